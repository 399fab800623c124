// commkit/check.hpp -- errors that reach Python as exceptions, never abort().
//
// Contract:
//   * Every failure on the host is a C++ exception derived from commkit::Error. It carries the
//     source location (file:line), and, where known, the rank and the peer involved.
//   * commkit::ValueError   -- a bad argument; bindings translate it to Python ValueError.
//   * commkit::TimeoutError -- a deadline expired; carries operation, rank, peer, expected and
//                              observed values; bindings translate it to a TimeoutError subclass.
//   * commkit::Error        -- anything else (CUDA/NCCL/system failure, protocol violation);
//                              bindings translate it to RuntimeError subclasses.
//   * Macros (all throw, none abort):
//       CK_CHECK(cond, msg...)          -> commkit::Error if !cond
//       CK_CHECK_ARG(cond, msg...)      -> commkit::ValueError if !cond
//       CK_THROW(msg...) / CK_THROW_ARG(msg...)
//       CK_CHECK_RANK(cond, rank, peer, msg...)   -> Error carrying rank and peer
//       CK_SYS_CHECK(expr)              -> Error with strerror(errno) when expr < 0
//       CK_CUDA_CHECK(expr)             -> Error with cudaGetErrorString (only when cuda_runtime is included)
//       CK_NCCL_CHECK(expr)             -> Error with ncclGetErrorString (only when nccl.h is included)
//     `msg...` is concatenated by commkit::str(): CK_CHECK(n > 0, "n must be positive, got ", n).
//     It takes strings, characters, integers, floats, pointers, enums and commkit::hex(v); no
//     iostreams are used (see impl/check__funcs.hpp for why).
//   * commkit::str(args...) builds a message the same way for code that formats its own.
//   * This header is host-only and free of torch and CUDA headers.
#pragma once

#include "commkit/impl/check__types.hpp"
#include "commkit/impl/check__funcs.hpp"
