// failure_record.cpp -- see failure_record.hpp.
#include "failure_record.hpp"

#include <atomic>

#include "a2a_types.hpp"
#include "commkit/atomics.hpp"
#include "commkit/check.hpp"

namespace ipc_all2all {

const char* op_name(uint32_t op) {
  switch (op) {
    case kSendRecvHeads * 4 + kPhaseEntry: return "send_recv_heads (entry handshake: peer never entered the call)";
    case kSendRecvHeads * 4 + kPhaseCompletion: return "send_recv_heads (completion: peer's data never arrived)";
    case kSendRecvHeads * 4 + kPhaseMismatch: return "send_recv_heads (entry handshake: peer entered another call)";
    case kSendRecvHeads * 4 + kPhaseBroken: return "send_recv_heads (abandoned: the instance failed)";
    case kGatherHeads * 4 + kPhaseEntry: return "gather_heads (entry handshake: peer never entered the call)";
    case kGatherHeads * 4 + kPhaseCompletion: return "gather_heads (completion: peer's data never arrived)";
    case kGatherHeads * 4 + kPhaseMismatch: return "gather_heads (entry handshake: peer entered another call)";
    case kGatherHeads * 4 + kPhaseBroken: return "gather_heads (abandoned: the instance failed)";
    case kAllGather * 4 + kPhaseEntry: return "allgather (entry handshake: peer never entered the call)";
    case kAllGather * 4 + kPhaseCompletion: return "allgather (completion: peer's data never arrived)";
    case kAllGather * 4 + kPhaseMismatch: return "allgather (entry handshake: peer entered another call)";
    case kAllGather * 4 + kPhaseBroken: return "allgather (abandoned: the instance failed)";
    case kPeerWatch * 4: return "ipc_all2all peer watch (a peer's process on this host died)";
    default: return "unknown ipc_all2all operation";
  }
}

const char* kind_name(uint32_t kind) {
  switch (kind) {
    case kSendRecvHeads: return "send_recv_heads";
    case kGatherHeads: return "gather_heads";
    case kAllGather: return "allgather";
    default: return "an unknown operation";
  }
}

const char kRecreate[] = "; destroy() the instance on every rank and build a new one";

std::string failure_message(const commkit::TimeoutRecord& r) {
  const uint32_t kind = r.op / 4, phase = r.op % 4;
  const char* me = kind_name(kind);
  if (phase == kPhaseMismatch) {
    const uint64_t mine = static_cast<uint64_t>(r.expected), theirs = static_cast<uint64_t>(r.observed);
    const uint32_t my_sig = ready_signature(mine), their_sig = ready_signature(theirs);
    std::string why;
    if (ready_call(theirs) != ready_call(mine)) {
      why = commkit::str("peer ", r.peer, " is at call ", ready_call(theirs), " while this rank is at call ",
                         ready_call(mine));
    } else if (signature_op(their_sig) != signature_op(my_sig)) {
      why = commkit::str("peer ", r.peer, " is running ",
                         signature_op(their_sig) == 0 ? "no call" : kind_name(signature_op(their_sig) - 1),
                         " while this rank runs ", me, " (call ", ready_call(mine),
                         " of both: a rank skipped or added a call)");
    } else if (signature_slot(their_sig) != signature_slot(my_sig)) {
      why = commkit::str("peer ", r.peer, " runs ", me, " into output slot ", signature_slot(their_sig),
                         ", this rank into slot ", signature_slot(my_sig),
                         " (the ranks' call histories differ, e.g. a CUDA graph captured on some ranks only)");
    } else {
      why = commkit::str("peer ", r.peer, " runs ", me,
                         " with another batch, head layout, element size, fp8 mode or token counts (signature ",
                         commkit::hex(their_sig), ", this rank's ", commkit::hex(my_sig), ")");
    }
    return commkit::str("ipc_all2all: ", me, " on rank ", r.rank, ": ", why,
                        "; every rank must make the same calls in the same order with the same shapes and "
                        "set_rank_tokens. Nothing was written to the peer", kRecreate);
  }
  if (phase == kPhaseBroken) {
    const std::string by = r.peer == r.rank ? std::string(" (on this rank)")
                           : r.peer >= 0    ? commkit::str(" (marked failed by rank ", r.peer, ")")
                                            : std::string();
    return commkit::str("ipc_all2all: ", me, " on rank ", r.rank, " (call ", r.expected,
                        ") was abandoned: this instance failed in this or an earlier call", by,
                        "; its output and every later one are invalid (an input may derive from the failed call)",
                        kRecreate);
  }
  return commkit::str(op_name(r.op), " timed out on rank ", r.rank, " waiting for peer ", r.peer, ": expected call ",
                      r.expected, ", observed ", r.observed);
}


namespace {
// One copy of the fields, each read once (volatile: the compiler may neither cache nor merge them).
commkit::TimeoutRecord snapshot(const commkit::TimeoutRecord* rec) {
  const volatile commkit::TimeoutRecord* v = rec;
  commkit::TimeoutRecord c{};
  c.flag = v->flag;
  c.op = v->op;
  c.rank = v->rank;
  c.peer = v->peer;
  c.expected = v->expected;
  c.observed = v->observed;
  c.waited_ns = v->waited_ns;
  c.channel = v->channel;
  return c;
}

bool same_fields(const commkit::TimeoutRecord& a, const commkit::TimeoutRecord& b) {
  return a.op == b.op && a.rank == b.rank && a.peer == b.peer && a.expected == b.expected &&
         a.observed == b.observed && a.waited_ns == b.waited_ns && a.channel == b.channel;
}
}  // namespace

std::string plausible(const commkit::TimeoutRecord& r, int world, int rank) {
  if (r.rank != rank) return commkit::str("it names rank ", r.rank, " as the rank that waited, not this rank ", rank);
  const uint32_t kind = r.op / 4, phase = r.op % 4;
  const bool watch = r.op == uint32_t(kPeerWatch) * 4;
  if (!watch && kind > uint32_t(kAllGather)) return commkit::str("unknown operation code ", r.op);
  // An abandoned call names the rank whose mark it found (a word peers write): -1 when the mark
  // carried none. Every other record names the peer waited for, never this rank.
  const bool peer_ok = phase == uint32_t(kPhaseBroken) && !watch ? r.peer >= -1 && r.peer < world
                                                                 : r.peer >= 0 && r.peer < world && r.peer != rank;
  if (!peer_ok) return commkit::str("peer ", r.peer, " is not a rank this record can name (world size ", world, ")");
  return {};
}

RecordRead read_failure_record(const commkit::TimeoutRecord* rec, int world, int rank, int tries,
                               const std::function<void()>& between) {
  RecordRead out;
  for (int i = 0; i < tries; ++i) {
    const uint32_t flag = commkit::ld_acquire(&rec->flag);
    if (flag == kFlagClear || flag == kFlagHostAbort) return out;
    if (flag != kFlagReady) {
      if (flag == kFlagWriting) continue;
      out.state = RecordState::kMalformed;
      out.rec = snapshot(rec);
      out.why = commkit::str("its flag word is ", flag, " (0, 1, 2 or 3 expected)");
      return out;
    }
    const commkit::TimeoutRecord a = snapshot(rec);
    if (between) between();
    std::atomic_thread_fence(std::memory_order_acquire);
    const commkit::TimeoutRecord b = snapshot(rec);
    if (commkit::ld_acquire(&rec->flag) != kFlagReady || !same_fields(a, b)) continue;
    out.rec = b;
    out.why = plausible(b, world, rank);
    out.state = out.why.empty() ? RecordState::kReady : RecordState::kMalformed;
    return out;
  }
  out.state = RecordState::kPending;
  return out;
}

}  // namespace ipc_all2all
