// commkit/python_errors.hpp -- maps commkit exceptions to Python exceptions (pybind11 TUs only).
//
// Contract:
//   commkit::register_python_errors(m) adds to module `m`:
//     CommError(RuntimeError)        for commkit::Error; attributes rank, peer
//     CommTimeoutError(TimeoutError) for commkit::TimeoutError; attributes operation, rank, peer,
//                                    expected, observed
//   and translates commkit::ValueError to the builtin ValueError. Packages may subclass these
//   Python types in their own Python code; the C++ side always raises these.
//   Every translated error but ValueError also carries `where` ("file.cpp:line", error_where(e)).
//
//   commkit::error_where(e) -> "file.cpp:line" of a commkit::Error's source location, for a package
//   that translates commkit errors to its own Python classes (keeping the same attributes).
//
//   The translator is module-local (pybind11::register_local_exception_translator): pybind11's
//   global translator list is shared by every extension in the process, so a global translator
//   from one package (or a test probe) would catch and re-type another package's exceptions.
//   Each extension therefore raises only its own CommError / CommTimeoutError classes.
#pragma once

#include <pybind11/pybind11.h>

#include <cstring>
#include <string>

#include "commkit/check.hpp"

namespace commkit {

inline std::string error_where(const Error& e) {
  const char* base = std::strrchr(e.file(), '/');
  return std::string(base ? base + 1 : e.file()) + ":" + std::to_string(e.line());
}

inline void register_python_errors(pybind11::module_& m) {
  namespace py = pybind11;
  static py::handle comm_error;
  static py::handle timeout_error;
  comm_error = py::exception<Error>(m, "CommError", PyExc_RuntimeError).release();
  timeout_error = py::exception<TimeoutError>(m, "CommTimeoutError", PyExc_TimeoutError).release();
  py::register_local_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    auto raise_with = [](py::handle type, const Error& e, py::dict attrs) {
      py::object exc = type(py::str(e.what()));
      attrs["rank"] = e.rank();
      attrs["peer"] = e.peer();
      attrs["where"] = py::str(error_where(e));
      for (auto item : attrs) py::setattr(exc, item.first, item.second);
      PyErr_SetObject(type.ptr(), exc.ptr());
    };
    try {
      std::rethrow_exception(p);
    } catch (const TimeoutError& e) {
      py::gil_scoped_acquire gil;
      py::dict attrs;
      attrs["operation"] = e.operation();
      attrs["expected"] = e.expected();
      attrs["observed"] = e.observed();
      raise_with(timeout_error, e, attrs);
    } catch (const ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const Error& e) {
      py::gil_scoped_acquire gil;
      raise_with(comm_error, e, py::dict());
    }
  });
}

}  // namespace commkit
