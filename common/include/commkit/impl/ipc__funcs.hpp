// commkit/impl/ipc__funcs.hpp -- the functions of commkit/ipc.hpp (see there for the contract).
#pragma once

#include <cstring>
#include <string>
#include <vector>

#include "commkit/check.hpp"

namespace commkit {

inline std::string ipc_handle_of(void* base) {
  cudaIpcMemHandle_t h;
  CK_CUDA_CHECK(cudaIpcGetMemHandle(&h, base));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "commkit/ipc_handle.hpp assumes 64-byte handles");

inline void check_ipc_handles(const std::vector<std::string>& handles, int rank, const std::string& own,
                              const char* what) {
  check_ipc_handle_list(handles, rank, own, what, sizeof(cudaIpcMemHandle_t));
}

inline cudaError_t close_ipc_handles(std::vector<void*>& ptrs) {
  cudaError_t first = cudaSuccess;
  for (void*& p : ptrs)
    if (p != nullptr) {
      const cudaError_t e = cudaIpcCloseMemHandle(p);
      if (first == cudaSuccess) first = e;
      p = nullptr;
    }
  return first;
}

// The bytes from `ptr` to the end of the device allocation it lies in (cuMemGetAddressRange, reached
// through the runtime so that nothing links libcuda), or -1 when the driver cannot say.
inline int64_t allocation_bytes_from(const void* ptr) {
  using Fn = int (*)(unsigned long long* base, size_t* size, unsigned long long dptr);  // CUresult, CUdeviceptr
  static const Fn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuMemGetAddressRange", &f, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return Fn(nullptr);
    }
    return reinterpret_cast<Fn>(f);
  }();
  unsigned long long base = 0;
  size_t size = 0;
  const auto at = reinterpret_cast<unsigned long long>(ptr);
  if (fn == nullptr || fn(&base, &size, at) != 0 || at < base || at - base > size) return -1;
  return static_cast<int64_t>(base + size - at);
}

inline std::vector<void*> open_ipc_handles(const std::vector<std::string>& handles, int rank, const char* what,
                                           int64_t min_bytes = 0) {
  // The handles come from peers: a short entry would be copied past its end into the handle.
  for (size_t p = 0; p < handles.size(); ++p)
    CK_CHECK_ARG(handles[p].size() == sizeof(cudaIpcMemHandle_t), what, ": handle of rank ", p, " has ",
                 handles[p].size(), " bytes, expected ", sizeof(cudaIpcMemHandle_t));
  std::vector<void*> ptrs(handles.size(), nullptr);
  for (size_t p = 0; p < handles.size(); ++p) {
    if (static_cast<int>(p) == rank) continue;
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[p].data(), sizeof(h));
    const cudaError_t err = cudaIpcOpenMemHandle(&ptrs[p], h, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      ptrs[p] = nullptr;
      close_ipc_handles(ptrs);
      (void)cudaGetLastError();
      CK_CHECK_RANK(false, rank, static_cast<int>(p), what, ": cudaIpcOpenMemHandle of rank ", p,
                    "'s buffer failed: ", cudaGetErrorString(err),
                    " (the GPUs must be peer-capable over NVLink or PCIe and visible to this process, or shared)");
    }
    // The description a peer sent says how large its buffer is; the mapping says how large it really
    // is. A forged or corrupted handle of a smaller allocation would let this rank write past it.
    const int64_t real = min_bytes > 0 ? allocation_bytes_from(ptrs[p]) : -1;
    if (real >= 0 && real < min_bytes) {
      close_ipc_handles(ptrs);
      (void)cudaGetLastError();
      CK_CHECK_RANK(false, rank, static_cast<int>(p), what, ": the buffer behind rank ", p, "'s handle has ", real,
                    " bytes, its description says ", min_bytes, " (a handle of another allocation); nothing opened");
    }
  }
  return ptrs;
}

}  // namespace commkit
