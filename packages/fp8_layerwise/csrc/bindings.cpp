#include <pybind11/pybind11.h>
#include "commkit/python_errors.hpp"
namespace py = pybind11;
#if COMMKIT_WITH_CUDA
int launch_probe();
#endif
PYBIND11_MODULE(_C, m) {
  commkit::register_python_errors(m);
  m.def("built_with_cuda", [] { return bool(COMMKIT_WITH_CUDA); });
}
