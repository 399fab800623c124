// kernels.cu -- the one push kernel behind send_recv_heads, gather_heads and allgather.
//
// Every operation is "for each target rank p, move a set of rows of `chunk_bytes` from my input to
// p's slot"; only the row addressing differs (W ranks, me = rank q, counts n[], exclusive prefix P[],
// total T, E = element size, chunk = hpr*D*E, wide = H*D*E):
//   send_recv_heads  x[b, x_rows, H, D]      rows t < n[q]:  src x + (b*x_rows + t)*wide + p*chunk
//                                                            dst slot_p + (b*OUT + P[q] + t)*chunk
//   gather_heads     x[b, x_rows, hpr, D]    rows t < n[p]:  src x + (b*x_rows + P[p] + t)*chunk
//                                                            dst slot_p + (b*OUT_p + t)*wide + q*chunk
//   allgather        x[b, x_rows, h, d]      rows t < n[q]:  src x + (b*x_rows + t)*chunk (chunk = wide)
//                                                            dst slot_p + (b*OUT + P[q] + t)*chunk
// OUT is the output's rows per batch: T (or n[p] for gather) when the counts came from the host, a
// fixed capacity when they live on the device (CUDA graphs: the shape cannot follow the counts).
//
// The (row, 16-byte column) space of one target is flattened and shared by that target's blocks
// with a grid stride, kUnroll 16-byte loads in flight per thread before the stores, so any head or
// hidden size works (no "one token per thread group" limit) and every store is a full 16 B vector.
// Stores go straight to the peer over NVLink (push): posted writes need no round trip, where a pull
// would wait a full NVLink latency per load. With fp8 on the wire (pack_head_dim > 0) the same push
// packs bf16 head vectors into e4m3 records as it moves them (pack_records, below).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "a2a_geometry.hpp"
#include "a2a_types.hpp"
#include "commkit/check.hpp"
#include "commkit/device_deadline.cuh"
#include "commkit/ptx.cuh"
#include "kernels.hpp"

namespace ipc_all2all {
namespace {

using commkit::ld_nc_v4;
using commkit::st_na_v4;

__device__ __forceinline__ void copy_rows(const RowMap& m, const char* x, char* slot, uint32_t total_vecs, uint32_t first,
                                          uint32_t stride) {
  uint32_t v = first;
  for (; v + (kUnroll - 1) * stride < total_vecs; v += kUnroll * stride) {
    int4 r[kUnroll];
    int4* d[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      uint64_t so, dof;
      m.offsets(v + u * stride, so, dof);
      d[u] = reinterpret_cast<int4*>(slot + dof);
      r[u] = ld_nc_v4(reinterpret_cast<const int4*>(x + so));
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) st_na_v4(d[u], r[u]);
  }
  for (; v < total_vecs; v += stride) {
    uint64_t so, dof;
    m.offsets(v, so, dof);
    st_na_v4(reinterpret_cast<int4*>(slot + dof), ld_nc_v4(reinterpret_cast<const int4*>(x + so)));
  }
}

// ------------------------------------------------------------------------------ fp8 on the wire
// A head vector of D bf16 elements travels as one record of D + 16 bytes (kFp8RecordPad):
//   [ D bytes e4m3 | fp32 scale | 12 zero bytes ],  scale = amax / 448 (1 when amax == 0),
//   q[i] = e4m3_rn_satfinite(x[i] / scale);  back: bf16_rn(float(q[i]) * scale).
// Every division and product is IEEE round-to-nearest (__fdiv_rn, __fmul_rn), so a plain torch
// implementation of the same formula gives the same bits. The push packs while it moves
// (pack_records: bf16 read locally, records stored to the target), so the wire carries
// (D + 16) / 2D of the bf16 bytes and no packed copy is written first; the receiver unpacks its slot
// into a fresh bf16 output (fp8_unpack_kernel). D in {16, 32, 64, 128, 256}.
__device__ __forceinline__ float group_max(float v, int L) {
  for (int o = L / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o, L));
  return v;
}

// The 16 bf16 values of two 16-byte vectors, as floats (exact).
__device__ __forceinline__ void bf16x16_to_float(const int4 (&raw)[2], float (&v)[16]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 f = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(raw)[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ float absmax16(const float (&v)[16]) {
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = fmaxf(m, fabsf(v[i]));
  return m;
}

// 16 values -> 16 e4m3 bytes with the record's scale.
__device__ __forceinline__ int4 quantize16(const float (&v)[16], float scale) {
  uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; ++i)
    w[i / 4] |= uint32_t(__nv_cvt_float_to_fp8(__fdiv_rn(v[i], scale), __NV_SATFINITE, __NV_E4M3)) << (8 * (i % 4));
  return make_int4(int(w[0]), int(w[1]), int(w[2]), int(w[3]));
}

// The fused pack + push of one target: the RowMap is in record bytes (records of R = D + 16 bytes,
// rpr per row); record r's bf16 source sits at (its record offset / R) * 2D in x. A group of
// L = D / 16 lanes handles one record, 16 elements (32 bytes of bf16 in, 16 bytes of e4m3 out) per
// lane, kPackUnroll records per group in flight; lane 0 of the group also stores the scale field.
// Loop bounds are warp-uniform (the amax reduction shuffles across the warp).
constexpr int kPackUnroll = 2;

__device__ __forceinline__ void pack_records(const RowMap& m, int batch, const char* x, char* slot, int D,
                                             uint32_t first_thread, uint32_t nthreads) {
  const uint64_t R = uint64_t(D) + kFp8RecordPad, src_rec = 2u * uint64_t(D);
  const uint32_t rpr = static_cast<uint32_t>(uint64_t(m.vpr) * 16u / R);
  const uint32_t total = static_cast<uint32_t>(batch) * m.rpb * rpr;
  // Source strides in bf16 bytes: every record-space source offset is a whole number of records.
  const uint64_t s0 = m.src0 / R * src_rec, sb = m.sbs / R * src_rec, st = m.sts / R * src_rec;
  const int L = D / 16, per_warp = 32 / L;
  const int lane = threadIdx.x & 31, sub = lane / L, li = lane % L;
  const uint32_t warp = first_thread / 32u, nwarps = nthreads / 32u;
  const uint32_t step = nwarps * per_warp * kPackUnroll;
  for (uint32_t base = warp * per_warp * kPackUnroll; base < total; base += step) {
    int4 raw[kPackUnroll][2];
    uint64_t dof[kPackUnroll];
    bool valid[kPackUnroll];
#pragma unroll
    for (int u = 0; u < kPackUnroll; ++u) {
      const uint32_t r = base + u * per_warp + sub;
      valid[u] = r < total;
      dof[u] = 0;
      if (valid[u]) {
        const uint32_t row = r / rpr, col = r - row * rpr;
        const uint32_t b = row / m.rpb, t = row - b * m.rpb;
        const uint64_t so = s0 + b * sb + t * st + col * src_rec + 32u * li;
        dof[u] = m.dst0 + b * m.dbs + t * m.dts + col * R;
        raw[u][0] = ld_nc_v4(reinterpret_cast<const int4*>(x + so));
        raw[u][1] = ld_nc_v4(reinterpret_cast<const int4*>(x + so + 16));
      } else {
        raw[u][0] = raw[u][1] = make_int4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kPackUnroll; ++u) {
      float v[16];
      bf16x16_to_float(raw[u], v);
      const float amax = group_max(absmax16(v), L);
      const float scale = amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;
      if (valid[u]) {
        char* rec = slot + dof[u];
        st_na_v4(reinterpret_cast<int4*>(rec + 16 * li), quantize16(v, scale));
        if (li == 0) st_na_v4(reinterpret_cast<int4*>(rec + D), make_int4(__float_as_int(scale), 0, 0, 0));
      }
    }
  }
}

// ------------------------------------------------------------------------------ failure handling
// Marks the instance failed here and, with `peers`, on every peer too (stores into the peers'
// signal blocks, never their slots): the mark is sticky, so every later kernel of this instance
// moves nothing and posts nothing (see Signals::broken). Value: broken_word(call, rank that marked
// it), so a kernel can tell a mark of its own call from an earlier one (see the entry post). A
// timeout marks the peers, so a late peer's call fails at once instead of waiting out its deadline;
// a signature mismatch does not, as the peer sees the same mismatch and reports it itself (a mark
// landing first would turn its report into a less telling "abandoned").
__device__ __forceinline__ void mark_broken(const KernelArgs& a, bool peers, uint64_t e) {
  const uint64_t v = broken_word(e, a.rank);
  commkit::st_release(&a.sig[a.rank]->gave_up, uint64_t{1});
  if (!peers) {
    commkit::st_release(&a.sig[a.rank]->broken, v);
    return;
  }
  for (int p = 0; p < a.world; ++p) commkit::st_release(&a.sig[p]->broken, v);
}

// A kernel of a failed instance leaves a record that it abandoned the call, unless an earlier record
// still waits for the host (first writer wins): the host then refuses the instance (destroy and
// recreate).
__device__ __forceinline__ void report_not_run(const KernelArgs& a, uint64_t e, uint64_t broken) {
  commkit::report_timeout(a.rec, static_cast<uint32_t>(a.op * 4 + kPhaseBroken), a.rank,
                          broken_rank(broken), static_cast<int64_t>(e), static_cast<int64_t>(broken), 0);
}

// Entry handshake, part 2, run by thread 0 of a block that pushes to `target`: waits until the
// target entered this call (its stream no longer reads what this block overwrites) and checks that
// it entered the same call (same signature). Every peer block waits here when the target is late,
// and a waiter given the timeout record polls its host-mapped flag every 64 spins: one PCIe round
// trip each, serialised across the waiters (~1 us apiece), which delays every waiter's view of
// `ready`. So only the first block per target (blk 0) polls it; the others time out on their own
// deadline (they started waiting at about the same time) and then claim the record themselves, so
// a failure is always reported. On a mismatch nothing is pushed: the peer's slot is left alone.
// Out of line: thread 0 runs it once per call, and inlined its failure paths cost the copy loop
// registers.
// The wait also stops when this rank gave up meanwhile (another block of this call found a mismatch
// or a deadline): with 3 or more ranks, a rank that a mismatch with one peer made fail before it
// posted its entry is never going to enter, and the others, who saw the same mismatch, must not
// wait out their deadline for it. Such a stop records nothing: the block that gave up did. A mark
// from a peer does not stop it: a peer's timeout must not turn this rank's own timeout, which names
// the rank that never came, into a less telling "abandoned".
__device__ __noinline__ bool enter_call(const KernelArgs& a, Signals* me, int target, int blk, uint64_t e,
                                        uint64_t word) {
  const int q = a.rank;
  const uint32_t op = static_cast<uint32_t>(a.op * 4 + kPhaseEntry);
  bool ok = commkit::wait_tag_ge(&me->ready[target], static_cast<uint32_t>(e), a.timeout_ns, blk == 0 ? a.rec : nullptr,
                                 op, q, target, 6, 0, &me->gave_up);
  if (!ok && commkit::ld_acquire(&me->gave_up) != 0u) return false;  // stopped: this rank gave up meanwhile
  // The target cannot have moved past call e: it needs this block's push (and done) to finish e.
  const uint64_t seen = commkit::ld_acquire(&me->ready[target]);
  if (!ok) {
    if (blk != 0)
      commkit::report_timeout(a.rec, op, q, target, static_cast<int64_t>(static_cast<uint32_t>(e)),
                              static_cast<int64_t>(seen), a.timeout_ns);
    mark_broken(a, true, e);
  } else if (seen != word) {
    commkit::report_timeout(a.rec, static_cast<uint32_t>(a.op * 4 + kPhaseMismatch), q, target,
                            static_cast<int64_t>(word), static_cast<int64_t>(seen), 0);
    mark_broken(a, false, e);
    ok = false;
  }
  return ok;
}

// kPack: the fp8-on-the-wire push (pack_records); a separate instantiation so that the exact path
// keeps its register count (two blocks per SM) whatever the packing code needs.
// `a` is __grid_constant__ so that the out-of-line enter_call can take it by reference without a
// local copy of the struct.
template <bool kPack>
__global__ void __launch_bounds__(kThreads) a2a_kernel(const __grid_constant__ KernelArgs a) {
  __shared__ int64_t s_n[kMaxWorld];
  __shared__ int64_t s_prefix[kMaxWorld + 1];
  __shared__ uint64_t s_epoch, s_word;
  __shared__ int s_live;  // the instance was not marked failed when this block started
  __shared__ int s_ok;    // this block may push (live, and the target entered the same call)
  __shared__ int s_post;  // block 0 posts this rank's entry (see below)

  Signals* me = a.sig[a.rank];
  const int W = a.world;
  const int q = a.rank;
  if (threadIdx.x == 0) {
    s_epoch = commkit::ld_relaxed(&me->epoch) + 1;
    resolve_counts(a, a.counts_dev != nullptr ? a.counts_dev : a.counts, s_n, s_prefix);
    s_word = ready_word(s_epoch, call_signature(a.sig_base, s_n, W));
    // A call queued behind a failed one (on this rank or a peer) may consume that call's garbage:
    // it runs nothing.
    const uint64_t broken = commkit::ld_acquire(&me->broken);
    s_live = s_ok = broken == 0u;
    // The entry is posted unless the instance was marked failed in an earlier call: a mark of this
    // same call (another block of it found a mismatch or a deadline first, or a peer's entry deadline
    // expired waiting for this rank) must not hide this rank's entry from peers still waiting for it,
    // or each would wait out its own deadline (see entry_post_allowed;
    // tests/ipc_all2all/test_protocol_model.py runs the rule).
    s_post = entry_post_allowed(broken, s_epoch, q);
    if (broken != 0u) report_not_run(a, s_epoch, broken);
  }
  __syncthreads();
  const uint64_t e = s_epoch;

  // Entry handshake, part 1: tell every peer that my stream has reached call e, and which call.
  if (blockIdx.x == 0 && threadIdx.x < W && static_cast<int>(threadIdx.x) != q && s_post)
    commkit::st_release(&a.sig[threadIdx.x]->ready[q], s_word);

  int target, blk, nb;
  if (static_cast<int>(blockIdx.x) < a.self_blocks) {
    target = q;
    blk = blockIdx.x;
    nb = a.self_blocks;
  } else {
    int k = (blockIdx.x - a.self_blocks) / a.per_peer;
    blk = (blockIdx.x - a.self_blocks) - k * a.per_peer;
    target = (q + 1 + k) % W;
    nb = a.per_peer;
  }

  if (target != q && threadIdx.x == 0 && s_live) s_ok = enter_call(a, me, target, blk, e, s_word);
  __syncthreads();

  if (s_ok) {
    const RowMap m = row_map(a, s_n, s_prefix, target);
    if constexpr (kPack)
      pack_records(m, a.batch, a.x, a.dst[target], a.pack_head_dim, blk * blockDim.x + threadIdx.x, nb * blockDim.x);
    else
      copy_rows(m, a.x, a.dst[target], m.total_vecs(a.batch), blk * blockDim.x + threadIdx.x, nb * blockDim.x);
  }

  // Completion: the block's stores are made visible system-wide before thread 0 counts the block.
  commkit::block_fence_system();
  if (threadIdx.x != 0) return;
  if (target != q) {
    // Low 16 bits count blocks that copied, high 16 bits blocks that gave up or did not run: a
    // failed call must not look complete to the peer, or its next call would consume garbage.
    const uint32_t inc = s_ok ? 1u : 0x10000u;
    const uint32_t now = atomicAdd(&me->cnt[target], inc) + inc;
    if ((now & 0xffffu) + (now >> 16) == static_cast<uint32_t>(nb)) {
      atomicExch(&me->cnt[target], 0u);
      __threadfence_system();
      if ((now >> 16) == 0u) {
        // A failure since this call began (another group of this kernel, a peer's mark) withholds
        // done too: the target then fails this call instead of taking it as complete.
        const uint64_t broken = commkit::ld_acquire(&me->broken);
        if (broken == 0u)
          commkit::st_release(&a.sig[target]->done[q], e);
        else
          report_not_run(a, e, broken);
      }
    }
  }
  uint32_t old = atomicAdd(&me->fin, 1u);
  if (old == gridDim.x - 1) {
    atomicExch(&me->fin, 0u);
    // A failed instance waits for nobody (no peer posts done to it any more); this call's output may
    // then lack a peer's rows, so it is reported as abandoned (unless a record is already waiting).
    const uint64_t broken = commkit::ld_acquire(&me->broken);
    if (broken != 0u) {
      report_not_run(a, e, broken);
    } else {
      for (int k = 1; k < W; ++k) {
        int src = (q + k) % W;
        if (!commkit::wait_ge(&me->done[src], e, a.timeout_ns, a.rec, a.op * 4 + kPhaseCompletion, q, src, 6, 0,
                              &me->broken)) {
          // Marked failed meanwhile (a peer's timeout): abandoned; else this wait's own deadline.
          const uint64_t b = commkit::ld_acquire(&me->broken);
          if (b != 0u)
            report_not_run(a, e, b);
          else
            mark_broken(a, true, e);
          break;
        }
      }
    }
    __threadfence();
    commkit::st_relaxed(&me->epoch, e);
  }
}

__global__ void __launch_bounds__(256) fp8_unpack_kernel(const char* __restrict__ in,  // [groups, D + 16]
                                                         int4* __restrict__ out,       // [groups, D] bf16
                                                         int64_t groups, int D) {
  const int L = D / 8, per_warp = 32 / L;
  const int lane = threadIdx.x & 31, sub = lane / L, li = lane % L;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / 32;
  for (int64_t g = warp * per_warp + sub; g < groups + sub; g += warps * per_warp) {
    if (g >= groups) continue;
    const char* rec = in + g * (D + kFp8RecordPad);
    const uint2 q = *reinterpret_cast<const uint2*>(rec + 8 * li);
    const float scale = *reinterpret_cast<const float*>(rec + D);
    int4 r;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t word = i < 2 ? q.x : q.y;
      const int sh = 16 * (i & 1);
      const __half_raw a = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>((word >> sh) & 0xffu), __NV_E4M3);
      const __half_raw b = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>((word >> (sh + 8)) & 0xffu),
                                                   __NV_E4M3);
      h[i] = __floats2bfloat162_rn(__fmul_rn(__half2float(__half(a)), scale), __fmul_rn(__half2float(__half(b)), scale));
    }
    out[g * L + li] = r;
  }
}

int fp8_grid(int64_t groups, int D) {
  const int64_t threads = groups * (D / 8);
  const int64_t blocks = (threads + 255) / 256;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > 8192 ? 8192 : blocks));
}

}  // namespace

void launch_a2a(const KernelArgs& args, int grid, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (args.pack_head_dim > 0)
    a2a_kernel<true><<<grid, kThreads, 0, s>>>(args);
  else
    a2a_kernel<false><<<grid, kThreads, 0, s>>>(args);
  CK_CUDA_CHECK(cudaGetLastError());
}

void launch_fp8_unpack(const Fp8UnpackArgs& args, void* stream) {
  if (args.groups <= 0) return;
  fp8_unpack_kernel<<<fp8_grid(args.groups, args.head_dim), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const char*>(args.in), static_cast<int4*>(args.out), args.groups, args.head_dim);
  CK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ipc_all2all
