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

// /proc/<pid>/stat start time (field 22); 0 when the process is gone or a zombie.
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
    default: return "unknown";
  }
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
  return c;
}

}  // namespace

size_t control_bytes() { return kControlBytes; }
size_t control_struct_bytes() { return sizeof(Control); }

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
    CK_CHECK_ARG(ld_acquire(&me.status) != kRankAttached || live_start_time(ld_relaxed(&me.pid)) == 0 ||
                     ld_relaxed(&me.pid) == static_cast<uint64_t>(::getpid()),
                 "rank ", rank_, " is already attached by live process ", ld_relaxed(&me.pid));
    generation_ = ld_acquire(&c_->layer.generation);
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

  // --- poison -------------------------------------------------------------------------------
  bool publish_poison(int code, int rank, const std::string& msg) noexcept {
    if (cas(&c_->poison.state, uint64_t{0}, kPoisonClaimed) != 0) return false;
    st_relaxed(&c_->poison.claim_ns, monotonic_ns());
    st_relaxed(&c_->poison.code, static_cast<uint64_t>(code));
    st_relaxed(&c_->poison.rank, static_cast<int64_t>(rank));
    st_relaxed(&c_->poison.generation, ld_relaxed(&c_->layer.generation));
    std::snprintf(c_->poison.message, sizeof(c_->poison.message), "%s", msg.c_str());
    commkit::fence_system();
    st_release(&c_->poison.state, uint64_t{1});
    return true;
  }

  bool is_poisoned() const { return ld_acquire(&c_->poison.state) != 0; }

  // Reads the record, giving a claimer 10 ms to finish publishing it.
  void read_poison(int& code, int& rank, std::string& msg) const {
    const uint64_t until = monotonic_ns() + 10000000ull;
    while (ld_acquire(&c_->poison.state) == kPoisonClaimed && monotonic_ns() < until) sched_yield();
    if (ld_acquire(&c_->poison.state) == kPoisonClaimed) {
      code = static_cast<int>(ld_relaxed(&c_->poison.code));
      rank = -1;
      msg = "poison publication did not complete (the claiming process may have died)";
      return;
    }
    code = static_cast<int>(ld_relaxed(&c_->poison.code));
    rank = static_cast<int>(ld_relaxed(&c_->poison.rank));
    char buf[sizeof(c_->poison.message)];
    std::memcpy(buf, c_->poison.message, sizeof(buf));
    buf[sizeof(buf) - 1] = '\0';
    msg = buf;
  }

  [[noreturn]] void raise_poison() const {
    int code, rank;
    std::string msg;
    read_poison(code, rank, msg);
    throw PoisonedError(commkit::str("fp8_layerwise transport poisoned (code ", code, " ", code_name(code), ", rank ",
                                     rank, "): ", msg, " [raised on rank ", rank_, "]"),
                        code, rank, msg);
  }

  void check_poison() const {
    if (is_poisoned()) raise_poison();
  }

  [[noreturn]] void poison_and_throw(int code, const std::string& msg) {
    publish_poison(code, rank_, msg);
    raise_poison();
  }

  // --- liveness -----------------------------------------------------------------------------
  // Poisons (peer-dead) if a rank in `mask` closed or its process is gone.
  void check_peers(uint32_t mask, const char* what) {
    for (int r = 0; r < tp_; ++r) {
      if (r == rank_ || !(mask & (1u << r))) continue;
      const auto& rs = c_->ranks[r];
      const uint64_t status = ld_acquire(&rs.status);
      if (status == kRankClosed) {
        publish_poison(kErrPeerDead, r,
                       commkit::str("rank ", r, " closed its transport while rank ", rank_, " was waiting for ", what));
        raise_poison();
      }
      if (status != kRankAttached) continue;  // not attached yet: only the deadline applies
      const uint64_t pid = ld_relaxed(&rs.pid);
      const uint64_t start = live_start_time(pid);
      if (start == 0 || (ld_relaxed(&rs.pid_start) != 0 && start != ld_relaxed(&rs.pid_start))) {
        publish_poison(kErrPeerDead, r,
                       commkit::str("rank ", r, " (pid ", pid, ") died while rank ", rank_, " was waiting for ", what));
        raise_poison();
      }
    }
  }

  uint32_t all_mask() const { return (1u << tp_) - 1u; }

  // Waits for pred(); poison, close, dead peers (mask) and a stalled deadline all throw. The checks
  // that end a wait early throw from inside the poll, so it never reports kAborted.
  template <typename Pred, typename Progress>
  void wait_for(const char* what, Pred&& pred, Progress&& progress, uint32_t mask, bool honor_poison = true) {
    commkit::ProgressDeadline deadline(timeout_ms_);
    uint64_t next_live = monotonic_ns() + opt_.liveness_ms * 1000000ull;
    auto interrupted = [&] {
      if (honor_poison) check_poison();
      if (stopping_.load(std::memory_order_acquire)) throw Stopping{};
      if (mask != 0 && monotonic_ns() >= next_live) {
        check_peers(mask, what);
        next_live = monotonic_ns() + opt_.liveness_ms * 1000000ull;
      }
      return false;
    };
    // The default backoff yields for 200 us since the last progress (a copy of a few MB takes
    // ~100 us), then sleeps.
    if (commkit::poll_until(pred, deadline, [&] { return static_cast<uint64_t>(progress()); }, interrupted) ==
        commkit::PollResult::kExpired) {
      if (!honor_poison) CK_THROW_TIMEOUT(what, rank_, -1, 1, 0, " after ", timeout_ms_, " ms without progress");
      poison_and_throw(kErrTimeout,
                       commkit::str("timed out after ", timeout_ms_, " ms without progress waiting for ", what));
    }
    if (honor_poison) check_poison();
  }

  template <typename F>
  auto api(F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const Stopping&) {
      CK_THROW("fp8_layerwise transport was closed while rank ", rank_, " was blocked in a call");
    }
  }

  void ensure_open() const { CK_CHECK(!closed_.load(), "fp8_layerwise transport is closed (rank ", rank_, ")"); }

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
    ensure_open();
    validate_call(epoch, layer_id, expert_count);
    check_poison();
    check_generation();
    auto& me = c_->ranks[rank_];
    if (epoch <= ld_relaxed(&me.join_epoch))
      poison_and_throw(kErrProtocol, "rank " + std::to_string(rank_) + " joined epoch " + std::to_string(epoch) +
                                         ", which is not above its previous epoch " +
                                         std::to_string(ld_relaxed(&me.join_epoch)));
    api([&] {
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
              all_mask());
        }
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
              return a == epoch;
            },
            [&] { return ld_relaxed(&c_->layer.active_epoch); }, 1u);
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
    ensure_open();
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
    return api([&] {
      wait_for(
          "this rank's copies and the producer to finish the layer",
          [&] {
            return ld_acquire(&me.consumer_done_epoch) >= epoch && ld_acquire(&c_->layer.producer_done_epoch) >= epoch;
          },
          [&] {
            return ld_relaxed(&c_->layer.next_sequence) * 31 + ld_relaxed(&me.consumer_done_epoch) * 7 +
                   ld_relaxed(&c_->layer.producer_done_epoch);
          },
          ld_acquire(&c_->layer.producer_done_epoch) >= epoch ? 0u : 1u);
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
    if (s.poisoned) read_poison(s.error_code, s.error_rank, s.error_message);
    return s;
  }

  Stats last_poison() const {
    Stats s;
    s.rank = rank_;
    s.poisoned = is_poisoned();
    if (s.poisoned) read_poison(s.error_code, s.error_rank, s.error_message);
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
        all_mask());
  }

  template <typename WriteFn>
  void produce(uint64_t epoch, int64_t layer_id, int expert_count, WriteFn&& write) {
    ensure_open();
    check_poison();
    if (rank_ != 0)
      poison_and_throw(kErrProtocol, "run_producer called on rank " + std::to_string(rank_) + "; only rank 0 produces");
    validate_call(epoch, layer_id, expert_count);
    if (ld_acquire(&c_->layer.active_epoch) != epoch || ld_relaxed(&c_->layer.layer_id) != layer_id ||
        ld_relaxed(&c_->layer.expert_count) != static_cast<uint64_t>(expert_count) ||
        ld_acquire(&c_->ranks[0].join_epoch) != epoch || ld_acquire(&c_->layer.producer_done_epoch) >= epoch) {
      poison_and_throw(kErrProtocol, commkit::str("run_producer(epoch ", epoch, ", layer ", layer_id, ", count ",
                                                  expert_count, ") does not match the joined layer (epoch ",
                                                  ld_relaxed(&c_->layer.active_epoch), ", layer ",
                                                  ld_relaxed(&c_->layer.layer_id), ", count ",
                                                  ld_relaxed(&c_->layer.expert_count), ")"));
    }
    api([&] {
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
          all_mask());
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
        check_poison();  // a consumer may have failed meanwhile: stop publishing
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
    uint64_t next_live = monotonic_ns() + opt_.liveness_ms * 1000000ull;
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
        poison_and_throw(kErrTimeout, "rank " + std::to_string(rank_) + " consumer timed out after " +
                                          std::to_string(timeout_ms_) + " ms without progress waiting for expert " +
                                          std::to_string(next_issue) + " of epoch " + std::to_string(epoch));
      }
      if (monotonic_ns() >= next_live && ld_acquire(&c_->layer.producer_done_epoch) < epoch) {
        check_peers(1u, "the producer to publish an expert");
        next_live = monotonic_ns() + opt_.liveness_ms * 1000000ull;
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
  void close() noexcept {
    // Serialised: a second caller returns only once the first finished, so the owner can unmap
    // the region as soon as its own close() returned.
    std::lock_guard<std::mutex> guard(close_mu_);
    if (closed_.exchange(true)) return;
    auto& me = c_->ranks[rank_];
    const uint64_t active = ld_acquire(&c_->layer.active_epoch);
    if (active != 0 && ld_acquire(&me.join_epoch) == active && ld_acquire(&me.consumer_done_epoch) < active &&
        !is_poisoned()) {
      publish_poison(kErrClosedWhileActive, rank_,
                     "rank " + std::to_string(rank_) + " closed its transport while epoch " + std::to_string(active) +
                         " was active");
    }
    stopping_.store(true, std::memory_order_release);
    if (worker_.joinable()) worker_.join();
    // The owner may unmap the region right after close(): keep what accessors still report.
    final_poison_ = last_poison();
    st_release(&me.status, static_cast<uint64_t>(kRankClosed));
  }

  uint64_t reset() {
    ensure_open();
    const uint64_t gen = ld_acquire(&c_->layer.generation);
    if (!is_poisoned()) publish_poison(kErrUser, rank_, "reset requested by rank " + std::to_string(rank_));
    auto& me = c_->ranks[rank_];
    st_release(&me.reset_request, gen + 1);
    return api([&] {
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
            0u, /*honor_poison=*/false);
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
          for (int s = 0; s < kMaxSlots; ++s) st_relaxed(&rs.ack[s], uint64_t{0});
          st_relaxed(&rs.join_epoch, std::max(active, ld_relaxed(&rs.join_epoch)));
          st_relaxed(&rs.consumer_done_epoch, active);
          st_relaxed(&rs.wait_returned_epoch, active);
        }
        st_relaxed(&c_->poison.code, uint64_t{0});
        st_relaxed(&c_->poison.rank, int64_t{-1});
        c_->poison.message[0] = '\0';
        commkit::fence_system();
        st_release(&c_->poison.state, uint64_t{0});
        st_release(&c_->layer.generation, gen + 1);
      } else {
        wait_for(
            "rank 0 to finish the reset", [&] { return ld_acquire(&c_->layer.generation) != gen; },
            [&] { return ld_relaxed(&c_->ranks[0].reset_request); }, 1u, /*honor_poison=*/false);
      }
      generation_ = gen + 1;
      return generation_;
    });
  }

  bool poison(int code, const std::string& msg) {
    ensure_open();
    CK_CHECK_ARG(code > 0, "poison code must be positive");
    return publish_poison(code, rank_, msg);
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
  std::thread worker_;
  std::mutex init_mu_;
  std::condition_variable init_cv_;
  bool init_done_ = false;
  std::string init_error_;
  Stats final_poison_;
  std::mutex close_mu_;
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
  impl_->produce(epoch, layer_id, expert_count, [&](int e, const std::vector<uintptr_t>* p) {
    const std::vector<uintptr_t>* d[kKinds] = {&p[0], &p[1], &p[2], &p[3]};
    writer.write(e, d);
  });
}
void Transport::close() noexcept { impl_->close(); }
uint64_t Transport::reset() { return impl_->reset(); }
bool Transport::poison(int code, const std::string& message) { return impl_->poison(code, message); }
bool Transport::poisoned() const { return closed() ? impl_->final_poison_.poisoned : impl_->is_poisoned(); }
Stats Transport::last_poison() const { return closed() ? impl_->final_poison_ : impl_->last_poison(); }
int Transport::rank() const { return impl_->rank_; }
int Transport::tp_size() const { return impl_->tp_; }
int Transport::num_slots() const { return impl_->slots_; }
int Transport::num_experts() const { return impl_->num_experts_; }
bool Transport::closed() const { return impl_->closed_.load(); }
uint64_t Transport::generation() const { return impl_->generation_; }
std::string Transport::backend() const { return impl_->opt_.backend; }

}  // namespace fp8lw
