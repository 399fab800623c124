// transport_calls.cpp -- Transport::Impl's public calls in flight (each runs inside api(), so that
// close() knows when no other thread touches the shared memory any more), the per-thread record of
// the call and generation a thread is in, close(), and the collective reset() after a poison.
#include <algorithm>

#include "transport_impl.hpp"

namespace fp8lw {
namespace {

using commkit::ld_acquire;
using commkit::ld_relaxed;
using commkit::st_release;
using commkit::st_relaxed;

// close() waits for the calls other threads are in for the transport's timeout, but at most this
// long: it runs from __exit__, __del__ and interpreter exit, where hanging on a stuck writer is
// worse than leaving the memory mapped.
constexpr uint64_t kCloseDrainMaxMs = 60000;

}  // namespace

// The generation the innermost public call of this thread started in. A reset() that completes
// while the call is blocked (another thread of this rank ran it) abandons that call's layer: rank 0
// zeroes sequences and acks and marks the epoch done, so the call must not go on as if it were
// still current (a stale run() would keep writing and publishing the old layer's slots next to
// the new layer, a stale wait() would return the abandoned layer as complete).
uint64_t& Transport::Impl::call_generation_slot() {
  static thread_local uint64_t gen = 0;
  return gen;
}

// The public call this thread is inside of (for messages).
const char*& Transport::Impl::current_call_slot() {
  static thread_local const char* call = nullptr;
  return call;
}

const char* Transport::Impl::current_call() {
  const char* c = current_call_slot();
  return c != nullptr ? c : "a call";
}

// Both checks a public call makes before acting on the layer it started in (not the consumer
// thread, which is outside any call).
void Transport::Impl::check_poison_or_reset() const {
  check_poison();
  check_not_reset();
}

void Transport::Impl::check_not_reset() const {
  const uint64_t now = ld_acquire(&c_->layer.generation);
  const uint64_t at = call_generation_slot();
  if (now != at)
    CK_THROW("fp8_layerwise transport on rank ", rank_, ": reset() ran (generation ", at, " -> ", now, ") while ",
             current_call(), "() was blocked in it; the layer of that call was abandoned, so it stops here");
}

void Transport::Impl::throw_closed_while_blocked(const char* call) const {
  throw ClosedError(commkit::str("fp8_layerwise transport on rank ", rank_, " was closed while ", call,
                                 "() was blocked in it (close() from another thread, or from the writer)"),
                    rank_);
}

// The calls this thread is inside of, innermost last (a writer may call back into the transport).
std::vector<const Transport::Impl*>& Transport::Impl::thread_calls() {
  static thread_local std::vector<const Impl*> calls;
  return calls;
}

void Transport::Impl::enter_call(const char* call) {
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

void Transport::Impl::leave_call() noexcept {
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
bool Transport::Impl::wait_calls_left() noexcept {
  const auto& mine = thread_calls();
  const int64_t own = std::count(mine.begin(), mine.end(), this);
  commkit::ProgressDeadline deadline(std::min(timeout_ms_, kCloseDrainMaxMs));
  const auto left = [&] { return inflight_calls_.load() <= own; };
  const auto progress = [&] { return static_cast<uint64_t>(inflight_calls_.load()); };
  if (commkit::poll_until(left, deadline, progress, [] { return false; }) != commkit::PollResult::kReady) return false;
  return inflight_calls_.load() == 0;
}

void Transport::Impl::validate_call(uint64_t epoch, int64_t layer_id, int expert_count) {
  CK_CHECK_ARG(epoch != 0, "epoch 0 is reserved; epochs start at 1 and strictly increase");
  CK_CHECK_ARG(layer_id >= 0, "layer_id must be non-negative, got ", layer_id);
  CK_CHECK_ARG(expert_count >= 1 && expert_count <= num_experts_, "expert_count must be in 1..", num_experts_,
               ", got ", expert_count);
}

void Transport::Impl::check_generation() const {
  CK_CHECK(ld_acquire(&c_->layer.generation) == generation_,
           "the transport was reset by another rank; call reset() on this rank too (rank ", rank_, ")");
}

bool Transport::Impl::close() noexcept {
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
  heartbeat_.reset();
  {
    // The owner may unmap the region right after close(): keep what accessors still report.
    std::lock_guard<std::mutex> g(final_mu_);
    final_poison_ = last_poison();
    final_ready_ = true;
  }
  st_release(&me.status, static_cast<uint64_t>(kRankClosed));
  return drained_;
}

// "rank 1 has not called reset(); rank 2's consumer has not drained": who rank 0's reset waits for.
Transport::Impl::Blame Transport::Impl::reset_missing(uint64_t gen) const {
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

uint64_t Transport::Impl::reset() {
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

}  // namespace fp8lw
