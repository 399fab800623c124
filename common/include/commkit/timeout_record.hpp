// commkit/timeout_record.hpp -- the record a device-side deadline leaves for the host.
//
// Contract:
//   TimeoutRecord lives in host-visible memory (cudaHostAlloc(..., cudaHostAllocMapped) or any
//   memory both sides can reach). A device wait that expires claims it with a CAS on `flag`
//   (first writer wins), fills operation / rank / peer / expected / observed, and leaves the
//   kernel; every other waiter sees `flag != 0` and leaves too (see device_deadline.cuh).
//   After the stream is synchronised the host calls raise_if_timed_out(record, op_name), which
//   throws commkit::TimeoutError naming the operation, rank and peer, then clears the record.
//   claim_timeout_record(record, op, rank, peer, expected) is that claim made by the host (a peer
//   watch, a teardown ending the waits). No trap(): the CUDA context stays usable.
#pragma once

#include <cstdint>
#include <string>

#include "commkit/atomics.hpp"
#include "commkit/platform.hpp"

namespace commkit {

struct alignas(64) TimeoutRecord {
  uint32_t flag;      // 0: clear; 1: a deadline expired (claimed by CAS)
  uint32_t op;        // package-defined operation code
  int32_t rank;       // rank that waited
  int32_t peer;       // peer it waited for (-1 when not a single peer)
  int64_t expected;   // value it waited for
  int64_t observed;   // value it last saw
  uint64_t waited_ns; // how long it waited without progress
  uint32_t channel;   // block / channel index that expired
  uint32_t reserved[5];
};
static_assert(sizeof(TimeoutRecord) == 64, "TimeoutRecord must stay one cache line");

}  // namespace commkit

#if !CK_IS_DEVICE_PASS
#include "commkit/check.hpp"

namespace commkit {

// The fields first, the flag last (a release store): while the flag is still set no kernel can claim
// the record, so one that claims it right after the clear never has its fields zeroed under it (a
// whole-struct assignment may store the flag first). `after_store` (tests only) runs after each store.
template <typename AfterStore>
inline void clear_timeout_record(TimeoutRecord* rec, AfterStore&& after_store) {
  volatile TimeoutRecord* r = rec;
  r->op = 0u;
  after_store();
  r->rank = 0;
  after_store();
  r->peer = -1;
  after_store();
  r->expected = 0;
  after_store();
  r->observed = 0;
  after_store();
  r->waited_ns = 0u;
  after_store();
  r->channel = 0u;
  after_store();
  for (uint32_t& w : rec->reserved) w = 0u;
  fence_system();
  st_release(&rec->flag, 0u);
  after_store();
}

inline void clear_timeout_record(TimeoutRecord* rec) {
  clear_timeout_record(rec, [] {});
}

// Claims `rec` from the host as a device wait claims it (flag 0 -> 2, the fields, then 1), so that every
// device wait polling it leaves: a wait that expires at the same moment either keeps its report or finds
// the record taken, and the fields never mix two. Returns whether this call claimed it.
inline bool claim_timeout_record(TimeoutRecord* rec, uint32_t op, int rank, int peer, int64_t expected) {
  if (cas(&rec->flag, 0u, 2u) != 0u) return false;
  rec->op = op;
  rec->rank = rank;
  rec->peer = peer;
  rec->expected = expected;
  rec->observed = 0;
  rec->waited_ns = 0;
  rec->channel = 0;
  st_release(&rec->flag, 1u);
  return true;
}

// Throws commkit::TimeoutError if a device deadline expired. op_name maps op codes to names.
template <typename OpName>
inline void raise_if_timed_out(TimeoutRecord* rec, OpName&& op_name, const char* file, int line) {
  // flag 2: a device thread is still filling the record. Reading it now would report torn fields,
  // and clearing it would let that thread's final flag = 1 revive the record for a later operation.
  if (ld_acquire(&rec->flag) != 1u) return;
  TimeoutRecord copy = *rec;
  clear_timeout_record(rec);
  std::string op = op_name(copy.op);
  detail::raise_timeout(file, line, op, copy.rank, copy.peer, copy.expected, copy.observed,
                        " after ", copy.waited_ns / 1000000ull, " ms without progress (GPU channel ",
                        copy.channel, "); the CUDA context is still usable");
}

}  // namespace commkit

#define CK_RAISE_IF_TIMED_OUT(rec, op_name) ::commkit::raise_if_timed_out((rec), (op_name), __FILE__, __LINE__)
#endif
