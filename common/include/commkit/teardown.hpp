// commkit/teardown.hpp -- a teardown that releases everything it can, then reports every failure.
//
// Contract:
//   TeardownLog log(hook)       hook (tests only; empty: none): release steps to report as failed,
//                               comma-separated step names ("*": every step), e.g. read from a test
//                               variable of the environment. The step itself still runs: the hook
//                               changes only what is reported.
//   log.step(name, ok, detail)  one release step: recorded as failed when !ok (detail says why, e.g.
//                               cudaGetErrorString) or when the hook names it. Returns true if failed.
//   log.note(text)              a failure that is not one release (e.g. peers that never arrived).
//   log.empty(), log.message()  nothing failed / every failure in order, "; "-separated.
//   cuda_step(log, name, err)   (CUDA builds) log.step for a CUDA call's result, its error string the
//                               detail.
// Why: a destroy() that frees five things must free all five even when the first fails, and must
// not report success when one failed. Host only; the log itself needs no CUDA.
#pragma once

#include <string>
#include <utility>

#if COMMKIT_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace commkit {

class TeardownLog {
 public:
  explicit TeardownLog(std::string hook = {}) : hook_(std::move(hook)) {}

  bool step(const std::string& name, bool ok, const std::string& detail = {}) {
    if (ok && !hooked(name)) return false;
    note(ok ? name + " failed (injected by a test hook)" : name + " failed: " + detail);
    return true;
  }

  void note(const std::string& text) { msg_ += (msg_.empty() ? "" : "; ") + text; }
  bool empty() const { return msg_.empty(); }
  const std::string& message() const { return msg_; }

 private:
  bool hooked(const std::string& name) const {
    if (hook_.empty()) return false;
    if (hook_ == "*") return true;
    size_t start = 0;
    while (start <= hook_.size()) {
      size_t end = hook_.find(',', start);
      if (end == std::string::npos) end = hook_.size();
      if (hook_.compare(start, end - start, name) == 0) return true;
      start = end + 1;
    }
    return false;
  }

  std::string hook_, msg_;
};

#if COMMKIT_WITH_CUDA
inline bool cuda_step(TeardownLog& log, const std::string& name, cudaError_t e) {
  return log.step(name, e == cudaSuccess, cudaGetErrorString(e));
}
#endif

}  // namespace commkit
