"""Cheap packaging checks of the three distributions (the full sdist -> wheel -> venv run is
``tools/check_dist.sh``):

* each package's version is stated once, in ``__init__.py`` (pyproject.toml reads it);
* each sdist carries ``common/`` (headers and CMake);
* each installed package imports without a GPU;
* elastic_ep's build stops with a clear error on an NCCL without the device-API headers, and its
  low-level module refuses a runtime NCCL older than the build's.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKGS = ["elastic_ep", "ipc_all2all", "fp8_layerwise"]
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize("pkg", PKGS)
def test_version_is_single_sourced(pkg):
    # The version lives in __init__.py only; pyproject.toml reads it (scikit-build-core's regex provider).
    with open(os.path.join(ROOT, "packages", pkg, "pyproject.toml")) as f:
        pyproject = f.read()
    assert not re.search(r"^version = ", pyproject, re.M), "pyproject.toml states a version of its own"
    assert re.search(r'^dynamic = \["version"\]$', pyproject, re.M)
    assert f'input = "src/{pkg}/__init__.py"' in pyproject
    with open(os.path.join(ROOT, "packages", pkg, "src", pkg, "__init__.py")) as f:
        assert re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M), f"{pkg}/__init__.py defines no __version__"


def _is_module(name: str) -> bool:
    """True for an importable regular module. A bare directory of that name on sys.path (the repo's own
    build/ folder of logs) is a namespace package to find_spec, and `python -m build` then fails."""
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


@pytest.mark.parametrize("pkg", PKGS)
def test_sdist_carries_common(pkg, tmp_path):
    if not _is_module("build") or not _is_module("scikit_build_core"):
        pytest.skip("needs the build and scikit-build-core modules")
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path),
                    os.path.join(ROOT, "packages", pkg)], check=True, capture_output=True)
    (sdist,) = tmp_path.glob("*.tar.gz")
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    assert {"common/include/commkit/check.hpp", "common/cmake/CommkitDeps.cmake", "common/CMakeLists.txt",
            f"src/{pkg}/__init__.py", "CMakeLists.txt"} <= names


def test_installed_packages_import_without_gpu(tmp_path):
    pkgs = [p for p in PKGS if importlib.util.find_spec(p) is not None]
    if not pkgs:
        pytest.skip("none of the packages is installed")
    code = "import torch; assert not torch.cuda.is_available()\n" + "".join(f"import {p}\n" for p in pkgs)
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=NO_GPU, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr


def _import_low_level_with_nccl(tmp_path, version_expr: str):
    """Imports elastic_ep._low_level in a fresh process whose _C reports the loaded NCCL as
    ``version_expr`` (a Python expression over ``c``); prints the ImportError or "ok"."""
    code = ("import elastic_ep._C as c\n"
            "if not c.built_with_cuda(): raise SystemExit(3)\n"
            f"c.nccl_version = lambda: {version_expr}\n"
            "try:\n import elastic_ep._low_level\nexcept ImportError as e: print(e)\nelse: print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=NO_GPU, capture_output=True, text=True,
                         timeout=120)
    if res.returncode == 3:
        pytest.skip("elastic_ep was built without CUDA")
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.strip()


def test_elastic_ep_nccl_range_at_import(tmp_path):
    # The floor (2.28.9, torch 2.11's NCCL) and anything newer load; an older library is refused by name.
    if importlib.util.find_spec("elastic_ep") is None:
        pytest.skip("elastic_ep is not installed")
    out = _import_low_level_with_nccl(tmp_path, "22808")
    assert "needs NCCL >= 2.28.9" in out and "2.28.8" in out, out
    assert _import_low_level_with_nccl(tmp_path, "c.nccl_build_version() + 100") == "ok"
    from elastic_ep import _C
    if _C.nccl_build_version() >= 22900:
        # Headers with the versioned device-API structures, library 2.28.x: LSA through 2.28.x's layout.
        assert _import_low_level_with_nccl(tmp_path, "22809") == "ok"
        assert (_C.devcomm_abi(22809, False), _C.devcomm_abi(22809, True)) == ("legacy_lsa_only", "unsupported")
        assert _C.devcomm_abi(_C.nccl_build_version(), True) == "same" == _C.devcomm_abi(23203, False)
    else:
        assert "rebuild elastic_ep against NCCL >= 2.29 headers" in _import_low_level_with_nccl(tmp_path, "22900")
        assert _C.devcomm_abi(22900, False) == "unsupported" and _C.devcomm_abi(22809, True) == "same"


def test_elastic_ep_links_no_nccl_function_newer_than_the_floor():
    # A build against newer headers must load with NCCL 2.28.9: every libnccl function the extension
    # links is one that release exports (data/nccl_2.28.9_exports.txt: `nm -D --defined-only` of torch
    # 2.11's libnccl.so.2); newer ones are looked up at run time.
    spec = importlib.util.find_spec("elastic_ep._C")
    nm = shutil.which("nm")
    if spec is None or nm is None:
        pytest.skip("needs the installed elastic_ep extension and nm")
    res = subprocess.run([nm, "-D", "--undefined-only", spec.origin], capture_output=True, text=True, timeout=60)
    used = {line.split()[-1] for line in res.stdout.splitlines() if line.split()[-1].startswith("nccl")}
    if not used:
        pytest.skip("elastic_ep was built without CUDA (links no NCCL)")
    floor = set(open(os.path.join(ROOT, "tests", "elastic_ep", "data", "nccl_2.28.9_exports.txt")).read().split())
    assert "ncclDevCommCreate" in used and "ncclCommWindowRegister" in used
    assert used <= floor, f"linked NCCL functions 2.28.9 does not export: {sorted(used - floor)}"


def test_elastic_ep_build_needs_nccl_device_api(tmp_path):
    cmake = shutil.which("cmake")
    nccl = importlib.util.find_spec("nvidia.nccl")
    if cmake is None or nccl is None or importlib.util.find_spec("torch") is None:
        pytest.skip("needs cmake, torch and the nvidia-nccl wheel")
    real = list(nccl.submodule_search_locations)[0]
    fake = tmp_path / "nccl"  # nccl.h and the library, but no nccl_device.h
    (fake / "include").mkdir(parents=True)
    shutil.copy(os.path.join(real, "include", "nccl.h"), fake / "include")
    os.symlink(os.path.join(real, "lib"), fake / "lib")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    res = subprocess.run([cmake, *gen, "-S", os.path.join(ROOT, "packages", "elastic_ep"), "-B", str(tmp_path / "b"),
                          f"-DPython_EXECUTABLE={sys.executable}", f"-DNCCL_HOME={fake}", "-DCOMMKIT_BUILD_CUDA=OFF"],
                         capture_output=True, text=True, timeout=120)
    out = " ".join((res.stdout + res.stderr).split())
    assert res.returncode != 0
    assert "nccl_device.h" in out and "2.28.9" in out, out
