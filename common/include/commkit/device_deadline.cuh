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
//       CK_RAISE_IF_TIMED_OUT. timeout_ns == 0 disables the deadline.
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
template <bool kEq, typename T>
__device__ __forceinline__ bool wait_impl(const T* ptr, T expected, uint64_t timeout_ns,
                                          TimeoutRecord* rec, uint32_t op, int rank, int peer) {
  T seen = ld_acquire(ptr);
  uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while (kEq ? (seen != expected) : (seen < expected)) {
    if ((++spins & 63u) == 0u) {
      if (aborted(rec)) return false;
      uint64_t now = globaltimer_ns();
      if (timeout_ns != 0 && now - start > timeout_ns) {
        report_timeout(rec, op, rank, peer, static_cast<int64_t>(expected),
                       static_cast<int64_t>(seen), now - start);
        return false;
      }
    }
    T next = ld_acquire(ptr);
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
                                        TimeoutRecord* rec, uint32_t op, int rank, int peer) {
  return deadline_detail::wait_impl<false>(ptr, expected, timeout_ns, rec, op, rank, peer);
}

template <typename T>
__device__ __forceinline__ bool wait_eq(const T* ptr, T expected, uint64_t timeout_ns,
                                        TimeoutRecord* rec, uint32_t op, int rank, int peer) {
  return deadline_detail::wait_impl<true>(ptr, expected, timeout_ns, rec, op, rank, peer);
}

}  // namespace commkit
