// elastic_ep/csrc/kernels/ll_sizing.hpp -- byte layouts of low-latency mode (DeepEP V1's
// low_latency_dispatch / low_latency_combine; kernels ll_dispatch.cuh and ll_combine.cuh).
//
// The low-latency area is the part of the buffer from `ll_offset` (after the bytes normal mode uses),
// split in two halves of `half_bytes`. A call uses half `buffer_idx`, which the host flips on every call
// as DeepEP V1 does, so that two calls can be in flight (the two micro-batches of a decode step).
// Inside a half:
//   dispatch receive   [L][R][M][msg]   the tokens rank s sends local expert l, in token order; msg =
//                                       16 B header {source token, top-k lane, 0, 0} + hidden x (FP8 1 B |
//                                       BF16 2 B) + FP8 only: hidden / 128 f32 scales, 16 B aligned
//   combine receive    [M][K][hidden]   bf16, at ll_combine_offset: the expert output for the origin's
//                                       token t, top-k lane k (written by the expert's rank)
// The dispatch area is sized with BF16 messages whatever the call uses (as DeepEP's hint), so that it
// also holds the zero-copy combine source [L][R * M][hidden] bf16 (get_next_low_latency_combine_buffer),
// which only its own rank reads.
// Signals live in the workspace (sizing.hpp WorkspaceLayout::ll_*), never in these areas, so normal
// mode may reuse the bytes between calls without a clean.
#pragma once

#include <cstdint>

#include "commkit/layout.hpp"

namespace elastic_ep {

// DeepEP V1's low-latency kernels take at most 9 top-k lanes; ours take up to 32 (the lane travels in
// 5 bits of the route word).
constexpr int kLowLatencyMaxTopk = 32;
// num_max_dispatch_tokens_per_rank: the geometry word keeps it in 16 bits.
constexpr int kLowLatencyMaxTokens = 8192;
// Hidden sizes are multiples of the FP8 scale group.
constexpr int kLowLatencyHiddenAlign = 128;
constexpr int kLowLatencyHeaderBytes = 16;
// Local experts per rank: one thread each in the combine's prefix scan (normal mode allows 256; Kimi-K2's
// 384 experts on one GPU need more).
constexpr int kLowLatencyMaxLocalExperts = 1024;
// Geometry words a rank sends with each call (ll_geometry_word).
constexpr int kLowLatencyGeometryWords = 2;

CK_HD constexpr int64_t ll_msg_bytes(int64_t hidden, bool use_fp8) {
  const int64_t body = use_fp8 ? commkit::sat_add(hidden, hidden / 32) : commkit::sat_mul(hidden, int64_t(2));
  return int64_t(commkit::align_up(uint64_t(commkit::sat_add(body, int64_t(kLowLatencyHeaderBytes))), 16));
}
// Offset of the FP8 scales inside a message.
CK_HD constexpr int64_t ll_msg_scales_offset(int64_t hidden) { return kLowLatencyHeaderBytes + hidden; }

// The dispatch receive area of one half (BF16-sized, see above).
CK_HD constexpr int64_t ll_dispatch_area_bytes(int64_t num_max_tokens, int64_t hidden, int64_t num_experts) {
  return commkit::sat_mul(commkit::sat_mul(num_experts, num_max_tokens), ll_msg_bytes(hidden, false));
}
// Offset of the combine receive area inside a half.
CK_HD constexpr int64_t ll_combine_offset(int64_t num_max_tokens, int64_t hidden, int64_t num_experts) {
  return int64_t(commkit::align_up(uint64_t(ll_dispatch_area_bytes(num_max_tokens, hidden, num_experts)), 4096));
}
// Bytes of one half a call needs.
CK_HD constexpr int64_t ll_half_bytes(int64_t num_max_tokens, int64_t hidden, int64_t num_experts, int64_t num_topk) {
  const int64_t row_bytes = commkit::sat_mul(hidden, int64_t(2));
  const int64_t combine = commkit::sat_mul(commkit::sat_mul(num_max_tokens, num_topk), row_bytes);
  return commkit::sat_add(ll_combine_offset(num_max_tokens, hidden, num_experts), combine);
}
// DeepEP V1's get_low_latency_rdma_size_hint: two halves, each for any top-k a call may use, each a
// multiple of 2 MiB.
CK_HD constexpr int64_t ll_size_hint(int64_t num_max_tokens, int64_t hidden, int64_t num_experts) {
  const int64_t k = num_experts < kLowLatencyMaxTopk ? num_experts : kLowLatencyMaxTopk;
  return commkit::sat_mul(int64_t(2), int64_t(commkit::align_up(uint64_t(ll_half_bytes(num_max_tokens, hidden,
                                                                                       num_experts, k)),
                                                                uint64_t(2) << 20)));
}

// What must be equal on every rank for a call's messages to be where and what the peers read:
// [0] (M << 16) | (K << 8) | use_fp8, [1] (E << 16) | hidden / 128.
CK_HD constexpr uint32_t ll_geometry_word(int w, int num_max_tokens, int hidden, int num_experts, int num_topk,
                                          bool use_fp8) {
  return w == 0 ? (uint32_t(num_max_tokens) << 16) | (uint32_t(num_topk) << 8) | uint32_t(use_fp8 ? 1 : 0)
                : (uint32_t(num_experts) << 16) | uint32_t(hidden / kLowLatencyHiddenAlign);
}

// The combine's route word of a received row: (source rank << 8) | top-k lane.
CK_HD constexpr int ll_route(int src_rank, int lane) { return (src_rank << 8) | lane; }

}  // namespace elastic_ep
