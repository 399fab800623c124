"""destroy() of an instance whose operations wait forever (``timeout_seconds=0``) is bounded on a GPU
(csrc/teardown.cpp), and a CUDA release that fails in destroy() is reported (ranks sharing one GPU).

* A peer dies while this rank's kernel waits for it: the peer watch ends the wait, and destroy(), called
  without synchronize(), returns at once without waiting for the dead rank's arrival.
* A peer that is alive but never comes (the watch off): destroy(timeout_seconds=2) ends this rank's
  own waits after 2 s, waits 2 s for the peer's arrival, then raises CommError naming it (``.peer``);
  the CUDA context stays usable, and the late peer's own destroy() later succeeds.
* IPC_ALL2ALL_TEST_FAIL_RELEASE names a release step: destroy() raises naming it, after releasing the
  rest, and a new instance works.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from tests._dist import run_workers

H_PER_RANK, D = 4, 128


def _build(world, timeout_seconds):
    import ipc_all2all

    a2a = ipc_all2all.All2All.from_group(num_tokens=64 * world, hidden_dim=H_PER_RANK * world * D,
                                         tensor_dtype=torch.bfloat16, timeout_seconds=timeout_seconds)
    a2a.set_rank_tokens([16] * world)
    return a2a


def _warm(a2a, world, dev):
    x = torch.ones(1, 16, H_PER_RANK * world, D, dtype=torch.bfloat16, device=dev)
    a2a.gather_heads(a2a.send_recv_heads(x), copy_output=True)  # every kernel loaded, the ranks in step
    a2a.synchronize()
    return x


def _flag_path(rdzv, name):
    return os.path.join(os.path.dirname(rdzv.removeprefix("file://")), name)


def _wait_for(path, limit_s=60.0):
    t0 = time.monotonic()
    while not os.path.exists(path) and time.monotonic() - t0 < limit_s:
        time.sleep(0.05)


def dead_peer_worker(rank, world, rdzv):
    import signal

    from tests.ipc_all2all._references import _setup

    dev = _setup(rank, world, rdzv)
    a2a = _build(world, timeout_seconds=0)
    x = _warm(a2a, world, dev)
    if rank == 1:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    a2a.send_recv_heads(x)  # waits without a deadline for the rank that is about to die
    t0 = time.monotonic()
    a2a.destroy()  # no synchronize() first: destroy() itself waits for the device
    took = time.monotonic() - t0
    assert a2a.destroyed
    assert float(torch.ones(1024, device=dev).sum().item()) == 1024.0  # the context is usable
    return took


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.fault
def test_destroy_after_a_peer_died_mid_call_without_a_deadline(tmp_path):
    took = run_workers(dead_peer_worker, 2, tmp_path=tmp_path, timeout=120, expect_dead={1})[0]
    assert took < 5.0, f"destroy() took {took:.1f} s with a dead peer"


def absent_peer_worker(rank, world, rdzv):
    import ipc_all2all
    from tests.ipc_all2all._references import _setup

    dev = _setup(rank, world, rdzv)
    a2a = _build(world, timeout_seconds=0)
    x = _warm(a2a, world, dev)
    done, late_done = _flag_path(rdzv, "rank0_destroyed"), _flag_path(rdzv, "rank1_destroyed")
    if rank == 1:  # alive, but enters neither the next call nor destroy() until rank 0 is done
        _wait_for(done)
        t0 = time.monotonic()
        a2a.destroy(timeout_seconds=2)  # rank 0 announced its arrival before it gave up on this rank
        took = time.monotonic() - t0
        open(late_done, "w").close()
        return took
    a2a.send_recv_heads(x)  # waits without a deadline for rank 1's entry
    t0 = time.monotonic()
    try:
        a2a.destroy(timeout_seconds=2)
        msg, peer = "no error", None
    except ipc_all2all.CommError as e:
        msg, peer = str(e), getattr(e, "peer", None)
    took = time.monotonic() - t0
    open(done, "w").close()
    _wait_for(late_done)  # rank 0's buffer (kept) stays mapped in rank 1 until rank 1 is done with it
    assert "destroy() on rank 0" in msg and "rank(s) 1 did not reach destroy() within 2 s" in msg, msg
    assert peer == 1, (peer, msg)
    assert a2a.destroyed
    assert float(torch.ones(1024, device=dev).sum().item()) == 1024.0  # the context is usable
    return took


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.fault
def test_destroy_is_bounded_when_a_peer_never_comes(tmp_path):
    res = run_workers(absent_peer_worker, 2, tmp_path=tmp_path, timeout=120,
                      env={"IPC_ALL2ALL_PEER_WATCH_MS": "0"})
    # 2 s for the device (then this rank's waits are ended), 2 s for the peer's arrival
    assert 3.5 < res[0] < 8.0, f"rank 0's destroy() took {res[0]:.1f} s"
    assert res[1] < 1.0, f"the late rank's destroy() took {res[1]:.1f} s"


def failing_release_worker(rank, world, rdzv):
    import ipc_all2all
    from tests.ipc_all2all._references import _setup

    dev = _setup(rank, world, rdzv)
    a2a = _build(world, timeout_seconds=10)
    _warm(a2a, world, dev)
    try:
        a2a.destroy()
        msg = "no error"
    except ipc_all2all.CommError as e:
        msg = str(e)
    assert a2a.destroyed
    os.environ.pop("IPC_ALL2ALL_TEST_FAIL_RELEASE")
    b = _build(world, timeout_seconds=10)  # the device and the peers are fine: a new instance works
    y = b.gather_heads(b.send_recv_heads(torch.full((1, 16, H_PER_RANK * world, D), rank + 1.0,
                                                    dtype=torch.bfloat16, device=dev)), copy_output=True)
    b.synchronize()
    ok = bool((y == rank + 1.0).all().item())
    b.destroy()
    return msg, ok


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.fault
def test_a_failed_release_in_destroy_is_raised(tmp_path):
    res = run_workers(failing_release_worker, 2, tmp_path=tmp_path, timeout=120,
                      env={"IPC_ALL2ALL_TEST_FAIL_RELEASE": "cudaIpcCloseMemHandle(peers),cudaFree(buffer)"})
    for rank, (msg, ok) in enumerate(res):
        assert f"destroy() on rank {rank}" in msg, msg
        assert "cudaIpcCloseMemHandle(peers) failed" in msg and "cudaFree(buffer) failed" in msg, msg
        assert "cudaFreeHost(record)" not in msg, msg  # the steps in between ran and succeeded
        assert ok, f"rank {rank}: a new instance after the failed release moved wrong data"
