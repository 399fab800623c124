// bindings.cpp -- the torch-free extension module ipc_all2all._C.
#include <pybind11/pybind11.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <functional>

#include "a2a_types.hpp"
#include "commkit/check.hpp"
#include "commkit/gil.hpp"
#include "commkit/python_errors.hpp"
#include "core.hpp"
#include "host_replay.hpp"

namespace py = pybind11;

using ipc_all2all::Core;

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native core of ipc_all2all (raw pointers; use the ipc_all2all Python package).";
  commkit::register_python_errors(m);
  m.def("built_with_cuda", [] { return bool(COMMKIT_WITH_CUDA); });
  m.def(
      "this_process", [] { return commkit::as_tuple(commkit::this_process()); },
      "(kernel boot id hash, PID-namespace inode, pid, start time) of this process, for Core.watch_peers.");
  m.attr("FP8_RECORD_PAD") = ipc_all2all::kFp8RecordPad;
  m.attr("MAX_WORLD_SIZE") = ipc_all2all::kMaxWorld;
  m.attr("NUM_SLOTS") = ipc_all2all::kNumSlots;
  m.attr("THREADS_PER_BLOCK") = ipc_all2all::kThreads;
  m.attr("OP_SEND_RECV_HEADS") = int(ipc_all2all::kSendRecvHeads);
  m.attr("OP_GATHER_HEADS") = int(ipc_all2all::kGatherHeads);
  m.attr("OP_ALLGATHER") = int(ipc_all2all::kAllGather);

  m.def(
      "buffer_layout",
      [](uint64_t capacity) {
        auto l = ipc_all2all::buffer_layout(capacity);
        py::dict d;
        d["signals"] = py::make_tuple(l.signals.offset, l.signals.bytes);
        d["slots"] = py::make_tuple(py::make_tuple(l.slot[0].offset, l.slot[0].bytes),
                                    py::make_tuple(l.slot[1].offset, l.slot[1].bytes));
        d["total"] = l.total;
        return d;
      },
      py::arg("capacity"), "Offsets and sizes (bytes) of one rank's shared allocation.");
  m.def(
      "grid_plan",
      [](int num_blocks, int world, int self_blocks) {
        auto g = ipc_all2all::grid_plan(num_blocks, world, self_blocks);
        return py::make_tuple(g.total, g.self_blocks, g.per_peer);
      },
      py::arg("num_blocks"), py::arg("world_size"), py::arg("self_blocks") = 0,
      "(grid, blocks for the own rank, blocks per peer) of one launch.");
  // The kernel's addressing, bounds and words computed on the host (host_replay.hpp), for the CPU tests.
  m.def(
      "simulate",
      [](int op, int world, int batch, int64_t x_rows, int64_t out_rows, int64_t cap_rows, int64_t chunk,
         int64_t wide, const std::vector<int32_t>& counts, const std::vector<std::string>& inputs, int64_t slot_bytes,
         int only_sender) {
        py::list out;
        for (const auto& s : ipc_all2all::simulate(op, world, batch, x_rows, out_rows, cap_rows, chunk, wide, counts,
                                                   inputs, slot_bytes, only_sender))
          out.append(py::bytes(s));
        return out;
      },
      py::arg("op"), py::arg("world_size"), py::arg("batch"), py::arg("x_rows"), py::arg("out_rows"),
      py::arg("cap_rows"), py::arg("chunk_bytes"), py::arg("wide_bytes"), py::arg("counts"), py::arg("inputs"),
      py::arg("slot_bytes"), py::arg("only_sender") = -1);
  m.def("slot_bytes_needed", &ipc_all2all::sender_slot_bytes, py::arg("op"), py::arg("world_size"), py::arg("rank"),
        py::arg("batch"), py::arg("x_rows"), py::arg("out_rows"), py::arg("cap_rows"), py::arg("chunk_bytes"),
        py::arg("wide_bytes"), py::arg("counts"));
  m.def("op_name", [](uint32_t op) { return std::string(ipc_all2all::op_name(op)); });
  m.attr("PHASE_ENTRY") = int(ipc_all2all::kPhaseEntry);
  m.attr("PHASE_COMPLETION") = int(ipc_all2all::kPhaseCompletion);
  m.attr("PHASE_MISMATCH") = int(ipc_all2all::kPhaseMismatch);
  m.attr("PHASE_BROKEN") = int(ipc_all2all::kPhaseBroken);
  // The handshake word, the failure mark and the kernel's entry-post rule (a2a_types.hpp), for the CPU
  // tests and the protocol model (tests/ipc_all2all/test_protocol_model.py decides with the kernel's own rule).
  m.def("ready_word", &ipc_all2all::call_ready_word, py::arg("op"), py::arg("world_size"), py::arg("batch"),
        py::arg("out_rows"), py::arg("cap_rows"), py::arg("chunk_bytes"), py::arg("wide_bytes"),
        py::arg("pack_head_dim"), py::arg("slot"), py::arg("counts"), py::arg("call"));
  m.def("broken_word", &ipc_all2all::checked_broken_word, py::arg("call"), py::arg("rank"));
  m.def("broken_rank", &ipc_all2all::broken_rank, py::arg("word"));
  m.def(
      "entry_post_allowed",
      [](uint64_t broken, uint64_t call, int rank) { return ipc_all2all::entry_post_allowed(broken, call, rank); },
      py::arg("broken"), py::arg("call"), py::arg("rank"),
      "Whether block 0 of call `call` on `rank` posts its entry, given the broken word it finds.");
  // Core::set_timeout_seconds's, Core::set_grid's and the constructor's capacity checks, for the CPU tests and
  // the Python layer's argument checks.
  m.def("timeout_ns_from_seconds", &ipc_all2all::timeout_ns_from_seconds, py::arg("seconds"));
  m.def("check_grid_args", &ipc_all2all::check_grid_args, py::arg("world_size"), py::arg("num_blocks"),
        py::arg("self_blocks"));
  m.def("check_capacity_bytes", &ipc_all2all::check_capacity_bytes, py::arg("capacity_bytes"));
  // The message the host raises for a device-side record (timeouts raise CommTimeoutError with it).
  m.def("failure_message", &ipc_all2all::record_message, py::arg("op"), py::arg("rank"), py::arg("peer"),
        py::arg("expected"), py::arg("observed"));
  // Core::check's reading of the failure record (failure_record.hpp), for the CPU tests: `record_ptr`
  // is the address of a 64-byte commkit::TimeoutRecord in host memory, `between` (or None) runs
  // between the reader's two copies of its fields. Returns (state, op, rank, peer, expected,
  // observed, why), state one of "clear", "pending", "ready", "malformed".
  m.def(
      "read_failure_record",
      [](uint64_t record_ptr, int world, int rank, int tries, py::object between) {
        CK_CHECK_ARG(record_ptr != 0 && record_ptr % alignof(commkit::TimeoutRecord) == 0,
                     "record_ptr must be a non-null address aligned to ", alignof(commkit::TimeoutRecord));
        CK_CHECK_ARG(tries > 0, "tries must be positive, got ", tries);
        std::function<void()> cb;
        if (!between.is_none()) cb = [&between] { between(); };
        const auto got = ipc_all2all::read_failure_record(
            reinterpret_cast<const commkit::TimeoutRecord*>(record_ptr), world, rank, tries, cb);
        static const char* names[] = {"clear", "pending", "ready", "malformed"};
        const auto& r = got.rec;
        return py::make_tuple(names[int(got.state)], r.op, r.rank, r.peer, r.expected, r.observed, got.why);
      },
      py::arg("record_ptr"), py::arg("world_size"), py::arg("rank"), py::arg("tries") = 100000,
      py::arg("between") = py::none());
  m.def(
      "clear_failure_record",
      [](uint64_t record_ptr, py::object after_store) {
        CK_CHECK_ARG(record_ptr != 0 && record_ptr % alignof(commkit::TimeoutRecord) == 0,
                     "record_ptr must be a non-null address aligned to ", alignof(commkit::TimeoutRecord));
        const bool hook = !after_store.is_none();
        commkit::clear_timeout_record(reinterpret_cast<commkit::TimeoutRecord*>(record_ptr), [&] {
          if (hook) after_store();
        });
      },
      py::arg("record_ptr"), py::arg("after_store") = py::none(),
      "Core::check's clear of a record it read (commkit::clear_timeout_record); `after_store` (or None) runs "
      "after each of its stores.");
  m.attr("RECORD_FLAG_HOST_ABORT") = ipc_all2all::kFlagHostAbort;
  m.attr("OP_PEER_WATCH") = int(ipc_all2all::kPeerWatch);
  m.attr("DESTROY_TIMEOUT_SECONDS") = ipc_all2all::kDestroyTimeoutSeconds;
  // The handle format (handle_format, commkit/ipc_handle.hpp): sync()'s checks, testable without a GPU.
  m.attr("HANDLE_BYTES") = commkit::kDescribedIpcHandleBytes;
  m.def(
      "encode_handle",
      [](int world, int rank, uint64_t capacity, uint64_t buffer_bytes, const std::string& cuda_handle) {
        return py::bytes(commkit::describe_ipc_handle(
            ipc_all2all::handle_format(), commkit::IpcWindowInfo{world, rank, capacity, buffer_bytes}, cuda_handle));
      },
      py::arg("world_size"), py::arg("rank"), py::arg("capacity_bytes"), py::arg("buffer_bytes"),
      py::arg("cuda_handle"));
  m.def(
      "check_handles",
      [](const std::vector<std::string>& handles, int world, int rank, uint64_t capacity, uint64_t buffer_bytes,
         py::object own) {
        CK_CHECK_ARG(rank >= 0 && rank < world && static_cast<size_t>(rank) < handles.size(),
                     "sync(): expected one handle per rank, got ", handles.size());
        const std::string mine = own.is_none() ? handles[static_cast<size_t>(rank)] : own.cast<std::string>();
        py::list raw;
        for (const auto& h : commkit::check_described_ipc_handles(
                 ipc_all2all::handle_format(), handles, commkit::IpcWindowInfo{world, rank, capacity, buffer_bytes},
                 mine, "sync()"))
          raw.append(py::bytes(h));
        return raw;
      },
      py::arg("handles"), py::arg("world_size"), py::arg("rank"), py::arg("capacity_bytes"),
      py::arg("buffer_bytes"), py::arg("own") = py::none(),
      "sync()'s checks of every rank's handle (own: this rank's handle, default handles[rank]); returns the "
      "CUDA IPC handles.");

  py::class_<Core>(m, "Core")
      .def(py::init<int, int, int64_t, int, double>(), py::arg("rank"), py::arg("world_size"),
           py::arg("capacity_bytes"), py::arg("num_blocks"), py::arg("timeout_seconds"))
      .def("ipc_handle", [](const Core& c) { return py::bytes(c.ipc_handle()); })
      .def("open_peers", &Core::open_peers, py::arg("handles"))
      .def_property_readonly("opened", &Core::opened)
      .def_property_readonly("buffer_ptr", &Core::buffer_ptr)
      .def_property_readonly("buffer_bytes", &Core::buffer_bytes)
      .def_property_readonly("capacity", &Core::capacity)
      .def_property_readonly("device", &Core::device)
      .def_property_readonly("next_slot", &Core::next_slot)
      .def_property_readonly("calls", &Core::calls)
      .def_property_readonly("captured_calls", &Core::captured_calls)
      .def("slot_capture", &Core::slot_capture, py::arg("slot"))
      .def("capture_id", &Core::capture_id, py::arg("stream"))
      .def(
          "record_last_call",
          [](Core& c, int64_t stream, bool capturing) {
            c.record_last_call(reinterpret_cast<void*>(stream), capturing);
          },
          py::arg("stream"), py::arg("capturing"),
          "Moves the instance's ordering point to now on `stream`: after the caller's own read of the slot "
          "(copy_output), so a next call on another stream also waits for that read.")
      .def_property_readonly("broken", &Core::broken)
      .def_property_readonly("dead_peer", &Core::dead_peer, "the rank the peer watch found dead, or -1")
      .def_property_readonly("destroyed", &Core::destroyed)
      .def("slot_offset", &Core::slot_offset)
      .def("launch", &Core::launch, py::arg("op"), py::arg("x_ptr"), py::arg("stream"), py::arg("batch"),
           py::arg("x_rows"), py::arg("out_rows"), py::arg("cap_rows"), py::arg("chunk_bytes"),
           py::arg("wide_bytes"), py::arg("counts"), py::arg("counts_ptr"), py::arg("pack_head_dim") = 0)
      .def("fp8_unpack", &Core::fp8_unpack, py::arg("in_ptr"), py::arg("out_ptr"), py::arg("groups"),
           py::arg("head_dim"), py::arg("stream"))
      .def("check", &Core::check)
      .def(
          "watch_peers",
          [](Core& c, const std::vector<commkit::ProcessIdTuple>& ids, int period_ms) {
            c.watch_peers(commkit::process_ids(ids), period_ms);
          },
          py::arg("process_ids"), py::arg("period_ms"),
          "Watch the peers' processes on this host (process_ids[r] = rank r's this_process()); period_ms 0: off")
      .def("synchronize", &Core::synchronize, py::arg("stream"), py::call_guard<commkit::GilRelease>())
      .def("set_timeout_seconds", &Core::set_timeout_seconds)
      .def_property_readonly("timeout_seconds", &Core::timeout_seconds)
      .def("set_grid", &Core::set_grid, py::arg("num_blocks"), py::arg("self_blocks") = 0)
      .def_property_readonly("grid", &Core::grid)
      .def("destroy", &Core::destroy, py::arg("free_buffer") = true,
           py::arg("timeout_seconds") = ipc_all2all::kDestroyTimeoutSeconds, py::arg("collective") = false,
           py::call_guard<commkit::GilRelease>())
      .def("release_buffer", &Core::release_buffer);
}
