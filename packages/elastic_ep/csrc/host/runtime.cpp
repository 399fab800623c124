// elastic_ep/csrc/host/runtime.cpp -- the runtime's life: set-up over either window, the hybrid domain
// view, the views the kernels get, and teardown (see runtime.hpp). Host code compiled by the C++ compiler
// (exceptions never unwind through nvcc-compiled frames); empty unless the CUDA build is on.
#if COMMKIT_WITH_CUDA
#include "host/runtime.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "commkit/atomics.hpp"
#include "commkit/check.hpp"
#include "commkit/device_sync.hpp"
#include "commkit/timeout_record.hpp"
#include "host/comm.hpp"
#include "host/trace.hpp"
#include "kernels/sizing.hpp"

namespace elastic_ep {

namespace {
// How long destroy() waits for its peers when the buffer has no device deadline.
constexpr uint64_t kDestroyDeadlineNs = 30ull * 1000000000ull;
}  // namespace

WindowShape Runtime::begin_setup(int rank, int num_ranks, int64_t num_buffer_bytes, int num_cpu_timeout_secs,
                                 int num_gpu_timeout_secs, const RuntimeOptions& options) {
  rank_ = rank;
  num_ranks_ = num_ranks;
  num_buffer_bytes_ = num_buffer_bytes;
  num_cpu_timeout_secs_ = num_cpu_timeout_secs;
  gpu_timeout_ns_ = uint64_t(num_gpu_timeout_secs > 0 ? num_gpu_timeout_secs : 0) * 1000000000ull;
  CK_CHECK_ARG(num_ranks >= 1 && num_ranks <= kMaxRanks, "num_ranks must be in [1, ", kMaxRanks, "], got ",
               num_ranks);
  CK_CHECK_ARG(rank >= 0 && rank < num_ranks, "rank_idx must be in [0, num_ranks), got ", rank);
  CK_CHECK_ARG(num_buffer_bytes > 0 && num_buffer_bytes % kBufferAlignmentBytes == 0,
               "num_buffer_bytes must be a positive multiple of ", kBufferAlignmentBytes, " (2 MiB), got ",
               num_buffer_bytes);
  CK_CHECK_ARG(num_cpu_timeout_secs > 0, "num_cpu_timeout_secs must be positive");
  // How long a host wait yields before it sleeps (see poll_host; ELASTIC_EP_HOST_WAIT_YIELD_US).
  host_wait_yield_ns_ = uint64_t(std::max<int64_t>(0, options.host_wait_yield_us)) * 1000ull;
  debug_ = options.debug;
  test_fail_release_ = options.test_fail_release;
  const int U = options.num_scaleup_ranks;
  CK_CHECK_ARG(U == 0 || (U > 0 && U <= num_ranks && num_ranks % U == 0), "num_scaleup_ranks must be 0 (direct "
               "mode) or a divisor of the ", num_ranks, " ranks, got ", U);
  scaleup_ = U == num_ranks ? 0 : U;
  CK_CHECK_ARG(!options.use_gin || scaleup_ > 0, "the GIN scale-out transport is for hybrid mode: num_scaleup_ranks "
               "must be a proper divisor of the ", num_ranks, " ranks, got ", U);
#if !ELASTIC_EP_WITH_GIN
  CK_CHECK(!options.use_gin, "hybrid mode across NVLink domains needs the GIN scale-out transport, which this build "
           "of elastic_ep leaves out (it has not run on a real network yet): rebuild it with the CMake option "
           "ELASTIC_EP_GIN=ON (pip install --no-build-isolation -Ccmake.define.ELASTIC_EP_GIN=ON "
           "packages/elastic_ep)");
#endif
  gin_ = options.use_gin;
  gin_request_ = options.gin;
  CK_CUDA_CHECK(cudaGetDevice(&device_));
  CK_CUDA_CHECK(cudaDeviceGetAttribute(&num_device_sms_, cudaDevAttrMultiProcessorCount, device_));
  workspace_bytes_ = workspace_layout().bytes;
  return WindowShape{rank, num_ranks, device_, workspace_bytes_, num_buffer_bytes};  // [workspace | buffer]
}

Runtime::Runtime(int rank, int num_ranks, int64_t nccl_comm, int64_t num_buffer_bytes, int num_cpu_timeout_secs,
                 int num_gpu_timeout_secs, const RuntimeOptions& options) {
  CK_CHECK_ARG(nccl_comm != 0, "nccl_comm is null");
  const WindowShape shape =
      begin_setup(rank, num_ranks, num_buffer_bytes, num_cpu_timeout_secs, num_gpu_timeout_secs, options);
  auto [comm_rank, comm_size] = nccl_comm_rank_size(nccl_comm);
  CK_CHECK_ARG(comm_rank == rank && comm_size == num_ranks, "the NCCL communicator is rank ", comm_rank, " of ",
               comm_size, " but rank_idx=", rank, ", num_ranks=", num_ranks, " were given");
  window_ = std::make_unique<NcclWindow>(shape, reinterpret_cast<void*>(nccl_comm), gin_ ? &gin_request_ : nullptr,
                                         scaleup_, debug_);
  finish_setup();
}

Runtime::Runtime(Ipc, int rank, int num_ranks, int64_t num_buffer_bytes, int num_cpu_timeout_secs,
                 int num_gpu_timeout_secs, const RuntimeOptions& options) {
  const WindowShape shape =
      begin_setup(rank, num_ranks, num_buffer_bytes, num_cpu_timeout_secs, num_gpu_timeout_secs, options);
  CK_CHECK_ARG(!gin_, "the CUDA-IPC window is one node's: its hybrid mode runs over the NVLink emulation, not GIN");
  auto window = std::make_unique<IpcWindow>(shape, debug_);
  ipc_ = window.get();
  window_ = std::move(window);
  finish_setup();
  // Unusable (pending_health reports it) until the peers' windows are open.
  broken_ = true;
  broken_reason_ = "its CUDA-IPC window is not connected: open_ipc_peers() has not run";
}

void Runtime::finish_setup() {
  try {
    make_domain_view();
    // The workspace is zeroed once; kernels keep their local scratch at zero and tag signals by epoch.
    CK_CUDA_CHECK(cudaMemset(window_->mem(), 0, workspace_bytes_));
    void* ws = nullptr;
    CK_CUDA_CHECK(cudaHostAlloc(&ws, host_workspace_layout().bytes, cudaHostAllocMapped));
    host_ws_.reset(ws);
    std::memset(ws, 0, host_workspace_layout().bytes);
    commkit::clear_timeout_record(host_workspace_layout().timeout.at<commkit::TimeoutRecord>(ws));
    CK_CUDA_CHECK(cudaHostGetDevicePointer(&host_ws_dev_, ws, 0));
    for (CudaEvent* ev : {&event_in_, &event_out_, &notify_done_, &epi_done_}) {
      cudaEvent_t e = nullptr;
      CK_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      ev->reset(e);
    }
    cudaStream_t epi = nullptr;
    CK_CUDA_CHECK(cudaStreamCreateWithFlags(&epi, cudaStreamNonBlocking));
    epi_stream_.reset(epi);
    CK_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (...) {
    // No destructor runs after a failed constructor: free what was made (see release). The set-up's
    // own error is the one raised.
    commkit::TeardownLog secondary;
    release(Teardown::kLocal, secondary);
    destroyed_ = true;
    (void)cudaGetLastError();
    throw;
  }
  trace(debug_, "rank %d: window and workspace ready\n", rank_);
  // The caller runs a process-group barrier next, before any peer writes into this window.
}

void Runtime::make_domain_view() {
  if (!hybrid() || window_->host_peer_bases().empty()) return;
  const auto& all = window_->host_peer_bases();
  std::vector<void*> dom(size_t(num_ranks_), nullptr);
  for (int r = rank_ - rank_ % scaleup_; r < rank_ - rank_ % scaleup_ + scaleup_; ++r) dom[r] = all[r];
  void* dev = nullptr;
  CK_CUDA_CHECK(cudaMalloc(&dev, sizeof(void*) * num_ranks_));
  domain_peer_bases_.reset(dev);
  CK_CUDA_CHECK(cudaMemcpy(dev, dom.data(), sizeof(void*) * num_ranks_, cudaMemcpyHostToDevice));
}

std::string Runtime::ipc_handle() const {
  CK_CHECK(ipc(), "ipc_handle: this buffer's window is NCCL's, not CUDA IPC");
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  set_device();
  return ipc_->handle();
}

void Runtime::open_ipc_peers(const std::vector<std::string>& handles) {
  CK_CHECK(ipc(), "open_ipc_peers: this buffer's window is NCCL's, not CUDA IPC");
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  set_device();
  ipc_->open_peers(handles);
  make_domain_view();
  broken_ = false;
  broken_reason_.clear();
  trace(debug_, "rank %d: IPC peers open\n", rank_);
  // The caller runs a process-group barrier next, before any peer writes into this window.
}

Runtime::~Runtime() {
  if (!destroyed_) {
    try {
      destroy();
    } catch (...) {  // never throw from a destructor; destroy() reports through Python when called
    }
  }
}

void Runtime::set_device() const { CK_CUDA_CHECK(cudaSetDevice(device_)); }

void Runtime::destroy() {
  if (destroyed_) return;
  destroyed_ = true;
  trace(debug_, "rank %d: destroy (broken=%d)\n", rank_, int(broken_));
  commkit::TeardownLog log(test_fail_release_);
  Teardown how = Teardown::kLeak;
  try {
    how = quiesce(log);
  } catch (...) {
    release(Teardown::kLeak, log);
    throw;
  }
  release(how, log);
  if (!log.empty()) {
    (void)cudaGetLastError();
    CK_THROW("destroy() on rank ", rank_, ": ", log.message(),
             how == Teardown::kLeak ? " (the window and its workspaces were kept, not freed: kernels or peers may "
                                      "still use them; the process releases them at exit)"
                                    : " (every other resource of the buffer was released)");
  }
}

Teardown Runtime::quiesce(commkit::TeardownLog& log) {
  if (broken_ && window_->peer_bases() != nullptr) {
    // After a timeout the peers are out of step (or gone): NCCL's window/devcomm teardown is collective
    // and kernels may still be spinning towards their device deadline, so nothing is freed here. The
    // window is leaked until the communicator is aborted (destroy_nccl_comm) or the process exits.
    // (An IPC window whose peers were never opened ran no kernel: it is freed.)
    return Teardown::kLeak;
  }
  set_device();
  // With num_gpu_timeout_secs = 0 a kernel may wait forever for a peer that never comes; teardown may
  // not: the device gets a deadline, on a helper thread (commkit/device_sync.hpp). The synchronisation
  // waits for all work of the device, not only this buffer's, and with a device deadline each of this
  // buffer's waits may take that long: the bound is then that deadline plus the destroy barrier's.
  const uint64_t barrier_ns = gpu_timeout_ns_ > 0 ? gpu_timeout_ns_ : kDestroyDeadlineNs;
  const uint64_t deadline_ns = gpu_timeout_ns_ > 0 ? gpu_timeout_ns_ + kDestroyDeadlineNs : kDestroyDeadlineNs;
  const commkit::DeviceSyncResult synced = commkit::synchronize_device(device_, deadline_ns, [this]() noexcept {
    // Every device wait of this rank polls the timeout record: claiming it (as the peer watch does)
    // ends them; the device then gets the deadline once more. Op 0 and no peer: no operation expired,
    // and nothing reads the record of a destroyed buffer.
    commkit::claim_timeout_record(host_workspace_layout().timeout.at<commkit::TimeoutRecord>(host_ws_.get()), 0u,
                                  rank_, -1, 0);
    try {
      mark_broken("destroy() ended its device waits");
    } catch (...) {  // no memory for the reason: broken all the same
      broken_ = true;
    }
  });
  if (!synced.finished) {
    log.note(synced.failure("this buffer's"));
    return Teardown::kLeak;
  }
  commkit::cuda_step(log, "cudaDeviceSynchronize", synced.error);
  if (synced.timed_out) {
    // Its operations were ended half way: the peers are out of step, as after a timeout (see above).
    // Reported: nothing else told the caller that an operation never finished.
    log.note(commkit::str("the device was still busy after ", double(deadline_ns) * 1e-9, " s (e.g. an operation "
                          "of this buffer waiting for a peer that never made the same call; num_gpu_timeout_secs=",
                          gpu_timeout_ns_ / 1000000000ull, "), so destroy() ended this buffer's device waits"));
    return Teardown::kLeak;
  }
  if (window_->peer_bases() != nullptr && (entered_ || !ipc())) {
    // A device barrier with a deadline before anything is released.
    // * CUDA IPC: nothing makes its teardown collective, so the barrier makes sure no peer still
    //   writes into (or reads) this window when it is freed. Not needed when this rank never entered
    //   an operation: a peer writes here only after this rank published an epoch, and this rank read
    //   no peer's window. That is also the case after a failed set-up, where peers may never arrive.
    // * NCCL: the window and device-communicator teardown is collective and has no deadline of its
    //   own; entering it only once every peer reached destroy() keeps a rank whose peer never comes
    //   (an exception on that rank, a dead process) from blocking in it forever.
    // A peer that never arrives leaves a timeout record; the window is then leaked as after any
    // timeout (destroy_nccl_comm / process exit release it). With num_gpu_timeout_secs = 0 (no device
    // deadline) the operations may wait forever, but teardown may not: it gets its own deadline.
    CommView v = view();
    v.timeout_ns = barrier_ns;
    launch_barrier(v, nullptr);
    const cudaError_t barrier = cudaDeviceSynchronize();
    // Decided on the real result: a test hook only changes what is reported (commkit/teardown.hpp).
    commkit::cuda_step(log, "destroy barrier", barrier);
    if (barrier != cudaSuccess) return Teardown::kLeak;
    if (commkit::ld_acquire(&host_workspace_layout().timeout.at<commkit::TimeoutRecord>(host_ws_.get())->flag) == 1u) {
      broken_ = true;
      broken_reason_ = "a peer did not reach destroy()";
      return Teardown::kLeak;
    }
  }
  return Teardown::kCollective;
}

void Runtime::release(Teardown how, commkit::TeardownLog& log) noexcept {
  watch_.reset();  // its thread writes the timeout record in the host workspace
  const auto step = [&log](const char* name, cudaError_t e) { commkit::cuda_step(log, name, e); };
  // Events and the stream are local and may go with work pending on them (CUDA frees them once it
  // completes).
  for (CudaEvent* ev : {&event_in_, &event_out_, &notify_done_, &epi_done_}) {
    if (*ev) step("cudaEventDestroy", cudaEventDestroy(ev->get()));
    ev->leak();
  }
  if (epi_stream_) step("cudaStreamDestroy", cudaStreamDestroy(epi_stream_.get()));
  epi_stream_.leak();
  if (how != Teardown::kLeak) {
    if (domain_peer_bases_) step("cudaFree(domain_peer_bases)", cudaFree(domain_peer_bases_.get()));
    if (host_ws_) step("cudaFreeHost(host_workspace)", cudaFreeHost(host_ws_.get()));
  }
  // kLeak: kernels may still write the timeout record into the host workspace and read the domain view.
  domain_peer_bases_.leak();
  host_ws_.leak();
  if (window_) window_->release(how, log);
}

uint64_t Runtime::buffer_ptr() const {
  return reinterpret_cast<uint64_t>(static_cast<char*>(window_->base()) + workspace_bytes_);
}

CommView Runtime::view() const {
  CommView c = view_all();
  if (hybrid()) c.peer_bases = static_cast<void* const*>(domain_peer_bases_.get());
  return c;
}

CommView Runtime::view_all() const {
  CommView c{};
  c.peer_bases = window_->peer_bases();
  c.window_base = window_->base();
  c.buffer_offset = workspace_bytes_;
  c.host_workspace = host_ws_dev_;
  c.rank = rank_;
  c.num_ranks = num_ranks_;
  c.timeout_ns = gpu_timeout_ns_;
  c.num_scaleup_ranks = scaleup_;
  c.scaleout_peer_bases = gin_ ? nullptr : window_->peer_bases();
  c.gin_devcomm = gin_ ? window_->gin_devcomm() : nullptr;
  c.gin_window = gin_ ? window_->gin_window() : nullptr;
  return c;
}

void Runtime::stream_wait(int64_t waiter, int64_t signaller, void* event) {
  if (waiter == kNoStream || signaller == kNoStream || waiter == signaller) return;
  auto ev = static_cast<cudaEvent_t>(event);
  CK_CUDA_CHECK(cudaEventRecord(ev, reinterpret_cast<cudaStream_t>(signaller)));
  CK_CUDA_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(waiter), ev, 0));
}

}  // namespace elastic_ep
#endif  // COMMKIT_WITH_CUDA
