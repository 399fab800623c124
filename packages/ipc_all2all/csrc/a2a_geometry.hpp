// a2a_geometry.hpp -- which bytes go where: the row addressing of the three operations, shared by the
// CUDA kernel and by a host simulation (ipc_all2all._C.simulate) that the CPU test suite compares
// against plain torch permutes, so the layout math is checked without a GPU.
//
// For target p, me = rank q, counts n[], exclusive prefix P[], total T, chunk = hpr*D*E, wide = H*D*E:
//   send_recv_heads  rows t < n[q]:  src (b*x_rows + t)*wide + p*chunk      dst (b*OUT + P[q] + t)*chunk
//   gather_heads     rows t < n[p]:  src (b*x_rows + P[p] + t)*chunk        dst (b*OUT_p + t)*wide + q*chunk
//   allgather        rows t < n[q]:  src (b*x_rows + t)*chunk               dst (b*OUT + P[q] + t)*chunk
// OUT = out_rows when >= 0 (device-count mode), else T (n[p] for gather_heads).
#pragma once

#include <cstdint>

#include "a2a_types.hpp"
#include "commkit/platform.hpp"
#include "kernels.hpp"

namespace ipc_all2all {

struct RowMap {
  uint64_t src0, dst0;          // byte offsets of row 0 in x and in the target's slot
  uint64_t sbs, sts, dbs, dts;  // batch / token strides in bytes of source and destination
  uint32_t vpr;                 // 16-byte vectors per row
  uint32_t rpb;                 // rows per batch for this target

  // Byte offsets (from x, from the slot) of flattened 16-byte vector v.
  CK_HD CK_INLINE void offsets(uint32_t v, uint64_t& s, uint64_t& d) const {
    uint32_t row = v / vpr;
    uint32_t col = v - row * vpr;
    uint32_t b = row / rpb;
    uint32_t t = row - b * rpb;
    s = src0 + b * sbs + t * sts + uint64_t(col) * 16u;
    d = dst0 + b * dbs + t * dts + uint64_t(col) * 16u;
  }
  CK_HD CK_INLINE uint32_t total_vecs(int batch) const { return static_cast<uint32_t>(batch) * rpb * vpr; }
};

// Clamped counts and their exclusive prefix (prefix[world] = total), as the kernel computes them.
CK_HD CK_INLINE void resolve_counts(const KernelArgs& a, const int32_t* counts, int64_t* n, int64_t* prefix) {
  int64_t acc = 0;
  for (int i = 0; i < a.world; ++i) {
    int64_t c = counts[i];
    if (c < 0) c = 0;
    if (a.cap_rows >= 0 && c > a.cap_rows) c = a.cap_rows;
    n[i] = c;
    prefix[i] = acc;
    acc += c;
  }
  prefix[a.world] = acc;
}

CK_HD CK_INLINE RowMap row_map(const KernelArgs& a, const int64_t* n, const int64_t* prefix, int target) {
  const int q = a.rank;
  const uint64_t chunk = a.chunk_bytes, wide = a.wide_bytes;
  RowMap m{};
  m.vpr = a.chunk_bytes / 16u;
  if (a.op == kGatherHeads) {
    const int64_t out = a.out_rows >= 0 ? a.out_rows : n[target];
    m.rpb = static_cast<uint32_t>(n[target]);
    m.src0 = prefix[target] * chunk;
    m.sbs = a.x_rows * chunk;
    m.sts = chunk;
    m.dst0 = q * chunk;
    m.dbs = out * wide;
    m.dts = wide;
  } else {
    const int64_t out = a.out_rows >= 0 ? a.out_rows : prefix[a.world];
    m.rpb = static_cast<uint32_t>(n[q]);
    if (a.op == kSendRecvHeads) {
      m.src0 = target * chunk;
      m.sbs = a.x_rows * wide;
      m.sts = wide;
    } else {
      m.src0 = 0;
      m.sbs = a.x_rows * chunk;
      m.sts = chunk;
    }
    m.dst0 = prefix[q] * chunk;
    m.dbs = out * chunk;
    m.dts = chunk;
  }
  return m;
}

// One past the last byte that a sender's rows reach in the target's slot (0 when it sends none).
CK_HD CK_INLINE uint64_t dst_extent(const RowMap& m, int batch) {
  if (batch <= 0 || m.rpb == 0 || m.vpr == 0) return 0;
  return m.dst0 + uint64_t(batch - 1) * m.dbs + uint64_t(m.rpb - 1) * m.dts + uint64_t(m.vpr) * 16u;
}

// The most bytes of any target's slot that sender a.rank writes with these counts. Every extent grows
// with the counts, so with device counts (clamped to cap_rows) passing cap_rows for every rank gives
// the worst case over all values the device may hold.
CK_HD CK_INLINE uint64_t slot_bytes_needed(const KernelArgs& a, const int32_t* counts) {
  int64_t n[kMaxWorld], prefix[kMaxWorld + 1];
  resolve_counts(a, counts, n, prefix);
  uint64_t most = 0;
  for (int p = 0; p < a.world; ++p) {
    const uint64_t e = dst_extent(row_map(a, n, prefix, p), a.batch);
    if (e > most) most = e;
  }
  return most;
}

}  // namespace ipc_all2all
