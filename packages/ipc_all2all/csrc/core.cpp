// core.cpp -- see core.hpp. Without CUDA (COMMKIT_WITH_CUDA=0) the class still compiles so the
// layout helpers and validation are testable on a CPU-only machine; constructing it raises.
#include "core.hpp"

#include "a2a_geometry.hpp"
#include "kernels.hpp"

#include <cmath>
#include <cstring>

#include "commkit/check.hpp"
#include "commkit/timeout_record.hpp"

#if COMMKIT_WITH_CUDA
#include <cuda_runtime.h>

#include "commkit/ipc.hpp"
#include "device_guard.hpp"
#endif

namespace ipc_all2all {

Core::Core(int rank, int world, int64_t capacity, int num_blocks, double timeout_seconds)
    : rank_(rank), world_(world), capacity_(capacity), num_blocks_(num_blocks) {
  CK_CHECK_ARG(world >= 1 && world <= kMaxWorld, "world_size must be in [1, ", kMaxWorld, "], got ", world);
  CK_CHECK_ARG(rank >= 0 && rank < world, "rank must be in [0, world_size=", world, "), got ", rank);
  check_capacity_bytes(capacity);
  CK_CHECK_ARG(num_blocks >= world && num_blocks < 65536,
               "num_sms must be in [world_size, 65535] (one block per target at least), got ", num_blocks);
  set_timeout_seconds(timeout_seconds);
  layout_ = buffer_layout(static_cast<uint64_t>(capacity));
#if COMMKIT_WITH_CUDA
  CK_CUDA_CHECK(cudaGetDevice(&device_));
  void* p = nullptr;
  CK_CUDA_CHECK(cudaMalloc(&p, layout_.total));
  base_[rank_] = static_cast<char*>(p);
  // Zeroed signals before the handle leaves this process: no peer can see stale counters.
  cudaError_t err = cudaMemset(base_[rank_] + layout_.signals.offset, 0, layout_.signals.bytes);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  cudaIpcMemHandle_t h;
  if (err == cudaSuccess) err = cudaIpcGetMemHandle(&h, p);
  // The record, then destroy()'s staging words (teardown.cpp), in one pinned allocation.
  if (err == cudaSuccess) err = cudaHostAlloc(reinterpret_cast<void**>(&rec_host_), kHostBytes, cudaHostAllocMapped);
  if (err == cudaSuccess) err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&rec_dev_), rec_host_, 0);
  cudaEvent_t ev = nullptr;  // the stream-order event (see launch)
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    if (rec_host_) cudaFreeHost(rec_host_);
    cudaFree(p);
    CK_THROW("ipc_all2all: setting up the shared buffer failed: ", cudaGetErrorString(err));
  }
  last_done_ = ev;
  commkit::clear_timeout_record(rec_host_);
  handle_ = commkit::describe_ipc_handle(handle_format(), window_info(),
                                        std::string(reinterpret_cast<const char*>(&h), sizeof(h)));
#else
  CK_THROW("ipc_all2all was built without CUDA (no nvcc at build time); All2All needs a CUDA build");
#endif
}

Core::~Core() {
  try {
    destroy();
  } catch (...) {
  }
  try {
    release_buffer();
  } catch (...) {
  }
}

std::string Core::ipc_handle() const {
  require_usable("get_local_ipc_handle");
  return handle_;
}

uint64_t Core::slot_offset(int slot) const {
  CK_CHECK_ARG(slot >= 0 && slot < kNumSlots, "slot must be 0 or 1, got ", slot);
  return layout_.slot[slot].offset;
}

uint64_t Core::slot_capture(int slot) const {
  CK_CHECK_ARG(slot >= 0 && slot < kNumSlots, "slot must be 0 or 1, got ", slot);
  return slot_capture_[static_cast<size_t>(slot)];
}

uint64_t Core::capture_id(uint64_t stream) const {
#if COMMKIT_WITH_CUDA
  DeviceGuard g(device_);
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  CK_CUDA_CHECK(cudaStreamGetCaptureInfo(reinterpret_cast<cudaStream_t>(stream), &st, &id));
  CK_CHECK(st != cudaStreamCaptureStatusInvalidated,
           "ipc_all2all: the stream's CUDA graph capture was invalidated by an earlier error");
  return st == cudaStreamCaptureStatusActive ? static_cast<uint64_t>(id) : 0u;
#else
  (void)stream;
  return 0;
#endif
}

void Core::order_after_last_call(void* stream, bool capturing) {
#if COMMKIT_WITH_CUDA
  // Two kernels of one instance must never overlap (they share the block counters cnt/fin and the
  // epoch), so a call on a new stream waits for the previous call. Inside a capture the wait would
  // tie the graph to an eager event; torch synchronises before capturing, and a replay runs on the
  // stream it is replayed on, which the caller orders (documented).
  if (!capturing && have_last_ && stream != last_stream_)
    CK_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(last_done_), 0));
#else
  (void)stream;
  (void)capturing;
#endif
}

void Core::record_last_call(void* stream, bool capturing) {
  const std::lock_guard<std::recursive_mutex> lock(mu_);
#if COMMKIT_WITH_CUDA
  // A destroy() from another thread may have run between this call's launch and its output copy:
  // the event is gone, and no later call of this instance will need ordering after the copy.
  if (capturing || destroyed_) return;
  CK_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(last_done_), static_cast<cudaStream_t>(stream)));
  last_stream_ = stream;
  have_last_ = true;
#else
  (void)stream;
  (void)capturing;
#endif
}

void Core::require_usable(const char* what) const {
  CK_CHECK(!destroyed_, what, ": this All2All instance was destroyed");
  CK_CHECK(!broken_, what, ": this All2All instance is unusable after an earlier failure (", broken_reason_,
           "); destroy() it on every rank and build a new one");
}

void Core::open_peers(const std::vector<std::string>& handles) {
  const std::lock_guard<std::recursive_mutex> lock(mu_);
  require_usable("sync");
  CK_CHECK_ARG(!opened_, "sync(): the peers' handles are already open");
  CK_CHECK_ARG(static_cast<int>(handles.size()) == world_, "sync(): expected ", world_,
               " handles (one per rank), got ", handles.size());
#if COMMKIT_WITH_CUDA
  // Every rank's world size and slot capacity first: a peer built smaller would be written past
  // its allocation. Nothing is opened unless every entry matches.
  const std::vector<std::string> raw =
      commkit::check_described_ipc_handles(handle_format(), handles, window_info(), handle_, "sync()");
  DeviceGuard g(device_);
  const std::vector<void*> peers =
      commkit::open_ipc_handles(raw, rank_, "sync()", static_cast<int64_t>(layout_.total));
  for (int i = 0; i < world_; ++i)
    if (i != rank_) base_[i] = static_cast<char*>(peers[i]);
  opened_ = true;
#endif
}

int Core::launch(int op, uint64_t x_ptr, uint64_t stream, int batch, int64_t x_rows, int64_t out_rows,
                 int64_t cap_rows, int64_t chunk_bytes, int64_t wide_bytes, const std::vector<int64_t>& counts,
                 uint64_t counts_ptr, int pack_head_dim) {
  const std::lock_guard<std::recursive_mutex> lock(mu_);
  require_usable(op_name(static_cast<uint32_t>(op) * 4));
  CK_CHECK(opened_, "call sync() with every rank's handle before the first operation");
  check();
  CK_CHECK_ARG(op >= kSendRecvHeads && op <= kAllGather, "unknown op ", op);
  CK_CHECK_ARG(batch >= 0 && x_rows >= 0, "negative batch or token count");
  CK_CHECK_ARG(chunk_bytes > 0 && chunk_bytes % 16 == 0 && chunk_bytes < (int64_t(1) << 31),
               "bytes per token and target must be a positive multiple of 16, got ", chunk_bytes);
  CK_CHECK_ARG(wide_bytes >= chunk_bytes && wide_bytes % 16 == 0 && wide_bytes < (int64_t(1) << 32),
               "bad row size ", wide_bytes);
  CK_CHECK_ARG(counts_ptr == 0 || (cap_rows >= 0 && cap_rows < (int64_t(1) << 31)),
               "device token counts need a per-rank capacity cap_rows in [0, 2^31), got ", cap_rows);
  CK_CHECK_ARG(x_ptr % 16 == 0, "input must be 16-byte aligned");
  CK_CHECK_ARG(counts_ptr != 0 || static_cast<int>(counts.size()) == world_, "expected ", world_,
               " token counts, got ", counts.size());
  if (pack_head_dim != 0) {
    const int64_t rec = int64_t(pack_head_dim) + kFp8RecordPad;
    CK_CHECK_ARG(fp8_wire_head_dim_ok(pack_head_dim), "fp8 on the wire: head_dim must be 16, 32, 64, 128 or 256, got ",
                 pack_head_dim);
    CK_CHECK_ARG(op != kAllGather, "fp8 on the wire applies to send_recv_heads and gather_heads only");
    CK_CHECK_ARG(chunk_bytes % rec == 0 && wide_bytes % rec == 0, "fp8 on the wire: chunk_bytes ", chunk_bytes,
                 " and wide_bytes ", wide_bytes, " must be whole records of ", rec, " bytes");
  }
  KernelArgs a = geometry_args(op, world_, rank_, batch, x_rows, out_rows, cap_rows, chunk_bytes, wide_bytes);
  a.pack_head_dim = pack_head_dim;
  const int slot = next_slot();
  // The slot is part of the signature: ranks whose call histories put this call into different
  // slots (e.g. a graph captured on one rank only) fail the handshake instead of mixing slots.
  a.sig_base = geometry_signature(a, slot);
  for (int i = 0; i < world_; ++i) {
    a.dst[i] = base_[i] + layout_.slot[slot].offset;
    a.sig[i] = reinterpret_cast<Signals*>(base_[i] + layout_.signals.offset);
  }
  int64_t total = 0;
  for (size_t i = 0; i < counts.size() && static_cast<int>(i) < world_; ++i) {
    CK_CHECK_ARG(counts[i] >= 0 && counts[i] < (int64_t(1) << 31), "token count of rank ", i, " out of range: ",
                 counts[i]);
    a.counts[i] = static_cast<int32_t>(counts[i]);
    total += counts[i];
  }
  // The kernel indexes one target's 16-byte vectors with 32-bit integers.
  const int64_t max_rows = counts_ptr ? (cap_rows >= 0 ? cap_rows * world_ : x_rows) : total;
  CK_CHECK_ARG(int64_t(batch) * max_rows * (chunk_bytes / 16) < (int64_t(1) << 31),
               "one operation may move at most 2^31 16-byte vectors (32 GiB) per target");
  a.x = reinterpret_cast<const char*>(x_ptr);
  a.counts_dev = reinterpret_cast<const int32_t*>(counts_ptr);
  a.rec = rec_dev_;
  a.timeout_ns = timeout_ns_;
  // No write may leave a peer's slot, whatever the Python layer planned: with device counts the
  // kernel clamps them to cap_rows, so the worst case is every rank at cap_rows.
  int32_t worst[kMaxWorld];
  for (int i = 0; i < kMaxWorld; ++i) worst[i] = static_cast<int32_t>(cap_rows);
  const uint64_t need = slot_bytes_needed(a, counts_ptr ? worst : a.counts);
  CK_CHECK_ARG(need <= static_cast<uint64_t>(capacity_), "ipc_all2all: this call would write ", need, " bytes into a slot of ", capacity_,
               " bytes; token counts exceed what the instance was built for");
  GridPlan g = grid_plan(num_blocks_, world_, self_blocks_hint_);
  a.self_blocks = g.self_blocks;
  a.per_peer = g.per_peer;
  const uint64_t cap_id = capture_id(stream);
#if COMMKIT_WITH_CUDA
  DeviceGuard dg(device_);
  void* s = reinterpret_cast<void*>(stream);
  order_after_last_call(s, cap_id != 0);
  launch_a2a(a, g.total, s);
  record_last_call(s, cap_id != 0);
#endif
  ++calls_;
  last_op_ = op;
  if (cap_id != 0) ++captured_calls_;
  slot_capture_[static_cast<size_t>(slot)] = cap_id;
  return slot;
}

namespace {
void check_fp8_args(const char* what, uint64_t a, uint64_t b, int64_t groups, int head_dim) {
  CK_CHECK_ARG(fp8_wire_head_dim_ok(head_dim), what, ": head_dim must be 16, 32, 64, 128 or 256 for fp8 on the wire, got ",
               head_dim);
  CK_CHECK_ARG(groups >= 0, what, ": groups must be >= 0, got ", groups);
  CK_CHECK_ARG(groups == 0 || (a != 0 && b != 0 && a % 16 == 0 && b % 16 == 0), what,
               ": pointers must be non-null and 16-byte aligned");
}
}  // namespace

void Core::fp8_unpack(uint64_t in_ptr, uint64_t out_ptr, int64_t groups, int head_dim, uint64_t stream) {
  const std::lock_guard<std::recursive_mutex> lock(mu_);
  require_usable("fp8_unpack");
  check_fp8_args("fp8_unpack", in_ptr, out_ptr, groups, head_dim);
#if COMMKIT_WITH_CUDA
  const uint64_t cap_id = capture_id(stream);
  DeviceGuard g(device_);
  // The unpack reads a slot, so the instance's next call (which may come on another stream) must
  // wait for it as it waits for a push.
  void* s = reinterpret_cast<void*>(stream);
  order_after_last_call(s, cap_id != 0);
  const Fp8UnpackArgs args{reinterpret_cast<const void*>(in_ptr), reinterpret_cast<void*>(out_ptr), groups, head_dim};
  launch_fp8_unpack(args, s);
  record_last_call(s, cap_id != 0);
#endif
}

void Core::watch_peers(const std::vector<commkit::ProcessId>& peers, int period_ms) {
  const std::lock_guard<std::recursive_mutex> lock(mu_);
  CK_CHECK(!destroyed_ && rec_host_ != nullptr, "watch_peers: this All2All instance was destroyed");
  CK_CHECK_ARG(int(peers.size()) == world_, "watch_peers: expected one process id per rank (", world_, "), got ",
               peers.size());
  watch_.reset();
  self_ = commkit::this_process();
  peers_ = peers;
  if (period_ms > 0)
    watch_ = std::make_unique<commkit::PeerWatch>(rec_host_, uint32_t(kPeerWatch * 4), rank_, peers, period_ms);
}

void Core::check() {
  const std::lock_guard<std::recursive_mutex> lock(mu_);
  if (destroyed_ || rec_host_ == nullptr) return;
  int dead = dead_peer();
  const RecordRead got = read_failure_record(rec_host_, world_, rank_);
  // The watch sets its dead peer before it writes the record: a record of the watch read after the
  // first look has it set.
  if (dead < 0 && got.state == RecordState::kReady && got.rec.op == uint32_t(kPeerWatch) * 4) dead = dead_peer();
  const bool readable = got.state == RecordState::kReady || got.state == RecordState::kMalformed;
  const commkit::TimeoutRecord r = got.rec;
  // Pending: a device thread is still filling the record (microseconds); a later check reads it.
  if (readable) commkit::clear_timeout_record(rec_host_);
  if (dead >= 0) {
    // From the watch's own state, not the record: its stores may have mixed with a kernel's report.
    // Once said, it explains every later failure of this instance: later records are dropped.
    if (death_reported_) return;
    death_reported_ = broken_ = true;
    broken_reason_ = commkit::str("rank ", dead, "'s process died");
    // The watch only ends the waits: the call that waited is the last one launched.
    const char* call = last_op_ >= 0 ? kind_name(uint32_t(last_op_)) : nullptr;
    const std::string during =
        call ? commkit::str(" during this rank's ", call, " (the last operation it launched)") : std::string();
    CK_CHECK_RANK(false, rank_, dead, "rank ", dead, "'s process (pid ", peers_[size_t(dead)].pid, ") on this host died",
                  during, "; the call waiting for it was ended at once", kRecreate);
  }
  if (!readable) return;
  broken_ = true;
  if (got.state == RecordState::kMalformed || r.op == uint32_t(kPeerWatch) * 4) {
    broken_reason_ = "an unreadable device-side failure record";
    CK_THROW("ipc_all2all: rank ", rank_, ": a device-side failure was recorded, but its record is not one this "
             "rank's kernels write (", got.why.empty() ? std::string("a peer-watch record, but no peer died") : got.why,
             "; op ", r.op, ", rank ", r.rank, ", peer ", r.peer, "), so no operation or peer can be named", kRecreate);
  }
  const uint32_t phase = r.op % 4;
  broken_reason_ = std::string("a device-side failure in ") + op_name(r.op);
  if (phase == kPhaseMismatch || phase == kPhaseBroken)
    CK_CHECK_RANK(false, r.rank, r.peer, failure_message(r));
  // Entry timeouts record call numbers in the handshake word's high half.
  const int64_t observed =
      phase == kPhaseEntry ? static_cast<int64_t>(ready_call(static_cast<uint64_t>(r.observed))) : r.observed;
  CK_THROW_TIMEOUT(op_name(r.op), r.rank, r.peer, r.expected, observed, " after ", r.waited_ns / 1000000ull,
                   " ms without progress (GPU channel ", r.channel, "); the CUDA context is still usable", kRecreate);
}

void Core::synchronize(uint64_t stream) {
  const std::lock_guard<std::recursive_mutex> lock(mu_);
  CK_CHECK(!destroyed_, "synchronize: this All2All instance was destroyed");
#if COMMKIT_WITH_CUDA
  DeviceGuard g(device_);
  CK_CUDA_CHECK(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)));
  // The last call may have run on another stream; its failure must surface here too.
  if (have_last_) CK_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(last_done_)));
#endif
  check();
}

uint64_t timeout_ns_from_seconds(double s) {
  CK_CHECK_ARG(std::isfinite(s) && s >= 0 && s < 1e9, "timeout_seconds must be finite and in [0, 1e9) (0 = wait forever), got ", s);
  const uint64_t ns = static_cast<uint64_t>(s * 1e9);
  // 0 ns is the "wait forever" sentinel: a positive timeout below 1 ns must not turn into it.
  return ns == 0 && s > 0 ? 1u : ns;
}

void check_grid_args(int world, int num_blocks, int self_blocks) {
  CK_CHECK_ARG(num_blocks >= world && num_blocks < 65536, "num_blocks must be in [world_size=", world,
               ", 65535], got ", num_blocks);
  CK_CHECK_ARG(self_blocks >= 0 && self_blocks < num_blocks, "self_blocks must be in [0, num_blocks), got ",
               self_blocks);
}

void check_capacity_bytes(int64_t capacity) {
  // The layout saturates instead of wrapping, so a total past int64 means two slots of this size
  // cannot be one allocation (and Python slices the buffer with int64 offsets).
  CK_CHECK_ARG(capacity > 0 && buffer_layout(static_cast<uint64_t>(capacity)).total <= uint64_t(INT64_MAX),
               "buffer capacity (num_tokens * hidden_dim * element size) must be positive and at most about 2^62 "
               "bytes (two slots in one allocation), got ", capacity);
}

void Core::set_timeout_seconds(double s) { timeout_ns_ = timeout_ns_from_seconds(s); }

void Core::set_grid(int num_blocks, int self_blocks) {
  check_grid_args(world_, num_blocks, self_blocks);
  num_blocks_ = num_blocks;
  self_blocks_hint_ = self_blocks;
}

std::array<int, 3> Core::grid() const {
  GridPlan g = grid_plan(num_blocks_, world_, self_blocks_hint_);
  return {g.total, g.self_blocks, g.per_peer};
}

}  // namespace ipc_all2all
