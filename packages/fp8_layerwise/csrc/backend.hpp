// backend.hpp -- the copy engine a consumer drives: CPU (memcpy, for CI) or CUDA (async H2D).
//
// A consumer submits one batch per group of ready slots: a list of (dst, src, bytes) copies and
// the slot that carries the batch's completion. poll(slot) reports completion without blocking;
// busy_ns(slot) then gives the time the copy engine spent on that batch (CUDA: event timing; CPU:
// the memcpy wall time), which feeds the h2d_ms statistic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fp8lw {

struct CopyOp {
  void* dst;
  const void* src;
  size_t bytes;
};

class CopyBackend {
 public:
  virtual ~CopyBackend() = default;
  // Enqueue `ops`; completion is tracked under `slot` (one outstanding batch per slot).
  virtual void submit(const std::vector<CopyOp>& ops, int slot) = 0;
  // True once the batch submitted under `slot` has landed. Throws commkit::Error on a copy error.
  virtual bool poll(int slot) = 0;
  // Copy-engine time of the completed batch under `slot`, in nanoseconds.
  virtual uint64_t busy_ns(int slot) = 0;
  // Block until everything submitted has finished (used before parking after a poison).
  virtual void drain() noexcept = 0;
  // Host memory a batch may copy from (CUDA: page-locked, so the copy stays asynchronous).
  virtual void* alloc_host(size_t bytes) = 0;
  virtual void free_host(void* p) noexcept = 0;
  // Drains, then frees what the backend made (CUDA: its streams and events). Returns every release
  // that failed, free_host's since construction included ("" when none; tests report named steps as
  // failed with FP8_LAYERWISE_TEST_FAIL_RELEASE, see commkit/teardown.hpp). The destructor calls it
  // when nobody did.
  virtual std::string release() noexcept = 0;
};

// The test hook's steps (FP8_LAYERWISE_TEST_FAIL_RELEASE; empty when unset).
std::string release_hook();

std::unique_ptr<CopyBackend> make_cpu_backend(int num_slots);
// Throws commkit::Error when the extension was built without CUDA or the device is unusable.
constexpr int kMaxCopyStreams = 4;
// `copy_streams` (1..kMaxCopyStreams): streams one batch's copies are spread over, largest first onto
// the least loaded; the batch is done when all of them are.
std::unique_ptr<CopyBackend> make_cuda_backend(int device, int num_slots, int copy_streams);

// CUDA helpers for the Python layer (no-ops that throw in a host-only build).
bool cuda_available();
void cuda_host_register(uintptr_t ptr, size_t bytes, int device);
void cuda_host_unregister(uintptr_t ptr);
// Plain pinned-memory H2D reference: `iters` cudaMemcpyAsync of `bytes` from `src` to `dst` on a
// fresh stream of `device`; returns the seconds between two events around them.
double cuda_h2d_seconds(int device, uintptr_t dst, uintptr_t src, size_t bytes, int iters);

}  // namespace fp8lw
