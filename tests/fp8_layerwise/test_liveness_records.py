"""The transport's liveness check of a rank record: (pid, /proc start time recorded on attach).

Every blocked wait checks, each ``liveness_ms``, that the ranks it depends on are alive
(csrc/transport_poison.cpp ``check_peers`` -> ``commkit::process_alive``). A rank's pid alone does not say
that: after the rank died its pid may be reused by an unrelated live process. The start time the
rank recorded tells the two apart, and this file checks that it does, through two test hooks of
the native module (the records live in the control region at offsets Python does not know):

* ``_C._debug_rank_process_alive(pid, recorded_start)``: the predicate ``check_peers`` uses;
* ``_C._debug_set_rank_process(ptr, size, rank, pid, start)``: forges rank's record (attached),
  so that a real transport's liveness check judges it end to end.

The PID-reuse case is staged with a live process (this one, or a sleeping child) and a start time
that is not its own: exactly what a dead rank's record looks like once another process got its pid.
"""
import ctypes
import mmap
import os
import subprocess
import time

import pytest
import torch

import fp8_layerwise as F
from fp8_layerwise import _C
from tests.fp8_layerwise._procs import proc_stat
from tests.fp8_layerwise._procs import sleeper as _sleeper
from tests.fp8_layerwise._procs import stop as _stop
from tests.fp8_layerwise._timing import fast_bound, poll

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")

alive = _C._debug_rank_process_alive

#: The liveness interval of the end-to-end tests (the package default).
LIVENESS_MS = 20
#: The timeout of the transports that must see a dead peer: a detection by the timeout fails them.
DEAD_PEER_TIMEOUT_MS = 10000


def _start(pid):
    return proc_stat(pid)[2]


def _state(pid):
    return proc_stat(pid)[1]


# ---- the predicate -----------------------------------------------------------------------------
def test_own_pid_with_its_start_time_is_alive():
    pid = os.getpid()
    start = _start(pid)
    assert start > 0 and _C.process_start_time(pid) == start
    assert alive(pid, start)
    assert alive(pid, 0)  # no recorded start time (unknown): the pid alone decides


@pytest.mark.parametrize("delta", [1, -1, 10**6])
def test_own_pid_with_another_start_time_is_dead(delta):
    # The record of a dead rank whose pid this process got: the pid is live, the start time is not its.
    start = _start(os.getpid())
    assert not alive(os.getpid(), start + delta)


def test_child_pid_alive_only_with_its_own_start_time():
    p = _sleeper()
    try:
        start = _start(p.pid)
        assert alive(p.pid, start)
        assert not alive(p.pid, start + 1)
        if start != _start(os.getpid()):  # both started within the same clock tick: no second start time
            assert not alive(p.pid, _start(os.getpid()))
    finally:
        _stop(p)
    assert not alive(p.pid, start)  # reaped: gone, whatever start time the record holds
    assert not alive(p.pid, 0)


def test_zombie_is_dead_even_with_its_start_time():
    p = subprocess.Popen(["sleep", "30"])
    try:
        start = _start(p.pid)
        assert alive(p.pid, start)
        p.kill()
        poll(lambda: _state(p.pid) == "Z", what=f"process {p.pid} becoming a zombie")  # exited, not reaped
        assert _start(p.pid) == start  # its /proc entry still has the start time ...
        assert not alive(p.pid, start)  # ... but a zombie counts as dead
    finally:
        p.wait(30)
    assert not alive(p.pid, start)
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    for pid in (0, pid_max + 1, 2**64 - 1):  # no such process can exist
        assert not alive(pid, 0) and not alive(pid, 1), pid


# ---- the hook that forges a record ----------------------------------------------------------------
def _control(tp):
    ctl = mmap.mmap(-1, 8192)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(ctl))
    _C.initialize_fp8_layerwise_control(ptr, 8192, tp, 2)
    return ctl, ptr


def test_set_rank_process_checks_its_arguments():
    ctl, ptr = _control(2)
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        _C._debug_set_rank_process(ptr, 8192, 2, os.getpid(), 1)
    with pytest.raises(ValueError, match="at least"):
        _C._debug_set_rank_process(ptr, 4096, 1, os.getpid(), 1)
    raw = mmap.mmap(-1, 8192)
    with pytest.raises(ValueError, match="not initialized"):
        _C._debug_set_rank_process(ctypes.addressof(ctypes.c_char.from_buffer(raw)), 8192, 1, os.getpid(), 1)
    _C._debug_set_rank_process(ptr, 8192, 1, os.getpid(), 1)


# ---- end to end: rank 0's run() waits for a rank 1 that only a forged record represents ------------
def _rank0(ptr, tp, timeout_ms, nb=16, experts=4, slots=2):
    """Rank 0 of ``tp`` (CPU backend) on the control region at ``ptr``; returns it and the tensors it
    points into (which must outlive it)."""
    k = [torch.zeros(4096, dtype=torch.uint8) for _ in range(4)]
    dst = [torch.zeros(experts * nb, dtype=torch.uint8) for _ in range(4)]
    host = [k[i].data_ptr() for _ in range(slots) for i in range(4)]
    all_ = [k[i].data_ptr() for _ in range(slots) for _ in range(tp) for i in range(4)]
    t = _C.FP8LayerwiseTransport(ptr, 8192, 0, tp, -1, host, [d.data_ptr() for d in dst], all_, [nb] * 4, experts,
                                 timeout_ms, backend="cpu", liveness_ms=LIVENESS_MS)
    return t, (k, dst)


def _run_against_record(pid, start, timeout_ms):
    """Rank 0 attaches, rank 1's record is forged as (pid, start), and rank 0 runs a layer, which waits
    for rank 1 to join. Returns (the exception run() raised, seconds until it did)."""
    ctl, ptr = _control(2)
    t, keep = _rank0(ptr, 2, timeout_ms)
    try:
        # After rank 0 attached: rank 0 compares the geometry of the ranks attached before it.
        _C._debug_set_rank_process(ptr, 8192, 1, pid, start)
        t.join(1, 0, 4)
        t0 = time.monotonic()
        with pytest.raises(F.TransportPoisoned) as info:
            t.run(1, 0, 4, lambda e, *slots: None)
        return info.value, time.monotonic() - t0
    finally:
        t.close()


@pytest.mark.parametrize("who", ["self", "child"])
@pytest.mark.fault
def test_live_pid_with_another_start_time_is_reported_dead_fast(who, record_property):
    # The PID-reuse case: rank 1's record names a live process (this one, or a sleeping child) with a
    # start time that is not that process's. Rank 0 must report rank 1 dead at its first liveness check,
    # not wait for it until the timeout.
    p = _sleeper() if who == "child" else None
    try:
        pid = p.pid if p else os.getpid()
        start = _start(pid)
        exc, dt = _run_against_record(pid, start + 1, DEAD_PEER_TIMEOUT_MS)
        assert os.path.exists(f"/proc/{pid}") and _start(pid) == start  # the process really is alive
    finally:
        if p:
            _stop(p)
    assert type(exc) is F.PeerDied, exc  # not TransportTimeout: the liveness check, not the timeout
    assert exc.code == F.ErrorCode.PEER_DEAD and exc.rank == 1 and exc.peer == 1, exc
    assert f"rank 1 (pid {pid}) died" in exc.message, exc.message
    assert dt < fast_bound(LIVENESS_MS / 1000, DEAD_PEER_TIMEOUT_MS / 1000), dt
    record_property("detect_s", dt)


@pytest.mark.fault
def test_exited_process_is_reported_dead_fast(record_property):
    # The plain dead case: the record holds the right start time of a process that has exited since.
    p = _sleeper()
    pid, start = p.pid, _start(p.pid)
    _stop(p)
    exc, dt = _run_against_record(pid, start, DEAD_PEER_TIMEOUT_MS)
    assert type(exc) is F.PeerDied and exc.rank == 1 and exc.peer == 1, exc
    assert dt < fast_bound(LIVENESS_MS / 1000, DEAD_PEER_TIMEOUT_MS / 1000), dt
    record_property("detect_s", dt)


@pytest.mark.fault
def test_live_pid_with_its_own_start_time_is_waited_for():
    # The control case: the same record with the process's own start time is a live rank 1 that has
    # not joined yet, so rank 0 waits for it until the (short) timeout, which names rank 1.
    exc, dt = _run_against_record(os.getpid(), _start(os.getpid()), 300)
    assert type(exc) is F.TransportTimeout, exc
    assert exc.peer == 1 and "rank 1" in exc.message, exc.message
    assert dt >= 0.25, dt


# ---- attach: a seat whose record names a process that is gone is free ------------------------------
def _attach_rank1(ptr, nb=16, experts=4, slots=2):
    """Rank 1 of 2 (CPU backend) attaching to the control region at ``ptr``."""
    k = [torch.zeros(4096, dtype=torch.uint8) for _ in range(4)]
    dst = [torch.zeros(experts * nb, dtype=torch.uint8) for _ in range(4)]
    host = [k[i].data_ptr() for _ in range(slots) for i in range(4)]
    t = _C.FP8LayerwiseTransport(ptr, 8192, 1, 2, -1, host, [d.data_ptr() for d in dst], [], [nb] * 4, experts,
                                 1000, backend="cpu", liveness_ms=LIVENESS_MS)
    return t, (k, dst)


@pytest.mark.parametrize("case", ["pid reused", "exited"])
@pytest.mark.fault
def test_a_dead_ranks_record_does_not_block_its_seat(case):
    # A restarted rank 1 takes the seat its dead predecessor left attached: the record names a process
    # that has exited, or (PID reuse) a live unrelated process whose start time is not the recorded one.
    p = _sleeper()
    try:
        pid, start = p.pid, _start(p.pid)
        if case == "exited":
            _stop(p)
            p = None
        ctl, ptr = _control(2)
        _C._debug_set_rank_process(ptr, 8192, 1, pid, start + 1 if case == "pid reused" else start)
        t, keep = _attach_rank1(ptr)
        t.close()
    finally:
        if p:
            _stop(p)


@pytest.mark.fault
def test_a_live_ranks_record_blocks_its_seat():
    # The control case: the record of a live process with its own start time is a rank 1 that is still
    # there, so a second process cannot take its seat.
    p = _sleeper()
    try:
        ctl, ptr = _control(2)
        _C._debug_set_rank_process(ptr, 8192, 1, p.pid, _start(p.pid))
        with pytest.raises(ValueError, match=f"rank 1 is already attached by live process {p.pid}"):
            _attach_rank1(ptr)
    finally:
        _stop(p)
