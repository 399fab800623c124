// transport.hpp -- the layerwise FP8 expert-weight transport (host side, torch-free).
//
// One transport object per rank. Rank 0 is the producer: it fills every rank's pinned host slots,
// expert by expert, through a writer, and publishes each slot. Every rank (rank 0 included) runs
// a consumer thread that copies published slots into its layer buffers at expert * nbytes[kind]
// and acknowledges the slot. The protocol state is the POD Control block in shared memory
// (control.hpp); see the package README for the full state machine.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "commkit/check.hpp"
#include "commkit/process.hpp"
#include "control.hpp"

namespace fp8lw {

// Raised on every rank once the region is poisoned; carries the original cause. peer() is the rank
// the failure is blamed on when the recording rank knew one (a timeout names the rank it waited
// for), else -1.
class PoisonedError : public commkit::Error {
 public:
  PoisonedError(const std::string& what, int code, int poison_rank, std::string message, int peer = -1)
      : commkit::Error(what, __FILE__, __LINE__, poison_rank, peer), code_(code), poison_rank_(poison_rank),
        message_(std::move(message)) {}
  int code() const noexcept { return code_; }
  int poison_rank() const noexcept { return poison_rank_; }
  const std::string& message() const noexcept { return message_; }

 private:
  int code_;
  int poison_rank_;
  std::string message_;
};

// Raised by a call on a closed transport, and by a call that another thread of this process was
// blocked in (join / run / wait / reset, or run's writer) when close() ran: close() waits until
// such a call has left before it returns, so the caller gets this error instead of touching memory
// the owner unmaps after close().
class ClosedError : public commkit::Error {
 public:
  ClosedError(const std::string& what, int rank) : commkit::Error(what, __FILE__, __LINE__, rank) {}
};

// Raised by a blocked call (join / run / wait / reset) whose Options::interrupt_check reported an
// interruption (the Python binding: a signal handler raised, e.g. KeyboardInterrupt on Ctrl-C). The
// region was poisoned first (code kErrInterrupted, unless already poisoned), so the peers stop too.
class InterruptedError : public commkit::Error {
 public:
  InterruptedError(const std::string& what, int rank) : commkit::Error(what, __FILE__, __LINE__, rank) {}
};

struct Stats {
  uint64_t epoch = 0;
  int64_t layer_id = 0;
  int expert_count = 0;
  int rank = 0;
  double writer_ms = 0, slot_wait_ms = 0, h2d_ms = 0, total_ms = 0;
  uint64_t bytes = 0;
  uint64_t copies = 0;
  bool poisoned = false;
  int error_code = 0;
  int error_rank = -1;
  int error_peer = -1;
  std::string error_message;
};

struct Options {
  std::string backend = "auto";  // "cuda", "cpu", or "auto" (cuda when cuda_device >= 0)
  int max_inflight = 0;          // experts in flight per consumer; 0 = num_slots; 1 = as KTransformers'
  bool coalesce = true;          // merge copies of consecutive slots when host memory is contiguous
  // With coalesce: while a batch is still queued on the copy engine, let a short run of ready slots
  // wait for the next ones (fewer, larger copies) instead of issuing it at once. Off by default: it
  // helps the transport alone (+2-3 points for small shards) but costs end to end when the writer
  // is the bottleneck (fp8_layerwise/BENCHMARKS.md, run 5).
  bool coalesce_wait = false;
  uint64_t liveness_ms = 20;     // how often a waiter checks that the ranks it waits on are alive
  // CUDA streams a consumer spreads each batch's copies over (1..kMaxCopyStreams): a copy's fixed
  // start-up cost (~2.5 us, all of a sub-KB scale copy's time) overlaps another stream's transfer.
  // On one H200: +2-3 points of the pinned peak for TP8-sized shards, neutral for larger experts
  // (fp8_layerwise/BENCHMARKS.md, run 4). 1 is KTransformers' single stream.
  int copy_streams = 2;
  // Kinds of at most kBatchedKindMaxBytes per expert (the FP32 block scales: 0.4-3 KB) are not
  // copied per expert: the consumer memcpy's them out of the slot into its own page-locked
  // [expert][bytes] staging buffer and copies each such kind for the whole layer once, with the
  // layer's last batch. A TP8-sized expert is then 2 copies instead of 4 (each ~2.5 us of copy
  // engine, whatever its size). On by default: transport alone +2 to +6 points of the pinned peak
  // for TP4/TP8-sized shards on one H200, neutral with the writer in the loop
  // (fp8_layerwise/BENCHMARKS.md, run 9).
  bool batch_small_kinds = true;
  // Asked by a thread blocked in join / run / wait / reset every kInterruptCheckMs (and at least
  // every liveness tick): a non-empty answer (what interrupted it, e.g. "KeyboardInterrupt") makes
  // the call poison the region (kErrInterrupted) and raise InterruptedError. Never called by the
  // consumer thread. Empty: the calls are interruptible only by close() and the peers.
  std::function<std::string()> interrupt_check;
};
constexpr uint64_t kInterruptCheckMs = 50;
constexpr uint64_t kBatchedKindMaxBytes = 64 * 1024;

// writer(expert, w13[rank], w13_scale[rank], w2[rank], w2_scale[rank]): fill every rank's slot.
using Writer = std::function<void(int, const std::vector<uintptr_t>&, const std::vector<uintptr_t>&,
                                  const std::vector<uintptr_t>&, const std::vector<uintptr_t>&)>;

// A native writer: copies rank r's shard of expert e, kind k, out of a whole-layer CPU buffer.
// Shard bytes, in order: for c in chunks, for i in rows:
//   base + e*expert_stride + (c*chunk_row_step + r*rank_row_step + i)*row_stride + r*rank_col_step,
//   row_bytes bytes. (w13 [E, 2I, H]: chunks 2 (gate, up), rows I/tp; w2 [E, H, I]: rows H,
//   row_bytes I/tp bytes, rank_col_step I/tp bytes.)
// num_experts is the number of experts in the source buffer (its first dimension): the writer
// refuses any expert outside 0..num_experts-1, which would read past the buffer.
struct ShardSpec {
  uintptr_t base = 0;
  uint64_t expert_stride = 0, row_stride = 0, rows = 0, row_bytes = 0;
  uint64_t rank_row_step = 0, rank_col_step = 0, chunks = 1, chunk_row_step = 0;
  uint64_t num_experts = 0;
  uint64_t shard_bytes() const { return chunks * rows * row_bytes; }
};

class WriterPool;  // persistent memcpy threads of a ShardWriter (shard_writer.cpp)

// What the writer does with the cache lines of a slot once it has written them. The copy engine
// reads a slot soon after it is filled, and reading lines still modified in the CPU's caches cut a
// 5.5 MB H2D stream from 53 to 29-36 GB/s on the H200 host's Xeon (BENCHMARKS.md, "H2D under host
// traffic"). kDemote moves them to the shared L3 (CLDEMOTE), kWriteBack writes them back (CLWB),
// kFlush evicts them (CLFLUSHOPT). Measured (run 11): demote restores the copy rate but costs the
// writer more than that gains end to end, so the default is kNone.
enum class CacheHint : int { kNone = 0, kDemote = 1, kWriteBack = 2, kFlush = 3 };
CacheHint parse_cache_hint(const std::string& name);  // "none" | "demote" | "writeback" | "flush"
const char* cache_hint_name(CacheHint h);
bool cache_hint_supported(CacheHint h);  // this CPU has the instruction

class ShardWriter {
 public:
  // tp_size: the ranks the specs were cut for (0: not known). check_ranks() refuses a transport with
  // more ranks; only a known tp_size lets run() refuse one with fewer, whose writer would fill every
  // rank's slot with its slice of a wider layer, bytes of the right size in the wrong place.
  ShardWriter(std::vector<ShardSpec> kinds, int threads, CacheHint hint = CacheHint::kNone, int tp_size = 0);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;
  // Copies every rank's shard of `expert` (0..num_experts()-1, else ValueError) into dst[kind][rank].
  void write(int expert, const std::vector<uintptr_t>* dst[kKinds]) const;
  // ValueError unless every rank 0..tp-1's shard lies inside one expert of each source (write()
  // checks it too; run() checks it before the layer starts, so a mismatch poisons nothing).
  void check_ranks(size_t tp) const;
  const std::vector<ShardSpec>& kinds() const { return kinds_; }
  int64_t num_experts() const { return static_cast<int64_t>(kinds_[0].num_experts); }  // same for every kind
  int threads() const { return threads_; }
  CacheHint cache_hint() const { return hint_; }
  int tp_size() const { return tp_size_; }

 private:
  std::vector<ShardSpec> kinds_;
  int threads_;
  CacheHint hint_;
  int tp_size_;
  std::unique_ptr<WriterPool> pool_;  // threads_ - 1 workers; the caller is worker 0
};

size_t control_bytes();
// Liveness of a rank's process: commkit::process_start_time (its /proc start time; 0 when gone or a
// zombie; with the pid it names one process across pid reuse) recorded on attach, and
// commkit::process_alive(pid, recorded start), which the check of every wait (check_peers) asks about
// each rank it depends on (commkit/process.hpp).
size_t control_struct_bytes();
// Test hook (bound as _C._debug_set_rank_process): stores (pid, start_time[, boot, pid_ns,
// heartbeat_ns]) as rank's process in the control region and marks the rank attached, as a rank of that process would have left its
// record, so that tests can make the liveness checks judge records that no real rank can produce
// (a live pid with another process's start time). Not for production use: it forges a rank.
void debug_set_rank_process(uintptr_t control_ptr, size_t control_size, int rank, uint64_t pid,
                            uint64_t start_time, uint64_t boot = 0, uint64_t pid_ns = 0, uint64_t heartbeat_ns = 0);
void initialize_control(uintptr_t control_ptr, size_t control_size, int tp_size, int num_slots);

class Transport {
 public:
  // local_host_ptrs: [slot][kind] (num_slots*4); local_dst_ptrs: [kind] (GPU for the CUDA
  // backend, host for the CPU backend); all_rank_host_ptrs: [slot][rank][kind] on rank 0, empty
  // elsewhere. num_slots comes from the control header.
  Transport(uintptr_t control_ptr, size_t control_size, int rank, int tp_size, int cuda_device,
            const std::vector<uintptr_t>& local_host_ptrs, const std::vector<uintptr_t>& local_dst_ptrs,
            const std::vector<uintptr_t>& all_rank_host_ptrs, const std::vector<size_t>& expert_nbytes,
            int num_experts, uint64_t timeout_ms, const Options& options = Options());
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  void join(uint64_t epoch, int64_t layer_id, int expert_count);
  Stats wait(uint64_t epoch);
  void run_producer(uint64_t epoch, int64_t layer_id, int expert_count, const Writer& writer);
  void run_producer_native(uint64_t epoch, int64_t layer_id, int expert_count, const ShardWriter& writer);
  // Stops the consumer and waits (up to min(timeout_ms, 60 s)) until every call that other threads
  // of this process are in has left (they raise ClosedError). Returns whether none is left: only
  // then may the owner unmap the control region and the slots. A call still inside (a writer that
  // did not return in time, or close() called from inside the writer) may still touch them.
  bool close() noexcept;
  // After close(): the copy backend's releases that failed (CUDA: stream synchronisation, event and
  // stream destruction, cudaFreeHost of the staging memory), "" when none.
  std::string teardown_error() const;
  // Collective recovery after a poison: every live rank calls it; returns the new generation.
  uint64_t reset();
  // Claims the poison record (exactly one concurrent claim wins); returns whether this call won.
  bool poison(int code, const std::string& message);
  bool poisoned() const;
  Stats last_poison() const;

  int rank() const;
  int tp_size() const;
  int num_slots() const;
  int num_experts() const;
  bool closed() const;
  uint64_t generation() const;
  std::string backend() const;

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fp8lw
