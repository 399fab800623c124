// elastic_ep/csrc/kernels/agrs.cuh -- AGRS (all-gather sessions) signals over the NVLink window (DeepEP
// V2's all_gather / destroy_agrs_session). The data moves by copy engine (cudaMemcpyAsync into every
// peer's session region, host/ops_pp_agrs.cpp); these one-block kernels order it:
//   gather done:  count the gather (agrs_local[0] = g), signal agrs_arrived[me] = g at every peer, wait
//                 until every peer's agrs_arrived at this rank reaches g (its copies into my region of
//                 this gather, and of every earlier one, have landed);
//   session end:  count the session (agrs_local[1] = n), signal agrs_ended[me] = n at every peer, wait
//                 until every peer's agrs_ended reaches n: no rank writes the next session's gathers
//                 into a region whose owner may still read the previous session's results.
// The counts live on the device, so a CUDA graph replays correctly. Every rank issues the same gathers
// and sessions in the same order (a collective), which is what makes the counts agree.
// Included once, by launch.cu (the package's one CUDA translation unit).
#pragma once

#include "device_common.cuh"

namespace elastic_ep {
namespace {

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

__global__ void __launch_bounds__(kMaxRanks) agrs_gather_done_kernel(CommView c) {
  Ctx cx(c);
  agrs_count_signal_wait(cx, 0, cx.ws.agrs_arrived, kOpAllGather);
}

__global__ void __launch_bounds__(kMaxRanks) agrs_session_end_kernel(CommView c) {
  Ctx cx(c);
  agrs_count_signal_wait(cx, 1, cx.ws.agrs_ended, kOpAgrsSession);
}

}  // namespace
}  // namespace elastic_ep
