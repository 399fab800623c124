// elastic_ep/csrc/kernels/engram.cuh -- Engram fetch: table rows from the ranks' pinned host segments
// (engram.hpp) into a device tensor, one warp per (token, entry), 16-byte words over PCIe.
// Included once, by launch.cu (the package's one CUDA translation unit).
#pragma once

#include "device_common.cuh"

namespace elastic_ep {
namespace {

// hosts:   [R] device-mapped address of each rank's segment; rank r's holds entries
//          [r * entries_per_rank, (r + 1) * entries_per_rank), row_bytes each
// indices: [n] int32 global entries, all in range (checked by the host before the launch)
// out:     [n][row_bytes]
__global__ void __launch_bounds__(kThreads) engram_fetch_impl(const void* const* hosts, const int* indices, int64_t n,
                                                               int64_t entries_per_rank, int64_t row_bytes, void* out) {
  const int lane = lane_id();
  const int64_t n16 = row_bytes / 16;
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; i < n;
       i += int64_t(gridDim.x) * blockDim.x / 32) {
    const int64_t e = indices[i];
    const auto* src = reinterpret_cast<const int4*>(static_cast<const char*>(hosts[e / entries_per_rank]) +
                                                    (e % entries_per_rank) * row_bytes);
    auto* dst = reinterpret_cast<int4*>(static_cast<char*>(out) + i * row_bytes);
    for (int64_t q = lane; q < n16; q += 32) dst[q] = ld_nc_v4(src + q);
  }
}

}  // namespace
}  // namespace elastic_ep
