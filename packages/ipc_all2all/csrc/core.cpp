// core.cpp -- see core.hpp. Without CUDA (COMMKIT_WITH_CUDA=0) the class still compiles so the
// layout helpers and validation are testable on a CPU-only machine; constructing it raises.
#include "core.hpp"

#include "a2a_geometry.hpp"

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
void launch_a2a(const KernelArgs& args, int grid, cudaStream_t stream);
void launch_fp8_unpack(const void* in, void* out, int64_t groups, int head_dim, cudaStream_t stream);

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
    case kGatherHeads * 4 + kPhaseEntry: return "gather_heads (entry handshake: peer never entered the call)";
    case kGatherHeads * 4 + kPhaseCompletion: return "gather_heads (completion: peer's data never arrived)";
    case kAllGather * 4 + kPhaseEntry: return "allgather (entry handshake: peer never entered the call)";
    case kAllGather * 4 + kPhaseCompletion: return "allgather (completion: peer's data never arrived)";
    default: return "unknown ipc_all2all operation";
  }
}

Core::Core(int rank, int world, int64_t capacity, int num_blocks, double timeout_seconds)
    : rank_(rank), world_(world), capacity_(capacity), num_blocks_(num_blocks) {
  CK_CHECK_ARG(world >= 1 && world <= kMaxWorld, "world_size must be in [1, ", kMaxWorld, "], got ", world);
  CK_CHECK_ARG(rank >= 0 && rank < world, "rank must be in [0, world_size=", world, "), got ", rank);
  CK_CHECK_ARG(capacity > 0, "buffer capacity (num_tokens * hidden_dim * element size) must be positive, got ",
               capacity);
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
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    if (rec_host_) cudaFreeHost(rec_host_);
    cudaFree(p);
    CK_THROW("ipc_all2all: setting up the shared buffer failed: ", cudaGetErrorString(err));
  }
  commkit::clear_timeout_record(rec_host_);
  handle_.assign(reinterpret_cast<const char*>(&h), sizeof(h));
#else
  CK_THROW("ipc_all2all was built without CUDA (no nvcc at build time); All2All needs a CUDA build");
#endif
}

Core::~Core() {
  try {
    destroy();
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

void Core::require_usable(const char* what) const {
  CK_CHECK(!destroyed_, what, ": this All2All instance was destroyed");
  CK_CHECK(!broken_, what, ": this All2All instance is unusable after an earlier failure (", broken_reason_,
           "); destroy() it on every rank and build a new one");
}

void Core::open_peers(const std::vector<std::string>& handles) {
  require_usable("sync");
  CK_CHECK_ARG(!opened_, "sync(): the peers' handles are already open");
  CK_CHECK_ARG(static_cast<int>(handles.size()) == world_, "sync(): expected ", world_,
               " handles (one per rank), got ", handles.size());
#if COMMKIT_WITH_CUDA
  commkit::check_ipc_handles(handles, rank_, handle_, "sync()");
  DeviceGuard g(device_);
  const std::vector<void*> peers = commkit::open_ipc_handles(handles, rank_, "sync()");
  for (int i = 0; i < world_; ++i)
    if (i != rank_) base_[i] = static_cast<char*>(peers[i]);
  opened_ = true;
#endif
}

int Core::launch(int op, uint64_t x_ptr, uint64_t stream, int batch, int64_t x_rows, int64_t out_rows,
                 int64_t cap_rows, int64_t chunk_bytes, int64_t wide_bytes, const std::vector<int64_t>& counts,
                 uint64_t counts_ptr, int pack_head_dim) {
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
#if COMMKIT_WITH_CUDA
  DeviceGuard dg(device_);
  launch_a2a(a, g.total, reinterpret_cast<cudaStream_t>(stream));
#endif
  ++calls_;
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
  require_usable("fp8_unpack");
  check_fp8_args("fp8_unpack", in_ptr, out_ptr, groups, head_dim);
#if COMMKIT_WITH_CUDA
  DeviceGuard g(device_);
  launch_fp8_unpack(reinterpret_cast<const void*>(in_ptr), reinterpret_cast<void*>(out_ptr), groups, head_dim,
                    reinterpret_cast<cudaStream_t>(stream));
#endif
}

void Core::check() {
  if (destroyed_ || rec_host_ == nullptr) return;
  if (commkit::ld_acquire(&rec_host_->flag) == 0) return;
  // flag 2 means a device thread is still filling the record; it finishes within microseconds.
  for (int i = 0; i < 1000000 && commkit::ld_acquire(&rec_host_->flag) != 1u; ++i) {
  }
  broken_ = true;
  broken_reason_ = std::string("a device-side timeout in ") + op_name(rec_host_->op);
  CK_RAISE_IF_TIMED_OUT(rec_host_, op_name);
}

void Core::synchronize(uint64_t stream) {
  CK_CHECK(!destroyed_, "synchronize: this All2All instance was destroyed");
#if COMMKIT_WITH_CUDA
  DeviceGuard g(device_);
  CK_CUDA_CHECK(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)));
#endif
  check();
}

void Core::set_timeout_seconds(double s) {
  CK_CHECK_ARG(std::isfinite(s) && s >= 0 && s < 1e9, "timeout_seconds must be finite and >= 0 (0 = wait forever), got ", s);
  timeout_ns_ = static_cast<uint64_t>(s * 1e9);
}

void Core::set_grid(int num_blocks, int self_blocks) {
  CK_CHECK_ARG(num_blocks >= world_ && num_blocks < 65536, "num_blocks must be in [world_size, 65535], got ",
               num_blocks);
  CK_CHECK_ARG(self_blocks >= 0 && self_blocks < num_blocks, "self_blocks must be in [0, num_blocks), got ",
               self_blocks);
  num_blocks_ = num_blocks;
  self_blocks_hint_ = self_blocks;
}

std::array<int, 3> Core::grid() const {
  GridPlan g = grid_plan(num_blocks_, world_, self_blocks_hint_);
  return {g.total, g.self_blocks, g.per_peer};
}

void Core::destroy() {
  if (destroyed_) return;
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
  if (base_[rank_]) {
    cudaError_t e = cudaFree(base_[rank_]);
    if (first == cudaSuccess) first = e;
    base_[rank_] = nullptr;
  }
  if (rec_host_) {
    cudaError_t e = cudaFreeHost(rec_host_);
    if (first == cudaSuccess) first = e;
    rec_host_ = rec_dev_ = nullptr;
  }
  if (first != cudaSuccess) {
    (void)cudaGetLastError();
    CK_THROW("destroy(): releasing the buffer failed: ", cudaGetErrorString(first));
  }
#endif
}

}  // namespace ipc_all2all
