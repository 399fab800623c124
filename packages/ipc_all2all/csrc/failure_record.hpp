// failure_record.hpp -- how the host reads the failure record (commkit::TimeoutRecord in host-mapped
// memory) that this rank's kernels and its peer watch write, and the messages it raises. Host only,
// CUDA-free: the CPU tests forge records and read them with the same code as Core::check.
//
// Writers of one instance's record:
//   * its kernels (commkit::report_timeout): claim flag 0 -> 2 by CAS, fill the fields, release-store
//     flag = 1. One device writer at a time, but the host may look while flag is 2 (half written);
//   * its peer watch (commkit::PeerWatch, a host thread): claims it the same way (CAS 0 -> 2, fields,
//     flag = 1), so a kernel and the watch never mix their fields. The watch sets its dead_peer()
//     before it claims anything: once that is set, the host reports the death from the watch's own
//     state and reads no field of the record.
//   * destroy() (host): flag = kFlagHostAbort when its deadline ends the kernels' waits (no fields).
// Core::check clears a record it read (a call queued behind the failed one reports too) with
// commkit::clear_timeout_record: the fields while the flag still says 1, so no writer can claim it meanwhile,
// then the flag. A whole-struct assignment could store the flag's 0 before the other zeros, and a
// kernel claiming the record in between would see its fields overwritten by them.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "commkit/timeout_record.hpp"

namespace ipc_all2all {

// flag values (commkit::report_timeout writes 2 then 1).
constexpr uint32_t kFlagClear = 0, kFlagReady = 1, kFlagWriting = 2;
// Set by destroy() when its deadline passed: every wait of this instance's kernels leaves (they poll
// flag != 0); the host reports nothing for it.
constexpr uint32_t kFlagHostAbort = 3;

enum class RecordState : int {
  kClear = 0,      // nothing recorded (or only destroy()'s abort)
  kPending = 1,    // a writer is still filling it (flag 2, or two reads disagreed every time)
  kReady = 2,      // `rec` is one writer's complete record, and its fields are plausible
  kMalformed = 3,  // complete and stable, but a field is impossible for this rank (`why` says which)
};

struct RecordRead {
  RecordState state = RecordState::kClear;
  commkit::TimeoutRecord rec{};
  std::string why;
};

// Reads `rec` as rank `rank` of `world`: the flag (acquire), then the fields twice with the flag
// re-read after them; the read counts only when the flag stayed kFlagReady and both copies agree
// (a writer still storing would make them differ). Up to `tries` attempts (a device writer needs
// microseconds), then kPending. `between` (tests only) runs between the two copies, standing in for
// a concurrent writer. Never throws; never trusts a field: see plausible().
RecordRead read_failure_record(const commkit::TimeoutRecord* rec, int world, int rank, int tries = 100000,
                               const std::function<void()>& between = {});

// Empty when `r` could have been written by this rank's kernels or watch; else why not (its rank is
// not this rank, an unknown operation, a peer outside [0, world) or this rank itself, ...).
std::string plausible(const commkit::TimeoutRecord& r, int world, int rank);

// The name of a record's op code (kind * 4 + phase), e.g. for TimeoutError.operation.
const char* op_name(uint32_t op);
// The name of a call kind (kSendRecvHeads, ...), or "an unknown operation".
const char* kind_name(uint32_t kind);
// The message the host raises for a record (host only; exposed for the CPU tests).
std::string failure_message(const commkit::TimeoutRecord& r);
// The advice every failure message ends with.
extern const char kRecreate[];

}  // namespace ipc_all2all
