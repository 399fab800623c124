// elastic_ep/csrc/host/cuda_owned.hpp -- owners of one CUDA allocation or object each (host only;
// include cuda_runtime.h first).
//
// Contract. Owned<Traits> holds one handle (null when empty) and frees it with Traits::free:
//   reset(h)   frees the handle held (if any) and takes h (default: none)
//   leak()     forgets the handle without freeing it: teardown after a timeout, where kernels may
//              still be spinning on the memory or the peers are out of step
//   the destructor frees it, as reset()
// Errors of a free are not reported (teardown paths cannot throw); they stay pending for the next
// cudaGetLastError(), as the CUDA call itself leaves them.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace elastic_ep {

template <typename Traits>
class Owned {
 public:
  using Handle = typename Traits::Handle;
  Owned() = default;
  explicit Owned(Handle h) : h_(h) {}
  ~Owned() { reset(); }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  Owned(Owned&& o) noexcept : h_(std::exchange(o.h_, Handle{})) {}
  Owned& operator=(Owned&& o) noexcept {
    if (this != &o) reset(std::exchange(o.h_, Handle{}));
    return *this;
  }

  Handle get() const { return h_; }
  explicit operator bool() const { return h_ != Handle{}; }
  void reset(Handle h = Handle{}) noexcept {
    if (h_ != Handle{}) Traits::free(h_);
    h_ = h;
  }
  void leak() noexcept { h_ = Handle{}; }

 private:
  Handle h_{};
};

struct DeviceMemoryTraits {  // cudaMalloc
  using Handle = void*;
  static void free(void* p) { cudaFree(p); }
};
struct HostMemoryTraits {  // cudaHostAlloc
  using Handle = void*;
  static void free(void* p) { cudaFreeHost(p); }
};
struct EventTraits {  // cudaEventCreate*; destroyed at once, freed by CUDA once pending work completes
  using Handle = cudaEvent_t;
  static void free(cudaEvent_t e) { cudaEventDestroy(e); }
};
struct StreamTraits {  // cudaStreamCreate*; released once its pending work completes
  using Handle = cudaStream_t;
  static void free(cudaStream_t s) { cudaStreamDestroy(s); }
};

using DeviceMemory = Owned<DeviceMemoryTraits>;
using HostMemory = Owned<HostMemoryTraits>;
using CudaEvent = Owned<EventTraits>;
using CudaStream = Owned<StreamTraits>;

}  // namespace elastic_ep
