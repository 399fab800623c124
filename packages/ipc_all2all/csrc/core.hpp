// core.hpp -- the host side of one ipc_all2all instance: allocation, IPC handle exchange, launches,
// timeouts. Torch-free: tensors arrive as raw pointers and sizes from the Python layer, which does the
// shape logic and validation (and this class re-checks everything a wrong value could corrupt).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "a2a_types.hpp"

namespace ipc_all2all {

class Core {
 public:
  // capacity: bytes of one output slot; num_blocks: CUDA blocks per launch (e.g. the SM count).
  Core(int rank, int world, int64_t capacity, int num_blocks, double timeout_seconds);
  ~Core();
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  std::string ipc_handle() const;                    // 64 bytes
  void open_peers(const std::vector<std::string>& handles);
  bool opened() const { return opened_; }

  uint64_t buffer_ptr() const { return reinterpret_cast<uint64_t>(base_[rank_]); }
  uint64_t buffer_bytes() const { return layout_.total; }
  uint64_t slot_offset(int slot) const;
  int64_t capacity() const { return capacity_; }
  int device() const { return device_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int next_slot() const { return static_cast<int>(calls_ % kNumSlots); }
  uint64_t calls() const { return calls_; }

  // Enqueues one operation on `stream` and returns the slot its output lands in. pack_head_dim D > 0:
  // x holds bf16 head vectors of D elements that the push packs into fp8 records of D + 16 bytes
  // (kernels.cu); chunk_bytes and wide_bytes are then in record bytes.
  int launch(int op, uint64_t x_ptr, uint64_t stream, int batch, int64_t x_rows, int64_t out_rows,
             int64_t cap_rows, int64_t chunk_bytes, int64_t wide_bytes, const std::vector<int64_t>& counts,
             uint64_t counts_ptr, int pack_head_dim = 0);

  // fp8 on the wire, receiving side (see kernels.cu): records [groups, head_dim + 16] -> bf16
  // [groups, head_dim] on `stream`, on this instance's device. Pointers 16-byte aligned, head_dim in
  // {16, ..., 256}.
  void fp8_unpack(uint64_t in_ptr, uint64_t out_ptr, int64_t groups, int head_dim, uint64_t stream);

  void check();                       // raises a TimeoutError if a kernel recorded one (non-blocking)
  void synchronize(uint64_t stream);  // waits for `stream`, then check()
  void set_timeout_seconds(double s);
  double timeout_seconds() const { return timeout_ns_ * 1e-9; }
  void set_grid(int num_blocks, int self_blocks);
  std::array<int, 3> grid() const;
  bool broken() const { return broken_; }
  void destroy();
  bool destroyed() const { return destroyed_; }

 private:
  void require_usable(const char* what) const;

  int rank_, world_, device_ = -1;
  int64_t capacity_;
  int num_blocks_, self_blocks_hint_ = 0;
  uint64_t timeout_ns_ = 0;
  BufferLayout layout_{};
  std::array<char*, kMaxWorld> base_{};
  std::string handle_;
  commkit::TimeoutRecord* rec_host_ = nullptr;
  commkit::TimeoutRecord* rec_dev_ = nullptr;
  uint64_t calls_ = 0;
  bool opened_ = false, broken_ = false, destroyed_ = false;
  std::string broken_reason_;
};

const char* op_name(uint32_t op);

}  // namespace ipc_all2all
