// shard_writer.cpp -- the native writer: rank r's shard of one expert, cut out of whole-layer CPU
// tensors by strides, copied into every rank's host slot without any Python per expert.
//
// The work of one expert (tp ranks x 4 kinds x chunks, each `rows` rows) is split into row
// ranges of roughly equal bytes and spread over `threads` threads, because one core's memcpy
// (~10 GB/s) is slower than a PCIe Gen5 link (~55 GB/s).
#include <algorithm>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "commkit/check.hpp"
#include "transport.hpp"

namespace fp8lw {

ShardWriter::ShardWriter(std::vector<ShardSpec> kinds, int threads) : kinds_(std::move(kinds)), threads_(threads) {
  CK_CHECK_ARG(kinds_.size() == kKinds, "ShardWriter needs exactly 4 kind specs, got ", kinds_.size());
  CK_CHECK_ARG(threads_ >= 1 && threads_ <= 64, "ShardWriter threads must be in 1..64, got ", threads_);
  for (size_t k = 0; k < kinds_.size(); ++k) {
    const auto& s = kinds_[k];
    CK_CHECK_ARG(s.base != 0, "ShardWriter kind ", k, ": source pointer is null");
    CK_CHECK_ARG(s.rows > 0 && s.row_bytes > 0 && s.chunks > 0, "ShardWriter kind ", k,
                 ": rows, row_bytes and chunks must be positive");
    CK_CHECK_ARG(s.row_bytes <= s.row_stride || s.rows == 1, "ShardWriter kind ", k, ": row_bytes ", s.row_bytes,
                 " exceeds row_stride ", s.row_stride);
  }
}

namespace {
struct Piece {
  const char* src;
  char* dst;
  uint64_t rows, row_bytes, row_stride;
};

void run_piece(const Piece& p) {
  if (p.row_bytes == p.row_stride) {
    std::memcpy(p.dst, p.src, p.rows * p.row_bytes);
    return;
  }
  for (uint64_t i = 0; i < p.rows; ++i) std::memcpy(p.dst + i * p.row_bytes, p.src + i * p.row_stride, p.row_bytes);
}
}  // namespace

void ShardWriter::write(int expert, const std::vector<uintptr_t>* dst[kKinds]) const {
  const size_t tp = dst[0]->size();
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
    for (const auto& p : pieces) run_piece(p);
    return;
  }
  // Split pieces into row ranges of about total/threads bytes, then deal them out round-robin.
  const uint64_t target = std::max<uint64_t>(total / static_cast<uint64_t>(threads_), 1);
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
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> errors(threads_);
  for (int t = 0; t < threads_; ++t) {
    pool.emplace_back([&, t] {
      try {
        for (size_t i = t; i < split.size(); i += threads_) run_piece(split[i]);
      } catch (...) {
        errors[t] = std::current_exception();
      }
    });
  }
  for (auto& th : pool) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace fp8lw
