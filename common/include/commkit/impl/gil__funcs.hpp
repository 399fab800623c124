// commkit/impl/gil__funcs.hpp -- the classes and functions of commkit/gil.hpp (see there for the
// contract).
#pragma once

#include <pthread.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

// pybind11's types are hidden; a class holding one must be too, or GCC warns in TUs built without
// -fvisibility=hidden (the extensions use it; test probes do not).
#define COMMKIT_PY_HIDDEN __attribute__((visibility("hidden")))

namespace commkit {

inline bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

class COMMKIT_PY_HIDDEN GilRelease {
 public:
  GilRelease() = default;
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  pybind11::gil_scoped_release release_;
};

template <typename Release = GilRelease, typename F>
auto without_gil(F&& f) -> decltype(f()) {
  using Ret = decltype(f());
  std::exception_ptr err;
  if constexpr (std::is_void_v<Ret>) {
    {
      Release nogil;
      try {
        f();
      } catch (...) {
        err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
  } else {
    std::optional<Ret> out;
    {
      Release nogil;
      try {
        out.emplace(f());
      } catch (...) {
        err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
    return std::move(*out);
  }
}

namespace gil_detail {

// One gate per extension module: the headers are compiled into each module with hidden visibility.
inline std::atomic<bool> g_exiting{false};
inline std::atomic<unsigned long> g_exit_thread{0};
inline std::atomic<int> g_entering{0};  // threads between the gate check and holding the GIL
inline thread_local bool t_exit_thread = false;

constexpr auto kGateDrainMax = std::chrono::seconds(2);

[[noreturn]] inline void park_until_exit() noexcept {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

// The atexit hook (GIL held, on the thread that runs the exit).
inline void close_exit_gate() {
  g_exit_thread.store(PyThread_get_thread_ident());
  g_exiting.store(true);
  if (g_entering.load() == 0) return;
  PyThreadState* ts = PyEval_SaveThread();  // let the threads already past the gate take the GIL
  const auto until = std::chrono::steady_clock::now() + kGateDrainMax;
  while (g_entering.load() != 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  PyEval_RestoreThread(ts);
}

}  // namespace gil_detail

inline bool exit_gate_closed() {
  if (!gil_detail::g_exiting.load() && !python_finalizing()) return false;
  return !gil_detail::t_exit_thread && PyThread_get_thread_ident() != gil_detail::g_exit_thread.load();
}

inline void install_exit_gate() {
  pybind11::module_::import("atexit").attr("register")(pybind11::cpp_function(&gil_detail::close_exit_gate));
  static const int atfork = pthread_atfork(nullptr, nullptr, [] {
    gil_detail::g_exiting.store(false);
    gil_detail::g_exit_thread.store(0);
    gil_detail::g_entering.store(0);
  });
  (void)atfork;
}

class GatedGilRelease {
 public:
  GatedGilRelease() {
    // Only the finalizing thread can hold the GIL now: it runs the exit and must not be gated.
    if (python_finalizing()) gil_detail::t_exit_thread = true;
    state_ = PyEval_SaveThread();
  }
  ~GatedGilRelease() {
    gil_detail::g_entering.fetch_add(1);
    if (exit_gate_closed()) {
      gil_detail::g_entering.fetch_sub(1);
      gil_detail::park_until_exit();
    }
    PyEval_RestoreThread(state_);
    gil_detail::g_entering.fetch_sub(1);
  }
  GatedGilRelease(const GatedGilRelease&) = delete;
  GatedGilRelease& operator=(const GatedGilRelease&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

class COMMKIT_PY_HIDDEN GatedGilAcquire {
 public:
  GatedGilAcquire() {
    struct Entering {
      Entering() { gil_detail::g_entering.fetch_add(1); }
      ~Entering() { gil_detail::g_entering.fetch_sub(1); }
    } entering;
    if (!exit_gate_closed()) gil_.emplace();
  }
  bool held() const { return gil_.has_value(); }

 private:
  std::optional<pybind11::gil_scoped_acquire> gil_;
};

}  // namespace commkit
