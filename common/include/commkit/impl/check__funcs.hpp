// Helpers and macros of commkit/check.hpp. See that header for the contract.
#pragma once

#include <cerrno>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>

#include "commkit/impl/check__types.hpp"

namespace commkit {
namespace detail {

inline void stream_all(std::ostringstream&) {}
template <typename T, typename... Rest>
inline void stream_all(std::ostringstream& os, T&& first, Rest&&... rest) {
  os << std::forward<T>(first);
  stream_all(os, std::forward<Rest>(rest)...);
}

template <typename... Args>
inline std::string format(const char* file, int line, int rank, int peer, Args&&... args) {
  std::ostringstream os;
  stream_all(os, std::forward<Args>(args)...);
  if (rank != kUnknownRank) os << " [rank " << rank;
  if (peer != kUnknownRank) os << (rank != kUnknownRank ? ", peer " : " [peer ") << peer;
  if (rank != kUnknownRank || peer != kUnknownRank) os << "]";
  const char* base = std::strrchr(file, '/');
  os << " (" << (base ? base + 1 : file) << ":" << line << ")";
  return os.str();
}

template <typename E, typename... Args>
[[noreturn]] inline void raise(const char* file, int line, int rank, int peer, Args&&... args) {
  throw E(format(file, line, rank, peer, std::forward<Args>(args)...), file, line, rank, peer);
}

template <typename... Args>
[[noreturn]] inline void raise_timeout(const char* file, int line, const std::string& op, int rank,
                                       int peer, int64_t expected, int64_t observed,
                                       Args&&... extra) {
  std::string msg = format(file, line, rank, peer, op, " timed out: expected ", expected,
                           ", observed ", observed, std::forward<Args>(extra)...);
  throw TimeoutError(msg, file, line, op, rank, peer, expected, observed);
}

}  // namespace detail
}  // namespace commkit

#define CK_THROW(...) \
  ::commkit::detail::raise<::commkit::Error>(__FILE__, __LINE__, -1, -1, __VA_ARGS__)
#define CK_THROW_ARG(...) \
  ::commkit::detail::raise<::commkit::ValueError>(__FILE__, __LINE__, -1, -1, __VA_ARGS__)

#define CK_CHECK(cond, ...)                                   \
  do {                                                        \
    if (__builtin_expect(!(cond), 0)) CK_THROW(__VA_ARGS__); \
  } while (0)

#define CK_CHECK_ARG(cond, ...)                                   \
  do {                                                            \
    if (__builtin_expect(!(cond), 0)) CK_THROW_ARG(__VA_ARGS__); \
  } while (0)

#define CK_CHECK_RANK(cond, rank, peer, ...)                                                 \
  do {                                                                                       \
    if (__builtin_expect(!(cond), 0))                                                        \
      ::commkit::detail::raise<::commkit::Error>(__FILE__, __LINE__, (rank), (peer), __VA_ARGS__); \
  } while (0)

#define CK_THROW_TIMEOUT(op, rank, peer, expected, observed, ...)                          \
  ::commkit::detail::raise_timeout(__FILE__, __LINE__, (op), (rank), (peer), (expected), \
                                   (observed), ##__VA_ARGS__)

#define CK_SYS_CHECK(expr)                                                             \
  do {                                                                                 \
    if ((expr) < 0) {                                                                  \
      int ck_errno_ = errno;                                                           \
      CK_THROW(#expr, " failed: ", std::strerror(ck_errno_), " (errno ", ck_errno_, ")"); \
    }                                                                                  \
  } while (0)

// Expands only where used, so the including TU must have cuda_runtime.h.
#define CK_CUDA_CHECK(expr)                                                                   \
  do {                                                                                        \
    cudaError_t ck_err_ = (expr);                                                             \
    if (ck_err_ != cudaSuccess) {                                                             \
      (void)cudaGetLastError();                                                               \
      CK_THROW(#expr, " failed: ", cudaGetErrorName(ck_err_), ": ", cudaGetErrorString(ck_err_)); \
    }                                                                                         \
  } while (0)

// Expands only where used, so the including TU must have nccl.h.
#define CK_NCCL_CHECK(expr)                                                     \
  do {                                                                          \
    ncclResult_t ck_res_ = (expr);                                              \
    if (ck_res_ != ncclSuccess) {                                               \
      CK_THROW(#expr, " failed: ", ncclGetErrorString(ck_res_), " (ncclResult ", \
               static_cast<int>(ck_res_), ")");                                 \
    }                                                                           \
  } while (0)
