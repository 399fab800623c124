// Helpers and macros of commkit/check.hpp. See that header for the contract.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "commkit/impl/check__types.hpp"

namespace commkit {

// Hexadecimal rendering for str() / the check macros (no "0x" prefix).
struct Hex {
  uint64_t value;
};
inline Hex hex(uint64_t v) { return Hex{v}; }

namespace detail {

// Messages are built without iostreams: in a process where torch was imported first, our
// extension's std::ostream calls crashed (SIGSEGV in the num_put facet) on an H200 host
// (torch 2.11 exports its own copies of libstdc++ internals). std::to_string / snprintf do
// not touch locales.
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, std::string_view v) { s.append(v.data(), v.size()); }
inline void append(std::string& s, const char* v) { s += v != nullptr ? v : "(null)"; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
inline void append(std::string& s, Hex v) {
  char b[24];
  std::snprintf(b, sizeof b, "%llx", static_cast<unsigned long long>(v.value));
  s += b;
}
template <typename T>
inline void append(std::string& s, const T& v) {
  using U = std::decay_t<T>;
  if constexpr (std::is_same_v<U, char*> || std::is_same_v<U, const char*>) {
    append(s, static_cast<const char*>(v));
  } else if constexpr (std::is_enum_v<U>) {
    s += std::to_string(static_cast<long long>(v));
  } else if constexpr (std::is_integral_v<U>) {
    s += std::to_string(v);
  } else if constexpr (std::is_floating_point_v<U>) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", static_cast<double>(v));
    s += b;
  } else if constexpr (std::is_pointer_v<U>) {
    char b[24];
    std::snprintf(b, sizeof b, "%p", static_cast<const void*>(v));
    s += b;
  } else {
    static_assert(sizeof(U) == 0, "commkit::str: unsupported argument type");
  }
}

}  // namespace detail

// Concatenates the arguments (strings, characters, integers, floats, pointers, enums, hex()).
template <typename... Args>
inline std::string str(Args&&... args) {
  std::string s;
  (detail::append(s, args), ...);
  return s;
}

namespace detail {

template <typename... Args>
inline std::string format(const char* file, int line, int rank, int peer, Args&&... args) {
  std::string s = str(std::forward<Args>(args)...);
  if (rank != kUnknownRank) s += str(" [rank ", rank);
  if (peer != kUnknownRank) s += str(rank != kUnknownRank ? ", peer " : " [peer ", peer);
  if (rank != kUnknownRank || peer != kUnknownRank) s += "]";
  const char* base = std::strrchr(file, '/');
  s += str(" (", base ? base + 1 : file, ":", line, ")");
  return s;
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
