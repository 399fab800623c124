// elastic_ep/csrc/host/ops_pp_agrs.cpp -- PP send/recv, AGRS gathers and session ends, and the scale-out
// probe over the runtime's window (see runtime.hpp). Point-to-point or copy-engine operations: no
// epoch. Empty unless the CUDA build is on.
#if COMMKIT_WITH_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <array>

#include "commkit/check.hpp"
#include "host/runtime.hpp"
#include "kernels/sizing.hpp"

namespace elastic_ep {

void Runtime::pp_transfer(const PpParams& p, bool send, int64_t stream) {
  const char* op = send ? "pp_send" : "pp_recv";
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  CK_CHECK(p.peer >= 0 && p.peer < num_ranks_ && p.peer != rank_ && p.nbytes >= 0 && p.nbytes <= p.slot_bytes &&
               p.num_max_inflight > 0 && p.num_max_inflight <= kPpDescEntries / num_ranks_ &&
               int64_t(num_ranks_) * p.num_max_inflight * p.slot_bytes <= num_buffer_bytes_,
           op, ": bad parameters (peer ", p.peer, ", ", p.nbytes, " bytes, slots of ", p.slot_bytes, ", ",
           p.num_max_inflight, " in flight)");
  // Over GIN another node's window is not mapped, and PP has no GIN kernels (DeepEP's PP uses GIN).
  const auto& hosts = window_->host_peer_bases();
  CK_CHECK(hosts.empty() || hosts[p.peer] != nullptr, op, ": rank ", p.peer,
           " is in another NVLink domain; PP over the GIN scale-out transport is not supported");
  set_device();
  (send ? launch_pp_send : launch_pp_recv)(view_all(), p, reinterpret_cast<void*>(stream));
  CK_CUDA_CHECK(cudaGetLastError());
}

std::vector<int64_t> Runtime::pp_unreceived() {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  set_device();
  CK_CUDA_CHECK(cudaDeviceSynchronize());
  const auto ws = workspace_layout();
  std::vector<uint64_t> sent(num_ranks_), received(num_ranks_);
  const char* base = static_cast<const char*>(window_->base());
  CK_CUDA_CHECK(cudaMemcpy(sent.data(), base + ws.pp_sent.offset, 8 * sent.size(), cudaMemcpyDeviceToHost));
  CK_CUDA_CHECK(cudaMemcpy(received.data(), base + ws.pp_seq.offset + 8ull * kMaxRanks, 8 * received.size(),
                           cudaMemcpyDeviceToHost));
  std::vector<int64_t> out(num_ranks_);
  for (int r = 0; r < num_ranks_; ++r) out[r] = int64_t(sent[r] - received[r]);
  return out;
}

std::vector<std::array<uint64_t, 5>> Runtime::pp_refusals() {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  set_device();
  CK_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint64_t> words(4ull * num_ranks_);
  const char* base = static_cast<const char*>(window_->base());
  CK_CUDA_CHECK(cudaMemcpy(words.data(), base + workspace_layout().pp_refusal.offset, 8 * words.size(),
                           cudaMemcpyDeviceToHost));
  std::vector<std::array<uint64_t, 5>> out;
  for (int r = 0; r < num_ranks_; ++r) {
    const uint64_t* w = &words[4 * r];
    if (w[0] != 0) out.push_back({uint64_t(r), w[0], w[1], w[2], w[3]});
  }
  return out;
}

void Runtime::agrs_all_gather(const std::vector<uint64_t>& srcs, const std::vector<int64_t>& nbytes,
                              const std::vector<int64_t>& offsets, const std::vector<uint64_t>& record,
                              int64_t stream) {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  CK_CHECK(srcs.size() == nbytes.size() && srcs.size() == offsets.size() && !srcs.empty(),
           "all_gather: one source, size and offset per tensor");
  CK_CHECK(record.size() == size_t(kAgrsRecordWords), "all_gather: a record of ", kAgrsRecordWords, " words, got ",
           record.size());
  AgrsGatherParams params{};
  std::copy(record.begin(), record.end(), params.record);
  const auto& hosts = window_->host_peer_bases();
  CK_CHECK(int(hosts.size()) == num_ranks_, "all_gather: the peers' windows are not open");
  CK_CHECK(!gin_, "all_gather: AGRS copies into every rank's window over NVLink; this buffer spans NVLink domains "
           "(GIN), so it has no AGRS");
  for (size_t i = 0; i < srcs.size(); ++i)
    CK_CHECK(nbytes[i] >= 0 && offsets[i] >= 0 && offsets[i] + num_ranks_ * nbytes[i] <= num_buffer_bytes_,
             "all_gather: tensor ", i, " (", nbytes[i], " bytes at ", offsets[i], ") exceeds the buffer");
  set_device();
  auto s = reinterpret_cast<cudaStream_t>(stream);
  // Peers in a rotating order, starting with the next rank, so the ranks' first copies do not all
  // target rank 0.
  for (int j = 0; j < num_ranks_; ++j) {
    const int r = (rank_ + 1 + j) % num_ranks_;
    for (size_t i = 0; i < srcs.size(); ++i) {
      if (nbytes[i] == 0) continue;
      char* dst = hosts[r] + workspace_bytes_ + offsets[i] + int64_t(rank_) * nbytes[i];
      const void* src = reinterpret_cast<const void*>(srcs[i]);
      if (r == rank_ && dst == src) continue;  // written in place (agrs_get_inplace_tensor)
      CK_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(nbytes[i]), cudaMemcpyDeviceToDevice, s));
    }
  }
  launch_agrs_gather_done(view_all(), params, s);
  CK_CUDA_CHECK(cudaGetLastError());
}

void Runtime::agrs_session_end(int64_t stream) {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  set_device();
  launch_agrs_session_end(view_all(), reinterpret_cast<void*>(stream));
  CK_CUDA_CHECK(cudaGetLastError());
}

void Runtime::scaleout_probe(const ScaleoutProbeParams& p, int64_t stream) {
  CK_CHECK(!destroyed_, "the elastic buffer was destroyed");
  CK_CHECK(p.next >= 0 && p.next < num_ranks_ && p.prev >= 0 && p.prev < num_ranks_ && p.bytes % 16 == 0 &&
               p.src % 16 == 0 && p.dst % 16 == 0 && p.src >= workspace_bytes_ && p.dst >= workspace_bytes_ &&
               p.src + p.bytes <= workspace_bytes_ + uint64_t(num_buffer_bytes_) &&
               p.dst + p.bytes <= workspace_bytes_ + uint64_t(num_buffer_bytes_),
           "scaleout_probe: bad parameters (next ", p.next, ", prev ", p.prev, ", ", p.bytes, " bytes from ", p.src,
           " to ", p.dst, ")");
  set_device();
  launch_scaleout_probe(view_all(), p, reinterpret_cast<void*>(stream));
  CK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace elastic_ep
#endif  // COMMKIT_WITH_CUDA
