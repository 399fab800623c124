"""Interrupts, slot-view lifetime, exchange checks, FileExchange sessions, blame in timeouts and
argument validation (CPU backend, real processes where signals or crashes are involved)."""
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch

import fp8_layerwise as F
from tests._dist import run_workers
from tests.fp8_layerwise import _shm
from tests.fp8_layerwise import _fault_workers as FW
from tests.fp8_layerwise import _workers as W
from tests.fp8_layerwise._timing import INTERRUPT_CHECK_S, InsideCall, fast_bound

NB = [1024, 128, 512, 64]

# A rank 1 of TP 2 alone on an anonymous control region (rank 0 never attaches), low-level API.
_LOW_LEVEL_RANK1 = r'''
import ctypes, mmap, signal, sys, time, threading
import torch, fp8_layerwise as F
signal.signal(signal.SIGINT, signal.default_int_handler)  # even if the launcher ignored SIGINT
nb = [64, 16, 32, 16]

def rank1(timeout_ms, liveness_ms=20):
    ctl = mmap.mmap(-1, 8192)
    p = ctypes.addressof(ctypes.c_char.from_buffer(ctl))
    F.initialize_fp8_layerwise_control(p, 8192, 2)
    host = [torch.zeros(64, dtype=torch.uint8) for _ in range(8)]
    dst = [torch.zeros(4 * n, dtype=torch.uint8) for n in nb]
    t = F.FP8LayerwiseTransport(p, 8192, 1, 2, -1, [h.data_ptr() for h in host], [d.data_ptr() for d in dst], [],
                                nb, 4, timeout_ms, backend="cpu", liveness_ms=liveness_ms)
    return t, (ctl, host, dst)
'''


def _child(code, *args):
    return subprocess.Popen([sys.executable, "-c", _LOW_LEVEL_RANK1 + code, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


# ---- 1. Ctrl-C while a call is blocked in native code ---------------------------------------------
@pytest.mark.fault
def test_sigint_interrupts_blocked_join_even_with_infinite_timeout():
    # join() waits for a rank 0 that never comes, with the documented "infinite" timeout: SIGINT must
    # raise KeyboardInterrupt within a fraction of a second and poison the region (code INTERRUPTED).
    # The SIGINT goes once the child was seen inside the native join(): a blocked call runs the signal
    # handlers with the caller's frame at the line of the call (see _timing.InsideCall), so the child's
    # SIGURG handler answers "inside" only from there.
    code = r'''
JOIN_LINE = None
def on_sigurg(signum, frame):
    global JOIN_LINE
    if JOIN_LINE is not None and frame is not None and frame.f_code.co_name == "<module>" \
            and frame.f_lineno == JOIN_LINE:
        JOIN_LINE = None  # answer once
        print("inside", flush=True)
signal.signal(signal.SIGURG, on_sigurg)
t, keep = rank1(2**62)
print("blocking", flush=True)
try:
    JOIN_LINE = sys._getframe().f_lineno + 1
    t.join(1, 0, 4)
    print("RETURNED", flush=True)
except BaseException as e:
    at = time.monotonic()
    info = t.last_poison()
    print(repr((type(e).__name__, at, info["error_code"], info["error_rank"], info["error_message"])), flush=True)
t.close()
'''
    import select

    p = _child(code)
    try:
        assert p.stdout.readline().strip() == "blocking"
        deadline = time.monotonic() + 30
        while not select.select([p.stdout], [], [], 0.005)[0]:  # poke until the child answers
            assert time.monotonic() < deadline and p.poll() is None, "the child never blocked in join()"
            os.kill(p.pid, signal.SIGURG)
        assert p.stdout.readline().strip() == "inside"
        t_sig = time.monotonic()
        os.kill(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, (out, err)
    name, at, code_, rank, msg = eval(out.strip().splitlines()[-1])  # noqa: S307 - our own repr
    assert name == "KeyboardInterrupt", (out, err)
    # The hook runs every <= 50 ms; the call would otherwise never return (communicate's 10 s).
    assert at - t_sig < fast_bound(INTERRUPT_CHECK_S, 10.0), at - t_sig
    assert code_ == F.ErrorCode.INTERRUPTED and rank == 1, (code_, rank, msg)
    assert "rank 1 was interrupted (KeyboardInterrupt) in join()" in msg, msg


@pytest.mark.fault
def test_native_error_mapping_does_not_swallow_a_pending_sigint():
    # The signal lands while the call is blocked and the call then fails on its own (a 40 ms timeout,
    # before the first interrupt check): the exception mapping runs Python code, which must not eat
    # the pending KeyboardInterrupt (it used to come out as a plain RuntimeError).
    code = r'''
names = []
for i in range(5):
    t, keep = rank1(40, liveness_ms=10**9)
    threading.Timer(0.005, lambda: __import__("os").kill(__import__("os").getpid(), signal.SIGINT)).start()
    try:
        t.join(1, 0, 4)
        names.append("returned")
    except BaseException as e:
        names.append(type(e).__name__)
    try:
        time.sleep(0.2)  # a signal that arrived after the call is delivered here (not counted)
    except KeyboardInterrupt:
        names[-1] += "+late"
    t.close()
print(repr(names), flush=True)
'''
    p = _child(code)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, (out, err)
    names = eval(out.strip().splitlines()[-1])  # noqa: S307 - our own repr
    # Each round raises KeyboardInterrupt from the call (or, if the timer was late, TransportTimeout
    # followed by the late KeyboardInterrupt); never a RuntimeError that ate the signal.
    assert all(n in ("KeyboardInterrupt", "TransportTimeout+late") for n in names), names
    assert names.count("KeyboardInterrupt") >= 1, names


@pytest.mark.fault
def test_sigint_in_wait_raises_at_once_and_stops_the_peers(tmp_path, record_property):
    r0, r1 = run_workers(FW.sigint_in_wait, 2, str(tmp_path), tmp_path=tmp_path, timeout=90)
    assert r1["type"] == "KeyboardInterrupt", r1
    assert r1["dt"] < fast_bound(INTERRUPT_CHECK_S, FW.SIGINT_TIMEOUT_MS / 1000), r1  # the hook's period
    assert r1["poison"] == (int(F.ErrorCode.INTERRUPTED), 1) and "in wait()" in r1["msg"], r1
    # The producer stops promptly with the interruption as its cause.
    assert r0["type"] == "TransportPoisoned" and r0["code"] == F.ErrorCode.INTERRUPTED and r0["rank"] == 1, r0
    # Rank 0's producer notices the poison within a liveness tick, after the expert it is writing (20 ms).
    assert r0["dt"] < fast_bound(FW.LIVENESS_MS / 1000 + 0.02, FW.SIGINT_TIMEOUT_MS / 1000), r0
    record_property("detect_s", r0["dt"])  # the peer raising after the interrupt


# ---- 6. a writer's KeyboardInterrupt / SystemExit -------------------------------------------------
@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
@pytest.mark.fault
def test_writer_keyboard_interrupt_and_system_exit_propagate(exc_type):
    with F.Transport(0, 1, 4, [16] * 4, num_slots=2, backend="cpu", exchange=lambda o: [o]) as t:
        def writer(e, slots):
            if e == 2:
                raise exc_type("from the writer")

        caught_by_except_exception = False
        with pytest.raises(exc_type):
            try:
                with t.layer(1, 0, 4) as layer:
                    layer.run(writer)
            except Exception:  # noqa: BLE001 - must not see Ctrl-C / exit
                caught_by_except_exception = True
        assert not caught_by_except_exception
        info = t.native.last_poison()  # poisoned as before, with the original cause
        assert info["poisoned"] and info["error_code"] == F.ErrorCode.WRITER, info
        assert f"{exc_type.__name__}: from the writer" in info["error_message"], info
        assert t.reset() == 1
        with t.layer(2, 0, 4) as layer:
            layer.run(lambda e, slots: None)


# ---- 2. slot views outlive close() ----------------------------------------------------------------
def test_writer_slot_views_keep_the_segment_mapped(tmp_path):
    (res,) = run_workers(W.slot_view_after_close, 1, str(tmp_path), tmp_path=tmp_path, timeout=60)
    # Expert 3 went through slot 1; the kept views still read its bytes after close().
    assert res["sums"] == [4096 * 13, 256 * 16, 100 * 15], res
    assert res["mapped_open"] == res["before"] + 1, res
    assert res["mapped_kept"] == res["before"] + 1, res  # kept mapped by the views
    assert res["after"] == res["before"], res  # and unmapped once they are gone


# ---- 3. the exchange must be the TP group ---------------------------------------------------------
@pytest.mark.fault
def test_default_world_group_larger_than_tp_group_fails_on_every_rank(tmp_path):
    res = run_workers(W.wrong_exchange_group, 4, str(tmp_path), "world", tmp_path=tmp_path, timeout=120)
    for rank, r in enumerate(res):
        assert r["type"] == "ValueError", (rank, r)
        assert "exchange returned 4 entries" in r["msg"] and "tp_size is 2" in r["msg"], (rank, r)
        assert "group=None is WORLD" in r["msg"], (rank, r)


@pytest.mark.fault
def test_exchange_order_must_match_tp_rank(tmp_path, record_property):
    res = run_workers(W.wrong_exchange_group, 2, str(tmp_path), "order", tmp_path=tmp_path, timeout=60)
    for rank, r in enumerate(res):
        assert r["type"] == "ValueError" and r["dt"] < 10, (rank, r)
        assert "entry 0 came from TP rank 1" in r["msg"] and "entry r must come from TP rank r" in r["msg"], (rank, r)
    record_property("detect_s", max(r["dt"] for r in res))


# ---- 4. FileExchange: private files, sessions, cleanup --------------------------------------------
def _gather(directory, world, payload, delays=None, rounds=2, close=True, timeout_s=10):
    out, errs = [None] * world, []

    def rank_main(r):
        try:
            time.sleep((delays or [0] * world)[r])
            ex = F.FileExchange(directory, r, world, timeout_s=timeout_s)
            res = [ex(payload(r, k)) for k in range(rounds)]
            if close:
                ex.close()
            out[r] = res
        except BaseException as exc:  # noqa: BLE001 - reported below
            errs.append((r, repr(exc)))

    ths = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(30)
    assert not errs, errs
    return out


def test_file_exchange_is_private_and_cleaned_up(tmp_path):
    d = tmp_path / "x"
    modes = []

    def payload(r, k):
        if r == 0 and k == 1:  # every rank published round 1 before anyone reached round 2
            for p in d.glob("s.*/1.*.json"):
                modes.append(stat.S_IMODE(p.stat().st_mode))
            modes.append(stat.S_IMODE(next(d.glob("s.*")).stat().st_mode))
        return {"r": r, "k": k}

    out = _gather(d, 3, payload, rounds=3)
    assert out[1] == [[{"r": r, "k": k} for r in range(3)] for k in range(3)]
    assert modes and all(m == 0o600 for m in modes[:-1]) and modes[-1] == 0o700, [oct(m) for m in modes]
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert os.listdir(d) == []  # the last round's files, the session and session.json are gone


@pytest.mark.fault
def test_file_exchange_never_reads_an_earlier_runs_files(tmp_path):
    d = tmp_path / "x"
    # An earlier run that crashed after one round (its leader, this process, is alive; seats taken)...
    _gather(d, 2, lambda r, k: {"run": "old", "r": r}, rounds=1, close=False)
    # ... and one whose leader died, pointed at by session.json, with its files.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = d / "s.deadbeef"
    stale.mkdir()
    (stale / "1.0.json").write_text(json.dumps({"run": "dead", "r": 0}))
    leader = {"nonce": "deadbeef", "pid": int(dead.stdout), "start": 1, "world_size": 2}
    (stale / "leader.json").write_text(json.dumps(leader))
    (d / "session.json").write_text(json.dumps(leader))
    (d / "1.0.json").write_text(json.dumps({"run": "legacy", "r": 0}))  # an old-format leftover
    # The new run: rank 1 starts first and must wait for rank 0's fresh session.
    out = _gather(d, 2, lambda r, k: {"run": "new", "r": r, "k": k}, delays=[0.4, 0], rounds=2)
    for r in range(2):
        assert out[r] == [[{"run": "new", "r": q, "k": k} for q in range(2)] for k in range(2)], out
    assert not stale.exists()  # the dead leader's session was removed


def test_transport_closes_its_file_exchange(tmp_path):
    d = tmp_path / "x"
    with F.Transport(0, 1, 4, [16] * 4, num_slots=2, backend="cpu", exchange=F.FileExchange(d, 0, 1)) as t:
        assert os.listdir(d) == []
        with t.layer(1, 0, 4) as layer:
            layer.run(lambda e, slots: None)
    with F.Transport(0, 1, 4, [16] * 4, num_slots=2, backend="cpu", exchange=F.FileExchange(d, 0, 1)):
        pass
    assert os.listdir(d) == []


# ---- 5. timeouts name the rank that is missing ----------------------------------------------------
@pytest.mark.fault
def test_timeout_names_the_rank_that_never_joined(tmp_path):
    res = run_workers(FW.rank_never_joins_tp3, 3, str(tmp_path), tmp_path=tmp_path, timeout=90)
    for rank, r in enumerate(res):
        assert r["type"] == "TransportTimeout" and r["code"] == F.ErrorCode.TIMEOUT, (rank, r)
        assert "rank 1 has not joined epoch 1" in r["msg"] and r["peer"] == 1, (rank, r)


@pytest.mark.fault
def test_timeout_names_the_rank_that_did_not_return_from_wait():
    import ctypes
    import mmap

    nb = [64, 16, 32, 16]
    ctl = mmap.mmap(-1, 8192)
    p = ctypes.addressof(ctypes.c_char.from_buffer(ctl))
    F.initialize_fp8_layerwise_control(p, 8192, 2)
    host = [[torch.zeros(64, dtype=torch.uint8) for _ in range(8)] for _ in range(2)]
    dst = [[torch.zeros(4 * n, dtype=torch.uint8) for n in nb] for _ in range(2)]
    allp = [host[r][s * 4 + k].data_ptr() for s in range(2) for r in range(2) for k in range(4)]
    ts = [F.FP8LayerwiseTransport(p, 8192, r, 2, -1, [h.data_ptr() for h in host[r]], [d.data_ptr() for d in dst[r]],
                                  allp if r == 0 else [], nb, 4, 500, backend="cpu") for r in range(2)]
    try:
        errs = []

        def join1():
            try:
                ts[1].join(1, 0, 4)
            except BaseException as exc:  # noqa: BLE001 - asserted in the main thread
                errs.append(exc)

        th = threading.Thread(target=join1)
        th.start()
        ts[0].join(1, 0, 4)
        th.join(30)
        assert not th.is_alive() and errs == [], errs
        ts[0].run(1, 0, 4, lambda e, *a: None)
        ts[0].wait(1)
        with pytest.raises(F.TransportTimeout) as info:  # rank 1 never returns from wait(1)
            ts[0].join(2, 0, 4)
        assert "rank 1 has not returned from wait() of epoch 1" in info.value.message, info.value
        assert info.value.peer == 1 and info.value.rank == 0
    finally:
        for t in ts:
            t.close()


# ---- 7. every constructor argument is checked up front --------------------------------------------
@pytest.mark.parametrize("kw,name", [
    (dict(liveness_ms=-1), "liveness_ms"), (dict(liveness_ms=0.5), "liveness_ms"),
    (dict(timeout_ms=1.5), "timeout_ms"), (dict(timeout_ms=0), "timeout_ms"),
    (dict(coalesce="no"), "coalesce"), (dict(coalesce_wait=1), "coalesce_wait"),
    (dict(batch_small_kinds=None), "batch_small_kinds"),
    (dict(num_experts=2**31), "num_experts"), (dict(num_experts=2.5), "num_experts"),
    (dict(num_experts="4"), "num_experts"),
    (dict(expert_nbytes=[256.5, 64, 128, 32]), r"expert_nbytes\[0\]"),
    (dict(expert_nbytes=[256, 64, 128, True]), r"expert_nbytes\[3\]"),
    (dict(expert_nbytes="abcd"), "expert_nbytes"),
    (dict(max_inflight=-3), "max_inflight"), (dict(max_inflight=100), "max_inflight"),
    (dict(num_slots=2.0), "num_slots"), (dict(copy_streams=1.0), "copy_streams"),
    (dict(rank=0.0), "rank"), (dict(tp_size="1"), "tp_size"), (dict(device=-1), "device"),
    (dict(backend=None), "backend"), (dict(exchange=42), "exchange"),
])
def test_constructor_rejects_bad_arguments_before_anything_is_shared(kw, name):
    calls = []
    args = dict(rank=0, tp_size=1, num_experts=4, expert_nbytes=[256, 64, 128, 32], backend="cpu",
                exchange=lambda o: calls.append(o) or [o])
    args.update(kw)
    with _shm.tagged_segments() as shm:
        with pytest.raises(ValueError, match=name):
            F.Transport(**args)
    # nothing exchanged but the error record that lets the peers fail at once ...
    assert len(calls) <= 1 and all(set(c) == {"error"} and re.search(name, c["error"]) for c in calls), calls
    assert shm.created == []  # ... and no segment created


@pytest.mark.fault
def test_bad_argument_on_one_rank_fails_every_rank_at_once(tmp_path, record_property):
    """Rank 1 passes a bad timeout_ms: it raises ValueError naming it, and rank 0, which would wait
    for rank 1 in the first exchange until that exchange's timeout, raises at once too."""
    from tests._dist import run_workers
    from tests.fp8_layerwise import _workers

    res = run_workers(_workers.bad_argument_on_one_rank, 2, str(tmp_path), tmp_path=tmp_path, timeout=60)
    for rank, (name, msg, dt) in enumerate(res):
        assert name == "ValueError" and "timeout_ms" in msg and dt < 10.0, (rank, name, msg, dt)
    record_property("detect_s", max(dt for _, _, dt in res))
    assert "entry 1 refused its arguments" in res[0][1], res[0]


def test_numpy_bools_and_ints_are_accepted():
    np = pytest.importorskip("numpy")
    with F.Transport(0, 1, np.int32(4), [16] * 4, num_slots=np.int64(2), max_inflight=np.int64(1), backend="cpu",
                     exchange=lambda o: [o], coalesce=np.bool_(False), timeout_ms=np.uint64(5000)) as t:
        with t.layer(1, 0, 4) as layer:
            layer.run(lambda e, slots: None)


# ---- 8. clear errors for a forgotten or repeated run() -------------------------------------------
@pytest.mark.fault
def test_rank0_wait_without_run_names_the_missing_run():
    """A forgotten run() on rank 0: the wait expires (it cannot tell a forgotten run() from a producer
    thread about to start) and says that rank 0 never called run()."""
    with F.Transport(0, 1, 4, [16] * 4, num_slots=2, backend="cpu", exchange=lambda o: [o],
                     timeout_ms=1000) as t:
        t0 = time.monotonic()
        with pytest.raises(F.TransportTimeout, match=r"rank 0 has not called run\(\) for epoch 1") as info:
            with t.layer(1, 0, 4):
                pass  # forgot layer.run(writer)
        assert time.monotonic() - t0 < 10.0
        assert info.value.peer == 0


def test_rank0_wait_before_a_producer_thread_enters_run():
    """KTransformers' pattern: rank 0's producer runs in another thread, which may enter run() only after
    the main thread already waits. That must work, layer after layer."""
    got, errs = [], []

    def produce(probe, epoch):
        try:
            probe.wait()  # the main thread is blocked inside wait(epoch) now
            t.run(epoch, 0, 4, lambda x, slots: None)
        except BaseException as exc:  # noqa: BLE001 - asserted in the main thread
            errs.append((epoch, exc))

    with F.Transport(0, 1, 4, [16] * 4, num_slots=2, backend="cpu", exchange=lambda o: [o],
                     timeout_ms=20000) as t:
        for epoch in (1, 2, 3):
            t.join(epoch, 0, 4)
            with InsideCall(F.Transport.wait, "native.wait(") as probe:
                th = threading.Thread(target=produce, args=(probe, epoch))
                th.start()
                got.append(t.wait(epoch).epoch)
                th.join(30)
            assert not th.is_alive()
    assert errs == [] and got == [1, 2, 3], (errs, got)


@pytest.mark.fault
def test_second_run_says_the_layer_was_already_produced():
    with F.Transport(0, 1, 4, [16] * 4, num_slots=2, backend="cpu", exchange=lambda o: [o]) as t:
        with pytest.raises(F.ProtocolError) as info:
            with t.layer(1, 0, 4) as layer:
                layer.run(lambda e, slots: None)
                layer.run(lambda e, slots: None)
        assert "was called again: rank 0 already produced this layer" in info.value.message, info.value
        assert "does not match" not in info.value.message


@pytest.mark.parametrize("case", ["badarg", "cuda", "create", "attach", "start"])
@pytest.mark.fault
def test_a_rank_failing_its_setup_fails_every_rank_at_once_and_leaves_nothing(tmp_path, case):
    """A rank whose constructor fails (a bad argument; backend="cuda" without a device; creating its
    segments, e.g. a full /dev/shm; mapping its peers' segments; starting the native transport)
    still takes part in the exchange its peers are in, with an error record: every rank raises at
    once, not after the exchange's timeout, and neither /dev/shm nor the exchange folder keeps
    anything."""
    from tests._dist import run_workers
    from tests.fp8_layerwise import _workers
    from tests.fp8_layerwise._timing import fast_bound

    if case == "cuda" and F.built_with_cuda() and torch.cuda.is_available():
        pytest.skip("backend='cuda' works here")
    res = run_workers(_workers.setup_step_fails, 2, str(tmp_path), case, tmp_path=tmp_path, timeout=120)
    bound = fast_bound(2.0, _workers.SETUP_EXCHANGE_TIMEOUT_S)  # 2 s: a FileExchange close waiting for marks
    bad = 0 if case == "attach" else 1
    for rank, (name, msg, dt, left) in enumerate(res):
        assert name is not None and dt < bound, (rank, name, msg, dt)
        assert left == [], (rank, left)
        if rank != bad and case not in ("badarg", "cuda"):
            assert name == "TransportError" and f"failed on rank {bad}" in msg, (rank, name, msg)
    assert os.listdir(tmp_path / "x") == [], os.listdir(tmp_path / "x")
