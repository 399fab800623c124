// transport_consumer.cpp -- every rank's consumer thread: copies each published slot into the layer
// buffers (up to max_inflight experts in flight, consecutive slots merged into one copy per kind,
// the small kinds batched for the whole layer), acknowledges a slot when its copy landed, and after
// a poison drains its copies and parks until a reset.
#include <time.h>

#include <algorithm>
#include <cstring>
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

void Transport::Impl::consumer_main() noexcept {
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
  teardown_error_ = backend_->release();  // close() reads it after joining this thread
  backend_.reset();
}

void Transport::Impl::free_staging() noexcept {
  for (auto& p : staging_) {
    if (p != nullptr && backend_) backend_->free_host(p);
    p = nullptr;
  }
}

// After a poison: finish in-flight copies (so nothing lands after a reset), report parked,
// and sleep until a reset publishes a new generation.
void Transport::Impl::park(uint64_t& gen, uint64_t& completed) {
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

bool Transport::Impl::slot_ready(int slot, uint64_t epoch, int expert, uint64_t& seq) const {
  const uint64_t s = ld_acquire(&c_->ready[slot].sequence);
  if (s == last_seq_[slot]) return false;
  if (ld_relaxed(&c_->ready[slot].epoch) != epoch || ld_relaxed(&c_->ready[slot].expert) != static_cast<uint64_t>(expert))
    return false;
  seq = s;
  return true;
}

void Transport::Impl::run_layer(uint64_t epoch) {
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

}  // namespace fp8lw
