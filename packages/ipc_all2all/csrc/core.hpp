// core.hpp -- the host side of one ipc_all2all instance: allocation, IPC handle exchange, launches,
// timeouts. Torch-free: tensors arrive as raw pointers and sizes from the Python layer, which does the
// shape logic and validation (and this class re-checks everything a wrong value could corrupt).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "a2a_types.hpp"
#include "failure_record.hpp"
#include "commkit/ipc_handle.hpp"
#include "commkit/process.hpp"
#include "commkit/timeout_record.hpp"

namespace ipc_all2all {

// The handle get_local_ipc_handle() returns and sync() checks (commkit/ipc_handle.hpp), with one
// output slot's capacity as the layout size: peers push at offsets of their own layout.
inline const commkit::IpcHandleFormat& handle_format() {
  static const commkit::IpcHandleFormat f{
      {'i', 'p', 'c', 'a', '2', 'a', '\0', '\x01'}, "ipc_all2all", "output slots of",
      " (num_tokens * hidden_dim * element size); every rank must build the instance alike, or a rank would "
      "write past a smaller peer buffer"};
  return f;
}

// destroy()'s deadline for each of its waits unless told otherwise (also when the operations wait
// forever, timeout_seconds = 0).
constexpr double kDestroyTimeoutSeconds = 30.0;

class Core {
 public:
  // capacity: bytes of one output slot; num_blocks: CUDA blocks per launch (e.g. the SM count).
  Core(int rank, int world, int64_t capacity, int num_blocks, double timeout_seconds);
  ~Core();
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  // Opaque bytes for the peers' open_peers: the CUDA IPC handle plus what must match between ranks
  // (world size, rank, slot capacity; see handle_format), which open_peers checks before it opens
  // any peer's memory.
  std::string ipc_handle() const;
  // What this rank's handle says about its window (what every peer's must match).
  commkit::IpcWindowInfo window_info() const {
    return {world_, rank_, static_cast<uint64_t>(capacity_), layout_.total};
  }
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
  // CUDA-graph bookkeeping (see launch): calls enqueued while their stream was capturing, and the
  // capture sequence (cudaStreamGetCaptureInfo id, 0 = an eager call) that last wrote each slot.
  uint64_t captured_calls() const { return captured_calls_; }
  uint64_t slot_capture(int slot) const;
  // The id of the capture sequence `stream` is recording into, or 0 when it is not capturing.
  uint64_t capture_id(uint64_t stream) const;

  // Enqueues one operation on `stream` and returns the slot its output lands in. Calls of one
  // instance run one after the other even across streams: an eager call on another stream than the
  // previous eager call first waits (cudaStreamWaitEvent) for an event recorded after that call, as
  // two kernels of one instance running at once would share its block counters. Captured calls
  // skip this (nothing runs at capture time; replays are ordered by the stream they are replayed
  // on). pack_head_dim D > 0:
  // x holds bf16 head vectors of D elements that the push packs into fp8 records of D + 16 bytes
  // (kernels.cu); chunk_bytes and wide_bytes are then in record bytes.
  int launch(int op, uint64_t x_ptr, uint64_t stream, int batch, int64_t x_rows, int64_t out_rows,
             int64_t cap_rows, int64_t chunk_bytes, int64_t wide_bytes, const std::vector<int64_t>& counts,
             uint64_t counts_ptr, int pack_head_dim = 0);

  // fp8 on the wire, receiving side (see kernels.cu): records [groups, head_dim + 16] -> bf16
  // [groups, head_dim] on `stream`, on this instance's device. Pointers 16-byte aligned, head_dim in
  // {16, ..., 256}.
  void fp8_unpack(uint64_t in_ptr, uint64_t out_ptr, int64_t groups, int head_dim, uint64_t stream);

  // Raises what a kernel recorded (non-blocking): commkit::TimeoutError for a deadline, commkit::Error
  // for a call the peer ran differently or a call abandoned because the instance had failed. Any
  // record leaves the instance broken: later calls are refused (destroy and recreate).
  void check();
  // Watches the peers' processes on this host (commkit::PeerWatch, every period_ms; 0: off):
  // peers[r] = rank r's commkit::this_process(), exchanged by the caller. A dead one ends this rank's
  // waits at once through the record; check() then raises commkit::Error naming it.
  void watch_peers(const std::vector<commkit::ProcessId>& peers, int period_ms);
  // The rank whose process the watch found dead, or -1.
  int dead_peer() const { return watch_ ? watch_->dead_peer() : -1; }
  void synchronize(uint64_t stream);  // waits for `stream` and the instance's last call, then check()
  void set_timeout_seconds(double s);
  double timeout_seconds() const { return timeout_ns_ * 1e-9; }
  void set_grid(int num_blocks, int self_blocks);
  std::array<int, 3> grid() const;
  bool broken() const { return broken_; }
  // Ends the instance (teardown.cpp). Every wait has a deadline of timeout_seconds (> 0, whatever
  // the operations' timeout; the default kDestroyTimeoutSeconds): (1) the device finishing this
  // instance's kernels; past the deadline their waits are ended through the failure record and the
  // device gets the deadline once more; (2) with `collective`, every peer announcing that its device
  // finished too (a word each rank's host writes into every peer's signal block; no process group),
  // ended early for peers the peer watch finds dead. Then the peers' mappings close and everything
  // is freed; with free_buffer=false the own allocation stays until release_buffer() (zero-copy
  // views of it may still be alive: the Python layer frees it when the last one goes).
  // Raises commkit::Error, after releasing all it safely can, naming what failed: peers that never
  // arrived (this rank's buffer is then kept until the process exits, as such a peer may still
  // write into it), a device that never finished (nothing is freed: freeing would wait for it), each
  // CUDA release that failed. Idempotent.
  void destroy(bool free_buffer = true, double timeout_seconds = kDestroyTimeoutSeconds, bool collective = false);
  void release_buffer();
  bool destroyed() const { return destroyed_; }
  // Stream-order bookkeeping of launch/fp8_unpack; `capturing` is the stream's capture state.
  // record_last_call is also called by the Python layer after its own copy of a slot (copy_output).
  void record_last_call(void* stream, bool capturing);

 private:
  void require_usable(const char* what) const;
  void order_after_last_call(void* stream, bool capturing);
  // destroy()'s steps (teardown.cpp).
  bool wait_for_device(uint64_t timeout_ns, std::string* failure);
  std::vector<int> wait_for_peers(uint64_t timeout_ns, std::string* failure);
  bool peer_known_dead(int peer) const;

  // The pinned host allocation: the failure record, then destroy()'s staging words.
  static constexpr size_t kHostBytes = sizeof(commkit::TimeoutRecord) + sizeof(uint64_t) * (kMaxWorld + 1);

  int rank_, world_, device_ = -1;
  int64_t capacity_;
  int num_blocks_, self_blocks_hint_ = 0;
  uint64_t timeout_ns_ = 0;
  BufferLayout layout_{};
  std::array<char*, kMaxWorld> base_{};
  std::string handle_;
  commkit::TimeoutRecord* rec_host_ = nullptr;
  commkit::TimeoutRecord* rec_dev_ = nullptr;
  std::unique_ptr<commkit::PeerWatch> watch_;  // writes *rec_host_: reset before it is freed
  std::vector<commkit::ProcessId> peers_;      // every rank's process, as watch_peers got them
  commkit::ProcessId self_{};                  // this process, as watch_peers found it
  bool death_reported_ = false;  // check() raised the watch's finding (later records are dropped)
  bool keep_buffer_ = false;  // destroy() kept the own allocation (a peer may still write into it)
  uint64_t calls_ = 0, captured_calls_ = 0;
  int last_op_ = -1;  // the last operation launched (named when a peer's process dies)
  std::array<uint64_t, kNumSlots> slot_capture_{};
  void* last_done_ = nullptr;    // cudaEvent_t recorded after the last eager call
  void* last_stream_ = nullptr;  // cudaStream_t of that call
  bool have_last_ = false;
  bool opened_ = false, broken_ = false, destroyed_ = false;
  std::string broken_reason_;
  // destroy() and synchronize() run without the GIL (they wait for the device), so another Python
  // thread may enter launch(), check() or record_last_call() meanwhile: those would use the peers'
  // mappings, the record and the event while destroy() frees them. Recursive: launch() calls check().
  mutable std::recursive_mutex mu_;
};

// The checks of Core::set_timeout_seconds and Core::set_grid (the constructor's too), host only and
// bound for the CPU tests. timeout_ns_from_seconds raises ValueError unless s is finite and in
// [0, 1e9) (0 = wait forever) and returns it in nanoseconds, at least 1 for any s > 0; check_grid_args
// raises ValueError unless num_blocks is in [world, 65535] and self_blocks in [0, num_blocks).
// check_capacity_bytes raises ValueError unless the slot capacity is positive and the whole buffer
// (signals and both slots, buffer_layout) stays addressable with int64 offsets.
uint64_t timeout_ns_from_seconds(double s);
void check_grid_args(int world, int num_blocks, int self_blocks);
void check_capacity_bytes(int64_t capacity);

}  // namespace ipc_all2all
