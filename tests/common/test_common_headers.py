"""CPU suite of the header-only ``common/`` library.

* the C++ suite ``common/tests/test_common.cpp`` (errors, deadlines, atomics across threads and
  processes, layouts, timeout records) is compiled with the host compiler and run;
* ``common/tests/test_device_headers.cu`` is compiled for sm_90a when nvcc exists (nothing runs), and
  its PTX shows the exact vector loads and stores of ``commkit/ptx.cuh``;
* throwaway pybind11 modules check that commkit exceptions reach Python as the documented types
  with their attributes (rank, peer, operation, expected, observed), and what ``commkit/gil.hpp``
  promises: the GIL released, values returned, exceptions rethrown with the GIL back, and a daemon
  thread inside a gated call at interpreter exit.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INC = os.path.join(ROOT, "common", "include")
CXX = os.environ.get("CXX", "g++")


def _build_probe(directory, name: str, source: str, extra_includes=(), src_name: str = "", link_args=()):
    """Compiles ``source`` (a pybind11 module named ``name`` on the common headers; file ``src_name``,
    default ``<name>.cpp``) in ``directory`` and imports it; skips when pybind11 is absent."""
    pybind11 = pytest.importorskip("pybind11")
    src = directory / (src_name or f"{name}.cpp")
    src.write_text(source)
    out = directory / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    includes = [INC, *extra_includes, pybind11.get_include(), sysconfig.get_paths()["include"]]
    subprocess.run([CXX, "-std=c++17", "-O0", "-shared", "-fPIC", *[a for i in includes for a in ("-I", i)],
                    str(src), "-o", str(out), *link_args], check=True)
    spec = importlib.util.spec_from_file_location(name, out)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _nvcc():
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.exists(cand):
            return cand
    return None


def test_cpp_suite(tmp_path):
    exe = tmp_path / "test_common"
    subprocess.run([CXX, "-std=c++17", "-O1", "-Wall", "-Werror", "-I", INC,
                    os.path.join(ROOT, "common", "tests", "test_common.cpp"), "-o", str(exe), "-pthread"],
                   check=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    print(res.stdout)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 failed" in res.stdout and "FAIL" not in res.stdout


def test_headers_compile_standalone(tmp_path):
    # Each public header must compile on its own (no hidden include-order dependency).
    headers = ["check.hpp", "deadline.hpp", "atomics.hpp", "layout.hpp", "timeout_record.hpp", "platform.hpp"]
    for h in headers:
        src = tmp_path / f"inc_{h}.cpp"
        src.write_text(f'#include "commkit/{h}"\nint main() {{ return 0; }}\n')
        subprocess.run([CXX, "-std=c++17", "-Wall", "-Werror", "-fsyntax-only", "-I", INC, str(src)], check=True)


def test_binding_headers_compile_standalone(tmp_path):
    # The pybind11-only headers, each on its own, with and without hidden visibility (the extensions
    # build with it, the probes here without).
    pybind11 = pytest.importorskip("pybind11")
    inc = ["-I", INC, "-I", pybind11.get_include(), "-I", sysconfig.get_paths()["include"]]
    for h in ["gil.hpp", "python_errors.hpp"]:
        src = tmp_path / f"inc_{h}.cpp"
        src.write_text(f'#include "commkit/{h}"\n')
        for vis in ([], ["-fvisibility=hidden"]):
            subprocess.run([CXX, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", *vis, *inc, str(src)],
                           check=True)


def test_device_headers_compile_for_sm90a(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    subprocess.run([nvcc, "-std=c++17", "-arch=sm_90a", "-I", INC, "-c",
                    os.path.join(ROOT, "common", "tests", "test_device_headers.cu"),
                    "-o", str(tmp_path / "dev.o")], check=True)
    assert (tmp_path / "dev.o").stat().st_size > 0


def test_ptx_loads_and_stores_are_the_documented_instructions(tmp_path):
    # ptx.cuh promises these exact instructions (the kernels' cache behaviour depends on them);
    # the PTX carries the inline asm verbatim.
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    ptx = tmp_path / "dev.ptx"
    subprocess.run([nvcc, "-std=c++17", "-arch=sm_90a", "-I", INC, "-ptx",
                    os.path.join(ROOT, "common", "tests", "test_device_headers.cu"), "-o", str(ptx)], check=True)
    text = ptx.read_text()
    body = text[text.index(".entry _Z12exercise_ptxPK4int4PS_"):]
    for insn in ("ld.global.nc.L1::no_allocate.v4.s32", "ld.global.v4.s32", "ld.global.cg.v4.s32",
                 "st.global.L1::no_allocate.v4.s32"):
        assert insn in body, insn


_ERR_MODULE = r"""
#include <pybind11/pybind11.h>
#include "commkit/python_errors.hpp"
PYBIND11_MODULE(ck_err_probe, m) {
  commkit::register_python_errors(m);
  m.def("raise_value", [] { CK_CHECK_ARG(false, "argument x must be positive, got -1"); });
  m.def("raise_error", [] { CK_CHECK_RANK(false, 2, 3, "peer vanished"); });
  m.def("raise_timeout", [] { CK_THROW_TIMEOUT("dispatch notify", 1, 0, 8, 5); });
}
"""


@pytest.fixture(scope="module")
def err_probe(tmp_path_factory):
    return _build_probe(tmp_path_factory.mktemp("probe"), "ck_err_probe", _ERR_MODULE, src_name="probe.cpp")


def test_value_error_maps_to_builtin(err_probe):
    with pytest.raises(ValueError, match="argument x must be positive") as ei:
        err_probe.raise_value()
    assert "probe.cpp:" in str(ei.value)


def test_error_carries_rank_and_peer(err_probe):
    with pytest.raises(RuntimeError, match="peer vanished") as ei:
        err_probe.raise_error()
    assert isinstance(ei.value, err_probe.CommError)
    assert ei.value.rank == 2 and ei.value.peer == 3
    assert ei.value.where.startswith("probe.cpp:")


def test_timeout_carries_operation(err_probe):
    with pytest.raises(TimeoutError) as ei:
        err_probe.raise_timeout()
    e = ei.value
    assert isinstance(e, err_probe.CommTimeoutError)
    assert (e.operation, e.rank, e.peer, e.expected, e.observed) == ("dispatch notify", 1, 0, 8, 5)
    assert "dispatch notify timed out" in str(e)


_IPC_MODULE = r"""
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include "commkit/ipc.hpp"
#include "commkit/python_errors.hpp"
PYBIND11_MODULE(ck_ipc_probe, m) {
  commkit::register_python_errors(m);
  m.attr("handle_bytes") = sizeof(cudaIpcMemHandle_t);
  m.def("check", [](const std::vector<pybind11::bytes>& hs, int rank, pybind11::bytes own) {
    std::vector<std::string> v(hs.begin(), hs.end());
    commkit::check_ipc_handles(v, rank, std::string(own), "sync()");
  });
}
"""


def _cuda_include():
    nvcc = _nvcc()
    cands = [os.path.join(os.environ[k], "include") for k in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(k)]
    if nvcc:
        cands.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include"))
    cands.append("/usr/local/cuda/include")
    return next((c for c in cands if os.path.exists(os.path.join(c, "cuda_runtime.h"))), None)


def test_ipc_handle_checks(tmp_path):
    # commkit/ipc.hpp's handle-list validation (shared by elastic_ep and ipc_all2all): one handle per
    # rank, each of handle size, this rank's own at its index. Compiled against the CUDA headers only:
    # nothing here needs libcudart or a GPU.
    inc = _cuda_include()
    if inc is None:
        pytest.skip("CUDA headers not found")
    mod = _build_probe(tmp_path, "ck_ipc_probe", _IPC_MODULE, extra_includes=[inc])
    n = mod.handle_bytes
    hs = [bytes([r]) * n for r in range(3)]
    mod.check(hs, 1, hs[1])  # well-formed
    with pytest.raises(ValueError, match=r"sync\(\): handle of rank 2 has 5 bytes"):
        mod.check(hs[:2] + [b"x" * 5], 1, hs[1])
    with pytest.raises(ValueError, match=r"sync\(\): entry 1 is not this rank's own handle"):
        mod.check([hs[1], hs[0], hs[2]], 1, hs[1])
    with pytest.raises(ValueError, match=r"sync\(\): expected one handle per rank, got 1 for rank 1"):
        mod.check(hs[:1], 1, hs[1])


_IPC_OPEN_MODULE = r"""
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include "commkit/ipc.hpp"
#include "commkit/python_errors.hpp"
PYBIND11_MODULE(ck_ipc_open_probe, m) {
  commkit::register_python_errors(m);
  m.def("open", [](const std::vector<pybind11::bytes>& hs, int rank) {
    std::vector<std::string> v(hs.begin(), hs.end());
    auto ptrs = commkit::open_ipc_handles(v, rank, "open_ipc_peers");
    commkit::close_ipc_handles(ptrs);
  });
}
"""


def test_open_ipc_handles_refuses_short_handles(tmp_path):
    # open_ipc_handles copies 64 bytes out of every peer entry: a shorter one must be refused before
    # that copy reads past it (and before CUDA is touched, so no GPU is needed here).
    inc = _cuda_include()
    if inc is None:
        pytest.skip("CUDA headers not found")
    libdir = os.path.join(os.path.dirname(inc), "lib64")
    if not os.path.exists(os.path.join(libdir, "libcudart.so")):
        pytest.skip("libcudart.so not found")
    mod = _build_probe(tmp_path, "ck_ipc_open_probe", _IPC_OPEN_MODULE, extra_includes=[inc],
                       link_args=[f"-L{libdir}", f"-Wl,-rpath,{libdir}", "-lcudart"])
    with pytest.raises(ValueError, match=r"open_ipc_peers: handle of rank 1 has 5 bytes, expected 64"):
        mod.open([b"\0" * 64, b"x" * 5], 0)


_IPC_HANDLE_MODULE = r"""
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include "commkit/ipc_handle.hpp"
#include "commkit/python_errors.hpp"
namespace {
const commkit::IpcHandleFormat kA{{'a', 'a', 'a', 'a', 'a', 'a', 'a', 1}, "pkg_a", "slots of", " (hint)"};
const commkit::IpcHandleFormat kB{{'b', 'b', 'b', 'b', 'b', 'b', 'b', 1}, "pkg_b", "slots of", " (hint)"};
const commkit::IpcHandleFormat& fmt(bool b) { return b ? kB : kA; }
}
PYBIND11_MODULE(ck_ipc_handle_probe, m) {
  commkit::register_python_errors(m);
  m.attr("handle_bytes") = commkit::kDescribedIpcHandleBytes;
  m.def("describe", [](bool b, int world, int rank, uint64_t layout, uint64_t alloc, std::string raw) {
    return pybind11::bytes(commkit::describe_ipc_handle(fmt(b), {world, rank, layout, alloc}, raw));
  });
  m.def("check", [](bool b, std::vector<std::string> hs, int world, int rank, uint64_t layout, uint64_t alloc) {
    pybind11::list out;
    for (auto& r : commkit::check_described_ipc_handles(fmt(b), hs, {world, rank, layout, alloc}, hs.at(rank), "sync()"))
      out.append(pybind11::bytes(r));
    return out;
  });
}
"""


def test_described_ipc_handles(tmp_path):
    # commkit/ipc_handle.hpp (host only; ipc_all2all's and elastic_ep's window handles): what must
    # match is checked before any peer is opened, and a handle of another format is refused.
    mod = _build_probe(tmp_path, "ck_ipc_handle_probe", _IPC_HANDLE_MODULE)
    raw = [bytes([r + 1]) * 64 for r in range(2)]
    hs = [mod.describe(False, 2, r, 4096, 8192, raw[r]) for r in range(2)]
    assert all(len(h) == mod.handle_bytes for h in hs)
    assert mod.check(False, hs, 2, 1, 4096, 8192) == raw
    with pytest.raises(ValueError, match=r"sync\(\): entry 0 \(96 bytes\) is not a handle .* of this pkg_b version"):
        mod.check(True, hs, 2, 1, 4096, 8192)
    with pytest.raises(ValueError, match=r"rank 0 was built with slots of 4096 bytes, this rank \(1\) with 2048 \(hint\)"):
        mod.check(False, [hs[0], mod.describe(False, 2, 1, 2048, 8192, raw[1])], 2, 1, 2048, 8192)
    with pytest.raises(ValueError, match=r"entry 0 holds the handle of rank 1"):
        mod.check(False, hs[::-1], 2, 1, 4096, 8192)
    with pytest.raises(ValueError, match="a CUDA IPC handle has 64 bytes"):
        mod.describe(False, 2, 0, 1, 1, b"short")


_GIL_MODULE = r"""
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include "commkit/gil.hpp"
#include "commkit/python_errors.hpp"
namespace py = pybind11;
PYBIND11_MODULE(ck_gil_probe, m) {
  commkit::register_python_errors(m);
  commkit::install_exit_gate();
  // (value, whether the GIL was held inside f)
  m.def("value", [] {
    bool held = true;
    const int v = commkit::without_gil([&] { held = PyGILState_Check() != 0; return 42; });
    return py::make_tuple(v, held);
  });
  m.def("move_only", [] {
    auto p = commkit::without_gil([] { return std::make_unique<std::string>("moved"); });
    return *p;
  });
  m.def("void_call", [] {
    bool held = true;
    commkit::without_gil([&] { held = PyGILState_Check() != 0; });
    return held;
  });
  m.def("gated_value", [] { return commkit::without_gil<commkit::GatedGilRelease>([] { return 7; }); });
  // The exception leaves without_gil with the GIL held again: the translator can build the Python error.
  m.def("raise_inside", [] { commkit::without_gil([]() -> int { CK_THROW_ARG("bad argument inside"); }); });
  m.def("raise_error_inside", [] { commkit::without_gil([] { CK_CHECK_RANK(false, 1, 2, "peer gone"); }); });
  m.def("held_under_guard", [] { return PyGILState_Check() != 0; }, py::call_guard<commkit::GilRelease>());
  m.def("held_under_gated_guard", [] { return PyGILState_Check() != 0; },
        py::call_guard<commkit::GatedGilRelease>());
  m.def("gate_closed", &commkit::exit_gate_closed);
  m.def("gated_acquire_held", [] {
    return commkit::without_gil([] { commkit::GatedGilAcquire gil; return gil.held() && PyGILState_Check() != 0; });
  });
  m.def("python_finalizing", &commkit::python_finalizing);
  // Blocks (GIL released) for `ms` milliseconds, asking for the GIL back every millisecond through a
  // gated acquire, as a native wait with an interrupt hook does; returns once the time is up.
  m.def("block", [](int ms) {
    commkit::GatedGilRelease nogil;
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (std::chrono::steady_clock::now() < until) {
      { commkit::GatedGilAcquire gil; }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
}
"""


@pytest.fixture(scope="module")
def gil_probe(tmp_path_factory):
    d = tmp_path_factory.mktemp("gil")
    return _build_probe(d, "ck_gil_probe", _GIL_MODULE, src_name="gil_probe.cpp"), d


def test_without_gil_releases_and_returns(gil_probe):
    mod, _ = gil_probe
    assert mod.value() == (42, False)
    assert mod.move_only() == "moved"
    assert mod.void_call() is False
    assert mod.gated_value() == 7


def test_without_gil_rethrows_with_the_gil_back(gil_probe):
    mod, _ = gil_probe
    with pytest.raises(ValueError, match="bad argument inside"):
        mod.raise_inside()
    with pytest.raises(RuntimeError, match="peer gone") as ei:
        mod.raise_error_inside()
    assert isinstance(ei.value, mod.CommError) and (ei.value.rank, ei.value.peer) == (1, 2)


def test_call_guards_release_the_gil(gil_probe):
    mod, _ = gil_probe
    assert mod.held_under_guard() is False
    assert mod.held_under_gated_guard() is False


def test_exit_gate_is_open_while_the_interpreter_runs(gil_probe):
    mod, _ = gil_probe
    assert mod.gate_closed() is False
    assert mod.python_finalizing() is False
    assert mod.gated_acquire_held() is True


def test_daemon_threads_in_gated_calls_do_not_abort_the_exit(gil_probe):
    # Daemon threads blocked in a gated native call, asking for the GIL every millisecond, while the
    # interpreter exits: they park or leave, and the process exits with its own status (CPython before
    # 3.14 would end them with pthread_exit while they wait for the GIL, which aborts the process).
    _, d = gil_probe
    code = ("import sys, threading, time\n"
            f"sys.path.insert(0, {str(d)!r})\n"
            "import ck_gil_probe as m\n"
            "for _ in range(4):\n"
            "    threading.Thread(target=m.block, args=(3000,), daemon=True).start()\n"
            "time.sleep(0.2)\n"
            "print('exiting', flush=True)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "exiting" in res.stdout
