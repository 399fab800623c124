"""Worker functions of the multi-process fp8_layerwise tests in which a rank fails the others: a
consumer or the producer SIGKILLed, a rank that never joins (TP 2 and 3), close() while a peer is
blocked, reset() with a dead rank, SIGINT during wait() (spawned by tests._dist.run_workers).

Each worker builds a real Transport in its own process; names travel through a FileExchange in
the test's tmp folder, so nothing here depends on a fixed port.
"""
from __future__ import annotations

import os
import signal
import time

import fp8_layerwise as F
from tests.fp8_layerwise._workers import _exchange


#: The liveness interval of the dead-peer workers (the package default, passed explicitly: the
#: tests derive their detection-time bounds from it).
LIVENESS_MS = 20


#: Their timeout: a death noticed only by it is the failure mode the bounds must exclude.
DEAD_PEER_TIMEOUT_MS = 30000


#: sigint_in_wait's timeout (likewise).
SIGINT_TIMEOUT_MS = 30000


def kill_consumer(rank, ws, rdzv, tmp, backend="cpu"):
    """Rank 0 SIGKILLs the last rank while it is streaming; every survivor must see PeerDied fast."""
    import faulthandler

    # A crash here is reported with every thread's Python stack in the test's failure message.
    faulthandler.enable(open(os.path.join(tmp, f"fault.{rank}.txt"), "w"), all_threads=True)
    nb = [4096, 512, 2048, 256]
    ex = _exchange(tmp, "x", rank, ws)
    t = F.Transport(rank, ws, 64, nb, num_slots=2, backend=backend, timeout_ms=DEAD_PEER_TIMEOUT_MS, exchange=ex,
                    liveness_ms=LIVENESS_MS)
    victim = ws - 1
    t.join(1, 0, 64)
    t0 = None
    try:
        if rank == 0:
            def writer(e, slots):
                nonlocal t0
                if e == 5:
                    t0 = time.monotonic()
                    os.kill(t.peer_pids[victim], signal.SIGKILL)
                time.sleep(0.01)
                for r in slots:
                    for v in r:
                        v.fill_(e)
            t.run(1, 0, 64, writer)
        elif rank == victim:
            time.sleep(60)  # killed long before
        t.wait(1)
    except F.TransportPoisoned as exc:
        return dict(type=type(exc).__name__, code=int(exc.code), rank=exc.rank, t_exc=time.monotonic(), t0=t0,
                    msg=exc.message)
    return dict(type=None)


def kill_producer(rank, ws, rdzv, tmp):
    """Rank 0 SIGKILLs itself in the middle of the writer; the consumers must see PeerDied fast."""
    nb = [4096, 512, 2048, 256]
    ex = _exchange(tmp, "x", rank, ws)
    t = F.Transport(rank, ws, 64, nb, num_slots=3, backend="cpu", timeout_ms=DEAD_PEER_TIMEOUT_MS, exchange=ex,
                    liveness_ms=LIVENESS_MS)
    t.join(1, 0, 64)
    if rank == 0:
        def writer(e, slots):
            if e == 7:
                with open(os.path.join(tmp, "killed_at"), "w") as f:
                    f.write(repr(time.monotonic()))
                os.kill(os.getpid(), signal.SIGKILL)
            for r in slots:
                for v in r:
                    v.fill_(e)
        t.run(1, 0, 64, writer)
        return None
    try:
        t.wait(1)
    except F.TransportPoisoned as exc:
        t_exc = time.monotonic()
        with open(os.path.join(tmp, "killed_at")) as f:
            t0 = float(f.read())
        return dict(type=type(exc).__name__, code=int(exc.code), rank=exc.rank, dt=t_exc - t0, msg=exc.message)
    return dict(type=None)


def _one_layer_with_a_late_rank(t, rank, late, wait_s=20.0):
    """Layer 1 of 4 experts; rank ``late`` joins only once the region is poisoned (the others time out
    waiting for it), so its join raises the recorded poison."""
    if rank == late:
        deadline = time.monotonic() + wait_s
        while not t.poisoned and time.monotonic() < deadline:
            time.sleep(0.01)
        t.join(1, 0, 4)  # too late: raises the recorded poison
        return
    t.join(1, 0, 4)
    if rank == 0:
        t.run(1, 0, 4, lambda e, s: None)
    t.wait(1)


def never_joins(rank, ws, rdzv, tmp):
    """The last rank never joins: rank 0's producer times out, every rank reports TIMEOUT."""
    nb = [1024, 128, 512, 64]
    ex = _exchange(tmp, "x", rank, ws)
    t = F.Transport(rank, ws, 4, nb, num_slots=2, backend="cpu", timeout_ms=800, exchange=ex)
    t0 = time.monotonic()
    try:
        _one_layer_with_a_late_rank(t, rank, ws - 1)
    except F.TransportPoisoned as exc:
        return dict(type=type(exc).__name__, code=int(exc.code), dt=time.monotonic() - t0,
                    is_timeout=isinstance(exc, TimeoutError))
    finally:
        t.close()
    return dict(type=None)


def rank_never_joins_tp3(rank, ws, rdzv, tmp):
    """Rank 1 of 3 never joins: every rank's timeout must name rank 1 (message and peer)."""
    nb = [1024, 128, 512, 64]
    ex = _exchange(tmp, "x", rank, ws)
    t = F.Transport(rank, ws, 4, nb, num_slots=2, backend="cpu", timeout_ms=800, exchange=ex)
    try:
        _one_layer_with_a_late_rank(t, rank, 1)
    except F.TransportPoisoned as exc:
        return dict(type=type(exc).__name__, code=int(exc.code), rank=exc.rank, peer=exc.peer, msg=exc.message)
    finally:
        t.close()
    return dict(type=None)


def close_while_blocked(rank, ws, rdzv, tmp, case):
    """Another thread of this process is inside run() / wait() (or the writer itself closes) when
    close() runs: that call must raise TransportClosed and the process must not crash (a crash shows
    up as this worker dying by a signal). Returns what the blocked call raised and what the writer saw.

    No fixed sleeps: each step waits for the state the next one needs (the writer inside its expert,
    close() started, the main thread inside the native wait()).
    """
    import threading
    import warnings

    from tests.fp8_layerwise._timing import InsideCall, poll

    nb = [4096, 512, 2048, 256]
    t = F.Transport(0, 1, 8, nb, num_slots=2, backend="cpu", timeout_ms=20000, exchange=lambda o: [o])
    native = t.native
    out = {"wrote_after_close": False}
    order = []  # "writer_done" / "close_returned", in the order they happened
    order_lock = threading.Lock()
    close_returned = threading.Event()

    def mark(what):
        with order_lock:
            order.append(what)

    def fill(e, slots):
        for r in slots:
            for v in r:
                v.fill_(e)

    def slow_writer(e, slots):
        in_writer.set()
        poll(lambda: native.closed, what="close() starting")  # the main thread is in close() now
        # close() must wait for this expert before it unmaps anything: had it returned, the main thread
        # would set close_returned at once. Give it a generous second to show such a bug (in a correct
        # transport the wait always runs out, whatever the machine's load).
        out["close_returned_during_writer"] = close_returned.wait(1.0)
        fill(e, slots)
        out["wrote_after_close"] = t.closed
        mark("writer_done")

    def closing_writer(e, slots):
        if e == 1:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t.close()  # from inside the writer: cannot wait for itself, keeps the memory mapped
            out["warnings"] = [str(w.message) for w in caught]
        fill(e, slots)  # the slots must still be mapped
        out["wrote_after_close"] = t.closed

    def parked_writer(e, slots):
        # Keeps run() (in its own thread) inside expert 0 until close() has stopped it, so wait() blocks.
        in_writer.set()
        poll(lambda: native.poisoned, what="close() poisoning the active layer")  # set after its stop flag

    in_writer = threading.Event()

    def record_exc(key, fn):
        try:
            fn()
            out[key] = None
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out[key] = (type(exc).__name__, str(exc), isinstance(exc, F.TransportError))

    t.join(1, 0, 8)
    if case == "wait":
        # The main thread waits (rank 0 must have started run() first, else ProtocolError at once: the
        # producer runs in another thread and never finishes its first expert); a third thread closes
        # once the main thread is inside the native wait().
        producer = threading.Thread(target=record_exc, args=("run_exc", lambda: t.run(1, 0, 8, parked_writer)))
        producer.start()
        assert in_writer.wait(30)
        with InsideCall(F.Transport.wait, "native.wait(") as probe:
            closer = threading.Thread(target=record_exc, args=("closer_exc", lambda: (probe.wait(), t.close())))
            closer.start()
            record_exc("exc", lambda: t.wait(1))
            closer.join(30)
        producer.join(30)
        out["thread_alive"] = producer.is_alive() or closer.is_alive()
        return out
    th = threading.Thread(target=record_exc, args=(
        "exc", lambda: t.run(1, 0, 8, slow_writer if case == "run" else closing_writer)))
    th.start()
    if case == "run":
        assert in_writer.wait(30)
        t0 = time.monotonic()
        t.close()
        out["close_s"] = time.monotonic() - t0
        mark("close_returned")
        close_returned.set()
    th.join(30)
    out["thread_alive"] = th.is_alive()
    out["order"] = order
    return out


def reset_with_dead_rank(rank, ws, rdzv, tmp):
    """After a poison the last rank dies; the others' reset() must report PeerDied naming it within
    the liveness interval (every rank watches every rank during reset), not at the timeout."""
    nb = [1024, 128, 512, 64]
    ex = _exchange(tmp, "x", rank, ws)
    t = F.Transport(rank, ws, 4, nb, num_slots=2, backend="cpu", timeout_ms=DEAD_PEER_TIMEOUT_MS, exchange=ex,
                    liveness_ms=LIVENESS_MS)
    sync = _exchange(tmp, "sync", rank, ws)
    if rank == 0:
        t.poison(F.ErrorCode.USER, "poisoned by the test")
    sync(0)
    if rank == ws - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        t.reset()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return dict(type=type(exc).__name__, base=isinstance(exc, F.TransportError), code=int(getattr(exc, "code", -1)),
                    rank=getattr(exc, "rank", None), msg=str(exc), dt=time.monotonic() - t0)
    return dict(type=None, dt=time.monotonic() - t0)


def sigint_in_wait(rank, ws, rdzv, tmp):
    """Rank 0 SIGINTs rank 1 while rank 1 is blocked in wait() (GIL released): rank 1 must raise
    KeyboardInterrupt at once, and rank 0's run() must stop with the interruption as its cause."""
    import threading

    from tests.fp8_layerwise._timing import InsideCall, poll

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if the launcher ignored SIGINT
    nb = [1024, 128, 512, 64]
    ex = _exchange(tmp, "x", rank, ws)
    t = F.Transport(rank, ws, 64, nb, num_slots=2, backend="cpu", timeout_ms=SIGINT_TIMEOUT_MS, exchange=ex,
                    liveness_ms=LIVENESS_MS)
    sent = os.path.join(tmp, "sigint_sent_at")
    inside = os.path.join(tmp, "rank1_inside_wait")
    try:
        t.join(1, 0, 64)
        if rank == 0:
            def writer(e, slots):
                if e == 10:
                    poll(lambda: os.path.exists(inside), what="rank 1 blocking in wait(1)")
                    with open(sent, "w") as f:
                        f.write(repr(time.monotonic()))
                    os.kill(t.peer_pids[1], signal.SIGINT)
                time.sleep(0.02)
            t.run(1, 0, 64, writer)
            t.wait(1)
        else:
            with InsideCall(F.Transport.wait, "native.wait(") as probe:
                def tell():
                    probe.wait()
                    open(inside, "w").close()
                threading.Thread(target=tell, daemon=True).start()
                t.wait(1)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        t_exc = time.monotonic()
        with open(sent) as f:
            t0 = float(f.read())
        info = t.native.last_poison()
        return dict(type=type(exc).__name__, dt=t_exc - t0, code=int(getattr(exc, "code", -1)),
                    rank=getattr(exc, "rank", None), poison=(info["error_code"], info["error_rank"]),
                    msg=info["error_message"])
    finally:
        t.close()
    return dict(type=None)
