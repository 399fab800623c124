// elastic_ep/csrc/host/engram.hpp -- the native runtime's Engram store: every rank's table shard in host memory
// that every GPU of the node reads directly (DeepEP V2's Engram reaches it by RDMA gets, which need a NIC).
//
// Each rank's shard lives in a POSIX shared-memory segment of num_cpu_bytes (commkit::ShmSegment: mode
// 0600, an unguessable name, unlinked as soon as every peer attached), pinned and mapped for its GPU
// with cudaHostRegister. The ranks exchange the names (the caller does, over its process group), attach
// to each other's segments and register them too, so a fetch kernel reads any rank's rows over PCIe
// with no peer taking part. Single node only: the segments are the node's memory.
//   EngramStore(rank, num_ranks, num_bytes)  creates and registers this rank's segment
//   name()                                   its name, for the peers' attach()
//   attach(names)                            names[r] of every rank r, in rank order (this rank's own
//                                            checked); registers the peers' segments
//   unlink()                                 drops this rank's name (after every peer attached)
//   write(src, nbytes, stream)               device bytes -> this rank's segment (async on stream)
//   fetch(...)                               rows of global entries -> a device tensor (engram.cuh)
//   close()                                  unregisters and unmaps everything (also the destructor)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "commkit/shm.hpp"

namespace elastic_ep {

class EngramStore {
 public:
  EngramStore(int rank, int num_ranks, int64_t num_bytes);
  ~EngramStore() { close(); }
  EngramStore(const EngramStore&) = delete;
  EngramStore& operator=(const EngramStore&) = delete;

  const std::string& name() const { return segs_[rank_].name(); }
  int64_t num_bytes() const { return num_bytes_; }
  void attach(const std::vector<std::string>& names);
  void unlink() { segs_[rank_].unlink(); }
  void write(uint64_t src, int64_t nbytes, int64_t stream);
  // indices: device int32 [num_indices] global entries (checked by the caller: in [0, entries x ranks));
  // out: device [num_indices][row_bytes]; row_bytes a multiple of 16 and entries x row_bytes <= num_bytes.
  void fetch(uint64_t indices, int64_t num_indices, int64_t entries_per_rank, int64_t row_bytes, uint64_t out,
             int64_t stream);
  void close();

 private:
  int rank_, num_ranks_, device_ = -1;
  int64_t num_bytes_;
  std::vector<commkit::ShmSegment> segs_;  // [num_ranks]; this rank's created, the peers' attached
  std::vector<bool> registered_;
  void** hosts_dev_ = nullptr;             // device [num_ranks]: each segment's device-mapped address
};

}  // namespace elastic_ep
