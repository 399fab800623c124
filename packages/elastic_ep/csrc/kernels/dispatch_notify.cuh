// elastic_ep/csrc/kernels/dispatch_notify.cuh -- dispatch, step 1: count tokens per rank/expert, give each token its slot,
// exchange the counts and publish prefix sums and host counts.
// Included once, by launch.cu (the package's one CUDA translation unit).
#pragma once

#include "device_common.cuh"

namespace elastic_ep {
namespace {

// ------------------------------------------------------------------------------ dispatch: notify
// Hybrid mode: window offset of word w of the block that this rank's rail peer in domain d relays
// for this rank's domain (sizing.hpp hybrid_count_block_words: [U rank words | U * L expert words]).
__device__ __forceinline__ uint64_t count_relay_offset(const Ctx& cx, int L, int d, int w) {
  const int64_t words = hybrid_count_block_words(cx.hd.U, L);
  return cx.ws.count_relay.offset + 8ull * uint64_t(HybridDomains::other_index(cx.hd.dom, d) * words + w);
}

// Hybrid mode (every thread of notify's last block): the count words each rail peer sent for this
// domain, passed on to the ranks here as the rail peer's own words (direct mode's places, tags
// unchanged). False (this thread) when a rail peer's words did not come within the deadline.
__device__ bool relay_counts(const Ctx& cx, int L, uint64_t E) {
  const HybridDomains& hd = cx.hd;
  const int W = int(hybrid_count_block_words(hd.U, L));
  for (int j = threadIdx.x; j < (hd.S - 1) * W; j += kThreads) {
    const int src = hd.rail_peer(hd.other_domain(j / W)), w = j % W;
    uint64_t* word = cx.local_u64(cx.ws.count_relay, j);
    if (!commkit::wait_tag_ge(word, uint32_t(E), cx.timeout_ns, cx.rec, kOpDispatchNotify, cx.tr.rank, src))
      return false;
    const uint64_t v = commkit::ld_relaxed(word);
    const int u = w < hd.U ? w : (w - hd.U) / L;
    const uint64_t at = w < hd.U ? cx.ws.rank_count.offset + 8ull * src
                                 : cx.ws.expert_count.offset + 8ull * (uint64_t(src) * L + (w - hd.U) % L);
    cx.tr.put_u64(hd.dom * hd.U + u, at, v);
  }
  return true;
}

// Hybrid mode (every thread of notify's last block, before check_geometry): the geometry words each
// rail peer sent, passed on to the other ranks of this domain at the rail peer's place, so that every
// rank compares every rank's (a rank of another geometry is refused by name everywhere, as in direct
// mode). False (this thread) when a rail peer's words did not come within the deadline.
__device__ bool relay_geometry(const Ctx& cx, uint64_t E) {
  const HybridDomains& hd = cx.hd;
  for (int j = threadIdx.x; j < (hd.S - 1) * kGeometryWords; j += kThreads) {
    const int src = hd.rail_peer(hd.other_domain(j / kGeometryWords)), i = src * kGeometryWords + j % kGeometryWords;
    const uint64_t* word = cx.local_u64(cx.ws.geometry, i);
    if (!commkit::wait_tag_ge(word, uint32_t(E), cx.timeout_ns, cx.rec, kOpDispatchNotify, cx.tr.rank, src))
      return false;
    const uint64_t v = commkit::ld_relaxed(word);
    for (int b = 0; b < hd.U; ++b)
      if (b != hd.rail) cx.tr.put_u64(hd.dom * hd.U + b, cx.ws.geometry.offset + 8ull * uint64_t(i), v);
  }
  return true;
}

// Notify's last block ends with its outcome (every thread of the block calls this, once).
__device__ void notify_outcome(const Ctx& cx, uint64_t E, NotifyStatus status) {
  __syncthreads();  // the block's stores (prefix sums, host counts) precede the release below
  if (threadIdx.x == 0) commkit::st_release_gpu(cx.counter_u64(kCtrDispatchOutcome), (E << 2) | uint64_t(status));
}

// Notify refuses the dispatch on every rank alike (a peer's geometry differs: every rank sees it) or on
// this one (a corrupted count word from `peer`), before any count or record is used: the host words
// carry the geometry bit (a CPU-synced host raises at once), the report says which peer and what (a
// host without CPU sync raises at its next call); the push writes nothing to a peer of another geometry
// and ends the operation, an epilogue launched without CPU sync returns at once.
__device__ void refuse_dispatch(const CommView& c, const DispatchParams& p, uint64_t E, const Ctx& cx, int L,
                                int peer, int what, uint64_t theirs, uint64_t mine) {
  const auto hl = host_workspace_layout();
  const uint64_t tag = uint64_t(p.host_tag) << 32;
  auto* host_rank = hl.rank_count.at<uint64_t>(c.host_workspace);
  auto* host_expert = hl.expert_count.at<uint64_t>(c.host_workspace);
  for (int s = threadIdx.x; s < c.num_ranks; s += kThreads) commkit::st_relaxed(&host_rank[s], tag | kGeometryBit);
  for (int l = threadIdx.x; l < L; l += kThreads) commkit::st_relaxed(&host_expert[l], tag);
  if (threadIdx.x == 0) report_to_host(c, peer, what, theirs, mine);
  notify_outcome(cx, E, kNotifyRefused);
}

// Slots: a token bound for rank r gets slot = number of earlier tokens of this rank bound for r (a
// token counts once per rank, however many of its experts live there).
// Grid: notify_split(T).blocks blocks (1 in cached mode), block b counting the tokens of its range
// [b * span, (b+1) * span). A block writes slots relative to its range and its per-rank totals to the
// workspace; the last block to finish turns the totals into per-block bases (which the push kernel
// adds to the slots) and runs the rest alone: counts to the peers, the wait for theirs, the prefix
// sums and the host-visible counts. (One block for all tokens was instruction-bound: 23 us at 4096
// tokens x top-8.)
// KB: compile-time bound on num_topk (8, 16 or 32), so the per-element arrays below live in registers.
// Dynamic shared memory: two [kWarps][R] u32 arrays, 256 * R bytes (sized in launch_dispatch).
// Hybrid mode: counts and geometry words for another domain's ranks go to the rail peer there, which
// passes them on (relay_counts, relay_geometry); the entry goes to the own domain and the rail peers
// (entry_barrier).
// SO: the scale-out transport (scaleout.cuh), used in hybrid mode only.
template <int KB, class SO>
__global__ void __launch_bounds__(kThreads, 1) dispatch_notify(CommView c, DispatchParams p, SO so) {
  __shared__ int expert_cnt[kMaxExperts];
  __shared__ uint8_t owner_tab[kMaxExperts];  // owner rank of each expert (a division per id otherwise)
  __shared__ int running[kMaxRanks];
  __shared__ unsigned int s_bad_ids;
  __shared__ long long s_bad_example;
  __shared__ int scan_scratch[kWarps];
  extern __shared__ uint32_t notify_dyn[];
  Ctx cx(c);
  const uint64_t E = cx.epoch();
  const int R = c.num_ranks, rank = c.rank, K = p.num_topk, T = p.num_tokens;
  const int L = p.num_experts / R;
  const int tid = threadIdx.x, lane = lane_id(), warp = tid / 32;
  // wmask[w][r]: bit j set when token j of warp w's 32 tokens (of the current chunk) goes to rank r.
  // wpre[w][r]:  slot at rank r of the first such token.
  uint32_t* wmask = notify_dyn;
  int* wpre = reinterpret_cast<int*>(notify_dyn + kWarps * R);

  // Publish "entered E" first so peers can start while we count, and the call's geometry.
  if (blockIdx.x == 0 && tid < R) publish_entry(cx, so, tid, E);
  if (blockIdx.x == 0) publish_geometry(cx, so, p, E);
  // The push may be this grid's programmatic dependent (launch_dispatch): it may launch once every
  // block of this grid has started, and then waits for kCtrDispatchReady itself.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

  if (!p.cached) {
    static_assert(kMaxRanks <= 256, "owner_tab holds ranks in 8 bits");
    for (int i = tid; i < p.num_experts; i += kThreads) {
      expert_cnt[i] = 0;
      owner_tab[i] = static_cast<uint8_t>(i / L);
    }
    for (int i = tid; i < R; i += kThreads) running[i] = 0;
    if (tid == 0) s_bad_ids = 0u;
    __syncthreads();
    // Token of element q within its warp, q / K, as a multiply by ceil(2^32 / K): exact for every
    // q < 32 * KB <= 1024 and K <= 32 (checked exhaustively), and a tenth of a division's instructions.
    // (floor((2^32 - 1) / K) + 1 is that ceiling for every K >= 1, with a 32-bit division.)
    const uint64_t k_magic = uint64_t(0xffffffffu / unsigned(K)) + 1u;
    // Every global access of the [T, K] arrays is warp-coalesced: warp w of a chunk owns tokens
    // wbase .. wbase+31, whose K ids are the 32*K consecutive elements wbase*K + q; lane q%32 holds
    // element q in round q/32, i.e. id q%K of token q/K of the warp. The per-rank token sets of the
    // warp are built as 32-bit masks (a warp OR-reduction per rank, or shared atomics when R > 32),
    // and every element finds its slot from its owner's mask, without moving ids between lanes.
    // (The previous version moved the ids into a token-per-lane layout and back, with K*K shuffles
    // per direction and element.)
    const NotifySplit split = notify_split(T);
    const int tok_begin = int(blockIdx.x) * split.span;
    const int tok_end = T < tok_begin + split.span ? T : tok_begin + split.span;
    const int64_t n_elems = int64_t(tok_end) * K;
    const bool by_reduction = R <= 32 && !p.notify_atomic_masks;
    static_assert(kNotifyChunkTokens == kThreads, "a chunk is one token per thread");
    for (int base = tok_begin; base < tok_end; base += kThreads) {
      const int64_t wfirst = int64_t(base + warp * 32) * K;  // first element of this warp's tokens
      if (!by_reduction)
        for (int i = lane; i < R; i += 32) wmask[warp * R + i] = 0u;  // only this warp touches its row
      __syncwarp();
      // Element round*32 + lane: -1 when masked / invalid / past the end, else (token within the
      // warp << 16) | owner rank, one packed register per element.
      int ot[KB];
      // Elements q of this warp exist for q < rem; indices and bounds are 32-bit from here on.
      const int rem = int(n_elems - wfirst < int64_t(32 * KB) ? n_elems - wfirst : int64_t(32 * KB));
      const int64_t* src = p.topk_idx + wfirst + lane;
      int64_t* copy = p.copied_topk_idx != nullptr ? p.copied_topk_idx + wfirst + lane : nullptr;
      // Loads in groups of G, each group issued before any store: the copy into
      // copied_topk_idx may alias topk_idx as far as the compiler knows, so interleaved load/store
      // pairs would serialise one memory round trip per element in this single block.
      constexpr int G = KB < 8 ? KB : 8;
#pragma unroll
      for (int it0 = 0; it0 < KB; it0 += G) {
        int64_t ev[G];
#pragma unroll
        for (int j = 0; j < G; ++j) {
          const int it = it0 + j;
          ev[j] = (it < K && it * 32 + lane < rem) ? src[it * 32] : -1;
        }
#pragma unroll
        for (int j = 0; j < G; ++j) {
          const int it = it0 + j;
          const int q = it * 32 + lane;
          ot[it] = -1;
          if (it < K && q < rem) {
            const int64_t e = ev[j];
            if (copy != nullptr) copy[it * 32] = e;
            if (e >= 0 && e < p.num_experts) {
              const int tok = int((uint64_t(q) * k_magic) >> 32);
              ot[it] = (tok << 16) | int(owner_tab[e]);
              atomicAdd(&expert_cnt[e], 1);
            } else if (e != -1) {
              atomicAdd(&s_bad_ids, 1u);
              s_bad_example = static_cast<long long>(e);
            }
          }
        }
      }
      if (by_reduction) {
        for (int r = 0; r < R; ++r) {
          uint32_t bits = 0u;
#pragma unroll
          for (int it = 0; it < KB; ++it)
            if (ot[it] >= 0 && (ot[it] & 0xffff) == r) bits |= 1u << (ot[it] >> 16);
          const uint32_t m = __reduce_or_sync(kFull, bits);
          if (lane == 0) wmask[warp * R + r] = m;
        }
      } else {
#pragma unroll
        for (int it = 0; it < KB; ++it)
          if (ot[it] >= 0) atomicOr(&wmask[warp * R + (ot[it] & 0xffff)], 1u << (ot[it] >> 16));
      }
      __syncthreads();
      // Slot bases: per rank, an exclusive scan over the warps (one warp per rank, lane = warp).
      static_assert(kWarps == 32, "one lane per warp");
      for (int r = warp; r < R; r += kWarps) {
        const int c = __popc(wmask[lane * R + r]);
        int incl = c;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
          const int y = __shfl_up_sync(kFull, incl, d);
          if (lane >= d) incl += y;
        }
        const int base_r = running[r];
        wpre[lane * R + r] = base_r + incl - c;
        __syncwarp();
        if (lane == 31) running[r] = base_r + incl;
      }
      __syncthreads();
      int* slots = p.slot_idx + wfirst + lane;
#pragma unroll
      for (int it = 0; it < KB; ++it) {
        if (it < K && it * 32 + lane < rem) {
          int v = -1;
          if (ot[it] >= 0) {
            const int r = ot[it] & 0xffff;
            v = wpre[warp * R + r] + __popc(wmask[warp * R + r] & ((1u << (ot[it] >> 16)) - 1u));
          }
          slots[it * 32] = v;
        }
      }
      __syncthreads();  // wmask / wpre are rewritten by the next chunk
    }
    // This block's share to the workspace, then the last block to arrive goes on alone.
    uint32_t* g_expert = cx.ws.notify_expert.at<uint32_t>(c.window_base);
    uint32_t* g_block_cnt = cx.ws.notify_block_cnt.at<uint32_t>(c.window_base);
    uint32_t* g_block_base = cx.ws.notify_block_base.at<uint32_t>(c.window_base);
    unsigned long long* g_bad = cx.ws.notify_bad.at<unsigned long long>(c.window_base);
    for (int e = tid; e < p.num_experts; e += kThreads)
      if (expert_cnt[e] != 0) atomicAdd(&g_expert[e], uint32_t(expert_cnt[e]));
    for (int r = tid; r < R; r += kThreads) g_block_cnt[blockIdx.x * R + r] = uint32_t(running[r]);
    if (tid == 0 && s_bad_ids != 0u) {
      g_bad[1] = static_cast<unsigned long long>(s_bad_example);  // any block's example will do
      atomicAdd(&g_bad[0], static_cast<unsigned long long>(s_bad_ids));
    }
    // The stores and atomics above are GPU-local: GPU-scope arrival.
    if (!commkit::grid_arrive_last<false>(&cx.counters[kCtrDispatchNotify])) return;
    // L2 reads (__ldcg): the other blocks' data never passed through this SM's L1.
    for (int r = tid; r < R; r += kThreads) {
      uint32_t acc = 0;
      for (int b = 0; b < int(gridDim.x); ++b) {
        g_block_base[b * R + r] = acc;
        acc += __ldcg(&g_block_cnt[b * R + r]);
      }
      running[r] = int(acc);
    }
    // Every slot is final once the bases are written: a push running beside this kernel starts now,
    // while this block exchanges the counts.
    __syncthreads();
    if (tid == 0) commkit::st_release_gpu(cx.counter_u64(kCtrDispatchReady), E);
    for (int e = tid; e < p.num_experts; e += kThreads) {
      expert_cnt[e] = int(__ldcg(&g_expert[e]));
      g_expert[e] = 0u;  // the workspace stays zeroed for the next dispatch
    }
    // Ids outside [-1, E). With a CPU sync (refuse_bad_ids) the whole dispatch is refused: this rank
    // flags its count words to the peers, every rank sees the flag after the count exchange, nobody
    // pushes, and every host raises. Without a CPU sync such ids were sent nowhere (as if masked) and
    // the host learns of them from a running total it compares with what it last saw (one writer:
    // notify kernels run one after another on the communication stream).
    __shared__ unsigned long long s_bad_total;
    if (tid == 0) {
      const unsigned long long bad = __ldcg(&g_bad[0]);
      s_bad_total = bad;
      if (bad != 0ull && p.refuse_bad_ids) {
        uint64_t* ids = host_workspace_layout().ids.at<uint64_t>(c.host_workspace);
        ids[1] = static_cast<uint64_t>(__ldcg(&g_bad[1]));
        commkit::st_release(&ids[0], (uint64_t(p.host_tag) << 32) | uint64_t(bad & 0x7fffffffull));
        g_bad[0] = 0ull;
      } else if (bad != 0ull) {
        uint64_t* ids = host_workspace_layout().ids.at<uint64_t>(c.host_workspace);
        ids[3] = static_cast<uint64_t>(__ldcg(&g_bad[1]));
        commkit::st_release(&ids[2], commkit::ld_relaxed(&ids[2]) + uint64_t(bad));
        g_bad[0] = 0ull;
      }
    }
    __syncthreads();
    // Counts to the peers: (tag << 32) | count with tag = E mod 2^32 (compared in serial-number order,
    // commkit::wait_tag_ge), one self-contained word each. The receiver validates every word by its
    // tag and reads nothing else they would have to order, so plain stores
    // do; a release per word is not needed (replacing it changed nothing measurable at EP 1, where
    // the stores are local; over NVLink it saves one system fence per word).
    const uint64_t refuse_bit = (p.refuse_bad_ids && s_bad_total != 0ull) ? kRefusedBit : 0ull;
    const uint64_t tag = uint64_t(uint32_t(E)) << 32;
    const HybridDomains& hd = cx.hd;
    for (int r = tid; r < R; r += kThreads) {
      uint64_t w = tag | refuse_bit | uint64_t(running[r]);
      if (p.test_corrupt == 1 && r == (rank + 1) % R && r != rank)
        w = tag | refuse_bit | uint64_t(p.num_max_tokens_per_rank + 1);
      if (hd.local(r))
        cx.tr.put_u64(r, cx.ws.rank_count.offset + 8ull * rank, w);
      else
        so.put_value(hd.rail_peer(r / hd.U), count_relay_offset(cx, L, r / hd.U, r % hd.U), w);
    }
    for (int e = tid; e < p.num_experts; e += kThreads) {
      const int r = e / L, l = e % L;
      uint64_t w = tag | uint64_t(expert_cnt[e]);
      if (p.test_corrupt == 5 && r == (rank + 1) % R && r != rank && l == 0)
        w = tag | (uint64_t(p.num_topk) * uint64_t(p.num_max_tokens_per_rank) + 1ull);
      if (hd.local(r))
        cx.tr.put_u64(r, cx.ws.expert_count.offset + 8ull * (rank * L + l), w);
      else
        so.put_value(hd.rail_peer(r / hd.U), count_relay_offset(cx, L, r / hd.U, hd.U + e - (r / hd.U) * hd.U * L), w);
    }
    // Zero-copy: a sender's rows start at the receiver's psum_rank[sender - 1], the tokens every
    // lower-ranked sender sends there. Each rank's row of counts goes to the higher-ranked peers,
    // the only ones that need it.
    if (p.zero_copy)
      for (int i = tid; i < (R - 1 - rank) * R; i += kThreads) {
        const int q = rank + 1 + i / R, r = i % R;
        cx.tr.put_u64(q, cx.ws.count_matrix.offset + 8ull * (uint64_t(rank) * R + r), tag | uint64_t(running[r]));
      }
  }

  // Wait for every peer: entry barrier, then (non-cached) its counts. The push kernel learns the
  // outcome from kCtrDispatchOutcome (one host-flag read here instead of one per push block).
  bool ok = tid != 0 || !commkit::aborted(cx.rec);
  if (ok) ok = wait_entry(cx, tid, E, kOpDispatchNotify);
  bool failed = __syncthreads_or(!ok);
  // A peer with another geometry is refused before any of its counts is read or relayed (its count
  // words would be laid out for its own number of experts).
  if (!failed && cx.hd.on) failed = __syncthreads_or(!relay_geometry(cx, E));
  __shared__ int s_geometry;
  if (tid == 0) s_geometry = -1;
  __syncthreads();
  if (!failed) failed = !check_geometry(cx, p, E, kOpDispatchNotify, &s_geometry);
  if (!failed && s_geometry >= 0) {
    const int at = s_geometry, w = at % kGeometryWords;
    refuse_dispatch(c, p, E, cx, L, at / kGeometryWords, w,
                    commkit::ld_relaxed(cx.local_u64(cx.ws.geometry, at)) & 0xffffffffull,
                    dispatch_geometry_word(p, w));
    return;
  }
  if (!failed && !p.cached && cx.hd.on) failed = __syncthreads_or(!relay_counts(cx, L, E));
  if (failed || p.cached) {
    notify_outcome(cx, E, failed ? kNotifyFailed : kNotifyOk);
    return;
  }
  // Hybrid mode: another domain's counts come from this domain's rank on their rail (WaitFor).
  for (int s = tid; s < R && ok; s += kThreads) {
    const WaitFor from(cx.hd, kOpDispatchNotify, s);
    ok = commkit::wait_tag_ge(cx.local_u64(cx.ws.rank_count, s), uint32_t(E), cx.timeout_ns, cx.rec, from.op, rank,
                              from.peer);
  }
  for (int i = tid; i < R * L && ok; i += kThreads) {
    const WaitFor from(cx.hd, kOpDispatchNotify, i / L);
    ok = commkit::wait_tag_ge(cx.local_u64(cx.ws.expert_count, i), uint32_t(E), cx.timeout_ns, cx.rec, from.op, rank,
                              from.peer);
  }
  for (int i = tid; p.zero_copy && i < rank * R && ok; i += kThreads)
    ok = commkit::wait_tag_ge(cx.local_u64(cx.ws.count_matrix, i), uint32_t(E), cx.timeout_ns, cx.rec,
                              kOpDispatchNotify, rank, i / R);
  failed = __syncthreads_or(!ok);
  if (failed) {
    notify_outcome(cx, E, kNotifyFailed);
    return;
  }

  // Peers' counts bound what the epilogue reads (at most M records from each, K rows per record and
  // expert): a larger one is a corrupted word, refused on this rank before anything is read or sized.
  __shared__ int s_bad_count;
  if (tid == 0) s_bad_count = -1;
  __syncthreads();
  for (int s = tid; s < R; s += kThreads)
    if ((*cx.local_u64(cx.ws.rank_count, s) & kCountMask) > uint64_t(p.num_max_tokens_per_rank))
      atomicCAS(&s_bad_count, -1, s);
  // R + i: expert count word i (so that the report names the word that is wrong, with its own bound).
  for (int i = tid; i < R * L; i += kThreads)
    if ((*cx.local_u64(cx.ws.expert_count, i) & 0xffffffffull) > uint64_t(K) * uint64_t(p.num_max_tokens_per_rank))
      atomicCAS(&s_bad_count, -1, R + i);
  __syncthreads();
  if (s_bad_count >= 0) {
    const int bad = s_bad_count;
    if (bad < R)
      refuse_dispatch(c, p, E, cx, L, bad, kProtocolCount, *cx.local_u64(cx.ws.rank_count, bad) & kCountMask,
                      uint64_t(p.num_max_tokens_per_rank));
    else
      refuse_dispatch(c, p, E, cx, L, (bad - R) / L, kProtocolExpertCount,
                      *cx.local_u64(cx.ws.expert_count, bad - R) & 0xffffffffull,
                      uint64_t(K) * uint64_t(p.num_max_tokens_per_rank));
    return;
  }
  // Reuse the shared arrays: running[] = tokens from each source, expert_cnt[] = aligned per local expert.
  const int A = p.expert_alignment;
  const auto hl = host_workspace_layout();
  auto* host_rank = hl.rank_count.at<uint64_t>(c.host_workspace);
  auto* host_expert = hl.expert_count.at<uint64_t>(c.host_workspace);
  const uint64_t tag = uint64_t(p.host_tag) << 32;
  bool refused = false;
  for (int s = tid; s < R; s += kThreads) {
    const uint64_t w = *cx.local_u64(cx.ws.rank_count, s);
    running[s] = int(w & kCountMask);
    refused |= (w & kRefusedBit) != 0ull;
  }
  if (__syncthreads_or(refused)) {
    // Refused everywhere alike (every rank saw the same flags): no push, no counts, no statistics.
    // The host learns which ranks refused from the flagged words and raises.
    for (int s = tid; s < R; s += kThreads)
      commkit::st_relaxed(&host_rank[s], tag | (*cx.local_u64(cx.ws.rank_count, s) & kRefusedBit));
    for (int l = tid; l < L; l += kThreads) commkit::st_relaxed(&host_expert[l], tag);
    notify_outcome(cx, E, kNotifyRefused);
    return;
  }
  // Before the outcome: the push reads it after notify (zero_copy clears concurrent_notify).
  for (int r = tid; p.zero_copy && r < R; r += kThreads) {
    int b = 0;
    for (int s = 0; s < rank; ++s) b += int(*cx.local_u64(cx.ws.count_matrix, s * R + r) & kCountMask);
    p.direct_base[r] = b;
  }
  for (int l = tid; l < L; l += kThreads) {
    int u = 0;
    for (int s = 0; s < R; ++s) u += int(*cx.local_u64(cx.ws.expert_count, s * L + l) & 0xffffffffu);
    p.unaligned_expert[l] = u;
    if (p.cumulative_stats != nullptr) p.cumulative_stats[l] += u;
    expert_cnt[l] = (u + A - 1) / A * A;
  }
  __syncthreads();
  {
    const int nr = tid < R ? running[tid] : 0;
    const int pr = block_exclusive_scan(nr, scan_scratch);
    if (tid < R) p.psum_rank[tid] = pr + nr;
    const int ne = tid < L ? expert_cnt[tid] : 0;
    const int pe = block_exclusive_scan(ne, scan_scratch);
    if (tid < L) p.psum_expert[tid + 1] = pe + ne;
    if (tid == 0) p.psum_expert[0] = 0;
  }
  // Host-visible counts last: the CPU allocates outputs from them. Each word carries the call's tag,
  // so the host validates every word on its own and no ordering between them is needed: relaxed
  // stores from many threads, not a serial loop of release stores (each a system-scope fence over
  // PCIe, ~1 us apiece: 0.25 ms for 256 experts).
  for (int s = tid; s < R; s += kThreads) commkit::st_relaxed(&host_rank[s], tag | uint64_t(running[s]));
  for (int l = tid; l < L; l += kThreads) commkit::st_relaxed(&host_expert[l], tag | uint64_t(expert_cnt[l]));
  notify_outcome(cx, E, kNotifyOk);
}

}  // namespace
}  // namespace elastic_ep
