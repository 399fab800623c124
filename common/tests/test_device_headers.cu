// Compile-only check of the device side of common/ (CI has nvcc but no GPU): instantiates every
// device wait and atomic for 32- and 64-bit types, and every vector load and store of ptx.cuh. Built for sm_90a by the superbuild and by
// tests/common/test_common_headers.py; nothing here runs on the CPU.
#include <cstdint>

#include "commkit/atomics.hpp"
#include "commkit/device_deadline.cuh"
#include "commkit/layout.hpp"
#include "commkit/ptx.cuh"

namespace {
constexpr commkit::Region kRegion = commkit::Layout(0).add(100, 128);
}

template <typename T>
__global__ void exercise(T* flags, commkit::TimeoutRecord* rec, uint64_t timeout_ns, int rank, int peer) {
  if (!commkit::wait_ge(flags, T(1), timeout_ns, rec, 1u, rank, peer)) return;
  if (!commkit::wait_eq(flags + 1, T(2), timeout_ns, rec, 2u, rank, peer)) return;
  commkit::fetch_add(flags + 2, T(1));
  commkit::cas(flags + 3, T(0), T(1));
  commkit::exchange(flags + 4, T(3));
  commkit::st_release(flags + 5, commkit::ld_acquire(flags + 6));
  commkit::st_release_gpu(flags + 7, commkit::ld_acquire_gpu(flags + 8));
  commkit::st_relaxed(flags + 9, commkit::ld_relaxed(flags + 10) + T(kRegion.end()));
  commkit::fence_system();
  if (commkit::aborted(rec)) return;
}

template __global__ void exercise<uint32_t>(uint32_t*, commkit::TimeoutRecord*, uint64_t, int, int);
template __global__ void exercise<uint64_t>(uint64_t*, commkit::TimeoutRecord*, uint64_t, int, int);
template __global__ void exercise<int>(int*, commkit::TimeoutRecord*, uint64_t, int, int);

// Every load flavour into one store, so none of them is optimised away.
__global__ void exercise_ptx(const int4* src, int4* dst) {
  const int i = threadIdx.x;
  int4 a = commkit::ld_nc_v4(src + i);
  const int4 b = commkit::ld_v4(src + 32 + i);
  const int4 c = commkit::ld_v4<true>(src + 64 + i);
  a.x += b.x + c.x;
  a.y += b.y + c.y;
  a.z += b.z + c.z;
  a.w += b.w + c.w;
  commkit::st_na_v4(dst + i, a);
}
