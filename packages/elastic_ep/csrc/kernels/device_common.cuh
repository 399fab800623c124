// elastic_ep/csrc/kernels/device_common.cuh -- the device context every kernel builds (transport, workspace, deadlines), the
// grid-counter slots, the entry barrier and the small warp/block helpers the kernel families share.
// Included once, by kernels.cu (the package's one CUDA translation unit).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include "commkit/atomics.hpp"
#include "commkit/device_deadline.cuh"
#include "commkit/timeout_record.hpp"
#include "kernels.hpp"
#include "sizing.hpp"
#include "transport.cuh"

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
                   kCtrDispatchOutcome = 12 };
enum NotifyStatus : uint64_t { kNotifyOk = 0, kNotifyFailed = 1, kNotifyRefused = 2 };
static_assert(kCtrEpoch % 2 == 0 && kCtrDispatchReady % 2 == 0 && kCtrDispatchOutcome % 2 == 0,
              "each u64 word needs an 8-byte aligned pair of slots");

struct Ctx {
  LsaTransport tr;
  WorkspaceLayout ws;
  uint64_t buf;  // offset of the buffer in the window
  commkit::TimeoutRecord* rec;
  uint32_t* counters;
  uint64_t timeout_ns;
  __device__ Ctx(const CommView& c)
      : tr{c.peer_bases, c.rank, c.num_ranks},
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

// Entry barrier of an operation. Block 0 publishes the epoch to every peer; every block waits until all
// peers published theirs. Returns false (in every thread) when a deadline expired.
__device__ bool entry_barrier(const Ctx& cx, uint64_t E, uint32_t op, bool publish) {
  const int R = cx.tr.num_ranks;
  bool ok = true;
  if (publish && int(threadIdx.x) < R) cx.tr.signal(threadIdx.x, cx.ws.barrier_signal.offset + 8ull * cx.tr.rank, E);
  if (int(threadIdx.x) < R)
    ok = commkit::wait_ge(cx.local_u64(cx.ws.barrier_signal, threadIdx.x), E, cx.timeout_ns, cx.rec, op, cx.tr.rank,
                          int(threadIdx.x));
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
