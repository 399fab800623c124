// commkit/ipc_handle.hpp -- a CUDA IPC handle that says what the peers must agree on (host only: no
// CUDA headers, so packages built without CUDA and their CPU tests use it too).
//
// A peer computes addresses inside my allocation from *its own* layout, so every rank must have been
// built alike or one rank writes past another's allocation. A bare cudaIpcMemHandle_t carries none
// of that, so a rank publishes
//   [ format tag (8) | world (4) | rank (4) | layout bytes (8) | allocation bytes (8) | cudaIpcMemHandle_t (64) ]
// (little endian), and every rank checks every entry before it opens any peer's memory.
//
// Contract:
//   IpcWindowInfo {world, rank, layout_bytes, alloc_bytes}: one rank's description of its window;
//     layout_bytes is the size its offsets are computed from (a package's slot or buffer size),
//     alloc_bytes the whole allocation.
//   IpcHandleFormat {tag[8], owner, layout_name, layout_hint}: per package: the tag (a handle of
//     another package or version is refused) and the words its messages use.
//   describe_ipc_handle(fmt, info, raw) -> bytes   raw: the 64 bytes of a cudaIpcMemHandle_t.
//   check_described_ipc_handles(fmt, handles, self, own, what) -> raw handles in rank order
//     commkit::ValueError (starting with `what`, naming the rank) unless there is one handle per rank
//     in rank order, each of this format, with this rank's world size, layout and allocation size,
//     and handles[self.rank] == own.
//   check_ipc_handle_list(handles, rank, own, what, handle_bytes)
//     the list checks alone: one entry per rank, each handle_bytes long, handles[rank] == own.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "commkit/check.hpp"

namespace commkit {

constexpr size_t kIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t); commkit/ipc.hpp asserts it
constexpr size_t kDescribedIpcHeaderBytes = 32;
constexpr size_t kDescribedIpcHandleBytes = kDescribedIpcHeaderBytes + kIpcHandleBytes;

struct IpcWindowInfo {
  int32_t world = 0;
  int32_t rank = 0;
  uint64_t layout_bytes = 0;
  uint64_t alloc_bytes = 0;
};

struct IpcHandleFormat {
  char tag[8];              // last byte: the format version
  const char* owner;        // "ipc_all2all"
  const char* layout_name;  // "output slots of"
  const char* layout_hint;  // appended to a layout mismatch: how the size comes about
};

#include "commkit/impl/ipc_handle__funcs.hpp"

}  // namespace commkit
