// elastic_ep/csrc/bindings/module.cpp -- elastic_ep._C: torch-free bindings. Every build (host-only too):
// the sizing and the kernels' parameter blocks; CUDA builds add NCCL set-up, the Runtime and the Engram
// store (see bindings.hpp).
#include <pybind11/pybind11.h>

#include "bindings/bindings.hpp"
#include "commkit/python_errors.hpp"

PYBIND11_MODULE(_C, m) {
  namespace eb = elastic_ep::bindings;
  m.doc() = "elastic_ep native core (torch-free; see elastic_ep._native_runtime)";
  commkit::register_python_errors(m);
  m.def("built_with_cuda", [] { return bool(COMMKIT_WITH_CUDA); });
  m.def("built_with_gin", [] { return bool(ELASTIC_EP_WITH_GIN); },
        "Whether the GIN scale-out transport is compiled in (CMake option ELASTIC_EP_GIN).");
#ifdef COMMKIT_BUILD_NCCL_VERSION_CODE
  m.attr("BUILD_NCCL_VERSION_CODE") = int(COMMKIT_BUILD_NCCL_VERSION_CODE);
#else
  m.attr("BUILD_NCCL_VERSION_CODE") = 0;
#endif
  eb::bind_sizing(m);
  eb::bind_params(m);
#if COMMKIT_WITH_CUDA
  eb::bind_comm(m);
  eb::bind_runtime(m);
  eb::bind_engram(m);
#endif
}
