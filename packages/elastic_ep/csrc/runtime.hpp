// elastic_ep/csrc/runtime.hpp -- the torch-free host side of the elastic buffer.
//
// Runtime owns one window [workspace | buffer] that every peer maps, the base address of every peer's
// window as the kernels see it, and a host-mapped workspace for the CPU sync and the device timeout
// record. Two ways to build the window, the kernels cannot tell them apart:
//  * NCCL (the default): an NCCL symmetric window (ncclMemAlloc + ncclCommWindowRegister), a device
//    communicator (ncclDevCommCreate, LSA only) and the peers' LSA addresses from ncclGetLsaPointer.
//  * CUDA IPC (Runtime::Ipc): cudaMalloc'ed memory whose cudaIpcMemHandle every rank exchanges (over
//    any process group) and opens. No NCCL at all: it runs where NCCL has no symmetric memory, and
//    with several ranks on one GPU (which NCCL refuses), which is how the multi-rank kernels are
//    tested on a one-GPU machine. Two steps: construct, then open_ipc_peers(every rank's handle).
// Python (_native_runtime.py) allocates every tensor and passes raw pointers and stream handles;
// nothing here includes torch and nothing here reads the environment (Python's _env.py does, and passes
// what it read in RuntimeOptions and the parameter blocks).
#pragma once

#include <cstdint>
#include <string>
#include <optional>
#include <tuple>
#include <vector>

#include "commkit/ipc_handle.hpp"
#include "kernels.hpp"

namespace elastic_ep {

// NCCL helpers (module-level _C functions).
int nccl_runtime_version();          // ncclGetVersion of the loaded libnccl
int nccl_build_version();            // NCCL_VERSION_CODE of the headers we compiled against
std::string get_local_nccl_unique_id();
int64_t create_nccl_comm(const std::string& unique_id, int num_ranks, int rank);
void destroy_nccl_comm(int64_t comm);
std::tuple<int, int> nccl_comm_rank_size(int64_t comm);
// (ginType, railedGinType, nLsaTeams) of a communicator from ncclCommQueryProperties, or nullopt when
// the NCCL headers the package was built with predate it (< 2.29).
std::optional<std::tuple<int, int, int>> comm_gin_properties(int64_t comm);

// "No stream" for the optional stream arguments below: 0 is a real stream (the legacy default stream,
// which is torch's default stream).
constexpr int64_t kNoStream = -1;

// Host-side settings of a runtime (Python reads them from the environment, see _env.py).
struct RuntimeOptions {
  int64_t host_wait_yield_us = 20000;  // poll_host: yield this long, then sleep
  bool debug = false;                  // print the set-up and teardown trace to stderr
  // Hybrid mode: U ranks per logical scale-out domain (0 < U < R, U dividing R; 0: direct mode). The
  // dispatch, combine and barrier kernels then reach another domain only through the scale-out
  // transport: the window's LSA pointers of those ranks are left null.
  int num_scaleup_ranks = 0;
  // The scale-out transport: NCCL GIN with this request (hybrid mode across NVLink domains, NCCL
  // window only: NCCL's LSA team must then be this rank's domain of U ranks), else the NVLink
  // emulation (every rank's window mapped: one NVLink domain, logical domains from the override).
  bool use_gin = false;
  GinRequest gin{};
};

// What wait_dispatch_counts found: status 0 = ready, 1 = a device wait expired (see take_timeout),
// 2 = the CPU wait expired (the buffer is then marked unusable), 3 = the dispatch was refused (see
// take_refusal; the buffer stays usable). The counts are valid with status 0; ranks_ready and
// experts_ready say how far the wait got.
struct DispatchCounts {
  int status = 0;
  int num_recv_tokens = 0, num_expanded_tokens = 0;
  std::vector<int> num_recv_tokens_per_expert;  // aligned, per local expert
  int ranks_ready = 0, experts_ready = 0;
};

class Runtime {
 public:
  Runtime(int rank, int num_ranks, int64_t nccl_comm, int64_t num_buffer_bytes, int num_cpu_timeout_secs,
          int num_gpu_timeout_secs, const RuntimeOptions& options);
  // The CUDA-IPC window: unusable until open_ipc_peers() ran.
  struct Ipc {};
  Runtime(Ipc, int rank, int num_ranks, int64_t num_buffer_bytes, int num_cpu_timeout_secs,
          int num_gpu_timeout_secs, const RuntimeOptions& options);
  bool ipc() const { return ipc_; }
  // IPC window: opaque bytes for the peers' open_ipc_peers: the CUDA IPC handle plus the world size,
  // rank and buffer size, which open_ipc_peers checks before it opens anything.
  std::string ipc_handle() const;
  // IPC window: opens every peer's handle (handles[r] from rank r; this rank's own is checked to be
  // its own) and makes the buffer usable. Not collective itself; the caller barriers afterwards.
  void open_ipc_peers(const std::vector<std::string>& handles);
  commkit::IpcWindowInfo window_info() const;
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  void destroy();
  bool destroyed() const { return destroyed_; }
  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  int lsa_size() const { return lsa_size_; }
  int num_scaleup_ranks() const { return scaleup_; }
  bool gin() const { return gin_; }
  int device() const { return device_; }
  int num_device_sms() const { return num_device_sms_; }
  int64_t num_buffer_bytes() const { return num_buffer_bytes_; }
  uint64_t buffer_ptr() const;  // address of the buffer (after the workspace) on this rank

  // Raises TimeoutError if a device deadline expired in an earlier operation, and Error if the
  // buffer is unusable since.
  void check_healthy();
  // The same without C++ exceptions (on the GPU machine a C++ exception crossing into Python once
  // crashed the process): returns the expired device wait, if any, and marks the buffer unusable.
  struct TimeoutInfo {
    bool expired = false;
    std::string operation;
    int rank = -1, peer = -1;
    int64_t expected = 0, observed = 0;
    uint64_t waited_ms = 0;
    uint32_t channel = 0;
  };
  TimeoutInfo take_timeout();
  bool broken() const { return broken_; }
  const std::string& broken_reason() const { return broken_reason_; }
  // The host gave up on an operation half way (e.g. an allocation failed after the push was
  // launched): this rank's epoch is then behind its peers', so the buffer must be recreated.
  void mark_broken(const std::string& reason) {
    if (!broken_) broken_reason_ = reason;
    broken_ = true;
  }
  // Tests only, between operations, on every rank with the same value (then a process-group
  // barrier): makes `last_epoch` the epoch of the last completed operation, and the count words the
  // peers wrote then carry its tag, as if that many operations had run. Lets a test cross the
  // 32-bit tag wrap of the count words (2^32 operations) in a few calls.
  void debug_seed_epoch(uint64_t last_epoch);

  // Bits of what take_timeout / broken / take_masked_ids would report, in one cheap call:
  // kHealthTimeout (a device timeout record is pending), kHealthBroken (unusable or destroyed),
  // kHealthMaskedIds (masked expert ids not reported yet). 0 = nothing to report.
  enum HealthBits { kHealthTimeout = 1, kHealthBroken = 2, kHealthMaskedIds = 4 };
  int pending_health() const;

  void barrier(int64_t stream);
  // Notify (or, cached, the entry barrier) and the push of the token records to the peers. With
  // `wait_stream` (a cudaStream_t, kNoStream for none), `stream` first waits for the work
  // queued on it so far (what torch's Stream.wait_stream does, without its Python cost).
  void dispatch(const DispatchParams& p, int64_t stream, int64_t wait_stream = kNoStream);
  // CPU sync: waits (GIL released by the binding) for the counts of the last dispatch. Never throws on
  // a timeout: the status says what happened (DispatchCounts).
  DispatchCounts wait_dispatch_counts(int num_local_experts);
  // The copy epilogue; with `join_stream` (kNoStream for none) that stream then waits for `stream`.
  void dispatch_epilogue(const EpilogueParams& p, int64_t stream, int64_t join_stream = kNoStream);
  // After wait_dispatch_counts returned status 3 (the dispatch was refused on every rank because some
  // rank passed expert ids outside [-1, E) in CPU-sync mode): (the ranks that did, ids outside
  // [-1, E) of this rank, one such id). Polls this rank's report, which notify writes before the
  // count exchange, with the CPU deadline; never launches anything.
  std::tuple<std::vector<int>, int64_t, int64_t> take_refusal();
  // Ids outside [-1, E) that notify masked in dispatches launched without the check (no CPU sync)
  // since the last call: (count, the last such id). Never throws.
  std::pair<int64_t, int64_t> take_masked_ids();
  // Push then reduce; with `wait_event` (a cudaEvent_t, 0 for none) the reduce also waits for it, so
  // the push overlaps whatever the event marks (DeepEP's previous_event_before_epilogue).
  // `wait_stream` / `join_stream` as in dispatch / dispatch_epilogue.
  // PP send / receive on `stream` (pp.cuh); point-to-point, no epoch. The Python layer checked the
  // arguments and that the slots fit the buffer.
  void pp_transfer(const PpParams& p, bool send, int64_t stream);
  // One ring step of the NVLink-emulated scale-out transport (kernels/scaleout_probe.cuh); offsets are
  // window offsets inside the buffer.
  void scaleout_probe(const ScaleoutProbeParams& p, int64_t stream);
  // One AGRS gather on `stream`: copy-engine copies of this rank's part of tensor i (nbytes[i] bytes
  // at srcs[i]) into every rank's region at buffer offset offsets[i] + rank * nbytes[i] (none where
  // source and destination coincide: in place), then the gather-done kernel (agrs.cuh).
  void agrs_all_gather(const std::vector<uint64_t>& srcs, const std::vector<int64_t>& nbytes,
                       const std::vector<int64_t>& offsets, int64_t stream);
  void agrs_session_end(int64_t stream);
  // Per source rank: tensors it delivered into this rank's PP slots that this rank did not receive
  // yet. Synchronises the device (pp_set_config's flush).
  std::vector<int64_t> pp_unreceived();
  void combine(const CombineParams& p, int64_t stream, uint64_t wait_event = 0, int64_t wait_stream = kNoStream,
               int64_t join_stream = kNoStream);

 private:
  // What dispatch, combine and barrier kernels get: in hybrid mode the LSA pointers of the own domain
  // only. view_all(): every mapped window (PP, AGRS, the scale-out probe).
  CommView view() const;
  CommView view_all() const;
  bool hybrid() const { return scaleup_ > 0 && scaleup_ < num_ranks_; }
  // peer_bases_ -> domain_peer_bases_ (hybrid mode; after the peers' windows are known).
  void make_domain_view();
  void set_device() const;
  // Argument checks, device, SM count, workspace size; returns the window's bytes. Both windows.
  uint64_t begin_setup(int rank, int num_ranks, int64_t num_buffer_bytes, int num_cpu_timeout_secs,
                       const RuntimeOptions& options);
  // Host workspace, events, zeroed device workspace: the half of the set-up both windows share.
  void finish_setup();
  // The rest of the NCCL constructor, after ncclMemAlloc.
  void setup_nccl_window(uint64_t total);
  // A constructor failed (no destructor runs then): frees what it had made. The NCCL window and the
  // device communicator are torn down only when that is safe without peers (see the definition).
  void abandon_setup() noexcept;
  // `waiter` waits for the work queued on `signaller` so far (an event recorded there); a no-op when
  // either is kNoStream or both are the same stream. Capturable: the usual fork/join of a CUDA graph.
  void stream_wait(int64_t waiter, int64_t signaller, void* event);
  // Polls pred() until it holds (0), a device timeout record appears (1) or the CPU deadline expires
  // without progress (2).
  template <typename Pred, typename Progress>
  int poll_host(Pred&& pred, Progress&& progress);

  int rank_, num_ranks_;
  int device_ = -1;
  int num_device_sms_ = 0;
  int lsa_size_ = 0;
  int scaleup_ = 0;               // RuntimeOptions::num_scaleup_ranks
  bool gin_ = false;              // the scale-out transport is GIN (RuntimeOptions::use_gin)
  GinRequest gin_request_{};
  int64_t num_buffer_bytes_;
  uint64_t workspace_bytes_ = 0;
  int num_cpu_timeout_secs_;
  uint64_t gpu_timeout_ns_;
  uint64_t host_wait_yield_ns_ = 20ull * 1000000ull;  // poll_host: yield this long, then sleep
  bool debug_ = false;                                // RuntimeOptions::debug
  void* comm_ = nullptr;          // ncclComm_t (not owned)
  void* window_ = nullptr;        // ncclWindow_t
  void* devcomm_ = nullptr;       // heap ncclDevComm
  void* sym_ptr_ = nullptr;       // ncclMemAlloc'ed (IPC: cudaMalloc'ed) window memory
  bool ipc_ = false;
  bool entered_ = false;          // an operation (barrier, dispatch, combine) was launched on this rank
  std::vector<void*> ipc_peers_;  // IPC: opened peer windows (nullptr for this rank)
  std::vector<char*> host_peer_bases_;  // every rank's window base as this process addresses it (AGRS copies)
  void* lsa_base_ = nullptr;      // the same memory in NCCL's flat LSA mapping (what kernels use)
  void** peer_bases_ = nullptr;   // device [num_ranks] (GIN: null outside the own NVLink domain)
  void** domain_peer_bases_ = nullptr;  // hybrid mode: device [num_ranks], null outside the own domain
  void* host_ws_ = nullptr;       // cudaHostAlloc mapped
  void* host_ws_dev_ = nullptr;
  uint32_t host_tag_ = 0;
  std::vector<int> refused_ranks_;  // of the last refused dispatch (see take_refusal)
  void* event_in_ = nullptr;   // cudaEvent_t of stream_wait before an operation's first launch
  void* event_out_ = nullptr;  // cudaEvent_t of stream_wait after its last launch
  // Overlapped dispatch: the copy epilogue runs on epi_stream_, which waits for notify_done_ (recorded
  // between notify and push) and is joined back into the communication stream through epi_done_.
  void* epi_stream_ = nullptr;  // cudaStream_t, created with the window
  void* notify_done_ = nullptr;
  void* epi_done_ = nullptr;
  uint64_t masked_ids_seen_ = 0;
  bool destroyed_ = false;
  bool setup_failed_everywhere_ = false;  // the set-up failed on a check every rank fails alike
  bool broken_ = false;
  std::string broken_reason_;
};

}  // namespace elastic_ep
