// elastic_ep/csrc/bindings/sizing.cpp -- DeepEP V2's buffer formulas and the buffer's layouts
// (kernels/sizing.hpp, the one implementation), checked and bound for Python. Every build.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <utility>
#include <vector>

#include "bindings/bindings.hpp"
#include "commkit/check.hpp"
#include "kernels/geometry.hpp"
#include "kernels/launch.hpp"
#include "kernels/ll_sizing.hpp"
#include "kernels/sizing.hpp"

namespace py = pybind11;

namespace elastic_ep::bindings {

namespace {


// The sizing saturates at kSizeOverflow instead of wrapping (sizing.hpp): refuse it by name.
int64_t fits_int64(const char* what, int64_t bytes) {
  CK_CHECK_ARG(bytes != kSizeOverflow, what, ": these arguments ask for 2^63 bytes or more, more than any buffer can "
               "hold (the sizes are int64); check num_max_tokens_per_rank and hidden");
  return bytes;
}

int64_t dispatch_buffer_size_checked(int num_max_tokens_per_rank, int hidden, int num_sf_packs, int num_topk,
                                     int elem_size, int num_scaleout_ranks, int num_scaleup_ranks,
                                     bool is_scaleup_nvlink) {
  CK_CHECK_ARG(num_max_tokens_per_rank > 0 && hidden > 0 && num_sf_packs >= 0 && num_topk > 0 && elem_size > 0 &&
                   num_scaleout_ranks > 0 && num_scaleup_ranks > 0,
               "get_dispatch_buffer_size: every size must be positive (num_sf_packs >= 0)");
  CK_CHECK_ARG(num_topk <= kMaxTopk, "get_dispatch_buffer_size: num_topk must be at most ", kMaxTopk, ", got ",
               num_topk);
  return fits_int64("get_dispatch_buffer_size",
                    dispatch_buffer_size(num_max_tokens_per_rank, hidden, num_sf_packs, num_topk, elem_size,
                                         num_scaleout_ranks, num_scaleup_ranks, is_scaleup_nvlink));
}

int64_t combine_buffer_size_checked(int num_max_tokens_per_rank, int hidden, int num_topk, int num_scaleout_ranks,
                                    int num_scaleup_ranks, bool is_scaleup_nvlink, bool allow_multiple_reduction) {
  CK_CHECK_ARG(num_max_tokens_per_rank > 0 && hidden > 0 && num_topk > 0 && num_scaleout_ranks > 0 &&
                   num_scaleup_ranks > 0,
               "get_combine_buffer_size: every size must be positive");
  CK_CHECK_ARG(num_topk <= kMaxTopk, "get_combine_buffer_size: num_topk must be at most ", kMaxTopk, ", got ",
               num_topk);
  return fits_int64("get_combine_buffer_size",
                    combine_buffer_size(num_max_tokens_per_rank, hidden, num_topk, num_scaleout_ranks,
                                        num_scaleup_ranks, is_scaleup_nvlink, allow_multiple_reduction));
}

int64_t buffer_size_for_domain_checked(int num_max_tokens_per_rank, int hidden, int num_topk, bool use_fp8_dispatch,
                                       int num_scaleout_ranks, int num_scaleup_ranks, bool is_scaleup_nvlink,
                                       bool allow_multiple_reduction) {
  CK_CHECK_ARG(num_max_tokens_per_rank > 0, "num_max_tokens_per_rank must be positive, got ", num_max_tokens_per_rank);
  CK_CHECK_ARG(hidden > 0, "hidden must be positive, got ", hidden);
  CK_CHECK_ARG(int64_t(ceil_div(uint64_t(hidden), 32)) * 4 <= hidden, "hidden too small: the worst-case SF bytes (",
               ceil_div(uint64_t(hidden), 32) * 4, ") exceed the hidden bytes");
  CK_CHECK_ARG(num_topk >= 0 && num_topk <= kMaxTopk, "num_topk must be in [0, ", kMaxTopk, "], got ", num_topk);
  CK_CHECK_ARG(num_scaleout_ranks > 0 && num_scaleup_ranks > 0, "domain sizes must be positive");
  return fits_int64("calculate_buffer_size",
                    calculate_buffer_size(num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                          num_scaleout_ranks, num_scaleup_ranks, is_scaleup_nvlink,
                                          allow_multiple_reduction));
}

}  // namespace

void bind_sizing(py::module_& m) {
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_EXPERTS") = kMaxExperts;
  m.attr("MAX_LOCAL_EXPERTS") = kMaxLocalExperts;
  m.attr("MAX_TOPK") = kMaxTopk;
  m.attr("NUM_ALIGNED_SF_PACKS") = kNumAlignedSFPacks;
  m.attr("MAX_SF_PACKS") = kMaxSfPacks;
  m.attr("GEOMETRY_WORDS") = kGeometryWords;
  // The dispatch geometry words of a call (kernels/geometry.hpp), which _geometry.py must reproduce.
  m.def("dispatch_geometry_words", [](int64_t num_max_tokens_per_rank, int64_t hidden_bytes, int64_t num_experts,
                                      int64_t num_topk, int64_t num_sf_packs, int64_t expert_alignment,
                                      bool zero_copy) {
    std::vector<uint32_t> words;
    for (int w = 0; w < kGeometryWords; ++w)
      words.push_back(dispatch_geometry_value(w, num_max_tokens_per_rank, hidden_bytes, num_experts, num_topk,
                                              num_sf_packs, expert_alignment, zero_copy));
    return words;
  });
  m.def("get_elastic_buffer_alignment", [] { return kBufferAlignmentBytes; });
  // Low-latency mode (kernels/ll_sizing.hpp); the Python layer checked the arguments' ranges.
  m.attr("LL_MAX_TOPK") = kLowLatencyMaxTopk;
  m.attr("LL_MAX_TOKENS") = kLowLatencyMaxTokens;
  m.attr("LL_HIDDEN_ALIGN") = kLowLatencyHiddenAlign;
  m.attr("LL_MAX_LOCAL_EXPERTS") = kLowLatencyMaxLocalExperts;
  // PP descriptors and AGRS records (kernels/pp.cuh, agrs.cuh): the record's size and the report codes
  // the kernels send the host, which _peer_calls.py turns into errors.
  m.attr("AGRS_RECORD_WORDS") = kAgrsRecordWords;
  m.attr("REPORT_PP_FIELD") = kReportPpField;
  m.attr("REPORT_PP_TAG") = kReportPpTag;
  m.attr("REPORT_AGRS_TAG") = kReportAgrsTag;
  m.attr("REPORT_AGRS_WORD") = kReportAgrsWord;
  m.def("ll_size_hint", [](int64_t m_, int64_t hidden, int64_t num_experts) {
    CK_CHECK_ARG(m_ >= 0 && hidden >= 0 && num_experts >= 0, "ll_size_hint: sizes must be non-negative");
    return fits_int64("ll_size_hint", ll_size_hint(m_, hidden, num_experts));
  }, py::arg("num_max_tokens"), py::arg("hidden"), py::arg("num_experts"));
  m.def("ll_half_bytes", [](int64_t m_, int64_t hidden, int64_t num_experts, int64_t num_topk) {
    CK_CHECK_ARG(m_ >= 0 && hidden >= 0 && num_experts >= 0 && num_topk >= 0, "ll_half_bytes: sizes must be non-negative");
    return fits_int64("ll_half_bytes", ll_half_bytes(m_, hidden, num_experts, num_topk));
  }, py::arg("num_max_tokens"), py::arg("hidden"), py::arg("num_experts"), py::arg("num_topk"));
  m.def("dispatch_token_bytes", [](int64_t hidden, int64_t elem_size, int64_t num_sf_packs, int64_t num_topk) {
    CK_CHECK_ARG(hidden >= 0 && elem_size >= 0 && num_sf_packs >= 0 && num_topk >= 0,
                 "dispatch_token_bytes: sizes must be non-negative");
    return fits_int64("dispatch_token_bytes", sizing_detail::from_u64(
                                                  dispatch_token_layout(hidden, elem_size, num_sf_packs, num_topk).bytes));
  });
  m.def("dispatch_token_layout", [](int64_t hidden, int64_t elem_size, int64_t num_sf_packs, int64_t num_topk) {
    CK_CHECK_ARG(hidden >= 0 && elem_size >= 0 && num_sf_packs >= 0 && num_topk >= 0,
                 "dispatch_token_layout: sizes must be non-negative");
    auto t = dispatch_token_layout(hidden, elem_size, num_sf_packs, num_topk);
    py::dict d;
    auto reg = [](const commkit::Region& r) { return py::make_tuple(r.offset, r.bytes); };
    d["x"] = reg(t.x);
    d["sf"] = reg(t.sf);
    d["topk_idx"] = reg(t.topk_idx);
    d["topk_weights"] = reg(t.topk_weights);
    d["src_meta"] = reg(t.src_meta);
    d["bytes"] = t.bytes;
    return d;
  });
  m.def("combine_token_bytes", [](int64_t hidden, int64_t num_topk) {
    CK_CHECK_ARG(hidden >= 0 && num_topk >= 0, "combine_token_bytes: sizes must be non-negative");
    return fits_int64("combine_token_bytes", sizing_detail::from_u64(combine_token_layout(hidden, 2, num_topk).bytes));
  });
  m.def("get_dispatch_buffer_size", &dispatch_buffer_size_checked, py::arg("num_max_tokens_per_rank"),
        py::arg("hidden"), py::arg("num_sf_packs"), py::arg("num_topk"), py::arg("elem_size"),
        py::arg("num_scaleout_ranks"), py::arg("num_scaleup_ranks"), py::arg("is_scaleup_nvlink"));
  m.def("get_combine_buffer_size", &combine_buffer_size_checked, py::arg("num_max_tokens_per_rank"),
        py::arg("hidden"), py::arg("num_topk"), py::arg("num_scaleout_ranks"), py::arg("num_scaleup_ranks"),
        py::arg("is_scaleup_nvlink"), py::arg("allow_multiple_reduction"));
  m.def("calculate_buffer_size_for_domain", &buffer_size_for_domain_checked);
  m.def(
      "calculate_elastic_buffer_size",
      [](int num_ranks, int num_max_tokens_per_rank, int hidden, int num_topk, bool use_fp8_dispatch,
         bool allow_hybrid_mode, bool allow_multiple_reduction, int num_nvl_ranks) {
        CK_CHECK_ARG(num_ranks > 0 && num_nvl_ranks > 0, "num_ranks and num_nvl_ranks must be positive, got ",
                     num_ranks, " and ", num_nvl_ranks);
        CK_CHECK_ARG(num_ranks % num_nvl_ranks == 0, "num_ranks (", num_ranks, ") must be a multiple of num_nvl_ranks (",
                     num_nvl_ranks, "): every NVLink domain must hold the same number of ranks");
        const SizingDomain d = sizing_domain(num_ranks, num_nvl_ranks, allow_hybrid_mode);
        return buffer_size_for_domain_checked(num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                              int(d.num_scaleout_ranks), int(d.num_scaleup_ranks), d.is_scaleup_nvlink,
                                              allow_multiple_reduction);
      },
      py::arg("num_ranks"), py::arg("num_max_tokens_per_rank"), py::arg("hidden"), py::arg("num_topk"),
      py::arg("use_fp8_dispatch"), py::arg("allow_hybrid_mode"), py::arg("allow_multiple_reduction"),
      py::arg("num_nvl_ranks"),
      "DeepEP V2's calculate_buffer_size for num_ranks ranks in NVLink domains of num_nvl_ranks (2 MiB-aligned).");
  m.def("worst_case_num_recv_tokens", &worst_case_num_recv_tokens);
  m.def("worst_case_num_expanded_tokens", [](int64_t num_ranks, int64_t num_max_tokens_per_rank, int64_t num_topk,
                                             int64_t num_local_experts, int64_t expert_alignment) {
    CK_CHECK_ARG(num_ranks > 0 && num_max_tokens_per_rank >= 0 && num_topk >= 0 && num_local_experts >= 0 &&
                     expert_alignment > 0,
                 "worst_case_num_expanded_tokens: sizes must be non-negative and expert_alignment positive");
    return worst_case_num_expanded_tokens(num_ranks, num_max_tokens_per_rank, num_topk, num_local_experts,
                                          expert_alignment);
  });
  m.def("chunk_order", [](int num_ranks, int rank, const std::vector<int>& rows_per_source) {
    // The walk of the overlapped kernels (sizing.hpp), as (source, slot) pairs, invalid ones skipped.
    CK_CHECK_ARG(num_ranks >= 1 && rank >= 0 && rank < num_ranks && int(rows_per_source.size()) == num_ranks,
                 "chunk_order: bad rank / count arguments");
    int max_rows = 0;
    for (int n : rows_per_source) max_rows = n > max_rows ? n : max_rows;
    std::vector<std::pair<int, int>> out;
    for (int64_t v = 0; v < chunk_order_size(num_ranks, max_rows); ++v) {
      const ChunkPos pos = chunk_order_at(v, num_ranks, rank);
      if (pos.slot < rows_per_source[pos.source]) out.emplace_back(pos.source, pos.slot);
    }
    return out;
  });
  m.def("overlap_fits", [](int64_t num_ranks, int64_t num_max_tokens_per_rank) {
    return overlap_fits(num_ranks, num_max_tokens_per_rank);
  });
  m.def("workspace_bytes", [] { return int64_t(workspace_layout().bytes); });
  m.def(
      "pp_buffer_bytes",
      [](int64_t num_ranks, int64_t num_max_tensor_bytes, int64_t num_max_inflight) {
        CK_CHECK_ARG(num_ranks > 0 && num_max_tensor_bytes > 0 && num_max_inflight > 0,
                     "pp_buffer_bytes: sizes must be positive");
        return fits_int64("pp_buffer_bytes", pp_buffer_bytes(num_ranks, num_max_tensor_bytes, num_max_inflight));
      },
      py::arg("num_ranks"), py::arg("num_max_tensor_bytes"), py::arg("num_max_inflight"),
      "Bytes of the native runtime's PP receive slots: R x inflight x tensor bytes rounded up to 32.");
  m.def(
      "zero_copy_layout",
      [](int64_t buffer_bytes, int64_t num_ranks, int64_t num_max_tokens_per_rank, int64_t hidden, int64_t elem_size,
         int64_t num_sf_packs, int64_t num_topk, bool allow_multiple_reduction) {
        CK_CHECK_ARG(buffer_bytes >= 0 && num_ranks > 0 && num_max_tokens_per_rank > 0 && hidden > 0 && elem_size > 0 &&
                         num_sf_packs >= 0 && num_topk > 0 && num_topk <= kMaxTopk,
                     "zero_copy_layout: sizes must be positive (num_sf_packs >= 0, num_topk <= ", kMaxTopk, ")");
        const ZeroCopyLayout z = zero_copy_layout(buffer_bytes, num_ranks, num_max_tokens_per_rank, hidden, elem_size,
                                                  num_sf_packs, num_topk, allow_multiple_reduction);
        return std::make_pair(z.x_offset, fits_int64("zero_copy_layout", z.need_bytes));
      },
      py::arg("buffer_bytes"), py::arg("num_ranks"), py::arg("num_max_tokens_per_rank"), py::arg("hidden"),
      py::arg("elem_size"), py::arg("num_sf_packs"), py::arg("num_topk"), py::arg("allow_multiple_reduction"),
      "Zero-copy dispatch: (offset of the dense receive area in the buffer, or -1 when it does not fit; the "
      "smallest buffer size with room for it).");
}

}  // namespace elastic_ep::bindings
