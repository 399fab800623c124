// a2a_handle.hpp -- the bytes get_local_ipc_handle() returns and sync() checks (host only: no CUDA,
// no torch, so the CPU test suite exercises the checks through ipc_all2all._C).
//
// A peer pushes into my slots at the offsets of *its own* layout, so every rank must have been built
// with the same slot capacity (num_tokens * hidden_dim * element size) and world size, or one rank
// writes past another's allocation. The CUDA IPC handle alone carries none of that, so the handle a
// rank publishes is
//
//   [ magic "ipca2a" + format version (8) | world (4) | rank (4) | slot capacity (8) | buffer bytes (8)
//     | cudaIpcMemHandle_t (64) ]                                                     (little endian)
//
// and sync() parses and compares every entry before it opens any peer's memory. Callers treat the
// handle as opaque bytes (from_group and the low-level exchange pass it through unchanged).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "commkit/check.hpp"

namespace ipc_all2all {

constexpr char kHandleMagic[8] = {'i', 'p', 'c', 'a', '2', 'a', '\0', '\x01'};  // last byte: format version
constexpr size_t kHandleHeaderBytes = 32;
constexpr size_t kCudaIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t); core.cpp asserts it
constexpr size_t kHandleBytes = kHandleHeaderBytes + kCudaIpcHandleBytes;

// What must match between ranks, as one rank describes its own instance.
struct HandleInfo {
  int32_t world = 0;
  int32_t rank = 0;
  uint64_t capacity = 0;      // bytes of one output slot
  uint64_t buffer_bytes = 0;  // bytes of the whole allocation (signals + both slots)
};

inline std::string encode_handle(const HandleInfo& info, const std::string& cuda_handle) {
  CK_CHECK_ARG(cuda_handle.size() == kCudaIpcHandleBytes, "a CUDA IPC handle has ", kCudaIpcHandleBytes,
               " bytes, got ", cuda_handle.size());
  std::string out(kHandleBytes, '\0');
  char* p = &out[0];
  std::memcpy(p, kHandleMagic, 8);
  std::memcpy(p + 8, &info.world, 4);
  std::memcpy(p + 12, &info.rank, 4);
  std::memcpy(p + 16, &info.capacity, 8);
  std::memcpy(p + 24, &info.buffer_bytes, 8);
  std::memcpy(p + kHandleHeaderBytes, cuda_handle.data(), kCudaIpcHandleBytes);
  return out;
}

// Parses entry `index` of sync()'s list; ValueError (naming the entry) unless it is a handle of
// this format.
inline HandleInfo parse_handle(const std::string& h, size_t index, const char* what) {
  CK_CHECK_ARG(h.size() == kHandleBytes && std::memcmp(h.data(), kHandleMagic, 8) == 0, what, ": entry ", index,
               " (", h.size(), " bytes) is not a handle from get_local_ipc_handle() of this ipc_all2all version (",
               kHandleBytes, " bytes); every rank must run the same version and pass the bytes unchanged");
  HandleInfo info;
  std::memcpy(&info.world, h.data() + 8, 4);
  std::memcpy(&info.rank, h.data() + 12, 4);
  std::memcpy(&info.capacity, h.data() + 16, 8);
  std::memcpy(&info.buffer_bytes, h.data() + 24, 8);
  return info;
}

// Checks every rank's handle against this rank's instance `self` and its own handle `own`, before
// any peer memory is touched, and returns the raw CUDA IPC handles in rank order. ValueError naming
// the rank whose instance differs, and how.
inline std::vector<std::string> check_handles(const std::vector<std::string>& handles, const HandleInfo& self,
                                              const std::string& own, const char* what) {
  CK_CHECK_ARG(handles.size() == static_cast<size_t>(self.world), what, ": expected ", self.world,
               " handles (one per rank, in rank order), got ", handles.size());
  std::vector<std::string> raw(handles.size());
  for (size_t p = 0; p < handles.size(); ++p) {
    const HandleInfo info = parse_handle(handles[p], p, what);
    CK_CHECK_ARG(info.rank == static_cast<int32_t>(p), what, ": entry ", p, " holds the handle of rank ", info.rank,
                 "; pass every rank's handle, ordered by rank");
    CK_CHECK_ARG(info.world == self.world, what, ": rank ", p, " was built with world_size ", info.world,
                 ", this rank (", self.rank, ") with ", self.world);
    CK_CHECK_ARG(info.capacity == self.capacity, what, ": rank ", p, " was built with output slots of ",
                 info.capacity, " bytes, this rank (", self.rank, ") with ", self.capacity,
                 " (num_tokens * hidden_dim * element size); every rank must build the instance alike, or a "
                 "rank would write past a smaller peer buffer");
    CK_CHECK_ARG(info.buffer_bytes == self.buffer_bytes, what, ": rank ", p, " has a buffer of ", info.buffer_bytes,
                 " bytes, this rank (", self.rank, ") ", self.buffer_bytes, " for the same slot size; every rank "
                 "must run the same ipc_all2all build");
    raw[p] = handles[p].substr(kHandleHeaderBytes);
  }
  CK_CHECK_ARG(handles[static_cast<size_t>(self.rank)] == own, what, ": entry ", self.rank,
               " is not this rank's own handle; the handles must be ordered by rank");
  return raw;
}

}  // namespace ipc_all2all
