// control.hpp -- the plain-old-data control block that every rank of one transport maps from
// process-shared memory.
//
// Ownership of the cache lines (so no two writers share a line on the hot path):
//   Header        written once by initialize_control(), read on attach (magic/version/size/tp/slots).
//   PoisonRecord  sticky error record: state 0 healthy -> kPoisonClaimed (CAS, exactly one winner)
//                 -> 1 published. Cleared only by a reset, which bumps LayerState::generation.
//   LayerState    rank 0 only: active epoch, layer id, expert count, next sequence, producer done.
//   ProducerStats rank 0 only: writer / slot-wait / total nanoseconds of the last layer.
//   RankState[r]  rank r only (its API thread and its consumer thread): join / done / returned
//                 epochs, liveness (pid + /proc start time), reset handshake, stats, the geometry
//                 it attached with (expert_nbytes, num_experts), and acks[slot].
//   ReadySlot[s]  rank 0 only: the (sequence, epoch, expert) that was last published in slot s.
// All cross-process accesses use commkit atomics (acquire/release on x86-64 is just ordering).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace fp8lw {

constexpr int kMaxTP = 8;
constexpr int kMaxSlots = 16;
constexpr int kKinds = 4;  // w13 FP8, w13 scale (fp32), w2 FP8, w2 scale (fp32)
constexpr size_t kControlBytes = 8192;  // the region size callers allocate (as in KTransformers')
constexpr uint64_t kMagic = 0x4b4346503857314cULL;  // "L1W8PFCK" little-endian: ours, not KTransformers'
// 4: RankState carries the attach geometry; 5: and departed_blame; 6: PoisonRecord::peer and
// LayerState::run_epoch; 7: RankState's boot / pid_ns / heartbeat_ns.
constexpr uint64_t kVersion = 7;
constexpr uint64_t kPoisonClaimed = ~0ull;

enum ErrorCode : int {
  kErrNone = 0,
  kErrProtocol = 1,
  kErrTimeout = 2,
  kErrCudaInit = 3,
  kErrCopy = 4,
  kErrWriter = 5,
  kErrClosedWhileActive = 6,
  kErrPeerDead = 7,
  kErrUser = 8,  // poison() called explicitly (e.g. an exception inside `with transport.layer()`)
  kErrInterrupted = 9,  // a blocked call was interrupted by a signal (Ctrl-C) on the recording rank
};

enum RankStatus : uint64_t { kRankAbsent = 0, kRankAttached = 1, kRankClosed = 2 };

struct alignas(64) Header {
  uint64_t magic;
  uint64_t version;
  uint64_t struct_bytes;
  uint64_t tp_size;
  uint64_t num_slots;
  uint64_t reserved[3];
};

struct alignas(64) PoisonRecord {
  uint64_t state;  // 0, kPoisonClaimed, 1
  uint64_t code;
  int64_t rank;
  uint64_t claim_ns;  // monotonic time of the claim: a claimer that died mid-publication is detected
  uint64_t generation;  // generation in which the poison happened
  uint64_t peer;        // 1 + the rank the failure is blamed on (the one a timeout waited for); 0: none
  uint64_t reserved[2];
  char message[256];
};

struct alignas(64) LayerState {
  uint64_t active_epoch;
  int64_t layer_id;
  uint64_t expert_count;
  uint64_t next_sequence;
  uint64_t producer_done_epoch;
  uint64_t generation;  // bumped by reset(); consumers re-arm when it changes
  uint64_t layer_start_ns;
  uint64_t run_epoch;  // the epoch rank 0's run() last started (so waits can tell "run() not called")
};

struct alignas(64) ProducerStats {
  uint64_t writer_ns;
  uint64_t slot_wait_ns;
  uint64_t total_ns;
  uint64_t reserved[5];
};

struct alignas(64) RankState {
  uint64_t join_epoch;
  uint64_t consumer_done_epoch;
  uint64_t wait_returned_epoch;
  uint64_t status;      // RankStatus
  uint64_t pid;
  uint64_t pid_start;   // /proc/<pid>/stat starttime: tells a recycled pid from the live rank
  // Where the pid means something (commkit::ProcessId): a peer of another kernel boot or PID namespace
  // (one container per rank) judges this rank by heartbeat_ns instead (CLOCK_MONOTONIC, beaten by a
  // thread of this rank while it is attached). 0 = unknown (the pid alone is judged).
  uint64_t boot;
  uint64_t pid_ns;
  uint64_t heartbeat_ns;
  uint64_t reset_request;    // generation + 1 once this rank called reset()
  uint64_t consumer_parked;  // generation + 1 once this rank's consumer drained after a poison
  uint64_t h2d_ns;
  uint64_t bytes;
  uint64_t copies;      // number of copy calls issued last layer (shows coalescing)
  // The geometry this rank attached with, written before `status` turns kRankAttached. Rank 0
  // writes every rank's slots at its own offsets and each rank copies at its own, so every rank
  // checks its values against rank 0's (on attach and on join): a disagreement would otherwise
  // deliver wrong bytes silently.
  uint64_t expert_nbytes[kKinds];
  uint64_t num_experts;
  // 1 + the rank this rank named when it raised PeerDied (0: none), written before it raises. Its
  // own departure is then a consequence: a rank that later finds it gone names the rank it named
  // (reset() has no poison record to carry the first cause). Cleared on attach and by a reset.
  uint64_t departed_blame;
  uint64_t ack[kMaxSlots];  // last sequence this rank finished copying out of slot s
};

struct alignas(64) ReadySlot {
  uint64_t sequence;
  uint64_t epoch;
  uint64_t expert;
  uint64_t reserved[5];
};

struct alignas(64) Control {
  Header header;
  PoisonRecord poison;
  LayerState layer;
  ProducerStats pstats;
  RankState ranks[kMaxTP];
  ReadySlot ready[kMaxSlots];
};

static_assert(std::is_trivial<Control>::value && std::is_standard_layout<Control>::value,
              "the control block lives in shared memory and must be POD");
static_assert(sizeof(RankState) % 64 == 0 && sizeof(ReadySlot) == 64, "one owner per cache line");
static_assert(sizeof(Control) <= kControlBytes, "control block must fit the 8 KiB region");

}  // namespace fp8lw
