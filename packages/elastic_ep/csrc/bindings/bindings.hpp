// elastic_ep/csrc/bindings/bindings.hpp -- the areas of elastic_ep._C, one file each (module.cpp calls
// them in this order). Thin, typed bindings: the checks and the work are in host/ and kernels/.
//   bind_sizing    sizing.cpp   the buffer formulas and layouts (kernels/sizing.hpp), every build
//   bind_params    params.cpp   the kernels' parameter blocks, by member name (fields.hpp), every build
//   bind_comm      runtime.cpp  NCCL communicators and the GIN request (host/comm.hpp), CUDA builds
//   bind_runtime   runtime.cpp  RuntimeOptions, Runtime and what it reports (host/runtime.hpp), CUDA builds
//   bind_engram    engram.cpp   the Engram store (host/engram.hpp), CUDA builds
#pragma once

#include <pybind11/pybind11.h>

namespace elastic_ep::bindings {

void bind_sizing(pybind11::module_& m);
void bind_params(pybind11::module_& m);
#if COMMKIT_WITH_CUDA
void bind_comm(pybind11::module_& m);
void bind_runtime(pybind11::module_& m);
void bind_engram(pybind11::module_& m);
#endif

}  // namespace elastic_ep::bindings
