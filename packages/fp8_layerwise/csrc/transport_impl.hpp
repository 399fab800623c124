// transport_impl.hpp -- Transport::Impl: the state of one rank's transport, and its members by concern.
//
// Internal to the transport's sources (host code, torch-free). The members are defined in:
//   transport.cpp           attaching to the control region (the constructor), the public Transport
//   transport_join.cpp      join / wait / their stats, and who a layer is waiting for
//   transport_producer.cpp  rank 0's producer (run) and its wait for the slots' acknowledgements
//   transport_consumer.cpp  the consumer thread: copies published slots, acknowledges them, parks
//   transport_poison.cpp    the poison record, the peers' liveness, interruption (Ctrl-C)
//   transport_calls.cpp     public calls in flight, close() and reset()
// The protocol's invariants are listed at the top of transport.cpp. The templates every concern
// uses (api() around each public call, wait_for() for each blocking wait) are defined here.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "commkit/atomics.hpp"
#include "commkit/deadline.hpp"
#include "control.hpp"
#include "transport.hpp"

namespace fp8lw {

class Transport::Impl {
 public:
  Impl(uintptr_t control_ptr, size_t control_size, int rank, int tp, int device,
       const std::vector<uintptr_t>& host, const std::vector<uintptr_t>& dst,
       const std::vector<uintptr_t>& all, const std::vector<size_t>& nbytes, int num_experts,
       uint64_t timeout_ms, const Options& opt);
  ~Impl() { close(); }

  struct Stopping {};  // thrown inside waits when close() runs concurrently

  // Who a wait is blocked on: the rank (-1: unknown) and "; rank 1 has not ..." for the message.
  struct Blame {
    int peer = -1;
    std::string text;
  };

  // One batch of consecutive slots a consumer has on the copy engine.
  struct Inflight {
    int first_slot;
    int count;
    std::array<uint64_t, kMaxSlots> seqs;
  };

  // --- attach (transport.cpp) -----------------------------------------------------------------
  std::string geometry_mismatch(int r) const;
  void check_geometry();

  // --- poison, liveness, interruption (transport_poison.cpp) ----------------------------------
  bool publish_poison(int code, int rank, const std::string& msg, int peer = -1) noexcept;
  bool is_poisoned() const { return commkit::ld_acquire(&c_->poison.state) != 0; }
  void read_poison(int& code, int& rank, std::string& msg, int& peer) const;
  [[noreturn]] void raise_poison() const;
  void check_poison() const {
    if (is_poisoned()) raise_poison();
  }
  [[noreturn]] void poison_and_throw(int code, const std::string& msg, int peer = -1);
  bool poison(int code, const std::string& msg);
  Stats last_poison() const;
  Stats poison_snapshot() const;
  void check_peers(uint32_t mask, const char* what, bool record = true);
  [[noreturn]] void departed(int r, const std::string& how, const char* what, bool record);
  [[noreturn]] void peer_dead(int r, const std::string& msg, bool record);
  uint64_t next_liveness_check() const;
  uint32_t all_mask() const { return (1u << tp_) - 1u; }
  uint64_t next_interrupt_check() const;
  void check_interrupt(const char* what);

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
      const uint64_t now = commkit::monotonic_ns();
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

  // --- calls in flight, close, reset (transport_calls.cpp) ------------------------------------
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
  [[noreturn]] void throw_closed_while_blocked(const char* call) const;
  static std::vector<const Impl*>& thread_calls();
  static uint64_t& call_generation_slot();
  static const char*& current_call_slot();
  static const char* current_call();

  struct CallGuard {
    CallGuard(Impl* impl, const char* call)
        : impl(impl), outer(current_call_slot()), outer_gen(call_generation_slot()) {
      impl->enter_call(call);
      current_call_slot() = call;
      call_generation_slot() = commkit::ld_acquire(&impl->c_->layer.generation);
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

  void enter_call(const char* call);
  void leave_call() noexcept;
  bool wait_calls_left() noexcept;
  void validate_call(uint64_t epoch, int64_t layer_id, int expert_count);
  void check_generation() const;
  void check_poison_or_reset() const;
  void check_not_reset() const;
  bool close() noexcept;
  Blame reset_missing(uint64_t gen) const;
  uint64_t reset();

  // --- join / wait (transport_join.cpp) -------------------------------------------------------
  void join(uint64_t epoch, int64_t layer_id, int expert_count);
  Stats wait(uint64_t epoch);
  Stats fill_stats(uint64_t epoch) const;
  Blame layer_blame(uint64_t epoch) const;

  // --- producer, rank 0 (transport_producer.cpp) ----------------------------------------------
  void wait_slot_acks(int slot, uint64_t seq);
  template <typename WriteFn>
  void produce(uint64_t epoch, int64_t layer_id, int expert_count, WriteFn&& write);

  // --- consumer thread (transport_consumer.cpp) -----------------------------------------------
  void consumer_main() noexcept;
  void free_staging() noexcept;
  void park(uint64_t& gen, uint64_t& completed);
  bool slot_ready(int slot, uint64_t epoch, int expert, uint64_t& seq) const;
  void run_layer(uint64_t epoch);

  // --- state ----------------------------------------------------------------------------------
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
  std::unique_ptr<commkit::Heartbeat> heartbeat_;  // beats ranks[rank_].heartbeat_ns while attached
  const commkit::ProcessId self_ = commkit::this_process();  // whose pids this process can judge
  // A peer in another PID namespace is dead after this long without a heartbeat (its beats come every
  // 10-100 ms; the margin covers a descheduled beating thread).
  static constexpr uint64_t kHeartbeatStaleMs = 2000;
  // How often this rank beats: its liveness interval, within [10, 100] ms (a peer in another PID
  // namespace declares it dead after kHeartbeatStaleMs without a beat).
  uint64_t heartbeat_period_ms() const { return std::min<uint64_t>(std::max<uint64_t>(opt_.liveness_ms, 10), 100); }
  std::mutex init_mu_;
  std::condition_variable init_cv_;
  bool init_done_ = false;
  std::string init_error_;
  std::string teardown_error_;  // the consumer's backend releases that failed (written before it exits)
  Stats final_poison_;
  bool final_ready_ = false;  // final_poison_ is set: the region may be gone (under final_mu_)
  mutable std::mutex final_mu_;
  std::mutex close_mu_;
  // Rank 0: held while a call publishes layer state (join's open, run's slots and done epoch) and
  // while reset() clears it, so a reset never interleaves with a publication of the old generation.
  std::mutex publish_mu_;
};

}  // namespace fp8lw
