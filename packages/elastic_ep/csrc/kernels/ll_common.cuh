// elastic_ep/csrc/kernels/ll_common.cuh -- what low-latency dispatch and combine share: their call
// counters, the shrink mask, the geometry words and the wait for a peer's signal.
//
// Protocol of one call (kind = dispatch or combine, half = the host's buffer_idx): the send phase writes
// every message straight into the peers' windows, then its last block publishes, to every unmasked
// peer (plain stores: grid_arrive_last's fences ordered every message before), this rank's geometry
// words and the signals ((seq << 32) | payload), seq being the
// count of send phases of that kind and half so far plus one. The receive phase waits for the signal
// of every unmasked peer with its own count (receive phases so far plus one): every rank runs the same
// calls, so the two counts agree, and since they live on the device a CUDA-graph replay advances them.
// A word from a later call, a count past M or a geometry word unlike this rank's is a protocol error
// (reported once to the host; nothing is copied from that peer). No entry barrier: a half is written
// again only by the call after next of the same rank, which DeepEP V1's rule (at most two low-latency
// results held at a time) and the dispatch-combine alternation order after the peers' reads.
// Included once, by launch.cu.
#pragma once

#include "device_common.cuh"
#include "ll_sizing.hpp"

namespace elastic_ep {
namespace {

enum LlKind : int { kLlDispatchKind = 0, kLlCombineKind = 1 };
constexpr uint32_t kPollSleepNs = 64;
enum LlSide : int { kLlSendSide = 0, kLlRecvSide = 1 };

struct LlCall {
  Ctx cx;
  CommView c;
  int kind, half;
  bool shrink;
  uint32_t geometry0, geometry1;  // ll_geometry_word 0 and 1 of this call

  __device__ __forceinline__ uint32_t geometry(int w) const { return w == 0 ? geometry0 : geometry1; }

  __device__ __forceinline__ uint64_t* seq_word(int side) const {
    return cx.local_u64(cx.ws.ll_seq, (kind * 2 + half) * 2 + side);
  }
  uint32_t seqs[2] = {0u, 0u};  // this call's phase numbers (begin)
  // Reads the seq of each phase this launch runs, at its entry: every block reads it before the phase's
  // last block stores it, and one read at entry keeps that round trip off the phases' critical path.
  __device__ __forceinline__ void begin(int phases) {
    if (phases & kLlSend) seqs[kLlSendSide] = uint32_t(commkit::ld_relaxed(seq_word(kLlSendSide)) + 1u);
    if (phases & kLlRecv) seqs[kLlRecvSide] = uint32_t(commkit::ld_relaxed(seq_word(kLlRecvSide)) + 1u);
  }
  __device__ __forceinline__ uint32_t seq(int side) const { return seqs[side]; }
  __device__ __forceinline__ void end_phase(int side, uint32_t s) const {
    commkit::st_relaxed(seq_word(side), uint64_t(s));
  }
  __device__ __forceinline__ uint32_t* grid_word(int side) const {
    return cx.ws.ll_grid.at<uint32_t>(c.window_base) + (kind * 2 + half) * 2 + side;
  }
  __device__ __forceinline__ bool masked(int r) const {
    return shrink && commkit::ld_relaxed(cx.ws.ll_mask.at<uint32_t>(c.window_base) + r) != 0u;
  }
  __device__ __forceinline__ void mask(int r) const { atomicExch(cx.ws.ll_mask.at<uint32_t>(c.window_base) + r, 1u); }
  __device__ __forceinline__ uint64_t geo_offset(int src, int w) const {
    return cx.ws.ll_geo.offset + 8ull * (uint64_t((kind * 2 + half) * kMaxRanks + src) * kLowLatencyGeometryWords + w);
  }
  // Last block of the send phase, every thread: the geometry words to every unmasked peer. No fence
  // here: every block (this one too) made its messages visible system-wide with its own fence before
  // counting itself in grid_arrive_last, which the last block observed before getting here. The
  // caller's signals follow in any order: a receiver waits for the geometry words of its call too.
  __device__ __forceinline__ void publish_geometry(uint32_t s) const {
    __syncthreads();
    for (int i = threadIdx.x; i < c.num_ranks * kLowLatencyGeometryWords; i += blockDim.x) {
      const int r = i / kLowLatencyGeometryWords, w = i % kLowLatencyGeometryWords;
      if (!masked(r)) cx.tr.put_u64(r, geo_offset(c.rank, w), (uint64_t(s) << 32) | geometry(w));
    }
  }
  // Waits for peer `src`'s signal `word` of call `s`. Returns true with `*payload` set when it came
  // and the peer's call matches this one; false when the wait failed (timeout or abort: recorded; in
  // shrink mode the peer is masked instead and nothing is recorded) or the peer's words are wrong
  // (reported). `*masked_now` tells the shrink case. `wait_ns` (may be null) += the time waited.
  // With `check_geometry` the peer's geometry words are polled with the signal, in the same round trip:
  // each carries its call's seq, so a stale read is seen as such and polled again, and no order between
  // the peer's stores is needed. The signal's load is the acquire that orders the reads of the messages.
  __device__ __forceinline__ bool wait_peer(const uint64_t* word, int src, uint32_t s, uint32_t op, uint64_t* payload,
                            bool* masked_now, int64_t* wait_ns, bool check_geometry) const {
    *masked_now = false;
    const uint64_t t0 = wait_ns != nullptr ? commkit::globaltimer_ns() : 0;
    const uint64_t* gw[kLowLatencyGeometryWords];
    for (int w = 0; w < kLowLatencyGeometryWords; ++w)
      gw[w] = reinterpret_cast<const uint64_t*>(cx.tr.local(geo_offset(src, w)));
    uint64_t v = 0, g[kLowLatencyGeometryWords] = {};
    // The least advanced tag of the words read (serial-number order relative to s), with v's payload.
    auto load = [&]() -> uint64_t {
      if (check_geometry)
        for (int w = 0; w < kLowLatencyGeometryWords; ++w) g[w] = commkit::ld_relaxed(gw[w]);
      v = commkit::ld_acquire(word);
      int32_t least = int32_t(uint32_t(v >> 32) - s);
      for (int w = 0; check_geometry && w < kLowLatencyGeometryWords; ++w)
        least = min(least, int32_t(uint32_t(g[w] >> 32) - s));
      return (uint64_t(s + uint32_t(least)) << 32) | (v & 0xffffffffull);
    };
    // Thousands of threads may poll at once (every block waits for every count word): a short sleep
    // between polls keeps them from flooding L2 while the send phase of slower blocks still writes.
    // A protocol error reported by any thread (e.g. a peer of another num_experts, which never writes
    // some of the words waited for) ends the other waits instead of leaving them to the deadline.
    const uint32_t* reported = &cx.counters[kCtrProtocolReported];
    const bool ok = commkit::wait_tag_ge_load(load, s, cx.timeout_ns, shrink ? nullptr : cx.rec, op, c.rank, src, 6,
                                              kPollSleepNs, reported);
    if (wait_ns != nullptr) atomicAdd(reinterpret_cast<unsigned long long*>(wait_ns),
                                      static_cast<unsigned long long>(commkit::globaltimer_ns() - t0));
    if (!ok) {
      if (shrink && !commkit::aborted(cx.rec) && commkit::ld_relaxed(reported) == 0u) {
        mask(src);
        *masked_now = true;
      }
      return false;
    }
    if (uint32_t(v >> 32) != s) {
      report_protocol_once(cx, c, src, kProtocolLlSeq, v >> 32, s);
      return false;
    }
    for (int w = 0; check_geometry && w < kLowLatencyGeometryWords; ++w) {
      if (uint32_t(g[w] >> 32) != s || uint32_t(g[w]) != geometry(w)) {
        report_protocol_once(cx, c, src, kProtocolLlGeometry + w, uint32_t(g[w]), geometry(w));
        return false;
      }
    }
    *payload = v & 0xffffffffull;
    return true;
  }
};

// Every block of a phase calls it at the phase's end: true (in every thread) in the block that finished
// last, which then sees the others' stores (kSystem: their stores to peers too). A grid of one block
// (one token at decode) needs no counter: its barrier and, for kSystem, one fence are enough.
template <bool kSystem>
__device__ __forceinline__ bool ll_phase_last(uint32_t* counter) {
  if (gridDim.x == 1) {
    if (kSystem) commkit::block_fence_system();
    __syncthreads();
    return true;
  }
  return commkit::grid_arrive_last<kSystem>(counter);
}

// A row is copied by up to kLlMaxSlices warps, one slice each, when there are warps to spare: one warp's
// copy of a 14 KB row is a chain of 7 dependent rounds of loads, which left a few dozen rows' call
// waiting on memory latency. Slice `sl` of `slices` copies the 16-byte words [*begin, *end) of n16.
constexpr int kLlMaxSlices = 8;
__device__ __forceinline__ int ll_slices(int64_t rows, int64_t nwarps) {
  const int64_t s = rows > 0 ? nwarps / rows : 1;
  return int(s < 1 ? 1 : (s > kLlMaxSlices ? kLlMaxSlices : s));
}
__device__ __forceinline__ void ll_slice_range(int n16, int sl, int slices, int* begin, int* end) {
  const int per = (n16 + slices - 1) / slices;
  *begin = min(n16, sl * per);
  *end = min(n16, *begin + per);
}

__device__ __forceinline__ int64_t ll_sanitize(int64_t e, int num_experts) {
  return e >= 0 && e < num_experts ? e : -1;
}

}  // namespace
}  // namespace elastic_ep
