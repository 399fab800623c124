"""destroy() always has a deadline, also for an instance whose operations wait forever
(``timeout_seconds=0``), and a collective destroy() never waits through the process group.

Before, a collective destroy() ran ``torch.cuda.synchronize()`` (no deadline: a kernel waiting forever
for a dead peer held it for ever) and ``dist.barrier()`` (a peer that never calls destroy() held it
for the group's timeout, and with NCCL the barrier's own kernel waited on the device). Now the native
core does both waits with destroy()'s deadline (csrc/teardown.cpp: the device, then every peer's
arrival word in its buffer; tests/ipc_all2all/test_peer_death_gpu.py runs them on a GPU); here the
Python layer's part, without a GPU.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import ipc_all2all
from tests.ipc_all2all._stand_ins import RecordingCore, instance_over


def _instance(timeout_seconds=10.0, collective=True):
    core = RecordingCore(4096, torch.zeros(16, dtype=torch.uint8))
    core.opened, core.timeout_seconds = True, timeout_seconds
    return instance_over(core, None, _collective=collective, comm_id=-5), core


@pytest.mark.parametrize("instance_timeout, given, bound", [
    (0.0, None, 30.0),     # the operations wait forever; destroy() does not
    (10.0, None, 30.0),
    (100.0, None, 100.0),  # never shorter than what the operations allow a late peer
    (0.0, 2.5, 2.5),
])
def test_destroy_passes_a_positive_deadline_to_every_wait(instance_timeout, given, bound):
    a, core = _instance(instance_timeout)
    a.destroy() if given is None else a.destroy(timeout_seconds=given)
    assert core.destroys == [(True, bound, True)], core.destroys
    assert ipc_all2all.DESTROY_TIMEOUT_SECONDS == 30.0


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, float("nan"), float("inf"), 1e9, True, "5"])
def test_a_deadline_that_is_not_one_is_refused_before_anything_is_released(bad):
    a, core = _instance(0.0)
    with pytest.raises(ValueError, match="timeout_seconds"):
        a.destroy(timeout_seconds=bad)
    assert not core.destroyed and core.destroys == []
    a.destroy()  # still possible afterwards
    assert core.destroyed


def test_a_collective_destroy_neither_synchronizes_nor_uses_the_process_group(monkeypatch):
    import torch.distributed as dist

    def unbounded(*args, **kwargs):
        raise AssertionError("destroy() made a wait without a deadline")

    for name in ("barrier", "monitored_barrier", "all_reduce", "all_gather"):
        monkeypatch.setattr(dist, name, unbounded)
    monkeypatch.setattr(torch.cuda, "synchronize", unbounded)
    a, core = _instance(0.0)
    a.destroy()
    assert core.destroys == [(True, 30.0, True)]


def test_a_failed_construction_is_released_alone():
    """An instance whose peers were never opened has no peer to wait for: not collective."""
    a, core = _instance(0.0)
    core.opened = False
    a.destroy()
    assert core.destroys == [(True, 30.0, False)]


def _worker_peer_never_destroys(rank, world, rdzv):
    """Rank 1 builds its instance collectively, then never calls destroy() (it waits for rank 0 to be
    done): rank 0's destroy() must return on its own."""
    from tests._dist import init_gloo
    from tests.ipc_all2all._cpu_workers import cpu_stand_ins

    group = init_gloo(rank, world, rdzv, timeout_s=60.0)
    cpu_stand_ins()
    a = ipc_all2all.All2All(rank, world, 16, 256, 8, torch.bfloat16, group=group, timeout_seconds=0)
    done = os.path.join(os.path.dirname(rdzv.removeprefix("file://")), "rank0_destroyed")
    if rank == 1:
        t0 = time.monotonic()
        while not os.path.exists(done) and time.monotonic() - t0 < 50:
            time.sleep(0.05)
        return os.path.exists(done)
    t0 = time.monotonic()
    a.destroy()
    took = time.monotonic() - t0
    open(done, "w").close()
    return took, a._core.destroys


@pytest.mark.fault
def test_destroy_returns_when_a_peer_never_calls_it(tmp_path):
    """Before, rank 0 waited in dist.barrier() for the group's timeout (60 s here) for a rank that
    never came."""
    from tests._dist import run_workers

    took, destroys = run_workers(_worker_peer_never_destroys, 2, tmp_path=tmp_path, timeout=40)[0]
    assert took < 5.0, f"destroy() took {took:.1f} s"
    assert destroys == [(True, 30.0, True)], destroys
