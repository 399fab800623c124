"""The one multi-process launcher of the repository's tools and tests.

``run_ranks(fn, world, *args, timeout=...)`` starts ``world`` processes with the ``spawn`` start
method, each running ``fn(rank, world, rdzv, *args)``, where ``rdzv`` is a ``file://`` URL in a
private folder (the ``init_method`` of ``torch.distributed.init_process_group``; never a fixed port).
Every child gets tools/env.sh's settings (NVLink multicast off) plus ``env``. The ranks are joined
with one overall deadline; after the first failure the others get ``grace_s`` more seconds (they may
wait for the failed rank in a collective until their own timeouts); the stragglers are then killed.
``RankFailure`` carries each failed rank's traceback.

``fn`` must be importable by the children (a module-level function of an importable module, or of
the script being run); its return value travels back through a queue (plain Python values, numpy
arrays). The children import this module by name, so tools/ must be on ``sys.path`` (a script in
tools/ has it there; tests/_tools.load_tool puts it there).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from _env import settings as _env_settings


class RankFailure(RuntimeError):
    """One or more ranks failed, died or outlived the deadline (the message has each one's reason)."""


def spawn_context():
    """The multiprocessing context the ranks run in: a ``Barrier`` or ``Queue`` made from it may be
    passed to the ranks among ``args``."""
    return mp.get_context("spawn")


def parse_run(parser, argv: Optional[Sequence[str]], resolve: Callable[[Any], Any]) -> Tuple[Any, Any]:
    """``(args, resolve(args))`` of a run's command line; a ValueError of ``resolve`` (a bad option, named)
    ends the program through ``parser.error`` (exit status 2), before anything is launched."""
    args = parser.parse_args(argv)
    try:
        return args, resolve(args)
    except ValueError as exc:
        parser.error(str(exc))


def abort_on_failure(barrier, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; if it raises, ``barrier`` (a ``Barrier`` of the ranks) is aborted first, so that
    the peers waiting in it fail at once instead of at its timeout."""
    try:
        return fn(*args)
    except BaseException:
        barrier.abort()
        raise


def _child(fn, rank, world, rdzv, args, q, env):
    os.environ.update(env)
    try:
        result = fn(rank, world, rdzv, *args)
        q.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - forwarded to the parent verbatim
        q.put((rank, False, traceback.format_exc()))
        raise SystemExit(1)


def _collect(procs, q, deadline: float, expect_dead: set, grace_s: Optional[float]):
    """``(results, failures, deadline)`` once every rank not in ``expect_dead`` reported, died or the
    deadline passed."""
    results: Dict[int, Any] = {}
    failures: Dict[int, str] = {}
    pending = set(range(len(procs))) - expect_dead
    while pending and time.monotonic() < deadline:
        try:
            rank, ok, payload = q.get(timeout=0.2)
        except queue_mod.Empty:
            for r in sorted(pending):
                p = procs[r]
                if p.exitcode in (0, None):
                    continue
                try:  # the child may have posted just before it exited
                    rank, ok, payload = q.get(timeout=1.0)
                except queue_mod.Empty:
                    failures[r] = f"rank {r} died with exit code {p.exitcode}"
                    pending.discard(r)
                    if grace_s is not None:
                        deadline = min(deadline, time.monotonic() + grace_s)
                    continue
                break
            else:
                continue
        if ok:
            results[rank] = payload
        else:
            failures[rank] = payload
            if grace_s is not None:
                deadline = min(deadline, time.monotonic() + grace_s)
        pending.discard(rank)
    return results, failures, pending


def _stop(procs, deadline: float) -> None:
    for p in procs:
        p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0,
              rdzv_dir: Optional[str] = None, env: Optional[dict] = None, expect_dead: Iterable[int] = (),
              grace_s: Optional[float] = None) -> List[Any]:
    """Run ``fn(rank, world, rdzv, *args)`` on ``world`` spawned processes; see the module docstring.

    Arguments:
        fn: module-level function; its return value is the rank's result.
        world: number of processes (>= 1).
        timeout: seconds for the whole group; stragglers are killed and reported.
        rdzv_dir: folder of the rendezvous file (e.g. a test's ``tmp_path``); default: a private
            temporary folder, removed afterwards.
        env: environment variables for the children, on top of tools/env.sh's.
        expect_dead: ranks expected to die (e.g. killed on purpose); their exit is no failure.
        grace_s: seconds the other ranks get after the first failure (None: until ``timeout``).

    Returns:
        The results, indexed by rank (None for a rank of ``expect_dead`` that reported nothing).

    Raises:
        ValueError: ``world`` or ``timeout`` out of range.
        RankFailure: a rank raised (its traceback), died, or did not finish in time.
    """
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world: expected a positive int, got {world!r}")
    if not timeout > 0:
        raise ValueError(f"timeout: expected > 0 seconds, got {timeout!r}")
    ctx = spawn_context()
    q = ctx.Queue()
    child_env = dict(_env_settings())
    child_env.update(env or {})
    with contextlib.ExitStack() as stack:
        folder = rdzv_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="ranks_"))
        rdzv = "file://" + os.path.join(str(folder), f"rdzv_{os.getpid()}_{time.monotonic_ns()}")
        procs = [ctx.Process(target=_child, args=(fn, r, world, rdzv, args, q, child_env), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            results, failures, hung = _collect(procs, q, deadline, set(expect_dead), grace_s)
        finally:
            _stop(procs, deadline)
    for r in sorted(hung):
        failures[r] = f"rank {r} did not finish within {timeout:.0f} s (or after another rank failed): killed"
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
        raise RankFailure(f"{len(failures)} of {world} ranks failed:\n{text}")
    return [results.get(r) for r in range(world)]
