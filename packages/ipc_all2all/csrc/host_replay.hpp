// host_replay.hpp -- the kernel's addressing, bounds and handshake words computed on the host with the
// kernel's own code (a2a_geometry.hpp, a2a_types.hpp), bound for the CPU tests and the protocol model.
// Host only and CUDA-free. Bad arguments raise commkit::ValueError.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "commkit/timeout_record.hpp"

namespace ipc_all2all {

// Runs the kernel's addressing for every (sender, target) pair (or only sender `only_sender` >= 0):
// the same row_map and offsets code as the GPU, bytes copied with memcpy. Every offset is
// bounds-checked, so a layout bug raises commkit::Error instead of corrupting memory.
// inputs: [world] each rank's x as bytes; returns [world] each target's slot of slot_bytes bytes.
std::vector<std::string> simulate(int op, int world, int batch, int64_t x_rows, int64_t out_rows, int64_t cap_rows,
                                  int64_t chunk_bytes, int64_t wide_bytes, const std::vector<int32_t>& counts,
                                  const std::vector<std::string>& inputs, int64_t slot_bytes, int only_sender);

// The bound Core::launch enforces before every launch: the most bytes sender `rank` writes into any
// target's slot (with device counts Core.launch passes cap_rows for every rank, the worst case).
uint64_t sender_slot_bytes(int op, int world, int rank, int batch, int64_t x_rows, int64_t out_rows, int64_t cap_rows,
                           int64_t chunk_bytes, int64_t wide_bytes, const std::vector<int32_t>& counts);

// The entry-handshake word of call `call` as the kernel builds it (ready_word of the call's signature).
uint64_t call_ready_word(int op, int world, int batch, int64_t out_rows, int64_t cap_rows, int64_t chunk_bytes,
                         int64_t wide_bytes, int pack_head_dim, int slot, const std::vector<int64_t>& counts,
                         uint64_t call);

// broken_word with the rank checked against kMaxWorld.
uint64_t checked_broken_word(uint64_t call, int rank);

// failure_message of a record with these fields.
std::string record_message(uint32_t op, int rank, int peer, int64_t expected, int64_t observed);

}  // namespace ipc_all2all
