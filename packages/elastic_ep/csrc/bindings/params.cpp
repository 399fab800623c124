// elastic_ep/csrc/bindings/params.cpp -- the kernels' parameter blocks (kernels/launch.hpp) as Python
// classes, each from one table of its members (fields.hpp). Every build, CUDA or not: the Python
// runtime builds its blocks from plans (_native_plans.py) whose fields carry these names.
#include <pybind11/pybind11.h>

#include "bindings/bindings.hpp"
#include "bindings/fields.hpp"
#include "kernels/launch.hpp"

namespace elastic_ep::bindings {

template <>
const FieldTable<DispatchParams>& fields_of<DispatchParams>() {
  static const FieldTable<DispatchParams> t{"DispatchParams", {
      EP_FIELD(DispatchParams, x),
      EP_FIELD(DispatchParams, sf),
      EP_FIELD(DispatchParams, sf_token_stride),
      EP_FIELD(DispatchParams, sf_hidden_stride),
      EP_FIELD(DispatchParams, topk_idx),
      EP_FIELD(DispatchParams, topk_weights),
      EP_FIELD(DispatchParams, copied_topk_idx),
      EP_FIELD(DispatchParams, cumulative_stats),
      EP_FIELD(DispatchParams, psum_rank),
      EP_FIELD(DispatchParams, psum_expert),
      EP_FIELD(DispatchParams, unaligned_expert),
      EP_FIELD(DispatchParams, slot_idx),
      EP_FIELD(DispatchParams, num_tokens),
      EP_FIELD(DispatchParams, num_max_tokens_per_rank),
      EP_FIELD(DispatchParams, hidden_bytes),
      EP_FIELD(DispatchParams, num_sf_packs),
      EP_FIELD(DispatchParams, num_experts),
      EP_FIELD(DispatchParams, num_topk),
      EP_FIELD(DispatchParams, expert_alignment),
      EP_FIELD(DispatchParams, cached),
      EP_FIELD(DispatchParams, host_tag),
      EP_FIELD(DispatchParams, num_sms),
      EP_FIELD(DispatchParams, notify_atomic_masks),
      EP_FIELD(DispatchParams, refuse_bad_ids),
      EP_FIELD(DispatchParams, overlap),
      EP_FIELD(DispatchParams, concurrent_notify),
      EP_FIELD(DispatchParams, zero_copy),
      EP_FIELD(DispatchParams, zero_copy_x_offset),
      EP_FIELD(DispatchParams, direct_base),
      EP_FIELD(DispatchParams, forward_dense),
      EP_FIELD(DispatchParams, test_drop_scaleout_signals),
      EP_FIELD(DispatchParams, test_corrupt),
  }};
  return t;
}

template <>
const FieldTable<EpilogueParams>& fields_of<EpilogueParams>() {
  static const FieldTable<EpilogueParams> t{"EpilogueParams", {
      EP_FIELD(EpilogueParams, x),
      EP_FIELD(EpilogueParams, sf),
      EP_FIELD(EpilogueParams, sf_token_stride),
      EP_FIELD(EpilogueParams, sf_hidden_stride),
      EP_FIELD(EpilogueParams, recv_x),
      EP_FIELD(EpilogueParams, recv_sf),
      EP_FIELD(EpilogueParams, recv_sf_token_stride),
      EP_FIELD(EpilogueParams, recv_sf_hidden_stride),
      EP_FIELD(EpilogueParams, recv_topk_idx),
      EP_FIELD(EpilogueParams, recv_topk_weights),
      EP_FIELD(EpilogueParams, recv_src_metadata),
      EP_FIELD(EpilogueParams, psum_rank),
      EP_FIELD(EpilogueParams, psum_expert),
      EP_FIELD(EpilogueParams, unaligned_expert),
      EP_FIELD(EpilogueParams, num_max_tokens_per_rank),
      EP_FIELD(EpilogueParams, hidden_bytes),
      EP_FIELD(EpilogueParams, num_sf_packs),
      EP_FIELD(EpilogueParams, num_experts),
      EP_FIELD(EpilogueParams, num_topk),
      EP_FIELD(EpilogueParams, expert_alignment),
      EP_FIELD(EpilogueParams, do_expand),
      EP_FIELD(EpilogueParams, cached),
      EP_FIELD(EpilogueParams, do_zero_padding),
      EP_FIELD(EpilogueParams, num_sms),
      EP_FIELD(EpilogueParams, overlap),
      EP_FIELD(EpilogueParams, zero_copy),
      EP_FIELD(EpilogueParams, forward_dense),
  }};
  return t;
}

template <>
const FieldTable<CombineParams>& fields_of<CombineParams>() {
  static const FieldTable<CombineParams> t{"CombineParams", {
      EP_FIELD(CombineParams, x),
      EP_FIELD(CombineParams, topk_weights),
      EP_FIELD(CombineParams, src_metadata),
      EP_FIELD(CombineParams, psum_rank),
      EP_FIELD(CombineParams, combined_topk_idx),
      EP_FIELD(CombineParams, combined_x),
      EP_FIELD(CombineParams, combined_topk_weights),
      EP_FIELD(CombineParams, bias0),
      EP_FIELD(CombineParams, bias1),
      EP_FIELD(CombineParams, num_combined_tokens),
      EP_FIELD(CombineParams, num_max_tokens_per_rank),
      EP_FIELD(CombineParams, hidden),
      EP_FIELD(CombineParams, num_experts),
      EP_FIELD(CombineParams, num_topk),
      EP_FIELD(CombineParams, use_expanded_layout),
      EP_FIELD(CombineParams, allow_multiple_reduction),
      EP_FIELD(CombineParams, num_sms),
      EP_FIELD(CombineParams, overlap_push_blocks),
      EP_FIELD(CombineParams, num_x_rows),
      EP_FIELD(CombineParams, test_corrupt),
  }};
  return t;
}

template <>
const FieldTable<PpParams>& fields_of<PpParams>() {
  static const FieldTable<PpParams> t{"PpParams", {
      EP_FIELD(PpParams, x),
      EP_FIELD(PpParams, nbytes),
      EP_FIELD(PpParams, slot_bytes),
      EP_FIELD(PpParams, peer),
      EP_FIELD(PpParams, num_max_inflight),
      EP_FIELD(PpParams, num_sms),
      EP_FIELD(PpParams, numel),
      EP_FIELD(PpParams, dtype_code),
      EP_FIELD(PpParams, shape_word),
  }};
  return t;
}

template <>
const FieldTable<LlDispatchParams>& fields_of<LlDispatchParams>() {
  static const FieldTable<LlDispatchParams> t{"LlDispatchParams", {
      EP_FIELD(LlDispatchParams, x),
      EP_FIELD(LlDispatchParams, topk_idx),
      EP_FIELD(LlDispatchParams, recv_x),
      EP_FIELD(LlDispatchParams, recv_scales),
      EP_FIELD(LlDispatchParams, recv_scales_ue8m0),
      EP_FIELD(LlDispatchParams, recv_count),
      EP_FIELD(LlDispatchParams, recv_src_info),
      EP_FIELD(LlDispatchParams, recv_route),
      EP_FIELD(LlDispatchParams, recv_layout_range),
      EP_FIELD(LlDispatchParams, recv_self_pos),
      EP_FIELD(LlDispatchParams, cumulative_stats),
      EP_FIELD(LlDispatchParams, wait_stats),
      EP_FIELD(LlDispatchParams, half_offset),
      EP_FIELD(LlDispatchParams, num_tokens),
      EP_FIELD(LlDispatchParams, num_max_tokens),
      EP_FIELD(LlDispatchParams, hidden),
      EP_FIELD(LlDispatchParams, num_experts),
      EP_FIELD(LlDispatchParams, num_topk),
      EP_FIELD(LlDispatchParams, use_fp8),
      EP_FIELD(LlDispatchParams, round_scale),
      EP_FIELD(LlDispatchParams, use_ue8m0),
      EP_FIELD(LlDispatchParams, half),
      EP_FIELD(LlDispatchParams, phases),
      EP_FIELD(LlDispatchParams, shrink),
      EP_FIELD(LlDispatchParams, num_sms),
      EP_FIELD(LlDispatchParams, own_in_place),
  }};
  return t;
}

template <>
const FieldTable<LlCombineParams>& fields_of<LlCombineParams>() {
  static const FieldTable<LlCombineParams> t{"LlCombineParams", {
      EP_FIELD(LlCombineParams, x),
      EP_FIELD(LlCombineParams, topk_idx),
      EP_FIELD(LlCombineParams, topk_weights),
      EP_FIELD(LlCombineParams, recv_count),
      EP_FIELD(LlCombineParams, src_info),
      EP_FIELD(LlCombineParams, route),
      EP_FIELD(LlCombineParams, self_pos),
      EP_FIELD(LlCombineParams, combined_x),
      EP_FIELD(LlCombineParams, wait_stats),
      EP_FIELD(LlCombineParams, half_offset),
      EP_FIELD(LlCombineParams, num_tokens),
      EP_FIELD(LlCombineParams, num_max_tokens),
      EP_FIELD(LlCombineParams, hidden),
      EP_FIELD(LlCombineParams, num_experts),
      EP_FIELD(LlCombineParams, num_topk),
      EP_FIELD(LlCombineParams, half),
      EP_FIELD(LlCombineParams, phases),
      EP_FIELD(LlCombineParams, shrink),
      EP_FIELD(LlCombineParams, num_sms),
  }};
  return t;
}

template <>
const FieldTable<ScaleoutProbeParams>& fields_of<ScaleoutProbeParams>() {
  static const FieldTable<ScaleoutProbeParams> t{"ScaleoutProbeParams", {
      EP_FIELD(ScaleoutProbeParams, next),
      EP_FIELD(ScaleoutProbeParams, prev),
      EP_FIELD(ScaleoutProbeParams, src),
      EP_FIELD(ScaleoutProbeParams, dst),
      EP_FIELD(ScaleoutProbeParams, bytes),
      EP_FIELD(ScaleoutProbeParams, round),
  }};
  return t;
}

void bind_params(pybind11::module_& m) {
  bind_fields<DispatchParams>(m, "A dispatch's notify + push launch (kernels/launch.hpp).");
  bind_fields<EpilogueParams>(m, "A dispatch's copy-epilogue launch (kernels/launch.hpp).");
  bind_fields<CombineParams>(m, "A combine's launches (kernels/launch.hpp).");
  bind_fields<PpParams>(m, "One PP send or receive (kernels/launch.hpp).");
  bind_fields<LlDispatchParams>(m, "A low-latency dispatch's phases (kernels/launch.hpp).");
  bind_fields<LlCombineParams>(m, "A low-latency combine's phases (kernels/launch.hpp).");
  bind_fields<ScaleoutProbeParams>(m, "One ring step of the scale-out probe (kernels/launch.hpp).");
}

}  // namespace elastic_ep::bindings
