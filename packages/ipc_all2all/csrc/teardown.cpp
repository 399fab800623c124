// teardown.cpp -- Core::destroy and Core::release_buffer (see core.hpp): every wait has a deadline,
// and every release that fails is reported after all the others ran.
//
// Test hook: IPC_ALL2ALL_TEST_FAIL_RELEASE=<steps> reports the named release steps as failed
// (commkit/teardown.hpp): cudaIpcCloseMemHandle(peers), cudaFreeHost(record), cudaEventDestroy(order),
// cudaFree(buffer); "*" names all of them.
#include "core.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <string>
#include <thread>

#include "commkit/atomics.hpp"
#include "commkit/check.hpp"
#include "commkit/device_sync.hpp"
#include "commkit/teardown.hpp"

#if COMMKIT_WITH_CUDA
#include <cuda_runtime.h>

#include "commkit/ipc.hpp"
#include "device_guard.hpp"
#endif

namespace ipc_all2all {

namespace {
std::string release_hook() {
  const char* v = std::getenv("IPC_ALL2ALL_TEST_FAIL_RELEASE");
  return v != nullptr ? v : "";
}

std::string seconds(uint64_t ns) { return commkit::str(double(ns) * 1e-9, " s"); }

#if COMMKIT_WITH_CUDA
using commkit::cuda_step;

// Polls `s` until its work finished or `deadline` passed (a copy engine may be held up too).
bool wait_stream(cudaStream_t s, std::chrono::steady_clock::time_point deadline, cudaError_t* err) {
  for (;;) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) {
      *err = e;
      return false;
    }
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}
#endif
}  // namespace

bool Core::peer_known_dead(int peer) const {
  // Only the peers the watch can see (same kernel and PID namespace: commkit::PeerWatch's rule).
  if (!watch_ || peer < 0 || size_t(peer) >= peers_.size() || peer == rank_) return false;
  const commkit::ProcessId& id = peers_[size_t(peer)];
  return id.boot == self_.boot && id.pid_ns == self_.pid_ns && id.pid != 0 && !commkit::process_alive(id.pid, id.start);
}

bool Core::wait_for_device(uint64_t timeout_ns, std::string* failure) {
#if COMMKIT_WITH_CUDA
  // On a helper thread (commkit/device_sync.hpp): a kernel that waits forever (timeout_seconds = 0)
  // must not hold destroy() past its deadline.
  const commkit::DeviceSyncResult r = commkit::synchronize_device(device_, timeout_ns, [this]() noexcept {
    // This instance's kernels may be waiting without a deadline for a peer that never comes: every
    // wait polls the record's flag, so claiming it ends them. The device gets the deadline once more.
    // A CAS: a device report that claimed the record meanwhile is kept, not overwritten.
    if (rec_host_ != nullptr) (void)commkit::cas(&rec_host_->flag, kFlagClear, kFlagHostAbort);
    broken_ = true;
  });
  *failure = r.failure("this instance's");
  return r.finished;
#else
  (void)timeout_ns;
  (void)failure;
  return true;
#endif
}

std::vector<int> Core::wait_for_peers(uint64_t timeout_ns, std::string* failure) {
  std::vector<int> missing;
#if COMMKIT_WITH_CUDA
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns);
  uint64_t* stage = reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(rec_host_) + sizeof(commkit::TimeoutRecord));
  const size_t words = layout_.signals.offset + offsetof(Signals, leaving);
  cudaStream_t s = nullptr;
  cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  // Announce: this rank's device is done, so it writes into no peer's buffer any more (a dead
  // peer's memory is left alone).
  stage[kMaxWorld] = leaving_word(rank_);
  for (int p = 0; p < world_ && err == cudaSuccess; ++p)
    if (p != rank_ && !peer_known_dead(p))
      err = cudaMemcpyAsync(base_[p] + words + sizeof(uint64_t) * size_t(rank_), &stage[kMaxWorld], sizeof(uint64_t),
                            cudaMemcpyHostToDevice, s);
  bool ok = err == cudaSuccess && wait_stream(s, deadline, &err);
  auto poll = std::chrono::milliseconds(1);
  for (;;) {
    missing.clear();
    if (ok) {
      err = cudaMemcpyAsync(stage, base_[rank_] + words, sizeof(uint64_t) * size_t(world_), cudaMemcpyDeviceToHost, s);
      ok = err == cudaSuccess && wait_stream(s, deadline, &err);
    }
    for (int p = 0; p < world_; ++p) {
      const bool arrived = ok && commkit::ld_acquire(&stage[p]) == leaving_word(p);
      if (p != rank_ && !arrived && !peer_known_dead(p)) missing.push_back(p);
    }
    if (missing.empty() || !ok || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(poll);
    poll = std::min(poll * 2, std::chrono::milliseconds(20));
  }
  if (err != cudaSuccess) {
    *failure = commkit::str("exchanging the arrival words failed: ", cudaGetErrorString(err));
    (void)cudaGetLastError();
  }
  if (s != nullptr) (void)cudaStreamDestroy(s);
#else
  (void)timeout_ns;
  (void)failure;
#endif
  return missing;
}

void Core::destroy(bool free_buffer, double timeout_seconds, bool collective) {
  const uint64_t bound = timeout_ns_from_seconds(timeout_seconds);
  CK_CHECK_ARG(bound > 0, "destroy(): timeout_seconds must be positive (destroy() always has a deadline), got ",
               timeout_seconds);
  const std::lock_guard<std::recursive_mutex> lock(mu_);
  if (destroyed_) {
    if (free_buffer) release_buffer();
    return;
  }
#if COMMKIT_WITH_CUDA
  DeviceGuard g(device_);  // before destroyed_: if it throws, nothing was released and destroy() may be called again
#endif
  destroyed_ = true;
#if COMMKIT_WITH_CUDA
  const std::string me = commkit::str("destroy() on rank ", rank_, ": ");
  std::string why;
  // Our kernels may still write to peers (and they to us); everything local must finish first.
  if (!wait_for_device(bound, &why)) {
    // Every release below would wait for the device (cudaFree synchronises): keep it all.
    watch_.reset();
    keep_buffer_ = true;
    for (int i = 0; i < world_; ++i)
      if (i != rank_) base_[i] = nullptr;
    rec_host_ = rec_dev_ = nullptr;
    last_done_ = nullptr;
    have_last_ = false;
    CK_THROW(me, why, "; the buffer, the peers' mappings and the failure record stay allocated until the process "
             "exits");
  }
  commkit::TeardownLog log(release_hook());
  if (!why.empty()) log.note(why);
  why.clear();
  std::vector<int> missing;
  // A peer that called destroy() with this rank may spend two deadlines in its device wait (one, then its
  // kernels' waits ended, one more) before it writes its arrival word: waiting only one would fail a
  // healthy rank whose own device was idle. Two deadlines and a second of slack cover it.
  if (collective && opened_ && world_ > 1) missing = wait_for_peers(2 * bound + 1000000000ull, &why);
  if (!why.empty()) log.note(why);
  std::vector<void*> peers(world_, nullptr);
  for (int i = 0; i < world_; ++i)
    if (i != rank_) {
      peers[i] = base_[i];
      base_[i] = nullptr;
    }
  cuda_step(log, "cudaIpcCloseMemHandle(peers)", commkit::close_ipc_handles(peers));
  watch_.reset();  // its thread writes the record freed below
  if (rec_host_ != nullptr) {
    cuda_step(log, "cudaFreeHost(record)", cudaFreeHost(rec_host_));
    rec_host_ = rec_dev_ = nullptr;
  }
  if (last_done_ != nullptr) {
    cuda_step(log, "cudaEventDestroy(order)", cudaEventDestroy(static_cast<cudaEvent_t>(last_done_)));
    last_done_ = nullptr;
    have_last_ = false;
  }
  int first_missing = -1;
  if (!missing.empty()) {
    // Such a rank may still be writing into this rank's buffer: it stays allocated.
    keep_buffer_ = true;
    first_missing = missing.front();
    std::string ranks;
    for (int p : missing) ranks += commkit::str(ranks.empty() ? "" : ", ", p);
    log.note(commkit::str("rank(s) ", ranks, " did not reach destroy() within ", seconds(bound),
                          " (alive or not watched: IPC_ALL2ALL_PEER_WATCH_MS); this rank's buffer stays allocated "
                          "until the process exits, as such a rank may still write into it"));
  }
  if (free_buffer && !keep_buffer_ && base_[rank_] != nullptr) {
    cuda_step(log, "cudaFree(buffer)", cudaFree(base_[rank_]));
    base_[rank_] = nullptr;
  }
  if (!log.empty()) {
    (void)cudaGetLastError();
    CK_CHECK_RANK(false, rank_, first_missing, me, log.message());
  }
#else
  (void)free_buffer;
  (void)collective;
#endif
}

void Core::release_buffer() {
  const std::lock_guard<std::recursive_mutex> lock(mu_);
#if COMMKIT_WITH_CUDA
  if (keep_buffer_ || base_[rank_] == nullptr) return;
  DeviceGuard g(device_);
  commkit::TeardownLog log(release_hook());
  cuda_step(log, "cudaFree(buffer)", cudaFree(base_[rank_]));
  base_[rank_] = nullptr;
  if (!log.empty()) {
    (void)cudaGetLastError();
    CK_THROW("destroy() on rank ", rank_, ": freeing the shared buffer failed: ", log.message());
  }
#endif
}

}  // namespace ipc_all2all
