// backend_cuda.cu -- the CUDA copy backend: one non-blocking stream per consumer, cudaMemcpyAsync
// from cudaHostRegister'ed shared memory, and per slot a pair of timing events (start, stop)
// whose elapsed time is the copy-engine time of the batch that slot retires.
#include <cuda_runtime.h>

#include <vector>

#include "backend.hpp"
#include "commkit/check.hpp"

namespace fp8lw {
namespace {

class CudaBackend final : public CopyBackend {
 public:
  CudaBackend(int device, int num_slots) : device_(device), start_(num_slots), stop_(num_slots) {
    int count = 0;
    CK_CUDA_CHECK(cudaGetDeviceCount(&count));
    CK_CHECK_ARG(device >= 0 && device < count, "cuda_device ", device, " out of range (", count, " devices)");
    CK_CUDA_CHECK(cudaSetDevice(device));
    CK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (int s = 0; s < num_slots; ++s) {
      CK_CUDA_CHECK(cudaEventCreate(&start_[s]));
      CK_CUDA_CHECK(cudaEventCreate(&stop_[s]));
    }
  }
  ~CudaBackend() override {
    drain();
    for (auto e : start_) cudaEventDestroy(e);
    for (auto e : stop_) cudaEventDestroy(e);
    if (stream_) cudaStreamDestroy(stream_);
  }
  void submit(const std::vector<CopyOp>& ops, int slot) override {
    CK_CUDA_CHECK(cudaEventRecord(start_[slot], stream_));
    for (const auto& op : ops)
      CK_CUDA_CHECK(cudaMemcpyAsync(op.dst, op.src, op.bytes, cudaMemcpyHostToDevice, stream_));
    CK_CUDA_CHECK(cudaEventRecord(stop_[slot], stream_));
  }
  bool poll(int slot) override {
    cudaError_t st = cudaEventQuery(stop_[slot]);
    if (st == cudaErrorNotReady) return false;
    CK_CUDA_CHECK(st);
    return true;
  }
  uint64_t busy_ns(int slot) override {
    float ms = 0.f;
    CK_CUDA_CHECK(cudaEventElapsedTime(&ms, start_[slot], stop_[slot]));
    return static_cast<uint64_t>(static_cast<double>(ms) * 1e6);
  }
  void drain() noexcept override {
    if (stream_) cudaStreamSynchronize(stream_);
    (void)cudaGetLastError();
  }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> start_, stop_;
};

}  // namespace

std::unique_ptr<CopyBackend> make_cuda_backend(int device, int num_slots) {
  return std::make_unique<CudaBackend>(device, num_slots);
}

bool cuda_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

void cuda_host_register(uintptr_t ptr, size_t bytes, int device) {
  CK_CHECK_ARG(ptr != 0 && bytes > 0, "cuda_host_register needs a non-null pointer and a positive size");
  // Select the rank's device first so this thread does not create a context on device 0.
  CK_CUDA_CHECK(cudaSetDevice(device));
  CK_CUDA_CHECK(cudaHostRegister(reinterpret_cast<void*>(ptr), bytes, cudaHostRegisterPortable));
}

void cuda_host_unregister(uintptr_t ptr) { CK_CUDA_CHECK(cudaHostUnregister(reinterpret_cast<void*>(ptr))); }

double cuda_h2d_seconds(int device, uintptr_t dst, uintptr_t src, size_t bytes, int iters) {
  CK_CHECK_ARG(dst != 0 && src != 0 && bytes > 0 && iters > 0, "cuda_h2d_seconds: bad arguments");
  CK_CUDA_CHECK(cudaSetDevice(device));
  cudaStream_t s;
  cudaEvent_t a, b;
  CK_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CK_CUDA_CHECK(cudaEventCreate(&a));
  CK_CUDA_CHECK(cudaEventCreate(&b));
  CK_CUDA_CHECK(cudaEventRecord(a, s));
  for (int i = 0; i < iters; ++i)
    CK_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes,
                                  cudaMemcpyHostToDevice, s));
  CK_CUDA_CHECK(cudaEventRecord(b, s));
  CK_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0.f;
  CK_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(s);
  return static_cast<double>(ms) / 1e3;
}

}  // namespace fp8lw
