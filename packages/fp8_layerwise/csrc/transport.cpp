// transport.cpp -- the protocol: join / run_producer / consumer thread / wait / close / reset.
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

#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <type_traits>

#include "backend.hpp"
#include "commkit/atomics.hpp"
#include "commkit/deadline.hpp"

namespace fp8lw {
namespace {

using commkit::cas;
using commkit::ld_acquire;
using commkit::ld_relaxed;
using commkit::monotonic_ns;
using commkit::st_release;
using commkit::st_relaxed;

struct Stopping {};  // thrown inside waits when close() runs concurrently

// Who a wait is blocked on: the rank (-1: unknown) and "; rank 1 has not ..." for the message.
struct Blame {
  int peer = -1;
  std::string text;
};

double ms(uint64_t ns) { return static_cast<double>(ns) / 1e6; }

const char* code_name(int code) {
  switch (code) {
    case kErrProtocol: return "protocol";
    case kErrTimeout: return "timeout";
    case kErrCudaInit: return "cuda-init";
    case kErrCopy: return "copy";
    case kErrWriter: return "writer";
    case kErrClosedWhileActive: return "closed-while-active";
    case kErrPeerDead: return "peer-dead";
    case kErrUser: return "user";
    case kErrInterrupted: return "interrupted";
    default: return "unknown";
  }
}

// "expert_nbytes [a, b, c, d], num_experts E": how a rank's geometry appears in errors.
std::string geometry_str(const uint64_t* nb, uint64_t num_experts) {
  return commkit::str("expert_nbytes [", nb[0], ", ", nb[1], ", ", nb[2], ", ", nb[3], "], num_experts ", num_experts);
}

// The first bytes of `msg` that fit a record field of `cap` bytes (with its NUL), cut before a UTF-8
// sequence that would not fit whole: messages carry writer exceptions, which may be any text, and a
// record ending in half a character could not be turned into a Python str (UnicodeDecodeError
// instead of the poison on every rank).
std::string fit_utf8(const std::string& msg, size_t cap) {
  if (msg.size() < cap) return msg;
  // msg[n] is the first byte that does not fit; if it continues a character (10xxxxxx), that
  // character starts further back and goes as a whole.
  size_t n = cap - 1;
  while (n > 0 && (static_cast<unsigned char>(msg[n]) & 0xC0u) == 0x80u) --n;
  return msg.substr(0, n);
}

// close() waits for the calls other threads are in for the transport's timeout, but at most this
// long: it runs from __exit__, __del__ and interpreter exit, where hanging on a stuck writer is
// worse than leaving the memory mapped.
constexpr uint64_t kCloseDrainMaxMs = 60000;

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
  return c;
}

}  // namespace

size_t control_bytes() { return kControlBytes; }

uint64_t live_start_time(uint64_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%llu/stat", static_cast<unsigned long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return 0;
  char buf[1024];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // the command name may contain spaces and parens
  if (p == nullptr) return 0;
  ++p;
  char state = 0;
  uint64_t start = 0;
  int field = 2;
  const char* tok = p;
  while (*tok != '\0' && field < 22) {
    while (*tok == ' ') ++tok;
    ++field;
    if (field == 3) state = *tok;
    if (field == 22) {
      start = std::strtoull(tok, nullptr, 10);
      break;
    }
    while (*tok != '\0' && *tok != ' ') ++tok;
  }
  if (state == 'Z' || state == 'X' || state == 'x') return 0;
  return start == 0 ? 1 : start;
}

bool rank_process_alive(uint64_t pid, uint64_t recorded_start) {
  const uint64_t start = live_start_time(pid);
  if (start == 0) return false;  // no such process, or a zombie
  // The pid names another process now (pid reuse): the rank's own process is gone.
  if (recorded_start != 0 && start != recorded_start) return false;
  return true;
}

size_t control_struct_bytes() { return sizeof(Control); }

void debug_set_rank_process(uintptr_t control_ptr, size_t control_size, int rank, uint64_t pid,
                            uint64_t start_time) {
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
class Transport::Impl {
 public:
  Impl(uintptr_t control_ptr, size_t control_size, int rank, int tp, int device,
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
                     !rank_process_alive(ld_relaxed(&me.pid), ld_relaxed(&me.pid_start)) ||
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
    st_relaxed(&me.pid, static_cast<uint64_t>(::getpid()));
    st_relaxed(&me.pid_start, live_start_time(static_cast<uint64_t>(::getpid())));
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

  ~Impl() { close(); }

  // --- geometry -----------------------------------------------------------------------------
  // "" when rank r attached with this rank's geometry, else the error message naming both.
  std::string geometry_mismatch(int r) const {
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
  void check_geometry() {
    const std::string diff = geometry_mismatch(0);
    if (!diff.empty()) poison_and_throw(kErrProtocol, diff);
  }

  // --- poison -------------------------------------------------------------------------------
  // peer: the rank the failure is blamed on (e.g. the one a timeout waited for), -1 if none.
  bool publish_poison(int code, int rank, const std::string& msg, int peer = -1) noexcept {
    if (cas(&c_->poison.state, uint64_t{0}, kPoisonClaimed) != 0) return false;
    st_relaxed(&c_->poison.claim_ns, monotonic_ns());
    st_relaxed(&c_->poison.code, static_cast<uint64_t>(code));
    st_relaxed(&c_->poison.rank, static_cast<int64_t>(rank));
    st_relaxed(&c_->poison.peer, peer >= 0 && peer < tp_ ? static_cast<uint64_t>(peer) + 1u : uint64_t{0});
    st_relaxed(&c_->poison.generation, ld_relaxed(&c_->layer.generation));
    std::snprintf(c_->poison.message, sizeof(c_->poison.message), "%s",
                  fit_utf8(msg, sizeof(c_->poison.message)).c_str());
    commkit::fence_system();
    st_release(&c_->poison.state, uint64_t{1});
    return true;
  }

  bool is_poisoned() const { return ld_acquire(&c_->poison.state) != 0; }

  // Reads the record, giving a claimer 10 ms to finish publishing it.
  void read_poison(int& code, int& rank, std::string& msg, int& peer) const {
    const uint64_t until = monotonic_ns() + 10000000ull;
    while (ld_acquire(&c_->poison.state) == kPoisonClaimed && monotonic_ns() < until) sched_yield();
    peer = -1;
    if (ld_acquire(&c_->poison.state) == kPoisonClaimed) {
      code = static_cast<int>(ld_relaxed(&c_->poison.code));
      rank = -1;
      msg = "poison publication did not complete (the claiming process may have died)";
      return;
    }
    code = static_cast<int>(ld_relaxed(&c_->poison.code));
    rank = static_cast<int>(ld_relaxed(&c_->poison.rank));
    const uint64_t p1 = ld_relaxed(&c_->poison.peer);
    peer = p1 >= 1 && p1 <= static_cast<uint64_t>(tp_) ? static_cast<int>(p1 - 1) : -1;
    char buf[sizeof(c_->poison.message)];
    std::memcpy(buf, c_->poison.message, sizeof(buf));
    buf[sizeof(buf) - 1] = '\0';
    msg = buf;
  }

  [[noreturn]] void raise_poison() const {
    int code, rank, peer;
    std::string msg;
    read_poison(code, rank, msg, peer);
    throw PoisonedError(commkit::str("fp8_layerwise transport poisoned (code ", code, " ", code_name(code), ", rank ",
                                     rank, "): ", msg, " [raised on rank ", rank_, "]"),
                        code, rank, msg, peer);
  }

  void check_poison() const {
    if (is_poisoned()) raise_poison();
  }

  [[noreturn]] void poison_and_throw(int code, const std::string& msg, int peer = -1) {
    publish_poison(code, rank_, msg, peer);
    raise_poison();
  }

  // --- liveness -----------------------------------------------------------------------------
  // Raises peer-dead if a rank in `mask` closed or its process is gone. With `record` it claims the
  // poison record first (every rank then raises it); reset() waits while the record is already
  // claimed by the failure being recovered from, so it raises the peer-dead error directly.
  // A dead rank is reported before a closed one: a rank usually closes because it saw another die
  // (and raised), so the death is the cause the user needs to hear about, whichever this rank
  // happens to notice first.
  // A rank that left after naming another (departed_blame) is reported as that rank, through
  // chains of such departures, so every rank names the first rank that went.
  void check_peers(uint32_t mask, const char* what, bool record = true) {
    int closed = -1;
    for (int r = 0; r < tp_; ++r) {
      if (r == rank_ || !(mask & (1u << r))) continue;
      const auto& rs = c_->ranks[r];
      const uint64_t status = ld_acquire(&rs.status);
      if (status == kRankClosed && closed < 0) closed = r;
      if (status != kRankAttached) continue;  // not attached yet: only the deadline applies
      const uint64_t pid = ld_relaxed(&rs.pid);
      if (!rank_process_alive(pid, ld_relaxed(&rs.pid_start)))
        departed(r, commkit::str("rank ", r, " (pid ", pid, ") died"), what, record);
    }
    if (closed >= 0) departed(closed, commkit::str("rank ", closed, " closed its transport"), what, record);
  }

  // Rank r is gone (`how`); raises PeerDied naming r, or the rank r itself had named before it left.
  [[noreturn]] void departed(int r, const std::string& how, const char* what, bool record) {
    int cause = r;
    for (int hops = 0; hops < tp_; ++hops) {  // bounded: a cycle cannot hang this
      const uint64_t b = ld_acquire(&c_->ranks[cause].departed_blame);
      if (b == 0 || int(b - 1) == cause || int(b - 1) == rank_ || b - 1 >= uint64_t(tp_)) break;
      cause = int(b - 1);
    }
    if (cause == r)
      peer_dead(r, commkit::str(how, " while rank ", rank_, " was waiting for ", what), record);
    peer_dead(cause, commkit::str("rank ", cause, " went away (reported by rank ", r, ", which then left: ", how,
                                  ") while rank ", rank_, " was waiting for ", what),
              record);
  }

  [[noreturn]] void peer_dead(int r, const std::string& msg, bool record) {
    st_release(&c_->ranks[rank_].departed_blame, static_cast<uint64_t>(r) + 1u);
    if (!record)
      throw PoisonedError(commkit::str("fp8_layerwise transport: ", msg, " [raised on rank ", rank_, "]"),
                          kErrPeerDead, r, msg, r);
    publish_poison(kErrPeerDead, r, msg, r);
    raise_poison();
  }

  // When the next liveness check is due: liveness_ms from now, saturating (a huge liveness_ms
  // means "never", not an overflow into the past).
  uint64_t next_liveness_check() const {
    return commkit::add_saturating(monotonic_ns(), commkit::ms_to_ns_saturating(opt_.liveness_ms));
  }

  uint32_t all_mask() const { return (1u << tp_) - 1u; }

  // Waits for pred(); poison, close, dead peers (mask), an interruption (Options::interrupt_check)
  // and a stalled deadline all throw. The checks that end a wait early throw from inside the poll,
  // so it never reports kAborted. describe() says who is missing (Blame: the rank, and ": rank 1 has
  // not ..." for the message); an expiry names it and records it as the error's peer. Without
  // honor_poison (reset(), which waits on a poisoned region) an expiry raises a TimeoutError
  // instead of poisoning.
  // A liveness mask is a constant, or a callable read at each check for waits whose dependencies
  // end part-way (wait() needs rank 0 only until its producer finished the layer).
  template <typename Mask>
  static uint32_t mask_now(const Mask& mask) {
    if constexpr (std::is_invocable_v<const Mask&>) {
      return mask();
    } else {
      return static_cast<uint32_t>(mask);
    }
  }

  template <typename Pred, typename Progress, typename Mask, typename Describe>
  void wait_for(const char* what, Pred&& pred, Progress&& progress, const Mask& live_mask, bool honor_poison,
                Describe&& describe) {
    commkit::ProgressDeadline deadline(timeout_ms_);
    uint64_t next_live = next_liveness_check();
    uint64_t next_intr = next_interrupt_check();
    auto interrupted = [&] {
      if (honor_poison) {
        check_poison_or_reset();
      }
      if (stopping_.load(std::memory_order_acquire)) throw Stopping{};
      const uint64_t now = monotonic_ns();
      if (now >= next_live) {
        const uint32_t mask = mask_now(live_mask);
        if (mask != 0) check_peers(mask, what, honor_poison);
        next_live = next_liveness_check();
      }
      if (now >= next_intr) {
        check_interrupt(what);
        next_intr = next_interrupt_check();
      }
      return false;
    };
    // The default backoff yields for 200 us since the last progress (a copy of a few MB takes
    // ~100 us), then sleeps.
    if (commkit::poll_until(pred, deadline, [&] { return static_cast<uint64_t>(progress()); }, interrupted) ==
        commkit::PollResult::kExpired) {
      const Blame blame = describe();
      if (!honor_poison)
        CK_THROW_TIMEOUT(what, rank_, blame.peer, 1, 0, " after ", timeout_ms_, " ms without progress", blame.text);
      poison_and_throw(kErrTimeout,
                       commkit::str("rank ", rank_, " timed out after ", timeout_ms_,
                                    " ms without progress waiting for ", what, blame.text),
                       blame.peer);
    }
    // pred() is tested before the checks above: a reset() that marked the awaited epoch done must not
    // pass for the layer having been delivered.
    if (honor_poison) {
      check_poison_or_reset();
    }
  }

  template <typename Pred, typename Progress>
  void wait_for(const char* what, Pred&& pred, Progress&& progress, uint32_t mask) {
    wait_for(what, std::forward<Pred>(pred), std::forward<Progress>(progress), mask, true, [] { return Blame{}; });
  }

  // --- interruption -------------------------------------------------------------------------
  // When the next Options::interrupt_check is due: every kInterruptCheckMs, or every liveness tick
  // when that is shorter (a huge timeout_ms or liveness_ms never delays it).
  uint64_t next_interrupt_check() const {
    if (!opt_.interrupt_check) return ~uint64_t{0};
    return commkit::add_saturating(monotonic_ns(),
                                   commkit::ms_to_ns_saturating(std::min(opt_.liveness_ms, kInterruptCheckMs)));
  }

  // Asks the hook; on an interruption poisons the region the way close() of an active layer does
  // (the peers raise at once, naming this rank and the cause) and raises InterruptedError.
  void check_interrupt(const char* what) {
    if (!opt_.interrupt_check) return;
    const std::string why = opt_.interrupt_check();
    if (why.empty()) return;
    const std::string msg = commkit::str("rank ", rank_, " was interrupted (", why, ") in ", current_call(),
                                         "() while waiting for ", what);
    publish_poison(kErrInterrupted, rank_, msg);
    throw InterruptedError(commkit::str("fp8_layerwise transport: ", msg, " [raised on rank ", rank_, "]"), rank_);
  }

  // The generation the innermost public call of this thread started in. A reset() that completes
  // while the call is blocked (another thread of this rank ran it) abandons that call's layer: rank 0
  // zeroes sequences and acks and marks the epoch done, so the call must not go on as if it were
  // still current (a stale run() would keep writing and publishing the old layer's slots next to
  // the new layer, a stale wait() would return the abandoned layer as complete).
  static uint64_t& call_generation_slot() {
    static thread_local uint64_t gen = 0;
    return gen;
  }

  // Both checks a public call makes before acting on the layer it started in (not the consumer
  // thread, which is outside any call).
  void check_poison_or_reset() const {
    check_poison();
    check_not_reset();
  }

  void check_not_reset() const {
    const uint64_t now = ld_acquire(&c_->layer.generation);
    const uint64_t at = call_generation_slot();
    if (now != at)
      CK_THROW("fp8_layerwise transport on rank ", rank_, ": reset() ran (generation ", at, " -> ", now, ") while ",
               current_call(), "() was blocked in it; the layer of that call was abandoned, so it stops here");
  }

  // The public call this thread is inside of (for messages).
  static const char*& current_call_slot() {
    static thread_local const char* call = nullptr;
    return call;
  }
  static const char* current_call() {
    const char* c = current_call_slot();
    return c != nullptr ? c : "a call";
  }

  // --- who is missing -----------------------------------------------------------------------
  // "; rank 1 has not joined epoch 3": the ranks (or rank 0's producer) that the layer `epoch` is
  // waiting for, from the control block; peer is the first of them.
  Blame layer_blame(uint64_t epoch) const {
    Blame b;
    auto add = [&](int r, const std::string& why) {
      if (b.peer < 0) b.peer = r;
      b.text += commkit::str(b.text.empty() ? ": " : "; ", why);
    };
    const uint64_t active = ld_acquire(&c_->layer.active_epoch);
    if (active < epoch) {
      add(0, commkit::str("rank 0 has not opened epoch ", epoch, " (its open epoch is ", active, ")"));
      return b;
    }
    if (active > epoch) return b;
    for (int r = 0; r < tp_; ++r)
      if (ld_acquire(&c_->ranks[r].join_epoch) < epoch) add(r, commkit::str("rank ", r, " has not joined epoch ", epoch));
    if (b.peer >= 0) return b;
    if (ld_acquire(&c_->layer.producer_done_epoch) >= epoch) {
      for (int r = 0; r < tp_; ++r)
        if (ld_acquire(&c_->ranks[r].consumer_done_epoch) < epoch)
          add(r, commkit::str("rank ", r, "'s consumer has not finished copying epoch ", epoch));
      return b;
    }
    if (ld_acquire(&c_->layer.run_epoch) < epoch) {
      add(0, commkit::str("rank 0 has not called run() for epoch ", epoch));
      return b;
    }
    // Rank 0 is producing: a rank that has not acknowledged a published slot of this epoch holds it.
    for (int r = 0; r < tp_; ++r) {
      for (int s = 0; s < slots_; ++s) {
        const uint64_t seq = ld_acquire(&c_->ready[s].sequence);
        if (seq != 0 && ld_relaxed(&c_->ready[s].epoch) == epoch && ld_acquire(&c_->ranks[r].ack[s]) < seq) {
          add(r, commkit::str("rank ", r, " has not acknowledged expert ", ld_relaxed(&c_->ready[s].expert),
                              " (slot ", s, ")"));
          break;
        }
      }
    }
    if (b.peer < 0)
      add(0, commkit::str("rank 0's writer has not published the next expert (", ld_relaxed(&c_->layer.next_sequence),
                          " published in this generation)"));
    return b;
  }

  // --- calls in flight ----------------------------------------------------------------------
  // Every public call runs inside api(): it is counted in flight so that close() can wait until no
  // other thread of this process still touches the region, the slots or (run's writer) the slots'
  // views (the owner unmaps them right after close() returns), and a call that close() interrupted
  // raises ClosedError ("closed while blocked") instead of whatever it was waiting for.
  template <typename F>
  auto api(const char* call, F&& f) -> decltype(f()) {
    CallGuard guard(this, call);
    try {
      return f();
    } catch (const Stopping&) {
      throw_closed_while_blocked(call);
    } catch (const PoisonedError& e) {
      // close() poisons a layer it interrupts (CLOSED_WHILE_ACTIVE, this rank): for this process's
      // own blocked caller that is the close, not a failure of the layer.
      if (closed_.load() && e.code() == kErrClosedWhileActive && e.poison_rank() == rank_)
        throw_closed_while_blocked(call);
      throw;
    }
  }

  [[noreturn]] void throw_closed_while_blocked(const char* call) const {
    throw ClosedError(commkit::str("fp8_layerwise transport on rank ", rank_, " was closed while ", call,
                                   "() was blocked in it (close() from another thread, or from the writer)"),
                      rank_);
  }

  // The calls this thread is inside of, innermost last (a writer may call back into the transport).
  static std::vector<const Impl*>& thread_calls() {
    static thread_local std::vector<const Impl*> calls;
    return calls;
  }

  struct CallGuard {
    CallGuard(Impl* impl, const char* call)
        : impl(impl), outer(current_call_slot()), outer_gen(call_generation_slot()) {
      impl->enter_call(call);
      current_call_slot() = call;
      call_generation_slot() = ld_acquire(&impl->c_->layer.generation);
    }
    ~CallGuard() {
      current_call_slot() = outer;
      call_generation_slot() = outer_gen;
      impl->leave_call();
    }
    CallGuard(const CallGuard&) = delete;
    CallGuard& operator=(const CallGuard&) = delete;
    Impl* impl;
    const char* outer;
    uint64_t outer_gen;
  };

  void enter_call(const char* call) {
    // Sequentially consistent with close()'s closed_.exchange: either close() sees this call in
    // flight and waits for it, or this call sees closed_ and never touches the region.
    inflight_calls_.fetch_add(1);
    thread_calls().push_back(this);
    if (closed_.load()) {
      leave_call();
      throw ClosedError(
          commkit::str("fp8_layerwise transport is closed (rank ", rank_, "); ", call, "() needs an open one"), rank_);
    }
  }

  void leave_call() noexcept {
    auto& calls = thread_calls();
    for (auto it = calls.end(); it != calls.begin();) {
      if (*--it == this) {
        calls.erase(it);
        break;
      }
    }
    inflight_calls_.fetch_sub(1);
  }

  // close(): waits until no other thread is inside a call. Returns whether no call at all is left
  // (false when the deadline expired, or when close() runs inside a call on this very thread: that
  // call still touches the region when it unwinds).
  bool wait_calls_left() noexcept {
    const auto& mine = thread_calls();
    const int64_t own = std::count(mine.begin(), mine.end(), this);
    commkit::ProgressDeadline deadline(std::min(timeout_ms_, kCloseDrainMaxMs));
    const auto left = [&] { return inflight_calls_.load() <= own; };
    const auto progress = [&] { return static_cast<uint64_t>(inflight_calls_.load()); };
    if (commkit::poll_until(left, deadline, progress, [] { return false; }) != commkit::PollResult::kReady) return false;
    return inflight_calls_.load() == 0;
  }

  void validate_call(uint64_t epoch, int64_t layer_id, int expert_count) {
    CK_CHECK_ARG(epoch != 0, "epoch 0 is reserved; epochs start at 1 and strictly increase");
    CK_CHECK_ARG(layer_id >= 0, "layer_id must be non-negative, got ", layer_id);
    CK_CHECK_ARG(expert_count >= 1 && expert_count <= num_experts_, "expert_count must be in 1..", num_experts_,
                 ", got ", expert_count);
  }

  void check_generation() const {
    CK_CHECK(ld_acquire(&c_->layer.generation) == generation_,
             "the transport was reset by another rank; call reset() on this rank too (rank ", rank_, ")");
  }

  // --- join / wait --------------------------------------------------------------------------
  void join(uint64_t epoch, int64_t layer_id, int expert_count) {
    api("join", [&] {
      validate_call(epoch, layer_id, expert_count);
      check_poison();
      check_generation();
      auto& me = c_->ranks[rank_];
      const uint64_t prev_join = ld_relaxed(&me.join_epoch);
      if (epoch <= prev_join)
        poison_and_throw(kErrProtocol, "rank " + std::to_string(rank_) + " joined epoch " + std::to_string(epoch) +
                                           ", which is not above its previous epoch " + std::to_string(prev_join));
      // Rank 0 would wait for this rank's wait(prev_join) and a peer for rank 0, which waits for it:
      // without this check the call would stall for the whole timeout, though the rank can tell now.
      if (prev_join > ld_acquire(&me.wait_returned_epoch))
        poison_and_throw(kErrProtocol, commkit::str("rank ", rank_, " joined epoch ", epoch, " without calling wait(",
                                                    prev_join, ") of its previous epoch ", prev_join, ": call wait(",
                                                    prev_join, ") before joining the next epoch"));
      if (rank_ == 0) {
        const uint64_t prev = ld_acquire(&c_->layer.active_epoch);
        if (epoch <= prev)
          poison_and_throw(kErrProtocol, "rank 0 reused or decreased epoch " + std::to_string(epoch) +
                                             " (active epoch is " + std::to_string(prev) + ")");
        if (prev != 0) {
          wait_for(
              "every rank to return from the previous layer",
              [&] {
                for (int r = 0; r < tp_; ++r)
                  if (ld_acquire(&c_->ranks[r].wait_returned_epoch) < prev) return false;
                return true;
              },
              [&] {
                uint64_t s = 0;
                for (int r = 0; r < tp_; ++r) s = s * 1000003u + ld_relaxed(&c_->ranks[r].wait_returned_epoch);
                return s;
              },
              all_mask(), true, [&] {
                Blame b;
                for (int r = 0; r < tp_; ++r) {
                  const auto& rs = c_->ranks[r];
                  if (ld_acquire(&rs.wait_returned_epoch) >= prev) continue;
                  if (b.peer < 0) b.peer = r;
                  const char* why = ld_acquire(&rs.join_epoch) < prev               ? " has not joined epoch "
                                    : ld_acquire(&rs.consumer_done_epoch) < prev ? "'s consumer has not finished epoch "
                                                                                  : " has not returned from wait() of epoch ";
                  b.text += commkit::str(b.text.empty() ? ": rank " : "; rank ", r, why, prev);
                }
                return b;
              });
        }
        std::lock_guard<std::mutex> publishing(publish_mu_);
        check_poison_or_reset();
        st_relaxed(&c_->layer.layer_id, layer_id);
        st_relaxed(&c_->layer.expert_count, static_cast<uint64_t>(expert_count));
        st_relaxed(&c_->layer.layer_start_ns, monotonic_ns());
        st_relaxed(&c_->pstats.writer_ns, uint64_t{0});
        st_relaxed(&c_->pstats.slot_wait_ns, uint64_t{0});
        st_relaxed(&c_->pstats.total_ns, uint64_t{0});
        commkit::fence_system();
        st_release(&c_->layer.active_epoch, epoch);
      } else {
        wait_for(
            "rank 0 to open the epoch",
            [&] {
              const uint64_t a = ld_acquire(&c_->layer.active_epoch);
              if (a > epoch)
                poison_and_throw(kErrProtocol, "rank " + std::to_string(rank_) + " joined epoch " +
                                                   std::to_string(epoch) + " but rank 0 already opened epoch " +
                                                   std::to_string(a));
              // Rank 0 opened an epoch between this rank's previous one and this one: this rank skipped
              // it, and rank 0 never opens the next before this rank returned from wait() of that one,
              // so waiting here could only end in the timeout.
              if (a > prev_join && a < epoch)
                poison_and_throw(kErrProtocol, commkit::str("rank ", rank_, " joined epoch ", epoch, " but rank 0 opened ",
                                                            "epoch ", a, ", which rank ", rank_, " skipped (its previous ",
                                                            "epoch was ", prev_join, "): every rank joins every epoch"));
              return a == epoch;
            },
            [&] { return ld_relaxed(&c_->layer.active_epoch); }, 1u, true, [&] {
              const uint64_t a = ld_acquire(&c_->layer.active_epoch);
              if (a == 0 || ld_acquire(&c_->ranks[0].status) != kRankAttached)
                return Blame{0, commkit::str(": rank 0 has not opened epoch ", epoch,
                                             a == 0 ? " (it has not opened any epoch yet)" : "")};
              // Rank 0 opens an epoch once every rank returned from wait() of the previous one: a rank
              // other than 0 that has not is the one holding it.
              for (int r = 1; r < tp_; ++r)
                if (ld_acquire(&c_->ranks[r].wait_returned_epoch) < a)
                  return Blame{r, commkit::str(": rank 0 has not opened epoch ", epoch, ", and rank ", r,
                                               " has not returned from wait(", a, ") of the epoch before")};
              return Blame{0, commkit::str(": rank 0 has not opened epoch ", epoch, " (its open epoch is ", a, ")")};
            });
        check_geometry();  // rank 0 is attached now (it opened the epoch); also after a reset()
        const int64_t lid = ld_relaxed(&c_->layer.layer_id);
        const uint64_t cnt = ld_relaxed(&c_->layer.expert_count);
        if (lid != layer_id || cnt != static_cast<uint64_t>(expert_count)) {
          poison_and_throw(kErrProtocol, commkit::str("rank ", rank_, " joined epoch ", epoch, " with layer_id ",
                                                      layer_id, ", expert_count ", expert_count,
                                                      " but rank 0 opened it with layer_id ", lid,
                                                      ", expert_count ", cnt));
        }
      }
      st_release(&me.join_epoch, epoch);
    });
  }

  Stats wait(uint64_t epoch) {
    return api("wait", [&] {
      CK_CHECK_ARG(epoch != 0, "epoch 0 is reserved");
      check_poison();
      auto& me = c_->ranks[rank_];
      if (ld_acquire(&me.join_epoch) != epoch)
        poison_and_throw(kErrProtocol, "rank " + std::to_string(rank_) + " called wait(" + std::to_string(epoch) +
                                           ") before joining that epoch (joined " +
                                           std::to_string(ld_relaxed(&me.join_epoch)) + ")");
      if (ld_acquire(&me.wait_returned_epoch) >= epoch)
        poison_and_throw(kErrProtocol, "rank " + std::to_string(rank_) + " called wait(" + std::to_string(epoch) +
                                           ") twice");
      // Rank 0 may wait before its run() started: the producer may run in another thread (as with the
      // seed). A run() that never comes is named when the wait expires ("rank 0 has not called run()
      // for epoch N", layer_blame), not refused here, where a producer thread about to start would
      // be indistinguishable from a forgotten run().
      wait_for(
          "this rank's copies and the producer to finish the layer",
          [&] {
            return ld_acquire(&me.consumer_done_epoch) >= epoch && ld_acquire(&c_->layer.producer_done_epoch) >= epoch;
          },
          [&] {
            return ld_relaxed(&c_->layer.next_sequence) * 31 + ld_relaxed(&me.consumer_done_epoch) * 7 +
                   ld_relaxed(&c_->layer.producer_done_epoch);
          },
          // Rank 0 only while its producer has not finished the layer: once it has, every slot was
          // acknowledged and only this rank's own consumer is left, so rank 0 closing (or exiting) after
          // its own wait() returned must not fail this one.
          [&] { return ld_acquire(&c_->layer.producer_done_epoch) >= epoch ? 0u : 1u; }, true,
          [&] { return layer_blame(epoch); });
      Stats s = fill_stats(epoch);
      st_release(&me.wait_returned_epoch, epoch);
      return s;
    });
  }

  Stats fill_stats(uint64_t epoch) const {
    Stats s;
    const auto& me = c_->ranks[rank_];
    s.epoch = epoch;
    s.layer_id = ld_relaxed(&c_->layer.layer_id);
    s.expert_count = static_cast<int>(ld_relaxed(&c_->layer.expert_count));
    s.rank = rank_;
    s.writer_ms = ms(ld_relaxed(&c_->pstats.writer_ns));
    s.slot_wait_ms = ms(ld_relaxed(&c_->pstats.slot_wait_ns));
    s.total_ms = ms(ld_relaxed(&c_->pstats.total_ns));
    s.h2d_ms = ms(ld_relaxed(&me.h2d_ns));
    s.bytes = ld_relaxed(&me.bytes);
    s.copies = ld_relaxed(&me.copies);
    s.poisoned = is_poisoned();
    if (s.poisoned) read_poison(s.error_code, s.error_rank, s.error_message, s.error_peer);
    return s;
  }

  Stats last_poison() const {
    Stats s;
    s.rank = rank_;
    s.poisoned = is_poisoned();
    if (s.poisoned) read_poison(s.error_code, s.error_rank, s.error_message, s.error_peer);
    return s;
  }

  // --- producer -----------------------------------------------------------------------------
  void wait_slot_acks(int slot, uint64_t seq) {
    wait_for(
        "every rank to acknowledge a host slot before it is rewritten",
        [&] {
          for (int r = 0; r < tp_; ++r)
            if (ld_acquire(&c_->ranks[r].ack[slot]) < seq) return false;
          return true;
        },
        [&] {
          uint64_t s = 0;
          for (int r = 0; r < tp_; ++r) s = s * 1000003u + ld_relaxed(&c_->ranks[r].ack[slot]);
          return s;
        },
        all_mask(), true, [&] {
          Blame b;
          for (int r = 0; r < tp_; ++r) {
            if (ld_acquire(&c_->ranks[r].ack[slot]) >= seq) continue;
            if (b.peer < 0) b.peer = r;
            b.text += commkit::str(b.text.empty() ? ": rank " : "; rank ", r, " has not acknowledged expert ",
                                   ld_relaxed(&c_->ready[slot].expert), " (slot ", slot, ")");
          }
          return b;
        });
  }

  template <typename WriteFn>
  void produce(uint64_t epoch, int64_t layer_id, int expert_count, WriteFn&& write) {
    api("run", [&] {
      check_poison();
      if (rank_ != 0)
        poison_and_throw(kErrProtocol,
                         "run_producer called on rank " + std::to_string(rank_) + "; only rank 0 produces");
      validate_call(epoch, layer_id, expert_count);
      const bool same_layer = ld_acquire(&c_->layer.active_epoch) == epoch &&
                              ld_relaxed(&c_->layer.layer_id) == layer_id &&
                              ld_relaxed(&c_->layer.expert_count) == static_cast<uint64_t>(expert_count) &&
                              ld_acquire(&c_->ranks[0].join_epoch) == epoch;
      if (same_layer && (ld_acquire(&c_->layer.run_epoch) == epoch || ld_acquire(&c_->layer.producer_done_epoch) >= epoch))
        poison_and_throw(kErrProtocol, commkit::str("run(epoch ", epoch, ", layer ", layer_id, ", count ", expert_count,
                                                    ") was called again: rank 0 already ",
                                                    ld_acquire(&c_->layer.producer_done_epoch) >= epoch
                                                        ? "produced this layer"
                                                        : "started producing this layer",
                                                    "; run() once per joined layer"));
      if (!same_layer || ld_acquire(&c_->layer.producer_done_epoch) >= epoch) {
        poison_and_throw(kErrProtocol, commkit::str("run_producer(epoch ", epoch, ", layer ", layer_id, ", count ",
                                                    expert_count, ") does not match the joined layer (epoch ",
                                                    ld_relaxed(&c_->layer.active_epoch), ", layer ",
                                                    ld_relaxed(&c_->layer.layer_id), ", count ",
                                                    ld_relaxed(&c_->layer.expert_count), ")",
                                                    ld_acquire(&c_->ranks[0].join_epoch) != epoch
                                                        ? commkit::str("; rank 0 joined epoch ",
                                                                       ld_relaxed(&c_->ranks[0].join_epoch))
                                                        : std::string()));
      }
      st_release(&c_->layer.run_epoch, epoch);
      const uint64_t t0 = monotonic_ns();
      wait_for(
          "every rank to join the layer",
          [&] {
            for (int r = 0; r < tp_; ++r)
              if (ld_acquire(&c_->ranks[r].join_epoch) != epoch) return false;
            return true;
          },
          [&] {
            uint64_t s = 0;
            for (int r = 0; r < tp_; ++r) s = s * 1000003u + ld_relaxed(&c_->ranks[r].join_epoch);
            return s;
          },
          all_mask(), true, [&] { return layer_blame(epoch); });
      std::array<uint64_t, kMaxSlots> published{};
      std::vector<uintptr_t> ptrs[kKinds];
      for (auto& v : ptrs) v.resize(tp_);
      uint64_t writer_ns = 0, slot_wait_ns = 0;
      for (int e = 0; e < expert_count; ++e) {
        const int slot = e % slots_;
        if (published[slot] != 0) {
          const uint64_t w0 = monotonic_ns();
          wait_slot_acks(slot, published[slot]);
          slot_wait_ns += monotonic_ns() - w0;
        }
        for (int r = 0; r < tp_; ++r)
          for (int k = 0; k < kKinds; ++k) ptrs[k][r] = all_[(static_cast<size_t>(slot) * tp_ + r) * kKinds + k];
        const uint64_t w0 = monotonic_ns();
        try {
          write(e, ptrs);
        } catch (const PoisonedError&) {
          throw;
        } catch (const std::exception& ex) {
          poison_and_throw(kErrWriter, "writer failed at expert " + std::to_string(e) + ": " + ex.what());
        } catch (...) {
          poison_and_throw(kErrWriter, "writer failed at expert " + std::to_string(e) + " (unknown exception)");
        }
        writer_ns += monotonic_ns() - w0;
        // close() may have run while the writer did (it waited for the writer to return): stop.
        if (stopping_.load(std::memory_order_acquire)) throw Stopping{};
        // Under publish_mu_, which rank 0's reset() holds while it clears the slots: a reset that
        // completed while the writer ran is seen here, and none can complete between check and publish.
        std::lock_guard<std::mutex> publishing(publish_mu_);
        check_poison_or_reset();  // a consumer may have failed meanwhile: stop publishing
        const uint64_t seq = ld_relaxed(&c_->layer.next_sequence) + 1;
        st_relaxed(&c_->layer.next_sequence, seq);
        st_relaxed(&c_->ready[slot].epoch, epoch);
        st_relaxed(&c_->ready[slot].expert, static_cast<uint64_t>(e));
        st_release(&c_->ready[slot].sequence, seq);
        published[slot] = seq;
      }
      const uint64_t w0 = monotonic_ns();
      for (int s = 0; s < slots_; ++s)
        if (published[s] != 0) wait_slot_acks(s, published[s]);
      slot_wait_ns += monotonic_ns() - w0;
      std::lock_guard<std::mutex> publishing(publish_mu_);
      check_poison_or_reset();
      st_relaxed(&c_->pstats.writer_ns, writer_ns);
      st_relaxed(&c_->pstats.slot_wait_ns, slot_wait_ns);
      st_relaxed(&c_->pstats.total_ns, monotonic_ns() - t0);
      commkit::fence_system();
      st_release(&c_->layer.producer_done_epoch, epoch);
    });
  }

  // --- consumer thread ----------------------------------------------------------------------
  void consumer_main() noexcept {
    try {
      backend_ = opt_.backend == "cuda" ? make_cuda_backend(device_, slots_, opt_.copy_streams) : make_cpu_backend(slots_);
      for (int k = 0; k < kKinds; ++k)
        if (opt_.batch_small_kinds && nb_[k] <= kBatchedKindMaxBytes)
          staging_[k] = static_cast<char*>(backend_->alloc_host(nb_[k] * static_cast<uint64_t>(num_experts_)));
    } catch (const std::exception& e) {
      free_staging();
      std::lock_guard<std::mutex> g(init_mu_);
      init_error_ = e.what();
      init_done_ = true;
      init_cv_.notify_all();
      return;
    }
    uint64_t gen = ld_acquire(&c_->layer.generation);
    for (int s = 0; s < slots_; ++s) last_seq_[s] = ld_acquire(&c_->ready[s].sequence);
    uint64_t completed = ld_acquire(&c_->ranks[rank_].consumer_done_epoch);
    {
      std::lock_guard<std::mutex> g(init_mu_);
      init_done_ = true;
      init_cv_.notify_all();
    }
    auto& me = c_->ranks[rank_];
    commkit::Backoff idle;
    while (!stopping_.load(std::memory_order_acquire)) {
      try {
        if (is_poisoned()) {
          park(gen, completed);
          idle.reset();
          continue;
        }
        const uint64_t epoch = ld_acquire(&c_->layer.active_epoch);
        if (epoch == 0 || epoch <= completed || ld_acquire(&me.join_epoch) != epoch) {
          idle.pause();
          continue;
        }
        run_layer(epoch);
        completed = epoch;
        idle.reset();
      } catch (const Stopping&) {
        break;
      } catch (const PoisonedError&) {
        // already recorded; park on the next iteration
      } catch (const std::exception& e) {
        publish_poison(kErrCopy, rank_,
                       std::string("consumer copy failed: ") + e.what());
      }
    }
    backend_->drain();
    free_staging();
    backend_.reset();
  }
  void free_staging() noexcept {
    for (auto& p : staging_) {
      if (p != nullptr && backend_) backend_->free_host(p);
      p = nullptr;
    }
  }

  // After a poison: finish in-flight copies (so nothing lands after a reset), report parked,
  // and sleep until a reset publishes a new generation.
  void park(uint64_t& gen, uint64_t& completed) {
    backend_->drain();
    inflight_.clear();
    auto& me = c_->ranks[rank_];
    st_release(&me.consumer_parked, gen + 1);
    while (ld_acquire(&c_->layer.generation) == gen) {
      if (stopping_.load(std::memory_order_acquire)) throw Stopping{};
      timespec ts{0, 200000};
      nanosleep(&ts, nullptr);
    }
    gen = ld_acquire(&c_->layer.generation);
    // Reset zeroed every sequence; rank 0 may already be publishing the next layer, so do not
    // re-read the slots here (that would swallow an expert published before we woke up).
    last_seq_.fill(0);
    completed = ld_acquire(&me.consumer_done_epoch);
  }

  struct Inflight {
    int first_slot;
    int count;
    std::array<uint64_t, kMaxSlots> seqs;
  };

  bool slot_ready(int slot, uint64_t epoch, int expert, uint64_t& seq) const {
    const uint64_t s = ld_acquire(&c_->ready[slot].sequence);
    if (s == last_seq_[slot]) return false;
    if (ld_relaxed(&c_->ready[slot].epoch) != epoch || ld_relaxed(&c_->ready[slot].expert) != static_cast<uint64_t>(expert))
      return false;
    seq = s;
    return true;
  }

  void run_layer(uint64_t epoch) {
    auto& me = c_->ranks[rank_];
    const int n = static_cast<int>(ld_relaxed(&c_->layer.expert_count));
    if (n <= 0 || n > num_experts_)
      poison_and_throw(kErrProtocol, "consumer saw expert_count " + std::to_string(n) + " outside 1.." +
                                         std::to_string(num_experts_));
    uint64_t h2d_ns = 0, bytes = 0, copies = 0;
    int next_issue = 0, next_done = 0;
    inflight_.clear();
    std::vector<CopyOp> ops;
    ops.reserve(kKinds * kMaxSlots);
    commkit::ProgressDeadline deadline(timeout_ms_);
    // Yield for up to 200 us since the last progress (a copy of a few MB takes ~100 us), then sleep.
    commkit::Backoff backoff;
    uint64_t next_live = next_liveness_check();
    // Keep at least two batches in flight when the window allows it, so the copy engine always
    // has queued work while the oldest batch is being acknowledged and its slot refilled.
    const int max_batch = std::max(1, opt_.max_inflight / 2);
    while (next_done < n) {
      bool progressed = false;
      // Issue every ready expert we may, merging runs of consecutive slots.
      while (next_issue < n && next_issue - next_done < opt_.max_inflight) {
        Inflight run{};
        run.first_slot = next_issue % slots_;
        const int budget =
            std::min({opt_.max_inflight - (next_issue - next_done), n - next_issue, max_batch});
        while (run.count < budget && run.first_slot + run.count < slots_) {
          uint64_t seq;
          if (!slot_ready(run.first_slot + run.count, epoch, next_issue + run.count, seq)) break;
          run.seqs[run.count++] = seq;
        }
        if (run.count == 0) break;
        // coalesce_wait: while a batch is still queued on the copy engine, a short run waits for the
        // slots after it, since a longer run is fewer, larger copies (each copy costs ~2.5 us of
        // engine time whatever its size; a TP8-sized expert has two scale copies < 1 KB). Issued at
        // once when nothing is queued, at the end of the layer or of the slot ring.
        if (opt_.coalesce && opt_.coalesce_wait && !inflight_.empty() && run.count < budget &&
            next_issue + run.count < n && run.first_slot + run.count < slots_)
          break;
        ops.clear();
        for (int k = 0; k < kKinds; ++k) {
          if (staging_[k] != nullptr) {
            // A batched small kind: out of the slots now (they are acked when this batch lands),
            // onto the GPU with the layer's last batch.
            for (int i = 0; i < run.count; ++i)
              std::memcpy(staging_[k] + static_cast<uint64_t>(next_issue + i) * nb_[k],
                          reinterpret_cast<const void*>(host_[(run.first_slot + i) * kKinds + k]), nb_[k]);
            if (next_issue + run.count == n)
              ops.push_back({reinterpret_cast<void*>(dst_[k]), staging_[k], static_cast<size_t>(n) * nb_[k]});
            continue;
          }
          auto* dst = reinterpret_cast<char*>(dst_[k] + static_cast<uint64_t>(next_issue) * nb_[k]);
          int i = 0;
          while (i < run.count) {
            // Extend while the next slot's host buffer directly follows this one.
            int j = i + 1;
            const uintptr_t src0 = host_[(run.first_slot + i) * kKinds + k];
            while (opt_.coalesce && j < run.count &&
                   host_[(run.first_slot + j) * kKinds + k] == src0 + static_cast<uint64_t>(j - i) * nb_[k])
              ++j;
            ops.push_back({dst + static_cast<uint64_t>(i) * nb_[k], reinterpret_cast<const void*>(src0),
                           static_cast<size_t>(j - i) * nb_[k]});
            i = j;
          }
        }
        backend_->submit(ops, run.first_slot + run.count - 1);
        copies += ops.size();
        next_issue += run.count;
        inflight_.push_back(run);
        progressed = true;
      }
      // Retire finished batches in order and ack their slots.
      while (!inflight_.empty() && backend_->poll(inflight_.front().first_slot + inflight_.front().count - 1)) {
        const Inflight& run = inflight_.front();
        h2d_ns += backend_->busy_ns(run.first_slot + run.count - 1);
        for (int i = 0; i < run.count; ++i) {
          const int slot = run.first_slot + i;
          last_seq_[slot] = run.seqs[i];
          st_release(&me.ack[slot], run.seqs[i]);
        }
        for (int k = 0; k < kKinds; ++k) bytes += nb_[k] * static_cast<uint64_t>(run.count);
        next_done += run.count;
        inflight_.pop_front();
        progressed = true;
      }
      if (progressed) {
        backoff.reset();
        continue;
      }
      check_poison();
      if (stopping_.load(std::memory_order_acquire)) throw Stopping{};
      if (ld_acquire(&c_->layer.active_epoch) != epoch)
        poison_and_throw(kErrProtocol, "rank 0 opened a new epoch before rank " + std::to_string(rank_) +
                                           " finished copying epoch " + std::to_string(epoch));
      const uint64_t progress = ld_relaxed(&c_->layer.next_sequence) * 1000003u + static_cast<uint64_t>(next_done);
      if (deadline.expired(progress)) {
        const Blame b = layer_blame(epoch);
        poison_and_throw(kErrTimeout,
                         commkit::str("rank ", rank_, "'s consumer timed out after ", timeout_ms_,
                                      " ms without progress waiting for expert ", next_issue, " of epoch ", epoch, b.text),
                         b.peer);
      }
      if (monotonic_ns() >= next_live && ld_acquire(&c_->layer.producer_done_epoch) < epoch) {
        check_peers(1u, "the producer to publish an expert");
        next_live = next_liveness_check();
      }
      backoff.pause();
    }
    st_relaxed(&me.h2d_ns, h2d_ns);
    st_relaxed(&me.bytes, bytes);
    st_relaxed(&me.copies, copies);
    commkit::fence_system();
    st_release(&me.consumer_done_epoch, epoch);
  }

  // --- close / reset ------------------------------------------------------------------------
  bool close() noexcept {
    // Serialised: a second caller returns only once the first finished, so the owner can unmap
    // the region as soon as its own close() returned. Except a close() from inside one of this
    // transport's own calls (the writer callback) while another thread is closing: that closer
    // waits for this very call to leave, so waiting for it here would hold both until the drain
    // deadline. It returns false at once (the mapping must stay) and the call then leaves.
    const auto& calls = thread_calls();
    const bool inside_call = std::find(calls.begin(), calls.end(), this) != calls.end();
    std::unique_lock<std::mutex> guard(close_mu_, std::defer_lock);
    if (!inside_call) {
      guard.lock();
    } else if (!guard.try_lock()) {
      stopping_.store(true, std::memory_order_release);
      return false;
    }
    if (closed_.exchange(true)) return drained_;  // from here on no new call enters (enter_call)
    auto& me = c_->ranks[rank_];
    // Before the poison below: a call blocked in this process sees stopping_ (or our own
    // CLOSED_WHILE_ACTIVE) and raises ClosedError.
    stopping_.store(true, std::memory_order_release);
    const uint64_t active = ld_acquire(&c_->layer.active_epoch);
    if (active != 0 && ld_acquire(&me.join_epoch) == active && ld_acquire(&me.consumer_done_epoch) < active &&
        !is_poisoned()) {
      publish_poison(kErrClosedWhileActive, rank_,
                     "rank " + std::to_string(rank_) + " closed its transport while epoch " + std::to_string(active) +
                         " was active");
    }
    drained_ = wait_calls_left();
    if (worker_.joinable()) worker_.join();
    {
      // The owner may unmap the region right after close(): keep what accessors still report.
      std::lock_guard<std::mutex> g(final_mu_);
      final_poison_ = last_poison();
      final_ready_ = true;
    }
    st_release(&me.status, static_cast<uint64_t>(kRankClosed));
    return drained_;
  }

  // The poison record as the accessors report it: the live one until close() finished, then the
  // copy close() kept. Holding final_mu_ keeps close() from finishing (and the owner from
  // unmapping the region) while the live record is read.
  Stats poison_snapshot() const {
    std::lock_guard<std::mutex> g(final_mu_);
    return final_ready_ ? final_poison_ : last_poison();
  }

  // "rank 1 has not called reset(); rank 2's consumer has not drained": who rank 0's reset waits for.
  Blame reset_missing(uint64_t gen) const {
    Blame b;
    for (int r = 0; r < tp_; ++r) {
      const char* why = ld_acquire(&c_->ranks[r].reset_request) != gen + 1    ? " has not called reset()"
                        : ld_acquire(&c_->ranks[r].consumer_parked) != gen + 1 ? "'s consumer has not drained"
                                                                                : nullptr;
      if (why == nullptr) continue;
      if (b.peer < 0) b.peer = r;
      b.text += commkit::str(b.text.empty() ? ": rank " : "; rank ", r, why);
    }
    return b;
  }

  uint64_t reset() {
    return api("reset", [&] {
      const uint64_t gen = ld_acquire(&c_->layer.generation);
      if (!is_poisoned()) publish_poison(kErrUser, rank_, "reset requested by rank " + std::to_string(rank_));
      auto& me = c_->ranks[rank_];
      st_release(&me.reset_request, gen + 1);
      if (rank_ == 0) {
        wait_for(
            "every rank to call reset() and drain its copies",
            [&] {
              for (int r = 0; r < tp_; ++r)
                if (ld_acquire(&c_->ranks[r].reset_request) != gen + 1 ||
                    ld_acquire(&c_->ranks[r].consumer_parked) != gen + 1)
                  return false;
              return true;
            },
            [&] {
              uint64_t s = 0;
              for (int r = 0; r < tp_; ++r)
                s = s * 1000003u + ld_relaxed(&c_->ranks[r].reset_request) * 7 + ld_relaxed(&c_->ranks[r].consumer_parked);
              return s;
            },
            // A rank that died or closed can never call reset(): report it now, not at the timeout.
            all_mask(), /*honor_poison=*/false, [&] { return reset_missing(gen); });
        std::lock_guard<std::mutex> publishing(publish_mu_);
        const uint64_t active = ld_relaxed(&c_->layer.active_epoch);
        for (int s = 0; s < kMaxSlots; ++s) {
          st_relaxed(&c_->ready[s].sequence, uint64_t{0});
          st_relaxed(&c_->ready[s].epoch, uint64_t{0});
          st_relaxed(&c_->ready[s].expert, uint64_t{0});
        }
        st_relaxed(&c_->layer.next_sequence, uint64_t{0});
        st_relaxed(&c_->layer.producer_done_epoch, active);
        for (int r = 0; r < tp_; ++r) {
          auto& rs = c_->ranks[r];
          st_relaxed(&rs.departed_blame, uint64_t{0});
          for (int s = 0; s < kMaxSlots; ++s) st_relaxed(&rs.ack[s], uint64_t{0});
          st_relaxed(&rs.join_epoch, std::max(active, ld_relaxed(&rs.join_epoch)));
          st_relaxed(&rs.consumer_done_epoch, active);
          st_relaxed(&rs.wait_returned_epoch, active);
        }
        st_relaxed(&c_->poison.code, uint64_t{0});
        st_relaxed(&c_->poison.rank, int64_t{-1});
        st_relaxed(&c_->poison.peer, uint64_t{0});
        c_->poison.message[0] = '\0';
        commkit::fence_system();
        st_release(&c_->poison.state, uint64_t{0});
        st_release(&c_->layer.generation, gen + 1);
      } else {
        wait_for(
            "rank 0 to finish the reset", [&] { return ld_acquire(&c_->layer.generation) != gen; },
            // Any dead rank, not only rank 0: rank 0's reset cannot finish without it either.
            [&] { return ld_relaxed(&c_->ranks[0].reset_request); }, all_mask(), /*honor_poison=*/false, [&] {
              if (ld_acquire(&c_->ranks[0].reset_request) != gen + 1) return Blame{0, ": rank 0 has not called reset()"};
              Blame b = reset_missing(gen);  // rank 0 waits for these
              if (b.peer < 0) return Blame{0, ": rank 0 has not finished the reset"};
              b.text = ": rank 0 is waiting for the other ranks' reset()" + b.text;
              b.text.replace(b.text.find(": rank ", 2), 2, " (");
              b.text += ")";
              return b;
            });
      }
      generation_ = gen + 1;
      return generation_;
    });
  }

  bool poison(int code, const std::string& msg) {
    return api("poison", [&] {
      CK_CHECK_ARG(code > 0, "poison code must be positive");
      return publish_poison(code, rank_, msg);
    });
  }

  Control* c_ = nullptr;
  Options opt_;
  int rank_ = 0, tp_ = 1, slots_ = 2, num_experts_ = 1, device_ = -1;
  uint64_t timeout_ms_ = 60000;
  uint64_t generation_ = 0;
  std::array<uintptr_t, kMaxSlots * kKinds> host_{};
  std::array<uintptr_t, kKinds> dst_{};
  std::array<uint64_t, kKinds> nb_{};
  std::vector<uintptr_t> all_;
  std::array<uint64_t, kMaxSlots> last_seq_{};
  std::deque<Inflight> inflight_;
  std::unique_ptr<CopyBackend> backend_;
  std::array<char*, kKinds> staging_{};  // batch_small_kinds: [expert][nb_[k]] page-locked, or null
  std::atomic<bool> stopping_{false}, closed_{false};
  std::atomic<int64_t> inflight_calls_{0};  // public calls of any thread inside api() right now
  bool drained_ = true;                     // what close() returned (under close_mu_)
  std::thread worker_;
  std::mutex init_mu_;
  std::condition_variable init_cv_;
  bool init_done_ = false;
  std::string init_error_;
  Stats final_poison_;
  bool final_ready_ = false;  // final_poison_ is set: the region may be gone (under final_mu_)
  mutable std::mutex final_mu_;
  std::mutex close_mu_;
  // Rank 0: held while a call publishes layer state (join's open, run's slots and done epoch) and
  // while reset() clears it, so a reset never interleaves with a publication of the old generation.
  std::mutex publish_mu_;
};

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
void Transport::run_producer(uint64_t epoch, int64_t layer_id, int expert_count, const Writer& writer) {
  CK_CHECK_ARG(static_cast<bool>(writer), "writer is empty");
  impl_->produce(epoch, layer_id, expert_count, [&](int e, const std::vector<uintptr_t>* p) {
    writer(e, p[0], p[1], p[2], p[3]);
  });
}
void Transport::run_producer_native(uint64_t epoch, int64_t layer_id, int expert_count, const ShardWriter& writer) {
  CK_CHECK_ARG(writer.kinds().size() == kKinds, "a ShardWriter needs 4 kinds");
  for (int k = 0; k < kKinds; ++k)
    CK_CHECK_ARG(writer.kinds()[k].shard_bytes() == impl_->nb_[k], "ShardWriter kind ", k, " shard is ",
                 writer.kinds()[k].shard_bytes(), " bytes but expert_nbytes[", k, "] is ", impl_->nb_[k]);
  writer.check_ranks(static_cast<size_t>(impl_->tp_));
  CK_CHECK_ARG(writer.tp_size() == 0 || writer.tp_size() == impl_->tp_, "the ShardWriter was cut for tp_size ",
               writer.tp_size(), " but the transport has ", impl_->tp_, " ranks: each rank would get its slice of a ",
               "layer cut for ", writer.tp_size(), " ranks (pass the transport's tp_size to make_shard_writer)");
  // Experts 0..expert_count-1 are read from the writer's sources: they must hold that many.
  CK_CHECK_ARG(expert_count <= writer.num_experts(), "expert_count ", expert_count,
               " exceeds the experts of the ShardWriter's source tensors (", writer.num_experts(), ")");
  impl_->produce(epoch, layer_id, expert_count, [&](int e, const std::vector<uintptr_t>* p) {
    const std::vector<uintptr_t>* d[kKinds] = {&p[0], &p[1], &p[2], &p[3]};
    writer.write(e, d);
  });
}
bool Transport::close() noexcept { return impl_->close(); }
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
