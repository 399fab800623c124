"""Multi-process test launcher shared by every package's test suite (over tools/_launch.py, the
launcher of the tools, so that tests and tools spawn ranks the same way).

``run_workers(fn, world_size, *args, tmp_path=..., timeout=...)`` starts ``world_size`` processes
with the ``spawn`` start method, each running ``fn(rank, world_size, rdzv, *args)`` where ``rdzv``
is a ``file://`` URL under the test's temporary folder (use it as ``init_method`` of
``torch.distributed.init_process_group``; never a fixed port). It joins every process with one
overall deadline, kills the stragglers, and raises ``WorkerFailure`` carrying each failed rank's
traceback, so a hang fails the test instead of the CI run. Every child runs with tools/env.sh's
settings (NVLink multicast off), ``env=`` on top.

``fn`` must be importable by the child (a module-level function of an importable test module).
Return values travel back through a queue and are returned as a list indexed by rank.
"""
from __future__ import annotations

import pathlib
from typing import Any, Callable, List, Optional

from tests._tools import load_tool

_launch = load_tool("_launch")  # also puts tools/ on sys.path, where the spawned ranks import it from


class WorkerFailure(AssertionError):
    """One or more worker processes failed, hung or died."""


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    tmp_path: pathlib.Path,
    timeout: float = 120.0,
    env: Optional[dict] = None,
    expect_dead: Optional[set] = None,
) -> List[Any]:
    """Run ``fn`` on ``world_size`` spawned processes; see the module docstring.

    Arguments:
        fn: module-level function ``fn(rank, world_size, rdzv_url, *args)``.
        world_size: number of processes.
        tmp_path: a per-test temporary folder (pytest's ``tmp_path``); the rendezvous file lives there.
        timeout: seconds for the whole group; stragglers are killed and the test fails.
        env: extra environment variables for the children.
        expect_dead: ranks that are expected to die (e.g. killed by the test); their exit is not an error.

    Returns:
        The list of return values, indexed by rank (None for ranks in ``expect_dead``).

    Raises:
        WorkerFailure: a rank failed, died or did not finish within ``timeout``.
    """
    try:
        return _launch.run_ranks(fn, world_size, *args, timeout=timeout, rdzv_dir=str(tmp_path), env=env,
                                 expect_dead=expect_dead or ())
    except _launch.RankFailure as e:
        raise WorkerFailure(str(e)) from None


def init_gloo(rank: int, world_size: int, rdzv: str, timeout_s: float = 60.0):
    """Initialise a gloo process group through the file rendezvous (CPU tests)."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=rdzv, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.group.WORLD


def init_nccl(rank: int, world_size: int, rdzv: str, timeout_s: float = 120.0, device: Optional[int] = None):
    """Initialise an NCCL process group (one GPU per rank unless ``device`` says otherwise)."""
    import datetime

    import torch
    import torch.distributed as dist

    dev = rank % torch.cuda.device_count() if device is None else device
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl", init_method=rdzv, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s), device_id=torch.device("cuda", dev),
    )
    return dist.group.WORLD


def init_gpu_group(rank: int, world_size: int, rdzv: str, device: Optional[int] = None, timeout_s: float = 120.0):
    """Bind this rank to a GPU and initialise the process group its test talks over.

    One rank per GPU gets NCCL. When ranks share a GPU (``COMMKIT_TEST_SHARE_GPU=1`` on a machine
    with fewer GPUs than ranks) NCCL refuses the duplicate device, so the group is gloo and tests
    move reference data through :func:`all_to_all_single` / :func:`all_gather_into_tensor` below,
    which go through host memory in that case.

    Returns:
        The ``torch.device`` this rank uses.
    """
    import torch

    n = torch.cuda.device_count()
    dev = rank % n if device is None else device
    if world_size <= n:
        init_nccl(rank, world_size, rdzv, timeout_s=timeout_s, device=dev)
    else:
        torch.cuda.set_device(dev)
        init_gloo(rank, world_size, rdzv, timeout_s=timeout_s)
    return torch.device("cuda", dev)


def _via_host() -> bool:
    import torch.distributed as dist

    return dist.get_backend() == "gloo"


def all_to_all_single(out, inp, out_splits, in_splits) -> None:
    """``dist.all_to_all_single`` on the default group, for GPU tensors over NCCL or gloo."""
    import torch.distributed as dist

    if not _via_host():
        dist.all_to_all_single(out, inp, out_splits, in_splits)
        return
    host_out = out.new_empty(out.shape, device="cpu")
    dist.all_to_all_single(host_out, inp.cpu(), out_splits, in_splits)
    out.copy_(host_out)


def all_gather_into_tensor(out, inp) -> None:
    """``dist.all_gather_into_tensor`` (concatenated along dim 0) for GPU tensors over NCCL or gloo."""
    import torch
    import torch.distributed as dist

    if not _via_host():
        dist.all_gather_into_tensor(out, inp)
        return
    parts = [torch.empty_like(inp, device="cpu") for _ in range(dist.get_world_size())]
    dist.all_gather(parts, inp.cpu())
    out.copy_(torch.cat(parts, dim=0))
