// elastic_ep/csrc/kernels/hybrid.cuh -- hybrid mode's forwarders: the kernels that relay rows between a
// scale-out domain and the scale-up domain of this rank.
//
// Hybrid mode (DeepEP V2's scale-out + scale-up): R = S * U ranks in S logical scale-out domains of U
// ranks; rank dom * U + rail talks across domains only to its rail peers d * U + rail, through the
// scale-out transport (scaleout.cuh). Layouts: sizing.hpp (hybrid_dispatch_layout,
// hybrid_combine_layout). The receive areas are direct mode's, so the dispatch epilogue and the
// combine reduce are direct mode's kernels and the outputs are bitwise direct mode's.
//
// Dispatch (notify -> push -> forward -> epilogue, one stream):
//   notify   direct mode's; a rail peer passes the counts and the geometry words of the other domains
//            on to its domain (dispatch_notify.cuh), so a rank of another geometry is refused by
//            every rank, by name, before anything is pushed or relayed
//   push     own domain: records straight into the destinations' receive areas [src][slot]; other
//            domains: one staged record per (token, domain), with its route (the slot at each lane's
//            owner) and its stamp (hybrid_stamp: epoch, source domain, token), put into the relay area
//            of the rail peer there, [index of the source domain among the S - 1 others][token]; then
//            the rail peers' scale-out signals
//   forward  (here) waits for each rail peer's signal, scans its relay area for records stamped for
//            this dispatch, writes each to the ranks of this domain that own its experts, at the slot
//            of the route ([src][slot], as the source's own push would have), and signals their
//            dispatch_done for that source; records what it relayed in forward_dense [S][M]
//            (src_global, mask of the destinations here), from which the host builds the handle's
//            token_metadata_at_forward and channel_linked_list. A record whose expert ids or route
//            are out of range is a corrupted word (kProtocolRoute): relayed nowhere, reported, and
//            then only this rank hears that the rows are complete (its peers here time out)
//   epilogue direct mode's
//
// Combine (push -> forward -> reduce):
//   push     rows for the own domain's origins straight into their receive areas; rows for another
//            domain's origin into the stage area of this domain's rail peer of the origin, by the
//            slot they take at the origin (per-rank slots: only this domain's U), each stamped; then
//            combine_done to the own domain
//   forward  (here) waits for its domain's combine_done, puts every stamped slot of each rail peer's
//            stage area into that peer's receive area over the scale-out transport (the partials
//            unreduced: the reduce sums them in direct mode's order), then raises the peers' signals;
//            the only peer words it reads are the stamps, compared whole (slots and tokens are its
//            loop's; the stage cells were addressed from the epilogue's checked source ids)
//   reduce   waits for the own domain's combine_done and one signal per rail peer, then direct mode's
//
// The forward kernels take the scale-out transport (SO, scaleout.cuh) as a parameter: launch.cu launches
// them over the runtime's (GIN across NVLink domains, else the NVLink emulation). Notify and the entry
// barriers reach other domains through it too (the rail peers), so nothing of hybrid mode's dispatch,
// combine or barrier touches another domain's window directly: the runtime leaves those ranks' LSA
// pointers null (CommView::peer_bases), on the emulation as over GIN.
// Grid: num_sms blocks of kThreads; one warp per (source domain, token). Included once, by launch.cu.
#pragma once

#include "device_common.cuh"

namespace elastic_ep {
namespace {

// Dispatch forward: the rail peers' staged records into this domain's receive areas.
template <class SO>
__global__ void __launch_bounds__(kThreads, 1) hybrid_dispatch_forward_kernel(
    CommView c,        // the window; relay area [S-1][M][record | route] in this rank's buffer
    EpilogueParams p,  // shape (M, hidden bytes, packs, K, experts); forward_dense [S * M, 2] or null
    SO so) {           // scale-out transport: the rail peers' signals
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  // Notify refused the dispatch (a rank's other geometry: nobody pushed; or a corrupted word here).
  if (dispatch_refused(cx, E)) return;
  const int R = c.num_ranks, K = p.num_topk, M = p.num_max_tokens_per_rank;
  const int L = p.num_experts / R;
  const int tid = threadIdx.x, lane = lane_id();
  const HybridDomains& hd = cx.hd;
  const auto tl = dispatch_token_layout(p.hidden_bytes, 1, p.num_sf_packs, K);
  const HybridDispatchLayout hl = hybrid_dispatch_layout(tl.bytes, K, R, hd.S, M);
  // Every block waits for the rail peers' pushes (one thread per domain).
  bool ok = true;
  if (tid < hd.S && tid != hd.dom) ok = wait_rail_signal(cx, so, hd.rail_peer(tid), kOpDispatchScaleout, cx.timeout_ns);
  if (__syncthreads_or(!ok)) return;
  const int gw = blockIdx.x * kWarps + tid / 32, nw = gridDim.x * kWarps;
  for (int64_t v = gw; v < int64_t(hd.S - 1) * M; v += nw) {
    const int d = hd.other_domain(int(v / M)), t = int(v % M);
    const uint64_t off = cx.buf + uint64_t(hl.relay) + uint64_t(v) * uint64_t(hl.staged_bytes);
    const char* rec = cx.tr.local(off);
    const int32_t* route = reinterpret_cast<const int32_t*>(rec + tl.bytes);
    uint64_t stamp = 0;
    if (lane == 0)
      stamp = __ldcg(reinterpret_cast<const unsigned long long*>(rec + tl.bytes + hybrid_route_stamp_offset(K)));
    if (__shfl_sync(kFull, stamp, 0) != hybrid_stamp(E, uint64_t(d) * M + t)) continue;  // none of this dispatch
    const int src = hd.rail_peer(d);
    // The record's expert ids and route are the source's words: an id outside [-1, E) or a slot
    // outside [0, M) for a rank here is a corrupted record, relayed nowhere and reported (the last
    // block then tells no other rank here that the rows are complete).
    int owner = -1, slot = -1, bad = -1, bound = 0;
    if (lane < K) {
      const int e = __ldcg(reinterpret_cast<const int*>(rec + tl.topk_idx.offset) + lane);
      slot = __ldcg(route + lane);
      owner = owner_of(e, p.num_experts, L);
      if (owner >= 0 && !hd.local(owner)) owner = -1;
      if (e < -1 || e >= p.num_experts)
        bad = e, bound = p.num_experts;
      else if (owner >= 0 && (slot < 0 || slot >= M))
        bad = slot, bound = M;
    }
    const unsigned bad_lanes = __ballot_sync(kFull, bound != 0);
    if (bad_lanes != 0u) {
      if (lane == __ffs(bad_lanes) - 1)
        report_protocol_once(cx, c, src, kProtocolRoute, uint64_t(int64_t(bad)), uint64_t(bound));
      continue;
    }
    const unsigned dests = __ballot_sync(kFull, is_master_lane(owner, K));
    for (unsigned m = dests; m; m &= m - 1) {
      const int k = __ffs(m) - 1;
      const int r = __shfl_sync(kFull, owner, k), sl = __shfl_sync(kFull, slot, k);
      // The record landed before the signal this kernel waited for: L2 loads (no stale L1 line).
      warp_copy_v4<4, false, true>(reinterpret_cast<int4*>(cx.tr.remote(r, cx.buf + (uint64_t(src) * M + sl) * tl.bytes)),
                                   reinterpret_cast<const int4*>(rec), int(tl.bytes / 16), lane);
    }
    const unsigned mask = __reduce_or_sync(kFull, owner >= 0 ? 1u << (owner - hd.dom * hd.U) : 0u);
    if (p.forward_dense != nullptr && lane == 0) {
      int* row = p.forward_dense + 2 * (int64_t(d) * M + t);
      row[0] = src * M + t;
      row[1] = int(mask);
    }
  }
  // The last block: every relayed record is written, so each destination here may read this
  // domain's rows of every rail peer's source. After a protocol error (this kernel's or an earlier
  // one's: the runtime is unusable) only this rank is told: the others here would read slots this
  // kernel left unwritten, and time out naming this rank as the relayer of the source's records (WaitFor);
  // this rank's host raises the report.
  grid_finish(cx, kCtrHybridForward, [&] {
    count_rail_signals(cx, hd);
    const bool reported = commkit::ld_relaxed(&cx.counters[kCtrProtocolReported]) != 0u;
    for (int d = 0; d < hd.S; ++d)
      if (d != hd.dom)
        for (int r = hd.dom * hd.U; r < (hd.dom + 1) * hd.U; ++r)
          if (!reported || r == c.rank) cx.tr.signal(r, cx.ws.dispatch_done.offset + 8ull * hd.rail_peer(d), E);
  });
}

// Combine forward: this domain's partials for each rail peer's tokens, over the scale-out transport.
template <class SO>
__global__ void __launch_bounds__(kThreads, 1) hybrid_combine_forward_kernel(
    CommView c,       // the window; stage area [S-1][M][stage slots][record] and stamps in this rank's buffer
    CombineParams p,  // shape (M, hidden, K, multiple reduction)
    SO so) {          // scale-out transport: puts into the rail peers' receive areas [M][slots][record]
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  const int R = c.num_ranks, rank = c.rank, M = p.num_max_tokens_per_rank;
  const int tid = threadIdx.x, lane = lane_id();
  const HybridDomains& hd = cx.hd;
  const CombineGeom g(p, R);
  const int stage_slots = int(hybrid_stage_slots(R, hd.U, p.num_topk, p.allow_multiple_reduction != 0));
  const HybridCombineLayout hc = hybrid_combine_layout(g.tl.bytes, g.slots, stage_slots, hd.S, M);
  bool ok = true;
  if (tid < hd.U) {
    const int r = hd.dom * hd.U + tid;
    ok = commkit::wait_ge(cx.local_u64(cx.ws.combine_done, r), E, cx.timeout_ns, cx.rec, kOpCombineScaleup, rank, r);
  }
  if (__syncthreads_or(!ok)) return;
  const unsigned long long* tags = reinterpret_cast<const unsigned long long*>(cx.tr.local(cx.buf + uint64_t(hc.tags)));
  const int gw = blockIdx.x * kWarps + tid / 32, nw = gridDim.x * kWarps;
  for (int64_t v = gw; v < int64_t(hd.S - 1) * M; v += nw) {
    const int origin = hd.rail_peer(hd.other_domain(int(v / M))), t = int(v % M);
    for (int q0 = 0; q0 < stage_slots; q0 += 32) {
      const int q = q0 + lane;
      const uint64_t cell = uint64_t(v) * stage_slots + q;
      const bool filled = q < stage_slots && __ldcg(tags + cell) == hybrid_stamp(E, cell);
      for (unsigned m = __ballot_sync(kFull, filled); m; m &= m - 1) {
        const int sq = q0 + __ffs(m) - 1;
        const int sl = g.per_rank ? hd.dom * hd.U + sq : sq;  // the slot in the origin's recv area
        so.put(origin, cx.buf + (uint64_t(t) * g.slots + sl) * g.tl.bytes,
               cx.buf + uint64_t(hc.stage) + (uint64_t(v) * stage_slots + sq) * g.tl.bytes, g.tl.bytes, lane);
      }
    }
  }
  so.flush(lane);  // GIN: this warp's puts have left before the last block signals
  grid_finish(cx, kCtrHybridForward, [&] {
    for (int d = 0; d < hd.S; ++d)
      if (d != hd.dom) so.signal(hd.rail_peer(d), rank, 1u);
  });
}

}  // namespace
}  // namespace elastic_ep
