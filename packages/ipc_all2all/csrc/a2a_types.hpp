// a2a_types.hpp -- the shared-buffer layout, the signal block and the handshake words of ipc_all2all
// (the kernels' arguments are in kernels.hpp).
//
// Every rank owns ONE device allocation, exported by one CUDA IPC handle:
//
//   [ Signals (4 KiB) | slot 0 (capacity bytes) | slot 1 (capacity bytes) ]
//
// Peers push (store over NVLink) their contribution straight into the receiver's slot, so the
// result of a call lives in the receiver's own memory. Calls alternate between the two slots so that
// the input of call N+1 may be the zero-copy output of call N (the round trip
// gather_heads(send_recv_heads(x))) while peers already write call N+1's output.
//
// Signalling (counters monotonic, compared with >= or in serial-number order, never reset, so
// nothing can overshoot):
//   * epoch     : a per-instance call counter kept on the device (so CUDA-graph replays advance it);
//                 call number e = epoch + 1.
//   * ready[s]  : written by rank s into my block when s *enters* call e, as one word
//                 ready_word(e, signature): the call number's low 32 bits in the high half (compared
//                 in serial-number order, so it may wrap) and the call's signature in the low half.
//                 Before I push into s's slot I wait for the call number to reach e: s's stream has
//                 then finished everything before call e, including every read of the slot I am
//                 about to overwrite (entry handshake: no write-after-read race however far ahead
//                 one rank runs). The signature (operation, output slot, geometry and token counts)
//                 must equal mine: one release store carries both, so a rank that skipped a call, or
//                 a send_recv_heads paired with a gather_heads, fails the call on both sides instead of
//                 being paired silently.
//   * done[s]   : written by rank s into my block once all of s's blocks finished pushing call e to
//                 me. My kernel ends only after done[s] >= e for every peer s.
//   * cnt / fin : local block-completion counters; the last block resets them to 0 before the
//                 kernel ends, so the next call starts from 0.
//   * leaving[s]: written by rank s's host in destroy() (see leaving_word).
//   * broken    : sticky failure mark. A kernel that gives up sets it here, and after a deadline
//                 also in every peer's block (a mismatch is seen by the peer itself); a kernel that
//                 finds it set moves nothing, posts no done and no ready (unless the mark is of this
//                 same call: entry_post_allowed), and leaves a record for the host.
//                 gave_up, local only, says that this rank itself gave up: a wait for a
//                 peer's entry stops on it (no waiting out a deadline for a rank that failed before it
//                 entered), and a wait for a peer's done stops on broken. So calls queued behind a failed one can never complete with data derived
//                 from it, and a late peer's next call fails at once instead of waiting out its
//                 deadline.
#pragma once

#include <cstdint>

#include "commkit/layout.hpp"

namespace ipc_all2all {

constexpr int kMaxWorld = 8;
constexpr int kNumSlots = 2;
constexpr uint64_t kSignalBytes = 4096;
constexpr uint64_t kSlotAlign = 256;
constexpr int kThreads = 512;
constexpr int kUnroll = 4;
// fp8 on the wire: a head vector of D bf16 elements travels as D e4m3 bytes + a 16-byte scale field.
constexpr int kFp8RecordPad = 16;
CK_HD constexpr bool fp8_wire_head_dim_ok(int64_t d) { return d == 16 || d == 32 || d == 64 || d == 128 || d == 256; }

// Operation codes, also the `op` of a TimeoutRecord (op = kind * 4 + phase). The record holds
// failures that are not timeouts too (kPhaseMismatch, kPhaseBroken); the host tells them apart by
// the phase.
enum Op : int { kSendRecvHeads = 0, kGatherHeads = 1, kAllGather = 2,
                kPeerWatch = 3 };  // not a call: commkit::PeerWatch found a peer's process gone (op kPeerWatch * 4)
enum Phase : int {
  kPhaseEntry = 0,       // timeout: the peer never entered the call (expected/observed: call numbers)
  kPhaseCompletion = 1,  // timeout: the peer's data never arrived (expected/observed: call numbers)
  kPhaseMismatch = 2,    // the peer entered a different call (expected: my ready word, observed: its)
  kPhaseBroken = 3,      // abandoned: the instance failed (peer: the rank that marked it; expected: call)
};

struct alignas(128) Signals {
  uint64_t ready[kMaxWorld];  // remote-written: epoch that rank s has entered
  uint64_t pad0[16 - kMaxWorld];
  uint64_t done[kMaxWorld];   // remote-written: epoch that rank s finished pushing to me
  uint64_t pad1[16 - kMaxWorld];
  uint64_t epoch;             // local: last completed call
  uint32_t cnt[kMaxWorld];    // local: blocks of the current call finished per target
  uint32_t fin;               // local: blocks of the current call finished in total
  uint64_t broken;            // local and remote-written: 0, or broken_word(call, rank that marked it)
  uint64_t gave_up;           // local: 1 once a kernel of this rank gave up (mismatch or deadline)
  uint64_t leaving[kMaxWorld];  // remote-written by rank s's host in destroy(): leaving_word(s) (see below)
};
static_assert(sizeof(Signals) <= kSignalBytes, "Signals must fit its region");

// destroy()'s arrival word: rank s's host writes leaving_word(s) into leaving[s] of every peer once
// s's device finished every kernel of the instance, so s writes into no peer's buffer any more. A
// rank frees its buffer only after every peer's word arrived (each is compared in full: a stray
// value is no arrival). The signal block is zeroed at construction, so a word from an earlier
// instance can never be there.
CK_HD constexpr uint64_t leaving_word(int rank) { return 0x4c45415645000000ull | (static_cast<uint64_t>(rank) + 1u); }

// The failure mark: the call number's low 32 bits in the high half, 1 + the marking rank in the low.
CK_HD constexpr uint64_t broken_word(uint64_t e, int rank) {
  return (uint64_t(static_cast<uint32_t>(e)) << 32) | (static_cast<uint64_t>(rank) + 1u);
}
CK_HD constexpr int broken_rank(uint64_t word) { return static_cast<int>(static_cast<uint32_t>(word)) - 1; }

// The entry-post rule of call e on rank `rank`, given the `broken` word it finds when it starts
// (a2a_kernel, block 0): post unless the instance was marked failed in an earlier call. A mark of this
// same call, by any rank (another block of this call found a mismatch or a deadline first; a peer's
// entry deadline expired waiting for this rank), must not hide this rank's entry from peers still
// waiting for it, or each of them would wait out its own deadline (W - 1 deadlines at W >= 3 for one
// late rank). Posting moves no data: the call stays failed here (nothing is pushed, no done posted).
// The call number is compared modulo 2^32 (broken_word keeps its low 32 bits), so a mark set exactly
// k * 2^32 calls earlier reads as this call's (tests/ipc_all2all/test_protocol_model.py).
CK_HD constexpr bool entry_post_allowed(uint64_t broken, uint64_t e, int /*rank*/) {
  return broken == 0u ||
         (static_cast<uint32_t>(broken >> 32) == static_cast<uint32_t>(e) && static_cast<uint32_t>(broken) != 0u);
}

// The entry-handshake word: call number e (its low 32 bits, compared in serial-number order by
// commkit::wait_tag_ge) in the high half, the call's signature in the low half.
CK_HD constexpr uint64_t ready_word(uint64_t e, uint32_t signature) {
  return (uint64_t(static_cast<uint32_t>(e)) << 32) | signature;
}
CK_HD constexpr uint32_t ready_call(uint64_t word) { return static_cast<uint32_t>(word >> 32); }
CK_HD constexpr uint32_t ready_signature(uint64_t word) { return static_cast<uint32_t>(word); }

// A call's signature: bits 31..28 the operation + 1 (0 = no call), bit 27 the output slot, bits
// 26..0 a hash of everything else every rank must agree on: the geometry (batch, bytes per row and
// target, row size, output rows, clamp, fp8 packing, world size) from the host, then the resolved
// token counts on the device (device counts can change between graph replays). x's own row count
// is left out: in host-count mode it is the rank's own count and differs between ranks.
CK_HD constexpr uint32_t sig_mix(uint32_t h, uint64_t v) {
  h = (h ^ static_cast<uint32_t>(v)) * 0x01000193u;
  h = (h ^ static_cast<uint32_t>(v >> 32)) * 0x01000193u;
  return h ^ (h >> 15);
}
constexpr uint32_t kSigHashMask = (1u << 27) - 1u;
CK_HD constexpr uint32_t signature_op(uint32_t sig) { return sig >> 28; }  // op + 1; 0: none
CK_HD constexpr uint32_t signature_slot(uint32_t sig) { return (sig >> 27) & 1u; }

struct BufferLayout {
  commkit::Region signals;
  commkit::Region slot[kNumSlots];
  uint64_t total;
};

// The layout of one rank's allocation for `capacity` bytes per slot.
CK_HD constexpr BufferLayout buffer_layout(uint64_t capacity) {
  commkit::Layout l;
  BufferLayout b{};
  b.signals = l.add(kSignalBytes, 4096);
  for (int s = 0; s < kNumSlots; ++s) b.slot[s] = l.add(commkit::align_up(capacity, kSlotAlign), kSlotAlign);
  b.total = l.total(4096);
  return b;
}

// How the grid's blocks are shared among targets: block ids [0, self) copy to the own rank, the rest
// go to the peers in equal groups of `per_peer` blocks, peer k (k = 1..W-1) being rank (rank+k) % W.
// Local copies run at HBM speed and NVLink is the bottleneck, so the own rank gets fewer blocks.
struct GridPlan {
  int self_blocks;
  int per_peer;
  int total;
};

CK_HD constexpr GridPlan grid_plan(int num_blocks, int world, int self_blocks_hint) {
  GridPlan g{1, 1, 1};
  if (world <= 1) {
    g.self_blocks = num_blocks < 1 ? 1 : num_blocks;
    g.per_peer = 0;
    g.total = g.self_blocks;
    return g;
  }
  int self = self_blocks_hint > 0 ? self_blocks_hint : num_blocks / (2 * world);
  if (self < 1) self = 1;
  int per_peer = (num_blocks - self) / (world - 1);
  if (per_peer < 1) per_peer = 1;
  g.self_blocks = self;
  g.per_peer = per_peer;
  g.total = self + per_peer * (world - 1);
  return g;
}

// The full signature: the host part with the resolved token counts n[0..world) folded into its hash.
CK_HD inline uint32_t call_signature(uint32_t base, const int64_t* n, int world) {
  uint32_t h = base;
  for (int i = 0; i < world; ++i) h = sig_mix(h, static_cast<uint64_t>(n[i]));
  return (base & ~kSigHashMask) | (h & kSigHashMask);
}

}  // namespace ipc_all2all
