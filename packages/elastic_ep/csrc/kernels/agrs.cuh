// elastic_ep/csrc/kernels/agrs.cuh -- AGRS (all-gather sessions) signals over the NVLink window (DeepEP
// V2's all_gather / destroy_agrs_session). The data moves by copy engine (cudaMemcpyAsync into every
// peer's session region, host/ops_pp_agrs.cpp); these one-block kernels order it:
//   gather done:  count the gather (agrs_local[0] = g), signal agrs_arrived[me] = (g << 32) | digest at
//                 every peer, wait until every peer's agrs_arrived at this rank reaches gather g (its
//                 copies into my region of this gather, and of every earlier one, have landed);
//   session end:  count the session (agrs_local[1] = n), signal agrs_ended[me] = n at every peer, wait
//                 until every peer's agrs_ended reaches n: no rank writes the next session's gathers
//                 into a region whose owner may still read the previous session's results.
// The counts live on the device, so a CUDA graph replays correctly. Every rank issues the same gathers
// and sessions in the same order (a collective), which is what makes the counts agree.
//
// Records: the ranks must also agree on what each gather holds (tensor count, dtypes, sizes, shapes,
// place in the session), or a rank reads rows of another size or type. The record (AgrsGatherParams)
// travels as the digest folded into the gather's signal: on the fast path nothing more is read. A peer
// whose signal is already its next gather's (it can be one ahead, never two: its gather g + 2 waits
// for this rank's g + 1) has its record of g read from its own agrs_record[g % 2], which it wrote before
// signalling. Digests that differ: the lowest such peer's record is read and its first differing word
// reported to the host (every rank finds one, so every rank raises at its next call). The copies have
// run by then, but every rank addressed them with its own arguments inside its session region, from
// the gather's offset on: results of the session's earlier gathers are intact. Later gathers of that
// session may start at other offsets on each rank, so the session is reported once (agrs_local[2])
// and the error says to end it.
// Included once, by launch.cu (the package's one CUDA translation unit).
#pragma once

#include "device_common.cuh"

namespace elastic_ep {
namespace {

static_assert(sizeof(AgrsGatherParams::record) == 8 * kAgrsRecordWords, "launch.hpp and sizing.hpp disagree");

// One block of kMaxRanks threads: thread r < R signals peer r and waits for it.
__device__ void agrs_count_signal_wait(const Ctx& cx, int counter, const Region& signals, uint32_t op) {
  const int R = cx.tr.num_ranks, rank = cx.tr.rank, r = threadIdx.x;
  uint64_t* local = cx.local_u64(cx.ws.agrs_local, counter);
  __shared__ uint64_t s_n;
  if (r == 0) s_n = commkit::ld_relaxed(local) + 1;  // stream order: the previous kernel's store is visible
  __syncthreads();
  const uint64_t n = s_n;
  if (commkit::aborted(cx.rec)) return;
  // The copy engine's writes precede this kernel (stream order); the release publishes them.
  if (r < R) cx.tr.signal(r, signals.offset + 8ull * rank, n);
  bool ok = true;
  if (r < R) ok = commkit::wait_ge(cx.local_u64(signals, r), n, cx.timeout_ns, cx.rec, op, rank, r);
  if (__syncthreads_or(!ok)) return;
  if (r == 0) commkit::st_relaxed(local, n);
}

// Word 0 is the kernel's own (the tag and this digest), so the digest covers the others.
__device__ __forceinline__ uint32_t agrs_digest(const uint64_t* record) {
  return digest_words(record + 1, kAgrsRecordWords - 1);
}

__global__ void __launch_bounds__(kMaxRanks) agrs_gather_done_kernel(CommView c, AgrsGatherParams p) {
  Ctx cx(c);
  const int R = c.num_ranks, rank = c.rank, r = threadIdx.x;
  uint64_t* local = cx.local_u64(cx.ws.agrs_local, 0);
  __shared__ uint64_t s_n;
  __shared__ uint32_t s_digest;
  __shared__ int s_check, s_bad;
  if (r == 0) {
    const uint64_t n = commkit::ld_relaxed(local) + 1;  // stream order: the previous kernel's store is visible
    const uint32_t digest = agrs_digest(p.record);
    uint64_t* mine = cx.local_u64(cx.ws.agrs_record, int(n & 1) * kAgrsRecordWords);
    for (int w = 1; w < kAgrsRecordWords; ++w) commkit::st_relaxed(mine + w, p.record[w]);
    commkit::st_relaxed(mine, (n << 32) | digest);  // published by the signals' release, after the barrier
    s_n = n;
    s_digest = digest;
    s_check = commkit::ld_relaxed(local + 2) != commkit::ld_relaxed(local + 1) + 1;
    s_bad = R;
  }
  __syncthreads();
  const uint64_t n = s_n;
  const uint32_t digest = s_digest;
  if (commkit::aborted(cx.rec)) return;
  // The copy engine's writes precede this kernel (stream order); the release publishes them.
  if (r < R) cx.tr.signal(r, cx.ws.agrs_arrived.offset + 8ull * rank, (n << 32) | digest);
  bool ok = true;
  const uint64_t record_at = cx.ws.agrs_record.offset + 8ull * (n & 1) * kAgrsRecordWords;
  if (r < R) {
    const uint64_t* word = cx.local_u64(cx.ws.agrs_arrived, r);
    ok = commkit::wait_tag_ge(word, uint32_t(n), cx.timeout_ns, cx.rec, kOpAllGather, rank, r);
    if (ok && r != rank && s_check) {
      uint64_t v = commkit::ld_acquire(word);
      if (uint32_t(v >> 32) == uint32_t(n + 1))
        v = commkit::ld_acquire(reinterpret_cast<const uint64_t*>(cx.tr.remote(r, record_at)));
      if (uint32_t(v >> 32) != uint32_t(n))
        report_protocol_once(cx, c, r, kReportAgrsTag, v >> 32, uint32_t(n));
      else if (uint32_t(v) != digest)
        atomicMin(&s_bad, r);
    }
  }
  if (__syncthreads_or(!ok)) return;
  if (s_bad < R && r == s_bad) {  // s_bad == R: no peer differs (the block has kMaxRanks threads)
    const auto* theirs = reinterpret_cast<const uint64_t*>(cx.tr.remote(r, record_at));
    int w = 1;
    while (w < kAgrsRecordWords - 1 && commkit::ld_relaxed(theirs + w) == p.record[w]) ++w;
    report_to_host(c, r, kReportAgrsWord + w, commkit::ld_relaxed(theirs + w), p.record[w]);
  }
  if (r == 0) {
    commkit::st_relaxed(local, n);
    if (s_bad < R) commkit::st_relaxed(local + 2, commkit::ld_relaxed(local + 1) + 1);
  }
}

__global__ void __launch_bounds__(kMaxRanks) agrs_session_end_kernel(CommView c) {
  Ctx cx(c);
  agrs_count_signal_wait(cx, 1, cx.ws.agrs_ended, kOpAgrsSession);
}

}  // namespace
}  // namespace elastic_ep
