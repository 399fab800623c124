// commkit/device_sync.hpp -- waiting for the device with a deadline: a teardown must not wait forever for
// a kernel that itself waits without one (a timeout of 0) for a peer that never comes.
//
// Contract (host only):
//   DetachedCall<R> call(fn)    runs fn() (returning R, default-constructible) on a detached helper
//                               thread; fn must not throw (there that ends the process). When no
//                               thread can be created (std::thread throws std::system_error) it runs
//                               fn() in place, before the constructor returns, without any deadline:
//                               in_place() then says so.
//   call.wait_for(ns) -> bool   true once fn() returned (at once after an in-place run); false when `ns`
//                               nanoseconds passed first. May be called again to wait longer.
//   call.result()               what fn() returned; only after wait_for returned true.
//   A caller that gives up leaves the thread behind until fn() returns: fn must own (capture by value)
//   everything it uses, as it may outlive the DetachedCall and its caller's objects.
//
//   With COMMKIT_WITH_CUDA (the CUDA build):
//   synchronize_device(device, timeout_ns, on_timeout) -> DeviceSyncResult
//       cudaSetDevice(device) + cudaDeviceSynchronize() on a DetachedCall (in place: the calling
//       thread's current device becomes `device`). When timeout_ns passes first, on_timeout() (noexcept,
//       checked at compile time) runs once
//       (e.g. end this instance's device waits through its abort flag) and the device gets timeout_ns
//       once more. DeviceSyncResult: finished (false: the device still runs; the thread stays behind
//       until it finishes), timed_out (on_timeout ran), error (what the synchronisation returned, when
//       finished), failure(whose) (why it failed in words, "" when it did not: `whose` names the owner
//       of the waits on_timeout ended, e.g. "this instance's").
// Errors: nothing thrown but what an in-place fn() throws (and std::bad_alloc).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#if COMMKIT_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace commkit {

template <typename R>
class DetachedCall {
 public:
  template <typename Fn>
  explicit DetachedCall(Fn fn);
  bool wait_for(uint64_t ns);
  bool in_place() const { return in_place_; }
  R result() const;

 private:
  // Shared with the helper thread, which may outlive this object.
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    R value{};
  };
  std::shared_ptr<State> s_;
  bool in_place_ = false;
};

#if COMMKIT_WITH_CUDA
struct DeviceSyncResult {
  int device = -1;
  uint64_t timeout_ns = 0;
  bool finished = true;
  bool timed_out = false;
  cudaError_t error = cudaSuccess;
  std::string failure(const char* whose) const;
};

template <typename OnTimeout>
DeviceSyncResult synchronize_device(int device, uint64_t timeout_ns, OnTimeout&& on_timeout);
#endif

}  // namespace commkit

#include "commkit/impl/device_sync__funcs.hpp"
