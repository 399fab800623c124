// commkit/impl/device_sync__funcs.hpp -- the definitions of commkit/device_sync.hpp (see there for the
// contract).
#pragma once

#include <chrono>
#include <system_error>
#include <thread>
#include <utility>

#if COMMKIT_WITH_CUDA
#include "commkit/check.hpp"
#endif

namespace commkit {

template <typename R>
template <typename Fn>
DetachedCall<R>::DetachedCall(Fn fn) : s_(std::make_shared<State>()) {
  try {
    // fn is copied into the thread, so that it is still whole here if the thread cannot start.
    std::thread([s = s_, fn]() mutable {
      R v = fn();
      {
        const std::lock_guard<std::mutex> g(s->mu);
        s->value = std::move(v);
        s->done = true;
      }
      s->cv.notify_all();
    }).detach();
  } catch (const std::system_error&) {  // no thread to spare: wait in place, without the deadline
    in_place_ = true;
    s_->value = fn();
    s_->done = true;
  }
}

template <typename R>
bool DetachedCall<R>::wait_for(uint64_t ns) {
  // Beyond ~31 years (e.g. UINT64_MAX for "no deadline") the clock arithmetic of wait_for would overflow.
  constexpr uint64_t kMaxNs = 1000000000000000000ull;
  std::unique_lock<std::mutex> g(s_->mu);
  State& s = *s_;
  return s.cv.wait_for(g, std::chrono::nanoseconds(int64_t(ns < kMaxNs ? ns : kMaxNs)), [&s] { return s.done; });
}

template <typename R>
R DetachedCall<R>::result() const {
  const std::lock_guard<std::mutex> g(s_->mu);
  return s_->value;
}

#if COMMKIT_WITH_CUDA
inline std::string DeviceSyncResult::failure(const char* whose) const {
  if (!finished) {
    const std::string s = str(double(timeout_ns) * 1e-9, " s");
    return str("the device did not finish within ", s, ", nor within ", s, " more after ", whose, " waits were ended "
               "(other work on device ", device, " still runs, e.g. a kernel waiting for another process)");
  }
  return error == cudaSuccess ? std::string() : str("cudaDeviceSynchronize failed: ", cudaGetErrorString(error));
}

template <typename OnTimeout>
DeviceSyncResult synchronize_device(int device, uint64_t timeout_ns, OnTimeout&& on_timeout) {
  // A throw from it would skip the caller's handling of a device that still runs (keep, do not free).
  static_assert(noexcept(on_timeout()), "synchronize_device: on_timeout must be noexcept");
  DetachedCall<cudaError_t> sync([device] {
    const cudaError_t e = cudaSetDevice(device);
    return e == cudaSuccess ? cudaDeviceSynchronize() : e;
  });
  DeviceSyncResult r;
  r.device = device;
  r.timeout_ns = timeout_ns;
  if (!sync.wait_for(timeout_ns)) {
    r.timed_out = true;
    on_timeout();
    r.finished = sync.wait_for(timeout_ns);
  }
  if (r.finished) r.error = sync.result();
  return r;
}
#endif

}  // namespace commkit
