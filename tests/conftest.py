"""Shared pytest plumbing: markers gpu / multigpu(n) / slow and their skips.

* ``@pytest.mark.gpu``          needs a CUDA device and a package built with CUDA.
* ``@pytest.mark.multigpu(n)``  needs at least n CUDA devices (implies gpu).
* ``@pytest.mark.slow``         long tests; skipped when ``--skip-slow`` is given.

``@pytest.mark.multigpu(n, shared_ok=True)`` marks a test whose ranks may share a GPU (no NCCL
communicator between them: NCCL refuses two ranks on one device). With the environment variable
``COMMKIT_TEST_SHARE_GPU=1`` such tests also run on a machine with fewer than n GPUs, their ranks
placed round-robin on the GPUs there are. Kernels of different processes on one GPU are
time-sliced, so this checks correctness (bytes, protocol, timeouts), never speed.
"""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # spawned workers re-import tests._dist and the test modules
    sys.path.insert(0, ROOT)

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)


def pytest_addoption(parser):
    parser.addoption("--skip-slow", action="store_true", default=False, help="skip tests marked slow")


def share_gpu_enabled() -> bool:
    return os.environ.get("COMMKIT_TEST_SHARE_GPU", "0") not in ("", "0")


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def pytest_collection_modifyitems(config, items):
    n = _gpu_count()
    skip_slow = config.getoption("--skip-slow")
    for item in items:
        if skip_slow and item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.skip(reason="--skip-slow"))
        mg = item.get_closest_marker("multigpu")
        need = 0
        if mg is not None:
            need = int(mg.args[0]) if mg.args else 2
            if mg.kwargs.get("shared_ok") and share_gpu_enabled() and n >= 1:
                need = 1
        elif item.get_closest_marker("gpu"):
            need = 1
        if need and n < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), found {n}"))
