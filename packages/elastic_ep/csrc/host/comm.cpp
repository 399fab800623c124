// elastic_ep/csrc/host/comm.cpp -- NCCL communicators (see comm.hpp). Empty unless the CUDA build is on.
#if COMMKIT_WITH_CUDA
#include "host/comm.hpp"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstring>

#include "commkit/check.hpp"
#include "kernels/launch.hpp"

#if NCCL_VERSION_CODE < 22809
#error "elastic_ep needs NCCL >= 2.28.9 (window registration, device communicators, LSA pointers)"
#endif

namespace elastic_ep {
namespace {

// A function only newer NCCLs export, looked up in the libnccl this extension loaded rather than linked:
// a build against newer headers must still load with an older NCCL (torch 2.11 ships 2.28.9). Null when
// the library lacks it.
void* nccl_optional_symbol(const char* name) {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&ncclGetVersion), &info) == 0 || info.dli_fname == nullptr) return nullptr;
  void* lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);  // the loaded one, never a second copy
  if (lib == nullptr) return nullptr;
  void* sym = dlsym(lib, name);
  dlclose(lib);  // drops the reference RTLD_NOLOAD took; the library stays loaded
  return sym;
}

}  // namespace

int nccl_runtime_version() {
  int v = 0;
  CK_NCCL_CHECK(ncclGetVersion(&v));
  return v;
}

int nccl_build_version() { return NCCL_VERSION_CODE; }

std::string get_local_nccl_unique_id() {
  ncclUniqueId id;
  CK_NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

int64_t create_nccl_comm(const std::string& unique_id, int num_ranks, int rank) {
  CK_CHECK_ARG(unique_id.size() == sizeof(ncclUniqueId::internal), "unique_id must be ",
               sizeof(ncclUniqueId::internal), " bytes (from get_local_nccl_unique_id), got ", unique_id.size());
  CK_CHECK_ARG(num_ranks > 0 && rank >= 0 && rank < num_ranks, "need 0 <= rank < num_ranks, got rank ", rank,
               " of ", num_ranks);
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclComm_t comm = nullptr;
  CK_NCCL_CHECK(ncclCommInitRank(&comm, num_ranks, id, rank));
  return reinterpret_cast<int64_t>(comm);
}

void destroy_nccl_comm(int64_t comm) {
  CK_CHECK_ARG(comm != 0, "destroy_nccl_comm: null communicator");
  // Abort rather than destroy: it never blocks on peers that are gone.
  CK_NCCL_CHECK(ncclCommAbort(reinterpret_cast<ncclComm_t>(comm)));
}

std::tuple<int, int> nccl_comm_rank_size(int64_t comm) {
  CK_CHECK_ARG(comm != 0, "null NCCL communicator");
  int rank = -1, size = -1;
  CK_NCCL_CHECK(ncclCommUserRank(reinterpret_cast<ncclComm_t>(comm), &rank));
  CK_NCCL_CHECK(ncclCommCount(reinterpret_cast<ncclComm_t>(comm), &size));
  return {rank, size};
}

std::optional<std::tuple<int, int, int>> comm_gin_properties(int64_t comm) {
  CK_CHECK_ARG(comm != 0, "null NCCL communicator");
  int gin = -1, railed = -1, lsa_teams = -1;
  // Looked up per call (set-up only): the first caller's answer would do, but this keeps no global state.
  void* query = nccl_runtime_version() >= 22900 ? nccl_optional_symbol("ncclCommQueryProperties") : nullptr;
  const int res =
      elastic_ep::nccl_comm_gin_properties(reinterpret_cast<void*>(comm), query, &gin, &railed, &lsa_teams);
  if (res == -1) return std::nullopt;
  CK_CHECK(res == int(ncclSuccess), "ncclCommQueryProperties failed: ", ncclGetErrorString(ncclResult_t(res)));
  return std::make_tuple(gin, railed, lsa_teams);
}

}  // namespace elastic_ep
#endif  // COMMKIT_WITH_CUDA
