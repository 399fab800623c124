// elastic_ep/csrc/host/comm.hpp -- NCCL communicators for the native runtime (module-level _C functions,
// DeepEP V2's names). Host only; CUDA builds. Communicators are ncclComm_t passed as int64.
//   nccl_runtime_version()            ncclGetVersion of the loaded libnccl
//   nccl_build_version()              NCCL_VERSION_CODE of the headers the package was compiled against
//   get_local_nccl_unique_id()        a new ncclUniqueId as bytes (rank 0 broadcasts it)
//   create_nccl_comm(id, R, rank)     ncclCommInitRank on the current device (collective)
//   destroy_nccl_comm(comm)           ncclCommAbort: frees it without waiting for peers that are gone
//   nccl_comm_rank_size(comm)         (rank, size) of a communicator
//   comm_gin_properties(comm)         (ginType, railedGinType, nLsaTeams) from ncclCommQueryProperties,
//                                     or nullopt when the headers or the loaded NCCL predate it (< 2.29)
// Bad arguments raise commkit::ValueError, NCCL failures commkit::Error.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace elastic_ep {

int nccl_runtime_version();
int nccl_build_version();
std::string get_local_nccl_unique_id();
int64_t create_nccl_comm(const std::string& unique_id, int num_ranks, int rank);
void destroy_nccl_comm(int64_t comm);
std::tuple<int, int> nccl_comm_rank_size(int64_t comm);
std::optional<std::tuple<int, int, int>> comm_gin_properties(int64_t comm);

}  // namespace elastic_ep
