// bindings.cpp -- the torch-free extension module ipc_all2all._C.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "a2a_types.hpp"
#include "commkit/python_errors.hpp"
#include "core.hpp"

namespace py = pybind11;
using ipc_all2all::Core;

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native core of ipc_all2all (raw pointers; use the ipc_all2all Python package).";
  commkit::register_python_errors(m);
  m.def("built_with_cuda", [] { return bool(COMMKIT_WITH_CUDA); });
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
           py::arg("wide_bytes"), py::arg("counts"), py::arg("counts_ptr"))
      .def("check", &Core::check)
      .def("synchronize", &Core::synchronize, py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("set_timeout_seconds", &Core::set_timeout_seconds)
      .def_property_readonly("timeout_seconds", &Core::timeout_seconds)
      .def("set_grid", &Core::set_grid, py::arg("num_blocks"), py::arg("self_blocks") = 0)
      .def_property_readonly("grid", &Core::grid)
      .def("destroy", &Core::destroy, py::call_guard<py::gil_scoped_release>());
}
