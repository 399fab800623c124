"""Cheap packaging checks of the three distributions (the full sdist -> wheel -> venv run is
``tools/check_dist.sh``):

* each package's ``__version__`` equals its pyproject.toml version;
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


def _pyproject_version(pkg: str) -> str:
    with open(os.path.join(ROOT, "packages", pkg, "pyproject.toml")) as f:
        return re.search(r'^version = "([^"]+)"$', f.read(), re.M).group(1)


@pytest.mark.parametrize("pkg", PKGS)
def test_version_matches_pyproject(pkg):
    with open(os.path.join(ROOT, "packages", pkg, "src", pkg, "__init__.py")) as f:
        m = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M)
    assert m, f"packages/{pkg}/src/{pkg}/__init__.py defines no __version__"
    assert m.group(1) == _pyproject_version(pkg)


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


def test_elastic_ep_refuses_older_runtime_nccl(tmp_path):
    if importlib.util.find_spec("elastic_ep") is None:
        pytest.skip("elastic_ep is not installed")
    code = ("import elastic_ep._C as c\n"
            "if not c.built_with_cuda(): raise SystemExit(3)\n"
            "c.nccl_version = lambda: c.nccl_build_version() - 1\n"
            "try:\n import elastic_ep._low_level\nexcept ImportError as e: print(e)\nelse: raise SystemExit(4)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=NO_GPU, capture_output=True, text=True,
                         timeout=120)
    if res.returncode == 3:
        pytest.skip("elastic_ep was built without CUDA")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "was built against NCCL" in res.stdout and "older" in res.stdout


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
