// bindings.cpp -- the torch-free _C module: the low-level transport (with the constructor and calls
// of KTransformers' FP8LayerwiseTransport), the native shard writer, POSIX shm segments
// (commkit/shm.hpp) and cudaHostRegister helpers. Python passes integer pointers; fp8_layerwise/
// builds the memory-owning API on top.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <utility>

#include "backend.hpp"
#include "commkit/gil.hpp"
#include "commkit/python_errors.hpp"
#include "commkit/shm.hpp"
#include "transport.hpp"

namespace py = pybind11;
using namespace fp8lw;

namespace {

// ---- the GIL at interpreter exit ------------------------------------------------------------------
// A daemon thread blocked in a call of this module (wait, join, a layer loop, a Python writer) asks for
// the GIL when the call returns, every 50 ms in the interrupt hook, and per expert in a Python writer;
// once the interpreter finalizes, CPython (before 3.14) ends such a waiter with pthread_exit, which
// aborted the whole process (SIGABRT: "terminate called without an active exception", "FATAL:
// exception not rethrown"). So every call here releases the GIL through commkit's exit gate
// (commkit/gil.hpp, installed in the module init). Behind the closed gate a thread that would wait for
// the GIL instead
//   * returning from a native call (GatedGilRelease): parks until the process exits; the call itself
//     has left, so close() of its transport is not held up;
//   * in the interrupt hook: reports no interruption (only the main thread handles signals anyway);
//   * in a Python writer: fails the writer (the layer is poisoned, so the peers stop at once).
// What a Python writer itself runs is out of reach: a daemon thread that the exit catches inside the
// writer's own Python code (a torch op, time.sleep) dies there, in frames that are not this module's.
template <typename F>
auto without_gil(F&& f) {
  return commkit::without_gil<commkit::GatedGilRelease>(std::forward<F>(f));
}

py::dict stats_dict(const Stats& s) {
  py::dict d;
  d["epoch"] = s.epoch;
  d["layer_id"] = s.layer_id;
  d["expert_count"] = s.expert_count;
  d["rank"] = s.rank;
  d["writer_ms"] = s.writer_ms;
  d["slot_wait_ms"] = s.slot_wait_ms;
  d["h2d_ms"] = s.h2d_ms;
  d["total_ms"] = s.total_ms;
  d["bytes"] = s.bytes;
  d["copies"] = s.copies;
  d["poisoned"] = s.poisoned;
  d["error_code"] = s.error_code;
  d["error_rank"] = s.error_rank;
  d["error_peer"] = s.error_peer;
  d["error_message"] = s.error_message;
  return d;
}

// A BaseException that is not an Exception (KeyboardInterrupt, SystemExit, GeneratorExit) raised by
// a Python writer: the native core poisons the region as for any writer failure (code WRITER), and
// run() then re-raises this original exception instead of TransportPoisoned, so that
// `except Exception` can never swallow a Ctrl-C.
struct WriterEscape {
  std::unique_ptr<py::error_already_set> error;  // set and read with the GIL held
};

Writer wrap_python_writer(py::function fn, std::shared_ptr<WriterEscape> escape) {
  auto holder = std::make_shared<py::function>(std::move(fn));
  return [holder, escape](int e, const std::vector<uintptr_t>& a, const std::vector<uintptr_t>& b,
                          const std::vector<uintptr_t>& c, const std::vector<uintptr_t>& d) {
    commkit::GatedGilAcquire gil;
    if (!gil.held())
      throw std::runtime_error("the Python interpreter is exiting: this thread may not run a Python writer");
    try {
      (*holder)(e, a, b, c, d);
    } catch (py::error_already_set& err) {
      // Keep the original cause as "ExcType: message" (without pybind11's traceback dump).
      std::string msg = py::str(err.type().attr("__name__")).cast<std::string>() + ": " +
                        py::str(err.value()).cast<std::string>();
      if (!PyErr_GivenExceptionMatches(err.type().ptr(), PyExc_Exception) && escape && !escape->error)
        escape->error = std::make_unique<py::error_already_set>(std::move(err));
      throw std::runtime_error(msg);
    }
  };
}

// The exception a Python signal handler raised (KeyboardInterrupt on Ctrl-C) while this thread was
// blocked in a native call, kept until that call's InterruptedError reaches the translator (which
// runs on the same thread) and raised there instead.
struct SavedPyError {
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* tb = nullptr;
  void clear() {
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    type = value = tb = nullptr;
  }
};
thread_local SavedPyError t_interrupt;

// Options::interrupt_check of every transport made here: runs the Python signal handlers (only the
// main thread runs them; elsewhere this is a no-op); when one raised, keeps its exception for the
// translator and names it, so the native call poisons the region and raises InterruptedError.
std::string check_python_signals() noexcept {
  if (commkit::python_finalizing()) return std::string();
  commkit::GatedGilAcquire gil;
  if (!gil.held() || PyErr_CheckSignals() == 0) return std::string();
  t_interrupt.clear();
  PyErr_Fetch(&t_interrupt.type, &t_interrupt.value, &t_interrupt.tb);
  PyErr_NormalizeException(&t_interrupt.type, &t_interrupt.value, &t_interrupt.tb);
  const char* name = t_interrupt.type != nullptr ? reinterpret_cast<PyTypeObject*>(t_interrupt.type)->tp_name : nullptr;
  return name != nullptr ? std::string(name) : std::string("a signal");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fp8_layerwise native core (torch-free)";
  // Closes the GIL gate when the interpreter exits, before it starts finalizing (see above).
  commkit::install_exit_gate();
  commkit::register_python_errors(m);
  // Module-local like the commkit translators and registered after them, so it is tried first.
  // fp8_layerwise documents TransportError as the base of every runtime error it raises, so every
  // commkit::Error but ValueError (left to commkit's translator: the builtin ValueError) becomes
  // one of fp8_layerwise.errors' classes, keeping the commkit attributes (rank, peer, where; and
  // operation, expected, observed of a timeout).
  //
  // Running Python code here (the import, the factories) would run the handler of a signal that is
  // still pending (Ctrl-C during the native call) and raise inside the translator, where the error
  // would be lost or re-typed by a later translator: so a pending signal is run first and its
  // exception (KeyboardInterrupt) wins, and any error while building ours is raised as it is.
  py::register_local_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    auto raise = [](py::object exc) { PyErr_SetObject(py::type::handle_of(exc).ptr(), exc.ptr()); };
    auto errors = [] { return py::module_::import("fp8_layerwise.errors"); };
    try {
      std::rethrow_exception(p);
    } catch (const InterruptedError& e) {
      py::gil_scoped_acquire gil;
      if (t_interrupt.type != nullptr) {
        PyErr_Restore(t_interrupt.type, t_interrupt.value, t_interrupt.tb);  // steals the references
        t_interrupt = SavedPyError();
      } else {
        PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
      }
    } catch (const commkit::ValueError&) {
      throw;  // to commkit's translator (no Python code runs there)
    } catch (const commkit::Error& e) {
      py::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() != 0) return;  // the signal handler's exception is set: it wins
      try {
        if (const auto* pe = dynamic_cast<const PoisonedError*>(&e)) {
          raise(errors().attr("_from_native")(pe->code(), pe->poison_rank(), pe->message(), std::string(e.what()),
                                              pe->peer()));
        } else if (const auto* te = dynamic_cast<const commkit::TimeoutError*>(&e)) {
          raise(errors().attr("_from_native_timeout")(std::string(e.what()), e.rank(), e.peer(),
                                                      commkit::error_where(e), te->operation(), te->expected(),
                                                      te->observed()));
        } else {
          raise(errors().attr("_from_native_error")(std::string(e.what()), e.rank(), e.peer(), commkit::error_where(e),
                                                    dynamic_cast<const ClosedError*>(&e) != nullptr));
        }
      } catch (py::error_already_set& err) {
        err.restore();
      }
    }
  });

  m.attr("FP8_LAYERWISE_CONTROL_BYTES") = py::int_(control_bytes());
  m.attr("FP8_LAYERWISE_MAX_TP_SIZE") = py::int_(kMaxTP);
  m.attr("FP8_LAYERWISE_MAX_SLOTS") = py::int_(kMaxSlots);
  m.attr("FP8_LAYERWISE_MAX_COPY_STREAMS") = py::int_(kMaxCopyStreams);
  m.attr("CONTROL_STRUCT_BYTES") = py::int_(control_struct_bytes());
  m.def("built_with_cuda", [] { return bool(COMMKIT_WITH_CUDA); });
  m.def("cuda_available", &cuda_available);
  m.def("cuda_host_register", &cuda_host_register, py::arg("ptr"), py::arg("nbytes"), py::arg("device"));
  m.def("cuda_host_unregister", &cuda_host_unregister, py::arg("ptr"));
  m.def("cuda_h2d_seconds", &cuda_h2d_seconds, py::arg("device"), py::arg("dst"), py::arg("src"), py::arg("nbytes"),
        py::arg("iters"), py::call_guard<commkit::GatedGilRelease>(),
        "Reference: seconds for `iters` plain cudaMemcpyAsync H2D copies (event timing).");
  m.def("initialize_fp8_layerwise_control", &initialize_control, py::arg("control_ptr"), py::arg("control_size"),
        py::arg("tp_size"), py::arg("num_slots") = 2,
        "Zero and stamp a control region (magic, version, struct size, tp_size, num_slots).");

  // The buffer protocol exports the whole mapping; an exporter (memoryview, torch.frombuffer's tensor)
  // holds a reference to the segment object, so the mapping stays until the last view is gone as
  // long as nobody calls close() explicitly (HostSlots only drops its reference).
  py::class_<commkit::ShmSegment>(m, "ShmSegment", py::buffer_protocol())
      .def_buffer([](commkit::ShmSegment& s) -> py::buffer_info {
        if (s.data() == nullptr) throw py::buffer_error("the shm segment is closed (unmapped)");
        return py::buffer_info(s.data(), sizeof(uint8_t), py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(s.size())}, {static_cast<py::ssize_t>(1)});
      })
      .def_static("create", &commkit::ShmSegment::create, py::arg("prefix"), py::arg("nbytes"),
                  "Create an owner-only (0600, O_EXCL) segment with an unguessable name.")
      .def_static("attach", &commkit::ShmSegment::attach, py::arg("name"), py::arg("nbytes") = 0)
      .def_property_readonly("name", &commkit::ShmSegment::name)
      .def_property_readonly("ptr", [](const commkit::ShmSegment& s) { return reinterpret_cast<uintptr_t>(s.data()); })
      .def_property_readonly("nbytes", &commkit::ShmSegment::size)
      .def_property_readonly("linked", &commkit::ShmSegment::linked)
      .def("unlink", &commkit::ShmSegment::unlink)
      .def("close", &commkit::ShmSegment::close);
  m.def("shm_free_bytes", &commkit::shm_free_bytes);
  m.def("process_start_time", &commkit::process_start_time, py::arg("pid"));
  // Test hooks for the liveness check (tests/fp8_layerwise/test_liveness_records.py): the per-rank
  // (pid, start time) records live in the control region at offsets Python does not know.
  m.def("_debug_rank_process_alive", &commkit::process_alive, py::arg("pid"), py::arg("recorded_start"),
        "Test hook: the transport's liveness predicate for a rank record (pid, start time recorded on "
        "attach): False when the pid is gone, a zombie, or now names a process with another start time.");
  m.def("_debug_set_rank_process", &debug_set_rank_process, py::arg("control_ptr"), py::arg("control_size"),
        py::arg("rank"), py::arg("pid"), py::arg("start_time"), py::arg("boot") = 0, py::arg("pid_ns") = 0,
        py::arg("heartbeat_ns") = 0,
        "Test hook: record (pid, start_time[, boot, pid_ns, heartbeat_ns]) as `rank`'s process in an initialized "
        "control region and mark the rank attached, so the transport's liveness checks judge that record. "
        "Forges a rank: tests only.");
  m.def(
      "this_process", [] { return commkit::as_tuple(commkit::this_process()); },
      "(kernel boot id hash, PID-namespace inode, pid, start time) of this process");
  m.def("_debug_monotonic_ns", &commkit::monotonic_ns, "CLOCK_MONOTONIC in ns (the heartbeats' clock; tests)");

  py::class_<ShardSpec>(m, "ShardSpec")
      .def(py::init([](uintptr_t base, uint64_t expert_stride, uint64_t row_stride, uint64_t rows, uint64_t row_bytes,
                       uint64_t rank_row_step, uint64_t rank_col_step, uint64_t chunks, uint64_t chunk_row_step,
                       uint64_t num_experts) {
             ShardSpec s;
             s.base = base;
             s.expert_stride = expert_stride;
             s.row_stride = row_stride;
             s.rows = rows;
             s.row_bytes = row_bytes;
             s.rank_row_step = rank_row_step;
             s.rank_col_step = rank_col_step;
             s.chunks = chunks;
             s.chunk_row_step = chunk_row_step;
             s.num_experts = num_experts;
             return s;
           }),
           // num_experts (the experts in the source buffer) has no default: the writer's only bound.
           py::arg("base"), py::arg("expert_stride"), py::arg("row_stride"), py::arg("rows"), py::arg("row_bytes"),
           py::arg("rank_row_step") = 0, py::arg("rank_col_step") = 0, py::arg("chunks") = 1,
           py::arg("chunk_row_step") = 0, py::kw_only(), py::arg("num_experts"))
      .def_property_readonly("shard_bytes", &ShardSpec::shard_bytes)
      .def_property_readonly("num_experts", [](const ShardSpec& s) { return s.num_experts; });

  m.def(
      "cache_hint_supported", [](const std::string& name) { return cache_hint_supported(parse_cache_hint(name)); },
      py::arg("name"), "Whether this CPU has the instruction behind a ShardWriter cache_hint.");

  py::class_<ShardWriter>(m, "ShardWriter")
      // The specs hold raw pointers into the source tensors: `sources` (any object, e.g. the tensors)
      // is kept alive as long as the writer, so the tensors cannot be freed under it.
      .def(py::init([](std::vector<ShardSpec> kinds, int threads, const std::string& cache_hint, py::object,
                       int tp_size) {
             return std::make_unique<ShardWriter>(std::move(kinds), threads, parse_cache_hint(cache_hint), tp_size);
           }),
           py::arg("kinds"), py::arg("threads") = 1, py::arg("cache_hint") = "none", py::arg("sources") = py::none(),
           py::arg("tp_size") = 0, py::keep_alive<1, 5>())
      .def_property_readonly("tp_size", &ShardWriter::tp_size)
      .def_property_readonly("threads", &ShardWriter::threads)
      .def_property_readonly("num_experts", &ShardWriter::num_experts)
      .def_property_readonly("cache_hint",
                             [](const ShardWriter& w) { return std::string(cache_hint_name(w.cache_hint())); })
      .def(
          "write",
          [](const ShardWriter& w, int expert, const std::vector<std::vector<uintptr_t>>& dst) {
            CK_CHECK_ARG(dst.size() == kKinds, "dst must be [kind][rank] pointers for 4 kinds");
            for (const auto& v : dst) CK_CHECK_ARG(v.size() == dst[0].size() && !v.empty(), "ragged dst");
            for (const auto& v : dst)
              for (auto p : v) CK_CHECK_ARG(p != 0, "dst pointer is null");
            const std::vector<uintptr_t>* d[kKinds] = {&dst[0], &dst[1], &dst[2], &dst[3]};
            without_gil([&] { w.write(expert, d); });
          },
          py::arg("expert"), py::arg("dst"),
          "Copy every rank's shard of `expert` (0..num_experts-1, else ValueError) into dst[kind][rank].");

  py::class_<Transport>(m, "FP8LayerwiseTransport")
      .def(py::init([](uintptr_t control_ptr, size_t control_size, int rank, int tp_size, int cuda_device,
                       const std::vector<uintptr_t>& local_host_ptrs, const std::vector<uintptr_t>& local_gpu_ptrs,
                       const std::vector<uintptr_t>& all_rank_host_ptrs, const std::vector<size_t>& expert_nbytes,
                       int num_experts, uint64_t timeout_ms, const std::string& backend, int max_inflight,
                       bool coalesce, uint64_t liveness_ms, int copy_streams, bool coalesce_wait,
                       bool batch_small_kinds) {
             Options o;
             o.backend = backend;
             o.max_inflight = max_inflight;
             o.coalesce = coalesce;
             o.liveness_ms = liveness_ms;
             o.copy_streams = copy_streams;
             o.coalesce_wait = coalesce_wait;
             o.batch_small_kinds = batch_small_kinds;
             o.interrupt_check = check_python_signals;
             return without_gil([&] {
               return new Transport(control_ptr, control_size, rank, tp_size, cuda_device, local_host_ptrs,
                                    local_gpu_ptrs, all_rank_host_ptrs, expert_nbytes, num_experts, timeout_ms, o);
             });
           }),
           py::arg("control_ptr"), py::arg("control_size"), py::arg("rank"), py::arg("tp_size"),
           py::arg("cuda_device"), py::arg("local_host_ptrs"), py::arg("local_gpu_ptrs"),
           py::arg("all_rank_host_ptrs"), py::arg("expert_nbytes"), py::arg("num_experts"),
           py::arg("timeout_ms") = 60000, py::arg("backend") = "auto", py::arg("max_inflight") = 0,
           py::arg("coalesce") = true, py::arg("liveness_ms") = 20, py::arg("copy_streams") = 2,
           py::arg("coalesce_wait") = false, py::arg("batch_small_kinds") = true)
      .def("join", &Transport::join, py::arg("epoch"), py::arg("layer_id"), py::arg("expert_count"),
           py::call_guard<commkit::GatedGilRelease>())
      .def(
          "wait",
          [](Transport& t, uint64_t epoch) {
            return stats_dict(without_gil([&] { return t.wait(epoch); }));
          },
          py::arg("epoch"))
      .def(
          "run",
          [](Transport& t, uint64_t epoch, int64_t layer_id, int expert_count, py::object writer) {
            if (py::isinstance<ShardWriter>(writer)) {
              const ShardWriter& w = writer.cast<const ShardWriter&>();
              without_gil([&] { t.run_producer_native(epoch, layer_id, expert_count, w); });
              return;
            }
            if (!PyCallable_Check(writer.ptr())) throw py::type_error("writer must be a ShardWriter or a callable");
            auto escape = std::make_shared<WriterEscape>();
            Writer w = wrap_python_writer(py::reinterpret_borrow<py::function>(writer), escape);
            try {
              without_gil([&] { t.run_producer(epoch, layer_id, expert_count, w); });
            } catch (const commkit::Error&) {
              // The writer raised KeyboardInterrupt / SystemExit: the region is poisoned (WRITER), and
              // the caller gets that exception back rather than TransportPoisoned.
              if (escape->error) throw py::error_already_set(std::move(*escape->error));
              throw;
            }
          },
          py::arg("epoch"), py::arg("layer_id"), py::arg("expert_count"), py::arg("writer"),
          "Rank 0: fill every rank's slots expert by expert (writer(expert, w13[r], w13s[r], w2[r], w2s[r]) "
          "or a native ShardWriter).")
      .def("close", &Transport::close, py::call_guard<commkit::GatedGilRelease>(),
           "Close; returns False when a call of another thread (or of this one, closing from inside the writer) "
           "was still inside after the deadline: the control region and the slots must then stay mapped.")
      .def("teardown_error", &Transport::teardown_error,
           "After close(): the copy backend's releases that failed, '' when none.")
      .def("reset", &Transport::reset, py::call_guard<commkit::GatedGilRelease>())
      .def("poison", &Transport::poison, py::arg("code"), py::arg("message"),
           py::call_guard<commkit::GatedGilRelease>())
      .def_property_readonly("poisoned", &Transport::poisoned)
      .def("last_poison", [](const Transport& t) { return stats_dict(t.last_poison()); })
      .def_property_readonly("rank", &Transport::rank)
      .def_property_readonly("tp_size", &Transport::tp_size)
      .def_property_readonly("num_slots", &Transport::num_slots)
      .def_property_readonly("num_experts", &Transport::num_experts)
      .def_property_readonly("closed", &Transport::closed)
      .def_property_readonly("generation", &Transport::generation)
      .def_property_readonly("backend", &Transport::backend);
}
