// elastic_ep/csrc/kernels.cu -- direct-mode (one NVLink domain) dispatch, combine and barrier kernels.
//
// Every operation (barrier, dispatch, combine) has an epoch E = 1 + the epoch stored in this rank's
// workspace; the operation's last kernel stores E when it finishes. All ranks run the same sequence of
// operations, so their epochs agree, and since the epoch lives on the device, CUDA-graph replays
// advance it too. Signals are monotonic u64 words compared with >=, so the workspace never needs to be
// cleared again after creation. Each operation begins with an entry barrier: a rank writes into a
// peer's buffer only after the peer published "entered epoch E", which it does after its previous
// operation's kernels finished reading the (aliased) buffer.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstring>
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

// --------------------------------------------------------------------------------------- set-up
__global__ void resolve_peers_kernel(ncclWindow_t win, int n, void** out, int* info) {
  const int p = threadIdx.x + blockIdx.x * blockDim.x;
  if (p < n) out[p] = ncclGetLsaPointer(win, 0, p);
}

// -------------------------------------------------------------------------------------- barrier
__global__ void __launch_bounds__(kMaxRanks) barrier_kernel(CommView c) {
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  if (!entry_barrier(cx, E, kOpBarrier, true)) return;
  if (threadIdx.x == 0) cx.end_epoch(E);
}

// ------------------------------------------------------------------------------ dispatch: notify
// Notify's last block ends with its outcome (every thread of the block calls this, once).
__device__ void notify_outcome(const Ctx& cx, uint64_t E, NotifyStatus status) {
  __syncthreads();  // the block's stores (prefix sums, host counts) precede the release below
  if (threadIdx.x == 0) commkit::st_release_gpu(cx.counter_u64(kCtrDispatchOutcome), (E << 2) | uint64_t(status));
}

// Slots: a token bound for rank r gets slot = number of earlier tokens of this rank bound for r (a
// token counts once per rank, however many of its experts live there).
// Grid: notify_split(T).blocks blocks (1 in cached mode), block b counting the tokens of its range
// [b * span, (b+1) * span). A block writes slots relative to its range and its per-rank totals to the
// workspace; the last block to finish turns the totals into per-block bases (which the push kernel
// adds to the slots) and runs the rest alone: counts to the peers, the wait for theirs, the prefix
// sums and the host-visible counts. (One block for all tokens was instruction-bound: 23 us at 4096
// tokens x top-8.)
// KB: compile-time bound on num_topk (8, 16 or 32), so the per-element arrays below live in registers.
// Dynamic shared memory: two [kWarps][R] u32 arrays, 256 * R bytes (sized in launch_dispatch).
template <int KB>
__global__ void __launch_bounds__(kThreads, 1) dispatch_notify_kernel(CommView c, DispatchParams p) {
  __shared__ int expert_cnt[kMaxExperts];
  __shared__ uint8_t owner_tab[kMaxExperts];  // owner rank of each expert (a division per id otherwise)
  __shared__ int running[kMaxRanks];
  __shared__ unsigned int s_bad_ids;
  __shared__ long long s_bad_example;
  __shared__ int scan_scratch[kWarps];
  extern __shared__ uint32_t notify_dyn[];
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  const int R = c.num_ranks, rank = c.rank, K = p.num_topk, T = p.num_tokens;
  const int L = p.num_experts / R;
  const int tid = threadIdx.x, lane = lane_id(), warp = tid / 32;
  // wmask[w][r]: bit j set when token j of warp w's 32 tokens (of the current chunk) goes to rank r.
  // wpre[w][r]:  slot at rank r of the first such token.
  uint32_t* wmask = notify_dyn;
  int* wpre = reinterpret_cast<int*>(notify_dyn + kWarps * R);

  // Publish "entered E" first so peers can start while we count.
  if (blockIdx.x == 0 && tid < R) cx.tr.signal(tid, cx.ws.barrier_signal.offset + 8ull * rank, E);
  // The push may be this grid's programmatic dependent (launch_dispatch): it may launch once every
  // block of this grid has started, and then waits for kCtrDispatchReady itself.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

  if (!p.cached) {
    static_assert(kMaxRanks <= 256, "owner_tab holds ranks in 8 bits");
    for (int i = tid; i < p.num_experts; i += kThreads) {
      expert_cnt[i] = 0;
      owner_tab[i] = static_cast<uint8_t>(i / L);
    }
    for (int i = tid; i < R; i += kThreads) running[i] = 0;
    if (tid == 0) s_bad_ids = 0u;
    __syncthreads();
    // Token of element q within its warp, q / K, as a multiply by ceil(2^32 / K): exact for every
    // q < 32 * KB <= 1024 and K <= 32 (checked exhaustively), and a tenth of a division's instructions.
    // (floor((2^32 - 1) / K) + 1 is that ceiling for every K >= 1, with a 32-bit division.)
    const uint64_t k_magic = uint64_t(0xffffffffu / unsigned(K)) + 1u;
    // Every global access of the [T, K] arrays is warp-coalesced: warp w of a chunk owns tokens
    // wbase .. wbase+31, whose K ids are the 32*K consecutive elements wbase*K + q; lane q%32 holds
    // element q in round q/32, i.e. id q%K of token q/K of the warp. The per-rank token sets of the
    // warp are built as 32-bit masks (a warp OR-reduction per rank, or shared atomics when R > 32),
    // and every element finds its slot from its owner's mask, without moving ids between lanes.
    // (The previous version moved the ids into a token-per-lane layout and back, with K*K shuffles
    // per direction and element.)
    const NotifySplit split = notify_split(T);
    const int tok_begin = int(blockIdx.x) * split.span;
    const int tok_end = T < tok_begin + split.span ? T : tok_begin + split.span;
    const int64_t n_elems = int64_t(tok_end) * K;
    const bool by_reduction = R <= 32 && !p.notify_atomic_masks;
    static_assert(kNotifyChunkTokens == kThreads, "a chunk is one token per thread");
    for (int base = tok_begin; base < tok_end; base += kThreads) {
      const int64_t wfirst = int64_t(base + warp * 32) * K;  // first element of this warp's tokens
      if (!by_reduction)
        for (int i = lane; i < R; i += 32) wmask[warp * R + i] = 0u;  // only this warp touches its row
      __syncwarp();
      // Element round*32 + lane: -1 when masked / invalid / past the end, else (token within the
      // warp << 16) | owner rank, one packed register per element.
      int ot[KB];
      // Elements q of this warp exist for q < rem; indices and bounds are 32-bit from here on.
      const int rem = int(n_elems - wfirst < int64_t(32 * KB) ? n_elems - wfirst : int64_t(32 * KB));
      const int64_t* src = p.topk_idx + wfirst + lane;
      int64_t* copy = p.copied_topk_idx != nullptr ? p.copied_topk_idx + wfirst + lane : nullptr;
      // Loads in groups of G, each group issued before any store: the copy into
      // copied_topk_idx may alias topk_idx as far as the compiler knows, so interleaved load/store
      // pairs would serialise one memory round trip per element in this single block.
      constexpr int G = KB < 8 ? KB : 8;
#pragma unroll
      for (int it0 = 0; it0 < KB; it0 += G) {
        int64_t ev[G];
#pragma unroll
        for (int j = 0; j < G; ++j) {
          const int it = it0 + j;
          ev[j] = (it < K && it * 32 + lane < rem) ? src[it * 32] : -1;
        }
#pragma unroll
        for (int j = 0; j < G; ++j) {
          const int it = it0 + j;
          const int q = it * 32 + lane;
          ot[it] = -1;
          if (it < K && q < rem) {
            const int64_t e = ev[j];
            if (copy != nullptr) copy[it * 32] = e;
            if (e >= 0 && e < p.num_experts) {
              const int tok = int((uint64_t(q) * k_magic) >> 32);
              ot[it] = (tok << 16) | int(owner_tab[e]);
              atomicAdd(&expert_cnt[e], 1);
            } else if (e != -1) {
              atomicAdd(&s_bad_ids, 1u);
              s_bad_example = static_cast<long long>(e);
            }
          }
        }
      }
      if (by_reduction) {
        for (int r = 0; r < R; ++r) {
          uint32_t bits = 0u;
#pragma unroll
          for (int it = 0; it < KB; ++it)
            if (ot[it] >= 0 && (ot[it] & 0xffff) == r) bits |= 1u << (ot[it] >> 16);
          const uint32_t m = __reduce_or_sync(kFull, bits);
          if (lane == 0) wmask[warp * R + r] = m;
        }
      } else {
#pragma unroll
        for (int it = 0; it < KB; ++it)
          if (ot[it] >= 0) atomicOr(&wmask[warp * R + (ot[it] & 0xffff)], 1u << (ot[it] >> 16));
      }
      __syncthreads();
      // Slot bases: per rank, an exclusive scan over the warps (one warp per rank, lane = warp).
      static_assert(kWarps == 32, "one lane per warp");
      for (int r = warp; r < R; r += kWarps) {
        const int c = __popc(wmask[lane * R + r]);
        int incl = c;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
          const int y = __shfl_up_sync(kFull, incl, d);
          if (lane >= d) incl += y;
        }
        const int base_r = running[r];
        wpre[lane * R + r] = base_r + incl - c;
        __syncwarp();
        if (lane == 31) running[r] = base_r + incl;
      }
      __syncthreads();
      int* slots = p.slot_idx + wfirst + lane;
#pragma unroll
      for (int it = 0; it < KB; ++it) {
        if (it < K && it * 32 + lane < rem) {
          int v = -1;
          if (ot[it] >= 0) {
            const int r = ot[it] & 0xffff;
            v = wpre[warp * R + r] + __popc(wmask[warp * R + r] & ((1u << (ot[it] >> 16)) - 1u));
          }
          slots[it * 32] = v;
        }
      }
      __syncthreads();  // wmask / wpre are rewritten by the next chunk
    }
    // This block's share to the workspace, then the last block to arrive goes on alone.
    uint32_t* g_expert = cx.ws.notify_expert.at<uint32_t>(c.window_base);
    uint32_t* g_block_cnt = cx.ws.notify_block_cnt.at<uint32_t>(c.window_base);
    uint32_t* g_block_base = cx.ws.notify_block_base.at<uint32_t>(c.window_base);
    unsigned long long* g_bad = cx.ws.notify_bad.at<unsigned long long>(c.window_base);
    for (int e = tid; e < p.num_experts; e += kThreads)
      if (expert_cnt[e] != 0) atomicAdd(&g_expert[e], uint32_t(expert_cnt[e]));
    for (int r = tid; r < R; r += kThreads) g_block_cnt[blockIdx.x * R + r] = uint32_t(running[r]);
    if (tid == 0 && s_bad_ids != 0u) {
      g_bad[1] = static_cast<unsigned long long>(s_bad_example);  // any block's example will do
      atomicAdd(&g_bad[0], static_cast<unsigned long long>(s_bad_ids));
    }
    // The stores and atomics above are GPU-local: GPU-scope arrival.
    if (!commkit::grid_arrive_last<false>(&cx.counters[kCtrDispatchNotify])) return;
    // L2 reads (__ldcg): the other blocks' data never passed through this SM's L1.
    for (int r = tid; r < R; r += kThreads) {
      uint32_t acc = 0;
      for (int b = 0; b < int(gridDim.x); ++b) {
        g_block_base[b * R + r] = acc;
        acc += __ldcg(&g_block_cnt[b * R + r]);
      }
      running[r] = int(acc);
    }
    // Every slot is final once the bases are written: a push running beside this kernel starts now,
    // while this block exchanges the counts.
    __syncthreads();
    if (tid == 0) commkit::st_release_gpu(cx.counter_u64(kCtrDispatchReady), E);
    for (int e = tid; e < p.num_experts; e += kThreads) {
      expert_cnt[e] = int(__ldcg(&g_expert[e]));
      g_expert[e] = 0u;  // the workspace stays zeroed for the next dispatch
    }
    // Ids outside [-1, E). With a CPU sync (refuse_bad_ids) the whole dispatch is refused: this rank
    // flags its count words to the peers, every rank sees the flag after the count exchange, nobody
    // pushes, and every host raises. Without a CPU sync such ids were sent nowhere (as if masked) and
    // the host learns of them from a running total it compares with what it last saw (one writer:
    // notify kernels run one after another on the communication stream).
    __shared__ unsigned long long s_bad_total;
    if (tid == 0) {
      const unsigned long long bad = __ldcg(&g_bad[0]);
      s_bad_total = bad;
      if (bad != 0ull && p.refuse_bad_ids) {
        uint64_t* ids = host_workspace_layout().ids.at<uint64_t>(c.host_workspace);
        ids[1] = static_cast<uint64_t>(__ldcg(&g_bad[1]));
        commkit::st_release(&ids[0], (uint64_t(p.host_tag) << 32) | uint64_t(bad & 0x7fffffffull));
        g_bad[0] = 0ull;
      } else if (bad != 0ull) {
        uint64_t* ids = host_workspace_layout().ids.at<uint64_t>(c.host_workspace);
        ids[3] = static_cast<uint64_t>(__ldcg(&g_bad[1]));
        commkit::st_release(&ids[2], commkit::ld_relaxed(&ids[2]) + uint64_t(bad));
        g_bad[0] = 0ull;
      }
    }
    __syncthreads();
    // Counts to the peers: (tag << 32) | count with tag = E mod 2^32 (compared in serial-number order,
    // commkit::wait_tag_ge), one self-contained word each. The receiver validates every word by its
    // tag and reads nothing else they would have to order, so plain stores
    // do; a release per word is not needed (replacing it changed nothing measurable at EP 1, where
    // the stores are local; over NVLink it saves one system fence per word).
    const uint64_t refuse_bit = (p.refuse_bad_ids && s_bad_total != 0ull) ? kRefusedBit : 0ull;
    const uint64_t tag = uint64_t(uint32_t(E)) << 32;
    for (int r = tid; r < R; r += kThreads)
      cx.tr.put_u64(r, cx.ws.rank_count.offset + 8ull * rank, tag | refuse_bit | uint64_t(running[r]));
    for (int e = tid; e < p.num_experts; e += kThreads) {
      const int r = e / L, l = e % L;
      cx.tr.put_u64(r, cx.ws.expert_count.offset + 8ull * (rank * L + l), tag | uint64_t(expert_cnt[e]));
    }
  }

  // Wait for every peer: entry barrier, then (non-cached) its counts. The push kernel learns the
  // outcome from kCtrDispatchOutcome (one host-flag read here instead of one per push block).
  bool ok = tid != 0 || !commkit::aborted(cx.rec);
  if (tid < R && ok)
    ok = commkit::wait_ge(cx.local_u64(cx.ws.barrier_signal, tid), E, cx.timeout_ns, cx.rec, kOpDispatchNotify,
                          rank, tid);
  bool failed = __syncthreads_or(!ok);
  if (failed || p.cached) {
    notify_outcome(cx, E, failed ? kNotifyFailed : kNotifyOk);
    return;
  }
  for (int s = tid; s < R && ok; s += kThreads)
    ok = commkit::wait_tag_ge(cx.local_u64(cx.ws.rank_count, s), uint32_t(E), cx.timeout_ns, cx.rec,
                              kOpDispatchNotify, rank, s);
  for (int i = tid; i < R * L && ok; i += kThreads)
    ok = commkit::wait_tag_ge(cx.local_u64(cx.ws.expert_count, i), uint32_t(E), cx.timeout_ns, cx.rec,
                              kOpDispatchNotify, rank, i / L);
  failed = __syncthreads_or(!ok);
  if (failed) {
    notify_outcome(cx, E, kNotifyFailed);
    return;
  }

  // Reuse the shared arrays: running[] = tokens from each source, expert_cnt[] = aligned per local expert.
  const int A = p.expert_alignment;
  const auto hl = host_workspace_layout();
  auto* host_rank = hl.rank_count.at<uint64_t>(c.host_workspace);
  auto* host_expert = hl.expert_count.at<uint64_t>(c.host_workspace);
  const uint64_t tag = uint64_t(p.host_tag) << 32;
  bool refused = false;
  for (int s = tid; s < R; s += kThreads) {
    const uint64_t w = *cx.local_u64(cx.ws.rank_count, s);
    running[s] = int(w & kCountMask);
    refused |= (w & kRefusedBit) != 0ull;
  }
  if (__syncthreads_or(refused)) {
    // Refused everywhere alike (every rank saw the same flags): no push, no counts, no statistics.
    // The host learns which ranks refused from the flagged words and raises.
    for (int s = tid; s < R; s += kThreads)
      commkit::st_relaxed(&host_rank[s], tag | (*cx.local_u64(cx.ws.rank_count, s) & kRefusedBit));
    for (int l = tid; l < L; l += kThreads) commkit::st_relaxed(&host_expert[l], tag);
    notify_outcome(cx, E, kNotifyRefused);
    return;
  }
  for (int l = tid; l < L; l += kThreads) {
    int u = 0;
    for (int s = 0; s < R; ++s) u += int(*cx.local_u64(cx.ws.expert_count, s * L + l) & 0xffffffffu);
    p.unaligned_expert[l] = u;
    if (p.cumulative_stats != nullptr) p.cumulative_stats[l] += u;
    expert_cnt[l] = (u + A - 1) / A * A;
  }
  __syncthreads();
  {
    const int nr = tid < R ? running[tid] : 0;
    const int pr = block_exclusive_scan(nr, scan_scratch);
    if (tid < R) p.psum_rank[tid] = pr + nr;
    const int ne = tid < L ? expert_cnt[tid] : 0;
    const int pe = block_exclusive_scan(ne, scan_scratch);
    if (tid < L) p.psum_expert[tid + 1] = pe + ne;
    if (tid == 0) p.psum_expert[0] = 0;
  }
  // Host-visible counts last: the CPU allocates outputs from them. Each word carries the call's tag,
  // so the host validates every word on its own and no ordering between them is needed: relaxed
  // stores from many threads, not a serial loop of release stores (each a system-scope fence over
  // PCIe, ~1 us apiece: 0.25 ms for 256 experts).
  for (int s = tid; s < R; s += kThreads) commkit::st_relaxed(&host_rank[s], tag | uint64_t(running[s]));
  for (int l = tid; l < L; l += kThreads) commkit::st_relaxed(&host_expert[l], tag | uint64_t(expert_cnt[l]));
  notify_outcome(cx, E, kNotifyOk);
}

// -------------------------------------------------------------------------------- dispatch: push
// One warp per token: its record goes to every destination rank's area [src = this rank][slot].
// Two launches (launch_dispatch):
//   * beside notify (p.concurrent_notify: a programmatic dependent launch). Each block waits for the
//     final slots (kCtrDispatchReady; not in cached mode, whose slots come from the handle) and for
//     the entry barrier itself, so the push overlaps notify's count exchange, prefix sums and host
//     stores. Notify's outcome is read by the last block only. A dispatch that notify then finds
//     refused has pushed rows that nobody reads (no epilogue runs); harmless, as every peer had
//     entered this epoch.
//   * after notify (the overlapped dispatch, or ELASTIC_EP_DISPATCH_PDL=0): notify's outcome is final,
//     read once per block, and a refused or failed dispatch pushes nothing (the overlapped epilogue's
//     arrival counters must not count rows of a dispatch that has no epilogue).
// Flags come from device memory: reading the host-mapped timeout flag instead cost ~4.5 ms per
// dispatch at 132 SMs when every thread read it, and still grew by ~1 us per block when one thread did.
__global__ void __launch_bounds__(kThreads, 1) dispatch_push_kernel(CommView c, DispatchParams p) {
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  const int R = c.num_ranks, rank = c.rank, K = p.num_topk, T = p.num_tokens;
  const int L = p.num_experts / R;
  const int tid = threadIdx.x, lane = lane_id();
  const auto tl = dispatch_token_layout(p.hidden_bytes, 1, p.num_sf_packs, K);
  const int n16 = p.hidden_bytes / 16;
  __shared__ int block_skip;  // after notify: its status; beside it: 1 when this block's waits failed
  if (!p.concurrent_notify) {
    if (tid == 0) {
      const uint64_t w = commkit::ld_relaxed(cx.counter_u64(kCtrDispatchOutcome));
      block_skip = (w >> 2) == E ? int(w & 3u) : int(kNotifyFailed);
    }
    __syncthreads();
  } else {
    // (No read of the host-mapped timeout flag up front, which costs ~1 us per block: a pending
    // timeout makes notify's outcome "failed", and the waits below notice it if they spin.)
    bool ready = true;
    if (tid == 0 && !p.cached)
      ready = commkit::wait_ge(cx.counter_u64(kCtrDispatchReady), E, cx.arrival_timeout(), cx.rec, kOpDispatchNotify,
                               rank, rank);
    // (Block-uniform short circuit: the entry barrier runs in every thread or in none.)
    const bool failed = __syncthreads_or(!ready) || !entry_barrier(cx, E, kOpDispatchNotify, false);
    if (tid == 0) {
      block_skip = failed ? 1 : 0;
      if (failed) commkit::st_relaxed(&cx.counters[kCtrDispatchPushFailed], 1u);
    }
    __syncthreads();
  }
  if (!block_skip) {
    const int gw = blockIdx.x * kWarps + threadIdx.x / 32, nw = gridDim.x * kWarps;
    // A fresh notify left slots relative to its block's token range; the range's base is added here
    // and the final slot written back (the handle's dst_buffer_slot_idx, reused by cached calls).
    const uint32_t* block_base = cx.ws.notify_block_base.at<uint32_t>(c.window_base);
    const int span = notify_split(T).span;
    for (int t = gw; t < T; t += nw) {
      int64_t e = -1;
      int slot = -1;
      float w = 0.f;
      if (lane < K) {
        e = p.topk_idx[int64_t(t) * K + lane];
        slot = __ldcg(&p.slot_idx[int64_t(t) * K + lane]);  // written by notify, maybe while this kernel ran
        if (p.topk_weights != nullptr) w = p.topk_weights[int64_t(t) * K + lane];
      }
      const int owner = owner_of(e, p.num_experts, L);
      if (!p.cached && owner >= 0) {
        slot += int(__ldcg(&block_base[(t / span) * R + owner]));
        p.slot_idx[int64_t(t) * K + lane] = slot;
      }
      const bool master = is_master_lane(owner, K);
      const unsigned dests = __ballot_sync(kFull, master);
      if (dests == 0) continue;
      // The row itself only goes to other ranks: the epilogue reads this rank's own tokens straight
      // from x (one HBM round trip less; at EP 1 the push then moves no hidden bytes at all).
      const unsigned xdests = dests & ~__ballot_sync(kFull, master && owner == rank);
      // Record base offset per destination lane (valid on master lanes).
      const uint64_t my_off = cx.buf + (uint64_t(rank) * p.num_max_tokens_per_rank + uint64_t(slot < 0 ? 0 : slot)) *
                                           tl.bytes;
      const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(p.x) + int64_t(t) * p.hidden_bytes);
      // Hidden bytes: read once, store to every destination.
      constexpr int U = 4;
      for (int i0 = 0; xdests != 0 && i0 < n16; i0 += 32 * U) {
        int4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int i = i0 + u * 32 + lane;
          if (i < n16) v[u] = ld_nc_v4(src + i);
        }
        for (unsigned d = xdests; d; d &= d - 1) {
          const int k = __ffs(d) - 1;
          const int r = __shfl_sync(kFull, owner, k);
          const uint64_t off = __shfl_sync(kFull, my_off, k);
          const auto dst = cx.tr.dest(r, off + tl.x.offset);  // resolved once per chunk
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int i = i0 + u * 32 + lane;
            if (i < n16) cx.tr.put_v4(dst, uint64_t(i), v[u]);
          }
        }
      }
      for (unsigned d = dests; d; d &= d - 1) {
        const int k = __ffs(d) - 1;
        const int r = __shfl_sync(kFull, owner, k);
        const uint64_t off = __shfl_sync(kFull, my_off, k);
        for (int j = lane; r != rank && j < p.num_sf_packs; j += 32) {
          const uint32_t v =
              static_cast<const uint32_t*>(p.sf)[int64_t(t) * p.sf_token_stride + int64_t(j) * p.sf_hidden_stride];
          cx.tr.put_u32(r, off + tl.sf.offset + 4ull * j, v);
        }
        if (lane < K) {
          cx.tr.put_u32(r, off + tl.topk_idx.offset + 4ull * lane, uint32_t(int32_t(owner >= 0 ? e : -1)));
          cx.tr.put_u32(r, off + tl.topk_weights.offset + 4ull * lane, __float_as_uint(w));
        }
        if (lane == 0) cx.tr.put_u32(r, off + tl.src_meta.offset, uint32_t(rank * p.num_max_tokens_per_rank + t));
      }
      if (p.overlap) {
        // Every destination's record is complete: count it into the receiver's arrival counter of
        // its slot chunk (the release covers the whole warp's stores after the __syncwarp).
        __syncwarp();
        if (master) {
          const uint64_t counter =
              uint64_t(rank) * arrive_chunks(p.num_max_tokens_per_rank) + uint64_t(slot / kArriveTokens);
          commkit::red_add_release(
              reinterpret_cast<uint32_t*>(cx.tr.remote(owner, cx.ws.arrive.offset + 4ull * counter)), 1u);
        }
      }
    }
  }
  grid_finish(cx, kCtrDispatchPush, [&] {
    const bool push_failed = commkit::ld_relaxed(&cx.counters[kCtrDispatchPushFailed]) != 0u;
    if (push_failed) commkit::st_relaxed(&cx.counters[kCtrDispatchPushFailed], 0u);
    uint64_t status = uint64_t(block_skip);
    if (p.concurrent_notify) {
      // Twice the deadline (arrival_timeout): notify's own waits expire first and name the peer.
      const uint64_t* w = cx.counter_u64(kCtrDispatchOutcome);
      status = commkit::wait_ge(w, E << 2, cx.arrival_timeout(), cx.rec, kOpDispatchNotify, rank, rank)
                   ? (commkit::ld_relaxed(w) & 3u)
                   : uint64_t(kNotifyFailed);
    }
    if (status == kNotifyRefused) {
      // Refused: there is no epilogue (the host raises), so the operation ends here. No peer waits
      // for this rank's records, so no done signal either.
      cx.end_epoch(E);
      return;
    }
    // A deadline expired (in notify or in a block's waits): not everything was pushed, so no peer may
    // be told this rank's records are complete; a peer that got past its own notify then times out
    // in its epilogue instead of returning rows this rank never wrote.
    if (status != kNotifyOk || push_failed) return;
    if (p.overlap) return;  // the epilogues wait for arrival counts, not for dispatch_done
    for (int r = 0; r < R; ++r) cx.tr.signal(r, cx.ws.dispatch_done.offset + 8ull * rank, E);
  });
}

// ---------------------------------------------------------------------------- dispatch: epilogue
__global__ void __launch_bounds__(kThreads, 1) dispatch_epilogue_kernel(CommView c, EpilogueParams p) {
  __shared__ int psum[kMaxRanks];
  __shared__ int start[kMaxLocalExperts];
  __shared__ int unal[kMaxLocalExperts];
  __shared__ int scan_scratch[kWarps];
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  const int R = c.num_ranks, rank = c.rank, K = p.num_topk;
  const int L = p.num_experts / R;
  const int tid = threadIdx.x, lane = lane_id();
  const int A = p.expert_alignment;
  bool ok = true;
  // Overlapped: no wait here; each chunk of 32 slots is awaited below as it lands.
  if (tid < R && !p.overlap)
    ok = commkit::wait_ge(cx.local_u64(cx.ws.dispatch_done, tid), E, cx.timeout_ns, cx.rec, kOpDispatchEpilogue,
                          rank, tid);
  if (tid < R) psum[tid] = p.psum_rank[tid];
  if (tid < L) unal[tid] = p.unaligned_expert[tid];
  if (__syncthreads_or(!ok)) return;
  {
    const int aligned = tid < L ? (unal[tid] + A - 1) / A * A : 0;
    const int ex = block_exclusive_scan(aligned, scan_scratch);
    if (tid < L) start[tid] = ex;
  }
  __syncthreads();

  const auto tl = dispatch_token_layout(p.hidden_bytes, 1, p.num_sf_packs, K);
  const int n16 = p.hidden_bytes / 16;
  const int N = psum[R - 1];
  const int M = K + 2;
  int* cursor = cx.ws.expert_cursor.at<int>(c.window_base);
  const int gw = blockIdx.x * kWarps + tid / 32, nw = gridDim.x * kWarps;
  // Row order. Two kernels: row i = psum[s - 1] + slot, grid-stride. Overlapped: chunk_order_at
  // (sizing.hpp), so the epilogue follows every sender's push and does its own rows (whose push only
  // writes metadata) last in each chunk.
  constexpr int CH = kArriveTokens;
  const int chunks = arrive_chunks(p.num_max_tokens_per_rank);
  const uint32_t* arrive = cx.ws.arrive.at<uint32_t>(c.window_base);
  int64_t V = N;
  if (p.overlap) {
    int max_rows = 0;
    for (int r = 0; r < R; ++r) max_rows = max(max_rows, psum[r] - (r > 0 ? psum[r - 1] : 0));
    V = chunk_order_size(R, max_rows);
  }
  for (int64_t v = gw; v < V; v += nw) {
    int s, slot, i;
    if (!p.overlap) {
      i = int(v);
      s = 0;
      while (psum[s] <= i) ++s;
      slot = i - (s > 0 ? psum[s - 1] : 0);
    } else {
      const ChunkPos pos = chunk_order_at(v, R, rank);
      const int ch = pos.chunk;
      s = pos.source;
      slot = pos.slot;
      const int first = s > 0 ? psum[s - 1] : 0, n_s = psum[s] - first;
      if (slot >= n_s) continue;  // warp-uniform
      i = first + slot;
      int arrived = 1;
      if (lane == 0)
        arrived = commkit::wait_ge(&arrive[s * chunks + ch], uint32_t(min(CH, n_s - ch * CH)),
                                   cx.arrival_timeout(), cx.rec, kOpDispatchEpilogue, rank, s, 10, 100)
                      ? 1
                      : 0;
      if (!__shfl_sync(kFull, arrived, 0)) break;
    }
    const char* rec = cx.tr.local(cx.buf + (uint64_t(s) * p.num_max_tokens_per_rank + slot) * tl.bytes);
    // A row of this rank's own comes from x (the push sent only its metadata); a peer's from the record.
    const bool own = s == rank;
    int src_global = 0;
    const char* row = rec + tl.x.offset;
    const uint32_t* sf = reinterpret_cast<const uint32_t*>(rec + tl.sf.offset);
    int64_t sf_step = 1;
    if (own) {
      src_global = *reinterpret_cast<const volatile int*>(rec + tl.src_meta.offset);
      const int64_t t = src_global - int64_t(rank) * p.num_max_tokens_per_rank;
      row = static_cast<const char*>(p.x) + t * p.hidden_bytes;
      sf = static_cast<const uint32_t*>(p.sf) + t * p.sf_token_stride;
      sf_step = p.sf_hidden_stride;
    }
    // A peer's record may have landed during this kernel (overlapped): read it from L2, since an L1
    // line filled earlier for a neighbouring record could be stale.
    const bool in_flight = p.overlap && !own;
    auto copy_row = [&](int64_t dst) {
      int4* out = reinterpret_cast<int4*>(static_cast<char*>(p.recv_x) + dst * p.hidden_bytes);
      if (in_flight)
        warp_copy_v4<4, false, true>(out, reinterpret_cast<const int4*>(row), n16, lane);
      else
        warp_copy_v4<4, false>(out, reinterpret_cast<const int4*>(row), n16, lane);
      for (int j = lane; j < p.num_sf_packs; j += 32)
        static_cast<uint32_t*>(p.recv_sf)[dst * p.recv_sf_token_stride + int64_t(j) * p.recv_sf_hidden_stride] =
            in_flight ? __ldcg(sf + j) : sf[j * sf_step];
    };
    // The row's place does not depend on its metadata: start the copy before those loads, so their
    // latency overlaps it instead of preceding it.
    if (!p.do_expand) copy_row(i);
    int local = -1;
    float w = 0.f;
    if (lane < K) {
      const int e = *reinterpret_cast<const volatile int*>(rec + tl.topk_idx.offset + 4 * lane);
      w = *reinterpret_cast<const volatile float*>(rec + tl.topk_weights.offset + 4 * lane);
      local = (e >= rank * L && e < (rank + 1) * L) ? e - rank * L : -1;
    }
    const unsigned lanes = __ballot_sync(kFull, local >= 0);
    const int master = lanes ? __ffs(lanes) - 1 : 0;
    if (!own) src_global = *reinterpret_cast<const volatile int*>(rec + tl.src_meta.offset);
    int my_row = -1;
    if (!p.do_expand) {
      if (lane < K) {
        p.recv_topk_idx[int64_t(i) * K + lane] = local;
        if (p.recv_topk_weights != nullptr) p.recv_topk_weights[int64_t(i) * K + lane] = local >= 0 ? w : 0.f;
        my_row = local >= 0 ? i : -1;
      }
    } else {
      for (unsigned d = lanes; d; d &= d - 1) {
        const int k = __ffs(d) - 1;
        const int l = __shfl_sync(kFull, local, k);
        int pos = 0;
        if (lane == 0)
          pos = p.cached ? p.recv_src_metadata[int64_t(i) * M + 2 + k] : start[l] + atomicAdd(&cursor[l], 1);
        pos = __shfl_sync(kFull, pos, 0);
        if (lane == k) my_row = pos;
        copy_row(pos);
        const float wk = __shfl_sync(kFull, w, k);
        if (lane == 0 && p.recv_topk_weights != nullptr) p.recv_topk_weights[pos] = wk;
      }
    }
    if (!p.cached) {
      int* meta = p.recv_src_metadata + int64_t(i) * M;
      if (lane == 0) {
        meta[0] = src_global;
        meta[1] = s * K + master;
      }
      if (lane < K) meta[2 + lane] = my_row;
    }
  }

  if (p.do_expand && p.do_zero_padding) {
    // Rows between start + count and the aligned end of each expert's segment.
    int row_base = 0;
    for (int l = 0; l < L; ++l) {
      const int pad = (unal[l] + A - 1) / A * A - unal[l];
      for (int j = gw; j < row_base + pad; j += nw) {
        if (j < row_base) continue;
        const int64_t row = start[l] + unal[l] + (j - row_base);
        int4* dst = reinterpret_cast<int4*>(static_cast<char*>(p.recv_x) + row * p.hidden_bytes);
        for (int q = lane; q < n16; q += 32) dst[q] = make_int4(0, 0, 0, 0);
        for (int q = lane; q < p.num_sf_packs; q += 32)
          static_cast<uint32_t*>(p.recv_sf)[row * p.recv_sf_token_stride + int64_t(q) * p.recv_sf_hidden_stride] = 0;
        if (lane == 0 && p.recv_topk_weights != nullptr) p.recv_topk_weights[row] = 0.f;
      }
      row_base += pad;
    }
  }
  if (p.do_expand && !p.cached && blockIdx.x == 0 && p.psum_expert != nullptr)
    for (int l = tid; l < L; l += kThreads) p.psum_expert[l] = start[l] + unal[l];

  // The last block to finish clears the scratch (expand cursors; overlapped: the arrival counters,
  // every one of which was awaited, so no count is still in flight) and ends the epoch.
  if (!commkit::grid_arrive_last<true>(&cx.counters[kCtrDispatchEpilogue])) return;
  for (int l = tid; l < L; l += kThreads) cursor[l] = 0;
  if (p.overlap)
    for (int j = tid; j < R * chunks; j += kThreads) const_cast<uint32_t*>(arrive)[j] = 0u;
  __syncthreads();
  if (tid == 0) {
    __threadfence_system();
    if (!commkit::aborted(cx.rec)) cx.end_epoch(E);
  }
}

// ------------------------------------------------------------------------------------ combine
// Combine sends every received row back to its origin's receive area [token][slot] (the push) and
// the origin sums its slots per token (the reduce). Two schedules share the per-row and per-token
// code below:
//   * two kernels: the reduce starts after every peer signalled combine_done (the default, and the
//     only one when an event must gate the reduce);
//   * overlapped (p.overlap_push_blocks > 0): one kernel; its first blocks push rows in token-chunk
//     order and count each finished row into the origin's arrival counter of
//     [pushing rank][token / kArriveTokens]; the other blocks reduce a token once every rank
//     holding one of its experts has delivered the whole chunk, so the reduce runs under the push.

// Geometry of one combine, shared by push and reduce.
struct CombineGeom {
  CombineTokenLayout tl;
  int slots;          // slots per token in the receive area
  bool per_rank;      // slot = pushing rank (else the top-k lane)
  int n16;            // 16-byte words per row
  int64_t row_bytes;
  __device__ CombineGeom(const CombineParams& p, int R)
      : tl(combine_token_layout(p.hidden, 2, p.num_topk)),
        slots(combine_num_slots(R, p.num_topk, p.allow_multiple_reduction)),
        per_rank(combine_slot_per_rank(R, p.num_topk, p.allow_multiple_reduction)),
        n16(p.hidden / 8),
        row_bytes(int64_t(p.hidden) * 2) {}
};

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(h[q]);
    acc[2 * q] += f.x;
    acc[2 * q + 1] += f.y;
  }
}
__device__ __forceinline__ void set_bf16x8(float (&acc)[8], const int4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(h[q]);
    acc[2 * q] = f.x;
    acc[2 * q + 1] = f.y;
  }
}
// acc += +0.0f: not an identity in IEEE arithmetic (-0.0 + 0.0 = +0.0), and DeepEP's order adds
// such a term for every lane that carries no partial.
__device__ __forceinline__ void add_zero8(float (&acc)[8]) {
#pragma unroll
  for (int q = 0; q < 8; ++q) acc[q] += 0.f;
}
__device__ __forceinline__ int4 to_bf16x8(const float (&acc)[8]) {
  int4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) h[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
  return v;
}

// Pushes received row i (one warp) into its origin's slot; returns the origin token (t) of the row.
// `s_out`: the origin rank.
__device__ __forceinline__ int combine_push_row(const Ctx& cx, const CombineParams& p, const CombineGeom& g, int i,
                                                int& s_out) {
  const int rank = cx.tr.rank, K = p.num_topk, lane = lane_id();
  const int M = K + 2;
  const char* xb = static_cast<const char*>(p.x);
  const auto& tl = g.tl;
  const int* meta = p.src_metadata + int64_t(i) * M;
  const int gsrc = meta[0];
  const int s = gsrc / p.num_max_tokens_per_rank, t = gsrc % p.num_max_tokens_per_rank;
  const int m = meta[1] % K;
  const int row_k = lane < K ? meta[2 + lane] : -1;
  const unsigned lanes = __ballot_sync(kFull, row_k >= 0);
  const uint64_t base = cx.buf + uint64_t(t) * g.slots * tl.bytes;
  s_out = s;
  if (!p.use_expanded_layout) {
    const uint64_t dst = base + uint64_t(g.per_rank ? rank : m) * tl.bytes;
    if (s != rank)
      cx.tr.put_warp(s, dst + tl.x.offset, xb + int64_t(i) * g.row_bytes, g.row_bytes, lane);
    else if (lane == 0)  // own row: the reduce reads it from x; the slot holds its index
      cx.tr.put_u32(s, dst + tl.x.offset, uint32_t(i));
    if (lane < K) {
      const float w = p.topk_weights != nullptr ? p.topk_weights[int64_t(i) * K + lane] : 0.f;
      cx.tr.put_u32(s, dst + tl.topk_weights.offset + 4ull * lane, __float_as_uint(w));
    }
  } else if (p.allow_multiple_reduction) {
    const uint64_t dst = base + uint64_t(g.per_rank ? rank : m) * tl.bytes;
    if (__popc(lanes) == 1) {
      const int r0 = __shfl_sync(kFull, row_k, __ffs(lanes) - 1);
      cx.tr.put_warp(s, dst + tl.x.offset, xb + int64_t(r0) * g.row_bytes, g.row_bytes, lane);
    } else {
      // Every lane runs every round so the shuffles see the whole warp.
      for (int q0 = 0; q0 < g.n16; q0 += 32) {
        const int q = q0 + lane;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (unsigned d = lanes; d; d &= d - 1) {
          const int rk = __shfl_sync(kFull, row_k, __ffs(d) - 1);
          if (q < g.n16) add_bf16x8(acc, ld_nc_v4(reinterpret_cast<const int4*>(xb + int64_t(rk) * g.row_bytes) + q));
        }
        if (q < g.n16) cx.tr.put_v4(s, dst + tl.x.offset + 16ull * q, to_bf16x8(acc));
      }
    }
    if (lane < K) {
      const float w = (p.topk_weights != nullptr && row_k >= 0) ? p.topk_weights[row_k] : 0.f;
      cx.tr.put_u32(s, dst + tl.topk_weights.offset + 4ull * lane, __float_as_uint(w));
    }
  } else {
    for (unsigned d = lanes; d; d &= d - 1) {
      const int k = __ffs(d) - 1;
      const int rk = __shfl_sync(kFull, row_k, k);
      const uint64_t dst = base + uint64_t(k) * tl.bytes;
      if (s != rank)
        cx.tr.put_warp(s, dst + tl.x.offset, xb + int64_t(rk) * g.row_bytes, g.row_bytes, lane);
      else if (lane == k)
        cx.tr.put_u32(s, dst + tl.x.offset, uint32_t(rk));
      if (lane == k) {
        const float w = p.topk_weights != nullptr ? p.topk_weights[rk] : 0.f;
        cx.tr.put_u32(s, dst + tl.topk_weights.offset + 4ull * k, __float_as_uint(w));
      }
    }
  }
  return t;
}

// Sums token t's slots (one warp) into combined_x and routes its weights back, in DeepEP's order
// (its reference combine), so that the bits match it: an fp32 accumulator starts from the biases
// (bias_0, or bias_0 + bias_1 in fp32), then takes one term per top-k lane in lane order -- the
// partial of the rank whose LAST lane it is (in the per-lane layout every lane's own row), +0.0 at
// every other lane -- and is rounded to BF16 once.
// kInFlight: the slots may have been written during this kernel (overlapped combine), so slot data
// is read from L2 (ld.cg): an L1 line filled earlier for a neighbouring record could be stale.
// scratch: this warp's [64] shared ints: [0, 32) the x row of this rank's own slots (by slot),
// [32, 64) the slot added at each lane (-1: +0.0).
template <bool kInFlight>
__device__ __forceinline__ void combine_reduce_token(const Ctx& cx, const CombineParams& p, const CombineGeom& g,
                                                     int t, int* scratch) {
  const int R = cx.tr.num_ranks, rank = cx.tr.rank, K = p.num_topk, lane = lane_id();
  const int L = p.num_experts / R;
  const auto& tl = g.tl;
  const bool per_lane = !p.allow_multiple_reduction && p.use_expanded_layout;
  // Slots filled by this rank itself hold the index of the row in x instead of the row, except in the
  // expanded multiple-reduction layout, where the push may have summed several rows into one slot.
  const bool own_by_index = !(p.use_expanded_layout && p.allow_multiple_reduction);
  const char* xb = static_cast<const char*>(p.x);
  const int64_t e = lane < K ? p.combined_topk_idx[int64_t(t) * K + lane] : -1;
  const int owner = owner_of(e, p.num_experts, L);
  const bool master = is_master_lane(owner, K);
  int* own_row = scratch;
  int* lane_slot = scratch + 32;
  // First lane with the same owner (the slot of a reduced row in the per-lane layouts), and whether
  // this lane is the last one with its owner (where DeepEP's order adds the owner's partial).
  int master_of = -1;
  bool last = owner >= 0 && lane < K;
  for (int j = K - 1; j >= 0; --j) {
    const int oj = __shfl_sync(kFull, owner, j);
    if (oj == owner && owner >= 0) master_of = j;
    if (j > lane && oj == owner) last = false;
  }
  if (lane < K)
    lane_slot[lane] = per_lane ? (owner >= 0 ? lane : -1) : (last ? (g.per_rank ? owner : master_of) : -1);
  unsigned order;  // bits = the slot indices that hold a partial
  if (g.per_rank)
    order = __reduce_or_sync(kFull, owner >= 0 ? (1u << owner) : 0u);
  else if (per_lane)
    order = __ballot_sync(kFull, owner >= 0);
  else
    order = __ballot_sync(kFull, master);
  const char* base = cx.tr.local(cx.buf + uint64_t(t) * g.slots * tl.bytes);
  unsigned own_slots = 0;
  if (own_by_index) {
    own_slots = g.per_rank ? (order & (1u << rank)) : (order & __ballot_sync(kFull, owner == rank));
    if ((own_slots >> lane) & 1u)
      own_row[lane] = *reinterpret_cast<const volatile int*>(base + uint64_t(lane) * tl.bytes + tl.x.offset);
  }
  __syncwarp();
  const int4* b0 = p.bias0 ? reinterpret_cast<const int4*>(static_cast<const char*>(p.bias0) + int64_t(t) * g.row_bytes)
                           : nullptr;
  const int4* b1 = p.bias1 ? reinterpret_cast<const int4*>(static_cast<const char*>(p.bias1) + int64_t(t) * g.row_bytes)
                           : nullptr;
  int4* out = reinterpret_cast<int4*>(static_cast<char*>(p.combined_x) + int64_t(t) * g.row_bytes);
  // Two 16-byte chunks per lane in flight (q and q + 32): a warp reduces one token at a time and the
  // kernel is bound by load latency, not bandwidth (one chunk in flight: 38 us at EP 1 for 4096
  // tokens). Four in flight spilled at the 64-register limit and was slower (5eb8983).
  auto slot_src = [&](int sl) -> const int4* {
    return ((own_slots >> sl) & 1u) ? reinterpret_cast<const int4*>(xb + int64_t(own_row[sl]) * g.row_bytes)
                                    : reinterpret_cast<const int4*>(base + uint64_t(sl) * tl.bytes + tl.x.offset);
  };
  auto load = [&](int sl, const int4* src) -> int4 {
    if ((own_slots >> sl) & 1u) return ld_nc_v4(src);
    return ld_v4<kInFlight>(src);
  };
  for (int q = lane; q < g.n16; q += 64) {
    const bool two = q + 32 < g.n16;
    float acc0[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float acc1[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    // Start from the biases as DeepEP does (bias_0 itself, not 0 + bias_0: the sign of a zero survives).
    if (b0) {
      set_bf16x8(acc0, ld_nc_v4(b0 + q));
      if (two) set_bf16x8(acc1, ld_nc_v4(b0 + q + 32));
    }
    if (b1) {
      if (b0) {
        add_bf16x8(acc0, ld_nc_v4(b1 + q));
        if (two) add_bf16x8(acc1, ld_nc_v4(b1 + q + 32));
      } else {
        set_bf16x8(acc0, ld_nc_v4(b1 + q));
        if (two) set_bf16x8(acc1, ld_nc_v4(b1 + q + 32));
      }
    }
    for (int k = 0; k < K; ++k) {
      const int sl = lane_slot[k];  // warp-uniform (a shared-memory broadcast)
      if (sl < 0) {
        add_zero8(acc0);
        if (two) add_zero8(acc1);
        continue;
      }
      const int4* src = slot_src(sl);
      const int4 v0 = load(sl, src + q);
      const int4 v1 = two ? load(sl, src + q + 32) : make_int4(0, 0, 0, 0);
      add_bf16x8(acc0, v0);
      if (two) add_bf16x8(acc1, v1);
    }
    out[q] = to_bf16x8(acc0);
    if (two) out[q + 32] = to_bf16x8(acc1);
  }
  if (p.combined_topk_weights != nullptr && lane < K) {
    float w = 0.f;
    if (owner >= 0) {
      const int sl = g.per_rank ? owner : (per_lane ? lane : master_of);
      w = *reinterpret_cast<const volatile float*>(base + uint64_t(sl) * tl.bytes + tl.topk_weights.offset + 4 * lane);
    }
    p.combined_topk_weights[int64_t(t) * K + lane] = w;
  }
  __syncwarp();  // the scratch is rewritten by the warp's next token
}

__global__ void __launch_bounds__(kThreads, 1) combine_push_kernel(CommView c, CombineParams p) {
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  const int R = c.num_ranks, rank = c.rank;
  if (!entry_barrier(cx, E, kOpCombine, blockIdx.x == 0)) return;
  const CombineGeom g(p, R);
  const int N = p.psum_rank[R - 1];
  const int gw = blockIdx.x * kWarps + threadIdx.x / 32, nw = gridDim.x * kWarps;
  for (int i = gw; i < N; i += nw) {
    int s;
    combine_push_row(cx, p, g, i, s);
  }
  grid_finish(cx, kCtrCombinePush, [&] {
    for (int r = 0; r < R; ++r) cx.tr.signal(r, cx.ws.combine_done.offset + 8ull * rank, E);
  });
}

__global__ void __launch_bounds__(kThreads, 1) combine_reduce_kernel(CommView c, CombineParams p) {
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  const int R = c.num_ranks, rank = c.rank, T = p.num_combined_tokens;
  const int tid = threadIdx.x;
  bool ok = true;
  if (tid < R)
    ok = commkit::wait_ge(cx.local_u64(cx.ws.combine_done, tid), E, cx.timeout_ns, cx.rec, kOpCombineReduce, rank,
                          tid);
  if (__syncthreads_or(!ok)) return;
  const CombineGeom g(p, R);
  __shared__ int scratch[kWarps][64];  // [warp]: see combine_reduce_token
  const int gw = blockIdx.x * kWarps + tid / 32, nw = gridDim.x * kWarps;
  for (int t = gw; t < T; t += nw) combine_reduce_token<false>(cx, p, g, t, scratch[tid / 32]);
  grid_finish(cx, kCtrCombineReduce, [&] { cx.end_epoch(E); });
}

// The overlapped combine. Roles go by the order in which blocks start (a ticket), not blockIdx: the
// reduce blocks spin on rows the push blocks deliver, so every push block must already be running,
// whatever else occupies the GPU.
//
// Push order: chunk_order_at (sizing.hpp) over the received rows, row i = psum[s - 1] + slot: every
// pusher starts with a different peer and leaves its own rows last, and a grid-stride walk moves all
// pushers through the origins' token chunks roughly in step (slots are in token order), so the
// reduce can follow.
__global__ void __launch_bounds__(kThreads, 1) combine_overlapped_kernel(CommView c, CombineParams p) {
  __shared__ int s_ticket, s_max_rows;
  __shared__ int psum[kMaxRanks];
  __shared__ int scratch[kWarps][64];  // [warp]: see combine_reduce_token
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  const int R = c.num_ranks, rank = c.rank, K = p.num_topk, T = p.num_combined_tokens;
  const int L = p.num_experts / R;
  const int tid = threadIdx.x, lane = lane_id(), warp = tid / 32;
  const int P = p.overlap_push_blocks;
  const int chunks = arrive_chunks(p.num_max_tokens_per_rank);
  uint32_t* arrive = cx.ws.arrive.at<uint32_t>(c.window_base);
  if (tid == 0) {
    s_ticket = int(atomicAdd(&cx.counters[kCtrCombineTicket], 1u));
    s_max_rows = 0;
  }
  __syncthreads();
  const int ticket = s_ticket;
  const CombineGeom g(p, R);
  if (ticket < P) {
    if (entry_barrier(cx, E, kOpCombine, ticket == 0)) {
      for (int s = tid; s < R; s += kThreads) psum[s] = p.psum_rank[s];
      __syncthreads();
      for (int s = tid; s < R; s += kThreads) atomicMax(&s_max_rows, psum[s] - (s > 0 ? psum[s - 1] : 0));
      __syncthreads();
      constexpr int CH = kArriveTokens;
      const int64_t V = chunk_order_size(R, s_max_rows);
      const int gw = ticket * kWarps + warp, nw = P * kWarps;
      for (int64_t v = gw; v < V; v += nw) {
        const ChunkPos pos = chunk_order_at(v, R, rank);
        const int s = pos.source, slot = pos.slot;
        const int first = s > 0 ? psum[s - 1] : 0;
        if (slot >= psum[s] - first) continue;  // warp-uniform
        int origin;
        const int t = combine_push_row(cx, p, g, first + slot, origin);
        __syncwarp();  // the warp's stores before lane 0's release (see commkit::red_add_release)
        if (lane == 0)
          commkit::red_add_release(reinterpret_cast<uint32_t*>(cx.tr.remote(
                                       origin, cx.ws.arrive.offset + 4ull * (uint64_t(rank) * chunks + t / CH))),
                                   1u);
      }
    }
  } else {
    const int gw = (ticket - P) * kWarps + warp, nw = (int(gridDim.x) - P) * kWarps;
    bool ok = true;
    for (int t = gw; t < T && ok; t += nw) {
      // Wait until every rank holding one of t's experts delivered its rows of t's chunk: as many as
      // the chunk has tokens with an expert on that rank (the push sends one row per such token).
      const int64_t e = lane < K ? p.combined_topk_idx[int64_t(t) * K + lane] : -1;
      const int owner = owner_of(e, p.num_experts, L);
      const unsigned masters = __ballot_sync(kFull, is_master_lane(owner, K));
      const int ch = t / kArriveTokens;
      const int u = ch * kArriveTokens + lane;  // this lane's token of the chunk
      for (unsigned d = masters; d; d &= d - 1) {
        const int r = __shfl_sync(kFull, owner, __ffs(d) - 1);
        bool has = false;
        if (u < T)
          for (int k = 0; k < K && !has; ++k)
            has = owner_of(__ldg(reinterpret_cast<const long long*>(p.combined_topk_idx) + int64_t(u) * K + k),
                           p.num_experts, L) == r;
        const uint32_t expected = __popc(__ballot_sync(kFull, has));
        if (lane == 0 && ok)
          ok = commkit::wait_ge(&arrive[r * chunks + ch], expected, cx.arrival_timeout(), cx.rec, kOpCombineReduce,
                                rank, r, 10, 100);
      }
      ok = __shfl_sync(kFull, ok ? 1 : 0, 0) != 0;
      if (ok) combine_reduce_token<true>(cx, p, g, t, scratch[warp]);
    }
  }
  // Whole grid: the last block to finish clears the arrival counters (every row that counts into
  // them was awaited by some token, so none is still in flight) and ends the operation's epoch.
  if (!commkit::grid_arrive_last<true>(&cx.counters[kCtrCombineOverlapDone])) return;
  for (int i = tid; i < R * chunks; i += kThreads) arrive[i] = 0u;
  __syncthreads();
  if (tid == 0) {
    cx.counters[kCtrCombineTicket] = 0u;
    __threadfence_system();
    // After a timeout the operation did not complete: its epoch is not recorded (as in the other
    // kernels, which return before their last step), and the host reports the record.
    if (!commkit::aborted(cx.rec)) cx.end_epoch(E);
  }
}

int grid_of(int num_sms) { return num_sms > 0 ? num_sms : 1; }

// Zero the GIN requests where the headers have them (compile-time detection across NCCL versions).
template <typename Req>
auto disable_gin(Req& r, int) -> decltype(r.ginContextCount = 0, r.ginSignalCount = 0, r.ginCounterCount = 0,
                                          void()) {
  r.ginContextCount = 0;
  r.ginSignalCount = 0;
  r.ginCounterCount = 0;
}
template <typename Req>
void disable_gin(Req&, long) {}

}  // namespace

int devcomm_create(void* nccl_comm, void** out_devcomm, int* out_lsa_rank, int* out_lsa_size) {
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
  ncclDevCommRequirements reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  // Older 2.28.x headers have no initializer (and no size/magic/version fields): all-zero = LSA only.
  ncclDevCommRequirements reqs;
  memset(static_cast<void*>(&reqs), 0, sizeof(reqs));
#endif
  disable_gin(reqs, 0);
  auto* dc = new ncclDevComm();
  const ncclResult_t res = ncclDevCommCreate(static_cast<ncclComm_t>(nccl_comm), &reqs, dc);
  if (res != ncclSuccess) {
    delete dc;
    return int(res);
  }
  *out_lsa_rank = dc->lsaRank;
  *out_lsa_size = dc->lsaSize;
  *out_devcomm = dc;
  return int(ncclSuccess);
}

void devcomm_destroy(void* nccl_comm, void* devcomm) {
  auto* dc = static_cast<ncclDevComm*>(devcomm);
  ncclDevCommDestroy(static_cast<ncclComm_t>(nccl_comm), dc);
  delete dc;
}

void launch_resolve_peers(void* window, int num_ranks, void** out_peer_bases, int* out_info, void* stream) {
  resolve_peers_kernel<<<1, kMaxRanks, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<ncclWindow_t>(window),
                                                                               num_ranks, out_peer_bases, out_info);
}

void launch_barrier(const CommView& c, void* stream) {
  barrier_kernel<<<1, kMaxRanks, 0, static_cast<cudaStream_t>(stream)>>>(c);
}

void launch_dispatch(const CommView& c, const DispatchParams& p, void* stream, void* notify_done_event) {
  auto s = static_cast<cudaStream_t>(stream);
  static_assert(kMaxTopk == 32, "the notify instantiations below cover num_topk up to 32");
  // notify's per-warp rank masks and slot bases live in dynamic shared memory sized by the rank count
  // (64 KiB at 256 ranks, beyond the 48 KiB a kernel gets without opting in).
  const size_t smem = size_t(2) * kWarps * c.num_ranks * sizeof(uint32_t);
  auto notify = p.num_topk <= 8 ? dispatch_notify_kernel<8>
              : p.num_topk <= 16 ? dispatch_notify_kernel<16> : dispatch_notify_kernel<32>;
  if (smem > 32 * 1024) {
    // Opting in is per device context, and cheap: done on each such launch rather than once.
    const cudaError_t err = cudaFuncSetAttribute(notify, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return;  // the caller's cudaGetLastError() reports it
  }
  notify<<<p.cached ? 1 : notify_split(p.num_tokens).blocks, kThreads, smem, s>>>(c, p);
  if (notify_done_event != nullptr && cudaEventRecord(static_cast<cudaEvent_t>(notify_done_event), s) != cudaSuccess)
    return;  // the caller's cudaGetLastError() reports it
  if (!p.concurrent_notify) {
    dispatch_push_kernel<<<grid_of(p.num_sms), kThreads, 0, s>>>(c, p);
    return;
  }
  // Programmatic dependent launch: the push starts once every notify block has started (notify's
  // griddepcontrol.launch_dependents) instead of when notify ends. Stream capture turns this into a
  // programmatic graph edge. Where the attribute is not honoured the push simply runs after notify.
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(grid_of(p.num_sms)));
  cfg.blockDim = dim3(unsigned(kThreads));
  cfg.dynamicSmemBytes = 0;
  cfg.stream = s;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  (void)cudaLaunchKernelEx(&cfg, dispatch_push_kernel, c, p);  // errors: the caller's cudaGetLastError()
}

void launch_dispatch_epilogue(const CommView& c, const EpilogueParams& p, void* stream) {
  dispatch_epilogue_kernel<<<grid_of(p.num_sms), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(c, p);
}

void launch_combine_push(const CommView& c, const CombineParams& p, void* stream) {
  combine_push_kernel<<<grid_of(p.num_sms), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(c, p);
}

void launch_combine_reduce(const CommView& c, const CombineParams& p, void* stream) {
  combine_reduce_kernel<<<grid_of(p.num_sms), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(c, p);
}

void launch_combine_overlapped(const CommView& c, const CombineParams& p, void* stream) {
  combine_overlapped_kernel<<<grid_of(p.num_sms), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(c, p);
}

}  // namespace elastic_ep
