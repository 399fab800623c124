// elastic_ep/csrc/host/engram.cpp -- EngramStore (engram.hpp): shared, pinned host segments of the table shards.
#if COMMKIT_WITH_CUDA
#include "host/engram.hpp"

#include <cuda_runtime.h>

#include "commkit/check.hpp"
#include "kernels/launch.hpp"

namespace elastic_ep {

EngramStore::EngramStore(int rank, int num_ranks, int64_t num_bytes)
    : rank_(rank), num_ranks_(num_ranks), num_bytes_(num_bytes) {
  CK_CHECK_ARG(num_ranks >= 1 && rank >= 0 && rank < num_ranks, "EngramStore: bad rank ", rank, " of ", num_ranks);
  CK_CHECK_ARG(num_bytes > 0, "EngramStore: num_cpu_bytes must be positive, got ", num_bytes);
  CK_CUDA_CHECK(cudaGetDevice(&device_));
  segs_.resize(num_ranks);
  registered_.assign(num_ranks, false);
  segs_[rank] = commkit::ShmSegment::create("elastic_ep_engram", uint64_t(num_bytes));
  CK_CUDA_CHECK(cudaHostRegister(segs_[rank].data(), size_t(num_bytes), cudaHostRegisterMapped | cudaHostRegisterPortable));
  registered_[rank] = true;
}

void EngramStore::attach(const std::vector<std::string>& names) {
  CK_CHECK_ARG(int(names.size()) == num_ranks_, "EngramStore.attach: expected ", num_ranks_, " names, got ",
               names.size());
  CK_CHECK_ARG(names[rank_] == name(), "EngramStore.attach: names[", rank_, "] is not this rank's segment");
  CK_CHECK(hosts_dev_ == nullptr, "EngramStore.attach: already attached");
  CK_CUDA_CHECK(cudaSetDevice(device_));
  std::vector<void*> dev(num_ranks_);
  for (int r = 0; r < num_ranks_; ++r) {
    if (r != rank_) {
      segs_[r] = commkit::ShmSegment::attach(names[r], uint64_t(num_bytes_));
      CK_CUDA_CHECK(cudaHostRegister(segs_[r].data(), size_t(num_bytes_), cudaHostRegisterMapped | cudaHostRegisterPortable));
      registered_[r] = true;
    }
    CK_CUDA_CHECK(cudaHostGetDevicePointer(&dev[r], segs_[r].data(), 0));
  }
  CK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&hosts_dev_), sizeof(void*) * num_ranks_));
  CK_CUDA_CHECK(cudaMemcpy(hosts_dev_, dev.data(), sizeof(void*) * num_ranks_, cudaMemcpyHostToDevice));
}

void EngramStore::write(uint64_t src, int64_t nbytes, int64_t stream) {
  CK_CHECK(!segs_.empty() && segs_[rank_].data() != nullptr, "EngramStore: closed");
  CK_CHECK_ARG(nbytes >= 0 && nbytes <= num_bytes_, "EngramStore.write: ", nbytes, " bytes exceed num_cpu_bytes=",
               num_bytes_);
  CK_CUDA_CHECK(cudaSetDevice(device_));
  CK_CUDA_CHECK(cudaMemcpyAsync(segs_[rank_].data(), reinterpret_cast<const void*>(src), size_t(nbytes),
                                cudaMemcpyDeviceToHost, reinterpret_cast<cudaStream_t>(stream)));
}

void EngramStore::fetch(uint64_t indices, int64_t num_indices, int64_t entries_per_rank, int64_t row_bytes,
                        uint64_t out, int64_t stream) {
  CK_CHECK(hosts_dev_ != nullptr, "EngramStore.fetch: not attached to the peers' segments");
  CK_CHECK_ARG(num_indices >= 0 && entries_per_rank > 0 && row_bytes > 0 && row_bytes % 16 == 0 &&
                   entries_per_rank * row_bytes <= num_bytes_,
               "EngramStore.fetch: bad sizes (", entries_per_rank, " entries of ", row_bytes, " bytes, segment of ",
               num_bytes_, ")");
  if (num_indices == 0) return;
  CK_CUDA_CHECK(cudaSetDevice(device_));
  launch_engram_fetch(const_cast<const void* const*>(hosts_dev_), reinterpret_cast<const int*>(indices), num_indices,
                      entries_per_rank, row_bytes, reinterpret_cast<void*>(out), reinterpret_cast<void*>(stream));
  CK_CUDA_CHECK(cudaGetLastError());
}

void EngramStore::close() {
  if (device_ >= 0) cudaSetDevice(device_);
  if (hosts_dev_ != nullptr) {
    cudaDeviceSynchronize();  // no fetch may still read the segments
    cudaFree(hosts_dev_);
    hosts_dev_ = nullptr;
  }
  for (size_t r = 0; r < segs_.size(); ++r) {
    if (registered_[r]) cudaHostUnregister(segs_[r].data());
    registered_[r] = false;
    segs_[r].close();
  }
}

}  // namespace elastic_ep
#endif  // COMMKIT_WITH_CUDA
