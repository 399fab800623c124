// elastic_ep/csrc/kernels/scaleout/nvlink_emulated.cuh -- the scale-out transport over NVLink (see ../scaleout.cuh).
#pragma once

#include <cstdint>

#include "commkit/atomics.hpp"
#include "commkit/device_deadline.cuh"
#include "../scaleup.cuh"

namespace elastic_ep {

struct NvlinkEmulatedScaleout {
  static constexpr bool kHasGet = true;
  void* const* peer_bases;  // [num_ranks] mapped base of each rank's window
  uint64_t signal_offset;   // u64[num_ranks + kScaleoutExtraSignals] in every window (the workspace)
  int rank;
  int num_ranks;

  __device__ __forceinline__ char* at(int peer, uint64_t offset) const {
    return static_cast<char*>(peer_bases[peer]) + offset;
  }
  __device__ __forceinline__ uint64_t* signal_word(int peer, int sig) const {
    return reinterpret_cast<uint64_t*>(at(peer, signal_offset)) + sig;
  }
  __device__ __forceinline__ void put(int peer, uint64_t dst, uint64_t src, uint64_t bytes, int lane) const {
    warp_copy_v4<4, false>(reinterpret_cast<int4*>(at(peer, dst)), reinterpret_cast<const int4*>(at(rank, src)),
                           int(bytes / 16), lane);
  }
  __device__ __forceinline__ void signal(int peer, int sig, uint64_t add) const {
    // release at system scope: the peer that sees the new count sees every earlier store of this
    // thread (and, after the warp's __syncwarp, of its warp), as a GIN strong signal guarantees
    commkit::red_add_release(signal_word(peer, sig), add);
  }
  __device__ __forceinline__ void put_signal(int peer, uint64_t dst, uint64_t src, uint64_t bytes, int lane, int sig,
                                             uint64_t add) const {
    put(peer, dst, src, bytes, lane);
    __syncwarp();
    if (lane == 0) {
      __threadfence_system();
      signal(peer, sig, add);
    }
    __syncwarp();
  }
  __device__ __forceinline__ void put_value(int peer, uint64_t dst, uint64_t v) const {
    *reinterpret_cast<volatile uint64_t*>(at(peer, dst)) = v;
  }
  __device__ __forceinline__ void flush(int) const {}  // stores leave no source to wait for
  __device__ __forceinline__ uint64_t read_signal(int sig) const {
    return commkit::ld_acquire(signal_word(rank, sig));
  }
  __device__ __forceinline__ bool wait_signal(int sig, uint64_t least, uint64_t timeout_ns,
                                              commkit::TimeoutRecord* rec, uint32_t op, int peer) const {
    return commkit::wait_ge(signal_word(rank, sig), least, timeout_ns, rec, op, rank, peer);
  }
  __device__ __forceinline__ void get(int peer, uint64_t dst, uint64_t src, uint64_t bytes, int lane) const {
    warp_copy_v4<4, false>(reinterpret_cast<int4*>(at(rank, dst)), reinterpret_cast<const int4*>(at(peer, src)),
                           int(bytes / 16), lane);
  }
};

}  // namespace elastic_ep
