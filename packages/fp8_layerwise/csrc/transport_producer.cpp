// transport_producer.cpp -- rank 0's producer: run() waits until every rank joined the layer, then,
// expert by expert, waits until every rank acknowledged the slot's previous contents, has the
// writer fill every rank's slot and publishes it; and the public run_producer calls over it.
#include <array>
#include <exception>

#include "transport_impl.hpp"

namespace fp8lw {
namespace {

using commkit::ld_acquire;
using commkit::ld_relaxed;
using commkit::monotonic_ns;
using commkit::st_release;
using commkit::st_relaxed;

}  // namespace

void Transport::Impl::wait_slot_acks(int slot, uint64_t seq) {
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
void Transport::Impl::produce(uint64_t epoch, int64_t layer_id, int expert_count, WriteFn&& write) {
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

}  // namespace fp8lw
