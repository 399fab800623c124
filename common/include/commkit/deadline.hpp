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
//   Backoff b; b.pause();   spin with cpu-relax for a few hundred rounds, then yield, then sleep
//                           (up to 50 us), so a waiting thread costs little CPU on a 2-core box.
//   poll_until(pred, deadline, progress_fn, aborted_fn) -> PollResult
//     spins until pred() is true (kReady), aborted() is true (kAborted: e.g. a device timeout record
//     appeared), or the deadline expires without progress (kExpired). Never throws by itself.
//   wait_until(pred, deadline, progress_fn, on_timeout)
//     poll_until without abort; on expiry calls on_timeout() (which must throw).
//   monotonic_ns()          CLOCK_MONOTONIC in nanoseconds.
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

class ProgressDeadline {
 public:
  explicit ProgressDeadline(uint64_t timeout_ms)
      : timeout_ns_(timeout_ms * 1000000ull), start_ns_(monotonic_ns()) {}
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
  void pause() {
    if (rounds_ < 256) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else if (rounds_ < 1024) {
      sched_yield();
    } else {
      timespec ts{0, sleep_ns_};
      nanosleep(&ts, nullptr);
      if (sleep_ns_ < 50000) sleep_ns_ *= 2;
    }
    ++rounds_;
  }
  void reset() {
    rounds_ = 0;
    sleep_ns_ = 1000;
  }

 private:
  uint32_t rounds_ = 0;
  long sleep_ns_ = 1000;
};

enum class PollResult { kReady = 0, kAborted = 1, kExpired = 2 };

// Spins until pred() holds, aborted() holds, or the deadline expires. progress() returns a value
// that changes whenever the watched state moves (it restarts the deadline's window).
template <typename Pred, typename Progress, typename Aborted>
inline PollResult poll_until(Pred&& pred, ProgressDeadline& deadline, Progress&& progress, Aborted&& aborted) {
  Backoff backoff;
  while (!pred()) {
    if (aborted()) return PollResult::kAborted;
    if (deadline.expired(static_cast<uint64_t>(progress()))) return PollResult::kExpired;
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
