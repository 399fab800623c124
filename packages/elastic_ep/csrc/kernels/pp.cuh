// elastic_ep/csrc/kernels/pp.cuh -- PP send/recv over the NVLink window (DeepEP V2's pp_send / pp_recv).
//
// Receive slots: at the start of each rank's buffer, [source rank][num_max_inflight][slot_bytes]. The
// k-th tensor (k from 0) that rank s sends to rank d lands in d's slot [s][k % num_max_inflight]. Per
// pair, two monotonic u64 counts in the workspace carry the protocol (credits):
//   pp_sent[s] at d:  tensors s delivered into d's slots   (written by s, after its copy)
//   pp_freed[d] at s: tensors d copied out of its slots     (written by d, after its copy)
// and each rank keeps its own running counts (pp_seq: sent per peer, received per peer) on the device,
// so a CUDA graph of sends and receives advances them on every replay.
//   send k to d:  wait pp_freed[d] >= k + 1 - num_max_inflight (a free slot), copy, pp_sent[me] at d = k + 1
//   recv k from s: wait pp_sent[s] >= k + 1, copy out, pp_freed[me] at s = k + 1
// Every block waits for itself (thread 0), copies a stripe of 16-byte words, and the last block to
// finish publishes the count. Point-to-point: no epoch and no entry barrier; the slots alias the
// dispatch/combine and AGRS areas, so a buffer runs one kind of operation at a time.
//
// Descriptors: the two ends of a transfer must agree on the tensor, or the receiver would read bytes
// of another size or type. A send's block 0 writes the tensor's descriptor (numel, dtype, shape) into
// the receiver's ring pp_desc[me][k % depth] before it copies (depth = kPpDescEntries / num_ranks >=
// num_max_inflight: the entry's previous tensor, k - depth, was received, since slot k was free), word 0
// being ((k + 1) << 32) | digest; grid_arrive_last's fence orders it before the count. A receive reads
// that one word after its wait: its own descriptor's digest -> copy. Another -> refused: nothing copied,
// the first field that differs reported to the host (the next call raises it) and to the sender's
// pp_refusal[me] (its host reads it at pp_set_config), the slot returned and both counts advanced, so
// the pair's next tensors meet as before. A tag other than k + 1 is a corrupted word: reported, nothing
// copied or returned. A receive copies its own byte count (at most a slot) from the slot its own count
// picks: no word a peer wrote indexes memory.
// Included once, by launch.cu (the package's one CUDA translation unit).
#pragma once

#include "device_common.cuh"

namespace elastic_ep {
namespace {

// Copies `nbytes` from src to dst with every block of the grid: 16-byte words when both addresses
// allow it, then the tail (or everything, when they do not) byte by byte in block 0.
template <bool kL2Src>
__device__ void grid_copy(char* dst, const char* src, int64_t nbytes) {
  const bool vec = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15u) == 0;
  const int64_t n16 = vec ? nbytes / 16 : 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  auto* d16 = reinterpret_cast<int4*>(dst);
  const auto* s16 = reinterpret_cast<const int4*>(src);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n16; i += stride)
    d16[i] = kL2Src ? ld_v4<true>(s16 + i) : ld_nc_v4(s16 + i);
  if (blockIdx.x == 0)
    for (int64_t i = n16 * 16 + threadIdx.x; i < nbytes; i += blockDim.x)
      dst[i] = kL2Src ? static_cast<char>(__ldcg(reinterpret_cast<const signed char*>(src) + i)) : src[i];
}

// Slot of the k-th tensor from `src` in the receiving rank's buffer (offset in the window).
__device__ __forceinline__ uint64_t pp_slot(const Ctx& cx, const PpParams& p, int src, uint64_t k) {
  return cx.buf + (uint64_t(src) * p.num_max_inflight + k % uint64_t(p.num_max_inflight)) * uint64_t(p.slot_bytes);
}

// The ring entry of the k-th tensor from `src` in the receiving rank's workspace (offset in the window):
// word 0 ((k + 1) << 32) | digest, then the fields in PpField order.
__device__ __forceinline__ uint64_t pp_desc_offset(const Ctx& cx, int src, uint64_t k) {
  const uint64_t depth = uint64_t(kPpDescEntries / cx.tr.num_ranks);
  return cx.ws.pp_desc.offset + 8ull * kPpDescWords * (uint64_t(src) * depth + k % depth);
}
__device__ __forceinline__ uint64_t pp_field(const PpParams& p, int f) {
  return f == kPpFieldDtype ? p.dtype_code : f == kPpFieldNumel ? p.numel : p.shape_word;
}
__device__ __forceinline__ uint32_t pp_digest(const PpParams& p) {
  uint64_t fields[kPpDescWords - 1];
  for (int f = 0; f < kPpDescWords - 1; ++f) fields[f] = pp_field(p, f);
  return digest_words(fields, kPpDescWords - 1);
}

// A receive's refusal of tensor k (last block, thread 0): the first field that differs, to this rank's
// host and to the sender's pp_refusal[me] ([0] k + 1, written last; [1] the field; [2] this rank's
// value; [3] the sender's).
__device__ void pp_refuse(const Ctx& cx, const CommView& c, const PpParams& p, uint64_t k) {
  const auto* d = reinterpret_cast<const uint64_t*>(cx.tr.local(pp_desc_offset(cx, p.peer, k)));
  int f = 0;
  while (f < kPpFieldShape && commkit::ld_relaxed(d + 1 + f) == pp_field(p, f)) ++f;
  const uint64_t theirs = commkit::ld_relaxed(d + 1 + f), mine = pp_field(p, f);
  report_to_host(c, int(((k + 1) & 0x7fffffu) << 8) | p.peer, kReportPpField + f, theirs, mine);
  const uint64_t at = cx.ws.pp_refusal.offset + 32ull * uint64_t(c.rank);
  cx.tr.put_u64(p.peer, at + 8, uint64_t(f));
  cx.tr.put_u64(p.peer, at + 16, mine);
  cx.tr.put_u64(p.peer, at + 24, theirs);
  cx.tr.put_u64(p.peer, at, k + 1);
}

__global__ void __launch_bounds__(kThreads, 1) pp_send_kernel(CommView c, PpParams p) {
  Ctx cx(c);
  const int rank = c.rank, peer = p.peer;
  uint64_t* seq_word = cx.local_u64(cx.ws.pp_seq, peer);
  __shared__ uint64_t s_seq;
  __shared__ int s_ok;
  if (threadIdx.x == 0) {
    // Written only by the previous send to this peer's last block, which stream order puts before us.
    const uint64_t k = commkit::ld_relaxed(seq_word);
    bool ok = !commkit::aborted(cx.rec);
    if (ok && k >= uint64_t(p.num_max_inflight))
      ok = commkit::wait_ge(cx.local_u64(cx.ws.pp_freed, peer), k + 1 - uint64_t(p.num_max_inflight), cx.timeout_ns,
                            cx.rec, kOpPpSend, rank, peer);
    s_seq = k;
    s_ok = ok;
  }
  __syncthreads();
  const uint64_t k = s_seq;
  if (s_ok && blockIdx.x == 0 && threadIdx.x == 0) {
    const uint64_t at = pp_desc_offset(cx, rank, k);
    for (int f = 0; f < kPpDescWords - 1; ++f) cx.tr.put_u64(peer, at + 8ull * (1 + f), pp_field(p, f));
    cx.tr.put_u64(peer, at, ((k + 1) << 32) | pp_digest(p));
  }
  if (s_ok) grid_copy<false>(static_cast<char*>(cx.tr.remote(peer, pp_slot(cx, p, rank, k))),
                             static_cast<const char*>(p.x), p.nbytes);
  // Every block arrives (the counter must return to zero); a failed wait publishes nothing.
  if (commkit::grid_arrive_last<true>(cx.ws.pp_grid.at<uint32_t>(c.window_base) + peer) && threadIdx.x == 0 &&
      !commkit::aborted(cx.rec)) {
    __threadfence_system();
    cx.tr.signal(peer, cx.ws.pp_sent.offset + 8ull * rank, k + 1);
    commkit::st_relaxed(seq_word, k + 1);
  }
}

__global__ void __launch_bounds__(kThreads, 1) pp_recv_kernel(CommView c, PpParams p) {
  enum State : int { kCopy = 0, kRefuse = 1, kFail = 2, kCorrupt = 3 };
  Ctx cx(c);
  const int rank = c.rank, peer = p.peer;
  uint64_t* seq_word = cx.local_u64(cx.ws.pp_seq, kMaxRanks + peer);
  __shared__ uint64_t s_seq, s_desc;
  __shared__ int s_state;
  if (threadIdx.x == 0) {
    const uint64_t k = commkit::ld_relaxed(seq_word);
    bool ok = !commkit::aborted(cx.rec);
    if (ok)
      ok = commkit::wait_ge(cx.local_u64(cx.ws.pp_sent, peer), k + 1, cx.timeout_ns, cx.rec, kOpPpRecv, rank, peer);
    // Every block reads the word itself: the sender wrote it before its count, and it stays until this
    // receive returns the slot.
    const auto* desc = reinterpret_cast<const uint64_t*>(cx.tr.local(pp_desc_offset(cx, peer, k)));
    const uint64_t d = ok ? commkit::ld_relaxed(desc) : 0;
    s_seq = k;
    s_desc = d;
    s_state = !ok                                 ? kFail
              : uint32_t(d >> 32) != uint32_t(k + 1) ? kCorrupt
              : uint32_t(d) != pp_digest(p)          ? kRefuse
                                                     : kCopy;
  }
  __syncthreads();
  const uint64_t k = s_seq;
  const int state = s_state;
  // The peer's stores landed while this rank ran other kernels: read them from L2.
  if (state == kCopy)
    grid_copy<true>(static_cast<char*>(p.x), static_cast<const char*>(cx.tr.local(pp_slot(cx, p, peer, k))),
                    p.nbytes < p.slot_bytes ? p.nbytes : p.slot_bytes);
  if (commkit::grid_arrive_last<true>(cx.ws.pp_grid.at<uint32_t>(c.window_base) + kMaxRanks + peer) &&
      threadIdx.x == 0 && !commkit::aborted(cx.rec)) {
    if (state == kCorrupt) {  // the pair is out of step: nothing is returned (the runtime is unusable)
      report_protocol_once(cx, c, peer, kReportPpTag, s_desc >> 32, uint32_t(k + 1));
      return;
    }
    if (state == kRefuse) pp_refuse(cx, c, p, k);
    __threadfence_system();
    cx.tr.signal(peer, cx.ws.pp_freed.offset + 8ull * rank, k + 1);
    commkit::st_relaxed(seq_word, k + 1);
  }
}

}  // namespace
}  // namespace elastic_ep
