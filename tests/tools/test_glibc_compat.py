"""The release build's link for an older glibc (common/cmake/CommkitGlibcCompat.cmake, COMMKIT_MANYLINUX):
the stub glibc libraries, a small shared object linked through the CMake module (what it needs, that it
loads and runs here, the fallbacks of commkit_glibc_compat.cpp on their glibc-2.28 path), the check after
the link, and a package configuring with the option."""
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests._tools import ROOT, load_tool

CMAKE_DIR = os.path.join(ROOT, "common", "cmake")
SCRIPT = os.path.join(CMAKE_DIR, "commkit_glibc_compat.py")
wc = load_tool("wheelcheck")
P228 = next(p for p in wc.POLICIES if p[0] == "manylinux_2_28")

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.uname().machine != "x86_64"
    or not all(shutil.which(t) for t in ("g++", "readelf", "objdump")),
    reason="x86-64 Linux with g++ and binutils")


def _compat():
    spec = importlib.util.spec_from_file_location("commkit_glibc_compat", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _dynsyms(path):
    """{name: version} of the symbols ``path`` defines (each stub symbol has exactly one version)."""
    out = {}
    for line in subprocess.run(["readelf", "--dyn-syms", "-W", path], check=True, capture_output=True,
                               text=True).stdout.splitlines():
        m = re.match(r"^\s*\d+:\s+\S+\s+\S+\s+\w+\s+\w+\s+\w+\s+(\w+)\s+(\S+?)(@@?)(\S+)", line)
        if m and m.group(1) not in ("UND", "ABS"):
            name, at, ver = m.group(2), m.group(3), m.group(4)
            assert at == "@@", f"{path}: {name}@{ver} is not the default version"
            assert name not in out, f"{path}: {name} has two versions"
            out[name] = ver
    return out


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    out = tmp_path_factory.mktemp("stubs")
    subprocess.run([sys.executable, SCRIPT, "stubs", "--glibc", "2.28", "--cxx", "g++", "--out", str(out)],
                   check=True, capture_output=True, text=True)
    return str(out)


def test_stubs_hold_only_glibc_228_versions_in_228_places(stubs):
    compat = _compat()
    syms = {}
    for soname in ("libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "ld-linux-x86-64.so.2"):
        path = os.path.join(stubs, soname)
        dyn = subprocess.run(["readelf", "-d", path], check=True, capture_output=True, text=True).stdout
        assert f"Library soname: [{soname}]" in dyn
        syms[soname] = _dynsyms(path)
        for name, ver in syms[soname].items():
            assert compat.glibc_version(ver) <= (2, 28), f"{soname}: {name}@{ver}"
        # What the dynamic loader checks a version need against: the library of that name on this machine
        # (on glibc >= 2.34 libpthread, libdl and librt are shells that keep the old version nodes).
        real = compat.version_definitions(compat.find_library("g++", soname))
        assert set(syms[soname].values()) <= real, (soname, set(syms[soname].values()) - real)
    libc, pthread, dl, rt = (syms[s] for s in ("libc.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1"))
    # glibc 2.34 moved these into libc.so.6 (GLIBC_2.34); on glibc 2.28 they live in their own libraries.
    assert pthread["pthread_create"] == "GLIBC_2.2.5" and "pthread_create" not in libc
    assert pthread["sem_timedwait"] == "GLIBC_2.2.5" and "sem_timedwait" not in libc
    assert dl["dlopen"] == "GLIBC_2.2.5" and dl["dlmopen"] == "GLIBC_2.3.4" and "dlopen" not in libc
    assert rt["shm_open"] == "GLIBC_2.2.5" and rt["timer_create"] == "GLIBC_2.3.3" and "shm_open" not in libc
    # Always in libc, with its newest version <= 2.28.
    assert libc["memcpy"] == "GLIBC_2.14" and libc["pthread_mutex_lock"] == "GLIBC_2.2.5"
    assert libc["__xstat"] == "GLIBC_2.2.5" and libc["statx"] == "GLIBC_2.28"
    # Newer than 2.28: not there (commkit_glibc_compat.cpp's fallbacks, or the check, take over).
    for newer in ("stat", "fstat64", "__libc_single_threaded", "arc4random", "gettid", "pthread_cond_clockwait"):
        assert all(newer not in s for s in syms.values()), newer
    for short in ("c", "m", "pthread", "dl", "rt"):
        assert stubs in open(os.path.join(stubs, f"lib{short}.so")).read()


DEMO = r"""
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

using namespace std::chrono;
static timespec monotonic_in(int ms) {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  t.tv_nsec += ms * 1000000L;
  t.tv_sec += t.tv_nsec / 1000000000L;
  t.tv_nsec %= 1000000000L;
  return t;
}
static void* add_one(void* p) { ++*static_cast<int*>(p); return nullptr; }

// 0 when everything works, else the number of the step that failed.
extern "C" __attribute__((visibility("default"))) int commkit_compat_demo(const char* shm_name) {
  int n = 0;
  pthread_t th;
  if (pthread_create(&th, nullptr, add_one, &n) != 0 || pthread_join(th, nullptr) != 0 || n != 1) return 1;
  std::mutex m;
  std::condition_variable cv;
  bool ready = false;
  std::thread t([&] { std::lock_guard<std::mutex> g(m); ready = true; cv.notify_one(); });
  {
    std::unique_lock<std::mutex> l(m);
    if (!cv.wait_until(l, steady_clock::now() + seconds(10), [&] { return ready; })) return 2;
    auto t0 = steady_clock::now();  // steady-clock timeout: pthread_cond_clockwait
    if (cv.wait_until(l, t0 + milliseconds(20)) != std::cv_status::timeout) return 3;
    if (steady_clock::now() - t0 < milliseconds(19)) return 4;
  }
  t.join();
  std::timed_mutex tm;  // pthread_mutex_clocklock
  std::shared_timed_mutex sm;  // pthread_rwlock_clockrdlock / clockwrlock
  tm.lock();
  sm.lock();
  bool got_tm = true, got_sm = true, got_smw = true;
  std::thread t2([&] {
    got_tm = tm.try_lock_until(steady_clock::now() + milliseconds(10));
    got_sm = sm.try_lock_shared_until(steady_clock::now() + milliseconds(10));
    got_smw = sm.try_lock_until(steady_clock::now() + milliseconds(10));
  });
  t2.join();
  tm.unlock();
  sm.unlock();
  if (got_tm || got_sm || got_smw) return 5;
  pthread_mutex_t pm = PTHREAD_MUTEX_INITIALIZER;
  pthread_cond_t pc = PTHREAD_COND_INITIALIZER;
  pthread_mutex_lock(&pm);
  timespec d = monotonic_in(10);
  int rc = pthread_cond_clockwait(&pc, &pm, CLOCK_MONOTONIC, &d);
  pthread_mutex_unlock(&pm);
  if (rc != ETIMEDOUT) return 6;
  sem_t sem;
  sem_init(&sem, 0, 0);
  d = monotonic_in(10);
  if (sem_clockwait(&sem, CLOCK_MONOTONIC, &d) != -1 || errno != ETIMEDOUT) return 7;
  sem_post(&sem);
  if (sem_trywait(&sem) != 0) return 8;
  sem_destroy(&sem);
  void* h = dlopen("libm.so.6", RTLD_NOW);
  if (!h) return 9;
  auto cosine = reinterpret_cast<double (*)(double)>(dlsym(h, "cos"));
  if (!cosine || cosine(0.0) != 1.0) return 10;
  dlclose(h);
  int fd = shm_open(shm_name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return 11;
  struct stat st;
  bool ok = ftruncate(fd, 4096) == 0 && fstat(fd, &st) == 0 && st.st_size == 4096;
  close(fd);
  shm_unlink(shm_name);
  if (!ok) return 12;
  if (stat("/proc/self", &st) != 0 || !S_ISDIR(st.st_mode) || lstat("/proc/self", &st) != 0) return 13;
  if (arc4random() == 0 && arc4random() == 0 && arc4random() == 0) return 14;
  try {
    throw std::runtime_error(std::string("thrown ") + std::to_string(n));
  } catch (const std::exception& e) {
    if (std::string(e.what()) != "thrown 1") return 15;
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """Two shared objects from DEMO linked through CommkitGlibcCompat.cmake: the fallbacks as on glibc
    >= 2.30 (they call the real clock waits) and as on 2.28 (their lookup forced to fail)."""
    if shutil.which("cmake") is None:
        pytest.skip("needs cmake")
    src = tmp_path_factory.mktemp("demo")
    (src / "demo.cpp").write_text(DEMO)
    (src / "CMakeLists.txt").write_text(textwrap.dedent(f"""\
        cmake_minimum_required(VERSION 3.25)
        project(compat_demo LANGUAGES CXX)
        include("{CMAKE_DIR}/CommkitGlibcCompat.cmake")
        commkit_glibc_compat_setup()
        foreach(t demo demo_228)
          add_library(${{t}} SHARED demo.cpp)
          set_target_properties(${{t}} PROPERTIES CXX_STANDARD 17 CXX_VISIBILITY_PRESET hidden)
          commkit_glibc_compat(${{t}})
        endforeach()
        target_compile_definitions(demo_228 PRIVATE COMMKIT_GLIBC_COMPAT_FALLBACK)
        """))
    build = src / "build"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMKIT_")}
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cfg = subprocess.run(["cmake", *gen, "-S", str(src), "-B", str(build), "-DCOMMKIT_MANYLINUX=2_28",
                          f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert cfg.returncode == 0, (cfg.stdout + cfg.stderr)[-3000:]
    assert "stub glibc, static libstdc++" in cfg.stdout, cfg.stdout
    res = subprocess.run(["cmake", "--build", str(build), "-j", "2"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    return {t: str(build / f"lib{t}.so") for t in ("demo", "demo_228")}


@pytest.mark.parametrize("which", ["demo", "demo_228"])
def test_a_shared_object_linked_for_228_needs_only_228_and_runs_here(demo, which, tmp_path):
    lib = demo[which]
    needed, rpaths, versions = wc.elf_facts(lib)
    assert wc.policy_excess(versions, P228) == [], versions
    assert set(needed) <= wc.SYSTEM_LIBS and "libstdc++.so.6" not in needed, needed
    # As on glibc 2.28: pthread_create from libpthread, dlopen from libdl, shm_open from librt.
    assert {"libpthread.so.0", "libdl.so.2", "librt.so.1"} <= set(versions), versions
    assert not any(v.startswith(("GLIBCXX", "CXXABI")) for vs in versions.values() for v in vs)
    assert re.match(r"^GLIBC_2\.\d+, .*no libstdc\+\+ version$", wc.highest_versions(versions)), versions
    assert subprocess.run([sys.executable, SCRIPT, "check", "--glibc", "2.28", lib]).returncode == 0
    # Only the demo's own function is exported (libstdc++.a's symbols stay inside).
    exported = [ln for ln in subprocess.run(["objdump", "-T", lib], capture_output=True, text=True).stdout.splitlines()
                if " g " in ln and "*UND*" not in ln and " DF " in ln]
    assert any(ln.endswith(" commkit_compat_demo") for ln in exported), exported
    assert not any("_ZNSt" in ln or "pthread_cond_clockwait" in ln for ln in exported), exported
    # demo calls the real clock waits through dlvsym; demo_228 takes the fallbacks, as on glibc 2.28.
    undefined = subprocess.run(["objdump", "-T", lib], capture_output=True, text=True).stdout
    assert (" dlvsym" in undefined) == (which == "demo")
    # Loaded and run in a fresh interpreter on this (newer) glibc.
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
            "sys.exit(lib.commkit_compat_demo(sys.argv[2].encode()))")
    run = subprocess.run([sys.executable, "-c", code, lib, f"/ck_compat_{os.getpid()}_{which}"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"step {run.returncode} failed: {run.stderr[-2000:]}"


def test_the_check_names_a_glibc_function_newer_than_the_target(stubs, tmp_path):
    # gettid is glibc 2.30: against the stubs the reference stays undefined and unversioned (a shared
    # object may link so), and the wheel's version needs alone would not show it.
    src = tmp_path / "new.cpp"
    src.write_text("#include <unistd.h>\nextern \"C\" int tid() { return (int)gettid(); }\n")
    lib = tmp_path / "libnew.so"
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(lib), str(src), f"-L{stubs}", "-static-libstdc++"],
                   check=True)
    _, _, versions = wc.elf_facts(str(lib))
    assert wc.policy_excess(versions, P228) == []
    res = subprocess.run([sys.executable, SCRIPT, "check", "--glibc", "2.28", str(lib)], capture_output=True,
                         text=True)
    assert res.returncode == 1 and "gettid: a glibc symbol without a version <= 2.28" in res.stderr, res.stderr
    # Built plainly, the same object needs GLIBC_2.30 and the check says so.
    plain = tmp_path / "libplain.so"
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(plain), str(src)], check=True)
    res = subprocess.run([sys.executable, SCRIPT, "check", "--glibc", "2.28", str(plain)], capture_output=True,
                         text=True)
    assert res.returncode == 1 and "gettid@GLIBC_2.30: newer than GLIBC_2.28" in res.stderr, res.stderr


def test_a_package_configures_for_manylinux_228(tmp_path):
    cmake = shutil.which("cmake")
    if cmake is None or importlib.util.find_spec("pybind11") is None:
        pytest.skip("needs cmake and pybind11")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMKIT_", "CUDAARCHS"))}
    env["COMMKIT_MANYLINUX"] = "2_28"  # as tools/release.sh exports it
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    res = subprocess.run([cmake, *gen, "-S", os.path.join(ROOT, "packages", "fp8_layerwise"), "-B", str(tmp_path / "b"),
                          f"-DPython_EXECUTABLE={sys.executable}", "-DCOMMKIT_BUILD_CUDA=OFF"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert "extensions for glibc >= 2.28 (manylinux_2_28)" in res.stdout, res.stdout
    assert os.path.exists(tmp_path / "b" / "commkit_glibc_2_28" / "libpthread.so.0")
    flags = "".join(open(p).read() for p in glob.glob(str(tmp_path / "b" / "**" / "*"), recursive=True)
                    if p.endswith(("build.ninja", "link.txt", "build.make")))
    assert "-static-libstdc++" in flags and "commkit_glibc_2_28" in flags and "commkit_glibc_compat.py" in flags
    # Without the option nothing changes.
    env.pop("COMMKIT_MANYLINUX")
    res = subprocess.run([cmake, *gen, "-S", os.path.join(ROOT, "packages", "fp8_layerwise"), "-B", str(tmp_path / "c"),
                          f"-DPython_EXECUTABLE={sys.executable}", "-DCOMMKIT_BUILD_CUDA=OFF"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "stub glibc" not in res.stdout, (res.stdout + res.stderr)[-3000:]
    assert not os.path.exists(tmp_path / "c" / "commkit_glibc_2_28")
