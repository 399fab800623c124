// elastic_ep/csrc/kernels/ll_dispatch.cuh -- low-latency dispatch (DeepEP V1's low_latency_dispatch)
// over the NVLink window, no CPU sync, fixed shapes, CUDA-graph capturable.
//
// Send phase (grid-stride over this rank's T tokens, one token per block at a time):
//   * slot of lane k of token t = the (t', k') before (t, k) in row-major order that name the same
//     expert, so every sender fills its row of a receiver's area in token order (deterministic);
//   * the row is read once: BF16, or cast to FP8 per 128 channels (amax clamped at 1e-4, scale = amax x
//     (1 / 448), optionally rounded up to a power of two; x * (448 / amax) or x / scale rounded to E4M3), and
//     stored with its header into each destination's receive area [l][this rank][slot];
//   * every block then counts the tokens per expert; the phase's last block sends each (local expert,
//     this rank) count word to the expert's rank, with this rank's geometry words (ll_common.cuh).
// Receive phase: every block waits for all E count words (l, s), checks them, and lays out the packed
// output: expert l's rows are source rank 0's tokens, then rank 1's, ..., each in token order. Block 0
// writes recv_count, layout_range and the statistics; warps then copy the messages (grid-stride, a row
// in slices over several warps when warps are spare: ll_slices) into
// recv_x [L, R * M, hidden], the scales (column-major [L, groups, R * M]; UE8M0: 4 exponent bytes per
// int32), src_info and the route the combine takes back.
// Included once, by launch.cu.
#pragma once

#include <cuda_fp8.h>

#include "ll_common.cuh"

namespace elastic_ep {
namespace {

// Cast of 8 bf16 channels (one 16-byte word) to E4M3 with `scale`, 8 bytes.
__device__ __forceinline__ uint2 ll_cast_fp8x8(const int4& v, float scale) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  uint32_t out[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    uint32_t packed = 0;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float2 f = __bfloat1622float2(h[i * 2 + j]);
      const float2 s = make_float2(__fmul_rn(f.x, scale), __fmul_rn(f.y, scale));
      packed |= uint32_t(__nv_cvt_float2_to_fp8x2(s, __NV_SATFINITE, __NV_E4M3)) << (16 * j);
    }
    out[i] = packed;
  }
  return make_uint2(out[0], out[1]);
}

__device__ __forceinline__ float ll_amax8(const int4& v) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
  }
  return m;
}

// Send phase: this block's tokens into the peers' receive areas.
__device__ __forceinline__ void ll_dispatch_send(const LlCall& call, const LlDispatchParams& p) {
  const Ctx& cx = call.cx;
  const int T = p.num_tokens, K = p.num_topk, E = p.num_experts, R = cx.tr.num_ranks, L = E / R;
  const int H = p.hidden, n16 = H / 8;  // 16-byte words of a BF16 row; one FP8 group = 16 of them
  const uint64_t msg = uint64_t(ll_msg_bytes(H, p.use_fp8 != 0));
  const uint64_t area = cx.buf + uint64_t(p.half_offset);
  __shared__ int64_t s_e[kLowLatencyMaxTopk];
  __shared__ int s_slot[kLowLatencyMaxTopk];
  __shared__ char* s_dst[kLowLatencyMaxTopk];
  const auto* x = static_cast<const int4*>(p.x);
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    const int4* row = x + int64_t(t) * n16;
    // The row's first chunk is loaded before the slots are known: its latency overlaps theirs.
    const int4 first = int(threadIdx.x) < n16 ? commkit::ld_nc_v4(row + threadIdx.x) : make_int4(0, 0, 0, 0);
    if (threadIdx.x < K) {
      s_e[threadIdx.x] = ll_sanitize(p.topk_idx[int64_t(t) * K + threadIdx.x], E);
      s_slot[threadIdx.x] = 0;
    }
    __syncthreads();
    const int64_t end = int64_t(t) * K + K - 1;
    for (int64_t j = threadIdx.x; j < end; j += blockDim.x) {
      const int64_t e = ll_sanitize(p.topk_idx[j], E);
      if (e < 0) continue;
      for (int k = 0; k < K; ++k)
        if (s_e[k] == e && j < int64_t(t) * K + k) atomicAdd(&s_slot[k], 1);
    }
    __syncthreads();
    if (threadIdx.x < K) {
      const int64_t e = s_e[threadIdx.x];
      const int d = e >= 0 ? int(e) / L : 0;
      char* dst = nullptr;
      if (e >= 0 && !call.masked(d)) {
        const uint64_t i = uint64_t(e % L) * R + cx.tr.rank;
        dst = cx.tr.remote(d, area + (i * p.num_max_tokens + uint64_t(s_slot[threadIdx.x])) * msg);
        *reinterpret_cast<int4*>(dst) = make_int4(t, int(threadIdx.x), 0, 0);
      }
      s_dst[threadIdx.x] = dst;
    }
    __syncthreads();
    for (int base = 0; base < n16; base += blockDim.x) {
      const int i = base + threadIdx.x;
      const bool active = i < n16;
      const int4 v = base == 0 ? first : active ? commkit::ld_nc_v4(row + i) : make_int4(0, 0, 0, 0);
      if (!p.use_fp8) {
        for (int k = 0; k < K && active; ++k)
          if (s_dst[k] != nullptr) st_na_v4(reinterpret_cast<int4*>(s_dst[k] + kLowLatencyHeaderBytes) + i, v);
        continue;
      }
      // A group of 128 channels = 16 consecutive lanes (n16 is a multiple of 16: every lane of a
      // group is active or none is).
      float amax = ll_amax8(v);
#pragma unroll
      for (int m = 8; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, m));
      amax = fmaxf(amax, 1e-4f);
      // DeepEP V1's kernel arithmetic: scale_inv = amax x (1 / 448) (a rounded reciprocal, as torch's
      // CUDA division by a scalar too), scale = 448 / amax (IEEE division).
      float sf = __fmul_rn(amax, 1.0f / 448.0f), scale;
      if (p.round_scale) {
        uint32_t bits = __float_as_uint(sf);
        if (bits & 0x7fffffu) bits = (bits & 0xff800000u) + 0x800000u;
        sf = __uint_as_float(bits);
        scale = __frcp_rn(sf);
      } else {
        scale = __fdiv_rn(448.f, amax);
      }
      if (!active) continue;
      const uint2 q = ll_cast_fp8x8(v, scale);
      for (int k = 0; k < K; ++k) {
        char* dst = s_dst[k];
        if (dst == nullptr) continue;
        *reinterpret_cast<uint2*>(dst + kLowLatencyHeaderBytes + int64_t(i) * 8) = q;
        if ((i & 15) == 0) *reinterpret_cast<float*>(dst + ll_msg_scales_offset(H) + (i / 16) * 4) = sf;
      }
    }
    __syncthreads();  // s_e / s_slot / s_dst are rewritten for the next token
  }
}

// Tokens per expert of this rank's call, counted by every block after its rows (the loads overlap the
// rows' stores draining before the phase's fence), so that the block finishing last publishes at once.
struct LlExpertCounts {
  int hist[kMaxExperts];
  unsigned int bad;    // ids outside [-1, E), reported to the host
  long long bad_id;
};

__device__ __forceinline__ void ll_dispatch_count(const LlDispatchParams& p, LlExpertCounts& n) {
  const int E = p.num_experts;
  for (int e = threadIdx.x; e < E; e += blockDim.x) n.hist[e] = 0;
  if (threadIdx.x == 0) n.bad = 0u;
  __syncthreads();
  for (int64_t j = threadIdx.x; j < int64_t(p.num_tokens) * p.num_topk; j += blockDim.x) {
    const int64_t e = p.topk_idx[j];
    if (e >= 0 && e < E) {
      atomicAdd(&n.hist[e], 1);
    } else if (e != -1) {
      atomicAdd(&n.bad, 1u);
      n.bad_id = e;
    }
  }
  // No barrier: the send phase's end (ll_phase_last) orders these before the signal reads them.
}

// Last block of the send phase: geometry words, count words, and the ids outside [-1, E) to the host.
__device__ __forceinline__ void ll_dispatch_signal(const LlCall& call, const LlDispatchParams& p,
                                                   const LlExpertCounts& n) {
  const Ctx& cx = call.cx;
  const int E = p.num_experts, R = cx.tr.num_ranks, L = E / R;
  const uint32_t s = call.seq(kLlSendSide);
  call.publish_geometry(s);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int d = e / L;
    if (call.masked(d)) continue;
    const uint64_t i = uint64_t(call.half) * kMaxExperts + uint64_t(e % L) * R + cx.tr.rank;
    cx.tr.put_u64(d, cx.ws.ll_count.offset + 8ull * i, (uint64_t(s) << 32) | uint64_t(n.hist[e]));
  }
  if (threadIdx.x == 0) {
    call.end_phase(kLlSendSide, s);
    if (n.bad != 0u) {
      uint64_t* ids = host_workspace_layout().ids.at<uint64_t>(call.c.host_workspace);
      ids[3] = static_cast<uint64_t>(n.bad_id);
      commkit::st_release(&ids[2], commkit::ld_relaxed(&ids[2]) + uint64_t(n.bad));
    }
  }
}

// Receive phase.
__device__ __forceinline__ void ll_dispatch_recv(const LlCall& call, const LlDispatchParams& p) {
  const Ctx& cx = call.cx;
  const int E = p.num_experts, R = cx.tr.num_ranks, L = E / R, K = p.num_topk, M = p.num_max_tokens;
  const int H = p.hidden;
  const int64_t RM = int64_t(R) * M;
  const uint32_t s = call.seq(kLlRecvSide);
  __shared__ int s_cnt[kMaxExperts];
  __shared__ int s_base[kMaxExperts];  // flat exclusive prefix over (l, s), l-major
  __shared__ int s_scan[kWarps];
  __shared__ int s_total;
  bool failed = false;
  for (int i = threadIdx.x; i < E; i += blockDim.x) {
    const int l = i / R, src = i % R;
    int cnt = 0;
    if (!call.masked(src)) {
      const uint64_t* word = cx.local_u64(cx.ws.ll_count, call.half * kMaxExperts + i);
      uint64_t v = 0;
      bool masked_now = false;
      int64_t* stats = (p.wait_stats != nullptr && blockIdx.x == 0 && l == 0) ? p.wait_stats + src : nullptr;
      if (call.wait_peer(word, src, s, kOpLowLatencyDispatch, &v, &masked_now, stats, l == 0)) {
        if (v > uint64_t(M)) {
          report_protocol_once(cx, call.c, src, kProtocolLlCount, v, M);
          failed = true;
        } else {
          cnt = int(v);
        }
      } else if (!masked_now) {
        failed = true;
      }
    }
    s_cnt[i] = cnt;
  }
  failed = __syncthreads_or(failed);
  // Shrink: a peer another block masked counts as absent in every block.
  for (int i = threadIdx.x; i < E; i += blockDim.x)
    if (call.masked(i % R)) s_cnt[i] = 0;
  __syncthreads();
  {
    const int a = 2 * threadIdx.x, b = a + 1;
    const int ca = a < E ? s_cnt[a] : 0, cb = b < E ? s_cnt[b] : 0;
    const int before = block_exclusive_scan(ca + cb, s_scan);
    if (a < E) s_base[a] = before;
    if (b < E) s_base[b] = before + ca;
    if (threadIdx.x == blockDim.x - 1) s_total = before + ca + cb;
  }
  __syncthreads();
  if (failed) return;  // nothing copied; the host raises (timeout or protocol record)
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
      const int first = s_base[i] - s_base[(i / R) * R];
      p.recv_layout_range[i] = (int64_t(first) << 32) | int64_t(s_cnt[i]);
    }
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
      const int n = s_base[l * R + R - 1] + s_cnt[l * R + R - 1] - s_base[l * R];
      p.recv_count[l] = n;
      if (p.cumulative_stats != nullptr) p.cumulative_stats[l] += n;
    }
  }
  const uint64_t msg = uint64_t(ll_msg_bytes(H, p.use_fp8 != 0));
  const char* area = cx.tr.local(cx.buf + uint64_t(p.half_offset));
  const int row_bytes = p.use_fp8 ? H : 2 * H;
  const int lane = lane_id();
  const int64_t nwarps = int64_t(gridDim.x) * kWarps;
  const int slices = ll_slices(s_total, nwarps);
  for (int64_t u = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; u < int64_t(s_total) * slices; u += nwarps) {
    const int64_t m = u / slices;
    const int sl = int(u - m * slices);
    int lo = 0, hi = E;  // the last (l, s) whose base <= m
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (s_base[mid] <= m) lo = mid; else hi = mid;
    }
    const int i = lo, l = i / R, src = i % R, j = int(m - s_base[i]);
    const int64_t pos = int64_t(l) * RM + (s_base[i] - s_base[l * R]) + j;
    const char* in = area + (uint64_t(i) * M + j) * msg;
    // The header is loaded with the row (it only decides src_info and the route; pos comes from the
    // counts, so a bad header cannot move the row anywhere else).
    int4 h = make_int4(0, 0, 0, 0);
    if (lane == 0 && sl == 0) h = commkit::ld_v4<true>(reinterpret_cast<const int4*>(in));
    // Slice 0 also moves the scales: their loads are issued before the row's copy, not after it.
    const float* sf = reinterpret_cast<const float*>(in + ll_msg_scales_offset(H));
    const bool ue8m0 = p.recv_scales_ue8m0 != nullptr;
    const int groups = H / 128, packs = H / 512;
    float pre[4] = {0.f, 0.f, 0.f, 0.f};  // UE8M0: pack `lane`'s 4 scales; else groups lane + 32 r
    if (p.use_fp8 && sl == 0) {
#pragma unroll
      for (int r = 0; r < 4; ++r)
        if (ue8m0 ? lane < packs : lane + 32 * r < groups) pre[r] = __ldcg(sf + (ue8m0 ? 4 * lane + r : lane + 32 * r));
    }
    int b, e;
    ll_slice_range(row_bytes / 16, sl, slices, &b, &e);
    warp_copy_v4<4, false, true>(reinterpret_cast<int4*>(static_cast<char*>(p.recv_x) + pos * row_bytes) + b,
                                 reinterpret_cast<const int4*>(in + kLowLatencyHeaderBytes) + b, e - b, lane);
    if (sl != 0) continue;  // the header, src_info, route and scales: slice 0's
    const int t = __shfl_sync(kFull, h.x, 0), k = __shfl_sync(kFull, h.y, 0);
    const bool bad = t < 0 || t >= M || k < 0 || k >= K;
    if (lane == 0) {
      if (bad) report_protocol_once(cx, call.c, src, kProtocolLlRecord, uint32_t(t < 0 || t >= M ? t : k),
                                    t < 0 || t >= M ? M : K);
      p.recv_src_info[pos] = bad ? -1 : t;
      p.recv_route[pos] = bad ? -1 : ll_route(src, k);
    }
    if (!p.use_fp8) continue;
    const int64_t slot = pos - int64_t(l) * RM;
    auto exponents = [](const float* f) {
      uint32_t w = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) w |= ((__float_as_uint(f[j]) >> 23) & 0xffu) << (8 * j);
      return w;
    };
    if (ue8m0) {
      if (lane < packs) p.recv_scales_ue8m0[(int64_t(l) * packs + lane) * RM + slot] = int(exponents(pre));
      for (int q = lane + 32; q < packs; q += 32) {
        float f[4];
        for (int j = 0; j < 4; ++j) f[j] = __ldcg(sf + 4 * q + j);
        p.recv_scales_ue8m0[(int64_t(l) * packs + q) * RM + slot] = int(exponents(f));
      }
    } else {
#pragma unroll
      for (int r = 0; r < 4; ++r)
        if (lane + 32 * r < groups) p.recv_scales[(int64_t(l) * groups + lane + 32 * r) * RM + slot] = pre[r];
      for (int g = lane + 128; g < groups; g += 32) p.recv_scales[(int64_t(l) * groups + g) * RM + slot] = __ldcg(sf + g);
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) low_latency_dispatch(CommView c, LlDispatchParams p) {
  LlCall call{Ctx(c), c, kLlDispatchKind, p.half, p.shrink != 0,
              ll_geometry_word(0, p.num_max_tokens, p.hidden, p.num_experts, p.num_topk, p.use_fp8 != 0),
               ll_geometry_word(1, p.num_max_tokens, p.hidden, p.num_experts, p.num_topk, p.use_fp8 != 0)};
  call.begin(p.phases);
  if (p.phases & kLlSend) {
    __shared__ LlExpertCounts counts;
    ll_dispatch_send(call, p);
    ll_dispatch_count(p, counts);
    if (ll_phase_last<true>(call.grid_word(kLlSendSide))) ll_dispatch_signal(call, p, counts);
  }
  if (p.phases & kLlRecv) {
    ll_dispatch_recv(call, p);
    // The receive phase writes this GPU's memory only: a GPU-scope arrival is enough.
    if (ll_phase_last<false>(call.grid_word(kLlRecvSide)) && threadIdx.x == 0)
      call.end_phase(kLlRecvSide, call.seq(kLlRecvSide));
  }
}

}  // namespace
}  // namespace elastic_ep
