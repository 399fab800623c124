// elastic_ep/csrc/kernels/dispatch_epilogue.cuh -- dispatch, step 3: copy the received records into the output tensors
// (non-expanded or expanded by expert, padding, scales, metadata).
// Included once, by launch.cu (the package's one CUDA translation unit).
#pragma once

#include "device_common.cuh"

namespace elastic_ep {
namespace {

// ---------------------------------------------------------------------------- dispatch: epilogue
__global__ void __launch_bounds__(kThreads, 1) dispatch_copy_epilogue_impl(CommView c, EpilogueParams p) {
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
  // Notify refused this dispatch (launched without CPU sync, or cached): no rows came.
  if (dispatch_refused(cx, E)) return;
  bool ok = true;
  // Overlapped: no wait here; each chunk of 32 slots is awaited below as it lands.
  // Hybrid mode: another domain's records come from this domain's forwarder on their rail (WaitFor).
  if (tid < R && !p.overlap) {
    const WaitFor from(cx.hd, kOpDispatchEpilogue, tid);
    ok = commkit::wait_ge(cx.local_u64(cx.ws.dispatch_done, tid), E, cx.timeout_ns, cx.rec, from.op, rank, from.peer);
  }
  if (tid < R) psum[tid] = p.psum_rank[tid];
  if (tid < L) unal[tid] = p.unaligned_expert[tid];
  if (__syncthreads_or(!ok)) return;
  {
    const int aligned = tid < L ? (unal[tid] + A - 1) / A * A : 0;
    const int ex = block_exclusive_scan(aligned, scan_scratch);
    if (tid < L) start[tid] = ex;
  }
  __syncthreads();

  const auto tl = dispatch_token_layout(p.zero_copy ? 0 : p.hidden_bytes, 1, p.num_sf_packs, K);
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
      if (p.zero_copy)
        ;  // the push wrote the row in place
      else if (in_flight)
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
    if (!own) {
      src_global = *reinterpret_cast<const volatile int*>(rec + tl.src_meta.offset);
      // A record in source s's area names one of s's tokens; anything else is a corrupted word, which
      // would send combine's rows to a wrong or non-existent rank: reported, and a safe id kept.
      const int64_t first = int64_t(s) * p.num_max_tokens_per_rank;
      if (src_global < first || src_global >= first + p.num_max_tokens_per_rank) {
        if (lane == 0) report_protocol_once(cx, c, s, kProtocolSource, uint64_t(uint32_t(src_global)), uint64_t(s));
        src_global = int(first);
      }
    }
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
        if (lane == 0) {
          if (p.cached) {
            pos = p.recv_src_metadata[int64_t(i) * M + 2 + k];
          } else {
            // Rows past the expert's count come only from records whose ids disagree with the counts
            // their senders sent (a corrupted word): reported, never written past the segment.
            const int n = atomicAdd(&cursor[l], 1);
            pos = n < unal[l] ? start[l] + n : -1;
            if (pos < 0) report_protocol_once(cx, c, s, kProtocolPlacement, uint64_t(l), uint64_t(unal[l]));
          }
        }
        pos = __shfl_sync(kFull, pos, 0);
        if (pos < 0) continue;
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

}  // namespace
}  // namespace elastic_ep
