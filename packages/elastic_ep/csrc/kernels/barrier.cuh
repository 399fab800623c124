// elastic_ep/csrc/kernels/barrier.cuh -- set-up (peer pointers of an NCCL window) and the NVLink barrier kernel.
// Included once, by launch.cu (the package's one CUDA translation unit).
#pragma once

#include "device_common.cuh"

namespace elastic_ep {
namespace {

// --------------------------------------------------------------------------------------- set-up
// out[first + p] = LSA peer p's window (p < lsa_size): the ranks of this rank's NVLink domain.
__global__ void resolve_peers_kernel(ncclWindow_t win, int first, int lsa_size, void** out) {
  const int p = threadIdx.x + blockIdx.x * blockDim.x;
  if (p < lsa_size) out[first + p] = ncclGetLsaPointer(win, 0, p);
}

// -------------------------------------------------------------------------------------- barrier
// A barrier of all ranks. In hybrid mode the entry barrier covers the own domain and the rail peers
// only (nobody else is reachable); a second round inside the domain, each rank saying it has seen its
// rail peers, completes it: after it every rank (d, u) knows that each (d, v) saw every (d', v).
// The second round's words are combine_done's: epochs only grow, so a barrier's epoch there never
// satisfies a later combine's wait.
template <class SO>
__global__ void __launch_bounds__(kMaxRanks) barrier_kernel(CommView c, SO so) {
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  if (!entry_barrier(cx, so, E, kOpBarrier, true)) return;
  if (cx.hd.on) {
    const int r = threadIdx.x;
    const bool mine = r < c.num_ranks && cx.hd.local(r);
    if (mine) cx.tr.signal(r, cx.ws.combine_done.offset + 8ull * c.rank, E);
    const bool ok = !mine || commkit::wait_ge(cx.local_u64(cx.ws.combine_done, r), E, cx.timeout_ns, cx.rec,
                                              kOpBarrier, c.rank, r);
    if (__syncthreads_or(!ok)) return;
  }
  if (threadIdx.x == 0) cx.end_epoch(E);
}

}  // namespace
}  // namespace elastic_ep
