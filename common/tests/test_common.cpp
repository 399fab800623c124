#include <string_view>
#include <cstdint>
// CPU test suite of the common/ header library (no GPU, no torch). Built by the superbuild as
// `commkit_common_tests` and by tests/common/test_common_headers.py with g++ directly.
// Exits 0 when every check passed, 1 otherwise; prints one line per test.
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "commkit/atomics.hpp"
#include "commkit/check.hpp"
#include "commkit/deadline.hpp"
#include "commkit/device_sync.hpp"
#include "commkit/ipc_handle.hpp"
#include "commkit/layout.hpp"
#include "commkit/process.hpp"
#include "commkit/shm.hpp"
#include "commkit/teardown.hpp"
#include "commkit/timeout_record.hpp"

namespace {

int g_failed = 0;
int g_passed = 0;

#define EXPECT(...)                                                         \
  do {                                                                      \
    if (!(__VA_ARGS__)) {                                                        \
      std::printf("    expectation failed: %s (%s:%d)\n", #__VA_ARGS__, __FILE__, __LINE__); \
      throw std::runtime_error("expectation failed");                       \
    }                                                                       \
  } while (0)

void run(const char* name, const std::function<void()>& fn) {
  try {
    fn();
    ++g_passed;
    std::printf("PASS %s\n", name);
  } catch (const std::exception& e) {
    ++g_failed;
    std::printf("FAIL %s: %s\n", name, e.what());
  }
}

template <typename E, typename F>
E expect_throw(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e;
  }
  throw std::runtime_error("expected exception was not thrown");
}

// ---- layout: checked at compile time and at run time ------------------------------------------
constexpr commkit::Region kA = commkit::Layout(0).add(10, 16);
static_assert(commkit::align_up(10, 16) == 16, "align_up");
static_assert(commkit::align_up(32, 16) == 32, "align_up exact");
static_assert(commkit::align_down(33, 16) == 32, "align_down");
static_assert(commkit::ceil_div(33, 16) == 3, "ceil_div");
static_assert(commkit::sat_mul(int64_t(3), int64_t(5)) == 15 && commkit::sat_mul(INT64_MAX, int64_t(2)) == INT64_MAX,
              "sat_mul is constexpr and saturates");
static_assert(commkit::is_pow2(64) && !commkit::is_pow2(48) && !commkit::is_pow2(0), "is_pow2");
static_assert(kA.offset == 0 && kA.bytes == 10 && kA.end() == 10, "first region");

constexpr uint64_t three_region_total() {
  commkit::Layout l;
  l.add(10, 16);
  l.add(100, 128);
  l.add(1, 4096);
  return l.total(2 << 20);
}
static_assert(three_region_total() == (2u << 20), "total rounds to the requested alignment");

// ---- CK_* macros, exceptions and str()
void check_tests() {
  run("check: CK_CHECK_ARG throws ValueError with file:line", [] {
    auto e = expect_throw<commkit::ValueError>([] { CK_CHECK_ARG(1 + 1 == 3, "bad value ", 42); });
    std::string what = e.what();
    EXPECT(what.find("bad value 42") != std::string::npos);
    EXPECT(what.find("test_common.cpp:") != std::string::npos);
    EXPECT(e.line() > 0);
  });
  run("check: CK_CHECK throws Error, not ValueError", [] {
    bool value_error = false;
    try {
      CK_CHECK(false, "runtime");
    } catch (const commkit::ValueError&) {
      value_error = true;
    } catch (const commkit::Error& e) {
      EXPECT(std::string(e.what()).find("runtime") != std::string::npos);
    }
    EXPECT(!value_error);
  });
  run("check: CK_CHECK_RANK carries rank and peer", [] {
    auto e = expect_throw<commkit::Error>([] { CK_CHECK_RANK(false, 3, 5, "peer lost"); });
    EXPECT(e.rank() == 3 && e.peer() == 5);
    EXPECT(std::string(e.what()).find("[rank 3, peer 5]") != std::string::npos);
  });
  run("check: CK_THROW_TIMEOUT carries op, expected, observed", [] {
    auto e = expect_throw<commkit::TimeoutError>([] { CK_THROW_TIMEOUT("dispatch notify", 1, 0, 7, 3); });
    EXPECT(e.operation() == "dispatch notify" && e.expected() == 7 && e.observed() == 3);
    EXPECT(e.rank() == 1 && e.peer() == 0);
    EXPECT(std::string(e.what()).find("dispatch notify timed out") != std::string::npos);
  });
  run("check: CK_SYS_CHECK reports errno", [] {
    auto e = expect_throw<commkit::Error>([] { CK_SYS_CHECK(::close(-1)); });
    EXPECT(std::string(e.what()).find("Bad file descriptor") != std::string::npos);
  });
  run("check: str() formats every supported type without iostreams", [] {
    enum class Code : int { kFive = 5 };
    const std::string s = std::string("s");
    const char* null_str = nullptr;
    const std::string got = commkit::str("a", 'b', s, std::string_view("v"), -3, uint64_t(18446744073709551615ull),
                                         int8_t(-7), true, 0.5, 2.5f, Code::kFive, commkit::hex(0xbeefu), null_str);
    EXPECT(got == "abs" "v" "-318446744073709551615-7true0.52.55beef(null)");
    const void* p = reinterpret_cast<const void*>(uintptr_t(0x1000));
    EXPECT(commkit::str(p) == "0x1000");
    EXPECT(commkit::str() == "");
  });
}

// ---- progress deadlines, poll_until / wait_until and Backoff
void deadline_tests() {
  run("deadline: expires without progress", [] {
    commkit::ProgressDeadline d(20);
    EXPECT(!d.expired(uint64_t(1)));
    usleep(40 * 1000);
    EXPECT(d.expired(uint64_t(1)));
  });
  run("deadline: progress resets the window", [] {
    commkit::ProgressDeadline d(30);
    for (uint64_t i = 0; i < 6; ++i) {  // 6 x 15 ms = 90 ms > 30 ms, but progress every 15 ms
      EXPECT(!d.expired(i));
      usleep(15 * 1000);
    }
    EXPECT(!d.expired(uint64_t(100)));
  });
  run("deadline: wait_until raises via on_timeout, returns on success", [] {
    commkit::ProgressDeadline d(10);
    bool timed_out = false;
    try {
      commkit::wait_until([] { return false; }, d, [] { return 0; },
                          [] { CK_THROW_TIMEOUT("test wait", 0, 1, 1, 0); });
    } catch (const commkit::TimeoutError&) {
      timed_out = true;
    }
    EXPECT(timed_out);
    std::atomic<int> flag{0};
    std::thread t([&] {
      usleep(5000);
      flag = 1;
    });
    commkit::ProgressDeadline d2(2000);
    commkit::wait_until([&] { return flag.load() == 1; }, d2, [] { return 0; },
                        [] { CK_THROW("unexpected timeout"); });
    t.join();
  });
  run("deadline: poll_until reports ready, aborted and expired, and progress keeps it waiting", [] {
    commkit::ProgressDeadline d(10);
    EXPECT(commkit::poll_until([] { return true; }, d, [] { return 0; }, [] { return true; }) ==
           commkit::PollResult::kReady);  // ready wins over aborted
    commkit::ProgressDeadline d1(1000);
    EXPECT(commkit::poll_until([] { return false; }, d1, [] { return 0; }, [] { return true; }) ==
           commkit::PollResult::kAborted);
    commkit::ProgressDeadline d2(10);
    const uint64_t t0 = commkit::monotonic_ns();
    EXPECT(commkit::poll_until([] { return false; }, d2, [] { return 0; }, [] { return false; }) ==
           commkit::PollResult::kExpired);
    EXPECT(commkit::monotonic_ns() - t0 >= 10ull * 1000000ull);
    // A counter that moves every poll never expires; the predicate ends the wait after 40 ms.
    commkit::ProgressDeadline d3(10);
    uint64_t moves = 0;
    const uint64_t t1 = commkit::monotonic_ns();
    EXPECT(commkit::poll_until([&] { return commkit::monotonic_ns() - t1 > 40ull * 1000000ull; }, d3,
                               [&] { return ++moves; }, [] { return false; }) == commkit::PollResult::kReady);
  });
  run("deadline: Backoff yields within its window and sleeps after it", [] {
    // Within the yield window a pause yields, past it it sleeps. Told apart by the thread's voluntary
    // context switches (a sleep blocks; a yield leaves the thread runnable, counted as involuntary), not
    // by wall time, which a loaded machine stretches for yields too.
    const auto blocked = [] {
      rusage u{};
      getrusage(RUSAGE_THREAD, &u);
      return u.ru_nvcsw;
    };
    commkit::Backoff spin(uint64_t(1) << 40, 1000000);
    for (int i = 0; i < 64; ++i) spin.pause();
    long before = blocked();
    for (int i = 0; i < 10; ++i) spin.pause();
    EXPECT(blocked() == before);  // ten yields, no sleep
    commkit::Backoff sleepy(0, 1000000);
    for (int i = 0; i < 64; ++i) sleepy.pause();
    uint64_t t0 = commkit::monotonic_ns();
    before = blocked();
    sleepy.pause();
    EXPECT(commkit::monotonic_ns() - t0 >= 1000000ull && blocked() > before);
    sleepy.reset();  // a reset starts with the spin rounds again
    before = blocked();
    sleepy.pause();
    EXPECT(blocked() == before);
    // poll_until takes the caller's backoff.
    commkit::ProgressDeadline d(1000);
    std::atomic<int> flag{0};
    std::thread t([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      flag.store(1);
    });
    EXPECT(commkit::poll_until([&] { return flag.load() == 1; }, d, [] { return 0; }, [] { return false; },
                               commkit::Backoff(uint64_t(1) << 40)) == commkit::PollResult::kReady);
    t.join();
  });
  run("deadline: Backoff sleeps of a second or more really sleep", [] {
    // tv_nsec >= 1e9 made nanosleep fail at once: a busy spin instead of a sleep.
    commkit::Backoff b(0, 1000000000L);
    for (int i = 0; i < 64; ++i) b.pause();
    const uint64_t t0 = commkit::monotonic_ns();
    b.pause();
    EXPECT(commkit::monotonic_ns() - t0 >= 1000000000ull);
  });
}

// ---- atomics across threads and processes
void atomics_tests() {
  run("atomics: cas returns old value, exactly one winner among threads", [] {
    uint32_t word = 0;
    std::atomic<int> winners{0};
    std::vector<std::thread> ts;
    for (int i = 0; i < 8; ++i)
      ts.emplace_back([&, i] {
        if (commkit::cas(&word, 0u, uint32_t(i + 1)) == 0u) ++winners;
      });
    for (auto& t : ts) t.join();
    EXPECT(winners.load() == 1);
    EXPECT(word != 0u);
    EXPECT(commkit::cas(&word, 12345u, 7u) == word);  // failure returns the current value
  });
  run("atomics: fetch_add across processes on shared memory (system scope)", [] {
    void* mem = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    EXPECT(mem != MAP_FAILED);
    auto* counter = static_cast<uint64_t*>(mem);
    *counter = 0;
    constexpr int kProcs = 4, kIters = 20000;
    std::vector<pid_t> pids;
    for (int p = 0; p < kProcs; ++p) {
      pid_t pid = fork();
      if (pid == 0) {
        for (int i = 0; i < kIters; ++i) commkit::fetch_add(counter, uint64_t(1));
        _exit(0);
      }
      pids.push_back(pid);
    }
    for (pid_t pid : pids) waitpid(pid, nullptr, 0);
    EXPECT(commkit::ld_acquire(counter) == uint64_t(kProcs) * kIters);
    munmap(mem, 4096);
  });
  run("atomics: release/acquire message passing", [] {
    struct Msg {
      uint64_t payload[64];
      uint32_t ready;
    } msg{};
    std::thread producer([&] {
      for (int i = 0; i < 64; ++i) msg.payload[i] = uint64_t(i) * 3 + 1;
      commkit::st_release(&msg.ready, 1u);
    });
    while (commkit::ld_acquire(&msg.ready) == 0u) {
    }
    for (int i = 0; i < 64; ++i) EXPECT(msg.payload[i] == uint64_t(i) * 3 + 1);
    producer.join();
    EXPECT(commkit::exchange(&msg.ready, 5u) == 1u && msg.ready == 5u);
  });
}

// ---- layouts and saturating arithmetic
void layout_tests() {
  run("layout: regions are aligned, ordered and disjoint", [] {
    commkit::Layout l(0);
    commkit::Region a = l.add(1000, 16), b = l.add(24, 128), c = l.add_array<double>(3), d = l.add(0, 64);
    EXPECT(a.offset == 0 && b.offset == 1024 && c.offset == 1056 && c.bytes == 24);
    EXPECT(commkit::is_aligned(d.offset, 64) && d.offset >= c.end());
    EXPECT(!a.overlaps(b) && !b.overlaps(c) && !a.overlaps(c));
    EXPECT(commkit::Region{0, 10}.overlaps(commkit::Region{9, 1}));
    EXPECT(!commkit::Region{0, 10}.overlaps(commkit::Region{10, 1}));
    EXPECT(l.total(4096) == 4096);
    char buf[2048];
    EXPECT(reinterpret_cast<char*>(b.at<int>(buf)) == buf + 1024);
  });
  run("layout: sizes near 2^64 saturate instead of wrapping to a small total", [] {
    constexpr uint64_t kMax = ~uint64_t(0);
    EXPECT(commkit::align_up(kMax - 5, 16) == kMax);  // wrapped to 0
    EXPECT(commkit::align_up(kMax, 1) == kMax && commkit::align_up(kMax - 15, 16) == kMax - 15);
    EXPECT(commkit::ceil_div(kMax, 2) == (kMax >> 1) + 1);  // wrapped to 0
    EXPECT(commkit::ceil_div(kMax, 1) == kMax && commkit::ceil_div(0, 7) == 0 && commkit::ceil_div(14, 7) == 2);
    EXPECT((commkit::Region{4096, kMax}.end() == kMax));
    // ipc_all2all's buffer for a capacity of INT64_MAX: two 2^63-byte slots after a 4 KiB header.
    // Wrapping made the whole layout 4 KiB while each slot stayed 2^63 bytes long.
    commkit::Layout l;
    const commkit::Region sig = l.add(4096, 4096);
    const uint64_t slot = commkit::align_up(uint64_t(INT64_MAX), 256);
    const commkit::Region s0 = l.add(slot, 256), s1 = l.add(slot, 256);
    EXPECT(!sig.overlaps(s0) && !s0.overlaps(s1));
    EXPECT(l.overflowed() && l.total(4096) == kMax);
    EXPECT(l.total(4096) >= s1.end() && s1.end() >= s1.offset);
    commkit::Layout a;
    a.add_array<uint64_t>(kMax / 4);  // count * 8 wrapped to a small size
    EXPECT(a.overflowed() && a.total() == kMax);
    commkit::Layout ok;
    ok.add(100, 64);
    EXPECT(!ok.overflowed() && ok.total(64) == 128);
  });
  run("saturating arithmetic for signed and narrow types: the maximum instead of overflow", [] {
    constexpr int64_t kI = INT64_MAX;
    EXPECT(commkit::max_of<int64_t>() == kI && commkit::max_of<uint32_t>() == UINT32_MAX &&
           commkit::max_of<int32_t>() == INT32_MAX && commkit::max_of<uint64_t>() == ~uint64_t(0));
    // (2^31 - 1)^2 * 2^31 overflows int64 (undefined; it wrapped to a small size in elastic_ep's sizing)
    const int64_t big = INT32_MAX;
    EXPECT(commkit::sat_mul(commkit::sat_mul(big, big), int64_t(1) << 31) == kI);
    EXPECT(commkit::sat_mul(big, big) == big * big);  // exact below the limit
    EXPECT(commkit::sat_mul(int64_t(0), kI) == 0 && commkit::sat_mul(kI, int64_t(1)) == kI);
    EXPECT(commkit::sat_mul(int64_t(1) << 31, int64_t(1) << 32) == kI);  // exactly 2^63
    EXPECT(commkit::sat_mul((int64_t(1) << 31) - 1, int64_t(1) << 32) == kI - ((int64_t(1) << 32) - 1));
    EXPECT(commkit::sat_add(kI - 1, int64_t(1)) == kI && commkit::sat_add(kI - 1, int64_t(2)) == kI);
    EXPECT(commkit::sat_add(kI, kI) == kI && commkit::sat_add(int64_t(5), int64_t(7)) == 12);
    EXPECT(commkit::sat_add(uint32_t(UINT32_MAX - 1), uint32_t(5)) == UINT32_MAX);  // wrapped to 3
    EXPECT(commkit::sat_cast<int64_t>(~uint64_t(0)) == kI);  // was -1
    EXPECT(commkit::sat_cast<int64_t>(uint64_t(kI)) == kI && commkit::sat_cast<int64_t>(uint64_t(kI) + 1) == kI);
    EXPECT(commkit::sat_cast<int32_t>(uint64_t(1) << 40) == INT32_MAX && commkit::sat_cast<int32_t>(uint64_t(77)) == 77);
  });
}

// ---- IPC handle checks and shared-memory segments
void ipc_and_shm_tests() {
  run("ipc handle: a rank outside the world is refused before it indexes the handles", [] {
    const commkit::IpcHandleFormat fmt{{'t', 'e', 's', 't', 'f', 'm', 't', 1}, "test", "slots of", ""};
    const std::string raw(commkit::kIpcHandleBytes, 'h');
    commkit::IpcWindowInfo bad{2, 5, 64, 128};  // rank 5 of 2
    std::vector<std::string> hs;
    for (int r = 0; r < 2; ++r) hs.push_back(commkit::describe_ipc_handle(fmt, {2, r, 64, 128}, raw));
    auto e = expect_throw<commkit::ValueError>(
        [&] { commkit::check_described_ipc_handles(fmt, hs, bad, hs[0], "sync()"); });
    EXPECT(std::string(e.what()).find("rank 5 is outside [0, world_size=2)") != std::string::npos);
    EXPECT(commkit::check_described_ipc_handles(fmt, hs, {2, 1, 64, 128}, hs[1], "sync()").size() == 2);
  });
  run("shm: create is owner-only, attach refuses segments others can access or too small", [] {
    commkit::ShmSegment s = commkit::ShmSegment::create("ck_test", 4096);
    int fd = ::shm_open(s.name().c_str(), O_RDWR, 0);
    EXPECT(fd >= 0);
    struct stat st;
    EXPECT(::fstat(fd, &st) == 0 && (st.st_mode & 0777) == 0600 && st.st_size == 4096);
    EXPECT(commkit::ShmSegment::attach(s.name(), 4096).size() == 4096);
    expect_throw<commkit::ValueError>([&] { commkit::ShmSegment::attach(s.name(), 8192); });
    EXPECT(::fchmod(fd, 0666) == 0);
    auto e = expect_throw<commkit::Error>([&] { commkit::ShmSegment::attach(s.name(), 4096); });
    EXPECT(std::string(e.what()).find("accessible to other users (mode 0666)") != std::string::npos);
    ::close(fd);
    const std::string name = s.name();
    s.close();  // the creator unlinks
    EXPECT(::shm_open(name.c_str(), O_RDWR, 0) < 0 && errno == ENOENT);
  });
}

// ---- timeout records
void timeout_record_tests() {
  run("timeout record: a record still being written (flag 2) is left alone", [] {
    commkit::TimeoutRecord rec{};
    commkit::clear_timeout_record(&rec);
    rec.op = 7;
    commkit::st_release(&rec.flag, 2u);
    CK_RAISE_IF_TIMED_OUT(&rec, [](uint32_t) { return std::string("op"); });
    EXPECT(rec.flag == 2u && rec.op == 7u);
  });
  run("timeout record: host raises TimeoutError naming op, rank, peer; then clears", [] {
    commkit::TimeoutRecord rec{};
    commkit::clear_timeout_record(&rec);
    auto name = [](uint32_t op) { return op == 2 ? std::string("combine recv") : std::string("?"); };
    CK_RAISE_IF_TIMED_OUT(&rec, name);  // clear: no throw
    rec.op = 2;
    rec.rank = 1;
    rec.peer = 0;
    rec.expected = 9;
    rec.observed = 4;
    rec.waited_ns = 3000000000ull;
    commkit::st_release(&rec.flag, 1u);
    auto e = expect_throw<commkit::TimeoutError>([&] { CK_RAISE_IF_TIMED_OUT(&rec, name); });
    EXPECT(e.operation() == "combine recv" && e.rank() == 1 && e.peer() == 0);
    EXPECT(e.expected() == 9 && e.observed() == 4);
    EXPECT(std::string(e.what()).find("3000 ms") != std::string::npos);
    EXPECT(rec.flag == 0u && rec.op == 0u && rec.rank == 0 && rec.peer == -1 && rec.expected == 0 &&
           rec.observed == 0 && rec.waited_ns == 0u && rec.channel == 0u);
  });
}

// ---- peer processes
pid_t spawn_sleeper() {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::pause();
    ::_exit(0);
  }
  return pid;
}

void process_tests() {
  run("process: this process is alive under its start time, not under another", [] {
    const commkit::ProcessId me = commkit::this_process();
    EXPECT(me.pid == uint64_t(::getpid()) && me.start != 0 && me.boot != 0 && me.pid_ns != 0);
    EXPECT(commkit::process_alive(me.pid, me.start) && commkit::process_alive(me.pid, 0));
    EXPECT(!commkit::process_alive(me.pid, me.start + 1));  // the pid names another process now
  });
  run("process: a killed child is dead as a zombie and after it was reaped", [] {
    const pid_t child = spawn_sleeper();
    const uint64_t start = commkit::process_start_time(uint64_t(child));
    EXPECT(start != 0 && commkit::process_alive(uint64_t(child), start));
    ::kill(child, SIGKILL);
    bool dead = false;
    for (int i = 0; i < 200 && !dead; ++i) {  // the kernel makes it a zombie shortly
      dead = !commkit::process_alive(uint64_t(child), start);
      if (!dead) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT(dead);
    ::waitpid(child, nullptr, 0);
    EXPECT(!commkit::process_alive(uint64_t(child), start) && commkit::process_start_time(uint64_t(child)) == 0);
  });
  run("peer watch: a peer's death on this host claims the timeout record naming it, within periods", [] {
    const pid_t child = spawn_sleeper();
    commkit::ProcessId peer = commkit::this_process();
    peer.pid = uint64_t(child);
    peer.start = commkit::process_start_time(peer.pid);
    commkit::ProcessId elsewhere = peer;
    elsewhere.boot ^= 1;  // another kernel: its pid means nothing here, so it is not watched
    commkit::TimeoutRecord rec{};
    commkit::clear_timeout_record(&rec);
    commkit::PeerWatch watch(&rec, 14, 0, {commkit::this_process(), peer, elsewhere}, 10);
    EXPECT(watch.num_watched() == 1 && watch.dead_peer() == -1);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT(commkit::ld_acquire(&rec.flag) == 0u);  // alive: nothing reported
    const auto t0 = std::chrono::steady_clock::now();
    ::kill(child, SIGKILL);
    while (commkit::ld_acquire(&rec.flag) == 0u &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2))
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ::waitpid(child, nullptr, 0);
    EXPECT(rec.flag == 1u && rec.op == 14u && rec.rank == 0 && rec.peer == 1 && rec.expected == int64_t(child));
    EXPECT(watch.dead_peer() == 1);
  });
  run("heartbeat: beats at once and every period, stops when destroyed", [] {
    uint64_t word = 0;
    {
      commkit::Heartbeat beat(&word, 5);
      EXPECT(word != 0 && commkit::heartbeat_age_ns(&word) < 1000000000ull);
      const uint64_t first = word;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      EXPECT(word > first && commkit::heartbeat_age_ns(&word) < 40000000ull);
    }
    const uint64_t last = word;
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    EXPECT(word == last && commkit::heartbeat_age_ns(&word) >= 30000000ull);
  });
  run("peer watch: a record a device deadline claimed first is kept; stopping joins at once", [] {
    const pid_t child = spawn_sleeper();
    commkit::ProcessId peer = commkit::this_process();
    peer.pid = uint64_t(child);
    peer.start = commkit::process_start_time(peer.pid);
    commkit::TimeoutRecord rec{};
    commkit::clear_timeout_record(&rec);
    rec.op = 3;
    rec.peer = 5;
    commkit::st_release(&rec.flag, 1u);
    {
      commkit::PeerWatch watch(&rec, 14, 0, {commkit::this_process(), peer}, 5);
      ::kill(child, SIGKILL);
      ::waitpid(child, nullptr, 0);
      for (int i = 0; i < 100 && watch.dead_peer() < 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      EXPECT(watch.dead_peer() == 1);
    }
    EXPECT(rec.op == 3u && rec.peer == 5);
    const auto t0 = std::chrono::steady_clock::now();
    { commkit::PeerWatch idle(&rec, 14, 0, {commkit::this_process()}, 60000); }  // nobody to watch: no thread
    {
      // A live peer and a 60 s period: the destructor wakes the thread instead of waiting it out.
      commkit::PeerWatch slow(&rec, 14, 0, {commkit::this_process(), commkit::this_process()}, 60000);
      EXPECT(slow.num_watched() == 1);
    }
    EXPECT(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1));
  });
}

void teardown_tests() {
  run("teardown log: every failure is kept, in order; successes are not", [] {
    commkit::TeardownLog log;
    EXPECT(log.empty());
    EXPECT(!log.step("cudaEventDestroy", true, "no error"));
    EXPECT(log.step("cudaFree(buffer)", false, "invalid argument"));
    log.note("rank 1 did not arrive");
    EXPECT(log.step("ncclMemFree", false, "unhandled cuda error"));
    EXPECT(log.message() ==
           "cudaFree(buffer) failed: invalid argument; rank 1 did not arrive; ncclMemFree failed: unhandled cuda error");
  });
  run("teardown log: the test hook reports exactly the named steps", [] {
    commkit::TeardownLog log("cudaFree(buffer),ncclMemFree");
    EXPECT(!log.step("cudaFree", true));  // a prefix of a named step is not it
    EXPECT(log.step("cudaFree(buffer)", true));
    EXPECT(log.step("ncclMemFree", true));
    EXPECT(!log.step("cudaFreeHost(record)", true));
    EXPECT(log.message() == "cudaFree(buffer) failed (injected by a test hook); ncclMemFree failed (injected by a "
                            "test hook)");
    commkit::TeardownLog all("*");
    EXPECT(all.step("anything", true));
  });
}

// In a forked child: caps the address space below the next thread's stack (set large, so that no stack
// cached from an exited thread fits), then runs a DetachedCall. 0: fn ran in place, on this thread, and the
// call was done at once; 1: in place but not so; 2: a thread started anyway; 3: the cap failed.
int detached_call_without_threads() {
  pthread_attr_t attr;
  long pages = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  const bool read = f != nullptr && std::fscanf(f, "%ld", &pages) == 1 && std::fclose(f) == 0;
  const rlim_t cap = rlim_t(pages) * rlim_t(::sysconf(_SC_PAGESIZE)) + (64ull << 20);
  const rlimit lim{cap, cap};
  if (!read || ::pthread_attr_init(&attr) != 0 || ::pthread_attr_setstacksize(&attr, 256ull << 20) != 0 ||
      ::pthread_setattr_default_np(&attr) != 0 || ::setrlimit(RLIMIT_AS, &lim) != 0)
    return 3;
  std::thread::id ran_on;
  commkit::DetachedCall<int> call([where = &ran_on] { return *where = std::this_thread::get_id(), 5; });
  if (!call.in_place()) return 2;
  return ran_on == std::this_thread::get_id() && call.wait_for(0) && call.result() == 5 ? 0 : 1;
}

void device_sync_tests() {
  using std::chrono::milliseconds;
  using Clock = std::chrono::steady_clock;
  run("detached call: false at the deadline while fn blocks, true once it returns (also with no deadline)", [] {
    auto gate = std::make_shared<std::atomic<bool>>(false);
    commkit::DetachedCall<int> call([gate] {
      while (!gate->load()) std::this_thread::sleep_for(milliseconds(1));
      return 7;
    });
    const auto t0 = Clock::now();
    const bool early = call.wait_for(50000000ull) || call.wait_for(0);
    const auto waited = Clock::now() - t0;
    std::thread release([gate] { std::this_thread::sleep_for(milliseconds(20)), gate->store(true); });
    const bool done = call.wait_for(UINT64_MAX);  // "forever" must not overflow into "not at all"
    release.join();
    EXPECT(!call.in_place() && !early && waited >= milliseconds(50) && waited < std::chrono::seconds(5));
    EXPECT(done && call.result() == 7);
  });
  run("detached call: fn that returns at once; a caller that gives up leaves the thread to finish", [] {
    commkit::DetachedCall<int> quick([] { return 3; });
    EXPECT(quick.wait_for(5000000000ull) && quick.result() == 3 && !quick.in_place());
    auto gate = std::make_shared<std::atomic<bool>>(false);
    auto ended = std::make_shared<std::atomic<bool>>(false);
    {
      commkit::DetachedCall<int> late([gate, ended] {
        while (!gate->load()) std::this_thread::sleep_for(milliseconds(1));
        ended->store(true);
        return 1;
      });
      EXPECT(!late.wait_for(1000000ull));
    }
    gate->store(true);
    for (int i = 0; i < 2000 && !ended->load(); ++i) std::this_thread::sleep_for(milliseconds(1));
    EXPECT(ended->load());
  });
  run("detached call: no thread to spare (std::system_error) runs fn in place, done at once", [] {
    std::fflush(stdout);
    const pid_t pid = ::fork();
    if (pid == 0) {
      int code = 4;  // 4: an exception escaped
      try { code = detached_call_without_threads(); } catch (...) {}  // the child must _exit, whatever happens
      ::_exit(code);
    }
    int status = 0;
    EXPECT(pid > 0 && ::waitpid(pid, &status, 0) == pid && WIFEXITED(status));
    EXPECT(WEXITSTATUS(status) == 0);  // see detached_call_without_threads for the other codes
  });
}

}  // namespace

int main() {
  check_tests();
  deadline_tests();
  atomics_tests();
  layout_tests();
  ipc_and_shm_tests();
  timeout_record_tests();
  process_tests();
  teardown_tests();
  device_sync_tests();
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
