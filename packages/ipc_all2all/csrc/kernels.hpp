// kernels.hpp -- the kernels' parameter blocks and launchers (the kernels are in kernels.cu).
//
//   launch_a2a(args, grid, stream)     one call of send_recv_heads, gather_heads or allgather: the push
//                                      kernel moves this rank's rows into every target's slot (the
//                                      per-op row addressing: a2a_geometry.hpp), with the entry
//                                      handshake and completion protocol of a2a_types.hpp. grid:
//                                      GridPlan::total blocks of kThreads threads. args.pack_head_dim > 0
//                                      selects the instantiation that packs bf16 into fp8 records.
//   launch_fp8_unpack(args, stream)    fp8 on the wire, receiving side: a slot's records into bf16.
//
// Torch-free and CUDA-free (streams are cudaStream_t passed as void*), so the host code and the CPU
// build include it too. A launch error raises commkit::Error.
#pragma once

#include <cstdint>

#include "a2a_types.hpp"
#include "commkit/timeout_record.hpp"

namespace ipc_all2all {

// Everything one push needs, passed by value (so a CUDA graph captures it whole). Shapes use
// W = world, b = batch, n[] the (clamped) token counts, OUT the output rows per batch (out_rows, or
// derived from n[]) and E the element size; the per-op row addressing is in a2a_geometry.hpp.
struct KernelArgs {
  char* dst[kMaxWorld];         // [W] base of the current slot in every rank's buffer (indexed by rank),
                                //   holding the output: send_recv_heads [b, OUT, H/W, D], gather_heads
                                //   [b, OUT, H, D], allgather [b, OUT, h, d] (with pack_head_dim > 0,
                                //   D + 16-byte records in place of the D elements)
  Signals* sig[kMaxWorld];      // [W] every rank's signal block (indexed by rank)
  const char* x;                // this rank's input, 16-byte aligned: send_recv_heads [b, x_rows, H, D],
                                //   gather_heads [b, x_rows, H/W, D], allgather [b, x_rows, h, d]
  const int32_t* counts_dev;    // [W] token counts on the device, or nullptr: use counts[]
  int32_t counts[kMaxWorld];    // [W] token counts given on the host
  commkit::TimeoutRecord* rec;  // [1] host-mapped timeout record
  uint64_t timeout_ns;          // 0: wait forever
  int64_t x_rows;               // rows (tokens) per batch of x, i.e. x.shape[1]
  int64_t out_rows;             // rows per batch of the output; -1: derived from the counts
  int64_t cap_rows;             // device-count mode: counts are clamped to this; -1: no clamp
  uint32_t chunk_bytes;         // bytes moved per (batch, token) for one target, multiple of 16
  uint32_t wide_bytes;          // bytes of a full token row with all heads (H * D * E)
  int32_t rank, world, batch, op;
  int32_t self_blocks, per_peer;  // the grid's split (GridPlan)
  int32_t pack_head_dim;        // 0: move x's bytes as they are; D: x holds bf16 head vectors of D
                                // elements, packed on the fly into fp8 records of D + 16 bytes (the
                                // geometry above is then in record bytes)
  uint32_t sig_base;            // the signature's host part (geometry_signature); the kernel adds the counts
};

// fp8 on the wire, receiving side (kernels.cu: the record format).
struct Fp8UnpackArgs {
  const void* in;    // [groups, head_dim + kFp8RecordPad] records: head_dim e4m3 bytes, fp32 scale, 12 zero
                     //   bytes; 16-byte aligned
  void* out;         // [groups, head_dim] bf16, 16-byte aligned
  int64_t groups;    // head vectors to unpack; 0 launches nothing
  int head_dim;      // D, fp8_wire_head_dim_ok(D)
};

// The host part of a call's signature (see sig_mix): operation, slot and geometry.
CK_HD constexpr uint32_t geometry_signature(const KernelArgs& a, int slot) {
  uint32_t h = 0x811c9dc5u;
  h = sig_mix(h, static_cast<uint64_t>(a.op));
  h = sig_mix(h, static_cast<uint64_t>(a.world));
  h = sig_mix(h, static_cast<uint64_t>(a.batch));
  h = sig_mix(h, a.chunk_bytes);
  h = sig_mix(h, a.wide_bytes);
  h = sig_mix(h, static_cast<uint64_t>(a.out_rows));
  h = sig_mix(h, static_cast<uint64_t>(a.cap_rows));
  h = sig_mix(h, static_cast<uint64_t>(a.pack_head_dim));
  return (static_cast<uint32_t>(a.op + 1) << 28) | (static_cast<uint32_t>(slot & 1) << 27) | (h & kSigHashMask);
}

// The geometry part of KernelArgs (no pointers, counts or grid split), shared by the launch path and
// the host-side helpers that replay the kernel's addressing.
inline KernelArgs geometry_args(int op, int world, int rank, int batch, int64_t x_rows, int64_t out_rows,
                                int64_t cap_rows, int64_t chunk_bytes, int64_t wide_bytes) {
  KernelArgs a{};
  a.op = op;
  a.rank = rank;
  a.world = world;
  a.batch = batch;
  a.x_rows = x_rows;
  a.out_rows = out_rows;
  a.cap_rows = cap_rows;
  a.chunk_bytes = static_cast<uint32_t>(chunk_bytes);
  a.wide_bytes = static_cast<uint32_t>(wide_bytes);
  return a;
}

// Defined in kernels.cu, so only in a CUDA build (COMMKIT_WITH_CUDA).
void launch_a2a(const KernelArgs& args, int grid, void* stream);
void launch_fp8_unpack(const Fp8UnpackArgs& args, void* stream);

}  // namespace ipc_all2all
