// elastic_ep/csrc/kernels/device_common.cuh -- the device context every kernel builds (the scale-up
// transport, workspace, deadlines), the grid-counter slots, the entry barrier and the small warp/block
// helpers the kernel families share. Included once, by launch.cu (the package's one CUDA translation unit).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include "commkit/atomics.hpp"
#include "commkit/device_deadline.cuh"
#include "commkit/timeout_record.hpp"
#include "geometry.hpp"
#include "launch.hpp"
#include "sizing.hpp"
#include "scaleup.cuh"
#include "scaleout.cuh"

namespace elastic_ep {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

// Slots of the local grid-counter words (WorkspaceLayout::grid_counter, u32[16]).
// kCtrDispatchPushFailed: set by a push block that pushed nothing because its wait for the slots or
// the entry barrier failed (push beside notify, below); read and reset by the push's last block.
// kCtrCombineTicket / kCtrCombineOverlapDone: block start tickets and finished blocks of the overlapped
// combine (reset by its last block).
// kCtrEpoch: slots 8 and 9 together, the u64 epoch of the last completed operation (64 bits: a 32-bit
// one wraps after 2^32 operations, a few days of a busy server, and then every ">= epoch" wait
// would pass at once).
// kCtrDispatchReady (10, 11): u64 epoch whose slots notify has made final (the push adds the block
// bases only after it; written by notify's last block, never reset: epochs only grow).
// kCtrDispatchOutcome (12, 13): u64 (epoch << 2) | status of notify's last block: 0 the counts were
// exchanged, 1 a wait failed, 2 the dispatch was refused (some rank passed expert ids outside
// [-1, E) in CPU-sync mode). The push's last block reads it to decide whether to signal the peers.
enum CounterSlot { kCtrDispatchPush = 0, kCtrDispatchEpilogue = 1, kCtrCombinePush = 2, kCtrCombineReduce = 3,
                   kCtrDispatchPushFailed = 4, kCtrDispatchNotify = 5, kCtrCombineTicket = 6,
                   kCtrCombineOverlapDone = 7, kCtrEpoch = kGridCounterEpochSlot, kCtrDispatchReady = 10,
                   kCtrDispatchOutcome = 12, kCtrHybridForward = 14, kCtrProtocolReported = 15 };
enum NotifyStatus : uint64_t { kNotifyOk = 0, kNotifyFailed = 1, kNotifyRefused = 2 };
static_assert(kCtrEpoch % 2 == 0 && kCtrDispatchReady % 2 == 0 && kCtrDispatchOutcome % 2 == 0,
              "each u64 word needs an 8-byte aligned pair of slots");

// Hybrid mode's domains (sizing.hpp): rank = dom * U + rail; `on` false in direct mode (U = 0 or R).
struct HybridDomains {
  int U, S, dom, rail;
  bool on;
  __device__ HybridDomains(int num_scaleup_ranks, int R, int rank)
      : U(num_scaleup_ranks > 0 && num_scaleup_ranks < R ? num_scaleup_ranks : R),
        S(R / U),
        dom(rank / U),
        rail(rank % U),
        on(U < R) {}
  __device__ bool local(int r) const { return r / U == dom; }
  __device__ int rail_peer(int domain) const { return domain * U + rail; }  // of this rank, in `domain`
  // The relay / stage areas hold the S - 1 other domains of `own`: domain d at index d - (d > own).
  __device__ static int other_index(int d, int own) { return d - (d > own ? 1 : 0); }
  __device__ int other_domain(int i) const { return i + (i >= dom ? 1 : 0); }
  // The ranks whose kernels write into this rank's window, and whose entry into an operation this rank
  // waits for: every rank in direct mode; in hybrid mode its own domain (over NVLink) and its rail
  // peers (over the scale-out transport).
  __device__ bool hears_from(int r) const { return !on || local(r) || r % U == rail; }
  // The rank of this domain that passes r's notify words and records on to this rank (r in another
  // domain, on another rail: notify's relayed words, the forward kernel's records), else -1 (r writes
  // them here itself, or this rank relays them after a wait of its own that names r).
  __device__ int relayer(int r) const { return on && !local(r) && r % U != rail ? dom * U + r % U : -1; }
};

// Whom a wait for rank r's words or records names (commkit's TimeoutRecord peer and op): the relayer,
// with r in the code (launch.hpp kOpOriginShift), when one passes them on; else r.
struct WaitFor {
  int peer;
  uint32_t op;
  __device__ WaitFor(const HybridDomains& hd, uint32_t base_op, int r) : peer(hd.relayer(r)), op(base_op) {
    if (peer < 0)
      peer = r;
    else
      op |= uint32_t(r + 1) << kOpOriginShift;
  }
};


struct Ctx {
  ScaleupTransport tr;  // this rank's NVLink domain (scaleup.cuh); other domains: the SO parameter
  HybridDomains hd;  // CommView::num_scaleup_ranks
  WorkspaceLayout ws;
  uint64_t buf;  // offset of the buffer in the window
  commkit::TimeoutRecord* rec;
  uint32_t* counters;
  uint64_t timeout_ns;
  __device__ Ctx(const CommView& c)
      : tr{c.peer_bases, c.rank, c.num_ranks},
        hd(c.num_scaleup_ranks, c.num_ranks, c.rank),
        ws(workspace_layout()),
        buf(c.buffer_offset),
        rec(host_workspace_layout().timeout.at<commkit::TimeoutRecord>(c.host_workspace)),
        counters(ws.grid_counter.at<uint32_t>(c.window_base)),
        timeout_ns(c.timeout_ns) {}
  // Deadline of a wait for rows that a push running beside this kernel delivers (the overlapped
  // modes). The pushing rank (this one or any peer) may itself be waiting in its entry barrier for an
  // absent rank, and so is this rank's own push: every arrival wait gets twice the deadline, so the
  // entry barrier's wait expires first and the timeout names the absent rank, not a present one
  // that was waiting for it (with 3 or more ranks a reduce waits on peers that wait on the absent one).
  __device__ uint64_t arrival_timeout() const {
    return timeout_ns > ~uint64_t(0) / 2 ? timeout_ns : 2 * timeout_ns;  // 0 (no deadline) stays 0
  }
  __device__ uint64_t* local_u64(const Region& r, int i) const {
    return reinterpret_cast<uint64_t*>(tr.local(r.offset)) + i;
  }
  __device__ uint64_t* epoch_word() const { return counter_u64(kCtrEpoch); }
  __device__ uint64_t epoch() const { return commkit::ld_relaxed(epoch_word()) + 1u; }
  __device__ void end_epoch(uint64_t E) const { commkit::st_relaxed(epoch_word(), E); }
  __device__ uint64_t* counter_u64(CounterSlot slot) const { return reinterpret_cast<uint64_t*>(counters + slot); }
};

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }

// A 32-bit digest of n words (FNV-1a over 64-bit words, folded): what a PP descriptor and an AGRS
// record carry in a signal so that the receiver compares one word on the fast path. Both ends compute
// it with this function; a collision only loses the name of a difference, never bounds a copy.
__device__ __forceinline__ uint32_t digest_words(const uint64_t* w, int n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int i = 0; i < n; ++i) {
    h = (h ^ w[i]) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  return uint32_t(h ^ (h >> 32));
}


// The stamp of a hybrid relay or stage entry (sizing.hpp): the operation's epoch and the entry's
// position, so neither a stale entry nor other bytes in the aliased buffer pass for this one.
__device__ __forceinline__ uint64_t hybrid_stamp(uint64_t E, uint64_t where) {
  return (uint64_t(uint32_t(where) ^ 0x9e3779b9u) << 32) | uint64_t(uint32_t(E));
}

// Scale-out signals between rail peers: every hybrid operation raises each rail peer's signal
// [sender] once, and scaleout_seen counts the raises this rank consumed. A kernel's blocks each wait
// (one thread per peer) for the next raise; its last block counts them (count_rail_signals), so no
// block sees another's count change under it. SO: the scale-out transport (scaleout.cuh), which the
// hybrid kernels take as a parameter: the NVLink emulation runs; GIN compiles (launch.cu).
template <class SO>
__device__ bool wait_rail_signal(const Ctx& cx, const SO& so, int src, uint32_t op, uint64_t timeout_ns) {
  const uint64_t want = commkit::ld_relaxed(cx.local_u64(cx.ws.scaleout_seen, src)) + 1u;
  return so.wait_signal(src, want, timeout_ns, cx.rec, op, src);
}
__device__ void count_rail_signals(const Ctx& cx, const HybridDomains& hd) {
  for (int d = 0; hd.on && d < hd.S; ++d)
    if (d != hd.dom) {
      uint64_t* seen = cx.local_u64(cx.ws.scaleout_seen, hd.rail_peer(d));
      commkit::st_relaxed(seen, commkit::ld_relaxed(seen) + 1u);
    }
}

// The scale-out transport of a kernel that runs in direct mode only (the overlapped combine).
struct NoScaleout {
  __device__ void put_value(int, uint64_t, uint64_t) const {}
};

// Word w of this rank's dispatch geometry (geometry.hpp): what must be equal on every rank for the
// records one rank writes to be where and what its peers read.
__device__ __forceinline__ uint32_t dispatch_geometry_word(const DispatchParams& p, int w) {
  return dispatch_geometry_value(w, p.num_max_tokens_per_rank, p.hidden_bytes, p.num_experts, p.num_topk,
                                 p.num_sf_packs, p.expert_alignment, p.zero_copy != 0);
}
// A refusal or protocol error for the host (HostWorkspaceLayout::geometry): which peer, what, both
// values; the running total last, so the host reads a complete report.
__device__ void report_to_host(const CommView& c, int peer, int what, uint64_t theirs, uint64_t mine) {
  uint64_t* g = host_workspace_layout().geometry.at<uint64_t>(c.host_workspace);
  commkit::st_relaxed(&g[1], (uint64_t(peer) << 8) | uint64_t(what));
  commkit::st_relaxed(&g[2], theirs);
  commkit::st_relaxed(&g[3], mine);
  commkit::st_release(&g[0], commkit::ld_relaxed(&g[0]) + 1u);
}
// A protocol error found by any thread of any block: the first one is reported (the runtime is then
// unusable; the flag is never cleared).
__device__ void report_protocol_once(const Ctx& cx, const CommView& c, int peer, int what, uint64_t theirs,
                                     uint64_t mine) {
  if (atomicCAS(&cx.counters[kCtrProtocolReported], 0u, 1u) == 0u) report_to_host(c, peer, what, theirs, mine);
}

// This rank's geometry words (block 0 of notify, at entry) to every rank it talks to: every peer in
// direct mode; in hybrid mode its own domain and, over the scale-out transport, its rail peers, which
// pass them on to their domains (relay_geometry, dispatch_notify.cuh), so every rank gets every rank's.
template <class SO>
__device__ void publish_geometry(const Ctx& cx, const SO& so, const DispatchParams& p, uint64_t E) {
  const uint64_t tag = uint64_t(uint32_t(E)) << 32;
  for (int i = threadIdx.x; i < cx.tr.num_ranks * kGeometryWords; i += blockDim.x) {
    const int r = i / kGeometryWords, w = i % kGeometryWords;
    const uint64_t at = cx.ws.geometry.offset + 8ull * (uint64_t(cx.tr.rank) * kGeometryWords + w);
    const uint64_t v = tag | dispatch_geometry_word(p, w);
    if (!cx.hd.on || cx.hd.local(r))
      cx.tr.put_u64(r, at, v);
    else if (cx.hd.hears_from(r))
      so.put_value(r, at, v);
  }
}
// Every thread of a block: waits for every peer's geometry words of epoch E (hybrid mode: the relayed
// ones too) and compares them with this rank's. Returns false when a wait expired; `*mismatch`
// (shared, -1 before) gets the lowest differing (peer * kGeometryWords + word), whatever order the
// words came in (relayed ones come later), so a rank names the same peer on every run.
__device__ bool check_geometry(const Ctx& cx, const DispatchParams& p, uint64_t E, uint32_t op, int* mismatch) {
  bool ok = true;
  for (int i = threadIdx.x; i < cx.tr.num_ranks * kGeometryWords && ok; i += blockDim.x) {
    const int r = i / kGeometryWords, w = i % kGeometryWords;
    const uint64_t* word = cx.local_u64(cx.ws.geometry, i);
    const WaitFor from(cx.hd, op, r);  // hybrid mode: relayed words name their relayer too
    ok = commkit::wait_tag_ge(word, uint32_t(E), cx.timeout_ns, cx.rec, from.op, cx.tr.rank, from.peer);
    if (ok && uint32_t(commkit::ld_relaxed(word)) != dispatch_geometry_word(p, w))
      atomicMin(reinterpret_cast<unsigned*>(mismatch), unsigned(i));  // -1 is the largest: the lowest is named
  }
  return !__syncthreads_or(!ok);
}

// True when notify refused this dispatch (a peer's geometry differs, or a peer's word here was
// corrupted): no rows came and the push ended the operation, so its epoch is now E - 1 (or E while a
// push beside this kernel is still finishing). The kernels after the push then return at once.
__device__ bool dispatch_refused(const Ctx& cx, uint64_t E) {
  const uint64_t w = commkit::ld_relaxed(cx.counter_u64(kCtrDispatchOutcome));
  return (w & 3u) == kNotifyRefused && ((w >> 2) == E || (w >> 2) + 1u == E);
}

// "Entered epoch E" to rank r (one thread per peer): a store over NVLink, or in hybrid mode to a rail
// peer a value put over the scale-out transport (the word needs no ordering: it says this rank's
// earlier kernels, which the stream ordered before this one, finished with the buffer).
template <class SO>
__device__ void publish_entry(const Ctx& cx, const SO& so, int r, uint64_t E) {
  const uint64_t at = cx.ws.barrier_signal.offset + 8ull * cx.tr.rank;
  if (!cx.hd.on || cx.hd.local(r))
    cx.tr.signal(r, at, E);
  else if (cx.hd.hears_from(r))
    so.put_value(r, at, E);
}
// Waits (thread r) until rank r entered epoch E, for every rank this one hears from.
__device__ bool wait_entry(const Ctx& cx, int r, uint64_t E, uint32_t op) {
  if (r >= cx.tr.num_ranks || !cx.hd.hears_from(r)) return true;
  return commkit::wait_ge(cx.local_u64(cx.ws.barrier_signal, r), E, cx.timeout_ns, cx.rec, op, cx.tr.rank, r);
}

// Entry barrier of an operation. Block 0 publishes the epoch to every peer this rank writes to; every
// block waits until every peer that writes to this rank published theirs (hybrid mode: the own domain
// and the rail peers). Returns false (in every thread) when a deadline expired.
template <class SO>
__device__ bool entry_barrier(const Ctx& cx, const SO& so, uint64_t E, uint32_t op, bool publish) {
  if (publish && int(threadIdx.x) < cx.tr.num_ranks) publish_entry(cx, so, threadIdx.x, E);
  const bool ok = wait_entry(cx, threadIdx.x, E, op);
  return !__syncthreads_or(!ok);
}

// Called by every block at its end: the last block to finish runs `last` (thread 0 only). Arrivals
// are ordered at system scope: the blocks' stores include remote ones.
template <typename Last>
__device__ void grid_finish(const Ctx& cx, CounterSlot slot, Last&& last) {
  if (commkit::grid_arrive_last<true>(&cx.counters[slot]) && threadIdx.x == 0) {
    __threadfence_system();
    last();
  }
}

__device__ __forceinline__ int owner_of(int64_t e, int num_experts, int num_local) {
  return (e >= 0 && e < num_experts) ? int(e) / num_local : -1;  // 32-bit division: e < 2^31 here
}

// True on lane k (< K) when lane k is the first lane of the row with its (non-negative) owner.
__device__ __forceinline__ bool is_master_lane(int owner, int K) {
  const int lane = lane_id();
  bool master = owner >= 0 && lane < K;
  for (int j = 0; j < K; ++j) {
    const int oj = __shfl_sync(kFull, owner, j);
    if (j < lane && oj == owner) master = false;
  }
  return master;
}

// Exclusive prefix sum of one int per thread over a whole kThreads block; every thread must call it.
// `scratch`: __shared__ int[kWarps]. Returns this thread's exclusive prefix. Replaces serial loops of
// one thread over up to 256 entries, which held the other 1023 threads at the next barrier (~8 us).
__device__ int block_exclusive_scan(int v, int* scratch) {
  static_assert(kWarps == 32, "one warp scans the per-warp totals");
  static_assert(kMaxRanks <= kThreads && kMaxLocalExperts <= kThreads, "one entry per thread");
  const int lane = lane_id(), warp = threadIdx.x / 32;
  int x = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(kFull, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = scratch[lane];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int y = __shfl_up_sync(kFull, w, d);
      if (lane >= d) w += y;
    }
    scratch[lane] = w;
  }
  __syncthreads();
  const int before = warp > 0 ? scratch[warp - 1] : 0;
  __syncthreads();  // scratch can be reused right away
  return before + x - v;
}

}  // namespace
}  // namespace elastic_ep
