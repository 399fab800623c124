// elastic_ep/csrc/kernels/geometry.hpp -- the dispatch geometry words: what every rank must pass alike for
// the records one rank writes to be where and what its peers read. Notify sends each peer these words of
// its call, (epoch << 32) | word (sizing.hpp kGeometryWords, WorkspaceLayout::geometry), and compares the
// peers' with its own before any record is read or written (device_common.cuh); the torch runtime sends
// the same words with its counts (_geometry.py, which decodes them: keep the two layouts identical; the
// bindings expose this function, and the CPU suite compares it with Python's).
// Host+device constexpr, CUDA-free.
#pragma once

#include <cstdint>

#include "commkit/platform.hpp"
#include "sizing.hpp"

namespace elastic_ep {

// Scale packs per token a dispatch may carry: the most that word 2 holds whole (both runtimes refuse more
// before launching, so every value of every field is compared, none modulo a width).
constexpr int kMaxSfPacks = (1 << 14) - 1;

// Word w of a dispatch's geometry, each field whole within the limits the runtimes check first:
// [0] num_max_tokens_per_rank, [1] bytes per row of x (hidden x element size),
// [2] (num_experts << 20) | (num_topk << 14) | scale packs per token   (E <= kMaxExperts < 2^12,
//     K <= kMaxTopk < 2^6, packs <= kMaxSfPacks < 2^14),
// [3] (expert_alignment, at most 2^24 - 1) << 8 | zero_copy.
CK_HD constexpr uint32_t dispatch_geometry_value(int w, int64_t num_max_tokens_per_rank, int64_t hidden_bytes,
                                                 int64_t num_experts, int64_t num_topk, int64_t num_sf_packs,
                                                 int64_t expert_alignment, bool zero_copy) {
  switch (w) {
    case 0: return uint32_t(num_max_tokens_per_rank);
    case 1: return uint32_t(hidden_bytes);
    case 2: return (uint32_t(num_experts) << 20) | (uint32_t(num_topk) << 14) | uint32_t(num_sf_packs);
    default: return (uint32_t(expert_alignment < 0xffffff ? expert_alignment : 0xffffff) << 8) | uint32_t(zero_copy);
  }
}

static_assert(kMaxExperts < (1 << 12) && kMaxTopk < (1 << 6) && kMaxSfPacks < (1 << 14),
              "geometry word 2 holds num_experts, num_topk and the scale packs whole");
static_assert(dispatch_geometry_value(2, 64, 7168, 256, 8, 1, 1, false) !=
                  dispatch_geometry_value(2, 64, 7168, 256, 8, 257, 1, false),
              "scale packs differing by 256 differ in word 2");
static_assert(dispatch_geometry_value(2, 64, 7168, kMaxExperts, kMaxTopk, kMaxSfPacks, 1, false) ==
                  ((2048u << 20) | (32u << 14) | 16383u), "word 2 at every field's limit");

}  // namespace elastic_ep
