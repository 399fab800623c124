// commkit/device_deadline.cuh -- device-side deadlines on %globaltimer that never trap.
//
// Contract:
//   globaltimer_ns()                      the GPU's global nanosecond timer.
//   wait_ge(ptr, expected, timeout_ns, rec, op, rank, peer)
//   wait_eq(ptr, expected, timeout_ns, rec, op, rank, peer)
//       spin with acquire loads (system scope) until *ptr >= expected (or == expected). The
//       deadline restarts whenever the observed value changes (progress). Returns true on
//       success. Returns false when the deadline expired -- after recording (op, rank, peer,
//       expected, observed) in `rec` if no one else had -- or when another thread already
//       recorded a timeout (rec->flag != 0), so every waiter of a failed operation leaves fast.
//       The caller must leave the kernel (return) on false; the host then raises via
//       CK_RAISE_IF_TIMED_OUT. timeout_ns == 0 disables the deadline. A timer read that is earlier
//       than the wait's start (the global timer stepped back) restarts the deadline.
//   wait_tag_ge(ptr, tag, timeout_ns, rec, op, rank, peer)
//       the same for u64 words "(tag << 32) | payload": until the high half is at or past `tag` in
//       32-bit serial-number order, (int32_t)(high - tag) >= 0, so the tag may wrap around 2^32
//       (a plain >= on the word would accept every stale word once it had).
//   All three take three optional last arguments: poll_log2 (default 6): the abort flag (host memory,
//   a PCIe read) and the timer are checked every 2^poll_log2 spins (2^32 for 32 and above); sleep_ns (default 0): a
//   __nanosleep between spins. Waits that thousands of warps run at once (per-chunk arrival
//   counters) pass larger values so the waiters flood neither PCIe nor L2. stop (default none): a
//   u32 or u64 word checked with the abort flag; once it is non-zero the wait returns false without
//   recording anything (a sticky "this operation already failed" mark: the waiter leaves at once
//   instead of waiting out its deadline for a peer that will never come; the caller tells the
//   two apart by reading *stop).
//   wait_ge_load(load, expected, ...)     wait_ge on a value `load()` returns (a source that is not a
//                                         plain word, e.g. a GIN signal); the same arguments after it.
//   wait_tag_ge_load(load, tag, ...)      wait_tag_ge on a tagged word `load()` returns, e.g. the least
//                                         advanced of several tagged words read together in one round
//                                         trip (the loads of one poll are in flight at once).
//   aborted(rec)                          true once any waiter recorded a timeout.
//   report_timeout(rec, ...)              claim and fill the record directly.
#pragma once

#include <cstdint>

#include "commkit/atomics.hpp"
#include "commkit/timeout_record.hpp"

namespace commkit {

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool aborted(const TimeoutRecord* rec) {
  return rec != nullptr && ld_relaxed(&rec->flag) != 0u;
}

__device__ __forceinline__ void report_timeout(TimeoutRecord* rec, uint32_t op, int rank, int peer,
                                               int64_t expected, int64_t observed,
                                               uint64_t waited_ns) {
  if (rec == nullptr) return;
  if (cas(&rec->flag, 0u, 2u) == 0u) {  // 2 = being written; the host sees 1 only when complete
    rec->op = op;
    rec->rank = rank;
    rec->peer = peer;
    rec->expected = expected;
    rec->observed = observed;
    rec->waited_ns = waited_ns;
    rec->channel = blockIdx.x;
    st_release(&rec->flag, 1u);
  }
}

namespace deadline_detail {
enum class Cmp { kGe, kEq, kTagGe };

template <Cmp kCmp, typename T>
__device__ __forceinline__ bool reached(T seen, T expected) {
  if constexpr (kCmp == Cmp::kEq) {
    return seen == expected;
  } else if constexpr (kCmp == Cmp::kGe) {
    return seen >= expected;
  } else {
    return static_cast<int32_t>(static_cast<uint32_t>(seen >> 32) - static_cast<uint32_t>(expected)) >= 0;
  }
}

// `load()` returns the current value (an acquire load of a word, or another source such as a GIN signal).
template <Cmp kCmp, typename T, typename Load, typename S>
__device__ __forceinline__ bool wait_impl(Load load, T expected, uint64_t timeout_ns,
                                          TimeoutRecord* rec, uint32_t op, int rank, int peer,
                                          uint32_t poll_log2, uint32_t sleep_ns, const S* stop) {
  // poll_log2 >= 32 means "every 2^32 spins" (a shift by 32 or more is undefined).
  const uint32_t poll_mask = poll_log2 >= 32u ? 0xffffffffu : (1u << poll_log2) - 1u;
  T seen = load();
  uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while (!reached<kCmp>(seen, expected)) {
    if ((++spins & poll_mask) == 0u) {
      if (aborted(rec)) return false;
      if (stop != nullptr && ld_relaxed(stop) != S{0}) return false;
      uint64_t now = globaltimer_ns();
      // The timer may be stepped back (the driver re-syncs it): restart rather than read the
      // negative difference as ~2^64 ns waited and time out at once.
      if (now < start) start = now;
      if (timeout_ns != 0 && now - start > timeout_ns) {
        report_timeout(rec, op, rank, peer, static_cast<int64_t>(expected),
                       static_cast<int64_t>(seen), now - start);
        return false;
      }
    }
    if (sleep_ns != 0u) __nanosleep(sleep_ns);
    T next = load();
    if (next != seen) {
      seen = next;
      start = globaltimer_ns();
    }
  }
  return true;
}
}  // namespace deadline_detail

template <typename T>
__device__ __forceinline__ bool wait_ge(const T* ptr, T expected, uint64_t timeout_ns,
                                        TimeoutRecord* rec, uint32_t op, int rank, int peer,
                                        uint32_t poll_log2 = 6, uint32_t sleep_ns = 0,
                                        const uint64_t* stop = nullptr) {
  return deadline_detail::wait_impl<deadline_detail::Cmp::kGe>([ptr] { return ld_acquire(ptr); }, expected,
                                                               timeout_ns, rec, op, rank, peer, poll_log2, sleep_ns,
                                                               stop);
}

template <typename T>
__device__ __forceinline__ bool wait_eq(const T* ptr, T expected, uint64_t timeout_ns,
                                        TimeoutRecord* rec, uint32_t op, int rank, int peer,
                                        uint32_t poll_log2 = 6, uint32_t sleep_ns = 0,
                                        const uint64_t* stop = nullptr) {
  return deadline_detail::wait_impl<deadline_detail::Cmp::kEq>([ptr] { return ld_acquire(ptr); }, expected,
                                                               timeout_ns, rec, op, rank, peer, poll_log2, sleep_ns,
                                                               stop);
}

// `tag` is compared with the word's high 32 bits; a timeout record reports the tag as expected and
// the whole word as observed.
__device__ __forceinline__ bool wait_tag_ge(const uint64_t* ptr, uint32_t tag, uint64_t timeout_ns,
                                            TimeoutRecord* rec, uint32_t op, int rank, int peer,
                                            uint32_t poll_log2 = 6, uint32_t sleep_ns = 0,
                                            const uint64_t* stop = nullptr) {
  return deadline_detail::wait_impl<deadline_detail::Cmp::kTagGe>([ptr] { return ld_acquire(ptr); }, uint64_t{tag},
                                                                  timeout_ns, rec, op, rank, peer, poll_log2,
                                                                  sleep_ns, stop);
}

// wait_tag_ge on a tagged word that `load()` returns (several words polled together, one round trip).
template <typename Load, typename S = uint64_t>
__device__ __forceinline__ bool wait_tag_ge_load(Load load, uint32_t tag, uint64_t timeout_ns, TimeoutRecord* rec,
                                                 uint32_t op, int rank, int peer, uint32_t poll_log2 = 6,
                                                 uint32_t sleep_ns = 0, const S* stop = nullptr) {
  return deadline_detail::wait_impl<deadline_detail::Cmp::kTagGe>(load, uint64_t{tag}, timeout_ns, rec, op, rank,
                                                                  peer, poll_log2, sleep_ns, stop);
}

// wait_ge on a value that is not a plain memory word: `load()` returns it (e.g. a GIN signal read).
template <typename T, typename Load>
__device__ __forceinline__ bool wait_ge_load(Load load, T expected, uint64_t timeout_ns,
                                             TimeoutRecord* rec, uint32_t op, int rank, int peer,
                                             uint32_t poll_log2 = 6, uint32_t sleep_ns = 0,
                                             const uint64_t* stop = nullptr) {
  return deadline_detail::wait_impl<deadline_detail::Cmp::kGe>(load, expected, timeout_ns, rec, op, rank, peer,
                                                               poll_log2, sleep_ns, stop);
}

}  // namespace commkit
