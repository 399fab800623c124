// backend_cpu.cpp -- the CPU copy backend (memcpy into host "device" buffers) and the
// host-only stand-ins for the CUDA entry points, so the whole protocol runs without a GPU.
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend.hpp"
#include "commkit/check.hpp"
#include "commkit/deadline.hpp"
#include "commkit/teardown.hpp"

namespace fp8lw {
namespace {

class CpuBackend final : public CopyBackend {
 public:
  explicit CpuBackend(int num_slots) : busy_(num_slots, 0) {}
  void submit(const std::vector<CopyOp>& ops, int slot) override {
    const uint64_t t0 = commkit::monotonic_ns();
    for (const auto& op : ops) std::memcpy(op.dst, op.src, op.bytes);
    busy_[slot] = commkit::monotonic_ns() - t0;
  }
  bool poll(int) override { return true; }  // memcpy finished inside submit()
  uint64_t busy_ns(int slot) override { return busy_[slot]; }
  void drain() noexcept override {}
  void* alloc_host(size_t bytes) override {
    void* p = std::malloc(bytes);
    CK_CHECK(p != nullptr, "could not allocate ", bytes, " bytes of staging memory");
    return p;
  }
  void free_host(void* p) noexcept override {
    std::free(p);
    log_.step("free(staging)", true);
  }
  std::string release() noexcept override { return log_.message(); }

 private:
  std::vector<uint64_t> busy_;
  commkit::TeardownLog log_{release_hook()};
};

}  // namespace

std::string release_hook() {
  const char* v = std::getenv("FP8_LAYERWISE_TEST_FAIL_RELEASE");
  return v != nullptr ? v : "";
}

std::unique_ptr<CopyBackend> make_cpu_backend(int num_slots) { return std::make_unique<CpuBackend>(num_slots); }

#if !COMMKIT_WITH_CUDA
std::unique_ptr<CopyBackend> make_cuda_backend(int, int, int) {
  CK_THROW("fp8_layerwise was built without CUDA; use backend='cpu'");
}
bool cuda_available() { return false; }
void cuda_host_register(uintptr_t, size_t, int) { CK_THROW("fp8_layerwise was built without CUDA"); }
void cuda_host_unregister(uintptr_t) { CK_THROW("fp8_layerwise was built without CUDA"); }
double cuda_h2d_seconds(int, uintptr_t, uintptr_t, size_t, int) { CK_THROW("fp8_layerwise was built without CUDA"); }
#endif

}  // namespace fp8lw
