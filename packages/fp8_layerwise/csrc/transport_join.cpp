// transport_join.cpp -- joining a layer and waiting for it: join() on every rank (rank 0 opens the
// epoch once every rank returned from wait() of the previous one; the others wait for it and
// check that they joined the same layer), wait() for this rank's copies and its LayerStats, and
// layer_blame(), the message of who a layer is waiting for.
#include "transport_impl.hpp"

namespace fp8lw {
namespace {

using commkit::ld_acquire;
using commkit::ld_relaxed;
using commkit::monotonic_ns;
using commkit::st_release;
using commkit::st_relaxed;

double ms(uint64_t ns) { return static_cast<double>(ns) / 1e6; }

}  // namespace

// "; rank 1 has not joined epoch 3": the ranks (or rank 0's producer) that the layer `epoch` is
// waiting for, from the control block; peer is the first of them.
Transport::Impl::Blame Transport::Impl::layer_blame(uint64_t epoch) const {
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

void Transport::Impl::join(uint64_t epoch, int64_t layer_id, int expert_count) {
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

Stats Transport::Impl::wait(uint64_t epoch) {
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
    // Rank 0 may wait before its run() started: the producer may run in another thread (as with
    // KTransformers' FP8LayerwiseTransport). A run() that never comes is named when the wait
    // expires ("rank 0 has not called run() for epoch N", layer_blame), not refused here, where a
    // producer thread about to start would be indistinguishable from a forgotten run().
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

Stats Transport::Impl::fill_stats(uint64_t epoch) const {
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

}  // namespace fp8lw
