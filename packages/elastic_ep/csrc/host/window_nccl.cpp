// elastic_ep/csrc/host/window_nccl.cpp -- the NCCL symmetric window (see window.hpp). Empty unless the CUDA
// build is on.
#if COMMKIT_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include "commkit/check.hpp"
#include "host/comm.hpp"
#include "host/trace.hpp"
#include "host/window.hpp"

namespace elastic_ep {

NcclWindow::NcclWindow(const WindowShape& shape, void* comm, const GinRequest* gin, int scaleup, bool debug)
    : Window(shape, debug), comm_(comm) {
  // One symmetric allocation. Every rank passes the same size (collective).
  trace(debug_, "rank %d/%d: device %d, ncclMemAlloc %llu bytes\n", shape.rank, shape.num_ranks, shape.device,
        (unsigned long long)shape.bytes());
  CK_NCCL_CHECK(ncclMemAlloc(&mem_, shape.bytes()));
  try {
    connect(gin, scaleup);
  } catch (...) {
    commkit::TeardownLog secondary;  // the set-up's own error is the one raised
    release(Teardown::kLocal, secondary);
    (void)cudaGetLastError();
    throw;
  }
}

void NcclWindow::connect(const GinRequest* gin, int scaleup) {
  const int rank = shape_.rank, num_ranks = shape_.num_ranks;
  auto comm = static_cast<ncclComm_t>(comm_);
  trace(debug_, "rank %d: ncclCommWindowRegister %p\n", rank, mem_);
  ncclWindow_t win = nullptr;
  CK_NCCL_CHECK(ncclCommWindowRegister(comm, mem_, shape_.bytes(), &win, NCCL_WIN_COLL_SYMMETRIC));
  window_ = win;

  // Device communicator: LSA only (no GIN requested, so it works on machines without a NIC), or with
  // the GIN contexts of hybrid mode across NVLink domains.
  const bool use_gin = gin != nullptr;
  const int runtime = nccl_runtime_version();
  trace(debug_, "rank %d: ncclDevCommCreate (NCCL headers %d, library %d, GIN %d)\n", rank, NCCL_VERSION_CODE,
        runtime, int(use_gin));
  if (devcomm_abi(runtime, use_gin) == DevcommAbi::kUnsupported) {
    failed_everywhere_ = true;  // every rank loads the same NCCL
    CK_THROW("elastic_ep was built against NCCL ", NCCL_VERSION_CODE, " headers and the loaded libnccl is ", runtime,
             use_gin ? ": hybrid mode over GIN needs a libnccl of the same device-API generation as the headers "
                       "(both >= 2.29 or both 2.28.x); load NCCL >= 2.29 or rebuild against the loaded NCCL's headers"
                     : ": the NCCL 2.29+ library reads device-API structures with a version header that 2.28.x "
                       "headers do not write; rebuild elastic_ep against NCCL >= 2.29 headers (NCCL_HOME or the "
                       "nvidia-nccl wheel) or load NCCL 2.28.x");
  }
  int lsa_rank = -1;
  const int res = devcomm_create(comm_, gin, runtime, &devcomm_, &lsa_rank, &lsa_size_);
  if (res != int(ncclSuccess)) {
    failed_everywhere_ = true;  // every rank of the same job gets the same answer
    CK_THROW("ncclDevCommCreate failed: ", ncclGetErrorString(ncclResult_t(res)),
             use_gin ? " (hybrid mode asked for GIN contexts: it needs a GIN-capable network, InfiniBand/RoCE with "
                       "GPUDirect RDMA, on every node)"
                     : " (direct mode needs every rank in one NVLink/LSA domain with CUDA P2P)");
  }
  trace(debug_, "rank %d: devcomm lsaRank %d lsaSize %d\n", rank, lsa_rank, lsa_size_);
  // Over GIN, NCCL's LSA team is this rank's node = its scale-up domain of U ranks (ranks numbered
  // node by node); otherwise every rank shares one.
  const int team = use_gin ? scaleup : num_ranks, first = use_gin ? rank - rank % scaleup : 0;
  failed_everywhere_ = lsa_size_ != team || lsa_rank != rank - first;  // the same on every rank
  CK_CHECK(lsa_size_ == team && lsa_rank == rank - first,
           use_gin ? "hybrid mode over GIN needs NCCL's LSA team (the ranks sharing NVLink) to be this rank's "
                     "scale-up domain of "
                   : "direct mode needs all ",
           team, " ranks, node by node, but NCCL reports an LSA team of ", lsa_size_, " with this rank at ", lsa_rank,
           use_gin ? "" : " (several NVLink domains run in hybrid mode: allow_hybrid_mode=True)");

  void* dev = nullptr;
  CK_CUDA_CHECK(cudaMalloc(&dev, sizeof(void*) * num_ranks));
  peer_bases_.reset(dev);
  CK_CUDA_CHECK(cudaMemset(dev, 0, sizeof(void*) * num_ranks));  // other NVLink domains: none
  launch_resolve_peers(window_, first, lsa_size_, peer_bases(), nullptr);
  CK_CUDA_CHECK(cudaGetLastError());
  CK_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<void*> bases(num_ranks);
  CK_CUDA_CHECK(cudaMemcpy(bases.data(), dev, sizeof(void*) * num_ranks, cudaMemcpyDeviceToHost));
  for (int p = 0; p < num_ranks; ++p) trace(debug_, "rank %d: peer %d window at %p\n", rank, p, bases[p]);
  // NCCL maps every rank's window, this one included, into one flat LSA range; the kernels address
  // their own window through that mapping too (base_), the ncclMemAlloc pointer aliases it.
  base_ = bases[rank];
  CK_CHECK(base_ != nullptr, "ncclGetLsaPointer returned null for this rank");
  for (void* b : bases) host_peer_bases_.push_back(static_cast<char*>(b));
}

void NcclWindow::release(Teardown how, commkit::TeardownLog& log) noexcept {
  release_peer_bases(how, log);
  // Registration is collective: undone together (kCollective), or alone only where no rank got past
  // it or every rank failed on the same check, so every rank is here too (kLocal).
  const bool free_all = how == Teardown::kCollective || (how == Teardown::kLocal && (window_ == nullptr ||
                                                                                      failed_everywhere_));
  if (free_all) {
    auto comm = static_cast<ncclComm_t>(comm_);
    if (devcomm_ != nullptr) devcomm_destroy(comm_, devcomm_);
    if (window_ != nullptr) {
      const ncclResult_t r = ncclCommWindowDeregister(comm, static_cast<ncclWindow_t>(window_));
      log.step("ncclCommWindowDeregister", r == ncclSuccess, ncclGetErrorString(r));
    }
    if (mem_ != nullptr) {
      const ncclResult_t r = ncclMemFree(mem_);
      log.step("ncclMemFree", r == ncclSuccess, ncclGetErrorString(r));
    }
  }
  devcomm_ = window_ = mem_ = nullptr;
}

}  // namespace elastic_ep
#endif  // COMMKIT_WITH_CUDA
