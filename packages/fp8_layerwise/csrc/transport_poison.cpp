// transport_poison.cpp -- Transport::Impl's failure paths: the sticky poison record in the control
// region (claimed once, then raised on every rank with the original cause), the liveness checks of
// the ranks a wait depends on (a dead or closed peer is reported in milliseconds, not at the
// timeout), and the interruption of a blocked call (Options::interrupt_check, e.g. Ctrl-C).
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "transport_impl.hpp"

namespace fp8lw {
namespace {

using commkit::cas;
using commkit::ld_acquire;
using commkit::ld_relaxed;
using commkit::monotonic_ns;
using commkit::st_release;
using commkit::st_relaxed;

const char* code_name(int code) {
  switch (code) {
    case kErrProtocol: return "protocol";
    case kErrTimeout: return "timeout";
    case kErrCudaInit: return "cuda-init";
    case kErrCopy: return "copy";
    case kErrWriter: return "writer";
    case kErrClosedWhileActive: return "closed-while-active";
    case kErrPeerDead: return "peer-dead";
    case kErrUser: return "user";
    case kErrInterrupted: return "interrupted";
    default: return "unknown";
  }
}

// The first bytes of `msg` that fit a record field of `cap` bytes (with its NUL), cut before a UTF-8
// sequence that would not fit whole: messages carry writer exceptions, which may be any text, and a
// record ending in half a character could not be turned into a Python str (UnicodeDecodeError
// instead of the poison on every rank).
std::string fit_utf8(const std::string& msg, size_t cap) {
  if (msg.size() < cap) return msg;
  // msg[n] is the first byte that does not fit; if it continues a character (10xxxxxx), that
  // character starts further back and goes as a whole.
  size_t n = cap - 1;
  while (n > 0 && (static_cast<unsigned char>(msg[n]) & 0xC0u) == 0x80u) --n;
  return msg.substr(0, n);
}

}  // namespace

// peer: the rank the failure is blamed on (e.g. the one a timeout waited for), -1 if none.
bool Transport::Impl::publish_poison(int code, int rank, const std::string& msg, int peer) noexcept {
  if (cas(&c_->poison.state, uint64_t{0}, kPoisonClaimed) != 0) return false;
  st_relaxed(&c_->poison.claim_ns, monotonic_ns());
  st_relaxed(&c_->poison.code, static_cast<uint64_t>(code));
  st_relaxed(&c_->poison.rank, static_cast<int64_t>(rank));
  st_relaxed(&c_->poison.peer, peer >= 0 && peer < tp_ ? static_cast<uint64_t>(peer) + 1u : uint64_t{0});
  st_relaxed(&c_->poison.generation, ld_relaxed(&c_->layer.generation));
  std::snprintf(c_->poison.message, sizeof(c_->poison.message), "%s",
                fit_utf8(msg, sizeof(c_->poison.message)).c_str());
  commkit::fence_system();
  st_release(&c_->poison.state, uint64_t{1});
  return true;
}

// Reads the record, giving a claimer 10 ms to finish publishing it.
void Transport::Impl::read_poison(int& code, int& rank, std::string& msg, int& peer) const {
  const uint64_t until = monotonic_ns() + 10000000ull;
  while (ld_acquire(&c_->poison.state) == kPoisonClaimed && monotonic_ns() < until) sched_yield();
  peer = -1;
  if (ld_acquire(&c_->poison.state) == kPoisonClaimed) {
    code = static_cast<int>(ld_relaxed(&c_->poison.code));
    rank = -1;
    msg = "poison publication did not complete (the claiming process may have died)";
    return;
  }
  code = static_cast<int>(ld_relaxed(&c_->poison.code));
  rank = static_cast<int>(ld_relaxed(&c_->poison.rank));
  const uint64_t p1 = ld_relaxed(&c_->poison.peer);
  peer = p1 >= 1 && p1 <= static_cast<uint64_t>(tp_) ? static_cast<int>(p1 - 1) : -1;
  char buf[sizeof(c_->poison.message)];
  std::memcpy(buf, c_->poison.message, sizeof(buf));
  buf[sizeof(buf) - 1] = '\0';
  msg = buf;
}

void Transport::Impl::raise_poison() const {
  int code, rank, peer;
  std::string msg;
  read_poison(code, rank, msg, peer);
  throw PoisonedError(commkit::str("fp8_layerwise transport poisoned (code ", code, " ", code_name(code), ", rank ",
                                   rank, "): ", msg, " [raised on rank ", rank_, "]"),
                      code, rank, msg, peer);
}

void Transport::Impl::poison_and_throw(int code, const std::string& msg, int peer) {
  publish_poison(code, rank_, msg, peer);
  raise_poison();
}

bool Transport::Impl::poison(int code, const std::string& msg) {
  return api("poison", [&] {
    CK_CHECK_ARG(code > 0, "poison code must be positive");
    return publish_poison(code, rank_, msg);
  });
}

Stats Transport::Impl::last_poison() const {
  Stats s;
  s.rank = rank_;
  s.poisoned = is_poisoned();
  if (s.poisoned) read_poison(s.error_code, s.error_rank, s.error_message, s.error_peer);
  return s;
}

// The poison record as the accessors report it: the live one until close() finished, then the
// copy close() kept. Holding final_mu_ keeps close() from finishing (and the owner from
// unmapping the region) while the live record is read.
Stats Transport::Impl::poison_snapshot() const {
  std::lock_guard<std::mutex> g(final_mu_);
  return final_ready_ ? final_poison_ : last_poison();
}

// Raises peer-dead if a rank in `mask` closed or its process is gone. With `record` it claims the
// poison record first (every rank then raises it); reset() waits while the record is already
// claimed by the failure being recovered from, so it raises the peer-dead error directly.
// A dead rank is reported before a closed one: a rank usually closes because it saw another die
// (and raised), so the death is the cause the user needs to hear about, whichever this rank
// happens to notice first.
// A rank that left after naming another (departed_blame) is reported as that rank, through
// chains of such departures, so every rank names the first rank that went.
void Transport::Impl::check_peers(uint32_t mask, const char* what, bool record) {
  int closed = -1;
  for (int r = 0; r < tp_; ++r) {
    if (r == rank_ || !(mask & (1u << r))) continue;
    const auto& rs = c_->ranks[r];
    const uint64_t status = ld_acquire(&rs.status);
    if (status == kRankClosed && closed < 0) closed = r;
    if (status != kRankAttached) continue;  // not attached yet: only the deadline applies
    const uint64_t pid = ld_relaxed(&rs.pid), boot = ld_relaxed(&rs.boot), ns = ld_relaxed(&rs.pid_ns);
    if (boot == 0 || (boot == self_.boot && ns == self_.pid_ns)) {  // its pid names it here
      if (!commkit::process_alive(pid, ld_relaxed(&rs.pid_start)))
        departed(r, commkit::str("rank ", r, " (pid ", pid, ") died"), what, record);
    } else if (boot == self_.boot) {  // another PID namespace (a container per rank): its heartbeat
      const uint64_t age = commkit::heartbeat_age_ns(&rs.heartbeat_ns);
      if (age > kHeartbeatStaleMs * 1000000ull)
        departed(r, commkit::str("rank ", r, " (pid ", pid, " in another PID namespace) died: no heartbeat for ",
                                 age / 1000000ull, " ms"), what, record);
    }  // another kernel: its pid and clock mean nothing here; the deadline applies
  }
  if (closed >= 0) departed(closed, commkit::str("rank ", closed, " closed its transport"), what, record);
}

// Rank r is gone (`how`); raises PeerDied naming r, or the rank r itself had named before it left.
void Transport::Impl::departed(int r, const std::string& how, const char* what, bool record) {
  int cause = r;
  for (int hops = 0; hops < tp_; ++hops) {  // bounded: a cycle cannot hang this
    const uint64_t b = ld_acquire(&c_->ranks[cause].departed_blame);
    if (b == 0 || int(b - 1) == cause || int(b - 1) == rank_ || b - 1 >= uint64_t(tp_)) break;
    cause = int(b - 1);
  }
  if (cause == r)
    peer_dead(r, commkit::str(how, " while rank ", rank_, " was waiting for ", what), record);
  peer_dead(cause, commkit::str("rank ", cause, " went away (reported by rank ", r, ", which then left: ", how,
                                ") while rank ", rank_, " was waiting for ", what),
            record);
}

void Transport::Impl::peer_dead(int r, const std::string& msg, bool record) {
  st_release(&c_->ranks[rank_].departed_blame, static_cast<uint64_t>(r) + 1u);
  if (!record)
    throw PoisonedError(commkit::str("fp8_layerwise transport: ", msg, " [raised on rank ", rank_, "]"),
                        kErrPeerDead, r, msg, r);
  publish_poison(kErrPeerDead, r, msg, r);
  raise_poison();
}

// When the next liveness check is due: liveness_ms from now, saturating (a huge liveness_ms
// means "never", not an overflow into the past).
uint64_t Transport::Impl::next_liveness_check() const {
  return commkit::add_saturating(monotonic_ns(), commkit::ms_to_ns_saturating(opt_.liveness_ms));
}

// When the next Options::interrupt_check is due: every kInterruptCheckMs, or every liveness tick
// when that is shorter (a huge timeout_ms or liveness_ms never delays it).
uint64_t Transport::Impl::next_interrupt_check() const {
  if (!opt_.interrupt_check) return ~uint64_t{0};
  return commkit::add_saturating(monotonic_ns(),
                                 commkit::ms_to_ns_saturating(std::min(opt_.liveness_ms, kInterruptCheckMs)));
}

// Asks the hook; on an interruption poisons the region the way close() of an active layer does
// (the peers raise at once, naming this rank and the cause) and raises InterruptedError.
void Transport::Impl::check_interrupt(const char* what) {
  if (!opt_.interrupt_check) return;
  const std::string why = opt_.interrupt_check();
  if (why.empty()) return;
  const std::string msg = commkit::str("rank ", rank_, " was interrupted (", why, ") in ", current_call(),
                                       "() while waiting for ", what);
  publish_poison(kErrInterrupted, rank_, msg);
  throw InterruptedError(commkit::str("fp8_layerwise transport: ", msg, " [raised on rank ", rank_, "]"), rank_);
}

}  // namespace fp8lw
