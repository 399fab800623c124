// elastic_ep/csrc/kernels/dispatch_push.cuh -- dispatch, step 2: one warp per token writes its record into every
// destination rank's receive area.
// Included once, by kernels.cu (the package's one CUDA translation unit).
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
__global__ void __launch_bounds__(kThreads, 1) dispatch_push_kernel(CommView c, DispatchParams p) {
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  const int R = c.num_ranks, rank = c.rank, K = p.num_topk, T = p.num_tokens;
  const int L = p.num_experts / R;
  const int tid = threadIdx.x, lane = lane_id();
  // Zero-copy: records without the hidden bytes, which go to the dense area (sizing.hpp).
  const auto tl = dispatch_token_layout(p.zero_copy ? 0 : p.hidden_bytes, 1, p.num_sf_packs, K);
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

}  // namespace
}  // namespace elastic_ep
