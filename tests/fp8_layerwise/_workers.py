"""Worker functions for the multi-process fp8_layerwise tests (spawned by tests._dist.run_workers).

Each worker builds a real Transport in its own process; names travel through a FileExchange in
the test's tmp folder (or a gloo group), so nothing here depends on a fixed port.
"""
from __future__ import annotations

import os
import signal
import time

import torch

import fp8_layerwise as F
from tests.fp8_layerwise import _reference as R

H, I = 256, 1024  # I/tp = 128 at TP 8: the smallest legal block-FP8 shard
#: The liveness interval of the dead-peer workers (the package default, passed explicitly: the
#: tests derive their detection-time bounds from it).
LIVENESS_MS = 20
#: Their timeout: a death noticed only by it is the failure mode the bounds must exclude.
DEAD_PEER_TIMEOUT_MS = 30000
#: sigint_in_wait's timeout (likewise).
SIGINT_TIMEOUT_MS = 30000


def _exchange(tmp, name, rank, ws):
    return F.FileExchange(os.path.join(tmp, name), rank, ws)


def _sources(num_experts, seed):
    g = torch.Generator().manual_seed(seed)
    return F.make_block_fp8_sources(num_experts, H, I, generator=g)


def _check_delivery(t, sources, tp, rank, n):
    bad = []
    for e in range(n):
        ref = R.expert_shard(sources, tp, rank, e)
        for k in range(4):
            got = t.expert_view(k, e).cpu()
            if not torch.equal(got, ref[k]):
                bad.append((e, k))
    return bad


def delivery(rank, ws, rdzv, tmp, slot_counts, expert_counts, use_gloo, backend, stream_counts=(2,),
             coalesce_wait=False, batch_small_kinds=False):
    """Byte-exact delivery of native-writer shards for several slot, expert and copy-stream counts."""
    exchange = None
    if use_gloo:
        from tests._dist import init_gloo

        init_gloo(rank, ws, rdzv)
    E = max(expert_counts)
    sources = _sources(E, 1234)
    nb = F.block_fp8_expert_nbytes(H, I, ws)
    out = []
    for slots, streams in [(s, c) for s in slot_counts for c in stream_counts]:
        if not use_gloo:
            exchange = _exchange(tmp, f"x{slots}_{streams}", rank, ws)
        with F.Transport(rank, ws, E, nb, num_slots=slots, backend=backend, timeout_ms=20000,
                         exchange=exchange, copy_streams=streams, coalesce_wait=coalesce_wait,
                         batch_small_kinds=batch_small_kinds) as t:
            writer = F.make_shard_writer(sources, ws, threads=2) if rank == 0 else None
            epoch = 0
            for n in expert_counts:
                epoch += 1
                for b in t.buffers:
                    b.fill_(0)
                with t.layer(epoch, 3, n) as layer:
                    if rank == 0:
                        layer.run(writer)
                st = layer.stats
                want = n * sum(nb)
                out.append(dict(slots=slots, streams=streams, n=n, bad=_check_delivery(t, sources, ws, rank, n),
                                bytes=st.bytes, want=want, copies=st.copies,
                                untouched=bool(all(int(b[n * nbk:].count_nonzero()) == 0
                                                   for b, nbk in zip(t.buffers, nb)))))
    return out


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


def protocol_and_recovery(rank, ws, rdzv, tmp):
    """Cross-rank protocol violations, concurrent poison claims, close-while-active, and reset."""
    nb = [2048, 256, 1024, 128]
    log = []
    ex = _exchange(tmp, "x", rank, ws)
    t = F.Transport(rank, ws, 8, nb, num_slots=2, backend="cpu", timeout_ms=10000, exchange=ex)
    sync = _exchange(tmp, "sync", rank, ws)

    def fill(e, slots):
        for r, views in enumerate(slots):
            for k, v in enumerate(views):
                v.fill_((e * 16 + r * 4 + k + epoch) % 251)

    def ok_layer(epoch_, n=8):
        nonlocal epoch
        epoch = epoch_
        with t.layer(epoch_, 1, n) as L:
            if rank == 0:
                L.run(fill)
        for e in range(n):
            for k in range(4):
                assert bool((t.expert_view(k, e) == (e * 16 + rank * 4 + k + epoch_) % 251).all()), (epoch_, e, k)
        return L.stats

    def expect_poison(fn):
        try:
            fn()
        except F.TransportPoisoned as exc:
            return (type(exc).__name__, int(exc.code), exc.rank)
        return None

    epoch = 0
    ok_layer(1)
    # 1) layer_id mismatch on the last rank.
    def mismatch():
        t.join(2, 1 if rank != ws - 1 else 99, 8)
        if rank == 0:
            t.run(2, 1, 8, fill)
        t.wait(2)
    log.append(("mismatch", expect_poison(mismatch)))
    t.reset()
    sync(0)
    ok_layer(3)
    # 2) the producer called on rank 1.
    def producer_on_1():
        t.join(4, 1, 8)
        if rank == 1:
            t.run(4, 1, 8, fill)
        elif rank == 0:
            # Rank 0 calling wait() without run() is an error of its own (raised at once): let rank 1's
            # misuse be recorded first, it is the cause this case checks.
            deadline = time.monotonic() + 10
            while not t.poisoned and time.monotonic() < deadline:
                time.sleep(0.005)
        t.wait(4)
    log.append(("producer_on_1", expect_poison(producer_on_1)))
    t.reset()
    sync(0)
    # 3) concurrent poison claims: exactly one rank wins.
    sync(0)
    won = t.poison(int(F.ErrorCode.USER), f"claim by rank {rank}")
    info = t.native.last_poison()
    log.append(("claim", won, info["error_rank"]))
    sync(0)
    t.reset()
    sync(0)
    ok_layer(5, n=3)
    # 4) the last rank closes while the layer is active: everyone else gets CLOSED_WHILE_ACTIVE.
    if rank == ws - 1:
        t.join(6, 1, 8)
        t.close()
        t.close()  # double close is a no-op
        log.append(("closed", t.closed))
    else:
        def active():
            t.join(6, 1, 8)
            if rank == 0:
                t.run(6, 1, 8, fill)
            t.wait(6)
        log.append(("closed", expect_poison(active)))
    t.close()
    return log


def legacy_vs_default(rank, ws, rdzv, tmp, backend):
    """The seed design (2 slots, 1 in flight, 4 copies per expert) and the default, same bytes."""
    E = 16
    sources = _sources(E, 99)
    nb = F.block_fp8_expert_nbytes(H, I, ws)
    out = []
    for name, kw in (("seed", dict(num_slots=2, max_inflight=1, coalesce=False, batch_small_kinds=False)),
                     ("default", {})):
        ex = _exchange(tmp, name, rank, ws)
        with F.Transport(rank, ws, E, nb, backend=backend, timeout_ms=20000, exchange=ex, **kw) as t:
            w = F.make_shard_writer(sources, ws) if rank == 0 else None
            with t.layer(1, 0, E) as layer:
                if rank == 0:
                    layer.run(w)
            out.append(dict(mode=name, bad=_check_delivery(t, sources, ws, rank, E), copies=layer.stats.copies,
                            bytes=layer.stats.bytes, want=E * sum(nb)))
    return out


def writer_error_reset(rank, ws, rdzv, tmp, backend):
    """A Python writer raises at expert 3: every rank gets WRITER; after reset() a layer is exact."""
    nb = [4096, 512, 2048, 256]
    E = 8
    ex = _exchange(tmp, "x", rank, ws)
    out = {}
    with F.Transport(rank, ws, E, nb, num_slots=2, backend=backend, timeout_ms=20000, exchange=ex) as t:
        def fill(e, slots):
            for r, views in enumerate(slots):
                for k, v in enumerate(views):
                    v.fill_((e * 8 + r * 4 + k) % 251)

        def bad(e, slots):
            if e == 3:
                raise ValueError("synthetic writer failure")
            fill(e, slots)

        try:
            with t.layer(1, 0, E) as L:
                if rank == 0:
                    L.run(bad)
        except F.TransportPoisoned as exc:
            out["first"] = (type(exc).__name__, int(exc.code), exc.rank, exc.message)
        out["generation"] = t.reset()
        with t.layer(2, 0, E) as L:
            if rank == 0:
                L.run(fill)
        out["exact"] = all(bool((t.expert_view(k, e).cpu() == (e * 8 + rank * 4 + k) % 251).all())
                           for e in range(E) for k in range(4))
        out["bytes"] = L.stats.bytes == E * sum(nb)
    return out


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


def geometry_mismatch(rank, ws, rdzv, tmp, field):
    """The last rank disagrees with rank 0 on one of expert_nbytes / num_experts / num_slots: every
    rank must raise at once (before anything is shared), none may stream at mismatched offsets."""
    kw = dict(nb=[4096, 512, 2048, 256], num_experts=4, num_slots=2)
    if rank == ws - 1:
        kw[field] = {"nb": [4096, 512, 2048, 512], "num_experts": 6, "num_slots": 3}[field]
    ex = _exchange(tmp, "x", rank, ws)
    t0 = time.monotonic()
    try:
        with F.Transport(rank, ws, kw["num_experts"], kw["nb"], num_slots=kw["num_slots"], backend="cpu",
                         timeout_ms=5000, exchange=ex) as t:
            def w(e, slots):
                for views in slots:
                    for k, v in enumerate(views):
                        v.fill_(10 * e + k + 1)
            with t.layer(1, 0, 4) as layer:
                if rank == 0:
                    layer.run(w)
            return dict(type=None, bytes=layer.stats.bytes)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return dict(type=type(exc).__name__, msg=str(exc), dt=time.monotonic() - t0)


def join_without_wait(rank, ws, rdzv, tmp):
    """Rank 1 joins epoch 2 without wait(1): it raises ProtocolError at once, and rank 0 (which would
    wait for rank 1's wait(1)) gets the same error fast instead of the timeout."""
    nb = [1024, 128, 512, 64]
    ex = _exchange(tmp, "x", rank, ws)
    t = F.Transport(rank, ws, 4, nb, num_slots=2, backend="cpu", timeout_ms=20000, exchange=ex)
    t0 = time.monotonic()
    try:
        t.join(1, 0, 4)
        if rank == 0:
            t.run(1, 0, 4, lambda e, s: None)
            t.wait(1)
        t.join(2, 0, 4)  # rank 1 skipped wait(1)
        if rank == 0:
            t.run(2, 0, 4, lambda e, s: None)
        t.wait(2)
    except F.TransportPoisoned as exc:
        return dict(type=type(exc).__name__, code=int(exc.code), rank=exc.rank, msg=exc.message,
                    dt=time.monotonic() - t0)
    finally:
        t.close()
    return dict(type=None)


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


def slot_view_after_close(rank, ws, rdzv, tmp):
    """A Python writer keeps slot tensors (and a view of one) past close(): reading them must not crash
    (the segment stays mapped while they live) and the mapping must go once they are gone."""
    import gc

    def slot_maps():
        with open("/proc/self/maps") as f:
            return sum("fp8lw_slots" in line for line in f)

    before = slot_maps()
    kept = []
    with F.Transport(0, 1, 4, [4096, 512, 2048, 256], num_slots=2, backend="cpu", exchange=lambda o: [o]) as t:
        def writer(e, slots):
            for k, v in enumerate(slots[0]):
                v.fill_(e * 4 + k + 1)
            if e == 3:
                kept.extend([slots[0][0], slots[0][3], slots[0][2][100:200]])
        with t.layer(1, 0, 4) as layer:
            layer.run(writer)
        mapped_open = slot_maps()
    gc.collect()
    sums = [int(v.to(torch.int64).sum()) for v in kept]  # after close: must not crash
    mapped_kept = slot_maps()
    del kept, writer, layer
    gc.collect()
    return dict(sums=sums, before=before, mapped_open=mapped_open, mapped_kept=mapped_kept, after=slot_maps())


def wrong_exchange_group(rank, ws, rdzv, tmp, case):
    """The exchange does not match the TP group: `world` = WORLD of 4 gloo processes with tp_size 2 and
    group=None; `order` = 2 processes whose exchange order is the reverse of their TP ranks."""
    nb = [1024, 128, 512, 64]
    t0 = time.monotonic()
    try:
        if case == "world":
            from tests._dist import init_gloo

            init_gloo(rank, ws, rdzv)
            tp_rank, kw = rank % 2, {}
        else:
            tp_rank, kw = ws - 1 - rank, dict(exchange=_exchange(tmp, "x", rank, ws))
        with F.Transport(tp_rank, 2, 4, nb, num_slots=2, backend="cpu", timeout_ms=5000, **kw):
            return dict(type=None)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return dict(type=type(exc).__name__, msg=str(exc), dt=time.monotonic() - t0)


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


def bad_argument_on_one_rank(rank, ws, rdzv, tmp):
    """Rank 1 passes timeout_ms=1.5 (not an int); both ranks report what they raised and how fast."""
    ex = _exchange(tmp, "badarg", rank, ws)
    t0 = time.monotonic()
    try:
        F.Transport(rank, ws, 4, [256, 64, 128, 32], num_slots=2, backend="cpu", exchange=ex,
                    timeout_ms=1.5 if rank == 1 else 5000)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None, "", time.monotonic() - t0


#: setup_step_fails' exchange timeout: a peer that waits for the failed rank until it is the bug.
SETUP_EXCHANGE_TIMEOUT_S = 30.0


def setup_step_fails(rank, ws, rdzv, tmp, case):
    """One rank fails one step of the collective setup (``case``): its peers must raise at once, naming
    it, instead of waiting in the next exchange until its timeout; no segment and no exchange file
    may stay. Returns (exception type, message, seconds, names this rank left in /dev/shm)."""
    from fp8_layerwise import _C
    from fp8_layerwise import transport as T
    from tests.fp8_layerwise import _shm

    bad = 0 if case == "attach" else 1
    kw = dict(backend="cpu", timeout_ms=5000)

    def fail(*a, **k):
        raise T.TransportError(f"simulated failure on rank {rank} ({case})")

    if rank == bad:
        if case == "badarg":
            kw["timeout_ms"] = 1.5
        elif case == "cuda":
            kw["backend"] = "cuda"  # no usable CUDA device here: TransportError before the first exchange
        elif case == "create":
            T.HostSlots.create = classmethod(lambda cls, *a: (_ for _ in ()).throw(
                ValueError("shared memory too small: simulated")))
        elif case == "attach":
            T.HostSlots.attach = classmethod(lambda cls, *a: fail())
        elif case == "start":
            _C.FP8LayerwiseTransport = fail
    ex = F.FileExchange(os.path.join(tmp, "x"), rank, ws, timeout_s=SETUP_EXCHANGE_TIMEOUT_S)
    t0 = time.monotonic()
    with _shm.tagged_segments() as shm:
        try:
            F.Transport(rank, ws, 4, [1024, 128, 512, 64], num_slots=2, exchange=ex, **kw).close()
            return None, "", time.monotonic() - t0, shm.linked()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return type(exc).__name__, str(exc), time.monotonic() - t0, shm.linked()
