// elastic_ep/csrc/kernels/barrier.cuh -- set-up (peer pointers of an NCCL window) and the NVLink barrier kernel.
// Included once, by kernels.cu (the package's one CUDA translation unit).
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
// With every rank that writes into this one's window (hybrid mode: its domain and its rail peers).
template <class SO>
__global__ void __launch_bounds__(kMaxRanks) barrier_kernel(CommView c, SO so) {
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  if (!entry_barrier(cx, so, E, kOpBarrier, true)) return;
  if (threadIdx.x == 0) cx.end_epoch(E);
}

}  // namespace
}  // namespace elastic_ep
