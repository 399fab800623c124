// shard_writer.cpp -- the native writer: rank r's shard of one expert, cut out of whole-layer CPU
// tensors by strides, copied into every rank's host slot without any Python per expert.
//
// The work of one expert (tp ranks x 4 kinds x chunks, each `rows` rows) is split into row
// ranges of roughly equal bytes and spread over `threads` threads, because one core's memcpy
// (~10 GB/s) is slower than a PCIe Gen5 link (~55 GB/s). The threads are persistent (a
// per-expert spawn costs ~30 us per thread, comparable to copying a 5 MB shard) and spin between
// the experts of a layer (see WriterPool).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "commkit/check.hpp"
#include "transport.hpp"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace fp8lw {

// Persistent workers that hand-off jobs by a generation counter. Between the experts of a layer
// (one job every ~100 us) they spin on it for up to kSpinNs and so start within a microsecond; only
// an idle pool sleeps on a condition variable. Waking 11 sleeping threads and joining them through
// condition variables cost ~30 us per expert on the 32-CPU H200 host of BENCHMARKS.md: 68 us for a 5.5 MB expert that a
// plain parallel copy moves in 36 us (BENCHMARKS.md, "Writer alone").
class WriterPool {
 public:
  explicit WriterPool(int n) : n_(n), errors_(n), spin_ns_(spin_ns_from_env()) {
    for (int t = 1; t < n; ++t) threads_.emplace_back([this, t] { loop(t); });
  }
  ~WriterPool() {
    stop_.store(true, std::memory_order_release);
    wake(cv_);
    for (auto& th : threads_) th.join();
  }
  // Runs job(t) for t in 0..n-1 (t = 0 on the calling thread); rethrows the first error.
  void run(const std::function<void(int)>& job) {
    std::lock_guard<std::mutex> serial(run_mu_);
    std::fill(errors_.begin(), errors_.end(), nullptr);
    job_ = &job;
    remaining_.store(n_ - 1, std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_release);  // publishes job_ and errors_
    wake(cv_);
    try {
      job(0);
    } catch (...) {
      errors_[0] = std::current_exception();
    }
    await([this] { return remaining_.load(std::memory_order_acquire) == 0; }, done_cv_);
    job_ = nullptr;
    for (auto& e : errors_)
      if (e) std::rethrow_exception(e);
  }

 private:
  // How long a worker spins for the next job before it sleeps: 200 us (about two experts' worth of
  // copying), or FP8_LAYERWISE_WRITER_SPIN_US (0: sleep at once, the condition-variable pool of
  // before; for measuring the difference in one build).
  static int64_t spin_ns_from_env() {
    const char* v = std::getenv("FP8_LAYERWISE_WRITER_SPIN_US");
    return v != nullptr && *v != '\0' ? std::max<int64_t>(0, std::atoll(v)) * 1000 : 200000;
  }

  static void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  // Spins on `ready` for up to spin_ns_, then sleeps on `cv` until it holds. A waker changes the state
  // first and then calls wake(cv), which takes the mutex: a sleeper checks `ready` under it, so no
  // wake-up is lost.
  template <typename Ready>
  void await(Ready ready, std::condition_variable& cv) {
    const auto t0 = std::chrono::steady_clock::now();
    for (uint32_t i = 0; !ready(); ++i) {
      cpu_relax();
      if ((i & 255u) == 0u &&
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count() >= spin_ns_) {
        std::unique_lock<std::mutex> l(mu_);
        cv.wait(l, ready);
        return;
      }
    }
  }
  void wake(std::condition_variable& cv) {
    { std::lock_guard<std::mutex> g(mu_); }
    cv.notify_all();
  }
  void loop(int t) {
    uint64_t seen = 0;
    for (;;) {
      await([&] { return stop_.load(std::memory_order_acquire) || gen_.load(std::memory_order_acquire) != seen; },
            cv_);
      if (stop_.load(std::memory_order_acquire)) return;
      seen = gen_.load(std::memory_order_acquire);
      try {
        (*job_)(t);
      } catch (...) {
        errors_[t] = std::current_exception();
      }
      if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) wake(done_cv_);
    }
  }

  int n_;
  std::vector<std::thread> threads_;
  std::vector<std::exception_ptr> errors_;  // written by worker t only, read by run() after the join
  std::mutex mu_, run_mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> remaining_{0};
  std::atomic<bool> stop_{false};
  int64_t spin_ns_;
};

// ---- cache hints -----------------------------------------------------------------------------
CacheHint parse_cache_hint(const std::string& name) {
  if (name == "none") return CacheHint::kNone;
  if (name == "demote") return CacheHint::kDemote;
  if (name == "writeback") return CacheHint::kWriteBack;
  if (name == "flush") return CacheHint::kFlush;
  CK_CHECK_ARG(false, "cache_hint must be one of none, demote, writeback, flush; got '", name, "'");
  return CacheHint::kNone;
}

const char* cache_hint_name(CacheHint h) {
  switch (h) {
    case CacheHint::kDemote: return "demote";
    case CacheHint::kWriteBack: return "writeback";
    case CacheHint::kFlush: return "flush";
    default: return "none";
  }
}

bool cache_hint_supported(CacheHint h) {
  if (h == CacheHint::kNone) return true;
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  switch (h) {
    case CacheHint::kDemote: return (c >> 25) & 1u;     // CPUID.7.0:ECX[25] CLDEMOTE
    case CacheHint::kWriteBack: return (b >> 24) & 1u;  // CPUID.7.0:EBX[24] CLWB
    case CacheHint::kFlush: return (b >> 23) & 1u;      // CPUID.7.0:EBX[23] CLFLUSHOPT
    default: return false;
  }
#else
  return false;
#endif
}

namespace {
// The hints are performance hints only: x86 DMA is cache coherent, so the copy engine reads the
// right bytes whatever state the lines are in, and no fence is needed for correctness.
#if defined(__x86_64__)
// Every line that holds a byte of [p, p + n), including a partial first and last line.
#define FP8LW_FOR_LINES(p, n, op)                                                  \
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63},              \
                 end = reinterpret_cast<uintptr_t>(p) + (n);                       \
       a < end; a += 64)                                                          \
  op(reinterpret_cast<void*>(a))
__attribute__((target("cldemote"))) void demote_lines(char* p, uint64_t n) { FP8LW_FOR_LINES(p, n, _cldemote); }
__attribute__((target("clwb"))) void writeback_lines(char* p, uint64_t n) { FP8LW_FOR_LINES(p, n, _mm_clwb); }
__attribute__((target("clflushopt"))) void flush_lines(char* p, uint64_t n) { FP8LW_FOR_LINES(p, n, _mm_clflushopt); }
#undef FP8LW_FOR_LINES
#endif

void apply_hint(CacheHint h, char* p, uint64_t n) {
#if defined(__x86_64__)
  switch (h) {
    case CacheHint::kDemote: demote_lines(p, n); break;
    case CacheHint::kWriteBack: writeback_lines(p, n); break;
    case CacheHint::kFlush: flush_lines(p, n); break;
    default: break;
  }
#else
  (void)h, (void)p, (void)n;
#endif
}
}  // namespace

ShardWriter::~ShardWriter() = default;

ShardWriter::ShardWriter(std::vector<ShardSpec> kinds, int threads, CacheHint hint, int tp_size)
    : kinds_(std::move(kinds)), threads_(threads), hint_(hint), tp_size_(tp_size) {
  CK_CHECK_ARG(cache_hint_supported(hint_), "cache_hint '", cache_hint_name(hint_),
               "' needs an instruction this CPU does not have");
  CK_CHECK_ARG(kinds_.size() == kKinds, "ShardWriter needs exactly 4 kind specs, got ", kinds_.size());
  CK_CHECK_ARG(threads_ >= 1 && threads_ <= 64, "ShardWriter threads must be in 1..64, got ", threads_);
  CK_CHECK_ARG(tp_size_ >= 0 && tp_size_ <= kMaxTP, "ShardWriter tp_size must be in 0..", kMaxTP,
               " (0: not known), got ", tp_size_);
  for (size_t k = 0; k < kinds_.size(); ++k) {
    const auto& s = kinds_[k];
    CK_CHECK_ARG(s.base != 0, "ShardWriter kind ", k, ": source pointer is null");
    CK_CHECK_ARG(s.rows > 0 && s.row_bytes > 0 && s.chunks > 0, "ShardWriter kind ", k,
                 ": rows, row_bytes and chunks must be positive");
    CK_CHECK_ARG(s.row_bytes <= s.row_stride || s.rows == 1, "ShardWriter kind ", k, ": row_bytes ", s.row_bytes,
                 " exceeds row_stride ", s.row_stride);
    // Every kind is a whole-layer tensor [E, ...] of the same layer: one expert count for all.
    CK_CHECK_ARG(s.num_experts >= 1 && s.num_experts <= static_cast<uint64_t>(INT32_MAX), "ShardWriter kind ", k,
                 ": num_experts (the experts in the source tensor) must be in 1..", INT32_MAX, ", got ", s.num_experts);
    CK_CHECK_ARG(s.num_experts == kinds_[0].num_experts, "ShardWriter kind ", k, ": num_experts ", s.num_experts,
                 " differs from kind 0's ", kinds_[0].num_experts, " (all four sources must hold the same experts)");
  }
  if (tp_size_ > 0) check_ranks(static_cast<size_t>(tp_size_));
  if (threads_ > 1) pool_ = std::make_unique<WriterPool>(threads_);
}

namespace {
struct Piece {
  const char* src;
  char* dst;
  uint64_t rows, row_bytes, row_stride;
};

void run_piece(const Piece& p, CacheHint hint) {
  if (p.row_bytes == p.row_stride) {
    std::memcpy(p.dst, p.src, p.rows * p.row_bytes);
  } else {
    for (uint64_t i = 0; i < p.rows; ++i) std::memcpy(p.dst + i * p.row_bytes, p.src + i * p.row_stride, p.row_bytes);
  }
  // The piece (~100 KB) is still in this core's L1/L2: hinting now costs the least.
  apply_hint(hint, p.dst, p.rows * p.row_bytes);
}
}  // namespace

void ShardWriter::check_ranks(size_t tp) const {
  CK_CHECK_ARG(tp >= 1, "ShardWriter: no ranks to write");
  for (size_t k = 0; k < kinds_.size(); ++k) {
    const auto& s = kinds_[k];
    // A single-expert source whose stride is never used (0) has no extent to check against.
    if (s.num_experts == 1 && s.expert_stride == 0) continue;
    // The last byte rank tp-1 reads must lie inside its expert: a writer whose specs were cut for
    // fewer ranks than the transport has (e.g. make_shard_writer(sources, 1) on a TP-2 transport
    // with the same expert_nbytes) would otherwise read the next expert, or past the source tensor.
    const uint64_t r = tp - 1;
    const uint64_t end = ((s.chunks - 1) * s.chunk_row_step + r * s.rank_row_step + s.rows - 1) * s.row_stride +
                         r * s.rank_col_step + s.row_bytes;
    CK_CHECK_ARG(end <= s.expert_stride, "ShardWriter kind ", k, ": rank ", r, "'s shard ends at byte ", end,
                 " of its expert, but an expert of the source is ", s.expert_stride,
                 " bytes: the writer was built for fewer ranks than the ", tp, " it is asked to write (pass the "
                 "transport's tp_size to make_shard_writer)");
  }
}

void ShardWriter::write(int expert, const std::vector<uintptr_t>* dst[kKinds]) const {
  // The sources hold num_experts experts: any other index would read outside them.
  CK_CHECK_ARG(expert >= 0 && static_cast<uint64_t>(expert) < kinds_[0].num_experts, "ShardWriter.write: expert ",
               expert, " is outside the source tensors' experts 0..", kinds_[0].num_experts - 1);
  const size_t tp = dst[0]->size();
  check_ranks(tp);
  std::vector<Piece> pieces;
  uint64_t total = 0;
  for (int k = 0; k < kKinds; ++k) {
    const auto& s = kinds_[k];
    for (size_t r = 0; r < tp; ++r) {
      char* out = reinterpret_cast<char*>((*dst[k])[r]);
      for (uint64_t c = 0; c < s.chunks; ++c) {
        const char* src = reinterpret_cast<const char*>(s.base) + static_cast<uint64_t>(expert) * s.expert_stride +
                          (c * s.chunk_row_step + r * s.rank_row_step) * s.row_stride + r * s.rank_col_step;
        pieces.push_back({src, out + c * s.rows * s.row_bytes, s.rows, s.row_bytes, s.row_stride});
        total += s.rows * s.row_bytes;
      }
    }
  }
  if (threads_ == 1 || total < (1u << 20)) {
    for (const auto& p : pieces) run_piece(p, hint_);
    return;
  }
  // Split pieces into row ranges of about total/(4*threads) bytes; threads take them in turn
  // from a shared counter, so uneven pieces (scales vs weights) still balance.
  const uint64_t target = std::max<uint64_t>(total / (4 * static_cast<uint64_t>(threads_)), 1);
  std::vector<Piece> split;
  for (const auto& p : pieces) {
    const uint64_t bytes = p.rows * p.row_bytes;
    const uint64_t parts = std::max<uint64_t>(1, bytes / target);
    const uint64_t rows_per = (p.rows + parts - 1) / parts;
    for (uint64_t r0 = 0; r0 < p.rows; r0 += rows_per) {
      const uint64_t n = std::min(rows_per, p.rows - r0);
      split.push_back({p.src + r0 * p.row_stride, p.dst + r0 * p.row_bytes, n, p.row_bytes, p.row_stride});
    }
  }
  std::atomic<size_t> next{0};
  pool_->run([&](int) {
    for (size_t i = next.fetch_add(1); i < split.size(); i = next.fetch_add(1)) run_piece(split[i], hint_);
  });
}

}  // namespace fp8lw
