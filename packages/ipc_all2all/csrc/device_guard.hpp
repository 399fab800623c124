// device_guard.hpp -- every CUDA call of a Core runs on the instance's device, whatever the caller's
// current device is (the rank need not equal the device index). CUDA builds only.
#pragma once

#include <cuda_runtime.h>

#include "commkit/check.hpp"

namespace ipc_all2all {

class DeviceGuard {
 public:
  explicit DeviceGuard(int dev) {
    CK_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != dev) CK_CUDA_CHECK(cudaSetDevice(dev));
  }
  ~DeviceGuard() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev_) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

}  // namespace ipc_all2all
