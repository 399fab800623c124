// Exception types of commkit/check.hpp. See that header for the contract.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace commkit {

constexpr int kUnknownRank = -1;

class Error : public std::runtime_error {
 public:
  Error(const std::string& what, const char* file, int line, int rank = kUnknownRank,
        int peer = kUnknownRank)
      : std::runtime_error(what), file_(file), line_(line), rank_(rank), peer_(peer) {}
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }
  int rank() const noexcept { return rank_; }
  int peer() const noexcept { return peer_; }

 private:
  const char* file_;
  int line_;
  int rank_;
  int peer_;
};

class ValueError : public Error {
 public:
  using Error::Error;
};

class TimeoutError : public Error {
 public:
  TimeoutError(const std::string& what, const char* file, int line, std::string operation, int rank,
               int peer, int64_t expected, int64_t observed)
      : Error(what, file, line, rank, peer),
        operation_(std::move(operation)),
        expected_(expected),
        observed_(observed) {}
  const std::string& operation() const noexcept { return operation_; }
  int64_t expected() const noexcept { return expected_; }
  int64_t observed() const noexcept { return observed_; }

 private:
  std::string operation_;
  int64_t expected_;
  int64_t observed_;
};

}  // namespace commkit
