// commkit/ipc.hpp -- one device allocation per rank, shared with the other ranks by CUDA IPC handle.
//
// Contract (host only; include cuda_runtime.h first, like CK_CUDA_CHECK):
//   ipc_handle_of(base) -> std::string
//       the cudaIpcMemHandle_t of a cudaMalloc'ed base pointer as raw bytes (what a rank publishes
//       to its peers over any process group). commkit::Error on failure.
//   check_ipc_handles(handles, rank, own, what)
//       commkit::ValueError unless there is exactly one handle per rank in rank order: every entry
//       has the size of a handle and handles[rank] == own. `what` starts every message.
//       (commkit/ipc_handle.hpp: handles that also carry what the peers must agree on.)
//   open_ipc_handles(handles, rank, what, min_bytes = 0) -> std::vector<void*>
//       opens every peer's handle (cudaIpcMemLazyEnablePeerAccess); entry `rank` stays nullptr.
//       With min_bytes > 0, each mapping must reach min_bytes (the size the peer's description
//       claims) as far as the driver can tell. If one fails, the ones already opened are closed again
//       and commkit::Error names this rank and the peer whose handle failed: all or nothing.
//   allocation_bytes_from(ptr) -> int64_t
//       the bytes from ptr to the end of its device allocation (the driver's cuMemGetAddressRange,
//       through the runtime: no libcuda link), -1 when the driver cannot say.
//   close_ipc_handles(ptrs) -> cudaError_t
//       closes every non-null entry and sets it to nullptr; returns the first error (cudaSuccess).
// The allocation behind a handle must stay alive on its owner until every peer closed it; making
// teardown collective (a barrier first) is the caller's job.
#pragma once

#include "commkit/ipc_handle.hpp"
#include "commkit/impl/ipc__funcs.hpp"
