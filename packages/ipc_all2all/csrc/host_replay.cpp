// host_replay.cpp -- see host_replay.hpp.
#include "host_replay.hpp"

#include <cstring>

#include "a2a_geometry.hpp"
#include "a2a_types.hpp"
#include "commkit/check.hpp"
#include "core.hpp"
#include "kernels.hpp"

namespace ipc_all2all {

namespace {
void check_row_bytes(int64_t chunk_bytes, int64_t wide_bytes) {
  CK_CHECK_ARG(chunk_bytes > 0 && chunk_bytes % 16 == 0 && wide_bytes % 16 == 0,
               "chunk and wide must be multiples of 16");
}
}  // namespace

std::vector<std::string> simulate(int op, int world, int batch, int64_t x_rows, int64_t out_rows, int64_t cap_rows,
                                  int64_t chunk_bytes, int64_t wide_bytes, const std::vector<int32_t>& counts,
                                  const std::vector<std::string>& inputs, int64_t slot_bytes, int only_sender) {
  CK_CHECK_ARG(world >= 1 && world <= kMaxWorld, "bad world");
  CK_CHECK_ARG(static_cast<int>(counts.size()) == world && static_cast<int>(inputs.size()) == world,
               "need one count and one input per rank");
  check_row_bytes(chunk_bytes, wide_bytes);
  std::vector<std::string> slots(world, std::string(static_cast<size_t>(slot_bytes), '\0'));
  for (int q = 0; q < world; ++q) {
    if (only_sender >= 0 && q != only_sender) continue;
    const KernelArgs a = geometry_args(op, world, q, batch, x_rows, out_rows, cap_rows, chunk_bytes, wide_bytes);
    int64_t n[kMaxWorld], prefix[kMaxWorld + 1];
    resolve_counts(a, counts.data(), n, prefix);
    const std::string& x = inputs[q];
    for (int p = 0; p < world; ++p) {
      const RowMap m = row_map(a, n, prefix, p);
      const uint32_t total = m.total_vecs(batch);
      for (uint32_t v = 0; v < total; ++v) {
        uint64_t so, dof;
        m.offsets(v, so, dof);
        CK_CHECK(so + 16 <= x.size(), "source offset ", so, " beyond input of ", x.size(), " bytes (rank ", q, " -> ",
                 p, ")");
        CK_CHECK(dof + 16 <= slots[p].size(), "destination offset ", dof, " beyond slot of ", slots[p].size(),
                 " bytes (rank ", q, " -> ", p, ")");
        std::memcpy(&slots[p][dof], x.data() + so, 16);
      }
    }
  }
  return slots;
}

uint64_t sender_slot_bytes(int op, int world, int rank, int batch, int64_t x_rows, int64_t out_rows, int64_t cap_rows,
                           int64_t chunk_bytes, int64_t wide_bytes, const std::vector<int32_t>& counts) {
  CK_CHECK_ARG(world >= 1 && world <= kMaxWorld && rank >= 0 && rank < world, "bad world/rank");
  CK_CHECK_ARG(static_cast<int>(counts.size()) == world, "need one count per rank");
  check_row_bytes(chunk_bytes, wide_bytes);
  const KernelArgs a = geometry_args(op, world, rank, batch, x_rows, out_rows, cap_rows, chunk_bytes, wide_bytes);
  return slot_bytes_needed(a, counts.data());
}

uint64_t call_ready_word(int op, int world, int batch, int64_t out_rows, int64_t cap_rows, int64_t chunk_bytes,
                         int64_t wide_bytes, int pack_head_dim, int slot, const std::vector<int64_t>& counts,
                         uint64_t call) {
  CK_CHECK_ARG(world >= 1 && world <= kMaxWorld && static_cast<int>(counts.size()) == world,
               "need world in [1, 8] and one count per rank");
  KernelArgs a = geometry_args(op, world, 0, batch, 0, out_rows, cap_rows, chunk_bytes, wide_bytes);
  a.pack_head_dim = pack_head_dim;
  return ready_word(call, call_signature(geometry_signature(a, slot), counts.data(), world));
}

uint64_t checked_broken_word(uint64_t call, int rank) {
  CK_CHECK_ARG(rank >= 0 && rank < kMaxWorld, "rank must be in [0, ", kMaxWorld, "), got ", rank);
  return broken_word(call, rank);
}

std::string record_message(uint32_t op, int rank, int peer, int64_t expected, int64_t observed) {
  commkit::TimeoutRecord r{};
  r.op = op;
  r.rank = rank;
  r.peer = peer;
  r.expected = expected;
  r.observed = observed;
  return failure_message(r);
}

}  // namespace ipc_all2all
