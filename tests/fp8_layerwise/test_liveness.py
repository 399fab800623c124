"""Host liveness: the native /proc/<pid>/stat reader behind every liveness check
(``_C.process_start_time``, ``commkit::process_start_time`` in common/) and FileExchange's session-leader check,
which tells a live leader from a dead one whose pid another process now has (start times differ).

The expected start times come from this file's own reading of /proc/<pid>/stat (proc(5): field 2 is
the command name in parentheses, which may itself contain spaces and parentheses, so the fields
after it start after the *last* ')'; field 3 is the state, field 22 the start time in clock ticks).
"""
import json
import os
import subprocess

import pytest

import fp8_layerwise as F
from fp8_layerwise import _C
from tests.fp8_layerwise._procs import proc_stat as _stat
from tests.fp8_layerwise._procs import sleeper as _sleeper
from tests.fp8_layerwise._procs import stop as _stop
from tests.fp8_layerwise._timing import poll

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")


# ---- _C.process_start_time -------------------------------------------------------------------
def test_start_time_is_field_22_for_this_process_and_a_child():
    me = _C.process_start_time(os.getpid())
    assert me == _stat(os.getpid())[2] and me > 0
    p = _sleeper()
    try:
        child = _C.process_start_time(p.pid)
        assert child == _stat(p.pid)[2] and child >= me, (child, me)
        assert F.exchange._proc_start_time(p.pid) == child
    finally:
        _stop(p)


@pytest.mark.parametrize("name", [
    "a) Z 9 ) 8 7 6",  # ") " twice and a fake state 'Z': a parser stopping at the first ')' reads a zombie
    "x) (y) z)",       # ends with ')'
    "b c  d",          # spaces only
    ")",
])
def test_command_name_with_parens_and_spaces(name):
    p = _sleeper(name)
    try:
        comm, state, start = _stat(p.pid)
        assert comm == name and state in "RSD", (comm, state)  # the child really carries that name
        assert _C.process_start_time(p.pid) == start > 0
    finally:
        _stop(p)


def test_zombie_and_dead_processes_give_0():
    p = subprocess.Popen(["true"])
    try:
        poll(lambda: _stat(p.pid)[1] == "Z", what=f"process {p.pid} becoming a zombie")  # exited, not reaped
        assert _stat(p.pid)[2] > 0  # its /proc entry still has a start time ...
        assert _C.process_start_time(p.pid) == 0  # ... but a zombie counts as gone
        assert F.exchange._proc_start_time(p.pid) is None
    finally:
        p.wait(30)
    assert not os.path.exists(f"/proc/{p.pid}")
    assert _C.process_start_time(p.pid) == 0  # reaped: no /proc entry
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    for pid in (0, pid_max + 1, 2**63, 2**64 - 1):  # no such process can exist
        assert _C.process_start_time(pid) == 0, pid
    for bad in (-1, None):  # what a corrupt or incomplete leader.json gives
        assert F.exchange._proc_start_time(bad) is None


# ---- FileExchange: the session leader's liveness ----------------------------------------------
def _stale_session(d, nonce, pid, start, world_size=2):
    """A session folder and session.json as a leader with ``pid`` / ``start`` would have left them."""
    leader = {"nonce": nonce, "pid": pid, "start": start, "world_size": world_size}
    s = d / f"s.{nonce}"
    s.mkdir(parents=True, mode=0o700)
    (s / "leader.json").write_text(json.dumps(leader))
    (d / "session.json").write_text(json.dumps(leader))
    return s


def test_leader_alive_needs_a_live_pid_with_the_same_start_time():
    pid, start = os.getpid(), _stat(os.getpid())[2]
    alive = F.FileExchange._leader_alive
    assert alive({"pid": pid, "start": start})
    assert not alive({"pid": pid, "start": start + 1})  # the pid now names another process
    assert not alive({"pid": pid, "start": None})
    assert not alive({"pid": pid})
    assert not alive({"start": start})
    p = subprocess.Popen(["true"])
    p.wait(30)
    assert not alive({"pid": p.pid, "start": start})  # gone


@pytest.mark.parametrize("same_start", [False, True])
@pytest.mark.fault
def test_joining_rank_skips_a_session_whose_leader_pid_was_reused(tmp_path, same_start):
    # session.json names a live process (this one), as a crashed run's leader would if its pid had been
    # reused: only the start time tells them apart. With a different start time rank 1 must not take a
    # seat in that session; with the recorded one (the control case) it joins it.
    d = tmp_path / "x"
    start = _stat(os.getpid())[2]
    stale = _stale_session(d, "cafe" * 8, os.getpid(), start if same_start else start + 1)
    ex = F.FileExchange(d, 1, 2, timeout_s=0.5)
    with pytest.raises(TimeoutError) as info:
        ex({"r": 1})
    if same_start:
        assert (stale / "join.1").exists() and "rank 0 did not publish" in str(info.value), info.value
    else:
        assert not (stale / "join.1").exists() and not (stale / "1.1.json").exists()
        assert f"left by process {os.getpid()}, which is gone" in str(info.value), info.value


@pytest.mark.fault
def test_new_leader_removes_sessions_whose_leader_pid_was_reused(tmp_path):
    d = tmp_path / "x"
    start = _stat(os.getpid())[2]
    reused = _stale_session(d, "dead" * 8, os.getpid(), start + 1)
    live = _stale_session(d, "beef" * 8, os.getpid(), start)  # a session this process leads (another run)
    with F.FileExchange(d, 0, 1, timeout_s=5) as ex:
        assert ex({"r": 0}) == [{"r": 0}]
    assert not reused.exists()  # removed: its leader is gone, whatever process has its pid now
    assert live.exists() and (live / "leader.json").exists()
