"""Shared pytest plumbing: markers gpu / multigpu(n) / slow / smoke / fault and their skips.

* ``@pytest.mark.gpu``          needs a CUDA device and a package built with CUDA.
* ``@pytest.mark.multigpu(n)``  needs at least n CUDA devices (implies gpu).
* ``@pytest.mark.slow``         long tests; skipped when ``--skip-slow`` is given.
* ``@pytest.mark.smoke``        part of the short GPU check of every package: ``bash tools/gpu.sh OUT smoke``
                                runs the tests marked smoke and gpu or multigpu.
* ``@pytest.mark.fault``        injects a fault (the fault-injection suite: ``pytest -m "fault and not (gpu
                                or multigpu)"`` on the CPU, ``bash tools/gpu.sh OUT faults`` on the GPU);
                                each such test carries the junit property ``fault``, which
                                tools/fault_report.py counts.

``@pytest.mark.multigpu(n, shared_ok=True)`` marks a test whose ranks may share a GPU (no NCCL
communicator between them: NCCL refuses two ranks on one device). With the environment variable
``COMMKIT_TEST_SHARE_GPU=1`` such tests also run on a machine with fewer than n GPUs, their ranks
placed round-robin on the GPUs there are. Kernels of different processes on one GPU are
time-sliced, so this checks correctness (bytes, protocol, timeouts), never speed.

tools/gpu.sh sets ``COMMKIT_TEST_SHARE_GPU=1`` unless told otherwise: on a machine with enough GPUs it
changes nothing (ranks are placed round-robin on the GPUs either way), on one with fewer it runs the
``shared_ok`` tests instead of skipping them.

``COMMKIT_REQUIRE_GPU=1`` (set by tools/gpu.sh) makes a machine without a usable GPU an error
instead of a run of skips: the session stops at start-up with the reason (no device visible, or the
exception CUDA initialisation raised), and a test marked gpu or multigpu that skips for any other
reason than needing more devices than the machine has (e.g. a package built without CUDA,
``skipif(not built_with_cuda())``) fails instead. ``--skip-slow`` skips and expected failures (xfail)
stay as they are.
"""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # spawned workers re-import tests._dist and the test modules
    sys.path.insert(0, ROOT)

from tests._tools import load_tool  # noqa: E402 - needs ROOT on sys.path

# tools/env.sh, the one place of the environment settings (NVLink multicast off), for a direct pytest run
# too; the workers of tests/_dist.py get the same settings.
load_tool("_env").apply()


def pytest_addoption(parser):
    parser.addoption("--skip-slow", action="store_true", default=False, help="skip tests marked slow")


def share_gpu_enabled() -> bool:
    return os.environ.get("COMMKIT_TEST_SHARE_GPU", "0") not in ("", "0")


def require_gpu_enabled() -> bool:
    return os.environ.get("COMMKIT_REQUIRE_GPU", "0") not in ("", "0")


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def _required_gpu_count() -> int:
    """The number of CUDA devices, or pytest.UsageError naming why there is none (COMMKIT_REQUIRE_GPU=1)."""
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            torch.cuda.init()  # raises the reason CUDA is unusable, if it has one
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        raise pytest.UsageError(f"COMMKIT_REQUIRE_GPU=1 but CUDA could not be initialised: "
                                f"{type(e).__name__}: {e}") from e
    if n == 0:
        raise pytest.UsageError("COMMKIT_REQUIRE_GPU=1 but no CUDA device is visible "
                                f"(torch.cuda.is_available() is False, CUDA_VISIBLE_DEVICES="
                                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})")
    return n


_GPU_COUNT: "int | None" = None
# The reasons of the skips that stay skips under COMMKIT_REQUIRE_GPU=1, per item.
_ALLOWED_SKIP = pytest.StashKey[list]()


def pytest_configure(config):
    global _GPU_COUNT
    if require_gpu_enabled():
        _GPU_COUNT = _required_gpu_count()


def _is_gpu_test(item) -> bool:
    return item.get_closest_marker("gpu") is not None or item.get_closest_marker("multigpu") is not None


def pytest_collection_modifyitems(config, items):
    n = _GPU_COUNT if _GPU_COUNT is not None else _gpu_count()
    skip_slow = config.getoption("--skip-slow")
    for item in items:
        allowed = []
        if skip_slow and item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.skip(reason="--skip-slow"))
            allowed.append("--skip-slow")
        mg = item.get_closest_marker("multigpu")
        need = 0
        if mg is not None:
            need = int(mg.args[0]) if mg.args else 2
            if mg.kwargs.get("shared_ok") and share_gpu_enabled() and n >= 1:
                need = 1
        elif item.get_closest_marker("gpu"):
            need = 1
        if need and n < need:
            reason = f"needs {need} CUDA device(s), found {n}"
            item.add_marker(pytest.mark.skip(reason=reason))
            allowed.append(reason)
        item.stash[_ALLOWED_SKIP] = allowed
        if item.get_closest_marker("fault") is not None:
            item.user_properties.append(("fault", "1"))


def _skip_reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2])
    return str(lr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if not require_gpu_enabled() or not _is_gpu_test(item):
        return
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if any(a in reason for a in item.stash.get(_ALLOWED_SKIP, [])):
        return  # more devices needed than this machine has, or --skip-slow
    report.outcome = "failed"
    report.longrepr = (f"COMMKIT_REQUIRE_GPU=1: the GPU test {item.nodeid} skipped ({reason}); on the GPU "
                       "machine only skips for more devices than it has are allowed")
