"""Exit paths that used to leave something behind (CPU backend; a real interpreter exit where the path
needs one): what is left in /dev/shm and in the FileExchange folder, and how the process ends.

* A daemon thread inside a call of ``_C`` (blocked in ``wait()``, looping over layers with the native
  or a Python writer) when the interpreter exits: CPython ends a thread that waits for the GIL during
  finalization with ``pthread_exit``, whose unwinding aborted the process at the first C++ frame of
  the module (SIGABRT, "terminate called without an active exception" / "FATAL: exception not
  rethrown") instead of a clean exit.
* A setup that rank 0 leaves before its peers arrived (Ctrl-C while it waits for them, or the
  exchange's timeout): its ``FileExchange.close()`` waited for the done marks of ranks that had never
  joined, then left ``session.json`` and the session folder in the exchange's directory.
"""
import os
import signal
import subprocess
import threading
import time

import pytest

import fp8_layerwise as F
from tests.fp8_layerwise import _shm
from tests.fp8_layerwise._timing import fast_bound, poll

NB = [4096, 512, 2048, 256]
#: The children's timeout: a close() at exit that waited for a thread still inside a call would take
#: this long (min(timeout_ms, 60 s)), so the exit-time bound below tells it apart.
CHILD_TIMEOUT_MS = 20000

_DAEMON_CHILD = r'''
import threading, time
import fp8_layerwise as F
case = sys.argv[2]
if case == "blocked_wait":
    # Rank 0 never runs the layer: each wait() stays blocked until the timeout. liveness_ms=1: the
    # interrupt hook of each asks for the GIL every millisecond meanwhile.
    ts = [F.Transport(0, 1, 4, [4096, 512, 2048, 256], num_slots=2, backend="cpu", exchange=lambda o: [o],
                      timeout_ms=int(sys.argv[3]), liveness_ms=1) for _ in range(4)]
    for t in ts:
        t.join(1, 0, 4)
        threading.Thread(target=t.wait, args=(1,), daemon=True).start()
else:
    H, I, E = 256, 512, 16
    nb = F.block_fp8_expert_nbytes(H, I, 1)
    t = F.Transport(0, 1, E, nb, num_slots=2, backend="cpu", exchange=lambda o: [o], timeout_ms=int(sys.argv[3]))
    if case == "native_writer_loop":
        writer = F.make_shard_writer(F.make_block_fp8_sources(E, H, I), 1, threads=4)
    else:  # a Python writer that keeps the GIL (no torch op, no sleep)
        writer = lambda e, slots: sum(range(2000))

    def body():
        epoch = 0
        while True:
            epoch += 1
            with t.layer(epoch, 0, E) as layer:
                layer.run(writer)
            done.set()

    done = threading.Event()
    threading.Thread(target=body, daemon=True).start()
    assert done.wait(30), "no layer completed"
if case == "blocked_wait":
    time.sleep(0.2)
print("main returns", time.monotonic(), flush=True)
'''


@pytest.mark.parametrize("case", ["blocked_wait", "native_writer_loop", "python_writer_loop"])
def test_daemon_thread_inside_a_call_at_interpreter_exit_exits_cleanly(case):
    p, tag = _shm.spawn_tagged(_DAEMON_CHILD, case, str(CHILD_TIMEOUT_MS), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=60)
        ended = time.monotonic()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    left = _shm.linked_with_tag(tag)
    assert p.returncode == 0, (p.returncode, out, err[-2000:])
    assert "terminate called" not in err and "FATAL" not in err, err[-2000:]
    returned = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("main returns")]
    assert returned, out
    # No hang at exit: neither the parked daemon thread nor the close() of its transport holds it up.
    assert ended - returned[0] < fast_bound(1.0, CHILD_TIMEOUT_MS / 1000), ended - returned[0]
    assert left == [], left


@pytest.mark.fault
def test_rank0_setup_that_fails_before_its_peers_arrive_leaves_no_exchange_files(tmp_path):
    # Rank 0 of TP 2 alone: its first exchange times out. Nothing may stay in the exchange's folder
    # (session.json, the session folder) nor in /dev/shm (nothing is created before every rank arrived).
    d = tmp_path / "x"
    with _shm.tagged_segments() as shm:
        with pytest.raises(TimeoutError, match="rank 1 did not publish"):
            F.Transport(0, 2, 4, NB, num_slots=2, backend="cpu", exchange=F.FileExchange(d, 0, 2, timeout_s=0.5))
        assert shm.created == [] and shm.linked() == []
    assert os.listdir(d) == []


@pytest.mark.fault
def test_ctrl_c_while_rank0_waits_for_its_peers_in_the_setup_leaves_nothing(tmp_path):
    # The same exit path through KeyboardInterrupt (SIGINT) in a real process: rank 0 published its first
    # round and waits for rank 1, which never comes.
    xdir = tmp_path / "x"
    p, tag = _shm.spawn_tagged("import signal, time\n"
                               "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                               "import fp8_layerwise as F\n"
                               "ex = F.FileExchange(sys.argv[2], 0, 2, timeout_s=60)\n"
                               "try:\n"
                               "    F.Transport(0, 2, 4, [4096, 512, 2048, 256], num_slots=2, backend='cpu',\n"
                               "                exchange=ex)\n"
                               "except KeyboardInterrupt:\n"
                               "    print('KeyboardInterrupt', flush=True)\n",
                               str(xdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        poll(lambda: list(xdir.glob("s.*/1.0.json")) or p.poll() is not None, timeout_s=60,
             what="rank 0 reaching the first exchange")
        assert p.poll() is None, f"rank 0 exited with {p.returncode} before the first exchange"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    left = _shm.linked_with_tag(tag)
    assert p.returncode == 0 and out.strip() == "KeyboardInterrupt", (p.returncode, out, err[-2000:])
    assert os.listdir(xdir) == []
    assert left == [], left


@pytest.mark.fault
def test_file_exchange_rank0_leaving_removes_the_session_and_a_peer_then_fails_at_once(tmp_path):
    # Rank 1 joined and finished round 1 but has not closed when rank 0's close() gives up waiting for
    # it: rank 0 still removes the whole session, and rank 1's next round raises at once instead of
    # waiting for rank 0 until its own timeout.
    d = tmp_path / "x"
    ex = [F.FileExchange(d, r, 2, timeout_s=30) for r in range(2)]
    out, errs = [None, None], []

    def first_round(r):
        try:
            out[r] = ex[r]({"r": r})
        except BaseException as e:  # noqa: BLE001 - reported below
            errs.append(e)

    ths = [threading.Thread(target=first_round, args=(r,)) for r in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    assert not errs and out == [[{"r": 0}, {"r": 1}]] * 2, (errs, out)
    ex[0].close(timeout_s=0.05)
    assert os.listdir(d) == []
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="has ended: rank 0 closed it"):
        ex[1]({"r": 1})
    assert time.monotonic() - t0 < fast_bound(0.0, 30), "rank 1 waited for rank 0's round"
    ex[1].close()
    assert os.listdir(d) == []
