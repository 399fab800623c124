// elastic_ep/csrc/runtime.cpp -- host side of the elastic buffer: NCCL set-up, window, CPU sync.
// Host code compiled by the C++ compiler (exceptions never unwind through nvcc-compiled frames); it is
// empty unless the CUDA build is on (COMMKIT_WITH_CUDA=1). See runtime.hpp for the contract. The NCCL
// device-API structures live in kernels.cu (devcomm_create / devcomm_destroy).
#if COMMKIT_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "commkit/atomics.hpp"
#include "commkit/check.hpp"
#include "commkit/deadline.hpp"
#include "commkit/ipc.hpp"
#include "commkit/timeout_record.hpp"
#include "runtime.hpp"
#include "sizing.hpp"

#if NCCL_VERSION_CODE < 22809
#error "elastic_ep needs NCCL >= 2.28.9 (window registration, device communicators, LSA pointers)"
#endif

namespace elastic_ep {

namespace {
// The set-up / teardown trace of a Runtime method (RuntimeOptions::debug, from EP_BUFFER_DEBUG).
#define EP_DEBUG(...)                                    \
  do {                                                   \
    if (debug_) {                                        \
      std::fprintf(stderr, "[elastic_ep] " __VA_ARGS__); \
      std::fflush(stderr);                               \
    }                                                    \
  } while (0)

// commkit::clear_timeout_record is host-pass only; nvcc parses this file in its device pass as well.
void clear_record(commkit::TimeoutRecord* rec) {
  std::memset(static_cast<void*>(rec), 0, sizeof(*rec));
  rec->peer = -1;
  commkit::fence_system();
}
}  // namespace

const char* op_name(uint32_t op) {
  switch (op) {
    case kOpBarrier: return "elastic_ep barrier";
    case kOpDispatchNotify: return "elastic_ep dispatch (notify: waiting for a peer's counts)";
    case kOpDispatchEpilogue: return "elastic_ep dispatch epilogue (waiting for a peer's token records)";
    case kOpCombine: return "elastic_ep combine (entry barrier)";
    case kOpCombineReduce: return "elastic_ep combine reduce (waiting for a peer's combined rows)";
    case kOpPpSend: return "elastic_ep pp_send (waiting for a free slot at the peer)";
    case kOpPpRecv: return "elastic_ep pp_recv (waiting for the peer's tensor)";
    case kOpAllGather: return "elastic_ep all_gather (waiting for a peer's data)";
    case kOpAgrsSession: return "elastic_ep destroy_agrs_session (waiting for a peer to end the session)";
    case kOpScaleoutProbe: return "elastic_ep scale-out probe (waiting for the previous rail peer's put)";
    case kOpDispatchScaleout:
      return "elastic_ep hybrid dispatch scale-out stage (the forwarder waiting for a rail peer's tokens)";
    case kOpCombineScaleup:
      return "elastic_ep hybrid combine scale-up stage (the forwarder waiting for a domain peer's partials)";
    case kOpCombineScaleout:
      return "elastic_ep hybrid combine scale-out stage (waiting for a rail peer's forwarded partials)";
    default: return "elastic_ep operation";
  }
}

int nccl_runtime_version() {
  int v = 0;
  CK_NCCL_CHECK(ncclGetVersion(&v));
  return v;
}

int nccl_build_version() { return NCCL_VERSION_CODE; }

std::string get_local_nccl_unique_id() {
  ncclUniqueId id;
  CK_NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

int64_t create_nccl_comm(const std::string& unique_id, int num_ranks, int rank) {
  CK_CHECK_ARG(unique_id.size() == sizeof(ncclUniqueId::internal), "unique_id must be ",
               sizeof(ncclUniqueId::internal), " bytes (from get_local_nccl_unique_id), got ", unique_id.size());
  CK_CHECK_ARG(num_ranks > 0 && rank >= 0 && rank < num_ranks, "need 0 <= rank < num_ranks, got rank ", rank,
               " of ", num_ranks);
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclComm_t comm = nullptr;
  CK_NCCL_CHECK(ncclCommInitRank(&comm, num_ranks, id, rank));
  return reinterpret_cast<int64_t>(comm);
}

void destroy_nccl_comm(int64_t comm) {
  CK_CHECK_ARG(comm != 0, "destroy_nccl_comm: null communicator");
  // Abort rather than destroy: it never blocks on peers that are gone.
  CK_NCCL_CHECK(ncclCommAbort(reinterpret_cast<ncclComm_t>(comm)));
}

std::tuple<int, int> nccl_comm_rank_size(int64_t comm) {
  CK_CHECK_ARG(comm != 0, "null NCCL communicator");
  int rank = -1, size = -1;
  CK_NCCL_CHECK(ncclCommUserRank(reinterpret_cast<ncclComm_t>(comm), &rank));
  CK_NCCL_CHECK(ncclCommCount(reinterpret_cast<ncclComm_t>(comm), &size));
  return {rank, size};
}

std::optional<std::tuple<int, int, int>> comm_gin_properties(int64_t comm) {
  CK_CHECK_ARG(comm != 0, "null NCCL communicator");
  int gin = -1, railed = -1, lsa_teams = -1;
  const int res = elastic_ep::nccl_comm_gin_properties(reinterpret_cast<void*>(comm), &gin, &railed, &lsa_teams);
  if (res == -1) return std::nullopt;
  CK_CHECK(res == int(ncclSuccess), "ncclCommQueryProperties failed: ", ncclGetErrorString(ncclResult_t(res)));
  return std::make_tuple(gin, railed, lsa_teams);
}

uint64_t Runtime::begin_setup(int rank, int num_ranks, int64_t num_buffer_bytes, int num_cpu_timeout_secs,
                              const RuntimeOptions& options) {
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
  const int U = options.num_scaleup_ranks;
  CK_CHECK_ARG(U == 0 || (U > 0 && U <= num_ranks && num_ranks % U == 0), "num_scaleup_ranks must be 0 (direct "
               "mode) or a divisor of the ", num_ranks, " ranks, got ", U);
  scaleup_ = U == num_ranks ? 0 : U;
  CK_CHECK_ARG(!options.use_gin || scaleup_ > 0, "the GIN scale-out transport is for hybrid mode: num_scaleup_ranks "
               "must be a proper divisor of the ", num_ranks, " ranks, got ", U);
  gin_ = options.use_gin;
  gin_request_ = options.gin;
  CK_CUDA_CHECK(cudaGetDevice(&device_));
  CK_CUDA_CHECK(cudaDeviceGetAttribute(&num_device_sms_, cudaDevAttrMultiProcessorCount, device_));
  workspace_bytes_ = workspace_layout().bytes;
  return workspace_bytes_ + uint64_t(num_buffer_bytes);  // the window: [workspace | buffer]
}

Runtime::Runtime(int rank, int num_ranks, int64_t nccl_comm, int64_t num_buffer_bytes, int num_cpu_timeout_secs,
                 int num_gpu_timeout_secs, const RuntimeOptions& options)
    : rank_(rank),
      num_ranks_(num_ranks),
      num_buffer_bytes_(num_buffer_bytes),
      num_cpu_timeout_secs_(num_cpu_timeout_secs),
      gpu_timeout_ns_(uint64_t(num_gpu_timeout_secs > 0 ? num_gpu_timeout_secs : 0) * 1000000000ull) {
  CK_CHECK_ARG(nccl_comm != 0, "nccl_comm is null");
  const uint64_t total = begin_setup(rank, num_ranks, num_buffer_bytes, num_cpu_timeout_secs, options);
  auto [comm_rank, comm_size] = nccl_comm_rank_size(nccl_comm);
  CK_CHECK_ARG(comm_rank == rank && comm_size == num_ranks, "the NCCL communicator is rank ", comm_rank, " of ",
               comm_size, " but rank_idx=", rank, ", num_ranks=", num_ranks, " were given");
  comm_ = reinterpret_cast<void*>(nccl_comm);

  // One symmetric allocation. Every rank passes the same size (collective).
  EP_DEBUG("rank %d/%d: device %d, ncclMemAlloc %llu bytes\n", rank, num_ranks, device_, (unsigned long long)total);
  CK_NCCL_CHECK(ncclMemAlloc(&sym_ptr_, total));
  try {
    setup_nccl_window(total);
  } catch (...) {
    abandon_setup();
    throw;
  }
}

void Runtime::setup_nccl_window(uint64_t total) {
  const int rank = rank_, num_ranks = num_ranks_;
  auto comm = static_cast<ncclComm_t>(comm_);
  EP_DEBUG("rank %d: ncclCommWindowRegister %p\n", rank, sym_ptr_);
  ncclWindow_t win = nullptr;
  CK_NCCL_CHECK(ncclCommWindowRegister(comm, sym_ptr_, total, &win, NCCL_WIN_COLL_SYMMETRIC));
  window_ = win;

  // Device communicator: LSA only (no GIN requested, so it works on machines without a NIC), or with
  // the GIN contexts of hybrid mode across NVLink domains.
  EP_DEBUG("rank %d: ncclDevCommCreate (NCCL headers %d, GIN %d)\n", rank, NCCL_VERSION_CODE, int(gin_));
  int lsa_rank = -1;
  const int res = devcomm_create(comm_, gin_ ? &gin_request_ : nullptr, &devcomm_, &lsa_rank, &lsa_size_);
  if (res != int(ncclSuccess)) {
    setup_failed_everywhere_ = true;  // every rank of the same job gets the same answer
    CK_THROW("ncclDevCommCreate failed: ", ncclGetErrorString(ncclResult_t(res)),
             gin_ ? " (hybrid mode asked for GIN contexts: it needs a GIN-capable network, InfiniBand/RoCE with "
                    "GPUDirect RDMA, on every node)"
                  : " (direct mode needs every rank in one NVLink/LSA domain with CUDA P2P)");
  }
  EP_DEBUG("rank %d: devcomm lsaRank %d lsaSize %d\n", rank, lsa_rank, lsa_size_);
  // Over GIN, NCCL's LSA team is this rank's node = its scale-up domain of U ranks (ranks numbered
  // node by node); otherwise every rank shares one.
  const int team = gin_ ? scaleup_ : num_ranks, first = gin_ ? rank - rank % scaleup_ : 0;
  setup_failed_everywhere_ = lsa_size_ != team || lsa_rank != rank - first;  // the same on every rank
  CK_CHECK(lsa_size_ == team && lsa_rank == rank - first,
           gin_ ? "hybrid mode over GIN needs NCCL's LSA team (the ranks sharing NVLink) to be this rank's scale-up "
                  "domain of "
                : "direct mode needs all ",
           team, " ranks, node by node, but NCCL reports an LSA team of ", lsa_size_, " with this rank at ", lsa_rank,
           gin_ ? "" : " (several NVLink domains run in hybrid mode: allow_hybrid_mode=True)");

  CK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&peer_bases_), sizeof(void*) * num_ranks));
  CK_CUDA_CHECK(cudaMemset(peer_bases_, 0, sizeof(void*) * num_ranks));  // other NVLink domains: none
  launch_resolve_peers(window_, first, lsa_size_, peer_bases_, nullptr);
  CK_CUDA_CHECK(cudaGetLastError());
  CK_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<void*> bases(num_ranks);
  CK_CUDA_CHECK(cudaMemcpy(bases.data(), peer_bases_, sizeof(void*) * num_ranks, cudaMemcpyDeviceToHost));
  for (int p = 0; p < num_ranks; ++p) EP_DEBUG("rank %d: peer %d window at %p\n", rank, p, bases[p]);
  // NCCL maps every rank's window, this one included, into one flat LSA range; the kernels address
  // their own window through that mapping too (lsa_base_), the ncclMemAlloc pointer aliases it.
  lsa_base_ = bases[rank];
  CK_CHECK(lsa_base_ != nullptr, "ncclGetLsaPointer returned null for this rank");
  for (void* b : bases) host_peer_bases_.push_back(static_cast<char*>(b));
  make_domain_view();
  finish_setup();
}

void Runtime::make_domain_view() {
  if (!hybrid()) return;
  std::vector<void*> dom(size_t(num_ranks_), nullptr);
  for (int r = rank_ - rank_ % scaleup_; r < rank_ - rank_ % scaleup_ + scaleup_; ++r) dom[r] = host_peer_bases_[r];
  CK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&domain_peer_bases_), sizeof(void*) * num_ranks_));
  CK_CUDA_CHECK(cudaMemcpy(domain_peer_bases_, dom.data(), sizeof(void*) * num_ranks_, cudaMemcpyHostToDevice));
}

void Runtime::abandon_setup() noexcept {
  for (void** ev : {&event_in_, &event_out_, &notify_done_, &epi_done_})
    if (*ev != nullptr) {
      cudaEventDestroy(static_cast<cudaEvent_t>(*ev));
      *ev = nullptr;
    }
  if (epi_stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(epi_stream_));
  epi_stream_ = nullptr;
  if (peer_bases_ != nullptr) cudaFree(peer_bases_);
  peer_bases_ = nullptr;
  if (domain_peer_bases_ != nullptr) cudaFree(domain_peer_bases_);
  domain_peer_bases_ = nullptr;
  if (host_ws_ != nullptr) cudaFreeHost(host_ws_);
  host_ws_ = nullptr;
  if (ipc_) {
    if (sym_ptr_ != nullptr) cudaFree(sym_ptr_);
    sym_ptr_ = nullptr;
  } else if (window_ == nullptr || setup_failed_everywhere_) {
    // Registration is collective: undone only where no rank got past it (it failed) or where every
    // rank failed on the same check (the LSA team, the device communicator), so every rank is here.
    if (devcomm_ != nullptr) devcomm_destroy(comm_, devcomm_);
    devcomm_ = nullptr;
    if (window_ != nullptr)
      ncclCommWindowDeregister(static_cast<ncclComm_t>(comm_), static_cast<ncclWindow_t>(window_));
    window_ = nullptr;
    if (sym_ptr_ != nullptr) ncclMemFree(sym_ptr_);
    sym_ptr_ = nullptr;
  }
  // Otherwise a failure of this rank alone (a small cudaMalloc, the host workspace) after the
  // registration: a one-sided deregistration could wait for peers whose set-up went on, so the
  // window stays registered until the communicator is destroyed (the buffer's other memory is freed).
  destroyed_ = true;
  (void)cudaGetLastError();
}

Runtime::Runtime(Ipc, int rank, int num_ranks, int64_t num_buffer_bytes, int num_cpu_timeout_secs,
                 int num_gpu_timeout_secs, const RuntimeOptions& options)
    : rank_(rank),
      num_ranks_(num_ranks),
      num_buffer_bytes_(num_buffer_bytes),
      num_cpu_timeout_secs_(num_cpu_timeout_secs),
      gpu_timeout_ns_(uint64_t(num_gpu_timeout_secs > 0 ? num_gpu_timeout_secs : 0) * 1000000000ull),
      ipc_(true) {
  const uint64_t total = begin_setup(rank, num_ranks, num_buffer_bytes, num_cpu_timeout_secs, options);
  CK_CHECK_ARG(!gin_, "the CUDA-IPC window is one node's: its hybrid mode runs over the NVLink emulation, not GIN");
  EP_DEBUG("rank %d/%d: device %d, IPC window of %llu bytes\n", rank, num_ranks, device_, (unsigned long long)total);
  // cudaMalloc, not the caching allocator: an IPC handle exports a whole allocation.
  CK_CUDA_CHECK(cudaMalloc(&sym_ptr_, total));
  lsa_base_ = sym_ptr_;
  lsa_size_ = num_ranks;  // the caller promises one P2P domain (or one GPU)
  ipc_peers_.assign(size_t(num_ranks), nullptr);
  try {
    finish_setup();
  } catch (...) {
    abandon_setup();
    throw;
  }
  // Unusable (pending_health reports it) until the peers' windows are open.
  broken_ = true;
  broken_reason_ = "its CUDA-IPC window is not connected: open_ipc_peers() has not run";
}

namespace {
// The window handle ranks exchange (commkit/ipc_handle.hpp): kernels address a peer's window with
// this rank's layout, so every rank's buffer size must match, as in ipc_all2all.
const commkit::IpcHandleFormat kWindowHandleFormat{
    {'e', 'l', 'a', 's', 't', 'e', 'p', '\x01'}, "elastic_ep", "a buffer (num_bytes) of",
    "; every rank must create the buffer with the same num_bytes, or a rank would write past a smaller "
    "peer window"};
}  // namespace

std::string Runtime::ipc_handle() const {
  CK_CHECK(ipc_, "ipc_handle: this buffer's window is NCCL's, not CUDA IPC");
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  set_device();
  return commkit::describe_ipc_handle(kWindowHandleFormat, window_info(), commkit::ipc_handle_of(sym_ptr_));
}

commkit::IpcWindowInfo Runtime::window_info() const {
  return {num_ranks_, rank_, uint64_t(num_buffer_bytes_), workspace_bytes_ + uint64_t(num_buffer_bytes_)};
}

void Runtime::open_ipc_peers(const std::vector<std::string>& handles) {
  CK_CHECK(ipc_, "open_ipc_peers: this buffer's window is NCCL's, not CUDA IPC");
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  CK_CHECK(peer_bases_ == nullptr, "open_ipc_peers was already called");
  // Every rank's world size and buffer size before any peer's memory is opened.
  const std::vector<std::string> raw =
      commkit::check_described_ipc_handles(kWindowHandleFormat, handles, window_info(), ipc_handle(), "open_ipc_peers");
  set_device();
  ipc_peers_ = commkit::open_ipc_handles(raw, rank_, "open_ipc_peers");
  std::vector<void*> bases = ipc_peers_;
  bases[rank_] = sym_ptr_;
  host_peer_bases_.clear();
  for (void* b : bases) host_peer_bases_.push_back(static_cast<char*>(b));
  void** dev = nullptr;
  CK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dev), sizeof(void*) * num_ranks_));
  CK_CUDA_CHECK(cudaMemcpy(dev, bases.data(), sizeof(void*) * num_ranks_, cudaMemcpyHostToDevice));
  peer_bases_ = dev;
  make_domain_view();
  broken_ = false;
  broken_reason_.clear();
  EP_DEBUG("rank %d: IPC peers open\n", rank_);
  // The caller runs a process-group barrier next, before any peer writes into this window.
}

void Runtime::finish_setup() {
  // The workspace is zeroed once; kernels keep their local scratch at zero and tag signals by epoch.
  CK_CUDA_CHECK(cudaMemset(sym_ptr_, 0, workspace_bytes_));
  CK_CUDA_CHECK(cudaHostAlloc(&host_ws_, host_workspace_layout().bytes, cudaHostAllocMapped));
  std::memset(host_ws_, 0, host_workspace_layout().bytes);
  clear_record(host_workspace_layout().timeout.at<commkit::TimeoutRecord>(host_ws_));
  CK_CUDA_CHECK(cudaHostGetDevicePointer(&host_ws_dev_, host_ws_, 0));
  cudaEvent_t ev_in = nullptr, ev_out = nullptr;
  CK_CUDA_CHECK(cudaEventCreateWithFlags(&ev_in, cudaEventDisableTiming));
  CK_CUDA_CHECK(cudaEventCreateWithFlags(&ev_out, cudaEventDisableTiming));
  event_in_ = ev_in;
  event_out_ = ev_out;
  cudaEvent_t ev_notify = nullptr, ev_epi = nullptr;
  CK_CUDA_CHECK(cudaEventCreateWithFlags(&ev_notify, cudaEventDisableTiming));
  CK_CUDA_CHECK(cudaEventCreateWithFlags(&ev_epi, cudaEventDisableTiming));
  notify_done_ = ev_notify;
  epi_done_ = ev_epi;
  cudaStream_t epi = nullptr;
  CK_CUDA_CHECK(cudaStreamCreateWithFlags(&epi, cudaStreamNonBlocking));
  epi_stream_ = epi;
  CK_CUDA_CHECK(cudaDeviceSynchronize());
  EP_DEBUG("rank %d: window and workspace ready\n", rank_);
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

// How long destroy() waits for its peers when the buffer has no device deadline.
constexpr uint64_t kDestroyDeadlineNs = 30ull * 1000000000ull;

void Runtime::destroy() {
  if (destroyed_) return;
  destroyed_ = true;
  EP_DEBUG("rank %d: destroy (broken=%d)\n", rank_, int(broken_));
  // Events are local and may be destroyed with work pending on them (CUDA frees them once it completes).
  for (void** ev : {&event_in_, &event_out_, &notify_done_, &epi_done_})
    if (*ev != nullptr) {
      cudaEventDestroy(static_cast<cudaEvent_t>(*ev));
      *ev = nullptr;
    }
  if (epi_stream_ != nullptr) {  // released once its pending work completes
    cudaStreamDestroy(static_cast<cudaStream_t>(epi_stream_));
    epi_stream_ = nullptr;
  }
  if (broken_ && peer_bases_ != nullptr) {
    // After a timeout the peers are out of step (or gone): NCCL's window/devcomm teardown is collective
    // and kernels may still be spinning towards their device deadline, so nothing is freed here. The
    // window is leaked until the communicator is aborted (destroy_nccl_comm) or the process exits.
    // (An IPC window whose peers were never opened ran no kernel: it is freed below.)
    return;
  }
  set_device();
  cudaDeviceSynchronize();
  if (peer_bases_ != nullptr && (entered_ || !ipc_)) {
    // A device barrier with a deadline before anything is released.
    // * CUDA IPC: nothing makes its teardown collective, so the barrier makes sure no peer still
    //   writes into (or reads) this window when it is freed. Not needed when this rank never entered
    //   an operation: a peer writes here only after this rank published an epoch, and this rank read
    //   no peer's window. That is also the case after a failed set-up, where peers may never arrive.
    // * NCCL: the window and device-communicator teardown below is collective and has no deadline of
    //   its own; entering it only once every peer reached destroy() keeps a rank whose peer never
    //   comes (an exception on that rank, a dead process) from blocking in it forever.
    // A peer that never arrives leaves a timeout record; the window is then leaked as after any
    // timeout (destroy_nccl_comm / process exit release it). With num_gpu_timeout_secs = 0 (no device
    // deadline) the operations may wait forever, but teardown may not: it gets its own deadline.
    CommView v = view();
    if (v.timeout_ns == 0) v.timeout_ns = kDestroyDeadlineNs;
    launch_barrier(v, nullptr);
    cudaDeviceSynchronize();
    (void)cudaGetLastError();
    if (commkit::ld_acquire(&host_workspace_layout().timeout.at<commkit::TimeoutRecord>(host_ws_)->flag) == 1u) {
      broken_ = true;
      broken_reason_ = "a peer did not reach destroy()";
      return;
    }
  }
  auto comm = static_cast<ncclComm_t>(comm_);
  if (devcomm_ != nullptr) {
    devcomm_destroy(comm_, devcomm_);
    devcomm_ = nullptr;
  }
  if (window_ != nullptr) {
    ncclCommWindowDeregister(comm, static_cast<ncclWindow_t>(window_));
    window_ = nullptr;
  }
  commkit::close_ipc_handles(ipc_peers_);
  if (sym_ptr_ != nullptr) {
    if (ipc_)
      cudaFree(sym_ptr_);
    else
      ncclMemFree(sym_ptr_);
    sym_ptr_ = nullptr;
  }
  if (peer_bases_ != nullptr) cudaFree(peer_bases_);
  peer_bases_ = nullptr;
  if (domain_peer_bases_ != nullptr) cudaFree(domain_peer_bases_);
  domain_peer_bases_ = nullptr;
  if (host_ws_ != nullptr) cudaFreeHost(host_ws_);
  host_ws_ = nullptr;
}

uint64_t Runtime::buffer_ptr() const {
  return reinterpret_cast<uint64_t>(static_cast<char*>(lsa_base_) + workspace_bytes_);
}

CommView Runtime::view() const {
  CommView c = view_all();
  if (hybrid()) c.peer_bases = domain_peer_bases_;
  return c;
}

CommView Runtime::view_all() const {
  CommView c{};
  c.peer_bases = peer_bases_;
  c.window_base = lsa_base_;
  c.buffer_offset = workspace_bytes_;
  c.host_workspace = host_ws_dev_;
  c.rank = rank_;
  c.num_ranks = num_ranks_;
  c.timeout_ns = gpu_timeout_ns_;
  c.num_scaleup_ranks = scaleup_;
  c.scaleout_peer_bases = gin_ ? nullptr : peer_bases_;
  c.gin_devcomm = gin_ ? devcomm_ : nullptr;
  c.gin_window = gin_ ? window_ : nullptr;
  return c;
}

void Runtime::check_healthy() {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  auto* rec = host_workspace_layout().timeout.at<commkit::TimeoutRecord>(host_ws_);
  if (commkit::ld_acquire(&rec->flag) == 1u) {
    commkit::TimeoutRecord copy = *rec;
    broken_ = true;
    broken_reason_ = std::string(op_name(copy.op)) + " timed out earlier";
    clear_record(rec);
    commkit::detail::raise_timeout(__FILE__, __LINE__, op_name(copy.op), copy.rank, copy.peer, copy.expected,
                                   copy.observed, " after ", copy.waited_ns / 1000000ull,
                                   " ms without progress (GPU block ", copy.channel,
                                   "); the CUDA context is usable but this buffer's signals are out of step: "
                                   "destroy it and create a new one");
  }
  CK_CHECK(!broken_, "this elastic buffer is unusable (", broken_reason_, "); destroy it and create a new one");
}

void Runtime::barrier(int64_t stream) {
  // Health (timeouts, destroyed) is checked by the Python layer before the call (take_timeout).
  set_device();
  entered_ = true;
  launch_barrier(view(), reinterpret_cast<void*>(stream));
  CK_CUDA_CHECK(cudaGetLastError());
}

void Runtime::debug_seed_epoch(uint64_t last_epoch) {
  CK_CHECK(!destroyed_ && !broken_, "debug_seed_epoch needs a usable buffer");
  set_device();
  CK_CUDA_CHECK(cudaDeviceSynchronize());  // no kernel of this rank may be running
  const auto ws = workspace_layout();
  char* base = static_cast<char*>(sym_ptr_);
  CK_CUDA_CHECK(cudaMemcpy(base + ws.grid_counter.offset + 4ull * kGridCounterEpochSlot, &last_epoch,
                           sizeof(last_epoch), cudaMemcpyHostToDevice));
  const std::vector<uint64_t> words(std::max(kMaxRanks, kMaxExperts), uint64_t(uint32_t(last_epoch)) << 32);
  CK_CUDA_CHECK(cudaMemcpy(base + ws.rank_count.offset, words.data(), 8ull * kMaxRanks, cudaMemcpyHostToDevice));
  CK_CUDA_CHECK(
      cudaMemcpy(base + ws.expert_count.offset, words.data(), 8ull * kMaxExperts, cudaMemcpyHostToDevice));
  for (int half = 0; half < 2; ++half)  // hybrid notify's relayed words carry the tag too
    CK_CUDA_CHECK(cudaMemcpy(base + ws.count_relay.offset + half * 8ull * kMaxRanks, words.data(),
                             half == 0 ? 8ull * kMaxRanks : 8ull * kMaxExperts, cudaMemcpyHostToDevice));
}

int Runtime::pending_health() const {
  if (destroyed_ || host_ws_ == nullptr) return kHealthBroken;
  const auto hl = host_workspace_layout();
  int bits = broken_ ? int(kHealthBroken) : 0;
  if (commkit::ld_acquire(&hl.timeout.at<commkit::TimeoutRecord>(host_ws_)->flag) == 1u) bits |= kHealthTimeout;
  if (commkit::ld_acquire(&hl.ids.at<uint64_t>(host_ws_)[2]) != masked_ids_seen_) bits |= kHealthMaskedIds;
  return bits;
}

void Runtime::stream_wait(int64_t waiter, int64_t signaller, void* event) {
  if (waiter == kNoStream || signaller == kNoStream || waiter == signaller) return;
  auto ev = static_cast<cudaEvent_t>(event);
  CK_CUDA_CHECK(cudaEventRecord(ev, reinterpret_cast<cudaStream_t>(signaller)));
  CK_CUDA_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(waiter), ev, 0));
}

template <typename Pred, typename Progress>
int Runtime::poll_host(Pred&& pred, Progress&& progress) {
  auto* rec = host_workspace_layout().timeout.at<commkit::TimeoutRecord>(host_ws_);
  commkit::ProgressDeadline deadline(uint64_t(num_cpu_timeout_secs_) * 1000ull);
  // The host waits here for a kernel of the call it is inside (the counts of a CPU-synced dispatch):
  // it yields for up to 20 ms (ELASTIC_EP_HOST_WAIT_YIELD_US) before it sleeps, as a sleeping
  // waiter wakes ~50-100 us late (timer slack) and every dispatch would pay that. DeepEP spins.
  return int(commkit::poll_until(pred, deadline, progress, [&] { return commkit::ld_acquire(&rec->flag) == 1u; },
                                 commkit::Backoff(host_wait_yield_ns_)));
}

void Runtime::dispatch(const DispatchParams& p, int64_t stream, int64_t wait_stream) {
  // Health (timeouts, destroyed) is checked by the Python layer before the call (pending_health).
  set_device();
  stream_wait(stream, wait_stream, event_in_);
  DispatchParams q = p;
  // Tag of the host-mapped counts: a stale notify of an earlier, unsynchronised dispatch can still land
  // after this point, and its tag differs.
  host_tag_ = (host_tag_ + 1u) & 0x7fffffffu;
  if (host_tag_ == 0u) host_tag_ = 1u;
  q.host_tag = host_tag_;
  // The overlapped dispatch's epilogue starts after notify's event and counts on a push that pushes
  // nothing when notify refused: its push follows notify.
  if (q.overlap) q.concurrent_notify = 0;
  if (hybrid()) {
    // The Python layer plans hybrid dispatches this way; a bad plan must not write past the buffer.
    CK_CHECK(!q.overlap && !q.zero_copy, "dispatch: hybrid mode runs neither overlapped nor zero-copy");
    const auto hl = hybrid_dispatch_layout(dispatch_token_layout(q.hidden_bytes, 1, q.num_sf_packs, q.num_topk).bytes,
                                           q.num_topk, num_ranks_, num_ranks_ / scaleup_,
                                           q.num_max_tokens_per_rank);
    CK_CHECK(hl.bytes <= num_buffer_bytes_, "dispatch: hybrid mode needs ", hl.bytes, " bytes of buffer, this one has ",
             num_buffer_bytes_);
    q.concurrent_notify = 0;  // the push stages records in the buffer notify's barrier makes free
  }
  if (q.zero_copy) {
    // The Python layer checked the layout (zero_copy_layout); a bad plan must not write past the buffer.
    CK_CHECK(q.direct_base != nullptr, "dispatch: zero_copy needs direct_base");
    CK_CHECK(q.zero_copy_x_offset >= 0 &&
                 q.zero_copy_x_offset + int64_t(num_ranks_) * q.num_max_tokens_per_rank * q.hidden_bytes <=
                     num_buffer_bytes_,
             "dispatch: the zero-copy receive area (offset ", q.zero_copy_x_offset, ") does not fit the buffer of ",
             num_buffer_bytes_, " bytes");
    if (!q.cached) q.concurrent_notify = 0;  // its push needs notify's direct_base
  }
  entered_ = true;
  launch_dispatch(view(), q, reinterpret_cast<void*>(stream), q.overlap ? notify_done_ : nullptr);
  CK_CUDA_CHECK(cudaGetLastError());
}

Runtime::TimeoutInfo Runtime::take_timeout() {
  TimeoutInfo info;
  if (destroyed_ || host_ws_ == nullptr) return info;
  auto* rec = host_workspace_layout().timeout.at<commkit::TimeoutRecord>(host_ws_);
  if (commkit::ld_acquire(&rec->flag) != 1u) return info;
  commkit::TimeoutRecord copy = *rec;
  clear_record(rec);
  info.expired = true;
  info.operation = op_name(copy.op);
  info.rank = copy.rank;
  info.peer = copy.peer;
  info.expected = copy.expected;
  info.observed = copy.observed;
  info.waited_ms = copy.waited_ns / 1000000ull;
  info.channel = copy.channel;
  broken_ = true;
  broken_reason_ = info.operation + " timed out earlier";
  return info;
}

DispatchCounts Runtime::wait_dispatch_counts(int num_local_experts) {
  CK_CHECK_ARG(num_local_experts >= 1 && num_local_experts <= kMaxLocalExperts, "bad num_local_experts ",
               num_local_experts);
  const auto hl = host_workspace_layout();
  auto* rank_words = hl.rank_count.at<uint64_t>(host_ws_);
  auto* expert_words = hl.expert_count.at<uint64_t>(host_ws_);
  const uint64_t tag = host_tag_;
  int ready_ranks = 0, ready_experts = 0;
  int num_recv = 0, num_expanded = 0;
  std::vector<int> per_expert, refused;
  per_expert.reserve(num_local_experts);
  // Each word carries the dispatch's tag, so words are taken one by one as they land.
  const int status = poll_host(
      [&] {
        while (ready_ranks < num_ranks_) {
          const uint64_t w = commkit::ld_acquire(&rank_words[ready_ranks]);
          if ((w >> 32) != tag) return false;
          if (w & kRefusedBit) refused.push_back(ready_ranks);
          num_recv += int(w & kCountMask);
          ++ready_ranks;
        }
        while (ready_experts < num_local_experts) {
          const uint64_t w = commkit::ld_acquire(&expert_words[ready_experts]);
          if ((w >> 32) != tag) return false;
          per_expert.push_back(int(w & 0xffffffffu));
          num_expanded += int(w & 0xffffffffu);
          ++ready_experts;
        }
        return true;
      },
      [&] { return uint64_t(ready_ranks) * 65536u + uint64_t(ready_experts); });
  if (status == 2) {
    broken_ = true;
    broken_reason_ = "a dispatch CPU wait timed out";
  }
  DispatchCounts out;
  out.ranks_ready = ready_ranks;
  out.experts_ready = ready_experts;
  if (status == 0 && !refused.empty()) {
    refused_ranks_ = refused;
    out.status = 3;
    return out;
  }
  out.status = status;
  out.num_recv_tokens = num_recv;
  out.num_expanded_tokens = num_expanded;
  out.num_recv_tokens_per_expert = std::move(per_expert);
  return out;
}

std::tuple<std::vector<int>, int64_t, int64_t> Runtime::take_refusal() {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  std::vector<int> ranks = refused_ranks_;
  refused_ranks_.clear();
  const bool mine = std::find(ranks.begin(), ranks.end(), rank_) != ranks.end();
  if (!mine) return {ranks, 0, 0};
  auto* words = host_workspace_layout().ids.at<uint64_t>(host_ws_);
  uint64_t w = 0;
  const int status = poll_host(
      [&] {
        w = commkit::ld_acquire(&words[0]);
        return (w >> 32) == uint64_t(host_tag_);
      },
      [] { return 0; });
  if (status != 0) return {ranks, -1, 0};  // the report did not arrive: the count is unknown
  return {ranks, int64_t(w & 0xffffffffu), int64_t(words[1])};
}

std::pair<int64_t, int64_t> Runtime::take_masked_ids() {
  if (destroyed_ || host_ws_ == nullptr) return {0, 0};
  auto* words = host_workspace_layout().ids.at<uint64_t>(host_ws_);
  const uint64_t total = commkit::ld_acquire(&words[2]);
  if (total == masked_ids_seen_) return {0, 0};
  const int64_t fresh = int64_t(total - masked_ids_seen_);
  masked_ids_seen_ = total;
  return {fresh, int64_t(words[3])};
}

void Runtime::dispatch_epilogue(const EpilogueParams& p, int64_t stream, int64_t join_stream) {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  CK_CHECK(!hybrid() || !p.overlap, "dispatch epilogue: hybrid mode runs no overlapped epilogue");
  set_device();
  if (p.overlap) {
    // Beside the push (still running on `stream`): start once notify finished, then join back.
    auto epi = static_cast<cudaStream_t>(epi_stream_);
    CK_CUDA_CHECK(cudaStreamWaitEvent(epi, static_cast<cudaEvent_t>(notify_done_), 0));
    launch_dispatch_epilogue(view(), p, epi);
    CK_CUDA_CHECK(cudaGetLastError());
    CK_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(epi_done_), epi));
    CK_CUDA_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(epi_done_), 0));
  } else {
    launch_dispatch_epilogue(view(), p, reinterpret_cast<void*>(stream));
    CK_CUDA_CHECK(cudaGetLastError());
  }
  stream_wait(join_stream, stream, event_out_);
}

void Runtime::pp_transfer(const PpParams& p, bool send, int64_t stream) {
  const char* op = send ? "pp_send" : "pp_recv";
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  CK_CHECK(p.peer >= 0 && p.peer < num_ranks_ && p.peer != rank_ && p.nbytes >= 0 && p.nbytes <= p.slot_bytes &&
               p.num_max_inflight > 0 &&
               int64_t(num_ranks_) * p.num_max_inflight * p.slot_bytes <= num_buffer_bytes_,
           op, ": bad parameters (peer ", p.peer, ", ", p.nbytes, " bytes, slots of ", p.slot_bytes, ")");
  // Over GIN another node's window is not mapped, and PP has no GIN kernels (DeepEP's PP uses GIN).
  CK_CHECK(host_peer_bases_.empty() || host_peer_bases_[p.peer] != nullptr, op, ": rank ", p.peer,
           " is in another NVLink domain; PP over the GIN scale-out transport is not supported");
  set_device();
  (send ? launch_pp_send : launch_pp_recv)(view_all(), p, reinterpret_cast<void*>(stream));
  CK_CUDA_CHECK(cudaGetLastError());
}

void Runtime::scaleout_probe(const ScaleoutProbeParams& p, int64_t stream) {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  CK_CHECK(p.next >= 0 && p.next < num_ranks_ && p.prev >= 0 && p.prev < num_ranks_ && p.bytes % 16 == 0 &&
               p.src % 16 == 0 && p.dst % 16 == 0 && p.src >= workspace_bytes_ && p.dst >= workspace_bytes_ &&
               p.src + p.bytes <= workspace_bytes_ + uint64_t(num_buffer_bytes_) &&
               p.dst + p.bytes <= workspace_bytes_ + uint64_t(num_buffer_bytes_),
           "scaleout_probe: bad parameters (next ", p.next, ", prev ", p.prev, ", ", p.bytes, " bytes from ", p.src,
           " to ", p.dst, ")");
  set_device();
  launch_scaleout_probe(view_all(), p, reinterpret_cast<void*>(stream));
  CK_CUDA_CHECK(cudaGetLastError());
}

void Runtime::agrs_all_gather(const std::vector<uint64_t>& srcs, const std::vector<int64_t>& nbytes,
                              const std::vector<int64_t>& offsets, int64_t stream) {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  CK_CHECK(srcs.size() == nbytes.size() && srcs.size() == offsets.size() && !srcs.empty(),
           "all_gather: one source, size and offset per tensor");
  CK_CHECK(int(host_peer_bases_.size()) == num_ranks_, "all_gather: the peers' windows are not open");
  CK_CHECK(!gin_, "all_gather: AGRS copies into every rank's window over NVLink; this buffer spans NVLink domains "
           "(GIN), so it has no AGRS");
  for (size_t i = 0; i < srcs.size(); ++i)
    CK_CHECK(nbytes[i] >= 0 && offsets[i] >= 0 && offsets[i] + num_ranks_ * nbytes[i] <= num_buffer_bytes_,
             "all_gather: tensor ", i, " (", nbytes[i], " bytes at ", offsets[i], ") exceeds the buffer");
  set_device();
  auto s = reinterpret_cast<cudaStream_t>(stream);
  // Peers in a rotating order, starting with the next rank, so the ranks' first copies do not all
  // target rank 0.
  for (int j = 0; j < num_ranks_; ++j) {
    const int r = (rank_ + 1 + j) % num_ranks_;
    for (size_t i = 0; i < srcs.size(); ++i) {
      if (nbytes[i] == 0) continue;
      char* dst = host_peer_bases_[r] + workspace_bytes_ + offsets[i] + int64_t(rank_) * nbytes[i];
      const void* src = reinterpret_cast<const void*>(srcs[i]);
      if (r == rank_ && dst == src) continue;  // written in place (agrs_get_inplace_tensor)
      CK_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(nbytes[i]), cudaMemcpyDeviceToDevice, s));
    }
  }
  launch_agrs_gather_done(view_all(), s);
  CK_CUDA_CHECK(cudaGetLastError());
}

std::vector<int64_t> Runtime::pp_unreceived() {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  set_device();
  CK_CUDA_CHECK(cudaDeviceSynchronize());
  const auto ws = workspace_layout();
  std::vector<uint64_t> sent(num_ranks_), received(num_ranks_);
  const char* base = static_cast<const char*>(lsa_base_);
  CK_CUDA_CHECK(cudaMemcpy(sent.data(), base + ws.pp_sent.offset, 8 * sent.size(), cudaMemcpyDeviceToHost));
  CK_CUDA_CHECK(cudaMemcpy(received.data(), base + ws.pp_seq.offset + 8ull * kMaxRanks, 8 * received.size(),
                           cudaMemcpyDeviceToHost));
  std::vector<int64_t> out(num_ranks_);
  for (int r = 0; r < num_ranks_; ++r) out[r] = int64_t(sent[r] - received[r]);
  return out;
}

void Runtime::agrs_session_end(int64_t stream) {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  set_device();
  launch_agrs_session_end(view_all(), reinterpret_cast<void*>(stream));
  CK_CUDA_CHECK(cudaGetLastError());
}

void Runtime::combine(const CombineParams& p, int64_t stream, uint64_t wait_event, int64_t wait_stream,
                      int64_t join_stream) {
  // Health (timeouts, destroyed) is checked by the Python layer before the call (pending_health).
  set_device();
  stream_wait(stream, wait_stream, event_in_);
  auto* s = reinterpret_cast<void*>(stream);
  entered_ = true;
  if (hybrid()) {
    CK_CHECK(p.overlap_push_blocks == 0, "combine: hybrid mode has no overlapped combine");
    const bool multi = p.allow_multiple_reduction != 0;
    const auto hc = hybrid_combine_layout(combine_token_layout(p.hidden, 2, p.num_topk).bytes,
                                          combine_num_slots(num_ranks_, p.num_topk, multi),
                                          hybrid_stage_slots(num_ranks_, scaleup_, p.num_topk, multi),
                                          num_ranks_ / scaleup_, p.num_max_tokens_per_rank);
    CK_CHECK(hc.bytes <= num_buffer_bytes_, "combine: hybrid mode needs ", hc.bytes, " bytes of buffer, this one has ",
             num_buffer_bytes_);
  }
  if (p.overlap_push_blocks > 0) {
    CK_CHECK(wait_event == 0, "combine: previous_event_before_epilogue cannot gate an overlapped reduce");
    CK_CHECK(p.overlap_push_blocks < p.num_sms, "combine: overlap_push_blocks (", p.overlap_push_blocks,
             ") must leave reduce blocks of num_sms (", p.num_sms, ")");
    CK_CHECK(overlap_fits(num_ranks_, p.num_max_tokens_per_rank), "combine: ", num_ranks_, " ranks x ",
             p.num_max_tokens_per_rank, " tokens exceed the overlapped combine's arrival counters");
    launch_combine_overlapped(view(), p, s);
    CK_CUDA_CHECK(cudaGetLastError());
    stream_wait(join_stream, stream, event_out_);
    return;
  }
  launch_combine_push(view(), p, s);
  CK_CUDA_CHECK(cudaGetLastError());
  if (wait_event != 0)
    CK_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(s), reinterpret_cast<cudaEvent_t>(wait_event), 0));
  launch_combine_reduce(view(), p, s);
  CK_CUDA_CHECK(cudaGetLastError());
  stream_wait(join_stream, stream, event_out_);
}

}  // namespace elastic_ep
#endif  // COMMKIT_WITH_CUDA
