// elastic_ep/csrc/host/runtime.hpp -- the torch-free host side of the elastic buffer: a window and the
// operations over it.
//
// Runtime owns one window (window.hpp: NCCL's, or the CUDA-IPC one, which is usable only after
// open_ipc_peers(every rank's handle)), the hybrid domain view of it, a host-mapped workspace for the
// CPU sync and the device timeout record, and the events and second stream of the overlapped modes.
// Its operations live one file per area: health.cpp (timeouts, unusable state), ops_ep.cpp (barrier,
// dispatch, the CPU sync, epilogue, combine), ops_ll.cpp (low-latency mode), ops_pp_agrs.cpp (PP,
// AGRS, the scale-out probe).
// Python (_native_window.py, _native_runtime.py) allocates every tensor and passes raw pointers and
// stream handles in the parameter blocks (kernels/launch.hpp); nothing here includes torch and
// nothing here reads the environment (Python's _env.py does, and passes what it read in RuntimeOptions
// and the parameter blocks).
//
// Teardown: destroy() is collective. Once every rank reached it (a device barrier with a deadline;
// kDestroyDeadlineNs when the buffer has none) the window is released together; after a timeout (or a
// peer that never arrives) nothing but the events and the stream is freed (Teardown::kLeak): kernels may
// still spin on the memory. The device gets a deadline to finish first (that barrier's, plus the device
// deadline when there is one); past it this rank's waits are ended through the timeout record and the
// window is kept (kLeak) too. A constructor
// that fails frees what it made (Teardown::kLocal).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "commkit/process.hpp"
#include "host/cuda_owned.hpp"
#include "host/window.hpp"
#include "kernels/launch.hpp"

namespace elastic_ep {

// "No stream" for the optional stream arguments below: 0 is a real stream (the legacy default stream,
// which is torch's default stream).
constexpr int64_t kNoStream = -1;

// Host-side settings of a runtime (Python reads them from the environment, see _env.py).
struct RuntimeOptions {
  int64_t host_wait_yield_us = 20000;  // poll_host: yield this long, then sleep
  bool debug = false;                  // print the set-up and teardown trace to stderr
  // Tests only: release steps destroy() reports as failed (commkit/teardown.hpp; ELASTIC_EP_TEST_FAIL_RELEASE).
  std::string test_fail_release;
  // Hybrid mode: U ranks per logical scale-out domain (0 < U < R, U dividing R; 0: direct mode). The
  // dispatch, combine and barrier kernels then reach another domain only through the scale-out
  // transport: the window's LSA pointers of those ranks are left null.
  int num_scaleup_ranks = 0;
  // The scale-out transport: NCCL GIN with this request (hybrid mode across NVLink domains, NCCL
  // window only: NCCL's LSA team must then be this rank's domain of U ranks; a build with
  // ELASTIC_EP_WITH_GIN only), else the NVLink emulation (every rank's window mapped: one NVLink
  // domain, logical domains from the override).
  bool use_gin = false;
  GinRequest gin{};
};

// What wait_dispatch_counts found: status 0 = ready, 1 = a device wait expired (see take_timeout),
// 2 = the CPU wait expired (the buffer is then marked unusable), 3 = the dispatch was refused (see
// take_refusal; the buffer stays usable), 4 = refused because some rank's dispatch geometry differs
// (see take_geometry_mismatch; usable too). The counts are valid with status 0; ranks_ready and
// experts_ready say how far the wait got.
struct DispatchCounts {
  int status = 0;
  int num_recv_tokens = 0, num_expanded_tokens = 0;
  std::vector<int> num_recv_tokens_per_expert;  // aligned, per local expert
  int ranks_ready = 0, experts_ready = 0;
};

class Runtime {
 public:
  // ---- lifecycle (runtime.cpp)
  // The NCCL window over `nccl_comm` (collective).
  Runtime(int rank, int num_ranks, int64_t nccl_comm, int64_t num_buffer_bytes, int num_cpu_timeout_secs,
          int num_gpu_timeout_secs, const RuntimeOptions& options);
  // The CUDA-IPC window: unusable until open_ipc_peers() ran.
  struct Ipc {};
  Runtime(Ipc, int rank, int num_ranks, int64_t num_buffer_bytes, int num_cpu_timeout_secs,
          int num_gpu_timeout_secs, const RuntimeOptions& options);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  bool ipc() const { return ipc_ != nullptr; }
  // IPC window: this rank's handle for the peers (IpcWindow::handle).
  std::string ipc_handle() const;
  // IPC window: opens every peer's handle (handles[r] from rank r) and makes the buffer usable. Not
  // collective itself; the caller barriers afterwards.
  void open_ipc_peers(const std::vector<std::string>& handles);
  void destroy();
  bool destroyed() const { return destroyed_; }
  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  int lsa_size() const { return window_->lsa_size(); }
  int num_scaleup_ranks() const { return scaleup_; }
  bool gin() const { return gin_; }
  int device() const { return device_; }
  int num_device_sms() const { return num_device_sms_; }
  int64_t num_buffer_bytes() const { return num_buffer_bytes_; }
  uint64_t buffer_ptr() const;  // address of the buffer (after the workspace) on this rank

  // ---- health (health.cpp)
  // Raises TimeoutError if a device deadline expired in an earlier operation, and Error if the
  // buffer is unusable since.
  void check_healthy();
  // The same without C++ exceptions (on a GPU host a C++ exception crossing into Python once crashed
  // the process): returns the expired device wait, if any, and marks the buffer unusable.
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
  // kHealthMaskedIds (masked expert ids not reported yet), kHealthGeometry (a dispatch refused for a
  // peer's geometry not reported yet). 0 = nothing to report.
  enum HealthBits { kHealthTimeout = 1, kHealthBroken = 2, kHealthMaskedIds = 4, kHealthGeometry = 8 };
  int pending_health() const;
  // Watches the peers' processes on this host (commkit::PeerWatch; `peers[r]` = rank r's
  // commkit::this_process(), exchanged by the caller), every period_ms (0: no watch): a dead one ends
  // this rank's waits at once through the timeout record (op kOpPeerDied, peer = that rank). Stopped
  // by destroy. (health.cpp)
  void watch_peers(const std::vector<commkit::ProcessId>& peers, int period_ms);
  int num_watched_peers() const { return watch_ ? watch_->num_watched() : 0; }

  // ---- EP operations (ops_ep.cpp). Health (timeouts, destroyed) is checked by the Python layer
  // before each launch (pending_health).
  void barrier(int64_t stream);
  // Notify (or, cached, the entry barrier) and the push of the token records to the peers. With
  // `wait_stream` (a cudaStream_t, kNoStream for none), `stream` first waits for the work
  // queued on it so far (what torch's Stream.wait_stream does, without its Python cost).
  void dispatch(const DispatchParams& p, int64_t stream, int64_t wait_stream = kNoStream);
  // CPU sync: waits (GIL released by the binding) for the counts of the last dispatch. Never throws on
  // a timeout: the status says what happened (DispatchCounts).
  DispatchCounts wait_dispatch_counts(int num_local_experts);
  // After wait_dispatch_counts returned status 3 (the dispatch was refused on every rank because some
  // rank passed expert ids outside [-1, E) in CPU-sync mode): (the ranks that did, ids outside
  // [-1, E) of this rank, one such id). Polls this rank's report, which notify writes before the
  // count exchange, with the CPU deadline; never launches anything.
  std::tuple<std::vector<int>, int64_t, int64_t> take_refusal();
  // Ids outside [-1, E) that notify masked in dispatches launched without the check (no CPU sync)
  // since the last call: (count, the last such id). Never throws.
  std::pair<int64_t, int64_t> take_masked_ids();
  // The last dispatch notify refused because a peer's geometry differed from this rank's, once:
  // (peer, geometry word index, the peer's word, this rank's word), or nullopt when none is pending
  // (wait_dispatch_counts status 4 right after a CPU-synced one; pending_health otherwise).
  std::optional<std::tuple<int, int, int64_t, int64_t>> take_geometry_mismatch();
  // The copy epilogue; with `join_stream` (kNoStream for none) that stream then waits for `stream`.
  void dispatch_epilogue(const EpilogueParams& p, int64_t stream, int64_t join_stream = kNoStream);
  // Push then reduce; with `wait_event` (a cudaEvent_t, 0 for none) the reduce also waits for it, so
  // the push overlaps whatever the event marks (DeepEP's previous_event_before_epilogue).
  // `wait_stream` / `join_stream` as in dispatch / dispatch_epilogue.
  void combine(const CombineParams& p, int64_t stream, uint64_t wait_event = 0, int64_t wait_stream = kNoStream,
               int64_t join_stream = kNoStream);

  // ---- low-latency mode (ops_ll.cpp; kernels/ll_*.cuh). Direct mode only; no epoch, no entry barrier.
  void ll_dispatch(const LlDispatchParams& p, int64_t stream);
  void ll_combine(const LlCombineParams& p, int64_t stream);
  // Zeroes the low-latency counters and signals on `stream` (every rank, between two barriers:
  // clean_low_latency_buffer); the shrink mask stays.
  void ll_clean(int64_t stream);
  // Shrink mode's mask of `rank` (synchronous), all ranks' cleared (on `stream`), its device address.
  void ll_set_mask(int rank, bool masked, int64_t stream);
  void ll_clean_mask(int64_t stream);
  uint64_t ll_mask_address() const;

  // ---- PP, AGRS and the scale-out probe (ops_pp_agrs.cpp)
  // PP send / receive on `stream` (pp.cuh); point-to-point, no epoch. The Python layer checked the
  // arguments and that the slots fit the buffer.
  void pp_transfer(const PpParams& p, bool send, int64_t stream);
  // Per source rank: tensors it delivered into this rank's PP slots that this rank did not receive
  // yet. Synchronises the device (pp_set_config's flush).
  std::vector<int64_t> pp_unreceived();
  // Per peer that refused one of this rank's tensors: (peer, k + 1 of the last such tensor k, its
  // PpField, the peer's value, this rank's), pp.cuh's pp_refusal. Synchronises the device.
  std::vector<std::array<uint64_t, 5>> pp_refusals();
  // One AGRS gather on `stream`: copy-engine copies of this rank's part of tensor i (nbytes[i] bytes
  // at srcs[i]) into every rank's region at buffer offset offsets[i] + rank * nbytes[i] (none where
  // source and destination coincide: in place), then the gather-done kernel (agrs.cuh), which compares
  // the peers' records of the gather with `record` (AgrsGatherParams).
  void agrs_all_gather(const std::vector<uint64_t>& srcs, const std::vector<int64_t>& nbytes,
                       const std::vector<int64_t>& offsets, const std::vector<uint64_t>& record, int64_t stream);
  void agrs_session_end(int64_t stream);
  // One ring step of the scale-out transport (kernels/scaleout_probe.cuh); offsets are window offsets
  // inside the buffer.
  void scaleout_probe(const ScaleoutProbeParams& p, int64_t stream);

 private:
  // What dispatch, combine and barrier kernels get: in hybrid mode the LSA pointers of the own domain
  // only. view_all(): every mapped window (PP, AGRS, the scale-out probe).
  CommView view() const;
  CommView view_all() const;
  bool hybrid() const { return scaleup_ > 0 && scaleup_ < num_ranks_; }
  void set_device() const;
  // The constructors' arguments kept and checked, device, SM count, workspace size: the window's shape.
  WindowShape begin_setup(int rank, int num_ranks, int64_t num_buffer_bytes, int num_cpu_timeout_secs,
                          int num_gpu_timeout_secs, const RuntimeOptions& options);
  // The domain view and what both windows need beside the window: host workspace, events, stream,
  // zeroed device workspace. On a throw, release(kLocal) first.
  void finish_setup();
  // The hybrid view of the window (after the peers' windows are known).
  void make_domain_view();
  // The device synchronised (with a deadline, then this rank's device waits ended and the deadline once
  // more), then (where a peer may still write here) a barrier of every rank with its own deadline: how
  // destroy() may tear down.
  Teardown quiesce(commkit::TeardownLog& log);
  // The one teardown path of the runtime's memory and its window (window.hpp's Teardown); the events
  // and the stream go first, whatever `how`.
  void release(Teardown how, commkit::TeardownLog& log) noexcept;
  // `waiter` waits for the work queued on `signaller` so far (an event recorded there); a no-op when
  // either is kNoStream or both are the same stream. Capturable: the usual fork/join of a CUDA graph.
  void stream_wait(int64_t waiter, int64_t signaller, void* event);
  // Polls pred() until it holds (0), a device timeout record appears (1) or the CPU deadline expires
  // without progress (2).
  template <typename Pred, typename Progress>
  int poll_host(Pred&& pred, Progress&& progress);

  int rank_ = 0, num_ranks_ = 0;
  int device_ = -1;
  int num_device_sms_ = 0;
  int scaleup_ = 0;               // RuntimeOptions::num_scaleup_ranks
  bool gin_ = false;              // the scale-out transport is GIN (RuntimeOptions::use_gin)
  GinRequest gin_request_{};
  int64_t num_buffer_bytes_ = 0;
  uint64_t workspace_bytes_ = 0;
  int num_cpu_timeout_secs_ = 0;
  uint64_t gpu_timeout_ns_ = 0;
  uint64_t host_wait_yield_ns_ = 20ull * 1000000ull;  // poll_host: yield this long, then sleep
  bool debug_ = false;                                // RuntimeOptions::debug
  std::string test_fail_release_;                     // RuntimeOptions::test_fail_release
  std::unique_ptr<Window> window_;
  IpcWindow* ipc_ = nullptr;      // window_ when it is the CUDA-IPC one
  DeviceMemory domain_peer_bases_;  // hybrid mode: device [num_ranks], null outside the own domain
  HostMemory host_ws_;            // cudaHostAlloc mapped
  std::unique_ptr<commkit::PeerWatch> watch_;  // writes host_ws_'s timeout record: reset before it goes
  void* host_ws_dev_ = nullptr;
  CudaEvent event_in_;    // stream_wait before an operation's first launch
  CudaEvent event_out_;   // stream_wait after its last launch
  // Overlapped dispatch: the copy epilogue runs on epi_stream_, which waits for notify_done_ (recorded
  // between notify and push) and is joined back into the communication stream through epi_done_.
  CudaStream epi_stream_;
  CudaEvent notify_done_;
  CudaEvent epi_done_;
  bool entered_ = false;          // an operation (barrier, dispatch, combine) was launched on this rank
  uint32_t host_tag_ = 0;
  std::vector<int> refused_ranks_;  // of the last refused dispatch (see take_refusal)
  uint64_t masked_ids_seen_ = 0;
  uint64_t geometry_refusals_seen_ = 0;
  bool destroyed_ = false;
  bool broken_ = false;
  std::string broken_reason_;
};

}  // namespace elastic_ep
