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
#endif

namespace ipc_all2all {

#if COMMKIT_WITH_CUDA
namespace {
// Every CUDA call runs on the instance's device, whatever the caller's current device is (the rank
// need not equal the device index).
class DeviceGuard {
 public:
  explicit DeviceGuard(int dev) {
    CK_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != dev) CK_CUDA_CHECK(cudaSetDevice(dev));
  }
  ~DeviceGuard() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev_) (void)cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
};
}  // namespace
#endif

const char* op_name(uint32_t op) {
  switch (op) {
    case kSendRecvHeads * 4 + kPhaseEntry: return "send_recv_heads (entry handshake: peer never entered the call)";
    case kSendRecvHeads * 4 + kPhaseCompletion: return "send_recv_heads (completion: peer's data never arrived)";
    case kSendRecvHeads * 4 + kPhaseMismatch: return "send_recv_heads (entry handshake: peer entered another call)";
    case kSendRecvHeads * 4 + kPhaseBroken: return "send_recv_heads (abandoned: the instance failed)";
    case kGatherHeads * 4 + kPhaseEntry: return "gather_heads (entry handshake: peer never entered the call)";
    case kGatherHeads * 4 + kPhaseCompletion: return "gather_heads (completion: peer's data never arrived)";
    case kGatherHeads * 4 + kPhaseMismatch: return "gather_heads (entry handshake: peer entered another call)";
    case kGatherHeads * 4 + kPhaseBroken: return "gather_heads (abandoned: the instance failed)";
    case kAllGather * 4 + kPhaseEntry: return "allgather (entry handshake: peer never entered the call)";
    case kAllGather * 4 + kPhaseCompletion: return "allgather (completion: peer's data never arrived)";
    case kAllGather * 4 + kPhaseMismatch: return "allgather (entry handshake: peer entered another call)";
    case kAllGather * 4 + kPhaseBroken: return "allgather (abandoned: the instance failed)";
    case kPeerWatch * 4: return "ipc_all2all peer watch (a peer's process on this host died)";
    default: return "unknown ipc_all2all operation";
  }
}

namespace {
const char* kind_name(uint32_t kind) {
  switch (kind) {
    case kSendRecvHeads: return "send_recv_heads";
    case kGatherHeads: return "gather_heads";
    case kAllGather: return "allgather";
    default: return "an unknown operation";
  }
}

const char* kRecreate = "; destroy() the instance on every rank and build a new one";
}  // namespace

std::string failure_message(const commkit::TimeoutRecord& r) {
  const uint32_t kind = r.op / 4, phase = r.op % 4;
  const char* me = kind_name(kind);
  if (phase == kPhaseMismatch) {
    const uint64_t mine = static_cast<uint64_t>(r.expected), theirs = static_cast<uint64_t>(r.observed);
    const uint32_t my_sig = ready_signature(mine), their_sig = ready_signature(theirs);
    std::string why;
    if (ready_call(theirs) != ready_call(mine)) {
      why = commkit::str("peer ", r.peer, " is at call ", ready_call(theirs), " while this rank is at call ",
                         ready_call(mine));
    } else if (signature_op(their_sig) != signature_op(my_sig)) {
      why = commkit::str("peer ", r.peer, " is running ",
                         signature_op(their_sig) == 0 ? "no call" : kind_name(signature_op(their_sig) - 1),
                         " while this rank runs ", me, " (call ", ready_call(mine),
                         " of both: a rank skipped or added a call)");
    } else if (signature_slot(their_sig) != signature_slot(my_sig)) {
      why = commkit::str("peer ", r.peer, " runs ", me, " into output slot ", signature_slot(their_sig),
                         ", this rank into slot ", signature_slot(my_sig),
                         " (the ranks' call histories differ, e.g. a CUDA graph captured on some ranks only)");
    } else {
      why = commkit::str("peer ", r.peer, " runs ", me,
                         " with another batch, head layout, element size, fp8 mode or token counts (signature ",
                         commkit::hex(their_sig), ", this rank's ", commkit::hex(my_sig), ")");
    }
    return commkit::str("ipc_all2all: ", me, " on rank ", r.rank, ": ", why,
                        "; every rank must make the same calls in the same order with the same shapes and "
                        "set_rank_tokens. Nothing was written to the peer", kRecreate);
  }
  if (phase == kPhaseBroken) {
    const std::string by = r.peer == r.rank ? std::string(" (on this rank)")
                           : r.peer >= 0    ? commkit::str(" (marked failed by rank ", r.peer, ")")
                                            : std::string();
    return commkit::str("ipc_all2all: ", me, " on rank ", r.rank, " (call ", r.expected,
                        ") was abandoned: this instance failed in this or an earlier call", by,
                        "; its output and every later one are invalid (an input may derive from the failed call)",
                        kRecreate);
  }
  return commkit::str(op_name(r.op), " timed out on rank ", r.rank, " waiting for peer ", r.peer, ": expected call ",
                      r.expected, ", observed ", r.observed);
}

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
  if (err == cudaSuccess) err = cudaHostAlloc(reinterpret_cast<void**>(&rec_host_), sizeof(commkit::TimeoutRecord),
                                              cudaHostAllocMapped);
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
  if (period_ms > 0)
    watch_ = std::make_unique<commkit::PeerWatch>(rec_host_, uint32_t(kPeerWatch * 4), rank_, peers, period_ms);
}

void Core::check() {
  const std::lock_guard<std::recursive_mutex> lock(mu_);
  if (destroyed_ || rec_host_ == nullptr) return;
  if (commkit::ld_acquire(&rec_host_->flag) == 0) return;
  // flag 2 means a device thread is still filling the record; it finishes within microseconds. A record
  // still not complete after that is left for the next check: its fields may be torn, and clearing it
  // would let the writer's final flag = 1 revive it for a later call.
  for (int i = 0; i < 1000000 && commkit::ld_acquire(&rec_host_->flag) != 1u; ++i) {
  }
  if (commkit::ld_acquire(&rec_host_->flag) != 1u) return;
  const commkit::TimeoutRecord r = *rec_host_;
  commkit::clear_timeout_record(rec_host_);
  broken_ = true;
  const uint32_t phase = r.op % 4;
  broken_reason_ = std::string("a device-side failure in ") + op_name(r.op);
  if (r.op == kPeerWatch * 4) {
    broken_reason_ = commkit::str("rank ", r.peer, "'s process died");
    // The watch only ends the waits: the call that waited is the last one launched.
    const char* call = last_op_ == kSendRecvHeads ? "send_recv_heads"
                       : last_op_ == kGatherHeads ? "gather_heads"
                       : last_op_ == kAllGather   ? "allgather"
                                                  : nullptr;
    const std::string during =
        call ? commkit::str(" during this rank's ", call, " (the last operation it launched)") : std::string();
    CK_CHECK_RANK(false, r.rank, r.peer, "rank ", r.peer, "'s process (pid ", r.expected, ") on this host died", during,
                  "; the call waiting for it was ended at once", kRecreate);
  }
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

void Core::destroy(bool free_buffer) {
  const std::lock_guard<std::recursive_mutex> lock(mu_);
  if (destroyed_) {
    if (free_buffer) release_buffer();
    return;
  }
  destroyed_ = true;
#if COMMKIT_WITH_CUDA
  DeviceGuard g(device_);
  // Our kernels may still write to peers (and they to us); everything local must finish first.
  cudaError_t first = cudaDeviceSynchronize();
  std::vector<void*> peers(world_, nullptr);
  for (int i = 0; i < world_; ++i)
    if (i != rank_) {
      peers[i] = base_[i];
      base_[i] = nullptr;
    }
  const cudaError_t closed = commkit::close_ipc_handles(peers);
  if (first == cudaSuccess) first = closed;
  watch_.reset();  // its thread writes the record freed below
  if (rec_host_) {
    cudaError_t e = cudaFreeHost(rec_host_);
    if (first == cudaSuccess) first = e;
    rec_host_ = rec_dev_ = nullptr;
  }
  if (last_done_) {
    cudaError_t e = cudaEventDestroy(static_cast<cudaEvent_t>(last_done_));
    if (first == cudaSuccess) first = e;
    last_done_ = nullptr;
    have_last_ = false;
  }
  if (first != cudaSuccess) {
    (void)cudaGetLastError();
    if (free_buffer) release_buffer();
    CK_THROW("destroy(): releasing the instance failed: ", cudaGetErrorString(first));
  }
#endif
  if (free_buffer) release_buffer();
}

void Core::release_buffer() {
  const std::lock_guard<std::recursive_mutex> lock(mu_);
#if COMMKIT_WITH_CUDA
  if (base_[rank_] == nullptr) return;
  DeviceGuard g(device_);
  const cudaError_t e = cudaFree(base_[rank_]);
  base_[rank_] = nullptr;
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    CK_THROW("destroy(): freeing the shared buffer failed: ", cudaGetErrorString(e));
  }
#endif
}

}  // namespace ipc_all2all
