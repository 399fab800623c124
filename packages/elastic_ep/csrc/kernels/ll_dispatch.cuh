// elastic_ep/csrc/kernels/ll_dispatch.cuh -- low-latency dispatch (DeepEP V1's low_latency_dispatch)
// over the NVLink window, no CPU sync, fixed shapes, CUDA-graph capturable.
//
// Send phase (grid-stride over this rank's T tokens, one token per block at a time):
//   * slot of lane k of token t = the (t', k') before (t, k) in row-major order that name the same
//     expert, so every sender fills its row of a receiver's area in token order (deterministic);
//   * the row is read once: BF16, or cast to FP8 per 128 channels (amax clamped at 1e-4, scale = amax x
//     (1 / 448), optionally rounded up to a power of two; x * (448 / amax) or x / scale rounded to E4M3), and
//     stored with its header into each destination's receive area [l][this rank][slot], except, when the
//     call holds its own rows (ll_holds_own_rows), for the lanes whose expert is this rank's: the block
//     keeps the cast row in registers for the receive phase;
//   * every block then counts the tokens per expert; the phase's last block sends each (local expert,
//     this rank) count word to the expert's rank, with this rank's geometry words (ll_common.cuh).
// Receive phase: every block waits for all E count words (l, s), checks them, and lays out the packed
// output: expert l's rows are source rank 0's tokens, then rank 1's, ..., each in token order. Block 0
// writes recv_count, layout_range and the statistics; a block holding its token's own rows stores them
// at their places; warps then copy the messages (grid-stride, a row in slices over several warps when
// warps are spare: ll_slices) into recv_x [L, R * M, hidden], the scales (column-major [L, groups, R * M];
// UE8M0: 4 exponent bytes per int32), src_info and the route the combine takes back. recv_self_pos[t, k]
// ends as the row of each lane of this rank whose expert is its own (-1 for the others), which an
// in-place combine reads.
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

// The FP8 cast of one 16-byte word (8 channels) per thread, 16 consecutive threads holding one group of
// 128 channels (all 32 lanes of the warp call it: the amax is reduced across the 16): the 8 E4M3 bytes, and
// in `*sf` the group's scale_inv.
__device__ __forceinline__ uint2 ll_cast_group(const int4& v, bool round_scale, float* sf) {
  float amax = ll_amax8(v);
#pragma unroll
  for (int m = 8; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, m));
  amax = fmaxf(amax, 1e-4f);
  // DeepEP V1's kernel arithmetic: scale_inv = amax x (1 / 448) (a rounded reciprocal, as torch's
  // CUDA division by a scalar too), scale = 448 / amax (IEEE division).
  float s_inv = __fmul_rn(amax, 1.0f / 448.0f), scale;
  if (round_scale) {
    uint32_t bits = __float_as_uint(s_inv);
    if (bits & 0x7fffffu) bits = (bits & 0xff800000u) + 0x800000u;
    s_inv = __uint_as_float(bits);
    scale = __frcp_rn(s_inv);
  } else {
    scale = __fdiv_rn(448.f, amax);
  }
  *sf = s_inv;
  return ll_cast_fp8x8(v, scale);
}

// A call without receive hook (own_in_place: x is the same in both phases, one launch) in which every
// block sends at most one token whose row is at most one word per thread keeps that token's rows for
// its own experts in the sending block's registers, and stores them at their places once the counts
// are in: they never pass through the window. Every block of both phases computes the same answer.
__device__ __forceinline__ bool ll_holds_own_rows(const LlDispatchParams& p) {
  return p.own_in_place && p.phases == (kLlSend | kLlRecv) && p.recv_self_pos != nullptr &&
         p.num_tokens <= int(gridDim.x) && p.hidden / 8 <= int(blockDim.x);
}

// What a holding block keeps from its send to its receive: its token (-1: none), this thread's word of the
// row (BF16 as read, or FP8 bytes and the group's scale_inv), and per lane the own expert's (l, slot).
struct LlHeldRow {
  int t;
  int4 v;    // BF16
  uint2 q;   // FP8
  float sf;
};
struct LlHeldLanes {
  int l[kLowLatencyMaxTopk], slot[kLowLatencyMaxTopk];  // l = -1: the lane's expert is not this rank's
};

// Send phase: this block's tokens into the peers' receive areas.
__device__ __forceinline__ void ll_dispatch_send(const LlCall& call, const LlDispatchParams& p, LlHeldRow& held,
                                                 LlHeldLanes& own) {
  const Ctx& cx = call.cx;
  const int T = p.num_tokens, K = p.num_topk, E = p.num_experts, R = cx.tr.num_ranks, L = E / R;
  const int H = p.hidden, n16 = H / 8;  // 16-byte words of a BF16 row; one FP8 group = 16 of them
  const uint64_t msg = uint64_t(ll_msg_bytes(H, p.use_fp8 != 0));
  const uint64_t area = cx.buf + uint64_t(p.half_offset);
  __shared__ int64_t s_e[kLowLatencyMaxTopk];
  __shared__ int s_slot[kLowLatencyMaxTopk];
  __shared__ char* s_dst[kLowLatencyMaxTopk];
  const auto* x = static_cast<const int4*>(p.x);
  const bool hold = ll_holds_own_rows(p);
  held.t = -1;
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
      const bool held_lane = hold && e >= 0 && d == cx.tr.rank && !call.masked(d);
      own.l[threadIdx.x] = held_lane ? int(e % L) : -1;
      own.slot[threadIdx.x] = s_slot[threadIdx.x];
      if (e >= 0 && !call.masked(d) && !held_lane) {
        const uint64_t i = uint64_t(e % L) * R + cx.tr.rank;
        dst = cx.tr.remote(d, area + (i * p.num_max_tokens + uint64_t(s_slot[threadIdx.x])) * msg);
        *reinterpret_cast<int4*>(dst) = make_int4(t, int(threadIdx.x), 0, 0);
      }
      // The receive sets the rows of the own lanes.
      if (p.recv_self_pos != nullptr) p.recv_self_pos[int64_t(t) * K + threadIdx.x] = -1;
      s_dst[threadIdx.x] = dst;
    }
    __syncthreads();
    for (int base = 0; base < n16; base += blockDim.x) {
      const int i = base + threadIdx.x;
      const bool active = i < n16;
      const int4 v = base == 0 ? first : active ? commkit::ld_nc_v4(row + i) : make_int4(0, 0, 0, 0);
      if (hold) held.t = t, held.v = v;  // one token per block, one word per thread
      if (!p.use_fp8) {
        for (int k = 0; k < K && active; ++k)
          if (s_dst[k] != nullptr) st_na_v4(reinterpret_cast<int4*>(s_dst[k] + kLowLatencyHeaderBytes) + i, v);
        continue;
      }
      // A group of 128 channels = 16 consecutive lanes (n16 is a multiple of 16: every lane of a
      // group is active or none is).
      float sf;
      const uint2 q = ll_cast_group(v, p.round_scale != 0, &sf);
      if (hold) held.q = q, held.sf = sf;
      if (!active) continue;
      for (int k = 0; k < K; ++k) {
        char* dst = s_dst[k];
        if (dst == nullptr) continue;
        *reinterpret_cast<uint2*>(dst + kLowLatencyHeaderBytes + int64_t(i) * 8) = q;
        if ((i & 15) == 0) *reinterpret_cast<float*>(dst + ll_msg_scales_offset(H) + (i / 16) * 4) = sf;
      }
    }
    __syncthreads();  // s_e / s_slot / s_dst are rewritten for the next token
  }
  // The lanes of the tokens past T: none (a combine with more tokens than this dispatch reads no row).
  if (p.recv_self_pos != nullptr)
    for (int64_t j = int64_t(T) * K + int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
         j < int64_t(p.num_max_tokens) * K; j += int64_t(gridDim.x) * blockDim.x)
      p.recv_self_pos[j] = -1;
}

// Receive phase of a holding block: its token's rows for this rank's own experts at their places (row l *
// R * M + the rows of lower source ranks + slot), with scales, src_info, route and recv_self_pos.
__device__ __forceinline__ void ll_dispatch_store_held(const LlCall& call, const LlDispatchParams& p,
                                                       const LlHeldRow& held, const LlHeldLanes& own,
                                                       const int* s_base) {
  const int K = p.num_topk, H = p.hidden, R = call.cx.tr.num_ranks, me = call.cx.tr.rank;
  const int64_t RM = int64_t(R) * p.num_max_tokens;
  const int i = threadIdx.x;
  for (int k = 0; k < K; ++k) {
    const int l = own.l[k];
    if (l < 0) continue;
    const int64_t slot = int64_t(s_base[l * R + me] - s_base[l * R]) + own.slot[k];
    const int64_t pos = int64_t(l) * RM + slot;
    if (i == 0) {
      p.recv_src_info[pos] = held.t;
      p.recv_route[pos] = ll_route(me, k);
      p.recv_self_pos[int64_t(held.t) * K + k] = int(pos);
    }
    if (i >= H / 8) continue;
    if (!p.use_fp8) {
      st_na_v4(reinterpret_cast<int4*>(static_cast<char*>(p.recv_x) + pos * 2 * H) + i, held.v);
      continue;
    }
    *reinterpret_cast<uint2*>(static_cast<char*>(p.recv_x) + pos * H + int64_t(i) * 8) = held.q;
    if ((i & 15) != 0) continue;
    const int g = i / 16;
    if (p.recv_scales_ue8m0 != nullptr) {
      // Byte g % 4 of the int32 of groups 4 (g / 4) ..: the exponent the receive of a message packs.
      auto* w = reinterpret_cast<uint8_t*>(p.recv_scales_ue8m0 + (int64_t(l) * (H / 512) + g / 4) * RM + slot);
      w[g % 4] = uint8_t((__float_as_uint(held.sf) >> 23) & 0xffu);
    } else {
      p.recv_scales[(int64_t(l) * (H / 128) + g) * RM + slot] = held.sf;
    }
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
__device__ __forceinline__ void ll_dispatch_recv(const LlCall& call, const LlDispatchParams& p, const LlHeldRow& held,
                                                 const LlHeldLanes& own) {
  const Ctx& cx = call.cx;
  const int E = p.num_experts, R = cx.tr.num_ranks, L = E / R, K = p.num_topk, M = p.num_max_tokens;
  const int H = p.hidden;
  const int64_t RM = int64_t(R) * M;
  const uint32_t s = call.seq(kLlRecvSide);
  __shared__ int s_cnt[kMaxExperts];
  __shared__ int s_base[kMaxExperts];   // flat exclusive prefix over (l, s), l-major: the rows' places
  __shared__ int s_cbase[kMaxExperts];  // the same over the rows that come through the window
  __shared__ int s_scan[kWarps], s_cscan[kWarps];
  __shared__ int s_ctotal;
  const int me = cx.tr.rank;
  const bool hold = ll_holds_own_rows(p);
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
    // The rows a block held are stored by that block, not copied.
    const int xa = hold && a % R == me ? 0 : ca, xb = hold && b % R == me ? 0 : cb;
    const int cbefore = block_exclusive_scan(xa + xb, s_cscan);
    if (a < E) s_base[a] = before, s_cbase[a] = cbefore;
    if (b < E) s_base[b] = before + ca, s_cbase[b] = cbefore + xa;
    if (threadIdx.x == blockDim.x - 1) s_ctotal = cbefore + xa + xb;
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
  if (hold && held.t >= 0) ll_dispatch_store_held(call, p, held, own, s_base);
  const uint64_t msg = uint64_t(ll_msg_bytes(H, p.use_fp8 != 0));
  const char* area = cx.tr.local(cx.buf + uint64_t(p.half_offset));
  const int row_bytes = p.use_fp8 ? H : 2 * H;
  const int lane = lane_id();
  const int64_t nwarps = int64_t(gridDim.x) * kWarps;
  const int slices = ll_slices(s_ctotal, nwarps);
  for (int64_t u = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; u < int64_t(s_ctotal) * slices; u += nwarps) {
    const int64_t m = u / slices;
    const int sl = int(u - m * slices);
    int lo = 0, hi = E;  // the last (l, s) whose copy base <= m (one with rows: empty ones' bases tie)
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (s_cbase[mid] <= m) lo = mid; else hi = mid;
    }
    const int i = lo, l = i / R, src = i % R, j = int(m - s_cbase[i]);
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
      if (!bad && src == me && p.recv_self_pos != nullptr) p.recv_self_pos[int64_t(t) * K + k] = int(pos);
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
  LlHeldRow held;
  __shared__ LlHeldLanes own;
  if (p.phases & kLlSend) {
    __shared__ LlExpertCounts counts;
    ll_dispatch_send(call, p, held, own);
    ll_dispatch_count(p, counts);
    if (ll_phase_last<true>(call.grid_word(kLlSendSide))) ll_dispatch_signal(call, p, counts);
  }
  if (p.phases & kLlRecv) {
    ll_dispatch_recv(call, p, held, own);
    // The receive phase writes this GPU's memory only: a GPU-scope arrival is enough.
    if (ll_phase_last<false>(call.grid_word(kLlRecvSide)) && threadIdx.x == 0)
      call.end_phase(kLlRecvSide, call.seq(kLlRecvSide));
  }
}

}  // namespace
}  // namespace elastic_ep
