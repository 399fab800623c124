// elastic_ep/csrc/host/ops_ep.cpp -- the EP operations over the runtime's window: barrier, dispatch (notify
// + push, the CPU sync, the copy epilogue) and combine (see runtime.hpp). Empty unless the CUDA build is on.
#if COMMKIT_WITH_CUDA
#include <cuda_runtime.h>

#include <algorithm>

#include "commkit/atomics.hpp"
#include "commkit/check.hpp"
#include "commkit/deadline.hpp"
#include "commkit/timeout_record.hpp"
#include "host/runtime.hpp"
#include "kernels/geometry.hpp"
#include "kernels/sizing.hpp"

namespace elastic_ep {

template <typename Pred, typename Progress>
int Runtime::poll_host(Pred&& pred, Progress&& progress) {
  auto* rec = host_workspace_layout().timeout.at<commkit::TimeoutRecord>(host_ws_.get());
  commkit::ProgressDeadline deadline(uint64_t(num_cpu_timeout_secs_) * 1000ull);
  // The host waits here for a kernel of the call it is inside (the counts of a CPU-synced dispatch):
  // it yields for up to 20 ms (ELASTIC_EP_HOST_WAIT_YIELD_US) before it sleeps, as a sleeping
  // waiter wakes ~50-100 us late (timer slack) and every dispatch would pay that. DeepEP spins.
  return int(commkit::poll_until(pred, deadline, progress, [&] { return commkit::ld_acquire(&rec->flag) == 1u; },
                                 commkit::Backoff(host_wait_yield_ns_)));
}

void Runtime::barrier(int64_t stream) {
  set_device();
  entered_ = true;
  launch_barrier(view(), reinterpret_cast<void*>(stream));
  CK_CUDA_CHECK(cudaGetLastError());
}

namespace {

// What the kernels index, re-checked on the raw runtime (the Python layer checks it first; a caller of
// _C.Runtime directly must not make a kernel write past an array or the buffer). ValueError.
void check_dispatch_shape(const char* op, int num_ranks, int64_t buffer_bytes, int num_tokens, int64_t max_tokens,
                          int num_experts, int num_topk, int64_t hidden_bytes, int64_t num_sf_packs,
                          bool zero_copy) {
  CK_CHECK_ARG(num_topk >= 1 && num_topk <= kMaxTopk, op, ": num_topk must be in [1, ", kMaxTopk, "], got ", num_topk);
  CK_CHECK_ARG(max_tokens >= 1 && num_tokens >= 0 && num_tokens <= max_tokens, op, ": need 0 <= num_tokens (",
               num_tokens, ") <= num_max_tokens_per_rank (", max_tokens, ")");
  CK_CHECK_ARG(num_experts >= num_ranks && num_experts <= kMaxExperts && num_experts % num_ranks == 0 &&
                   num_experts / num_ranks <= kMaxLocalExperts,
               op, ": num_experts (", num_experts, ") must be a multiple of the ", num_ranks, " ranks, at most ",
               kMaxExperts, " and ", kMaxLocalExperts, " per rank");
  CK_CHECK_ARG(hidden_bytes > 0 && hidden_bytes % 16 == 0 && num_sf_packs >= 0, op,
               ": bytes per row must be a positive multiple of 16, got ", hidden_bytes, " (", num_sf_packs,
               " scale packs)");
  CK_CHECK_ARG(num_sf_packs <= kMaxSfPacks, op, ": num_sf_packs must be at most ", kMaxSfPacks,
               " (what the ranks' geometry words compare whole), got ", num_sf_packs);
  const int64_t need =
      zero_copy ? 0
                : buffer_layout_bytes(dispatch_token_layout(hidden_bytes, 1, num_sf_packs, num_topk).bytes, num_ranks,
                                      max_tokens);
  CK_CHECK_ARG(need <= buffer_bytes, op, ": ", num_ranks, " x ", max_tokens, " records of ", hidden_bytes,
               " bytes need ", need, " bytes of buffer, this one has ", buffer_bytes);
}

// Hybrid mode: the relay area the push stages records into and the forward kernel scans (both sized
// from the call's parameters) must lie inside the buffer.
void check_hybrid_layout(const char* op, int num_ranks, int num_scaleup_ranks, int64_t buffer_bytes,
                         int64_t hidden_bytes, int64_t num_sf_packs, int num_topk, int64_t max_tokens) {
  const auto hl = hybrid_dispatch_layout(dispatch_token_layout(hidden_bytes, 1, num_sf_packs, num_topk).bytes, num_topk,
                                         num_ranks, num_ranks / num_scaleup_ranks, max_tokens);
  CK_CHECK(hl.bytes <= buffer_bytes, op, ": hybrid mode needs ", hl.bytes, " bytes of buffer, this one has ",
           buffer_bytes);
}

}  // namespace

void Runtime::dispatch(const DispatchParams& p, int64_t stream, int64_t wait_stream) {
  check_dispatch_shape("dispatch", num_ranks_, num_buffer_bytes_, p.num_tokens, p.num_max_tokens_per_rank,
                       p.num_experts, p.num_topk, p.hidden_bytes, p.num_sf_packs, p.zero_copy != 0);
  CK_CHECK_ARG(p.expert_alignment >= 1 && p.num_sms >= 1, "dispatch: need expert_alignment >= 1 and num_sms >= 1, got ",
               p.expert_alignment, " and ", p.num_sms);
  set_device();
  stream_wait(stream, wait_stream, event_in_.get());
  DispatchParams q = p;
  // Tag of the host-mapped counts: a stale notify of an earlier, unsynchronised dispatch can still land
  // after this point, and its tag differs.
  host_tag_ = (host_tag_ + 1u) & 0x7fffffffu;
  if (host_tag_ == 0u) host_tag_ = 1u;
  q.host_tag = host_tag_;
  // The overlapped dispatch's epilogue starts after notify's event and counts on a push that pushes
  // nothing when notify refused: its push follows notify.
  if (q.overlap) q.concurrent_notify = 0;
  if (hybrid()) {
    // The Python layer plans hybrid dispatches this way; a bad plan must not write past the buffer.
    CK_CHECK(!q.overlap && !q.zero_copy, "dispatch: hybrid mode runs neither overlapped nor zero-copy");
    check_hybrid_layout("dispatch", num_ranks_, scaleup_, num_buffer_bytes_, q.hidden_bytes, q.num_sf_packs, q.num_topk,
                        q.num_max_tokens_per_rank);
    q.concurrent_notify = 0;  // the push stages records in the buffer notify's barrier makes free
  }
  if (q.zero_copy) {
    // The Python layer checked the layout (zero_copy_layout); a bad plan must not write past the buffer.
    CK_CHECK(q.direct_base != nullptr, "dispatch: zero_copy needs direct_base");
    CK_CHECK(q.zero_copy_x_offset >= 0 &&
                 q.zero_copy_x_offset + int64_t(num_ranks_) * q.num_max_tokens_per_rank * q.hidden_bytes <=
                     num_buffer_bytes_,
             "dispatch: the zero-copy receive area (offset ", q.zero_copy_x_offset, ") does not fit the buffer of ",
             num_buffer_bytes_, " bytes");
    if (!q.cached) q.concurrent_notify = 0;  // its push needs notify's direct_base
  }
  entered_ = true;
  launch_dispatch(view(), q, reinterpret_cast<void*>(stream), q.overlap ? notify_done_.get() : nullptr);
  CK_CUDA_CHECK(cudaGetLastError());
}

DispatchCounts Runtime::wait_dispatch_counts(int num_local_experts) {
  CK_CHECK_ARG(num_local_experts >= 1 && num_local_experts <= kMaxLocalExperts, "bad num_local_experts ",
               num_local_experts);
  const auto hl = host_workspace_layout();
  auto* rank_words = hl.rank_count.at<uint64_t>(host_ws_.get());
  auto* expert_words = hl.expert_count.at<uint64_t>(host_ws_.get());
  const uint64_t tag = host_tag_;
  int ready_ranks = 0, ready_experts = 0;
  int64_t num_recv = 0, num_expanded = 0;  // 64-bit: peers' words are summed before they are checked
  bool geometry = false;
  std::vector<int> per_expert, refused;
  per_expert.reserve(num_local_experts);
  // Each word carries the dispatch's tag, so words are taken one by one as they land.
  const int status = poll_host(
      [&] {
        while (ready_ranks < num_ranks_) {
          const uint64_t w = commkit::ld_acquire(&rank_words[ready_ranks]);
          if ((w >> 32) != tag) return false;
          if (w & kRefusedBit) refused.push_back(ready_ranks);
          geometry |= (w & kGeometryBit) != 0;
          num_recv += int64_t(w & kCountMask);
          ++ready_ranks;
        }
        while (ready_experts < num_local_experts) {
          const uint64_t w = commkit::ld_acquire(&expert_words[ready_experts]);
          if ((w >> 32) != tag) return false;
          per_expert.push_back(int(w & 0x7fffffffu));
          num_expanded += int64_t(w & 0x7fffffffu);
          ++ready_experts;
        }
        return true;
      },
      [&] { return uint64_t(ready_ranks) * 65536u + uint64_t(ready_experts); });
  if (status == 2) {
    broken_ = true;
    broken_reason_ = "a dispatch CPU wait timed out";
  }
  DispatchCounts out;
  out.ranks_ready = ready_ranks;
  out.experts_ready = ready_experts;
  if (status == 0 && geometry) {
    out.status = 4;  // take_geometry_mismatch says which peer and word
    return out;
  }
  if (status == 0 && !refused.empty()) {
    refused_ranks_ = refused;
    out.status = 3;
    return out;
  }
  out.status = status;
  CK_CHECK(num_recv <= INT32_MAX && num_expanded <= INT32_MAX, "dispatch: the peers' counts add up to ", num_recv,
           " received and ", num_expanded, " expanded rows, past what a dispatch can receive (a corrupted count word)");
  out.num_recv_tokens = int(num_recv);
  out.num_expanded_tokens = int(num_expanded);
  out.num_recv_tokens_per_expert = std::move(per_expert);
  return out;
}

std::tuple<std::vector<int>, int64_t, int64_t> Runtime::take_refusal() {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  std::vector<int> ranks = refused_ranks_;
  refused_ranks_.clear();
  const bool mine = std::find(ranks.begin(), ranks.end(), rank_) != ranks.end();
  if (!mine) return {ranks, 0, 0};
  auto* words = host_workspace_layout().ids.at<uint64_t>(host_ws_.get());
  uint64_t w = 0;
  const int status = poll_host(
      [&] {
        w = commkit::ld_acquire(&words[0]);
        return (w >> 32) == uint64_t(host_tag_);
      },
      [] { return 0; });
  if (status != 0) return {ranks, -1, 0};  // the report did not arrive: the count is unknown
  return {ranks, int64_t(w & 0xffffffffu), int64_t(words[1])};
}

std::optional<std::tuple<int, int, int64_t, int64_t>> Runtime::take_geometry_mismatch() {
  if (destroyed_ || !host_ws_) return std::nullopt;
  auto* g = host_workspace_layout().geometry.at<uint64_t>(host_ws_.get());
  const uint64_t total = commkit::ld_acquire(&g[0]);  // acquire: the report words were written before
  if (total == geometry_refusals_seen_) return std::nullopt;
  geometry_refusals_seen_ = total;
  return std::make_tuple(int(g[1] >> 8), int(g[1] & 0xffu), int64_t(g[2]), int64_t(g[3]));
}

std::pair<int64_t, int64_t> Runtime::take_masked_ids() {
  if (destroyed_ || !host_ws_) return {0, 0};
  auto* words = host_workspace_layout().ids.at<uint64_t>(host_ws_.get());
  const uint64_t total = commkit::ld_acquire(&words[2]);
  if (total == masked_ids_seen_) return {0, 0};
  const int64_t fresh = int64_t(total - masked_ids_seen_);
  masked_ids_seen_ = total;
  return {fresh, int64_t(words[3])};
}

void Runtime::dispatch_epilogue(const EpilogueParams& p, int64_t stream, int64_t join_stream) {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  // The forward kernel relays whole records (hidden bytes included) into the direct-mode layout.
  CK_CHECK(!hybrid() || (!p.overlap && !p.zero_copy),
           "dispatch epilogue: hybrid mode runs neither an overlapped nor a zero-copy epilogue");
  if (hybrid()) {
    // The forward kernel indexes the relay area and forward_dense with these values (the raw runtime's
    // caller fills them; the Python layer passes the dispatch's).
    check_dispatch_shape("dispatch epilogue", num_ranks_, num_buffer_bytes_, 0, p.num_max_tokens_per_rank,
                         p.num_experts, p.num_topk, p.hidden_bytes, p.num_sf_packs, p.zero_copy != 0);
    check_hybrid_layout("dispatch epilogue", num_ranks_, scaleup_, num_buffer_bytes_, p.hidden_bytes, p.num_sf_packs,
                        p.num_topk, p.num_max_tokens_per_rank);
  }
  set_device();
  if (p.overlap) {
    // Beside the push (still running on `stream`): start once notify finished, then join back.
    cudaStream_t epi = epi_stream_.get();
    CK_CUDA_CHECK(cudaStreamWaitEvent(epi, notify_done_.get(), 0));
    launch_dispatch_epilogue(view(), p, epi);
    CK_CUDA_CHECK(cudaGetLastError());
    CK_CUDA_CHECK(cudaEventRecord(epi_done_.get(), epi));
    CK_CUDA_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), epi_done_.get(), 0));
  } else {
    launch_dispatch_epilogue(view(), p, reinterpret_cast<void*>(stream));
    CK_CUDA_CHECK(cudaGetLastError());
  }
  stream_wait(join_stream, stream, event_out_.get());
}

void Runtime::combine(const CombineParams& p, int64_t stream, uint64_t wait_event, int64_t wait_stream,
                      int64_t join_stream) {
  CK_CHECK_ARG(p.num_sms >= 1 && p.hidden > 0 && p.hidden % 8 == 0, "combine: need num_sms >= 1 and a hidden that is "
               "a positive multiple of 8, got ", p.num_sms, " and ", p.hidden);
  CK_CHECK_ARG(p.num_topk >= 1 && p.num_topk <= kMaxTopk && p.num_combined_tokens >= 0 &&
                   p.num_combined_tokens <= p.num_max_tokens_per_rank,
               "combine: need 1 <= num_topk <= ", kMaxTopk, " and num_combined_tokens <= num_max_tokens_per_rank, got ",
               p.num_topk, ", ", p.num_combined_tokens, " and ", p.num_max_tokens_per_rank);
  set_device();
  stream_wait(stream, wait_stream, event_in_.get());
  auto* s = reinterpret_cast<void*>(stream);
  entered_ = true;
  if (hybrid()) {
    CK_CHECK(p.overlap_push_blocks == 0, "combine: hybrid mode has no overlapped combine");
    const bool multi = p.allow_multiple_reduction != 0;
    const auto hc = hybrid_combine_layout(combine_token_layout(p.hidden, 2, p.num_topk).bytes,
                                          combine_num_slots(num_ranks_, p.num_topk, multi),
                                          hybrid_stage_slots(num_ranks_, scaleup_, p.num_topk, multi),
                                          num_ranks_ / scaleup_, p.num_max_tokens_per_rank);
    CK_CHECK(hc.bytes <= num_buffer_bytes_, "combine: hybrid mode needs ", hc.bytes, " bytes of buffer, this one has ",
             num_buffer_bytes_);
  }
  if (p.overlap_push_blocks > 0) {
    CK_CHECK(wait_event == 0, "combine: previous_event_before_epilogue cannot gate an overlapped reduce");
    CK_CHECK(p.overlap_push_blocks < p.num_sms, "combine: overlap_push_blocks (", p.overlap_push_blocks,
             ") must leave reduce blocks of num_sms (", p.num_sms, ")");
    CK_CHECK(overlap_fits(num_ranks_, p.num_max_tokens_per_rank), "combine: ", num_ranks_, " ranks x ",
             p.num_max_tokens_per_rank, " tokens exceed the overlapped combine's arrival counters");
    launch_combine_overlapped(view(), p, s);
    CK_CUDA_CHECK(cudaGetLastError());
    stream_wait(join_stream, stream, event_out_.get());
    return;
  }
  launch_combine_push(view(), p, s);
  CK_CUDA_CHECK(cudaGetLastError());
  if (wait_event != 0)
    CK_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(s), reinterpret_cast<cudaEvent_t>(wait_event), 0));
  launch_combine_reduce(view(), p, s);
  CK_CUDA_CHECK(cudaGetLastError());
  stream_wait(join_stream, stream, event_out_.get());
}

}  // namespace elastic_ep
#endif  // COMMKIT_WITH_CUDA
