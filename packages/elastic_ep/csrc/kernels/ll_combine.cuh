// elastic_ep/csrc/kernels/ll_combine.cuh -- low-latency combine (DeepEP V1's low_latency_combine) over
// the NVLink window.
//
// Send phase: the rows of every local expert (recv_count[l] of them, packed) are walked grid-stride, a
// warp (or a few, one slice each: ll_slices) per row; row (l, pos) goes to its source rank (route >> 8)
// at combine slot [token src_info][lane route & 0xff] of that rank's half, so each of an origin's
// (token, lane) pairs has its own slot and nothing is summed on the way. The phase's last block then
// sends every unmasked rank its geometry words and a "rows landed" signal (ll_common.cuh). With self_pos
// (no receive hook: x is unchanged until the receive) the rows of this rank's own tokens stay in x.
// Receive phase: one thread per rank waits for the signals; then each block reduces whole tokens:
// out[t] = sum over lanes k in order of topk_weights[t, k] * row(t, k) in fp32 (separate multiply and
// add, round to nearest: the torch reference's arithmetic, so the result is bitwise reproducible),
// rounded to BF16 once; lanes with id -1 (or, in shrink mode, a masked rank) are skipped; a lane of this
// rank's own expert is read from x at self_pos[t, k] when self_pos is given.
// Included once, by launch.cu.
#pragma once

#include "ll_common.cuh"

namespace elastic_ep {
namespace {

// With the dispatch's recv_self_pos (given only when x stays as it is from the send phase to the receive
// phase: no receive hook), the receive reads the rows of this rank's own experts from x in place and the
// send skips them.
__device__ __forceinline__ bool ll_combine_in_place(const LlCombineParams& p) { return p.self_pos != nullptr; }

__device__ __forceinline__ void ll_combine_send(const LlCall& call, const LlCombineParams& p) {
  const Ctx& cx = call.cx;
  const int E = p.num_experts, R = cx.tr.num_ranks, L = E / R, K = p.num_topk, M = p.num_max_tokens;
  const int64_t RM = int64_t(R) * M;
  const uint64_t row_bytes = uint64_t(p.hidden) * 2;
  const uint64_t area = cx.buf + uint64_t(p.half_offset) + uint64_t(ll_combine_offset(M, p.hidden, E));
  const bool in_place = ll_combine_in_place(p);
  __shared__ int s_base[kLowLatencyMaxLocalExperts + 1];
  __shared__ int s_scan[kWarps];
  {
    const int l = threadIdx.x;
    int n = l < L ? p.recv_count[l] : 0;
    n = n < 0 ? 0 : (n > RM ? int(RM) : n);  // a handle is this rank's own memory, but stay inside it
    const int before = block_exclusive_scan(n, s_scan);
    if (l < L) s_base[l] = before;
    if (l == L - 1) s_base[L] = before + n;
  }
  __syncthreads();
  const int lane = lane_id();
  const int64_t nwarps = int64_t(gridDim.x) * kWarps;
  const int slices = ll_slices(s_base[L], nwarps);
  for (int64_t u = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; u < int64_t(s_base[L]) * slices; u += nwarps) {
    const int64_t m = u / slices;
    const int sl = int(u - m * slices);
    int lo = 0, hi = L;
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (s_base[mid] <= m) lo = mid; else hi = mid;
    }
    const int64_t pos = int64_t(lo) * RM + (m - s_base[lo]);
    const int route = p.route[pos], t = p.src_info[pos];
    const int src = route >> 8, k = route & 0xff;
    if (src < 0 || src >= R || k >= K || t < 0 || t >= M) {
      // The value out of range and its bound (kProtocolLlRecord), as the dispatch's receive reports them.
      // A source out of range names no peer: the row is this rank's own handle's, so this rank is named.
      const bool bad_src = src < 0 || src >= R, bad_lane = !bad_src && k >= K;
      if (lane == 0 && sl == 0)
        report_protocol_once(cx, call.c, bad_src ? cx.tr.rank : src, kProtocolLlRecord,
                             uint32_t(bad_src ? src : bad_lane ? k : t), uint32_t(bad_src ? R : bad_lane ? K : M));
      continue;
    }
    if (call.masked(src) || (in_place && src == cx.tr.rank)) continue;
    int b, e;
    ll_slice_range(int(row_bytes / 16), sl, slices, &b, &e);
    warp_copy_v4<4, true>(reinterpret_cast<int4*>(cx.tr.remote(src, area + (uint64_t(t) * K + k) * row_bytes)) + b,
                          reinterpret_cast<const int4*>(static_cast<const char*>(p.x) + pos * int64_t(row_bytes)) + b,
                          e - b, lane);
  }
}

__device__ __forceinline__ void ll_combine_signal(const LlCall& call) {
  const Ctx& cx = call.cx;
  const uint32_t s = call.seq(kLlSendSide);
  call.publish_geometry(s);
  for (int r = threadIdx.x; r < cx.tr.num_ranks; r += blockDim.x)
    if (!call.masked(r))
      cx.tr.put_u64(r, cx.ws.ll_done.offset + 8ull * (uint64_t(call.half) * kMaxRanks + cx.tr.rank),
                    (uint64_t(s) << 32) | 1u);
  if (threadIdx.x == 0) call.end_phase(kLlSendSide, s);
}

constexpr int kLlCombineGroup = 8;

__device__ __forceinline__ void ll_combine_recv(const LlCall& call, const LlCombineParams& p) {
  const Ctx& cx = call.cx;
  const int E = p.num_experts, R = cx.tr.num_ranks, L = E / R, K = p.num_topk, M = p.num_max_tokens;
  const int H = p.hidden, n16 = H / 8;
  const uint32_t s = call.seq(kLlRecvSide);
  __shared__ float s_w[kLowLatencyMaxTopk];
  __shared__ const int4* s_row[kLowLatencyMaxTopk];  // lane k's row, null for none
  __shared__ int s_owner[kLowLatencyMaxTopk];         // its rank (shrink: masked during the wait, skipped)
  const bool in_place = ll_combine_in_place(p);
  const int64_t rows_in_x = int64_t(L) * R * M;
  const char* area = cx.tr.local(cx.buf + uint64_t(p.half_offset) + uint64_t(ll_combine_offset(M, H, E)));
  auto load_lanes = [&](int t) {
    if (threadIdx.x < K && t < p.num_tokens) {
      const int k = threadIdx.x;
      const int64_t e = p.topk_idx[int64_t(t) * K + k];
      const int owner = e >= 0 && e < E ? int(e) / L : -1;
      const int4* row = nullptr;
      if (owner >= 0 && in_place && owner == cx.tr.rank) {
        // A position outside x (a top-k unlike the dispatch's) reads nothing.
        const int pos = p.self_pos[int64_t(t) * K + k];
        if (pos >= 0 && pos < rows_in_x)
          row = reinterpret_cast<const int4*>(static_cast<const char*>(p.x) + int64_t(pos) * 2 * H);
      } else if (owner >= 0) {
        row = reinterpret_cast<const int4*>(area + (uint64_t(t) * K + k) * 2ull * H);
      }
      s_row[k] = row;
      s_owner[k] = owner;
      s_w[k] = p.topk_weights[int64_t(t) * K + k];
    }
  };
  load_lanes(blockIdx.x);  // before the wait: the lanes' latency overlaps the peers' signals
  bool failed = false;
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    if (call.masked(r)) continue;
    uint64_t v = 0;
    bool masked_now = false;
    int64_t* stats = (p.wait_stats != nullptr && blockIdx.x == 0) ? p.wait_stats + r : nullptr;
    if (!call.wait_peer(cx.local_u64(cx.ws.ll_done, call.half * kMaxRanks + r), r, s, kOpLowLatencyCombine, &v,
                        &masked_now, stats, true) && !masked_now)
      failed = true;
  }
  if (__syncthreads_or(failed)) return;
  for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    for (int i = threadIdx.x; i < n16; i += blockDim.x) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      // Lanes in groups of kLlCombineGroup: the group's loads are in flight together (top-8, one group:
      // one round trip), the sums stay in lane order.
      for (int k0 = 0; k0 < K; k0 += kLlCombineGroup) {
        int4 v[kLlCombineGroup];
        bool on[kLlCombineGroup];
#pragma unroll
        for (int u = 0; u < kLlCombineGroup; ++u) {
          const int4* row = k0 + u < K ? s_row[k0 + u] : nullptr;
          on[u] = row != nullptr && !call.masked(s_owner[k0 + u]);
          if (on[u]) v[u] = commkit::ld_v4<true>(row + i);
        }
#pragma unroll
        for (int u = 0; u < kLlCombineGroup; ++u) {
          if (!on[u]) continue;
          const float w = s_w[k0 + u];
          const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 f = __bfloat1622float2(h[j]);
            acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(f.x, w));
            acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(f.y, w));
          }
        }
      }
      int4 out;
      auto* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
      for (int j = 0; j < 4; ++j) o[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
      reinterpret_cast<int4*>(p.combined_x)[int64_t(t) * n16 + i] = out;
    }
    __syncthreads();  // every thread is done with this token's lanes
    load_lanes(t + gridDim.x);
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kThreads, 1) low_latency_combine(CommView c, LlCombineParams p) {
  LlCall call{Ctx(c), c, kLlCombineKind, p.half, p.shrink != 0,
              ll_geometry_word(0, p.num_max_tokens, p.hidden, p.num_experts, p.num_topk, false),
               ll_geometry_word(1, p.num_max_tokens, p.hidden, p.num_experts, p.num_topk, false)};
  call.begin(p.phases);
  if (p.phases & kLlSend) {
    ll_combine_send(call, p);
    if (ll_phase_last<true>(call.grid_word(kLlSendSide))) ll_combine_signal(call);
  }
  if (p.phases & kLlRecv) {
    ll_combine_recv(call, p);
    // The receive phase writes this GPU's memory only: a GPU-scope arrival is enough.
    if (ll_phase_last<false>(call.grid_word(kLlRecvSide)) && threadIdx.x == 0)
      call.end_phase(kLlRecvSide, call.seq(kLlRecvSide));
  }
}

}  // namespace
}  // namespace elastic_ep
