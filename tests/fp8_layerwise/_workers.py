"""Worker functions for the multi-process fp8_layerwise tests (spawned by tests._dist.run_workers):
byte-exact delivery, KTransformers' design against the defaults, protocol errors and recovery, and
set-ups that must fail on every rank at once (mismatched geometry, a wrong exchange group, a bad
argument or a failing set-up step on one rank). Ranks that die, hang, are signalled or close while
others wait: _fault_workers.py.

Each worker builds a real Transport in its own process; names travel through a FileExchange in
the test's tmp folder (or a gloo group), so nothing here depends on a fixed port.
"""
from __future__ import annotations

import os
import time

import torch

import fp8_layerwise as F
from tests.fp8_layerwise import _reference as R

H, I = 256, 1024  # I/tp = 128 at TP 8: the smallest legal block-FP8 shard


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


def ktransformers_vs_default(rank, ws, rdzv, tmp, backend):
    """KTransformers' design (2 slots, 1 in flight, 4 copies per expert) and the default, same bytes."""
    E = 16
    sources = _sources(E, 99)
    nb = F.block_fp8_expert_nbytes(H, I, ws)
    out = []
    for name, kw in (("ktransformers", dict(num_slots=2, max_inflight=1, coalesce=False, batch_small_kinds=False)),
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
