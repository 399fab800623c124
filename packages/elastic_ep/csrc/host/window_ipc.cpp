// elastic_ep/csrc/host/window_ipc.cpp -- the CUDA-IPC window (see window.hpp). Empty unless the CUDA build
// is on.
#if COMMKIT_WITH_CUDA
#include <cuda_runtime.h>

#include "commkit/check.hpp"
#include "commkit/ipc.hpp"
#include "host/trace.hpp"
#include "host/window.hpp"

namespace elastic_ep {

namespace {
// The window handle ranks exchange (commkit/ipc_handle.hpp): kernels address a peer's window with
// this rank's layout, so every rank's buffer size must match, as in ipc_all2all.
const commkit::IpcHandleFormat kWindowHandleFormat{
    {'e', 'l', 'a', 's', 't', 'e', 'p', '\x01'}, "elastic_ep", "a buffer (num_bytes) of",
    "; every rank must create the buffer with the same num_bytes, or a rank would write past a smaller "
    "peer window"};
}  // namespace

IpcWindow::IpcWindow(const WindowShape& shape, bool debug) : Window(shape, debug) {
  trace(debug_, "rank %d/%d: device %d, IPC window of %llu bytes\n", shape.rank, shape.num_ranks, shape.device,
        (unsigned long long)shape.bytes());
  // cudaMalloc, not the caching allocator: an IPC handle exports a whole allocation.
  CK_CUDA_CHECK(cudaMalloc(&mem_, shape.bytes()));
  base_ = mem_;
  lsa_size_ = shape.num_ranks;  // the caller promises one P2P domain (or one GPU)
  peers_.assign(size_t(shape.num_ranks), nullptr);
}

commkit::IpcWindowInfo IpcWindow::info() const {
  return {shape_.num_ranks, shape_.rank, uint64_t(shape_.buffer_bytes), shape_.bytes()};
}

std::string IpcWindow::handle() const {
  return commkit::describe_ipc_handle(kWindowHandleFormat, info(), commkit::ipc_handle_of(mem_));
}

void IpcWindow::open_peers(const std::vector<std::string>& handles) {
  CK_CHECK(peer_bases() == nullptr, "open_ipc_peers was already called");
  // Every rank's world size and buffer size before any peer's memory is opened.
  const std::vector<std::string> raw =
      commkit::check_described_ipc_handles(kWindowHandleFormat, handles, info(), handle(), "open_ipc_peers");
  peers_ = commkit::open_ipc_handles(raw, shape_.rank, "open_ipc_peers", static_cast<int64_t>(info().alloc_bytes));
  std::vector<void*> bases = peers_;
  bases[shape_.rank] = mem_;
  host_peer_bases_.clear();
  for (void* b : bases) host_peer_bases_.push_back(static_cast<char*>(b));
  DeviceMemory dev;
  void* p = nullptr;
  CK_CUDA_CHECK(cudaMalloc(&p, sizeof(void*) * bases.size()));
  dev.reset(p);
  CK_CUDA_CHECK(cudaMemcpy(p, bases.data(), sizeof(void*) * bases.size(), cudaMemcpyHostToDevice));
  peer_bases_ = std::move(dev);
}

void IpcWindow::release(Teardown how, commkit::TeardownLog& log) noexcept {
  release_peer_bases(how, log);
  // Nothing makes an IPC teardown collective: the runtime's barrier before kCollective does.
  if (how != Teardown::kLeak) {
    commkit::cuda_step(log, "cudaIpcCloseMemHandle(peers)", commkit::close_ipc_handles(peers_));
    if (mem_ != nullptr) commkit::cuda_step(log, "cudaFree(window)", cudaFree(mem_));
  }
  peers_.assign(peers_.size(), nullptr);
  mem_ = nullptr;
}

}  // namespace elastic_ep
#endif  // COMMKIT_WITH_CUDA
