// transport.cpp -- attaching a rank to the control region (Transport::Impl's constructor), the
// control region's free functions, and the public Transport, which forwards to Transport::Impl
// (transport_impl.hpp says which file holds which concern: join, producer, consumer, poison and
// liveness, calls / close / reset).
//
// Invariants (see control.hpp for who writes which line):
//   * Epochs strictly increase per transport; 0 is reserved. Rank 0 publishes active_epoch only
//     after every rank returned from wait() of the previous epoch, so a layer buffer is never
//     overwritten while a rank may still read the previous layer's stats.
//   * Expert e always travels through slot e % num_slots. Rank 0 rewrites a slot only after every
//     rank acknowledged the slot's previous sequence, so up to num_slots experts are in flight.
//   * A consumer issues every ready expert it may (up to max_inflight), merging consecutive
//     slots into one copy per kind when their host memory is contiguous, and acks a slot when the
//     copy-engine event of its batch completed: there is no per-expert idle wait.
//   * Every blocking wait has a ProgressDeadline (resets when the watched cells move), checks the
//     sticky poison record, and every liveness_ms checks that the ranks it depends on are alive
//     (pid + /proc start time; a zombie counts as dead), so a SIGKILLed peer is reported in
//     milliseconds rather than at the timeout.
//   * A failure anywhere claims the poison record once (CAS); every rank then raises the original
//     cause. reset() is a collective that drains the consumers and starts a new generation.
//   * Every rank attaches with the same geometry (expert_nbytes, num_experts; num_slots comes from
//     the header): each rank checks its own against rank 0's on attach and on join, since rank 0
//     writes the slots at its offsets and each consumer copies at its own.
//   * Every public call is counted in flight (api()); close() waits until the calls of other
//     threads left (they see stopping_ and raise ClosedError) before it returns, because the owner
//     unmaps the region and the slots right after it.
#include "transport.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "transport_impl.hpp"

namespace fp8lw {
namespace {

using commkit::ld_acquire;
using commkit::ld_relaxed;
using commkit::st_release;
using commkit::st_relaxed;

// "expert_nbytes [a, b, c, d], num_experts E": how a rank's geometry appears in errors.
std::string geometry_str(const uint64_t* nb, uint64_t num_experts) {
  return commkit::str("expert_nbytes [", nb[0], ", ", nb[1], ", ", nb[2], ", ", nb[3], "], num_experts ", num_experts);
}

Control* checked_control(uintptr_t ptr, size_t size, int tp) {
  CK_CHECK_ARG(ptr != 0, "control_ptr is null");
  CK_CHECK_ARG(ptr % 64 == 0, "control_ptr must be 64-byte aligned, got 0x", commkit::hex(ptr));
  CK_CHECK_ARG(size >= kControlBytes, "control region must be at least ", kControlBytes, " bytes, got ", size);
  auto* c = reinterpret_cast<Control*>(ptr);
  CK_CHECK_ARG(ld_acquire(&c->header.magic) == kMagic,
               "control region is not initialized (bad magic); call initialize_control first");
  CK_CHECK_ARG(c->header.version == kVersion, "control region version ", c->header.version, " != ", kVersion);
  CK_CHECK_ARG(c->header.struct_bytes == sizeof(Control), "control struct size ", c->header.struct_bytes,
               " != ", sizeof(Control), " (incompatible build)");
  CK_CHECK_ARG(c->header.tp_size == static_cast<uint64_t>(tp), "control region was initialized for tp_size ",
               c->header.tp_size, ", transport has tp_size ", tp);
  // Every slot index below is taken modulo this value and indexes ready[] and ack[] of kMaxSlots
  // entries: a header word that another writer corrupted must not reach them.
  const uint64_t slots = c->header.num_slots;
  CK_CHECK_ARG(slots >= 2 && slots <= static_cast<uint64_t>(kMaxSlots), "control region's num_slots ", slots,
               " is outside 2..", kMaxSlots, " (corrupted, or initialized by another build)");
  return c;
}

}  // namespace

size_t control_bytes() { return kControlBytes; }

size_t control_struct_bytes() { return sizeof(Control); }

void debug_set_rank_process(uintptr_t control_ptr, size_t control_size, int rank, uint64_t pid,
                            uint64_t start_time, uint64_t boot, uint64_t pid_ns, uint64_t heartbeat_ns) {
  CK_CHECK_ARG(control_ptr != 0, "control_ptr is null");
  CK_CHECK_ARG(control_ptr % 64 == 0, "control_ptr must be 64-byte aligned, got 0x", commkit::hex(control_ptr));
  CK_CHECK_ARG(control_size >= kControlBytes, "control region must be at least ", kControlBytes, " bytes, got ",
               control_size);
  const auto* h = reinterpret_cast<const Header*>(control_ptr);
  CK_CHECK_ARG(ld_acquire(&h->magic) == kMagic,
               "control region is not initialized (bad magic); call initialize_control first");
  const uint64_t tp = h->tp_size;
  CK_CHECK_ARG(tp >= 1 && tp <= static_cast<uint64_t>(kMaxTP), "control region has tp_size ", tp);
  Control* c = checked_control(control_ptr, control_size, static_cast<int>(tp));
  CK_CHECK_ARG(rank >= 0 && static_cast<uint64_t>(rank) < tp, "rank must be in 0..", tp - 1, ", got ", rank);
  auto& rs = c->ranks[rank];
  st_relaxed(&rs.pid, pid);
  st_relaxed(&rs.pid_start, start_time);
  st_relaxed(&rs.boot, boot);
  st_relaxed(&rs.pid_ns, pid_ns);
  st_relaxed(&rs.heartbeat_ns, heartbeat_ns);
  st_release(&rs.status, static_cast<uint64_t>(kRankAttached));
}

void initialize_control(uintptr_t ptr, size_t size, int tp, int num_slots) {
  CK_CHECK_ARG(ptr != 0, "control_ptr is null");
  CK_CHECK_ARG(ptr % 64 == 0, "control_ptr must be 64-byte aligned");
  CK_CHECK_ARG(size >= kControlBytes, "control region must be at least ", kControlBytes, " bytes, got ", size);
  CK_CHECK_ARG(tp >= 1 && tp <= kMaxTP, "tp_size must be in 1..", kMaxTP, ", got ", tp);
  CK_CHECK_ARG(num_slots >= 2 && num_slots <= kMaxSlots, "num_slots must be in 2..", kMaxSlots, ", got ", num_slots);
  auto* c = reinterpret_cast<Control*>(ptr);
  std::memset(static_cast<void*>(c), 0, kControlBytes);
  c->header.version = kVersion;
  c->header.struct_bytes = sizeof(Control);
  c->header.tp_size = static_cast<uint64_t>(tp);
  c->header.num_slots = static_cast<uint64_t>(num_slots);
  c->poison.rank = -1;
  commkit::fence_system();
  st_release(&c->header.magic, kMagic);
}

// ---------------------------------------------------------------------------------------------
Transport::Impl::Impl(uintptr_t control_ptr, size_t control_size, int rank, int tp, int device,
                      const std::vector<uintptr_t>& host, const std::vector<uintptr_t>& dst,
                      const std::vector<uintptr_t>& all, const std::vector<size_t>& nbytes, int num_experts,
                      uint64_t timeout_ms, const Options& opt)
    : opt_(opt) {
  CK_CHECK_ARG(tp >= 1 && tp <= kMaxTP, "tp_size must be in 1..", kMaxTP, ", got ", tp);
  c_ = checked_control(control_ptr, control_size, tp);
  CK_CHECK_ARG(rank >= 0 && rank < tp, "rank must be in 0..", tp - 1, ", got ", rank);
  CK_CHECK_ARG(num_experts > 0, "num_experts must be positive, got ", num_experts);
  CK_CHECK_ARG(timeout_ms > 0, "timeout_ms must be positive");
  rank_ = rank;
  tp_ = tp;
  slots_ = static_cast<int>(c_->header.num_slots);
  num_experts_ = num_experts;
  device_ = device;
  timeout_ms_ = timeout_ms;
  CK_CHECK_ARG(host.size() == static_cast<size_t>(slots_ * kKinds), "local_host_ptrs must hold num_slots*4 = ",
               slots_ * kKinds, " pointers in [slot][kind] order, got ", host.size());
  CK_CHECK_ARG(dst.size() == kKinds, "local_gpu_ptrs must hold 4 pointers [kind], got ", dst.size());
  CK_CHECK_ARG(nbytes.size() == kKinds, "expert_nbytes must hold 4 sizes, got ", nbytes.size());
  const size_t want_all = static_cast<size_t>(slots_ * tp * kKinds);
  if (rank == 0) {
    CK_CHECK_ARG(all.size() == want_all, "all_rank_host_ptrs must hold num_slots*tp*4 = ", want_all,
                 " pointers [slot][rank][kind] on rank 0, got ", all.size());
  } else {
    CK_CHECK_ARG(all.empty(), "all_rank_host_ptrs must be empty on ranks other than 0");
  }
  for (size_t i = 0; i < host.size(); ++i) CK_CHECK_ARG(host[i] != 0, "local_host_ptrs[", i, "] is null");
  for (size_t i = 0; i < dst.size(); ++i) CK_CHECK_ARG(dst[i] != 0, "local_gpu_ptrs[", i, "] is null");
  for (size_t i = 0; i < all.size(); ++i) CK_CHECK_ARG(all[i] != 0, "all_rank_host_ptrs[", i, "] is null");
  for (int k = 0; k < kKinds; ++k) {
    CK_CHECK_ARG(nbytes[k] > 0, "expert_nbytes[", k, "] must be positive");
    CK_CHECK_ARG(nbytes[k] <= (~uint64_t{0}) / static_cast<uint64_t>(num_experts),
                 "expert_nbytes[", k, "] * num_experts overflows");
    nb_[k] = nbytes[k];
    dst_[k] = dst[k];
  }
  for (size_t i = 0; i < host.size(); ++i) host_[i] = host[i];
  all_ = all;
  if (opt_.backend == "auto") opt_.backend = device >= 0 ? "cuda" : "cpu";
  CK_CHECK_ARG(opt_.backend == "cuda" || opt_.backend == "cpu", "backend must be 'cuda', 'cpu' or 'auto', got '",
               opt_.backend, "'");
  if (opt_.backend == "cuda") CK_CHECK_ARG(device >= 0, "the CUDA backend needs cuda_device >= 0");
  if (opt_.max_inflight <= 0 || opt_.max_inflight > slots_) opt_.max_inflight = slots_;
  if (opt_.liveness_ms == 0) opt_.liveness_ms = 20;
  CK_CHECK_ARG(opt_.copy_streams >= 1 && opt_.copy_streams <= kMaxCopyStreams, "copy_streams must be in 1..",
               kMaxCopyStreams, ", got ", opt_.copy_streams);

  auto& me = c_->ranks[rank_];
  // A record left by a process that is gone (dead, a zombie, or its pid now another process's)
  // does not block the seat; one of a live process does, unless it is this process (re-attach).
  CK_CHECK_ARG(ld_acquire(&me.status) != kRankAttached ||
                   !commkit::process_alive(ld_relaxed(&me.pid), ld_relaxed(&me.pid_start)) ||
                   ld_relaxed(&me.pid) == static_cast<uint64_t>(::getpid()),
               "rank ", rank_, " is already attached by live process ", ld_relaxed(&me.pid));
  generation_ = ld_acquire(&c_->layer.generation);
  for (int k = 0; k < kKinds; ++k) st_relaxed(&me.expert_nbytes[k], nb_[k]);
  st_relaxed(&me.num_experts, static_cast<uint64_t>(num_experts_));
  // Whichever of this rank and rank 0 attaches second sees the disagreement: a rank that differs
  // from an attached rank 0 fails here; rank 0 records the ranks attached before it that differ
  // (they and it raise at their next call). join() checks again, so a reset cannot hide it.
  if (rank_ != 0) {
    if (ld_acquire(&c_->ranks[0].status) != kRankAbsent) check_geometry();
  } else {
    for (int r = 1; r < tp_; ++r) {
      if (ld_acquire(&c_->ranks[r].status) == kRankAbsent) continue;
      const std::string diff = geometry_mismatch(r);
      if (!diff.empty()) publish_poison(kErrProtocol, r, diff);
    }
  }
  st_relaxed(&me.departed_blame, uint64_t{0});
  const commkit::ProcessId self = commkit::this_process();
  st_relaxed(&me.pid, self.pid);
  st_relaxed(&me.pid_start, self.start);
  st_relaxed(&me.boot, self.boot);
  st_relaxed(&me.pid_ns, self.pid_ns);
  heartbeat_ = std::make_unique<commkit::Heartbeat>(&me.heartbeat_ns, int(heartbeat_period_ms()));
  st_release(&me.status, static_cast<uint64_t>(kRankAttached));

  worker_ = std::thread(&Impl::consumer_main, this);
  std::unique_lock<std::mutex> lock(init_mu_);
  init_cv_.wait(lock, [this] { return init_done_; });
  if (!init_error_.empty()) {
    lock.unlock();
    stopping_.store(true);
    worker_.join();
    st_release(&me.status, static_cast<uint64_t>(kRankClosed));
    CK_THROW("consumer initialization failed on rank ", rank_, ": ", init_error_);
  }
}

// "" when rank r attached with this rank's geometry, else the error message naming both.
std::string Transport::Impl::geometry_mismatch(int r) const {
  const auto& rs = c_->ranks[r];
  uint64_t theirs[kKinds];
  bool same = ld_relaxed(&rs.num_experts) == static_cast<uint64_t>(num_experts_);
  for (int k = 0; k < kKinds; ++k) {
    theirs[k] = ld_relaxed(&rs.expert_nbytes[k]);
    same = same && theirs[k] == nb_[k];
  }
  if (same) return std::string();
  const int wrong = rank_ == 0 ? r : rank_;
  const std::string wrong_geo = rank_ == 0 ? geometry_str(theirs, ld_relaxed(&rs.num_experts))
                                           : geometry_str(nb_.data(), static_cast<uint64_t>(num_experts_));
  const std::string ref_geo = rank_ == 0 ? geometry_str(nb_.data(), static_cast<uint64_t>(num_experts_))
                                         : geometry_str(theirs, ld_relaxed(&rs.num_experts));
  return commkit::str("rank ", wrong, " attached with ", wrong_geo, " but rank 0 with ", ref_geo,
                      ": every rank must pass the same expert_nbytes and num_experts (rank 0 would write the "
                      "slots at other offsets than rank ", wrong, " copies from)");
}

// On a rank other than 0, once rank 0 attached: poisons and raises ProtocolError on a mismatch.
void Transport::Impl::check_geometry() {
  const std::string diff = geometry_mismatch(0);
  if (!diff.empty()) poison_and_throw(kErrProtocol, diff);
}

// ---------------------------------------------------------------------------------------------
Transport::Transport(uintptr_t control_ptr, size_t control_size, int rank, int tp_size, int cuda_device,
                     const std::vector<uintptr_t>& local_host_ptrs, const std::vector<uintptr_t>& local_dst_ptrs,
                     const std::vector<uintptr_t>& all_rank_host_ptrs, const std::vector<size_t>& expert_nbytes,
                     int num_experts, uint64_t timeout_ms, const Options& options)
    : impl_(new Impl(control_ptr, control_size, rank, tp_size, cuda_device, local_host_ptrs, local_dst_ptrs,
                     all_rank_host_ptrs, expert_nbytes, num_experts, timeout_ms, options)) {}
Transport::~Transport() = default;

void Transport::join(uint64_t epoch, int64_t layer_id, int expert_count) { impl_->join(epoch, layer_id, expert_count); }
Stats Transport::wait(uint64_t epoch) { return impl_->wait(epoch); }
bool Transport::close() noexcept { return impl_->close(); }
std::string Transport::teardown_error() const {
  // final_ready_ is set after close() joined the consumer, which wrote teardown_error_ before it ended.
  std::lock_guard<std::mutex> g(impl_->final_mu_);
  return impl_->final_ready_ ? impl_->teardown_error_ : std::string();
}
uint64_t Transport::reset() { return impl_->reset(); }
bool Transport::poison(int code, const std::string& message) { return impl_->poison(code, message); }
bool Transport::poisoned() const { return impl_->poison_snapshot().poisoned; }
Stats Transport::last_poison() const { return impl_->poison_snapshot(); }
int Transport::rank() const { return impl_->rank_; }
int Transport::tp_size() const { return impl_->tp_; }
int Transport::num_slots() const { return impl_->slots_; }
int Transport::num_experts() const { return impl_->num_experts_; }
bool Transport::closed() const { return impl_->closed_.load(); }
uint64_t Transport::generation() const { return impl_->generation_; }
std::string Transport::backend() const { return impl_->opt_.backend; }

}  // namespace fp8lw
