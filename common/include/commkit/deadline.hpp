// commkit/deadline.hpp -- host-side deadlines that reset on progress, and a bounded spin-wait.
//
// Contract:
//   ProgressDeadline d(timeout_ms);
//     d.expired(progress)   true once `timeout_ms` passed since the last call in which `progress`
//                           differed from the value seen before (the watched state moved), so a
//                           slow-but-moving peer never times out and a stuck one does.
//     d.reset()             restart the window explicitly.
//     d.elapsed_ms()        time since the window (re)started.
//     timeout_ms == 0 means "never expires" only when explicitly built with ProgressDeadline::infinite().
//     A timeout_ms too large to count in nanoseconds (above ~584 years, e.g. 2**62 passed as
//     "infinite") saturates to infinite instead of wrapping around to a tiny window.
//   Backoff b(yield_ns = 200 us, sleep_ns = 20 us); b.pause(); b.reset();
//                           spin with cpu-relax for 64 rounds, then yield until `yield_ns` have
//                           passed since construction or the last reset (a waiter wakes within a
//                           yield, ~1 us), then sleep `sleep_ns` per round so a long wait costs little
//                           CPU. A nanosleep costs ~50-60 us of timer slack on Linux, so a sleeping
//                           waiter wakes that late: give waits on a latency-critical path (a host
//                           waiting for a kernel's result) a yield window longer than they last.
//   poll_until(pred, deadline, progress_fn, aborted_fn[, backoff]) -> PollResult
//     spins until pred() is true (kReady), aborted() is true (kAborted: e.g. a device timeout record
//     appeared), or the deadline expires without progress (kExpired). A change of progress_fn()
//     also resets the backoff. Never throws by itself.
//   wait_until(pred, deadline, progress_fn, on_timeout)
//     poll_until without abort; on expiry calls on_timeout() (which must throw).
//   monotonic_ns()          CLOCK_MONOTONIC in nanoseconds.
//   ms_to_ns_saturating(ms) ms * 1e6, or UINT64_MAX when that overflows.
//   add_saturating(a, b)    a + b, or UINT64_MAX when that overflows: `now + period` for a period
//                           given by the caller (a check interval, a deadline) without wrap-around.
#pragma once

#include <time.h>
#include <sched.h>

#include <cstdint>
#include <limits>

namespace commkit {

inline uint64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// Callers pass "infinite" as a huge count (2**62, UINT64_MAX): overflowing into a small window
// would turn it into an immediate timeout, so the arithmetic saturates instead.
inline uint64_t ms_to_ns_saturating(uint64_t ms) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  return ms > kMax / 1000000ull ? kMax : ms * 1000000ull;
}

inline uint64_t add_saturating(uint64_t a, uint64_t b) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  return b > kMax - a ? kMax : a + b;
}

class ProgressDeadline {
 public:
  explicit ProgressDeadline(uint64_t timeout_ms)
      : timeout_ns_(ms_to_ns_saturating(timeout_ms)), start_ns_(monotonic_ns()) {}
  static ProgressDeadline infinite() {
    ProgressDeadline d(0);
    d.timeout_ns_ = std::numeric_limits<uint64_t>::max();
    return d;
  }

  void reset() { start_ns_ = monotonic_ns(); }
  uint64_t elapsed_ms() const { return (monotonic_ns() - start_ns_) / 1000000ull; }
  uint64_t timeout_ms() const { return timeout_ns_ / 1000000ull; }

  // Without progress tracking: a plain deadline.
  bool expired() const { return monotonic_ns() - start_ns_ > timeout_ns_; }

  // With progress tracking: any change of `progress` restarts the window.
  bool expired(uint64_t progress) {
    if (!has_progress_ || progress != last_progress_) {
      has_progress_ = true;
      last_progress_ = progress;
      reset();
      return false;
    }
    return expired();
  }

 private:
  uint64_t timeout_ns_;
  uint64_t start_ns_;
  uint64_t last_progress_ = 0;
  bool has_progress_ = false;
};

class Backoff {
 public:
  explicit Backoff(uint64_t yield_ns = 200000, long sleep_ns = 20000)
      : yield_ns_(yield_ns), sleep_ns_(sleep_ns), since_(monotonic_ns()) {}
  void pause() {
    if (rounds_ < 64) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      ++rounds_;
    } else if (monotonic_ns() - since_ < yield_ns_) {
      sched_yield();
    } else {
      // nanosleep refuses tv_nsec outside [0, 1e9) with EINVAL and returns at once, which would
      // turn a long sleep into a busy spin.
      const long ns = sleep_ns_ < 0 ? 0 : sleep_ns_;
      timespec ts{static_cast<time_t>(ns / 1000000000L), ns % 1000000000L};
      nanosleep(&ts, nullptr);
    }
  }
  void reset() {
    rounds_ = 0;
    since_ = monotonic_ns();
  }

 private:
  uint64_t yield_ns_;
  long sleep_ns_;
  uint64_t since_;
  uint32_t rounds_ = 0;
};

enum class PollResult { kReady = 0, kAborted = 1, kExpired = 2 };

// Spins until pred() holds, aborted() holds, or the deadline expires. progress() returns a value
// that changes whenever the watched state moves (it restarts the deadline's window).
template <typename Pred, typename Progress, typename Aborted>
inline PollResult poll_until(Pred&& pred, ProgressDeadline& deadline, Progress&& progress, Aborted&& aborted,
                             Backoff backoff = Backoff()) {
  uint64_t last = static_cast<uint64_t>(progress());
  while (!pred()) {
    if (aborted()) return PollResult::kAborted;
    const uint64_t now = static_cast<uint64_t>(progress());
    if (now != last) {
      last = now;
      backoff.reset();
    }
    if (deadline.expired(now)) return PollResult::kExpired;
    backoff.pause();
  }
  return PollResult::kReady;
}

// poll_until without abort: on_timeout() is called (and must throw) once the deadline expires.
template <typename Pred, typename Progress, typename OnTimeout>
inline void wait_until(Pred&& pred, ProgressDeadline& deadline, Progress&& progress,
                       OnTimeout&& on_timeout) {
  if (poll_until(pred, deadline, progress, [] { return false; }) == PollResult::kExpired) on_timeout();
}

}  // namespace commkit
