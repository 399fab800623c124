// elastic_ep/csrc/kernels/scaleout.cuh -- the scale-out transport: how hybrid mode's kernels move bytes between
// rail peers (the ranks with the same scale-up index in different scale-out domains).
//
// Contract. A scale-out transport T is a trivially copyable struct, built on the host and passed to a
// kernel by value, with these device members (every offset is a byte offset in the symmetric window,
// the same on every rank; `peer` is a global rank of another scale-out domain, usually a rail peer):
//   put(peer, dst, src, bytes, lane)          warp-cooperative copy of `bytes` (a multiple of 16) from
//                                             this rank's window at `src` to the peer's window at `dst`;
//                                             all 32 lanes call it with the same arguments
//   put_signal(peer, dst, src, bytes, lane, sig, add)
//                                             the same, then the peer's signal `sig` += `add`, visible
//                                             only after the bytes (what a receiver waits on)
//   put_value(peer, dst, v)                   one u64 into the peer's window (no ordering)
//   signal(peer, sig, add)                    the peer's signal `sig` += `add`, after every earlier put
//                                             of this thread to that peer
//   flush(lane)                               the sources of this warp's puts may be reused
//   read_signal(sig)                          this rank's signal `sig` (monotonic u64)
//   wait_signal(sig, least, timeout_ns, rec, op, peer)
//                                             spin until read_signal(sig) >= least; false (after filling
//                                             the TimeoutRecord, see commkit/device_deadline.cuh) when
//                                             no progress came within timeout_ns -- never a hang
//   get(peer, dst, src, bytes, lane)          warp-cooperative read of the peer's window at `src` into
//                                             this rank's at `dst` (Engram's host rows; a backend
//                                             without it says so with kHasGet = false)
// Signals are numbered 0 .. kNumSignals-1 per rank: one per peer rank plus 4 (DeepEP's count).
//
// Backends, one file each:
//   scaleout/nvlink_emulated.cuh  NvlinkEmulatedScaleout: every rank's window is mapped (NCCL LSA or the
//                                 CUDA-IPC window), puts are stores, signals are u64 words in the
//                                 workspace raised with red.add.release.sys. The logical scale-out domains
//                                 of ELASTIC_EP_NUM_SCALEUP_RANKS live in one NVLink domain, so hybrid
//                                 mode runs and is checked on one node (a GPU shared by ranks included).
//   scaleout/gin.cuh              GinScaleout: NCCL's GPU-initiated networking (ncclGin over RDMA NICs),
//                                 compiled against NCCL >= 2.28.9; `get` needs NCCL >= 2.30. Built only
//                                 with the CMake option ELASTIC_EP_GIN=ON (ELASTIC_EP_WITH_GIN=1): it
//                                 has not run on a real network yet.
#pragma once

#include <cstdint>

// kScaleoutExtraSignals (sizing.hpp): signals beyond one per peer.
#include "sizing.hpp"
#include "scaleout/nvlink_emulated.cuh"
#if ELASTIC_EP_WITH_GIN
#include "scaleout/gin.cuh"
#endif
