// bindings.cpp -- the torch-free extension module ipc_all2all._C.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "a2a_geometry.hpp"
#include "a2a_types.hpp"
#include "commkit/check.hpp"
#include "commkit/python_errors.hpp"
#include "core.hpp"

namespace py = pybind11;

using ipc_all2all::Core;

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native core of ipc_all2all (raw pointers; use the ipc_all2all Python package).";
  commkit::register_python_errors(m);
  m.def("built_with_cuda", [] { return bool(COMMKIT_WITH_CUDA); });
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
  // Runs the kernel's addressing on the host for every (sender, target) pair: the same row_map and
  // offsets code as the GPU, bytes copied with memcpy. Every offset is bounds-checked, so a layout
  // bug surfaces as an exception instead of silent corruption. For CPU tests only.
  m.def(
      "simulate",
      [](int op, int world, int batch, int64_t x_rows, int64_t out_rows, int64_t cap_rows, int64_t chunk,
         int64_t wide, std::vector<int32_t> counts, std::vector<std::string> inputs, int64_t slot_bytes, int only_sender) {
        CK_CHECK_ARG(world >= 1 && world <= ipc_all2all::kMaxWorld, "bad world");
        CK_CHECK_ARG(static_cast<int>(counts.size()) == world && static_cast<int>(inputs.size()) == world,
                     "need one count and one input per rank");
        CK_CHECK_ARG(chunk > 0 && chunk % 16 == 0 && wide % 16 == 0, "chunk and wide must be multiples of 16");
        std::vector<std::string> slots(world, std::string(static_cast<size_t>(slot_bytes), '\0'));
        for (int q = 0; q < world; ++q) {
          if (only_sender >= 0 && q != only_sender) continue;
          const ipc_all2all::KernelArgs a =
              ipc_all2all::geometry_args(op, world, q, batch, x_rows, out_rows, cap_rows, chunk, wide);
          int64_t n[ipc_all2all::kMaxWorld], prefix[ipc_all2all::kMaxWorld + 1];
          ipc_all2all::resolve_counts(a, counts.data(), n, prefix);
          const std::string& x = inputs[q];
          for (int p = 0; p < world; ++p) {
            const ipc_all2all::RowMap m = ipc_all2all::row_map(a, n, prefix, p);
            const uint32_t total = m.total_vecs(batch);
            for (uint32_t v = 0; v < total; ++v) {
              uint64_t so, dof;
              m.offsets(v, so, dof);
              CK_CHECK(so + 16 <= x.size(), "source offset ", so, " beyond input of ", x.size(), " bytes (rank ", q,
                       " -> ", p, ")");
              CK_CHECK(dof + 16 <= slots[p].size(), "destination offset ", dof, " beyond slot of ", slots[p].size(),
                       " bytes (rank ", q, " -> ", p, ")");
              std::memcpy(&slots[p][dof], x.data() + so, 16);
            }
          }
        }
        py::list out;
        for (auto& s : slots) out.append(py::bytes(s));
        return out;
      },
      py::arg("op"), py::arg("world_size"), py::arg("batch"), py::arg("x_rows"), py::arg("out_rows"),
      py::arg("cap_rows"), py::arg("chunk_bytes"), py::arg("wide_bytes"), py::arg("counts"), py::arg("inputs"),
      py::arg("slot_bytes"), py::arg("only_sender") = -1);
  // The bound Core::launch enforces before every launch: the most bytes sender `rank` writes into
  // any target's slot. With device counts Core.launch passes cap_rows for every rank (the worst case).
  m.def(
      "slot_bytes_needed",
      [](int op, int world, int rank, int batch, int64_t x_rows, int64_t out_rows, int64_t cap_rows, int64_t chunk,
         int64_t wide, std::vector<int32_t> counts) {
        CK_CHECK_ARG(world >= 1 && world <= ipc_all2all::kMaxWorld && rank >= 0 && rank < world, "bad world/rank");
        CK_CHECK_ARG(static_cast<int>(counts.size()) == world, "need one count per rank");
        CK_CHECK_ARG(chunk > 0 && chunk % 16 == 0 && wide % 16 == 0, "chunk and wide must be multiples of 16");
        const ipc_all2all::KernelArgs a =
            ipc_all2all::geometry_args(op, world, rank, batch, x_rows, out_rows, cap_rows, chunk, wide);
        return ipc_all2all::slot_bytes_needed(a, counts.data());
      },
      py::arg("op"), py::arg("world_size"), py::arg("rank"), py::arg("batch"), py::arg("x_rows"),
      py::arg("out_rows"), py::arg("cap_rows"), py::arg("chunk_bytes"), py::arg("wide_bytes"), py::arg("counts"));
  m.def("op_name", [](uint32_t op) { return std::string(ipc_all2all::op_name(op)); });

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
      .def_property_readonly("broken", &Core::broken)
      .def_property_readonly("destroyed", &Core::destroyed)
      .def("slot_offset", &Core::slot_offset)
      .def("launch", &Core::launch, py::arg("op"), py::arg("x_ptr"), py::arg("stream"), py::arg("batch"),
           py::arg("x_rows"), py::arg("out_rows"), py::arg("cap_rows"), py::arg("chunk_bytes"),
           py::arg("wide_bytes"), py::arg("counts"), py::arg("counts_ptr"), py::arg("pack_head_dim") = 0)
      .def("fp8_unpack", &Core::fp8_unpack, py::arg("in_ptr"), py::arg("out_ptr"), py::arg("groups"),
           py::arg("head_dim"), py::arg("stream"))
      .def("check", &Core::check)
      .def("synchronize", &Core::synchronize, py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("set_timeout_seconds", &Core::set_timeout_seconds)
      .def_property_readonly("timeout_seconds", &Core::timeout_seconds)
      .def("set_grid", &Core::set_grid, py::arg("num_blocks"), py::arg("self_blocks") = 0)
      .def_property_readonly("grid", &Core::grid)
      .def("destroy", &Core::destroy, py::call_guard<py::gil_scoped_release>());
}
