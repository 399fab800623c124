"""Liveness of ranks in other PID namespaces (one container per rank sharing /dev/shm).

A rank's pid means something only to a process of the same kernel and PID namespace. Each rank records
its kernel boot id and PID-namespace inode beside its pid (``commkit::ProcessId``) and beats a heartbeat
word (CLOCK_MONOTONIC, one clock for every namespace of a kernel) while it is attached; a peer in
another namespace is judged by that heartbeat (dead after 2 s without a beat), never by a pid it cannot
see. Shown with forged records (``_C._debug_set_rank_process``) and with a real rank 1 started under
``unshare --pid --fork`` (as root): before, the survivor looked up the other namespace's pid in its own
/proc and reported the live rank dead at once.
"""
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import fp8_layerwise as F
from fp8_layerwise import _C
from tests.fp8_layerwise.test_liveness_records import _control, _rank0

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="needs Linux PID namespaces")

STALE_S = 2.0  # transport_impl.hpp kHeartbeatStaleMs


def _run(t):
    """rank 0 runs a layer that waits for rank 1 to join; returns (exception, seconds)."""
    t.join(1, 0, 4)
    t0 = time.monotonic()
    with pytest.raises(F.TransportPoisoned) as info:
        t.run(1, 0, 4, lambda e, *slots: None)
    return info.value, time.monotonic() - t0


def _forged(ptr, pid, start, boot, pid_ns, beat):
    _C._debug_set_rank_process(ptr, 8192, 1, pid, start, boot=boot, pid_ns=pid_ns, heartbeat_ns=beat)


@pytest.mark.parametrize("case", ["beating", "stale", "other kernel"])
@pytest.mark.fault
def test_a_rank_in_another_pid_namespace_is_judged_by_its_heartbeat(case, record_property):
    boot, ns, _, _ = _C.this_process()
    ctl, ptr = _control(2)
    t, keep = _rank0(ptr, 2, 1500 if case != "stale" else 10000)
    stop = threading.Event()
    # Its pid is 1 in its own namespace; here pid 1 is another process (or none) with another start time.
    other = dict(boot=boot if case != "other kernel" else boot ^ 1, pid_ns=ns + 1)
    now = _C._debug_monotonic_ns()
    _forged(ptr, 1, 12345, beat=now - int(10e9) if case == "stale" else now, **other)

    def beat():  # what the rank's own heartbeat thread does
        while not stop.wait(0.05):
            _forged(ptr, 1, 12345, beat=_C._debug_monotonic_ns(), **other)

    beater = threading.Thread(target=beat, daemon=True)
    if case == "beating":
        beater.start()
    try:
        exc, dt = _run(t)
    finally:
        stop.set()
        t.close()
    if case == "stale":
        assert type(exc) is F.PeerDied and exc.peer == 1, exc
        assert "another PID namespace" in exc.message and "no heartbeat" in exc.message, exc.message
        assert dt < 3.0, dt
        record_property("detect_s", dt)
    else:  # alive (or not judgeable): the wait goes on to its deadline, which names rank 1
        assert type(exc) is F.TransportTimeout and exc.peer == 1, exc
        assert dt >= 1.4, dt


_RANK1 = r"""
import ctypes, sys, time, torch
from fp8_layerwise import _C
seg = _C.ShmSegment.attach(sys.argv[1], 8192)
k = [torch.zeros(4096, dtype=torch.uint8) for _ in range(4)]
dst = [torch.zeros(4 * 16, dtype=torch.uint8) for _ in range(4)]
host = [k[i].data_ptr() for _ in range(2) for i in range(4)]
t = _C.FP8LayerwiseTransport(seg.ptr, 8192, 1, 2, -1, host, [d.data_ptr() for d in dst], [], [16] * 4, 4, 60000,
                             backend="cpu", liveness_ms=20)
import os
print("attached", os.getpid(), flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
@pytest.mark.fault
def test_real_rank_in_another_pid_namespace_is_alive_then_dead(record_property):
    seg = _C.ShmSegment.create("fp8lw_ns_test", 8192)
    try:
        _C.initialize_fp8_layerwise_control(seg.ptr, 8192, 2, 2)
        p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", _RANK1, seg.name],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        try:
            line = p.stdout.readline().split()
            assert line[:1] == ["attached"], line
            assert int(line[1]) != p.pid  # its pid in its own namespace: meaningless here
            t, keep = _rank0(seg.ptr, 2, 1500)
            try:
                exc, dt = _run(t)  # rank 1 lives but never joins: a timeout naming it, not PeerDied
                assert type(exc) is F.TransportTimeout and exc.peer == 1, exc
            finally:
                t.close()
            # The record rank 1 wrote on attach (csrc/control.hpp v7: RankState[1] at 512 + 320; pid,
            # pid_start, boot, pid_ns at +32..+56): its own namespace's pid and inode.
            pid, start, boot, ns = (ctypes.c_uint64.from_address(seg.ptr + 832 + off).value for off in (32, 40, 48, 56))
            assert pid == int(line[1]) and boot == _C.this_process()[0] and ns != _C.this_process()[1]
            p.send_signal(signal.SIGKILL)  # --kill-child: the namespace's process dies with it
            p.wait(30)
            _C.initialize_fp8_layerwise_control(seg.ptr, 8192, 2, 2)  # rank 0 starts over, and rank 1's
            t, keep = _rank0(seg.ptr, 2, 30000)                     # record is put back as it left it
            _C._debug_set_rank_process(seg.ptr, 8192, 1, pid, start, boot=boot, pid_ns=ns,
                                       heartbeat_ns=_C._debug_monotonic_ns())
            try:
                exc, dt = _run(t)
            finally:
                t.close()
            assert type(exc) is F.PeerDied and "another PID namespace" in exc.message, exc
            assert STALE_S - 0.5 <= dt < STALE_S + 2.0, dt
            record_property("detect_s", dt)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    finally:
        seg.close()
