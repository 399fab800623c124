// commkit/impl/process__funcs.hpp -- inline definitions for commkit/process.hpp.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "commkit/atomics.hpp"
#include "commkit/check.hpp"
#include "commkit/deadline.hpp"

namespace commkit {

inline uint64_t process_start_time(uint64_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%llu/stat", static_cast<unsigned long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return 0;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // the command name may contain spaces and parens
  if (p == nullptr) return 0;
  char state = 0;
  uint64_t start = 0;
  int field = 2;
  for (const char* tok = p + 1; *tok != '\0' && field < 22;) {
    while (*tok == ' ') ++tok;
    ++field;
    if (field == 3) state = *tok;
    if (field == 22) {
      start = std::strtoull(tok, nullptr, 10);
      break;
    }
    while (*tok != '\0' && *tok != ' ') ++tok;
  }
  if (state == 'Z' || state == 'X' || state == 'x') return 0;
  return start == 0 ? 1 : start;
}

inline ProcessIdTuple as_tuple(const ProcessId& id) { return {id.boot, id.pid_ns, id.pid, id.start}; }

inline std::vector<ProcessId> process_ids(const std::vector<ProcessIdTuple>& tuples) {
  std::vector<ProcessId> out;
  out.reserve(tuples.size());
  for (const auto& [boot, ns, pid, start] : tuples) out.push_back({boot, ns, pid, start});
  return out;
}

inline bool process_alive(uint64_t pid, uint64_t start) {
  const uint64_t now = process_start_time(pid);
  if (now == 0) return false;                // no such process, or a zombie
  return start == 0 || now == start;         // another start time: the pid was reused
}

inline ProcessId this_process() {
  ProcessId id{};
  char boot[64] = {};
  FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r");
  CK_CHECK(f != nullptr, "cannot read /proc/sys/kernel/random/boot_id");
  const size_t n = std::fread(boot, 1, sizeof(boot) - 1, f);
  std::fclose(f);
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(boot[i])) * 1099511628211ull;
  id.boot = h;
  struct stat st {};
  CK_CHECK(::stat("/proc/self/ns/pid", &st) == 0, "cannot stat /proc/self/ns/pid");
  id.pid_ns = static_cast<uint64_t>(st.st_ino);
  id.pid = static_cast<uint64_t>(::getpid());
  id.start = process_start_time(id.pid);
  return id;
}

inline Heartbeat::Heartbeat(uint64_t* word, int period_ms) : word_(word), period_ms_(period_ms > 0 ? period_ms : 1) {
  st_release(word_, monotonic_ns());
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, std::chrono::milliseconds(period_ms_), [this] { return stop_; }))
      st_release(word_, monotonic_ns());
  });
}

inline Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

inline uint64_t heartbeat_age_ns(const uint64_t* word) {
  const uint64_t beat = ld_acquire(word), now = monotonic_ns();
  return now > beat ? now - beat : 0;
}

inline PeerWatch::PeerWatch(TimeoutRecord* rec, uint32_t op, int rank, std::vector<ProcessId> peers, int period_ms)
    : rec_(rec), op_(op), rank_(rank), period_ms_(period_ms > 0 ? period_ms : 1) {
  const ProcessId me = this_process();
  for (int r = 0; r < int(peers.size()); ++r)
    if (r != rank && peers[r].boot == me.boot && peers[r].pid_ns == me.pid_ns && peers[r].pid != 0)
      watched_.emplace_back(r, peers[r]);
  if (!watched_.empty()) thread_ = std::thread([this] { run(); });
}

inline PeerWatch::~PeerWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

inline void PeerWatch::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, std::chrono::milliseconds(period_ms_), [this] { return stop_; })) {
    for (const auto& [r, id] : watched_) {
      if (process_alive(id.pid, id.start)) continue;
      dead_.store(r, std::memory_order_release);
      claim_timeout_record(rec_, op_, rank_, r, static_cast<int64_t>(id.pid));
      return;  // one report; the runtime is unusable from here on
    }
  }
}

}  // namespace commkit
