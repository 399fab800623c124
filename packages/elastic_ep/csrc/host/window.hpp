// elastic_ep/csrc/host/window.hpp -- the memory every rank maps, [workspace | buffer], and where each
// rank's copy of it is, as this process and as the kernels address it. Host only; CUDA builds.
//
// Two backends, one file each; the kernels cannot tell them apart:
//   NcclWindow (window_nccl.cpp)  an NCCL symmetric window (ncclMemAlloc + ncclCommWindowRegister), a
//       device communicator (ncclDevCommCreate: LSA only, or with GIN contexts) and the peers' LSA
//       addresses (ncclGetLsaPointer). Collective: every rank of the communicator constructs one.
//   IpcWindow (window_ipc.cpp)    cudaMalloc'ed memory whose CUDA IPC handle every rank publishes
//       (handle()) and opens (open_peers(every rank's handle), checked first). No NCCL: it runs where
//       NCCL has no symmetric memory, and with several ranks on one GPU (which NCCL refuses).
//
// What a window gives the runtime:
//   mem()                this rank's allocation as allocated (zeroing, the test-only epoch seed)
//   base()               this rank's window as the kernels address it (NCCL: its LSA mapping)
//   peer_bases()         device [num_ranks]: each rank's window as the kernels address it; null until
//                        the peers are known; NCCL over GIN: null outside this rank's NVLink domain
//   host_peer_bases()    the same addresses for host copies (AGRS's copy engines)
//   lsa_size()           ranks in this rank's NVLink (LSA) team
//   gin_devcomm()/gin_window()   the device communicator and window a GIN scale-out transport takes
//
// A window owns every handle it made, and release(how) is its one teardown path:
//   kCollective  every rank tears down together (the runtime's destroy(), after its deadline-bounded
//                barrier): everything is freed, the NCCL window deregistered.
//   kLocal       this rank alone (a failed set-up; the destructor): what is safe without the peers is
//                freed. NCCL: the registration, the device communicator and the memory only where no
//                rank got past the registration or every rank failed on the same check
//                (failed_everywhere()); otherwise a one-sided deregistration could wait for peers whose
//                set-up went on, so they stay until the communicator is destroyed.
//   kLeak        nothing is freed (after a timeout kernels may still spin on the memory and the peers
//                are out of step); the communicator's abort or the process exit reclaims it.
// Afterwards the window is empty (null accessors) and a second release does nothing. Every release
// step runs whatever an earlier one returned; each that fails (a CUDA or NCCL error) is entered in
// `log` by name (cudaIpcCloseMemHandle(peers), cudaFree(window), cudaFree(peer_bases),
// ncclCommWindowDeregister, ncclMemFree), for destroy() to raise once everything ran; the
// destructors, which cannot throw, discard it (destroy() released the window before, when it ran).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "commkit/ipc_handle.hpp"
#include "commkit/teardown.hpp"
#include "host/cuda_owned.hpp"
#include "kernels/launch.hpp"

namespace elastic_ep {

enum class Teardown { kCollective, kLocal, kLeak };

// The window's size and owner (every rank passes the same sizes).
struct WindowShape {
  int rank, num_ranks;
  int device;
  uint64_t workspace_bytes;  // before the buffer
  int64_t buffer_bytes;
  uint64_t bytes() const { return workspace_bytes + uint64_t(buffer_bytes); }
};

class Window {
 public:
  virtual ~Window() = default;
  Window(const Window&) = delete;
  Window& operator=(const Window&) = delete;

  const WindowShape& shape() const { return shape_; }
  void* mem() const { return mem_; }
  void* base() const { return base_; }
  void** peer_bases() const { return static_cast<void**>(peer_bases_.get()); }
  const std::vector<char*>& host_peer_bases() const { return host_peer_bases_; }
  int lsa_size() const { return lsa_size_; }
  virtual void* gin_devcomm() const { return nullptr; }
  virtual void* gin_window() const { return nullptr; }
  virtual void release(Teardown how, commkit::TeardownLog& log) noexcept = 0;

 protected:
  Window(const WindowShape& shape, bool debug) : shape_(shape), debug_(debug) {}
  // What both backends release alike: the peers' addresses (the device array is this rank's memory).
  void release_peer_bases(Teardown how, commkit::TeardownLog& log) noexcept {
    if (how != Teardown::kLeak && peer_bases_) commkit::cuda_step(log, "cudaFree(peer_bases)", cudaFree(peer_bases_.get()));
    peer_bases_.leak();
    host_peer_bases_.clear();
    base_ = nullptr;
  }

  WindowShape shape_;
  bool debug_;
  void* mem_ = nullptr;
  void* base_ = nullptr;
  DeviceMemory peer_bases_;
  std::vector<char*> host_peer_bases_;
  int lsa_size_ = 0;
};

class NcclWindow final : public Window {
 public:
  // Collective over `comm` (an ncclComm_t of shape.num_ranks ranks, this one shape.rank). With `gin`
  // the device communicator gets GIN contexts and NCCL's LSA team must be this rank's scale-up domain
  // of `scaleup` ranks; without, every rank must share one LSA team. Throws after release(kLocal).
  NcclWindow(const WindowShape& shape, void* comm, const GinRequest* gin, int scaleup, bool debug);
  ~NcclWindow() override {
    commkit::TeardownLog discarded;
    release(Teardown::kLocal, discarded);
  }
  void* gin_devcomm() const override { return devcomm_; }
  void* gin_window() const override { return window_; }
  bool failed_everywhere() const { return failed_everywhere_; }
  void release(Teardown how, commkit::TeardownLog& log) noexcept override;

 private:
  // Registration, device communicator, LSA team check, peers' addresses.
  void connect(const GinRequest* gin, int scaleup);

  void* comm_;               // ncclComm_t (not owned)
  void* window_ = nullptr;   // ncclWindow_t
  void* devcomm_ = nullptr;  // heap ncclDevComm (devcomm_create)
  bool failed_everywhere_ = false;  // the set-up failed on a check every rank fails alike
};

class IpcWindow final : public Window {
 public:
  // Unconnected (peer_bases() null) until open_peers().
  IpcWindow(const WindowShape& shape, bool debug);
  ~IpcWindow() override {
    commkit::TeardownLog discarded;
    release(Teardown::kLocal, discarded);
  }
  // Opaque bytes for the peers' open_peers: the CUDA IPC handle plus the world size, rank and buffer
  // size, which open_peers checks before it opens anything.
  std::string handle() const;
  // handles[r] from rank r (this rank's own checked to be its own): opens every peer's window. Not
  // collective itself; the caller barriers afterwards, before any peer writes into this window.
  void open_peers(const std::vector<std::string>& handles);
  commkit::IpcWindowInfo info() const;
  void release(Teardown how, commkit::TeardownLog& log) noexcept override;

 private:
  std::vector<void*> peers_;  // opened peer windows (nullptr for this rank)
};

}  // namespace elastic_ep
