// elastic_ep/csrc/kernels/combine.cuh -- combine: the push of rows back to their origin and the reduce in DeepEP's
// order, as two kernels or one overlapped kernel.
// Included once, by launch.cu (the package's one CUDA translation unit).
#pragma once

#include "device_common.cuh"

namespace elastic_ep {
namespace {

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

// Where one received row's slots go: its origin's receive area, or in hybrid mode, for an origin in
// another domain, the stage area of this domain's rail peer of the origin (the origin domain's part,
// by the origin's slot; per-rank slots less this domain's first rank, see sizing.hpp), with each
// filled slot's stamp (hybrid_stamp) set for this combine.
struct PushTarget {
  int peer;
  uint64_t base;   // the token's first slot
  uint64_t tags;   // hybrid stage: the token's first slot stamp (u64 each); 0: none
  uint64_t cell;   // hybrid stage: the index of the token's first slot in the stage area
  int slot_base;   // subtracted from a slot: the stage keeps only this domain's per-rank slots
  bool own;        // the origin is this rank: slots hold the row's index in x (see combine_reduce_token)
};
__device__ __forceinline__ PushTarget push_target(const Ctx& cx, const CombineParams& p, const CombineGeom& g,
                                                  const HybridDomains& hd, int s, int t) {
  if (!hd.on || hd.local(s))
    return PushTarget{s, cx.buf + uint64_t(t) * g.slots * g.tl.bytes, 0, 0, 0, s == cx.tr.rank};
  const int stage_slots =
      int(hybrid_stage_slots(cx.tr.num_ranks, hd.U, p.num_topk, p.allow_multiple_reduction != 0));
  const HybridCombineLayout hc = hybrid_combine_layout(g.tl.bytes, g.slots, stage_slots, hd.S,
                                                       p.num_max_tokens_per_rank);
  const uint64_t cell =
      (uint64_t(HybridDomains::other_index(s / hd.U, hd.dom)) * p.num_max_tokens_per_rank + t) * stage_slots;
  return PushTarget{hd.dom * hd.U + s % hd.U, cx.buf + uint64_t(hc.stage) + cell * g.tl.bytes,
                    cx.buf + uint64_t(hc.tags) + 8ull * cell, cell, g.per_rank ? hd.dom * hd.U : 0, false};
}

// Pushes received row i (one warp) into its origin's slot; returns the origin token (t) of the row.
// `s_out`: the origin rank.
__device__ __forceinline__ int combine_push_row(const Ctx& cx, const CombineParams& p, const CombineGeom& g,
                                                const HybridDomains& hd, uint64_t E, int i, int& s_out) {
  const int rank = cx.tr.rank, K = p.num_topk, lane = lane_id();
  const int M = K + 2;
  const char* xb = static_cast<const char*>(p.x);
  const auto& tl = g.tl;
  const uint32_t own_shift = p.test_corrupt == 4 ? uint32_t(p.num_x_rows) : 0u;  // tests only
  const int* meta = p.src_metadata + int64_t(i) * M;
  const int gsrc = meta[0];
  const int s = gsrc / p.num_max_tokens_per_rank, t = gsrc % p.num_max_tokens_per_rank;
  const int m = meta[1] % K;
  const int row_k = lane < K ? meta[2 + lane] : -1;
  const unsigned lanes = __ballot_sync(kFull, row_k >= 0);
  const PushTarget to = push_target(cx, p, g, hd, s, t);
  const int peer = to.peer;
  const uint64_t base = to.base;
  auto stamp = [&](int slot) {
    if (to.tags != 0) cx.tr.put_u64(peer, to.tags + 8ull * slot, hybrid_stamp(E, to.cell + slot));
  };
  s_out = s;
  if (!p.use_expanded_layout) {
    const int slot = (g.per_rank ? rank : m) - to.slot_base;
    const uint64_t dst = base + uint64_t(slot) * tl.bytes;
    if (!to.own)
      cx.tr.put_warp(peer, dst + tl.x.offset, xb + int64_t(i) * g.row_bytes, g.row_bytes, lane);
    else if (lane == 0)  // own row: the reduce reads it from x; the slot holds its index
      cx.tr.put_u32(peer, dst + tl.x.offset, uint32_t(i) + own_shift);
    if (lane < K) {
      const float w = p.topk_weights != nullptr ? p.topk_weights[int64_t(i) * K + lane] : 0.f;
      cx.tr.put_u32(peer, dst + tl.topk_weights.offset + 4ull * lane, __float_as_uint(w));
    }
    if (lane == 0) stamp(slot);
  } else if (p.allow_multiple_reduction) {
    const int slot = (g.per_rank ? rank : m) - to.slot_base;
    const uint64_t dst = base + uint64_t(slot) * tl.bytes;
    if (__popc(lanes) == 1) {
      const int r0 = __shfl_sync(kFull, row_k, __ffs(lanes) - 1);
      cx.tr.put_warp(peer, dst + tl.x.offset, xb + int64_t(r0) * g.row_bytes, g.row_bytes, lane);
    } else {
      // Every lane runs every round so the shuffles see the whole warp.
      for (int q0 = 0; q0 < g.n16; q0 += 32) {
        const int q = q0 + lane;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (unsigned d = lanes; d; d &= d - 1) {
          const int rk = __shfl_sync(kFull, row_k, __ffs(d) - 1);
          if (q < g.n16) add_bf16x8(acc, ld_nc_v4(reinterpret_cast<const int4*>(xb + int64_t(rk) * g.row_bytes) + q));
        }
        if (q < g.n16) cx.tr.put_v4(peer, dst + tl.x.offset + 16ull * q, to_bf16x8(acc));
      }
    }
    if (lane < K) {
      const float w = (p.topk_weights != nullptr && row_k >= 0) ? p.topk_weights[row_k] : 0.f;
      cx.tr.put_u32(peer, dst + tl.topk_weights.offset + 4ull * lane, __float_as_uint(w));
    }
    if (lane == 0) stamp(slot);
  } else {
    for (unsigned d = lanes; d; d &= d - 1) {
      const int k = __ffs(d) - 1;
      const int rk = __shfl_sync(kFull, row_k, k);
      const uint64_t dst = base + uint64_t(k) * tl.bytes;
      if (!to.own)
        cx.tr.put_warp(peer, dst + tl.x.offset, xb + int64_t(rk) * g.row_bytes, g.row_bytes, lane);
      else if (lane == k)
        cx.tr.put_u32(peer, dst + tl.x.offset, uint32_t(rk) + own_shift);
      if (lane == k) {
        const float w = p.topk_weights != nullptr ? p.topk_weights[rk] : 0.f;
        cx.tr.put_u32(peer, dst + tl.topk_weights.offset + 4ull * k, __float_as_uint(w));
        stamp(k);
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
__device__ __forceinline__ void combine_reduce_token(const Ctx& cx, const CommView& c, const CombineParams& p,
                                                     const CombineGeom& g, int t, int* scratch) {
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
    // The window is writable by every peer: an index outside x is reported and x is not read at it
    // (the slot is then read as the window's bytes, in bounds; the call raises CommError).
    bool outside = false;
    if ((own_slots >> lane) & 1u) {
      const int i = *reinterpret_cast<const volatile int*>(base + uint64_t(lane) * tl.bytes + tl.x.offset);
      outside = i < 0 || i >= p.num_x_rows;
      if (outside) report_protocol_once(cx, c, rank, kProtocolOwnRow, uint32_t(i), uint64_t(p.num_x_rows));
      own_row[lane] = i;
    }
    own_slots &= ~__ballot_sync(kFull, outside);
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

template <class SO>
__global__ void __launch_bounds__(kThreads, 1) combine_impl(CommView c, CombineParams p,
                                                                   SO so) {  // scale-out transport (hybrid: the entry)
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  const int R = c.num_ranks, rank = c.rank;
  if (!entry_barrier(cx, so, E, kOpCombine, blockIdx.x == 0)) return;
  const CombineGeom g(p, R);
  const HybridDomains& hd = cx.hd;
  const int N = p.psum_rank[R - 1];
  const int gw = blockIdx.x * kWarps + threadIdx.x / 32, nw = gridDim.x * kWarps;
  for (int i = gw; i < N; i += nw) {
    int s;
    combine_push_row(cx, p, g, hd, E, i, s);
  }
  // Hybrid mode: the own domain's ranks hold every row this rank pushed (origins there, stage areas
  // of the forwarders), so they are the ones told.
  grid_finish(cx, kCtrCombinePush, [&] {
    for (int r = hd.dom * hd.U; r < (hd.dom + 1) * hd.U; ++r)
      cx.tr.signal(r, cx.ws.combine_done.offset + 8ull * rank, E);
  });
}

template <class SO>
__global__ void __launch_bounds__(kThreads, 1) combine_reduce_epilogue_impl(CommView c, CombineParams p,
                                                                     SO so) {  // scale-out transport (hybrid)
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  const int R = c.num_ranks, rank = c.rank, T = p.num_combined_tokens;
  const int tid = threadIdx.x;
  bool ok = true;
  // Hybrid mode: the own domain's rows come straight from its ranks, the other domains' from their
  // rail peers of this rank (one scale-out signal each, after the combine forward kernels there).
  const HybridDomains& hd = cx.hd;
  if (tid < R && hd.local(tid))
    ok = commkit::wait_ge(cx.local_u64(cx.ws.combine_done, tid), E, cx.timeout_ns, cx.rec, kOpCombineReduce, rank,
                          tid);
  else if (tid < R && tid % hd.U == hd.rail)
    ok = wait_rail_signal(cx, so, tid, kOpCombineScaleout, cx.arrival_timeout());
  if (__syncthreads_or(!ok)) return;
  const CombineGeom g(p, R);
  __shared__ int scratch[kWarps][64];  // [warp]: see combine_reduce_token
  const int gw = blockIdx.x * kWarps + tid / 32, nw = gridDim.x * kWarps;
  for (int t = gw; t < T; t += nw) combine_reduce_token<false>(cx, c, p, g, t, scratch[tid / 32]);
  grid_finish(cx, kCtrCombineReduce, [&] {
    count_rail_signals(cx, hd);
    cx.end_epoch(E);
  });
}

// The overlapped combine. Roles go by the order in which blocks start (a ticket), not blockIdx: the
// reduce blocks spin on rows the push blocks deliver, so every push block must already be running,
// whatever else occupies the GPU.
//
// Push order: chunk_order_at (sizing.hpp) over the received rows, row i = psum[s - 1] + slot: every
// pusher starts with a different peer and leaves its own rows last, and a grid-stride walk moves all
// pushers through the origins' token chunks roughly in step (slots are in token order), so the
// reduce can follow.
__global__ void __launch_bounds__(kThreads, 1) combine_overlapped_impl(CommView c, CombineParams p) {
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
    if (entry_barrier(cx, NoScaleout{}, E, kOpCombine, ticket == 0)) {  // direct mode only
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
        const int t = combine_push_row(cx, p, g, HybridDomains(0, R, rank), E, first + slot, origin);
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
      if (ok) combine_reduce_token<true>(cx, c, p, g, t, scratch[warp]);
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

}  // namespace
}  // namespace elastic_ep
