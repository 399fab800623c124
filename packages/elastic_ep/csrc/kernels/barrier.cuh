// elastic_ep/csrc/kernels/barrier.cuh -- set-up (peer pointers of an NCCL window) and the NVLink barrier kernel.
// Included once, by kernels.cu (the package's one CUDA translation unit).
#pragma once

#include "device_common.cuh"

namespace elastic_ep {
namespace {

// --------------------------------------------------------------------------------------- set-up
__global__ void resolve_peers_kernel(ncclWindow_t win, int n, void** out, int* info) {
  const int p = threadIdx.x + blockIdx.x * blockDim.x;
  if (p < n) out[p] = ncclGetLsaPointer(win, 0, p);
}

// -------------------------------------------------------------------------------------- barrier
__global__ void __launch_bounds__(kMaxRanks) barrier_kernel(CommView c) {
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  if (!entry_barrier(cx, E, kOpBarrier, true)) return;
  if (threadIdx.x == 0) cx.end_epoch(E);
}

}  // namespace
}  // namespace elastic_ep
