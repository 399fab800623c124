// elastic_ep/csrc/bindings/runtime.cpp -- NCCL communicators, the GIN request and the Runtime (host/*.hpp)
// for Python. CUDA builds only. A launch takes its parameter block (params.cpp, filled by name) and
// stream handles; calls that wait release the GIL (commkit::without_gil).
#if COMMKIT_WITH_CUDA
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings/bindings.hpp"
#include "commkit/check.hpp"
#include "commkit/gil.hpp"
#include "host/comm.hpp"
#include "host/runtime.hpp"
#include "kernels/sizing.hpp"

namespace py = pybind11;

namespace elastic_ep::bindings {

namespace {

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

void bind_reports(py::module_& m) {
  py::class_<DispatchCounts>(m, "DispatchCounts", "What Runtime.wait_dispatch_counts found (host/runtime.hpp).")
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
}

void bind_options(py::module_& m) {
  py::class_<RuntimeOptions>(m, "RuntimeOptions", "Host-side settings of a Runtime (read by Python's _env.py).")
      .def(py::init<>())
      .def_readwrite("host_wait_yield_us", &RuntimeOptions::host_wait_yield_us)
      .def_readwrite("debug", &RuntimeOptions::debug)
      .def_readwrite("test_fail_release", &RuntimeOptions::test_fail_release)
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
}

}  // namespace

void bind_comm(py::module_& m) {
  m.def(
      "this_process", [] { return commkit::as_tuple(commkit::this_process()); },
      "(kernel boot id hash, PID-namespace inode, pid, start time) of this process, for Runtime.watch_peers.");
  m.def("nccl_version", &nccl_runtime_version, "NCCL_VERSION_CODE of the loaded libnccl");
  m.def("nccl_build_version", &nccl_build_version, "NCCL_VERSION_CODE of the headers at build time");
  m.def("get_local_nccl_unique_id", [] { return py::bytes(get_local_nccl_unique_id()); });
  m.def("create_nccl_comm", [](py::bytes id, int num_ranks, int rank) {
    std::string s = id;
    return commkit::without_gil([&] { return create_nccl_comm(s, num_ranks, rank); });
  });
  m.def("destroy_nccl_comm", &destroy_nccl_comm);
  m.def("nccl_comm_rank_size", &nccl_comm_rank_size);
  m.def("nccl_comm_gin_properties", &comm_gin_properties, py::arg("comm"),
        "(ginType, railedGinType, nLsaTeams) from ncclCommQueryProperties, or None below NCCL 2.29.");
  m.def(
      "devcomm_abi",
      [](int nccl_version, bool use_gin) {
        switch (devcomm_abi(nccl_version, use_gin)) {
          case DevcommAbi::kSame: return "same";
          case DevcommAbi::kLegacyLsaOnly: return "legacy_lsa_only";
          default: return "unsupported";
        }
      },
      py::arg("nccl_version"), py::arg("use_gin"),
      "How a device communicator is made with a libnccl of `nccl_version` (NCCL_VERSION_CODE) from the headers "
      "this extension was built with: 'same' layout, 'legacy_lsa_only' (2.28.x library, newer headers: LSA "
      "only, no GIN) or 'unsupported' (2.28.x headers on a 2.29+ library, or GIN across generations).");
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
      "connection: 0 none, 1 full, 2 rail). Host only: no NCCL call, in every CUDA build.");
}

void bind_runtime(py::module_& m) {
  bind_options(m);
  bind_reports(m);
  py::class_<Runtime>(m, "Runtime")
      .def(py::init([](int rank, int num_ranks, int64_t comm, int64_t num_buffer_bytes, int cpu_timeout,
                       int gpu_timeout, const RuntimeOptions& options) {
             return commkit::without_gil([&] {
               return new Runtime(rank, num_ranks, comm, num_buffer_bytes, cpu_timeout, gpu_timeout, options);
             });
           }),
           py::arg("rank"), py::arg("num_ranks"), py::arg("nccl_comm"), py::arg("num_buffer_bytes"),
           py::arg("num_cpu_timeout_secs"), py::arg("num_gpu_timeout_secs"), py::arg("options"))
      .def_static(
          "create_ipc",
          [](int rank, int num_ranks, int64_t num_buffer_bytes, int cpu_timeout, int gpu_timeout,
             const RuntimeOptions& options) {
            return commkit::without_gil([&] {
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
             commkit::without_gil([&] { r.open_ipc_peers(hs); });
           },
           py::arg("handles"))
      .def("destroy", [](Runtime& r) { commkit::without_gil([&] { r.destroy(); }); })
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
      .def("dispatch", &Runtime::dispatch, py::arg("params"), py::arg("stream"), py::arg("wait_stream") = kNoStream,
           "Notify (or, cached, the entry barrier) and the push; `params` carries the tensors' addresses.")
      .def("wait_dispatch_counts",
           [](Runtime& r, int n) { return commkit::without_gil([&] { return r.wait_dispatch_counts(n); }); },
           py::arg("num_local_experts"))
      .def("take_refusal", [](Runtime& r) { return commkit::without_gil([&] { return r.take_refusal(); }); })
      .def("take_masked_ids", &Runtime::take_masked_ids)
      .def(
          "watch_peers",
          [](Runtime& r, const std::vector<commkit::ProcessIdTuple>& ids, int period_ms) {
            r.watch_peers(commkit::process_ids(ids), period_ms);
          },
          py::arg("process_ids"), py::arg("period_ms"),
          "Watch the peers' processes on this host: process_ids[r] = rank r's this_process(); a dead one ends "
          "this rank's waits at once, reported by take_timeout (peer = that rank). period_ms 0: off.")
      .def_property_readonly("num_watched_peers", &Runtime::num_watched_peers)
      .def("take_geometry_mismatch", &Runtime::take_geometry_mismatch,
           "(peer, geometry word, the peer's word, this rank's word) of a dispatch notify refused for a peer's "
           "geometry, once; None when none is pending")
      .def("dispatch_epilogue", &Runtime::dispatch_epilogue, py::arg("params"), py::arg("stream"),
           py::arg("join_stream") = kNoStream,
           "The copy epilogue (hybrid mode: the forward kernel first); `params` carries the tensors' addresses.")
      .def("combine", &Runtime::combine, py::arg("params"), py::arg("stream"), py::arg("wait_event") = 0,
           py::arg("wait_stream") = kNoStream, py::arg("join_stream") = kNoStream,
           "Push then reduce; `params` carries the tensors' addresses.")
      .def(
          "pp_transfer",
          [](Runtime& r, bool send, uintptr_t x, int64_t nbytes, int peer, int64_t slot_bytes, int num_max_inflight,
             int num_sms, uint64_t numel, uint64_t dtype_code, uint64_t shape_word, int64_t stream) {
            PpParams p{reinterpret_cast<void*>(x), nbytes, slot_bytes, peer, num_max_inflight, num_sms,
                       numel, dtype_code, shape_word};
            r.pp_transfer(p, send, stream);
          },
          py::arg("send"), py::arg("x"), py::arg("nbytes"), py::arg("peer"), py::arg("slot_bytes"),
          py::arg("num_max_inflight"), py::arg("num_sms"), py::arg("numel"), py::arg("dtype_code"),
          py::arg("shape_word"), py::arg("stream"),
          "PP send (send=True: nbytes at x to peer) or receive (into x from peer), pp.cuh; x is a data pointer; "
          "numel, dtype_code and shape_word describe the tensor (a receive refuses a sender's other one).")
      .def("pp_refusals", [](Runtime& r) { return commkit::without_gil([&] { return r.pp_refusals(); }); },
           "(peer, k + 1, field, the peer's value, this rank's) per peer that refused this rank's tensor k "
           "(the last one; synchronises the device).")
      .def_property_readonly(
          "pp_max_inflight", [](const Runtime& r) { return kPpDescEntries / r.num_ranks(); },
          "Most PP tensors in flight per peer: the receivers' descriptor ring (kernels/pp.cuh).")
      .def("ll_dispatch", &Runtime::ll_dispatch, py::arg("params"), py::arg("stream"),
           "Low-latency dispatch, the phases params.phases names (kernels/ll_dispatch.cuh).")
      .def("ll_combine", &Runtime::ll_combine, py::arg("params"), py::arg("stream"),
           "Low-latency combine, the phases params.phases names (kernels/ll_combine.cuh).")
      .def("ll_clean", &Runtime::ll_clean, py::arg("stream"),
           "Zeroes the low-latency counters and signals on `stream` (clean_low_latency_buffer, between barriers).")
      .def("ll_set_mask", &Runtime::ll_set_mask, py::arg("rank"), py::arg("masked"), py::arg("stream"),
           "Shrink mode: masks (unmasks) `rank` in this rank's mask (synchronous).")
      .def("ll_clean_mask", &Runtime::ll_clean_mask, py::arg("stream"), "Shrink mode: unmasks every rank.")
      .def_property_readonly("ll_mask_address", &Runtime::ll_mask_address,
                             "Device address of the shrink mask, int32[num_ranks] (1 = masked).")
      .def("pp_unreceived", [](Runtime& r) { return commkit::without_gil([&] { return r.pp_unreceived(); }); },
           "Per source rank: PP tensors delivered to this rank and not received (synchronises the device).")
      .def("agrs_all_gather", &Runtime::agrs_all_gather, py::arg("srcs"), py::arg("nbytes"), py::arg("offsets"),
           py::arg("record"), py::arg("stream"),
           "One AGRS gather: copy-engine copies into every rank's region, then its signals; `record` (16 "
           "words, AgrsGatherParams) is compared with every peer's.")
      .def("agrs_session_end", &Runtime::agrs_session_end, py::arg("stream"),
           "Ends an AGRS session: count, signal and wait for every peer's end (agrs.cuh).")
      .def("scaleout_probe", &Runtime::scaleout_probe, py::arg("params"), py::arg("stream"),
           "One ring step of the scale-out transport (kernels/scaleout_probe.cuh).");
}

}  // namespace elastic_ep::bindings
#endif  // COMMKIT_WITH_CUDA
