// elastic_ep/csrc/bindings/engram.cpp -- the Engram store (host/engram.hpp) for Python. CUDA builds only.
#if COMMKIT_WITH_CUDA
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings/bindings.hpp"
#include "commkit/gil.hpp"
#include "host/engram.hpp"

namespace py = pybind11;

namespace elastic_ep::bindings {

void bind_engram(py::module_& m) {
  py::class_<EngramStore>(m, "EngramStore", "Pinned shared host segments of the Engram shards (host/engram.hpp).")
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
      .def("close", [](EngramStore& e) { commkit::without_gil([&] { e.close(); }); });
}

}  // namespace elastic_ep::bindings
#endif  // COMMKIT_WITH_CUDA
