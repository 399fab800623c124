// elastic_ep/csrc/kernels/scaleout/gin.cuh -- the scale-out transport over NCCL GIN (see ../scaleout.cuh).
//
// Needs a device communicator created with GIN contexts (one per QP: `context`) and R + 4 signals, and
// the symmetric window every offset refers to. Hybrid mode talks over it to rail peers only (world rank
// d * U + u for this rank's u), and the communicator has RAIL connections (DeepEP's request): a peer is
// addressed in NCCL's rail team (ncclTeamRail: the ranks of this LSA index, node by node), at its node
// index. The contract's `peer` stays a world rank.
// Signal waits poll readSignal under commkit's device deadline (wait_ge_load) instead of NCCL's
// unbounded waitSignal, so an unresponsive scale-out peer becomes a TimeoutRecord, never a hang.
// API across NCCL versions: put / signal / flush / readSignal / putValue exist from 2.28.9 (the
// headers this package supports); strong signals are spelled ncclGin_StrongSignalAdd from 2.30 and
// ncclGin_SignalAdd before; get exists from 2.30.
#pragma once

#include <cstdint>

#include <nccl.h>
#include <nccl_device.h>

#include "commkit/device_deadline.cuh"

namespace elastic_ep {

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 0)
using GinSignalAdd = ncclGin_StrongSignalAdd;
constexpr bool kGinHasGet = true;
#else
using GinSignalAdd = ncclGin_SignalAdd;
constexpr bool kGinHasGet = false;
#endif

struct GinScaleout {
  static constexpr bool kHasGet = kGinHasGet;
  ncclDevComm comm;     // the device communicator (by value: kernels take it as a parameter)
  ncclWindow_t window;  // the symmetric window every offset refers to
  int context;          // GIN context (QP) of the calling warp's channel
  int rank;
  int num_ranks;

  __device__ __forceinline__ ncclTeam team() const { return ncclTeamRail(comm); }
  __device__ __forceinline__ int at(int peer) const { return peer / comm.lsaSize; }  // rail team rank

  __device__ __forceinline__ void put(int peer, uint64_t dst, uint64_t src, uint64_t bytes, int lane) const {
    ncclGin gin(comm, context);
    gin.put(team(), at(peer), window, dst, window, src, bytes, ncclGin_None{}, ncclGin_None{},
            ncclCoopWarp{});
    (void)lane;
  }
  __device__ __forceinline__ void put_signal(int peer, uint64_t dst, uint64_t src, uint64_t bytes, int lane, int sig,
                                             uint64_t add) const {
    ncclGin gin(comm, context);
    gin.put(team(), at(peer), window, dst, window, src, bytes,
            GinSignalAdd{static_cast<ncclGinSignal_t>(sig), add}, ncclGin_None{}, ncclCoopWarp{});
    (void)lane;
  }
  __device__ __forceinline__ void put_value(int peer, uint64_t dst, uint64_t v) const {
    ncclGin gin(comm, context);
    gin.putValue(team(), at(peer), window, dst, v);
  }
  __device__ __forceinline__ void signal(int peer, int sig, uint64_t add) const {
    ncclGin gin(comm, context);
    gin.signal(team(), at(peer), GinSignalAdd{static_cast<ncclGinSignal_t>(sig), add});
  }
  __device__ __forceinline__ void flush(int lane) const {
    ncclGin gin(comm, context);
    gin.flush(ncclCoopWarp{});
    (void)lane;
  }
  __device__ __forceinline__ uint64_t read_signal(int sig) const {
    ncclGin gin(comm, context);
    return gin.readSignal(static_cast<ncclGinSignal_t>(sig));
  }
  __device__ __forceinline__ bool wait_signal(int sig, uint64_t least, uint64_t timeout_ns,
                                              commkit::TimeoutRecord* rec, uint32_t op, int peer) const {
    ncclGin gin(comm, context);
    return commkit::wait_ge_load([&] { return gin.readSignal(static_cast<ncclGinSignal_t>(sig)); }, least,
                                 timeout_ns, rec, op, rank, peer);
  }
  __device__ __forceinline__ void get(int peer, uint64_t dst, uint64_t src, uint64_t bytes, int lane) const {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 0)
    ncclGin gin(comm, context);
    gin.get(team(), at(peer), window, src, window, dst, bytes, ncclCoopWarp{});
#else
    (void)peer, (void)dst, (void)src, (void)bytes;
#endif
    (void)lane;
  }
};

}  // namespace elastic_ep
