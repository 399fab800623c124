// elastic_ep/csrc/host/ops_ll.cpp -- low-latency mode over the runtime's window (see runtime.hpp): the
// launches of ll_dispatch.cuh / ll_combine.cuh, the clean and the shrink mask. The Python layer
// validated every argument; these checks keep a raw call from writing outside the window. Empty unless
// the CUDA build is on.
#if COMMKIT_WITH_CUDA
#include <cuda_runtime.h>

#include <cstdint>

#include "commkit/check.hpp"
#include "host/runtime.hpp"
#include "kernels/ll_sizing.hpp"
#include "kernels/sizing.hpp"

namespace elastic_ep {
namespace {

// The checks both launches share: the call's shape and where its half lies.
template <typename P>
void check_ll_shape(const char* op, const P& p, int num_ranks, int num_device_sms, int64_t num_buffer_bytes) {
  CK_CHECK(p.num_experts > 0 && p.num_experts <= kMaxExperts && p.num_experts % num_ranks == 0 &&
               p.num_experts / num_ranks <= kLowLatencyMaxLocalExperts,
           op, ": num_experts=", p.num_experts, " must be a multiple of the ", num_ranks, " ranks, at most ",
           kMaxExperts, " and ", kLowLatencyMaxLocalExperts, " per rank");
  CK_CHECK(p.num_topk >= 1 && p.num_topk <= kLowLatencyMaxTopk, op, ": num_topk=", p.num_topk, " outside [1, ",
           kLowLatencyMaxTopk, "]");
  CK_CHECK(p.num_max_tokens >= 1 && p.num_max_tokens <= kLowLatencyMaxTokens && p.num_tokens >= 0 &&
               p.num_tokens <= p.num_max_tokens,
           op, ": ", p.num_tokens, " tokens with num_max_dispatch_tokens_per_rank=", p.num_max_tokens,
           " (at most ", kLowLatencyMaxTokens, ")");
  CK_CHECK(p.hidden > 0 && p.hidden % kLowLatencyHiddenAlign == 0 && p.hidden / kLowLatencyHiddenAlign <= 0xffff,
           op, ": hidden=", p.hidden, " must be a positive multiple of ", kLowLatencyHiddenAlign);
  CK_CHECK(p.half == 0 || p.half == 1, op, ": half=", p.half);
  CK_CHECK(p.phases >= 1 && p.phases <= (kLlSend | kLlRecv), op, ": phases=", p.phases);
  CK_CHECK(p.num_sms >= 1 && p.num_sms <= num_device_sms, op, ": num_sms=", p.num_sms, " outside [1, ",
           num_device_sms, "]");
  const int64_t need = ll_half_bytes(p.num_max_tokens, p.hidden, p.num_experts, p.num_topk);
  CK_CHECK(p.half_offset >= 0 && p.half_offset % 16 == 0 && need <= num_buffer_bytes - p.half_offset, op,
           ": the call needs ", need, " bytes at buffer offset ", p.half_offset, ", the buffer has ", num_buffer_bytes);
}

// recv_self_pos / self_pos hold rows of recv_x / x ([L, R * M] = E x M of them) as int32.
static_assert(int64_t(kMaxExperts) * kLowLatencyMaxTokens <= INT32_MAX, "low-latency row positions fit int32");

}  // namespace

void Runtime::ll_dispatch(const LlDispatchParams& p, int64_t stream) {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  CK_CHECK(!hybrid() && !gin_, "low_latency_dispatch: low-latency mode runs inside one NVLink domain");
  check_ll_shape("low_latency_dispatch", p, num_ranks_, num_device_sms_, num_buffer_bytes_);
  CK_CHECK(!p.use_ue8m0 || (p.use_fp8 && p.round_scale && p.hidden % 512 == 0),
           "low_latency_dispatch: use_ue8m0 needs use_fp8, round_scale and hidden % 512 == 0");
  if (p.phases & kLlSend) CK_CHECK(p.num_tokens == 0 || (p.x && p.topk_idx), "low_latency_dispatch: null input");
  // With recv_self_pos the send phase writes this rank's own rows into the outputs too.
  if ((p.phases & kLlRecv) || p.recv_self_pos != nullptr)
    CK_CHECK(p.recv_x && p.recv_count && p.recv_src_info && p.recv_route && p.recv_layout_range &&
                 (!p.use_fp8 || (p.use_ue8m0 ? p.recv_scales_ue8m0 != nullptr : p.recv_scales != nullptr)),
             "low_latency_dispatch: null output");
  set_device();
  launch_ll_dispatch(view(), p, reinterpret_cast<void*>(stream));
  CK_CUDA_CHECK(cudaGetLastError());
}

void Runtime::ll_combine(const LlCombineParams& p, int64_t stream) {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  CK_CHECK(!hybrid() && !gin_, "low_latency_combine: low-latency mode runs inside one NVLink domain");
  check_ll_shape("low_latency_combine", p, num_ranks_, num_device_sms_, num_buffer_bytes_);
  if (p.phases & kLlSend) CK_CHECK(p.x && p.recv_count && p.src_info && p.route, "low_latency_combine: null input");
  if (p.phases & kLlRecv)
    CK_CHECK(p.num_tokens == 0 || (p.topk_idx && p.topk_weights && p.combined_x), "low_latency_combine: null output");
  set_device();
  launch_ll_combine(view(), p, reinterpret_cast<void*>(stream));
  CK_CUDA_CHECK(cudaGetLastError());
}

void Runtime::ll_clean(int64_t stream) {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  set_device();
  const auto ws = workspace_layout();
  auto s = reinterpret_cast<cudaStream_t>(stream);
  char* base = static_cast<char*>(window_->base());
  // Counters, signals and geometry words: contiguous from ll_count to the end of ll_grid (not the mask).
  CK_CUDA_CHECK(cudaMemsetAsync(base + ws.ll_count.offset, 0, ws.ll_grid.end() - ws.ll_count.offset, s));
}

void Runtime::ll_set_mask(int rank, bool masked, int64_t stream) {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  CK_CHECK(rank >= 0 && rank < num_ranks_, "low_latency_update_mask_buffer: rank_to_mask=", rank, " outside [0, ",
           num_ranks_, ")");
  set_device();
  const uint32_t v = masked ? 1u : 0u;
  char* word = static_cast<char*>(window_->base()) + workspace_layout().ll_mask.offset + 4ull * rank;
  CK_CUDA_CHECK(cudaMemcpyAsync(word, &v, 4, cudaMemcpyHostToDevice, reinterpret_cast<cudaStream_t>(stream)));
  CK_CUDA_CHECK(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)));
}

void Runtime::ll_clean_mask(int64_t stream) {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  set_device();
  const auto r = workspace_layout().ll_mask;
  CK_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(window_->base()) + r.offset, 0, 4ull * num_ranks_,
                                reinterpret_cast<cudaStream_t>(stream)));
}

// The mask words' device address (a [kMaxRanks] int32 the caller copies num_ranks of).
uint64_t Runtime::ll_mask_address() const {
  return reinterpret_cast<uint64_t>(static_cast<char*>(window_->base()) + workspace_layout().ll_mask.offset);
}

}  // namespace elastic_ep
#endif  // COMMKIT_WITH_CUDA
