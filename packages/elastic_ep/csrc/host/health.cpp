// elastic_ep/csrc/host/health.cpp -- what the runtime reports between operations: expired device waits,
// the unusable state, the test-only epoch seed (see runtime.hpp). Empty unless the CUDA build is on.
#if COMMKIT_WITH_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "commkit/atomics.hpp"
#include "commkit/check.hpp"
#include "commkit/timeout_record.hpp"
#include "host/runtime.hpp"
#include "kernels/sizing.hpp"

namespace elastic_ep {

const char* op_name(uint32_t op) {
  switch (op) {
    case kOpBarrier: return "elastic_ep barrier";
    case kOpDispatchNotify: return "elastic_ep dispatch (notify: waiting for a peer's counts)";
    case kOpDispatchEpilogue: return "elastic_ep dispatch epilogue (waiting for a peer's token records)";
    case kOpCombine: return "elastic_ep combine (entry barrier)";
    case kOpCombineReduce: return "elastic_ep combine reduce (waiting for a peer's combined rows)";
    case kOpPpSend: return "elastic_ep pp_send (waiting for a free slot at the peer)";
    case kOpPpRecv: return "elastic_ep pp_recv (waiting for the peer's tensor)";
    case kOpAllGather: return "elastic_ep all_gather (waiting for a peer's data)";
    case kOpAgrsSession: return "elastic_ep destroy_agrs_session (waiting for a peer to end the session)";
    case kOpScaleoutProbe: return "elastic_ep scale-out probe (waiting for the previous rail peer's put)";
    case kOpDispatchScaleout:
      return "elastic_ep hybrid dispatch scale-out stage (the forwarder waiting for a rail peer's tokens)";
    case kOpCombineScaleup:
      return "elastic_ep hybrid combine scale-up stage (the forwarder waiting for a domain peer's partials)";
    case kOpCombineScaleout:
      return "elastic_ep hybrid combine scale-out stage (waiting for a rail peer's forwarded partials)";
    case kOpPeerDied: return "elastic_ep peer watch (a peer's process on this host died)";
    case kOpLowLatencyDispatch: return "elastic_ep low_latency_dispatch (receive: waiting for a peer's token counts)";
    case kOpLowLatencyCombine: return "elastic_ep low_latency_combine (receive: waiting for a peer's combined rows)";
    default: return "elastic_ep operation";
  }
}

namespace {

// The operation a timeout record names (its op code's low bits) and, for a wait on words or records a
// rank of this domain relays for another domain's rank (hybrid mode: launch.hpp kOpOriginShift), that
// rank: the record's peer is the relayer, the rank that did not deliver.
std::string timeout_operation(const commkit::TimeoutRecord& r) {
  std::string op = op_name(r.op & ((1u << kOpOriginShift) - 1u));
  const uint32_t origin = r.op >> kOpOriginShift;
  if (origin != 0u)
    op += " [hybrid mode: rank " + std::to_string(origin - 1u) + "'s, which rank " + std::to_string(r.peer) +
          " (the peer) relays to this domain]";
  return op;
}

}  // namespace

void Runtime::check_healthy() {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  auto* rec = host_workspace_layout().timeout.at<commkit::TimeoutRecord>(host_ws_.get());
  if (commkit::ld_acquire(&rec->flag) == 1u) {
    commkit::TimeoutRecord copy = *rec;
    broken_ = true;
    const std::string op = timeout_operation(copy);
    broken_reason_ = op + " timed out earlier";
    commkit::clear_timeout_record(rec);
    commkit::detail::raise_timeout(__FILE__, __LINE__, op, copy.rank, copy.peer, copy.expected,
                                   copy.observed, " after ", copy.waited_ns / 1000000ull,
                                   " ms without progress (GPU block ", copy.channel,
                                   "); the CUDA context is usable but this buffer's signals are out of step: "
                                   "destroy it and create a new one");
  }
  CK_CHECK(!broken_, "this elastic buffer is unusable (", broken_reason_, "); destroy it and create a new one");
}

Runtime::TimeoutInfo Runtime::take_timeout() {
  TimeoutInfo info;
  if (destroyed_ || !host_ws_) return info;
  auto* rec = host_workspace_layout().timeout.at<commkit::TimeoutRecord>(host_ws_.get());
  if (commkit::ld_acquire(&rec->flag) != 1u) return info;
  commkit::TimeoutRecord copy = *rec;
  commkit::clear_timeout_record(rec);
  info.expired = true;
  info.operation = timeout_operation(copy);
  info.rank = copy.rank;
  info.peer = copy.peer;
  info.expected = copy.expected;
  info.observed = copy.observed;
  info.waited_ms = copy.waited_ns / 1000000ull;
  info.channel = copy.channel;
  broken_ = true;
  broken_reason_ = info.operation + " timed out earlier";
  return info;
}

void Runtime::watch_peers(const std::vector<commkit::ProcessId>& peers, int period_ms) {
  CK_CHECK(!destroyed_ && host_ws_, "the elastic buffer was destroyed");
  CK_CHECK_ARG(int(peers.size()) == num_ranks_, "watch_peers: expected one process id per rank (", num_ranks_,
               "), got ", peers.size());
  watch_.reset();
  if (period_ms <= 0) return;
  watch_ = std::make_unique<commkit::PeerWatch>(host_workspace_layout().timeout.at<commkit::TimeoutRecord>(host_ws_.get()),
                                                uint32_t(kOpPeerDied), rank_, peers, period_ms);
}

int Runtime::pending_health() const {
  if (destroyed_ || !host_ws_) return kHealthBroken;
  const auto hl = host_workspace_layout();
  int bits = broken_ ? int(kHealthBroken) : 0;
  if (commkit::ld_acquire(&hl.timeout.at<commkit::TimeoutRecord>(host_ws_.get())->flag) == 1u) bits |= kHealthTimeout;
  if (commkit::ld_acquire(&hl.ids.at<uint64_t>(host_ws_.get())[2]) != masked_ids_seen_) bits |= kHealthMaskedIds;
  if (commkit::ld_acquire(&hl.geometry.at<uint64_t>(host_ws_.get())[0]) != geometry_refusals_seen_)
    bits |= kHealthGeometry;
  return bits;
}

void Runtime::debug_seed_epoch(uint64_t last_epoch) {
  CK_CHECK(!destroyed_ && !broken_, "debug_seed_epoch needs a usable buffer");
  set_device();
  CK_CUDA_CHECK(cudaDeviceSynchronize());  // no kernel of this rank may be running
  const auto ws = workspace_layout();
  char* base = static_cast<char*>(window_->mem());
  CK_CUDA_CHECK(cudaMemcpy(base + ws.grid_counter.offset + 4ull * kGridCounterEpochSlot, &last_epoch,
                           sizeof(last_epoch), cudaMemcpyHostToDevice));
  const std::vector<uint64_t> words(std::max(kMaxRanks * kGeometryWords, kMaxExperts),
                                    uint64_t(uint32_t(last_epoch)) << 32);
  CK_CUDA_CHECK(cudaMemcpy(base + ws.rank_count.offset, words.data(), 8ull * kMaxRanks, cudaMemcpyHostToDevice));
  CK_CUDA_CHECK(
      cudaMemcpy(base + ws.expert_count.offset, words.data(), 8ull * kMaxExperts, cudaMemcpyHostToDevice));
  CK_CUDA_CHECK(cudaMemcpy(base + ws.geometry.offset, words.data(), 8ull * kMaxRanks * kGeometryWords,
                           cudaMemcpyHostToDevice));
  for (int half = 0; half < 2; ++half)  // hybrid notify's relayed words carry the tag too
    CK_CUDA_CHECK(cudaMemcpy(base + ws.count_relay.offset + half * 8ull * kMaxRanks, words.data(),
                             half == 0 ? 8ull * kMaxRanks : 8ull * kMaxExperts, cudaMemcpyHostToDevice));
}

}  // namespace elastic_ep
#endif  // COMMKIT_WITH_CUDA
