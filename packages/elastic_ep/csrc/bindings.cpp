// elastic_ep._C -- torch-free bindings: sizing (always), NCCL set-up and kernels (CUDA builds).
// Python passes tensor.data_ptr() ints, sizes and stream handles; _low_level.py owns the tensors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <exception>
#include <optional>
#include <string>
#include <type_traits>

#include "commkit/check.hpp"
#include "commkit/python_errors.hpp"
#include "kernels.hpp"
#include "sizing.hpp"
#if COMMKIT_WITH_CUDA
#include "runtime.hpp"
#endif

namespace py = pybind11;
using namespace elastic_ep;

namespace {

// The sizing saturates at kSizeOverflow instead of wrapping (sizing.hpp): refuse it by name.
int64_t fits_int64(const char* what, int64_t bytes) {
  CK_CHECK_ARG(bytes != kSizeOverflow, what, ": these arguments ask for 2^63 bytes or more, more than any buffer can "
               "hold (the sizes are int64); check num_max_tokens_per_rank and hidden");
  return bytes;
}

// Kernel parameter blocks come from Python as dicts of ints; a missing key is a programming error.
int64_t get_i(const py::dict& d, const char* key) {
  CK_CHECK(d.contains(key), "internal: parameter '", key, "' missing");
  py::object v = d[key];
  if (v.is_none()) return 0;
  return v.cast<int64_t>();
}
template <typename T>
T* get_p(const py::dict& d, const char* key) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(get_i(d, key)));
}

DispatchParams dispatch_params(const py::dict& d) {
  DispatchParams p{};
  p.x = get_p<const void>(d, "x");
  p.sf = get_p<const void>(d, "sf");
  p.sf_token_stride = get_i(d, "sf_token_stride");
  p.sf_hidden_stride = get_i(d, "sf_hidden_stride");
  p.topk_idx = get_p<const int64_t>(d, "topk_idx");
  p.topk_weights = get_p<const float>(d, "topk_weights");
  p.copied_topk_idx = get_p<int64_t>(d, "copied_topk_idx");
  p.cumulative_stats = get_p<int>(d, "cumulative_stats");
  p.psum_rank = get_p<int>(d, "psum_rank");
  p.psum_expert = get_p<int>(d, "psum_expert");
  p.unaligned_expert = get_p<int>(d, "unaligned_expert");
  p.slot_idx = get_p<int>(d, "slot_idx");
  p.num_tokens = int(get_i(d, "num_tokens"));
  p.num_max_tokens_per_rank = int(get_i(d, "num_max_tokens_per_rank"));
  p.hidden_bytes = int(get_i(d, "hidden_bytes"));
  p.num_sf_packs = int(get_i(d, "num_sf_packs"));
  p.num_experts = int(get_i(d, "num_experts"));
  p.num_topk = int(get_i(d, "num_topk"));
  p.expert_alignment = int(get_i(d, "expert_alignment"));
  p.cached = int(get_i(d, "cached"));
  p.num_sms = int(get_i(d, "num_sms"));
  p.refuse_bad_ids = int(get_i(d, "refuse_bad_ids"));
  p.overlap = int(get_i(d, "overlap"));
  p.concurrent_notify = int(get_i(d, "concurrent_notify"));
  return p;
}

EpilogueParams epilogue_params(const py::dict& d) {
  EpilogueParams p{};
  p.x = get_p<const void>(d, "x");
  p.sf = get_p<const void>(d, "sf");
  p.sf_token_stride = get_i(d, "sf_token_stride");
  p.sf_hidden_stride = get_i(d, "sf_hidden_stride");
  p.recv_x = get_p<void>(d, "recv_x");
  p.recv_sf = get_p<void>(d, "recv_sf");
  p.recv_sf_token_stride = get_i(d, "recv_sf_token_stride");
  p.recv_sf_hidden_stride = get_i(d, "recv_sf_hidden_stride");
  p.recv_topk_idx = get_p<int64_t>(d, "recv_topk_idx");
  p.recv_topk_weights = get_p<float>(d, "recv_topk_weights");
  p.recv_src_metadata = get_p<int>(d, "recv_src_metadata");
  p.psum_rank = get_p<const int>(d, "psum_rank");
  p.psum_expert = get_p<int>(d, "psum_expert");
  p.unaligned_expert = get_p<const int>(d, "unaligned_expert");
  p.num_max_tokens_per_rank = int(get_i(d, "num_max_tokens_per_rank"));
  p.hidden_bytes = int(get_i(d, "hidden_bytes"));
  p.num_sf_packs = int(get_i(d, "num_sf_packs"));
  p.num_experts = int(get_i(d, "num_experts"));
  p.num_topk = int(get_i(d, "num_topk"));
  p.expert_alignment = int(get_i(d, "expert_alignment"));
  p.do_expand = int(get_i(d, "do_expand"));
  p.cached = int(get_i(d, "cached"));
  p.do_zero_padding = int(get_i(d, "do_zero_padding"));
  p.num_sms = int(get_i(d, "num_sms"));
  p.overlap = int(get_i(d, "overlap"));
  return p;
}

CombineParams combine_params(const py::dict& d) {
  CombineParams p{};
  p.x = get_p<const void>(d, "x");
  p.topk_weights = get_p<const float>(d, "topk_weights");
  p.src_metadata = get_p<const int>(d, "src_metadata");
  p.psum_rank = get_p<const int>(d, "psum_rank");
  p.combined_topk_idx = get_p<const int64_t>(d, "combined_topk_idx");
  p.combined_x = get_p<void>(d, "combined_x");
  p.combined_topk_weights = get_p<float>(d, "combined_topk_weights");
  p.bias0 = get_p<const void>(d, "bias0");
  p.bias1 = get_p<const void>(d, "bias1");
  p.num_combined_tokens = int(get_i(d, "num_combined_tokens"));
  p.num_max_tokens_per_rank = int(get_i(d, "num_max_tokens_per_rank"));
  p.hidden = int(get_i(d, "hidden"));
  p.num_experts = int(get_i(d, "num_experts"));
  p.num_topk = int(get_i(d, "num_topk"));
  p.use_expanded_layout = int(get_i(d, "use_expanded_layout"));
  p.allow_multiple_reduction = int(get_i(d, "allow_multiple_reduction"));
  p.num_sms = int(get_i(d, "num_sms"));
  p.overlap_push_blocks = int(get_i(d, "overlap_push_blocks"));
  return p;
}

// Runs f with the GIL released and rethrows its exception only after the GIL is back, so no C++
// exception ever unwinds across the GIL hand-over.
template <typename F>
auto without_gil(F&& f) -> decltype(f()) {
  using Ret = decltype(f());
  std::exception_ptr err;
  if constexpr (std::is_void_v<Ret>) {
    {
      py::gil_scoped_release nogil;
      try {
        f();
      } catch (...) {
        err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
  } else {
    std::optional<Ret> out;
    {
      py::gil_scoped_release nogil;
      try {
        out.emplace(f());
      } catch (...) {
        err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
    return std::move(*out);
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "elastic_ep native core (torch-free; see elastic_ep._low_level)";
  commkit::register_python_errors(m);
  m.def("built_with_cuda", [] { return bool(COMMKIT_WITH_CUDA); });
#ifdef COMMKIT_BUILD_NCCL_VERSION_CODE
  m.attr("BUILD_NCCL_VERSION_CODE") = int(COMMKIT_BUILD_NCCL_VERSION_CODE);
#else
  m.attr("BUILD_NCCL_VERSION_CODE") = 0;
#endif
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_EXPERTS") = kMaxExperts;
  m.attr("MAX_LOCAL_EXPERTS") = kMaxLocalExperts;
  m.attr("MAX_TOPK") = kMaxTopk;
  m.attr("NUM_ALIGNED_SF_PACKS") = kNumAlignedSFPacks;
  m.def("get_elastic_buffer_alignment", [] { return kBufferAlignmentBytes; });

  // Sizing: pure functions of the shapes (the CPU suite checks them).
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
  m.def("get_dispatch_buffer_size",
        [](int num_max_tokens_per_rank, int hidden, int num_sf_packs, int num_topk, int elem_size,
           int num_scaleout_ranks, int num_scaleup_ranks, bool is_scaleup_nvlink) {
          CK_CHECK_ARG(num_max_tokens_per_rank > 0 && hidden > 0 && num_sf_packs >= 0 && num_topk > 0 &&
                           elem_size > 0 && num_scaleout_ranks > 0 && num_scaleup_ranks > 0,
                       "get_dispatch_buffer_size: every size must be positive (num_sf_packs >= 0)");
          CK_CHECK_ARG(num_topk <= kMaxTopk, "get_dispatch_buffer_size: num_topk must be at most ", kMaxTopk,
                       ", got ", num_topk);
          return fits_int64("get_dispatch_buffer_size",
                            dispatch_buffer_size(num_max_tokens_per_rank, hidden, num_sf_packs, num_topk, elem_size,
                                                 num_scaleout_ranks, num_scaleup_ranks, is_scaleup_nvlink));
        });
  m.def("get_combine_buffer_size",
        [](int num_max_tokens_per_rank, int hidden, int num_topk, int num_scaleout_ranks, int num_scaleup_ranks,
           bool is_scaleup_nvlink, bool allow_multiple_reduction) {
          CK_CHECK_ARG(num_max_tokens_per_rank > 0 && hidden > 0 && num_topk > 0 && num_scaleout_ranks > 0 &&
                           num_scaleup_ranks > 0,
                       "get_combine_buffer_size: every size must be positive");
          CK_CHECK_ARG(num_topk <= kMaxTopk, "get_combine_buffer_size: num_topk must be at most ", kMaxTopk,
                       ", got ", num_topk);
          return fits_int64("get_combine_buffer_size",
                            combine_buffer_size(num_max_tokens_per_rank, hidden, num_topk, num_scaleout_ranks,
                                                num_scaleup_ranks, is_scaleup_nvlink, allow_multiple_reduction));
        });
  m.def("calculate_buffer_size_for_domain",
        [](int num_max_tokens_per_rank, int hidden, int num_topk, bool use_fp8_dispatch, int num_scaleout_ranks,
           int num_scaleup_ranks, bool is_scaleup_nvlink, bool allow_multiple_reduction) {
          CK_CHECK_ARG(num_max_tokens_per_rank > 0, "num_max_tokens_per_rank must be positive, got ",
                       num_max_tokens_per_rank);
          CK_CHECK_ARG(hidden > 0, "hidden must be positive, got ", hidden);
          CK_CHECK_ARG(int64_t(ceil_div(uint64_t(hidden), 32)) * 4 <= hidden,
                       "hidden too small: the worst-case SF bytes (", ceil_div(uint64_t(hidden), 32) * 4,
                       ") exceed the hidden bytes");
          CK_CHECK_ARG(num_topk >= 0 && num_topk <= kMaxTopk, "num_topk must be in [0, ", kMaxTopk, "], got ",
                       num_topk);
          CK_CHECK_ARG(num_scaleout_ranks > 0 && num_scaleup_ranks > 0, "domain sizes must be positive");
          return fits_int64("calculate_buffer_size",
                            calculate_buffer_size(num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                                  num_scaleout_ranks, num_scaleup_ranks, is_scaleup_nvlink,
                                                  allow_multiple_reduction));
        });
  m.def("worst_case_num_recv_tokens", &worst_case_num_recv_tokens);
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
  m.def("worst_case_num_expanded_tokens", &worst_case_num_expanded_tokens);
  m.def("workspace_bytes", [] { return int64_t(workspace_layout().bytes); });

#if COMMKIT_WITH_CUDA
  m.def("nccl_version", &nccl_runtime_version, "NCCL_VERSION_CODE of the loaded libnccl");
  m.def("nccl_build_version", &nccl_build_version, "NCCL_VERSION_CODE of the headers at build time");
  m.def("get_local_nccl_unique_id", [] { return py::bytes(get_local_nccl_unique_id()); });
  m.def("create_nccl_comm", [](py::bytes id, int num_ranks, int rank) {
    std::string s = id;
    return without_gil([&] { return create_nccl_comm(s, num_ranks, rank); });
  });
  m.def("destroy_nccl_comm", &destroy_nccl_comm);
  m.def("nccl_comm_rank_size", &nccl_comm_rank_size);

  py::class_<Runtime>(m, "Runtime")
      .def(py::init([](int rank, int num_ranks, int64_t comm, int64_t num_buffer_bytes, int cpu_timeout,
                       int gpu_timeout) {
             return without_gil(
                 [&] { return new Runtime(rank, num_ranks, comm, num_buffer_bytes, cpu_timeout, gpu_timeout); });
           }),
           py::arg("rank"), py::arg("num_ranks"), py::arg("nccl_comm"), py::arg("num_buffer_bytes"),
           py::arg("num_cpu_timeout_secs"), py::arg("num_gpu_timeout_secs"))
      .def_static(
          "create_ipc",
          [](int rank, int num_ranks, int64_t num_buffer_bytes, int cpu_timeout, int gpu_timeout) {
            return without_gil([&] {
              return new Runtime(Runtime::Ipc{}, rank, num_ranks, num_buffer_bytes, cpu_timeout, gpu_timeout);
            });
          },
          py::arg("rank"), py::arg("num_ranks"), py::arg("num_buffer_bytes"), py::arg("num_cpu_timeout_secs"),
          py::arg("num_gpu_timeout_secs"), py::return_value_policy::take_ownership,
          "A runtime on a CUDA-IPC window (no NCCL); usable after open_ipc_peers().")
      .def_property_readonly("ipc", &Runtime::ipc)
      .def("ipc_handle", [](const Runtime& r) { return py::bytes(r.ipc_handle()); })
      .def("open_ipc_peers",
           [](Runtime& r, const std::vector<py::bytes>& handles) {
             std::vector<std::string> hs(handles.begin(), handles.end());
             without_gil([&] { r.open_ipc_peers(hs); });
           },
           py::arg("handles"))
      .def("destroy", [](Runtime& r) { without_gil([&] { r.destroy(); }); })
      .def_property_readonly("destroyed", &Runtime::destroyed)
      .def_property_readonly("rank", &Runtime::rank)
      .def_property_readonly("num_ranks", &Runtime::num_ranks)
      .def_property_readonly("lsa_size", &Runtime::lsa_size)
      .def_property_readonly("device", &Runtime::device)
      .def_property_readonly("num_device_sms", &Runtime::num_device_sms)
      .def_property_readonly("num_buffer_bytes", &Runtime::num_buffer_bytes)
      .def_property_readonly("buffer_ptr", &Runtime::buffer_ptr)
      .def("check_healthy", &Runtime::check_healthy)
      .def("take_timeout",
           [](Runtime& r) -> py::object {
             auto t = r.take_timeout();
             if (!t.expired) return py::none();
             py::dict d;
             d["operation"] = t.operation;
             d["rank"] = t.rank;
             d["peer"] = t.peer;
             d["expected"] = t.expected;
             d["observed"] = t.observed;
             d["waited_ms"] = t.waited_ms;
             d["channel"] = t.channel;
             return std::move(d);
           })
      .def("pending_health", &Runtime::pending_health)
      .def_property_readonly("broken", &Runtime::broken)
      .def_property_readonly("broken_reason", &Runtime::broken_reason)
      .def("mark_broken", &Runtime::mark_broken, py::arg("reason"))
      .def("debug_seed_epoch", &Runtime::debug_seed_epoch, py::arg("last_epoch"))
      .def("barrier", &Runtime::barrier, py::arg("stream"))
      .def("dispatch",
           [](Runtime& r, const py::dict& d, int64_t stream, int64_t wait_stream) {
             r.dispatch(dispatch_params(d), stream, wait_stream);
           },
           py::arg("params"), py::arg("stream"), py::arg("wait_stream") = kNoStream)
      .def("wait_dispatch_counts",
           [](Runtime& r, int n) { return without_gil([&] { return r.wait_dispatch_counts(n); }); },
           py::arg("num_local_experts"))
      .def("take_refusal", [](Runtime& r) { return without_gil([&] { return r.take_refusal(); }); })
      .def("take_masked_ids", &Runtime::take_masked_ids)
      .def("dispatch_epilogue",
           [](Runtime& r, const py::dict& d, int64_t stream, int64_t join_stream) {
             r.dispatch_epilogue(epilogue_params(d), stream, join_stream);
           },
           py::arg("params"), py::arg("stream"), py::arg("join_stream") = kNoStream)
      .def("combine",
           [](Runtime& r, const py::dict& d, int64_t stream, uint64_t wait_event, int64_t wait_stream,
              int64_t join_stream) { r.combine(combine_params(d), stream, wait_event, wait_stream, join_stream); },
           py::arg("params"), py::arg("stream"), py::arg("wait_event") = 0, py::arg("wait_stream") = kNoStream,
           py::arg("join_stream") = kNoStream);
#endif
}
