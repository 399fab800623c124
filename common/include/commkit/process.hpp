// commkit/process.hpp -- whether a peer's process on this host is alive, and a watch that ends this
// rank's waits as soon as one dies instead of at their deadlines.
//
// Contract:
//   process_start_time(pid)     /proc/<pid>/stat start time (field 22, clock ticks after boot); 0 when
//                               no such process runs or it is a zombie. With the pid it names one
//                               process: a reused pid has another start time.
//   process_alive(pid, start)   the process with this pid and start time (start 0: any) still runs.
//   ProcessId, this_process()   {kernel boot id, PID-namespace inode, pid, start time} of this
//                               process: what a peer needs to watch it. A pid means something only
//                               to a process of the same kernel and PID namespace; the two ids say
//                               which peers those are (ranks in other containers or hosts are left to
//                               the deadlines). as_tuple / process_ids: the same as 4-tuples of
//                               uint64, the form the bindings exchange.
//   PeerWatch(rec, op, rank, peers, period_ms)
//                               a host thread that every period checks the peers that share this
//                               process's kernel and PID namespace. The first one found gone claims
//                               `rec` -- the TimeoutRecord in host-mapped memory that every device
//                               wait and host poll of this rank reads (device_deadline.cuh) -- with
//                               op, this rank, peer = the dead rank, expected = its pid, so those
//                               waits leave at once and the host raises naming the dead rank (the
//                               claim: claim_timeout_record, commkit/timeout_record.hpp). dead_peer()
//                               is that rank, or -1. The destructor stops and joins the thread.
//   Heartbeat(word, period_ms)  a host thread that stores monotonic_ns() into `word` (shared memory)
//                               now and every period, until destroyed: how a peer that cannot see this
//                               process's pid (another PID namespace: one container per rank) tells it
//                               is alive. heartbeat_age_ns(word) is how long ago it last beat
//                               (CLOCK_MONOTONIC is one clock for every PID namespace of a kernel).
// Errors: none thrown by the watch; this_process() throws commkit::Error when /proc is unreadable.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include "commkit/timeout_record.hpp"

namespace commkit {

struct ProcessId {
  uint64_t boot;    // hash of /proc/sys/kernel/random/boot_id (one kernel instance)
  uint64_t pid_ns;  // inode of /proc/self/ns/pid
  uint64_t pid;
  uint64_t start;   // process_start_time(pid)
};

using ProcessIdTuple = std::tuple<uint64_t, uint64_t, uint64_t, uint64_t>;

uint64_t process_start_time(uint64_t pid);
ProcessIdTuple as_tuple(const ProcessId& id);
std::vector<ProcessId> process_ids(const std::vector<ProcessIdTuple>& tuples);
bool process_alive(uint64_t pid, uint64_t start);
ProcessId this_process();

class Heartbeat {
 public:
  Heartbeat(uint64_t* word, int period_ms);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  uint64_t* word_;
  int period_ms_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};
uint64_t heartbeat_age_ns(const uint64_t* word);

class PeerWatch {
 public:
  // peers[r]: rank r's ProcessId (this rank's own entry is skipped).
  PeerWatch(TimeoutRecord* rec, uint32_t op, int rank, std::vector<ProcessId> peers, int period_ms);
  ~PeerWatch();
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;
  int dead_peer() const { return dead_.load(std::memory_order_acquire); }
  int num_watched() const { return int(watched_.size()); }

 private:
  void run();
  TimeoutRecord* rec_;
  uint32_t op_;
  int rank_;
  int period_ms_;
  std::vector<std::pair<int, ProcessId>> watched_;  // (rank, id) of the peers on this kernel and namespace
  std::atomic<int> dead_{-1};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace commkit

#include "commkit/impl/process__funcs.hpp"
