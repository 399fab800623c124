// backend_cuda.cu -- the CUDA copy backend: cudaMemcpyAsync from cudaHostRegister'ed shared memory
// on a consumer's own non-blocking streams, and per slot a pair of timing events (start, stop) whose
// elapsed time is the copy-engine time of the batch that slot retires.
//
// A batch's copies are spread over `copy_streams` streams (largest first onto the least loaded one):
// each cudaMemcpyAsync has a fixed cost in the copy engine (~2.5 us for a 1 KB copy on H200,
// tools/diag/h2d_sizes.py), which on one stream adds up between copies and on two overlaps the other
// stream's transfer. Small shards pay it most: a TP8-sized expert is 4 copies, 2 of them under 1 KB.
// The side streams start after the batch's start event; the primary waits for each before stop.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "commkit/check.hpp"
#include "commkit/teardown.hpp"

namespace fp8lw {
namespace {

class CudaBackend final : public CopyBackend {
 public:
  CudaBackend(int device, int num_slots, int copy_streams)
      : device_(device), nstreams_(copy_streams), start_(num_slots), stop_(num_slots) {
    CK_CHECK_ARG(copy_streams >= 1 && copy_streams <= kMaxCopyStreams, "copy_streams must be in 1..",
                 kMaxCopyStreams, ", got ", copy_streams);
    int count = 0;
    CK_CUDA_CHECK(cudaGetDeviceCount(&count));
    CK_CHECK_ARG(device >= 0 && device < count, "cuda_device ", device, " out of range (", count, " devices)");
    CK_CUDA_CHECK(cudaSetDevice(device));
    for (int i = 0; i < nstreams_; ++i) {
      CK_CUDA_CHECK(cudaStreamCreateWithFlags(&streams_[i], cudaStreamNonBlocking));
      CK_CUDA_CHECK(cudaEventCreateWithFlags(&joined_[i], cudaEventDisableTiming));
    }
    for (int s = 0; s < num_slots; ++s) {
      CK_CUDA_CHECK(cudaEventCreate(&start_[s]));
      CK_CUDA_CHECK(cudaEventCreate(&stop_[s]));
    }
  }
  ~CudaBackend() override {
    if (!released_) release();
  }
  std::string release() noexcept override {
    released_ = true;
    const auto step = [this](const char* name, cudaError_t e) { commkit::cuda_step(log_, name, e); };
    for (int i = 0; i < nstreams_; ++i)
      if (streams_[i]) step("cudaStreamSynchronize", cudaStreamSynchronize(streams_[i]));
    for (auto& e : start_) step("cudaEventDestroy", cudaEventDestroy(std::exchange(e, nullptr)));
    for (auto& e : stop_) step("cudaEventDestroy", cudaEventDestroy(std::exchange(e, nullptr)));
    for (int i = 0; i < nstreams_; ++i) {
      if (joined_[i]) step("cudaEventDestroy", cudaEventDestroy(std::exchange(joined_[i], nullptr)));
      if (streams_[i]) step("cudaStreamDestroy", cudaStreamDestroy(std::exchange(streams_[i], nullptr)));
    }
    (void)cudaGetLastError();
    return log_.message();
  }
  void submit(const std::vector<CopyOp>& ops, int slot) override {
    cudaStream_t primary = streams_[0];
    CK_CUDA_CHECK(cudaEventRecord(start_[slot], primary));
    std::array<uint64_t, kMaxCopyStreams> load{};
    std::array<bool, kMaxCopyStreams> used{};
    order_.resize(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) order_[i] = i;
    if (nstreams_ > 1)
      std::stable_sort(order_.begin(), order_.end(), [&](size_t a, size_t b) { return ops[a].bytes > ops[b].bytes; });
    for (size_t i : order_) {
      const int s = static_cast<int>(std::min_element(load.begin(), load.begin() + nstreams_) - load.begin());
      if (s != 0 && !used[s]) CK_CUDA_CHECK(cudaStreamWaitEvent(streams_[s], start_[slot], 0));
      used[s] = true;
      load[s] += ops[i].bytes;
      CK_CUDA_CHECK(cudaMemcpyAsync(ops[i].dst, ops[i].src, ops[i].bytes, cudaMemcpyHostToDevice, streams_[s]));
    }
    for (int s = 1; s < nstreams_; ++s) {
      if (!used[s]) continue;
      CK_CUDA_CHECK(cudaEventRecord(joined_[s], streams_[s]));
      CK_CUDA_CHECK(cudaStreamWaitEvent(primary, joined_[s], 0));
    }
    CK_CUDA_CHECK(cudaEventRecord(stop_[slot], primary));
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
    for (int i = 0; i < nstreams_; ++i)
      if (streams_[i]) cudaStreamSynchronize(streams_[i]);
    (void)cudaGetLastError();
  }
  void* alloc_host(size_t bytes) override {
    void* p = nullptr;
    CK_CUDA_CHECK(cudaSetDevice(device_));
    CK_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
    return p;
  }
  void free_host(void* p) noexcept override {
    if (p == nullptr) return;
    commkit::cuda_step(log_, "cudaFreeHost(staging)", cudaFreeHost(p));
    (void)cudaGetLastError();
  }

 private:
  int device_;
  int nstreams_;
  std::array<cudaStream_t, kMaxCopyStreams> streams_{};
  std::array<cudaEvent_t, kMaxCopyStreams> joined_{};  // [stream] reused: waited on right after its record
  std::vector<cudaEvent_t> start_, stop_;
  std::vector<size_t> order_;
  commkit::TeardownLog log_{release_hook()};
  bool released_ = false;
};

}  // namespace

std::unique_ptr<CopyBackend> make_cuda_backend(int device, int num_slots, int copy_streams) {
  return std::make_unique<CudaBackend>(device, num_slots, copy_streams);
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
