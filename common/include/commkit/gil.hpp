// commkit/gil.hpp -- releasing and taking back the GIL around native calls (pybind11 TUs only).
//
// Contract:
//   GilRelease           RAII: releases the GIL on construction, takes it back on destruction (as
//                        py::gil_scoped_release); py::call_guard<commkit::GilRelease>() for a bound call.
//   without_gil(f)       runs f() with the GIL released and returns its value. An exception of f is
//                        caught while the GIL is released and rethrown only once the GIL is back, so
//                        no C++ exception unwinds across the GIL hand-over.
//   without_gil<R>(f)    the same with another release type R (GatedGilRelease below).
//
// The exit gate, for modules whose calls block in threads that may outlive the interpreter (a daemon
// thread waiting in a native call when the program ends). Once the interpreter finalizes, CPython
// before 3.14 ends any other thread that waits for the GIL with pthread_exit, and its forced
// unwinding aborts the whole process (std::terminate) at the first C++ destructor or noexcept frame
// it meets. So no thread may wait for the GIL once the exit began:
//   install_exit_gate()  call once in the module's init: an atexit hook (which runs before the
//                        finalization) closes the gate, then (GIL released, at most 2 s) lets the
//                        threads already past it take the GIL and leave; a forked child starts with
//                        the gate open. Gate state is per extension module.
//   GatedGilRelease      as GilRelease, but behind a closed gate a thread that would take the GIL
//                        back parks until the process exits (what CPython 3.14 does with such
//                        threads): the call itself has returned, so whatever it released is free.
//   GatedGilAcquire      py::gil_scoped_acquire for a callback on a thread that released the GIL in a
//                        native call, unless the gate is closed: then held() is false and the GIL was
//                        not asked for (the callback must then not touch Python).
//   exit_gate_closed()   whether this thread must not wait for the GIL. The thread that runs the exit
//                        (and, as a fallback, whichever thread holds the GIL once the interpreter is
//                        finalizing) is never gated.
//   python_finalizing()  Py_IsFinalizing() on every supported Python version.
#pragma once

#include "commkit/impl/gil__funcs.hpp"
