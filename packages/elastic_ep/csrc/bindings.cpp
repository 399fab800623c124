// elastic_ep._C -- torch-free bindings. Every build (host-only too): the sizing (sizing.hpp, the one
// implementation of DeepEP V2's buffer formulas) and the kernels' parameter blocks (kernels.hpp), as
// classes with named fields. CUDA builds add NCCL set-up and the Runtime, whose launches take a
// parameter block plus the tensors' pointers as typed arguments (_native_runtime.py owns the tensors).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <exception>
#include <optional>
#include <string>
#include <type_traits>

#include "commkit/check.hpp"
#include "commkit/python_errors.hpp"
#include "kernels.hpp"
#if COMMKIT_WITH_CUDA
#include "engram.hpp"
#endif
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

#if COMMKIT_WITH_CUDA
// A GIN device-communicator request from Python's arguments (_domains.gin_requirements).
GinRequest gin_request_of(int contexts, int signals, int queue_depth, int traffic_class, const std::string& connection,
                          bool exclusive) {
  CK_CHECK_ARG(connection == "rail" || connection == "full" || connection == "none",
               "connection: expected 'rail', 'full' or 'none', got '", connection, "'");
  CK_CHECK_ARG(contexts > 0 && signals > 0 && queue_depth > 0 && traffic_class >= 0,
               "a GIN request needs positive contexts, signals and queue depth and a traffic class >= 0, got ",
               contexts, ", ", signals, ", ", queue_depth, ", ", traffic_class);
  const int conn = connection == "rail" ? kGinRail : connection == "full" ? kGinFull : kGinNone;
  return GinRequest{contexts, signals, 0, queue_depth, traffic_class, conn, int(exclusive)};
}

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
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
#endif

void bind_sizing(py::module_& m) {
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_EXPERTS") = kMaxExperts;
  m.attr("MAX_LOCAL_EXPERTS") = kMaxLocalExperts;
  m.attr("MAX_TOPK") = kMaxTopk;
  m.attr("NUM_ALIGNED_SF_PACKS") = kNumAlignedSFPacks;
  m.def("get_elastic_buffer_alignment", [] { return kBufferAlignmentBytes; });
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

// The parameter blocks: named scalar fields (the pointers go to each launch as typed arguments).
void bind_params(py::module_& m) {
  py::class_<DispatchParams>(m, "DispatchParams", "Scalars of a dispatch's notify + push launch (kernels.hpp).")
      .def(py::init([] { return DispatchParams{}; }))
      .def_readwrite("sf_token_stride", &DispatchParams::sf_token_stride)
      .def_readwrite("sf_hidden_stride", &DispatchParams::sf_hidden_stride)
      .def_readwrite("num_tokens", &DispatchParams::num_tokens)
      .def_readwrite("num_max_tokens_per_rank", &DispatchParams::num_max_tokens_per_rank)
      .def_readwrite("hidden_bytes", &DispatchParams::hidden_bytes)
      .def_readwrite("num_sf_packs", &DispatchParams::num_sf_packs)
      .def_readwrite("num_experts", &DispatchParams::num_experts)
      .def_readwrite("num_topk", &DispatchParams::num_topk)
      .def_readwrite("expert_alignment", &DispatchParams::expert_alignment)
      .def_readwrite("cached", &DispatchParams::cached)
      .def_readwrite("num_sms", &DispatchParams::num_sms)
      .def_readwrite("notify_atomic_masks", &DispatchParams::notify_atomic_masks)
      .def_readwrite("refuse_bad_ids", &DispatchParams::refuse_bad_ids)
      .def_readwrite("overlap", &DispatchParams::overlap)
      .def_readwrite("concurrent_notify", &DispatchParams::concurrent_notify)
      .def_readwrite("zero_copy", &DispatchParams::zero_copy)
      .def_readwrite("zero_copy_x_offset", &DispatchParams::zero_copy_x_offset)
      .def_readwrite("test_drop_scaleout_signals", &DispatchParams::test_drop_scaleout_signals);
  py::class_<EpilogueParams>(m, "EpilogueParams", "Scalars of a dispatch's copy-epilogue launch (kernels.hpp).")
      .def(py::init([] { return EpilogueParams{}; }))
      .def_readwrite("sf_token_stride", &EpilogueParams::sf_token_stride)
      .def_readwrite("sf_hidden_stride", &EpilogueParams::sf_hidden_stride)
      .def_readwrite("num_max_tokens_per_rank", &EpilogueParams::num_max_tokens_per_rank)
      .def_readwrite("hidden_bytes", &EpilogueParams::hidden_bytes)
      .def_readwrite("num_sf_packs", &EpilogueParams::num_sf_packs)
      .def_readwrite("num_experts", &EpilogueParams::num_experts)
      .def_readwrite("num_topk", &EpilogueParams::num_topk)
      .def_readwrite("expert_alignment", &EpilogueParams::expert_alignment)
      .def_readwrite("do_expand", &EpilogueParams::do_expand)
      .def_readwrite("cached", &EpilogueParams::cached)
      .def_readwrite("do_zero_padding", &EpilogueParams::do_zero_padding)
      .def_readwrite("num_sms", &EpilogueParams::num_sms)
      .def_readwrite("overlap", &EpilogueParams::overlap)
      .def_readwrite("zero_copy", &EpilogueParams::zero_copy)
      ;
  py::class_<CombineParams>(m, "CombineParams", "Scalars of a combine's launches (kernels.hpp).")
      .def(py::init([] { return CombineParams{}; }))
      .def_readwrite("num_combined_tokens", &CombineParams::num_combined_tokens)
      .def_readwrite("num_max_tokens_per_rank", &CombineParams::num_max_tokens_per_rank)
      .def_readwrite("hidden", &CombineParams::hidden)
      .def_readwrite("num_experts", &CombineParams::num_experts)
      .def_readwrite("num_topk", &CombineParams::num_topk)
      .def_readwrite("use_expanded_layout", &CombineParams::use_expanded_layout)
      .def_readwrite("allow_multiple_reduction", &CombineParams::allow_multiple_reduction)
      .def_readwrite("num_sms", &CombineParams::num_sms)
      .def_readwrite("overlap_push_blocks", &CombineParams::overlap_push_blocks)
      ;
}

#if COMMKIT_WITH_CUDA
void bind_runtime(py::module_& m) {
  m.def("nccl_version", &nccl_runtime_version, "NCCL_VERSION_CODE of the loaded libnccl");
  m.def("nccl_build_version", &nccl_build_version, "NCCL_VERSION_CODE of the headers at build time");
  m.def("get_local_nccl_unique_id", [] { return py::bytes(get_local_nccl_unique_id()); });
  m.def("create_nccl_comm", [](py::bytes id, int num_ranks, int rank) {
    std::string s = id;
    return without_gil([&] { return create_nccl_comm(s, num_ranks, rank); });
  });
  m.def("destroy_nccl_comm", &destroy_nccl_comm);
  m.def("nccl_comm_rank_size", &nccl_comm_rank_size);
  m.def("nccl_comm_gin_properties", &comm_gin_properties, py::arg("comm"),
        "(ginType, railedGinType, nLsaTeams) from ncclCommQueryProperties, or None below NCCL 2.29.");
  m.def(
      "gin_devcomm_request",
      [](int contexts, int signals, int queue_depth, int traffic_class, const std::string& connection,
         bool exclusive) {
        const GinRequestApplied a =
            gin_request_applied(gin_request_of(contexts, signals, queue_depth, traffic_class, connection, exclusive));
        py::dict d;
        d["ginContextCount"] = a.contexts;
        d["ginSignalCount"] = a.signals;
        d["ginCounterCount"] = a.counters;
        d["ginQueueDepth"] = a.queue_depth;
        d["ginTrafficClass"] = a.traffic_class;
        d["ginConnectionType"] = a.connection;
        d["ginExclusiveContexts"] = a.exclusive;
        return d;
      },
      py::arg("contexts"), py::arg("signals"), py::arg("queue_depth"), py::arg("traffic_class"),
      py::arg("connection"), py::arg("exclusive"),
      "The GIN fields of ncclDevCommRequirements a device communicator would be created with for this "
      "request, as read back from the struct (-1: the headers the package was built with lack the field; "
      "connection: 0 none, 1 full, 2 rail). Host only: no NCCL call.");

  py::class_<RuntimeOptions>(m, "RuntimeOptions", "Host-side settings of a Runtime (read by Python's _env.py).")
      .def(py::init<>())
      .def_readwrite("host_wait_yield_us", &RuntimeOptions::host_wait_yield_us)
      .def_readwrite("debug", &RuntimeOptions::debug)
      .def_readwrite("num_scaleup_ranks", &RuntimeOptions::num_scaleup_ranks)
      .def_readonly("use_gin", &RuntimeOptions::use_gin)
      .def(
          "set_gin",
          [](RuntimeOptions& o, int contexts, int signals, int queue_depth, int traffic_class,
             const std::string& connection, bool exclusive) {
            o.gin = gin_request_of(contexts, signals, queue_depth, traffic_class, connection, exclusive);
            o.use_gin = true;
          },
          py::arg("contexts"), py::arg("signals"), py::arg("queue_depth"), py::arg("traffic_class"),
          py::arg("connection"), py::arg("exclusive"),
          "The scale-out transport is NCCL GIN with this device-communicator request (hybrid mode across "
          "NVLink domains; arguments as gin_devcomm_request).")
      .def_property_readonly("gin", [](const RuntimeOptions& o) {
        const GinRequest& g = o.gin;
        return py::make_tuple(g.contexts, g.signals, g.queue_depth, g.traffic_class, g.connection, bool(g.exclusive));
      }, "(contexts, signals, queue_depth, traffic_class, connection 0 none / 1 full / 2 rail, exclusive)");
  py::class_<DispatchCounts>(m, "DispatchCounts", "What Runtime.wait_dispatch_counts found (runtime.hpp).")
      .def_readonly("status", &DispatchCounts::status)
      .def_readonly("num_recv_tokens", &DispatchCounts::num_recv_tokens)
      .def_readonly("num_expanded_tokens", &DispatchCounts::num_expanded_tokens)
      .def_readonly("num_recv_tokens_per_expert", &DispatchCounts::num_recv_tokens_per_expert)
      .def_readonly("ranks_ready", &DispatchCounts::ranks_ready)
      .def_readonly("experts_ready", &DispatchCounts::experts_ready);
  py::class_<Runtime::TimeoutInfo>(m, "TimeoutInfo", "An expired device wait (Runtime.take_timeout).")
      .def_readonly("operation", &Runtime::TimeoutInfo::operation)
      .def_readonly("rank", &Runtime::TimeoutInfo::rank)
      .def_readonly("peer", &Runtime::TimeoutInfo::peer)
      .def_readonly("expected", &Runtime::TimeoutInfo::expected)
      .def_readonly("observed", &Runtime::TimeoutInfo::observed)
      .def_readonly("waited_ms", &Runtime::TimeoutInfo::waited_ms)
      .def_readonly("channel", &Runtime::TimeoutInfo::channel);

  py::class_<EngramStore>(m, "EngramStore", "Pinned shared host segments of the Engram shards (engram.hpp).")
      .def(py::init<int, int, int64_t>(), py::arg("rank"), py::arg("num_ranks"), py::arg("num_bytes"))
      .def_property_readonly("name", [](const EngramStore& e) { return py::bytes(e.name()); })
      .def_property_readonly("num_bytes", &EngramStore::num_bytes)
      .def(
          "attach",
          [](EngramStore& e, const std::vector<py::bytes>& names) {
            std::vector<std::string> v(names.begin(), names.end());
            e.attach(v);
          },
          py::arg("names"))
      .def("unlink", &EngramStore::unlink)
      .def("write", &EngramStore::write, py::arg("src"), py::arg("nbytes"), py::arg("stream"))
      .def("fetch", &EngramStore::fetch, py::arg("indices"), py::arg("num_indices"), py::arg("entries_per_rank"),
           py::arg("row_bytes"), py::arg("out"), py::arg("stream"))
      .def("close", [](EngramStore& e) { without_gil([&] { e.close(); }); });
  py::class_<Runtime>(m, "Runtime")
      .def(py::init([](int rank, int num_ranks, int64_t comm, int64_t num_buffer_bytes, int cpu_timeout,
                       int gpu_timeout, const RuntimeOptions& options) {
             return without_gil([&] {
               return new Runtime(rank, num_ranks, comm, num_buffer_bytes, cpu_timeout, gpu_timeout, options);
             });
           }),
           py::arg("rank"), py::arg("num_ranks"), py::arg("nccl_comm"), py::arg("num_buffer_bytes"),
           py::arg("num_cpu_timeout_secs"), py::arg("num_gpu_timeout_secs"), py::arg("options"))
      .def_static(
          "create_ipc",
          [](int rank, int num_ranks, int64_t num_buffer_bytes, int cpu_timeout, int gpu_timeout,
             const RuntimeOptions& options) {
            return without_gil([&] {
              return new Runtime(Runtime::Ipc{}, rank, num_ranks, num_buffer_bytes, cpu_timeout, gpu_timeout, options);
            });
          },
          py::arg("rank"), py::arg("num_ranks"), py::arg("num_buffer_bytes"), py::arg("num_cpu_timeout_secs"),
          py::arg("num_gpu_timeout_secs"), py::arg("options"), py::return_value_policy::take_ownership,
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
      .def_property_readonly("num_scaleup_ranks", &Runtime::num_scaleup_ranks)
      .def_property_readonly("gin", &Runtime::gin)
      .def_property_readonly("device", &Runtime::device)
      .def_property_readonly("num_device_sms", &Runtime::num_device_sms)
      .def_property_readonly("num_buffer_bytes", &Runtime::num_buffer_bytes)
      .def_property_readonly("buffer_ptr", &Runtime::buffer_ptr)
      .def("check_healthy", &Runtime::check_healthy)
      .def("take_timeout",
           [](Runtime& r) -> py::object {
             Runtime::TimeoutInfo t = r.take_timeout();
             if (!t.expired) return py::none();
             return py::cast(std::move(t));
           })
      .def("pending_health", &Runtime::pending_health)
      .def_property_readonly("broken", &Runtime::broken)
      .def_property_readonly("broken_reason", &Runtime::broken_reason)
      .def("mark_broken", &Runtime::mark_broken, py::arg("reason"))
      .def("debug_seed_epoch", &Runtime::debug_seed_epoch, py::arg("last_epoch"))
      .def("barrier", &Runtime::barrier, py::arg("stream"))
      .def(
          "dispatch",
          [](Runtime& r, const DispatchParams& plan, uintptr_t x, uintptr_t sf, uintptr_t topk_idx,
             uintptr_t topk_weights, uintptr_t copied_topk_idx, uintptr_t cumulative_stats, uintptr_t psum_rank,
             uintptr_t psum_expert, uintptr_t unaligned_expert, uintptr_t slot_idx, int64_t stream,
             int64_t wait_stream, uintptr_t direct_base, uintptr_t forward_dense) {
            DispatchParams p = plan;
            p.direct_base = ptr<int>(direct_base);
            p.forward_dense = ptr<int>(forward_dense);
            p.x = ptr<const void>(x);
            p.sf = ptr<const void>(sf);
            p.topk_idx = ptr<const int64_t>(topk_idx);
            p.topk_weights = ptr<const float>(topk_weights);
            p.copied_topk_idx = ptr<int64_t>(copied_topk_idx);
            p.cumulative_stats = ptr<int>(cumulative_stats);
            p.psum_rank = ptr<int>(psum_rank);
            p.psum_expert = ptr<int>(psum_expert);
            p.unaligned_expert = ptr<int>(unaligned_expert);
            p.slot_idx = ptr<int>(slot_idx);
            r.dispatch(p, stream, wait_stream);
          },
          py::arg("params"), py::arg("x"), py::arg("sf"), py::arg("topk_idx"), py::arg("topk_weights"),
          py::arg("copied_topk_idx"), py::arg("cumulative_stats"), py::arg("psum_rank"), py::arg("psum_expert"),
          py::arg("unaligned_expert"), py::arg("slot_idx"), py::arg("stream"), py::arg("wait_stream") = kNoStream,
          py::arg("direct_base") = 0, py::arg("forward_dense") = 0,
          "Notify (or, cached, the entry barrier) and the push; tensor arguments are data pointers (0: none).")
      .def(
          "pp_transfer",
          [](Runtime& r, bool send, uintptr_t x, int64_t nbytes, int peer, int64_t slot_bytes, int num_max_inflight,
             int num_sms, int64_t stream) {
            r.pp_transfer(PpParams{ptr<void>(x), nbytes, slot_bytes, peer, num_max_inflight, num_sms}, send, stream);
          },
          py::arg("send"), py::arg("x"), py::arg("nbytes"), py::arg("peer"), py::arg("slot_bytes"),
          py::arg("num_max_inflight"), py::arg("num_sms"), py::arg("stream"),
          "PP send (send=True: nbytes at x to peer) or receive (into x from peer), pp.cuh; x is a data pointer.")
      .def(
          "scaleout_probe",
          [](Runtime& r, int next, int prev, uint64_t src, uint64_t dst, uint64_t bytes, uint64_t round,
             int64_t stream) { r.scaleout_probe(ScaleoutProbeParams{next, prev, src, dst, bytes, round}, stream); },
          py::arg("next"), py::arg("prev"), py::arg("src"), py::arg("dst"), py::arg("bytes"), py::arg("round"),
          py::arg("stream"),
          "One ring step of the NVLink-emulated scale-out transport (kernels/scaleout_probe.cuh).")
      .def("agrs_all_gather", &Runtime::agrs_all_gather, py::arg("srcs"), py::arg("nbytes"), py::arg("offsets"),
           py::arg("stream"), "One AGRS gather: copy-engine copies into every rank's region, then its signals.")
      .def("pp_unreceived", [](Runtime& r) { return without_gil([&] { return r.pp_unreceived(); }); },
           "Per source rank: PP tensors delivered to this rank and not received (synchronises the device).")
      .def("agrs_session_end", &Runtime::agrs_session_end, py::arg("stream"),
           "Ends an AGRS session: count, signal and wait for every peer's end (agrs.cuh).")
      .def("wait_dispatch_counts",
           [](Runtime& r, int n) { return without_gil([&] { return r.wait_dispatch_counts(n); }); },
           py::arg("num_local_experts"))
      .def("take_refusal", [](Runtime& r) { return without_gil([&] { return r.take_refusal(); }); })
      .def("take_masked_ids", &Runtime::take_masked_ids)
      .def(
          "dispatch_epilogue",
          [](Runtime& r, const EpilogueParams& plan, uintptr_t x, uintptr_t sf, uintptr_t recv_x, uintptr_t recv_sf,
             int64_t recv_sf_token_stride, int64_t recv_sf_hidden_stride, uintptr_t recv_topk_idx,
             uintptr_t recv_topk_weights, uintptr_t recv_src_metadata, uintptr_t psum_rank, uintptr_t psum_expert,
             uintptr_t unaligned_expert, int64_t stream, int64_t join_stream, uintptr_t forward_dense) {
            EpilogueParams p = plan;
            p.forward_dense = ptr<int>(forward_dense);
            p.x = ptr<const void>(x);
            p.sf = ptr<const void>(sf);
            p.recv_x = ptr<void>(recv_x);
            p.recv_sf = ptr<void>(recv_sf);
            p.recv_sf_token_stride = recv_sf_token_stride;
            p.recv_sf_hidden_stride = recv_sf_hidden_stride;
            p.recv_topk_idx = ptr<int64_t>(recv_topk_idx);
            p.recv_topk_weights = ptr<float>(recv_topk_weights);
            p.recv_src_metadata = ptr<int>(recv_src_metadata);
            p.psum_rank = ptr<const int>(psum_rank);
            p.psum_expert = ptr<int>(psum_expert);
            p.unaligned_expert = ptr<const int>(unaligned_expert);
            r.dispatch_epilogue(p, stream, join_stream);
          },
          py::arg("params"), py::arg("x"), py::arg("sf"), py::arg("recv_x"), py::arg("recv_sf"),
          py::arg("recv_sf_token_stride"), py::arg("recv_sf_hidden_stride"), py::arg("recv_topk_idx"),
          py::arg("recv_topk_weights"), py::arg("recv_src_metadata"), py::arg("psum_rank"), py::arg("psum_expert"),
          py::arg("unaligned_expert"), py::arg("stream"), py::arg("join_stream") = kNoStream,
          py::arg("forward_dense") = 0,
          "The copy epilogue (hybrid mode: the forward kernel first); tensor arguments are data pointers (0: none).")
      .def(
          "combine",
          [](Runtime& r, const CombineParams& plan, uintptr_t x, uintptr_t topk_weights, uintptr_t src_metadata,
             uintptr_t psum_rank, uintptr_t combined_topk_idx, uintptr_t combined_x, uintptr_t combined_topk_weights,
             uintptr_t bias0, uintptr_t bias1, int64_t stream, uint64_t wait_event, int64_t wait_stream,
             int64_t join_stream) {
            CombineParams p = plan;
            p.x = ptr<const void>(x);
            p.topk_weights = ptr<const float>(topk_weights);
            p.src_metadata = ptr<const int>(src_metadata);
            p.psum_rank = ptr<const int>(psum_rank);
            p.combined_topk_idx = ptr<const int64_t>(combined_topk_idx);
            p.combined_x = ptr<void>(combined_x);
            p.combined_topk_weights = ptr<float>(combined_topk_weights);
            p.bias0 = ptr<const void>(bias0);
            p.bias1 = ptr<const void>(bias1);
            r.combine(p, stream, wait_event, wait_stream, join_stream);
          },
          py::arg("params"), py::arg("x"), py::arg("topk_weights"), py::arg("src_metadata"), py::arg("psum_rank"),
          py::arg("combined_topk_idx"), py::arg("combined_x"), py::arg("combined_topk_weights"), py::arg("bias0"),
          py::arg("bias1"), py::arg("stream"), py::arg("wait_event") = 0, py::arg("wait_stream") = kNoStream,
          py::arg("join_stream") = kNoStream, "Push then reduce; tensor arguments are data pointers (0: none).");
}
#endif

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "elastic_ep native core (torch-free; see elastic_ep._native_runtime)";
  commkit::register_python_errors(m);
  m.def("built_with_cuda", [] { return bool(COMMKIT_WITH_CUDA); });
#ifdef COMMKIT_BUILD_NCCL_VERSION_CODE
  m.attr("BUILD_NCCL_VERSION_CODE") = int(COMMKIT_BUILD_NCCL_VERSION_CODE);
#else
  m.attr("BUILD_NCCL_VERSION_CODE") = 0;
#endif
  bind_sizing(m);
  bind_params(m);
#if COMMKIT_WITH_CUDA
  bind_runtime(m);
#endif
}
