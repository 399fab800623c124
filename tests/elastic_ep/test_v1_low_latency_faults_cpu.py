"""Low-latency mode's faults on the torch backend (gloo, CPU ranks): the rows of the README's "What
happens when …" table that this backend shares with the native runtime.

* A rank refuses its call with a bad argument (``ValueError`` before anything is exchanged), or never
  makes it: the peers that made it wait in the exchange of the per-rank counts and raise ``TimeoutError``
  naming the call (``low_latency_dispatch`` / ``low_latency_combine``) and their rank after
  ``num_cpu_timeout_secs``, never a hang. The torch backend cannot name the peer (the collective does
  not say who is missing); the native runtime's ``CommTimeoutError`` does
  (``test_v1_low_latency_faults_gpu``).

The other rows (a peer's other arguments, corrupted words, calls out of step) are about words the native
kernels read from a peer's writes; the torch backend exchanges no such words (its collectives carry the
rows themselves), so they are tested on the GPU only. Shrink mode's masks are in ``test_v1_low_latency_cpu``.

DeepEP V1's ``Buffer`` takes no CPU deadline, so the workers shorten the runtime's (300 s by default).
The helpers here are also the GPU test's.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import pytest
import torch

from tests._dist import run_workers
from tests.elastic_ep.test_v1_low_latency_cpu import Checks, Ctx, Round, ep, one_round

pytestmark = pytest.mark.fault

WORLD = 2
CPU_DEADLINE_S = 2
IDLE_S = CPU_DEADLINE_S + 5  # the absent rank's sleep: its peer's deadline passes first


def caught(fn: Callable[[], Any]) -> Optional[Exception]:
    """The exception ``fn()`` raises, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the caller checks its type
        return e
    return None


def expect(ck: Checks, err: Optional[Exception], typ: type, *phrases: str) -> None:
    """``err`` is exactly a ``typ`` whose message holds every phrase."""
    ck(type(err) is typ, f"expected {typ.__name__}, got {type(err).__name__}: {err}")
    for p in phrases:
        ck(p in str(err), f"{p!r} not in the {type(err).__name__}: {err}")


def refuse(ck: Checks, buf, r: Round, op: str, res: Any) -> None:
    """This rank's ``op`` with one bad argument: ``ValueError`` naming it, raised before anything runs
    (dispatch: one token more than ``num_max_dispatch_tokens_per_rank``; combine: ``out`` of another
    shape)."""
    c = r.c
    if op == "dispatch":
        x = torch.zeros((c.M + 1, c.H), dtype=torch.bfloat16, device=c.device)
        idx = torch.full((c.M + 1, c.K), -1, dtype=torch.int64, device=c.device)
        err = caught(lambda: buf.low_latency_dispatch(x, idx, c.M, c.E, use_fp8=False))
        expect(ck, err, ValueError, f"x: {c.M + 1} tokens exceed num_max_dispatch_tokens_per_rank={c.M}")
    else:
        out = torch.empty((r.x.shape[0], c.H + 128), dtype=torch.bfloat16, device=c.device)
        err = caught(lambda: buf.low_latency_combine(res[0], r.idx, r.w, res[2], out=out))
        expect(ck, err, ValueError, "out: expected shape")


def call(buf, r: Round, op: str, res: Any) -> None:
    """``op`` with good arguments (combine: of the dispatch result ``res``)."""
    if op == "dispatch":
        buf.low_latency_dispatch(r.x, r.idx, r.c.M, r.c.E, use_fp8=False)
    else:
        buf.low_latency_combine(res[0], r.idx, r.w, res[2])


# ------------------------------------------------------------------------------------------ torch backend
def absent_worker(rank: int, world: int, rdzv: str, how: str, op: str):
    """A whole round on both ranks, then rank 1 refuses ``op`` (``how == "refuses"``) or skips it, and
    sleeps past the deadline; rank 0 makes the call and must raise ``TimeoutError`` naming it."""
    from tests._dist import init_gloo

    group = init_gloo(rank, world, rdzv)
    c = Ctx(rank, world, group, dict(backend="torch", window="auto"), torch.device("cpu"))
    ck = Checks(rank, f"rank 1 {how} its {op}")
    buf = ep.Buffer(group, 0, c.hint, low_latency_mode=True, backend="torch")
    buf.runtime.runtime.num_cpu_timeout_secs = CPU_DEADLINE_S
    r = Round(c, 800, "bf16")
    one_round(ck, buf, r, "sync", "plain", label="both ranks: ")
    ck.where = f"rank 1 {how} its {op}"
    res = buf.low_latency_dispatch(r.x, r.idx, c.M, c.E, use_fp8=False) if op == "combine" else None
    if rank == 1:
        if how == "refuses":
            refuse(ck, buf, r, op, res)
        time.sleep(IDLE_S)  # joins no collective of rank 0's any more
        return ck.count, ck.failures
    t0 = time.monotonic()
    err = caught(lambda: call(buf, r, op, res))
    waited = time.monotonic() - t0
    expect(ck, err, TimeoutError, f"elastic_ep low_latency_{op} (exchanging the per-rank counts) timed out on rank 0 "
           f"of 2 after {CPU_DEADLINE_S} s", "a peer did not join")
    ck(CPU_DEADLINE_S * 0.8 <= waited < IDLE_S, f"raised {waited:.1f} s after the call, deadline {CPU_DEADLINE_S} s")
    return ck.count, ck.failures


def assert_checks(results) -> None:
    """Every rank made checks and none failed."""
    assert all(n > 0 for n, _ in results), f"a rank made no checks: {results}"
    failures = [f for _, fs in results for f in fs]
    assert not failures, f"{len(failures)} failed checks:\n  " + "\n  ".join(failures[:40])


@pytest.mark.parametrize("how,op", [("refuses", "dispatch"), ("refuses", "combine"), ("skips", "combine")])
def test_ll_torch_peer_of_a_refused_or_absent_call_times_out(tmp_path, how, op):
    assert_checks(run_workers(absent_worker, WORLD, how, op, tmp_path=tmp_path, timeout=90))
