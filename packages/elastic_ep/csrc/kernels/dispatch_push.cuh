// elastic_ep/csrc/kernels/dispatch_push.cuh -- dispatch, step 2: one warp per token writes its record into every
// destination rank's receive area.
// Included once, by launch.cu (the package's one CUDA translation unit).
#pragma once

#include "device_common.cuh"

namespace elastic_ep {
namespace {

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
//
// Hybrid mode (p.num_scaleup_ranks < R; always after notify, never overlapped or zero-copy): the rows
// for this rank's own domain go as above; a token with experts in other domains is staged once in
// this rank's send area with its route (the slot at each lane's owner) and put once per such domain
// into the relay area of this rank's rail peer there, whose forward kernel (kernels/hybrid.cuh)
// writes it where this push would have. The last block signals dispatch_done to the own domain only
// and raises each rail peer's scale-out signal (behind every put: the grid's fence, and for GIN the
// warps' flushes on the one context).
template <class SO>
__device__ __forceinline__ void hybrid_stage_token(const Ctx& cx, const DispatchParams& p, const HybridDomains& hd,
                                                   const DispatchTokenLayout& tl, const HybridDispatchLayout& hl,
                                                   const SO& so, uint64_t E, int t, int64_t e,
                                                   int owner, int slot, float w, unsigned remote) {
  const int lane = lane_id(), K = p.num_topk, rank = cx.tr.rank, M = p.num_max_tokens_per_rank;
  const uint64_t send = cx.buf + uint64_t(hl.send) + uint64_t(t) * uint64_t(hl.staged_bytes);
  char* st = cx.tr.local(send);
  warp_copy_v4<4, true>(reinterpret_cast<int4*>(st + tl.x.offset),
                        reinterpret_cast<const int4*>(static_cast<const char*>(p.x) + int64_t(t) * p.hidden_bytes),
                        p.hidden_bytes / 16, lane);
  for (int j = lane; j < p.num_sf_packs; j += 32)
    reinterpret_cast<uint32_t*>(st + tl.sf.offset)[j] =
        static_cast<const uint32_t*>(p.sf)[int64_t(t) * p.sf_token_stride + int64_t(j) * p.sf_hidden_stride];
  int32_t* route = reinterpret_cast<int32_t*>(st + tl.bytes);
  if (lane < K) {
    reinterpret_cast<int32_t*>(st + tl.topk_idx.offset)[lane] = int32_t(owner >= 0 ? e : -1);
    reinterpret_cast<float*>(st + tl.topk_weights.offset)[lane] = w;
    route[lane] = owner >= 0 ? slot + (p.test_corrupt == 3 ? M : 0) : -1;
  }
  if (lane == 0) {
    const int64_t corrupt = p.test_corrupt == 2 ? int64_t(cx.tr.num_ranks) * M : 0;  // as the direct rows'
    *reinterpret_cast<uint32_t*>(st + tl.src_meta.offset) = uint32_t(rank * M + t + corrupt);
    *reinterpret_cast<uint64_t*>(st + tl.bytes + hybrid_route_stamp_offset(K)) =
        hybrid_stamp(E, uint64_t(hd.dom) * M + t);  // the same at every forwarder: by source domain
  }
  __syncwarp();  // the staged record, written by the whole warp, is the puts' source
  // One put per destination domain (the first remote lane of each domain).
  const bool rem = (remote >> lane) & 1u;
  const unsigned firsts = __ballot_sync(kFull, is_master_lane(rem ? owner / hd.U : -1, K));
  for (unsigned d = firsts; d; d &= d - 1) {
    const int dom = __shfl_sync(kFull, owner, __ffs(d) - 1) / hd.U;
    const uint64_t at = uint64_t(HybridDomains::other_index(hd.dom, dom)) * M + t;  // in that forwarder's relay
    so.put(hd.rail_peer(dom), cx.buf + uint64_t(hl.relay) + at * uint64_t(hl.staged_bytes), send,
           uint64_t(hl.staged_bytes), lane);
  }
}

template <class SO>
__global__ void __launch_bounds__(kThreads, 1) dispatch_impl(CommView c, DispatchParams p,
                                                                    SO so) {  // scale-out transport (hybrid)
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  const int R = c.num_ranks, rank = c.rank, K = p.num_topk, T = p.num_tokens;
  const int L = p.num_experts / R;
  const int tid = threadIdx.x, lane = lane_id();
  // Zero-copy: records without the hidden bytes, which go to the dense area (sizing.hpp).
  const auto tl = dispatch_token_layout(p.zero_copy ? 0 : p.hidden_bytes, 1, p.num_sf_packs, K);
  const int n16 = p.hidden_bytes / 16;
  const HybridDomains& hd = cx.hd;
  const HybridDispatchLayout hl = hybrid_dispatch_layout(tl.bytes, K, R, hd.S, p.num_max_tokens_per_rank);
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
    bool failed = __syncthreads_or(!ready) || !entry_barrier(cx, so, E, kOpDispatchNotify, false);
    // Direct mode: nothing goes to peers before their geometry is known to be this rank's (notify
    // refuses the dispatch on a difference; this block then pushes nothing, like a failed wait).
    __shared__ int s_geometry;
    if (tid == 0) s_geometry = -1;
    __syncthreads();
    if (!failed && !hd.on) failed = !check_geometry(cx, p, E, kOpDispatchNotify, &s_geometry) || s_geometry >= 0;
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
      unsigned dests = __ballot_sync(kFull, master);
      if (hd.on) {
        // This domain's ranks directly; the other domains through their rail peers of this rank.
        const bool here = master && hd.local(owner);
        const unsigned remote = dests & ~__ballot_sync(kFull, here);
        dests &= ~remote;
        const unsigned mask = __reduce_or_sync(kFull, here ? 1u << (owner - hd.dom * hd.U) : 0u);
        if (p.forward_dense != nullptr && lane == 0 && mask != 0u) {
          int* row = p.forward_dense + 2 * (int64_t(hd.dom) * p.num_max_tokens_per_rank + t);
          row[0] = rank * p.num_max_tokens_per_rank + t;
          row[1] = int(mask);
        }
        if (remote != 0u) hybrid_stage_token(cx, p, hd, tl, hl, so, E, t, e, owner, slot, w, remote);
      }
      if (dests == 0) continue;
      // The row itself only goes to other ranks: the epilogue reads this rank's own tokens straight
      // from x (one HBM round trip less; at EP 1 the push then moves no hidden bytes at all). Zero-copy:
      // to every destination, own rank included (the view is all there is).
      const unsigned xdests = p.zero_copy ? dests : dests & ~__ballot_sync(kFull, master && owner == rank);
      // Record base offset per destination lane (valid on master lanes), and where the row goes.
      const uint64_t my_off = cx.buf + (uint64_t(rank) * p.num_max_tokens_per_rank + uint64_t(slot < 0 ? 0 : slot)) *
                                           tl.bytes;
      uint64_t x_off = my_off + tl.x.offset;
      if (p.zero_copy && master)
        x_off = cx.buf + uint64_t(p.zero_copy_x_offset) +
                (uint64_t(__ldcg(&p.direct_base[owner])) + uint64_t(slot)) * uint64_t(p.hidden_bytes);
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
          const uint64_t off = __shfl_sync(kFull, x_off, k);
          const auto dst = cx.tr.dest(r, off);  // resolved once per chunk
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
        if (lane == 0) {
          const int64_t src = int64_t(rank) * p.num_max_tokens_per_rank + t +
                              (p.test_corrupt == 2 && r != rank ? int64_t(R) * p.num_max_tokens_per_rank : 0);
          cx.tr.put_u32(r, off + tl.src_meta.offset, uint32_t(src));
        }
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
    if (hd.on) so.flush(lane);  // GIN: this warp's puts have left before the last block signals
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
    for (int r = hd.dom * hd.U; r < (hd.dom + 1) * hd.U; ++r)
      cx.tr.signal(r, cx.ws.dispatch_done.offset + 8ull * rank, E);
    for (int d = 0; hd.on && !p.test_drop_scaleout_signals && d < hd.S; ++d)
      if (d != hd.dom) so.signal(hd.rail_peer(d), rank, 1u);
  });
}

}  // namespace
}  // namespace elastic_ep
