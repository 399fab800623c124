// elastic_ep/csrc/kernels/scaleup.cuh -- the scale-up transport: how every kernel reaches the ranks of
// its own NVLink domain.
//
// Every rank's window in the domain is mapped into this process (NCCL LSA pointers, or the CUDA-IPC
// window), so moving bytes is a plain store. The kernels use ScaleupTransport directly (Ctx::tr in
// device_common.cuh); it is not a template parameter. What a kernel is a template over is the
// scale-out transport (scaleout.cuh), the one that crosses to other domains in hybrid mode.
//   put_warp(peer, offset, src, bytes, lane)   warp-cooperative copy of `bytes` (multiple of 16) from
//                                               local memory into the peer's window at `offset`
//   dest(peer, offset) -> Dest                 resolve a destination once for a run of stores
//   put_v4(dest, i, v)                          store 16-byte word i at a resolved destination
//   put_u32(peer, offset, v) / put_u64(...)    one small value (no ordering)
//   signal(peer, offset, v)                    release-store a u64 signal (orders earlier puts of this
//                                               thread, and of the block after a fence, before it)
//   flush()                                    make this thread's puts visible system-wide
//   local(offset) / remote(peer, offset)       address in this rank's / a peer's window
// warp_copy_v4 is the warp copy both transports' stores use (the NVLink scale-out emulation too).
#pragma once

#include <cstdint>

#include "commkit/atomics.hpp"
#include "commkit/ptx.cuh"

namespace elastic_ep {

using commkit::ld_nc_v4;
using commkit::ld_v4;
using commkit::st_na_v4;

// Warp copy of n16 16-byte words with kUnroll loads in flight per lane. Source loads: kNcSrc = the
// read-only path (inputs), kCgSrc = L2 only (data that may land while the kernel runs), else plain.
template <int kUnroll, bool kNcSrc, bool kCgSrc = false>
__device__ __forceinline__ void warp_copy_v4(int4* dst, const int4* src, int n16, int lane) {
  auto ld = [](const int4* q) { return kNcSrc ? ld_nc_v4(q) : ld_v4<kCgSrc>(q); };
  int i = lane;
  for (; i + 32 * (kUnroll - 1) < n16; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = ld(src + i + 32 * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) st_na_v4(dst + i + 32 * u, v[u]);
  }
  for (; i < n16; i += 32) st_na_v4(dst + i, ld(src + i));
}

struct ScaleupTransport {
  void* const* peer_bases;  // [num_ranks] mapped base of each rank's window (hybrid mode: null outside the domain)
  int rank;
  int num_ranks;

  __device__ __forceinline__ char* remote(int peer, uint64_t offset) const {
    return static_cast<char*>(peer_bases[peer]) + offset;
  }
  __device__ __forceinline__ char* local(uint64_t offset) const { return remote(rank, offset); }

  template <bool kNcSrc = true>
  __device__ __forceinline__ void put_warp(int peer, uint64_t offset, const void* src, uint64_t bytes,
                                           int lane) const {
    warp_copy_v4<4, kNcSrc>(reinterpret_cast<int4*>(remote(peer, offset)), static_cast<const int4*>(src),
                            int(bytes / 16), lane);
  }
  // Store of one 16-byte word the caller computed (e.g. a reduced row chunk).
  __device__ __forceinline__ void put_v4(int peer, uint64_t offset, const int4& v) const {
    st_na_v4(reinterpret_cast<int4*>(remote(peer, offset)), v);
  }
  // For runs of stores to one place: every store has a "memory" clobber, so put_v4(peer, ..) per
  // word reloads peer_bases[peer] after each store; a Dest is resolved once (for LSA, the address).
  struct Dest {
    int4* base;
  };
  __device__ __forceinline__ Dest dest(int peer, uint64_t offset) const {
    return Dest{reinterpret_cast<int4*>(remote(peer, offset))};
  }
  __device__ __forceinline__ void put_v4(const Dest& d, uint64_t i, const int4& v) const { st_na_v4(d.base + i, v); }
  __device__ __forceinline__ void put_u32(int peer, uint64_t offset, uint32_t v) const {
    *reinterpret_cast<volatile uint32_t*>(remote(peer, offset)) = v;
  }
  __device__ __forceinline__ void put_u64(int peer, uint64_t offset, uint64_t v) const {
    *reinterpret_cast<volatile uint64_t*>(remote(peer, offset)) = v;
  }
  __device__ __forceinline__ void signal(int peer, uint64_t offset, uint64_t v) const {
    commkit::st_release(reinterpret_cast<uint64_t*>(remote(peer, offset)), v);
  }
  __device__ __forceinline__ void flush() const { __threadfence_system(); }
};

}  // namespace elastic_ep
