"""TP 1 in one process: the full protocol (producer + consumer thread) on the CPU backend."""
import threading
import time

import pytest
import torch

import fp8_layerwise as F
from tests.fp8_layerwise import _reference as R
from tests.fp8_layerwise._timing import InsideCall, fast_bound

EX = staticmethod(lambda o: [o])


def make(num_experts, nb, slots=2, **kw):
    kw.setdefault("timeout_ms", 5000)
    return F.Transport(0, 1, num_experts, nb, num_slots=slots, backend="cpu", exchange=lambda o: [o], **kw)


def pattern_writer(layer):
    def w(e, slots):
        for r, views in enumerate(slots):
            for k, v in enumerate(views):
                v.copy_(torch.arange(v.numel(), dtype=torch.int64).add_(layer * 131 + e * 7 + k).remainder_(251)
                        .to(torch.uint8))
    return w


def expect(layer, e, k, n):
    return torch.arange(n, dtype=torch.int64).add_(layer * 131 + e * 7 + k).remainder_(251).to(torch.uint8)


@pytest.mark.parametrize("slots", [2, 3, 4, 8])
@pytest.mark.parametrize("nb", [[4096, 512, 2048, 256], [1, 3, 7, 4099]])  # aligned and odd sizes
def test_delivery_slots_counts_odd_sizes(slots, nb):
    E = 9
    with make(E, nb, slots) as t:
        for epoch, n in enumerate([1, 2, slots, slots + 1, E], start=1):
            for b in t.buffers:
                b.fill_(0)
            with t.layer(epoch, epoch, n) as layer:
                layer.run(pattern_writer(epoch))
            for e in range(n):
                for k in range(4):
                    assert torch.equal(t.expert_view(k, e), expect(epoch, e, k, nb[k])), (n, e, k)
            for k in range(4):
                assert int(t.buffers[k][n * nb[k]:].count_nonzero()) == 0
            st = layer.stats
            assert st.bytes == n * sum(nb) and st.expert_count == n and st.layer_id == epoch and st.epoch == epoch
            assert not st.poisoned and st.total_ms >= st.writer_ms


@pytest.mark.parametrize("threads", [1, 3])
def test_native_shard_writer_matches_torch_reference(threads):
    E, H, I = 5, 512, 768
    src = F.make_block_fp8_sources(E, H, I, generator=torch.Generator().manual_seed(7))
    nb = F.block_fp8_expert_nbytes(H, I, 1)
    w = F.make_shard_writer(src, 1, threads=threads)
    with make(E, nb, 3) as t:
        with t.layer(1, 0, E) as layer:
            layer.run(w)
        for e in range(E):
            ref = R.expert_shard(src, 1, 0, e)
            for k in range(4):
                assert torch.equal(t.expert_view(k, e), ref[k])


@pytest.mark.parametrize("threads,hint", [(1, "none"), (4, "none"), (4, "demote"), (1, "writeback"), (4, "flush")])
@pytest.mark.parametrize("misalign", [0, 8, 3], ids=["aligned", "dst_off_by_8", "dst_off_by_3"])
def test_native_writer_splits_ranks_like_reference(threads, hint, misalign):
    # The native writer's per-rank cut (gate/up halves, w2 columns, block scales) against torch,
    # into destinations at any byte offset; the bytes after each shard stay untouched. Every cache
    # hint must leave the bytes as plain stores do (hints on lines shared with a neighbour included).
    if not F._C.cache_hint_supported(hint):
        pytest.skip(f"this CPU lacks the instruction of cache hint {hint!r}")
    E, H, I = 2, 1024, 768  # 2.4 MB per expert: above the 1 MB threshold of the threaded path
    src = F.make_block_fp8_sources(E, H, I, generator=torch.Generator().manual_seed(3))
    for tp in (2, 3, 6):
        nb = F.block_fp8_expert_nbytes(H, I, tp)
        w = F.make_shard_writer(src, tp, threads=threads, cache_hint=hint)
        assert w.cache_hint == hint
        for e in range(E):
            backing = [[torch.zeros(nb[k] + 64, dtype=torch.uint8) for _ in range(tp)] for k in range(4)]
            base = [[b[(-b.data_ptr()) % 16 + misalign:] for b in row] for row in backing]
            out = [[b[:nb[k]] for b in base[k]] for k in range(4)]
            w.write(e, [[t.data_ptr() for t in out[k]] for k in range(4)])
            for k in range(4):
                for b in base[k]:
                    assert int(b[nb[k]:].count_nonzero()) == 0, "the writer wrote past a shard"
            for r in range(tp):
                ref = R.expert_shard(src, tp, r, e)
                for k in range(4):
                    assert torch.equal(out[k][r], ref[k]), (tp, e, r, k)


def test_1000_layers_no_stale_data():
    nb = [64, 8, 32, 4]
    E = 4
    with make(E, nb, 2) as t:
        for epoch in range(1, 1001):
            n = 1 + epoch % E
            with t.layer(epoch, epoch % 61, n) as layer:
                layer.run(pattern_writer(epoch))
            for k in range(4):
                buf = t.buffers[k][: n * nb[k]].view(n, nb[k])
                want = torch.stack([expect(epoch, e, k, nb[k]) for e in range(n)])
                assert torch.equal(buf, want), (epoch, k)
            assert layer.stats.bytes == n * sum(nb)


def test_seed_design_mode_uses_four_copies_per_expert():
    nb = [4096, 512, 2048, 256]
    with make(8, nb, 2, max_inflight=1, coalesce=False, batch_small_kinds=False) as t:
        with t.layer(1, 0, 8) as layer:
            layer.run(pattern_writer(1))
        assert layer.stats.copies == 4 * 8
    with make(8, nb, 4) as t:  # coalescing and the batched small kinds can only reduce the count
        with t.layer(1, 0, 8) as layer:
            layer.run(pattern_writer(1))
        assert layer.stats.copies <= 2 * 8 + 2  # all four kinds are <= 64 KiB here: batched


def _poison_of(fn):
    with pytest.raises(F.TransportPoisoned) as info:
        fn()
    return info.value


def test_epoch_zero_and_range_errors():
    with make(4, [16, 16, 16, 16]) as t:
        with pytest.raises(ValueError, match="epoch 0 is reserved"):
            t.join(0, 0, 4)
        with pytest.raises(ValueError, match="expert_count must be in 1..4"):
            t.join(1, 0, 5)
        with pytest.raises(ValueError, match="expert_count must be in 1..4"):
            t.join(1, 0, 0)
        with pytest.raises(ValueError, match="layer_id must be non-negative"):
            t.join(1, -1, 1)
        assert not t.poisoned  # argument errors are raised before anything is shared


@pytest.mark.parametrize("case", ["reuse", "decrease", "wait_before_join", "layer_mismatch", "count_mismatch",
                                  "double_wait"])
def test_protocol_violations_poison(case):
    with make(4, [16, 16, 16, 16]) as t:
        with t.layer(5, 0, 4) as layer:
            layer.run(pattern_writer(5))
        if case == "reuse":
            exc = _poison_of(lambda: t.join(5, 0, 4))
        elif case == "decrease":
            exc = _poison_of(lambda: t.join(4, 0, 4))
        elif case == "wait_before_join":
            exc = _poison_of(lambda: t.wait(6))
        elif case == "double_wait":
            exc = _poison_of(lambda: t.wait(5))
        else:
            t.join(6, 0, 4)
            args = (6, 1, 4) if case == "layer_mismatch" else (6, 0, 3)
            exc = _poison_of(lambda: t.run(*args, pattern_writer(6)))
        assert isinstance(exc, F.ProtocolError) and exc.code == F.ErrorCode.PROTOCOL and exc.rank == 0
        # sticky: the next call raises the same original cause
        again = _poison_of(lambda: t.join(99, 0, 4))
        assert again.message == exc.message
        t.reset()
        with t.layer(100, 0, 4) as layer:
            layer.run(pattern_writer(100))
        assert torch.equal(t.expert_view(2, 3), expect(100, 3, 2, 16))


@pytest.mark.parametrize("k", [0, 3, 7])
def test_writer_raises_at_expert_k_then_reset(k):
    nb = [256, 32, 128, 16]
    with make(8, nb, 3) as t:
        def bad(e, slots):
            if e == k:
                raise KeyError(f"boom at {e}")
            pattern_writer(1)(e, slots)
        with pytest.raises(F.TransportPoisoned) as info:
            with t.layer(1, 0, 8) as layer:
                layer.run(bad)
        exc = info.value
        assert exc.code == F.ErrorCode.WRITER and exc.rank == 0
        assert f"writer failed at expert {k}: KeyError: 'boom at {k}'" in exc.message
        assert _poison_of(lambda: t.join(2, 0, 8)).message == exc.message
        assert t.reset() == 1
        with t.layer(3, 0, 8) as layer:
            layer.run(pattern_writer(3))
        for e in range(8):
            assert torch.equal(t.expert_view(0, e), expect(3, e, 0, nb[0]))


def test_exception_inside_layer_block_poisons():
    with make(2, [16] * 4) as t:
        with pytest.raises(ZeroDivisionError):
            with t.layer(1, 0, 2):
                1 / 0
        exc = _poison_of(lambda: t.join(2, 0, 2))
        assert exc.code == F.ErrorCode.USER and "ZeroDivisionError" in exc.message


def test_close_while_active_and_double_close():
    t = make(4, [16] * 4)
    t.join(1, 0, 4)
    info = t.native.last_poison()
    assert not info["poisoned"]
    native = t.native
    t.close()
    t.close()  # idempotent
    assert t.closed
    info = native.last_poison()
    assert info["poisoned"] and info["error_code"] == F.ErrorCode.CLOSED_WHILE_ACTIVE
    with pytest.raises(F.TransportError, match="closed"):
        t.join(2, 0, 4)


def test_close_from_another_thread_unblocks_wait():
    # The main thread is blocked in wait(1) (its producer, in another thread, is parked inside expert 0)
    # when a third thread closes the transport: wait() and run() both raise TransportClosed, promptly.
    timeout_ms = 60000
    t = make(4, [16] * 4, timeout_ms=timeout_ms)
    t.join(1, 0, 4)
    native = t.native
    res = {}

    def parked_writer(e, slots):  # never finishes expert 0 until close() runs
        while not native.poisoned:  # close() set its stop flag, then poisoned the active layer
            time.sleep(0.002)

    def produce():
        try:
            t.run(1, 0, 4, parked_writer)
            res["run"] = "returned"
        except BaseException as exc:  # noqa: BLE001 - asserted in the main thread
            res["run"] = exc

    def close_when_waiting(probe):
        try:
            probe.wait()  # the main thread is inside the native wait() now
            res["t_close"] = time.monotonic()
            res["closed"] = native.close()
        except BaseException as exc:  # noqa: BLE001 - asserted in the main thread
            res["closer"] = exc

    producer = threading.Thread(target=produce)
    producer.start()
    with InsideCall(F.Transport.wait, "native.wait(") as probe:
        closer = threading.Thread(target=close_when_waiting, args=(probe,))
        closer.start()
        with pytest.raises(F.TransportClosed, match=r"closed while wait\(\) was blocked") as info:
            t.wait(1)  # the producer never publishes; close() must release the waiter
        t_exc = time.monotonic()
        closer.join(30)
    producer.join(30)
    assert not producer.is_alive() and not closer.is_alive()
    assert "closer" not in res, res
    assert isinstance(res["run"], F.TransportClosed), res
    assert "closed while run() was blocked" in str(res["run"]), res
    assert res["closed"] is True, res
    assert t_exc - res["t_close"] < fast_bound(0, timeout_ms / 1000), (t_exc - res["t_close"], info.value)
    t.close()


def test_timeout_resets_on_progress():
    # A writer slower than timeout_ms in total, but faster than it per expert, must succeed. Each expert
    # takes 1/8 of the timeout, leaving a loaded machine 1.75 s of scheduling delay per expert.
    timeout_ms, n = 2000, 12
    with make(n, [16] * 4, 2, timeout_ms=timeout_ms) as t:
        def slow(e, slots):
            time.sleep(timeout_ms / 8000)
            pattern_writer(1)(e, slots)
        with t.layer(1, 0, n) as layer:
            layer.run(slow)
        assert not layer.stats.poisoned and layer.stats.total_ms > timeout_ms  # n / 8 timeouts of writing
        assert all(torch.equal(t.expert_view(0, e), expect(1, e, 0, 16)) for e in range(n))


def test_poison_claim_exactly_once():
    with make(2, [16] * 4) as t:
        assert t.poison(F.ErrorCode.USER, "first") is True
        assert t.poison(F.ErrorCode.USER, "second") is False
        assert t.native.last_poison()["error_message"] == "first"


def test_claimer_died_while_claimed_is_reported():
    # A process that died between claiming the record and publishing it leaves state CLAIMED:
    # readers must not hang on it, and report the incomplete publication after ~10 ms.
    import ctypes

    timeout_ms = 20000  # a reader that waited for the claim to complete would run into it
    with make(2, [16] * 4, timeout_ms=timeout_ms) as t:
        state = ctypes.c_uint64.from_address(t._control.ptr + 64)  # PoisonRecord follows the 64 B header
        state.value = 2**64 - 1
        t0 = time.monotonic()
        exc = _poison_of(lambda: t.join(1, 0, 2))
        assert "did not complete" in exc.message
        assert time.monotonic() - t0 < fast_bound(0.01, timeout_ms / 1000)
        assert t.poison(F.ErrorCode.USER, "late") is False  # the claim is still held


def test_exceptions_pickle_and_map_codes():
    import pickle

    for code, cls in [(1, F.ProtocolError), (2, F.TransportTimeout), (7, F.PeerDied), (5, F.TransportPoisoned)]:
        exc = F.errors._from_native(code, 3, "why", "text")
        assert type(exc) is cls and exc.code == code and exc.rank == 3 and exc.message == "why"
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is cls and back.code == code and back.message == "why" and str(back) == "text"
    assert isinstance(F.errors._from_native(2, 0, "", ""), TimeoutError)


@pytest.mark.parametrize("slots", [2, 3, 16])
def test_host_slot_layout_contiguous_aligned_disjoint(slots):
    nb = [1, 4099, 7, 8192]
    offsets, total = F.HostSlots.layout(nb, slots)
    regions = []
    for k in range(4):
        assert offsets[k] % 4096 == 0  # every kind starts page-aligned
        # slot s+1 of a kind directly follows slot s: what lets the consumer merge copies
        regions.append((offsets[k], offsets[k] + slots * nb[k]))
    regions.sort()
    for (a0, a1), (b0, b1) in zip(regions, regions[1:]):
        assert a1 <= b0
    assert regions[-1][1] <= total and total % 4096 == 0


def test_every_expert_count_from_1_to_num_experts():
    nb = [40, 8, 24, 4]
    E = 11
    with make(E, nb, 3) as t:
        for n in range(1, E + 1):
            for b in t.buffers:
                b.fill_(0)
            with t.layer(n, 0, n) as layer:
                layer.run(pattern_writer(n))
            for k in range(4):
                want = torch.stack([expect(n, e, k, nb[k]) for e in range(n)])
                assert torch.equal(t.buffers[k][: n * nb[k]].view(n, nb[k]), want), (n, k)
                assert int(t.buffers[k][n * nb[k]:].count_nonzero()) == 0
            assert layer.stats.bytes == n * sum(nb)


def test_default_slot_count_follows_expert_size():
    # DeepSeek-V3 block-FP8 shards: TP1/TP2 experts (44 / 22 MB per rank) get 2 slots, TP4/TP8 (11 / 5.5 MB) get 4.
    sizes = {tp: F.block_fp8_expert_nbytes(7168, 2048, tp) for tp in (1, 2, 4, 8)}
    assert [F.default_num_slots(sizes[tp]) for tp in (1, 2, 4, 8)] == [2, 2, 4, 4]
    assert F.default_num_slots([F.SMALL_EXPERT_BYTES, 0, 0, 0]) == F.DEFAULT_SLOTS
    assert F.default_num_slots([F.SMALL_EXPERT_BYTES - 1, 0, 0, 0]) == F.SMALL_EXPERT_SLOTS
    small = [4096, 512, 4096, 512]
    t = F.Transport(0, 1, 3, small, backend="cpu", exchange=lambda o: [o])  # num_slots omitted
    try:
        assert t.num_slots == F.SMALL_EXPERT_SLOTS
        with t.layer(1, 0, 3) as layer:
            layer.run(pattern_writer(0))
        for e in range(3):
            for k in range(4):
                assert torch.equal(t.expert_view(k, e), expect(0, e, k, small[k]))
    finally:
        t.close()


@pytest.mark.parametrize("timeout_ms", [2**62, 2**64 // 10**6 + 1, 2**64 - 1])
def test_huge_timeout_and_liveness_mean_infinite(timeout_ms):
    # "Infinite" timeouts passed as huge counts: ms -> ns must saturate, not wrap into a tiny
    # window that expires at once (2**64 // 10**6 + 1 ms is the first count whose ns overflow).
    with make(4, [16] * 4, 2, timeout_ms=timeout_ms, liveness_ms=timeout_ms) as t:
        def slow(e, slots):
            time.sleep(0.005)
            pattern_writer(1)(e, slots)
        with t.layer(1, 0, 4) as layer:
            layer.run(slow)
        assert not layer.stats.poisoned and layer.stats.bytes == 4 * 64
        for e in range(4):
            assert torch.equal(t.expert_view(1, e), expect(1, e, 1, 16))


def test_join_next_epoch_without_wait_raises_at_once():
    timeout_ms = 20000
    with make(4, [16] * 4, timeout_ms=timeout_ms) as t:
        t.join(1, 0, 4)
        t.run(1, 0, 4, pattern_writer(1))
        t0 = time.monotonic()
        exc = _poison_of(lambda: t.join(2, 0, 4))  # wait(1) was never called
        assert time.monotonic() - t0 < fast_bound(0, timeout_ms / 1000)  # at once, not at the timeout
        assert isinstance(exc, F.ProtocolError) and exc.code == F.ErrorCode.PROTOCOL and exc.rank == 0
        assert "without calling wait(1)" in exc.message and "call wait(1) before joining" in exc.message
        t.reset()  # like every protocol violation: poisoned, recoverable
        with t.layer(2, 0, 4) as layer:
            layer.run(pattern_writer(2))
        assert torch.equal(t.expert_view(3, 3), expect(2, 3, 3, 16))


def test_shard_writer_refuses_experts_outside_its_sources():
    E, H, I = 2, 256, 256
    src = F.make_block_fp8_sources(E, H, I, generator=torch.Generator().manual_seed(0))
    nb = F.block_fp8_expert_nbytes(H, I, 1)
    w = F.make_shard_writer(src, 1, threads=1)
    assert w.num_experts == E
    with make(4, nb, 2) as t:
        t.join(1, 0, 4)
        with pytest.raises(ValueError, match=r"expert_count 4 exceeds the experts of the ShardWriter's source "
                                             r"tensors \(2\)"):
            t.run(1, 0, 4, w)  # the layer has room for 4 experts, the sources hold 2
        assert not t.poisoned  # refused before anything was written
        t.poison(F.ErrorCode.USER, "abandon epoch 1")
        t.reset()
        with t.layer(2, 0, E) as layer:
            layer.run(w)
        for e in range(E):
            ref = R.expert_shard(src, 1, 0, e)
            assert all(torch.equal(t.expert_view(k, e), ref[k]) for k in range(4))
    out = [torch.zeros(n, dtype=torch.uint8) for n in nb]
    dst = [[o.data_ptr()] for o in out]
    for bad in (E, -1, -100000):
        with pytest.raises(ValueError, match=rf"expert {bad} is outside the source tensors' experts 0\.\.1"):
            w.write(bad, dst)
    w.write(1, dst)
    assert all(torch.equal(out[k], R.expert_shard(src, 1, 0, 1)[k]) for k in range(4))


def test_shard_writer_keeps_its_sources_alive():
    import gc
    import weakref

    E, H, I = 4, 1024, 1024
    gen = lambda: torch.Generator().manual_seed(11)  # noqa: E731
    src = F.make_block_fp8_sources(E, H, I, generator=gen())
    refs = [weakref.ref(s) for s in src]
    w = F.make_shard_writer(src, 1, threads=1)
    del src
    gc.collect()
    assert all(r() is not None for r in refs), "the writer must hold its source tensors"
    again = F.make_block_fp8_sources(E, H, I, generator=gen())  # same bytes, allocated after the del
    with make(E, F.block_fp8_expert_nbytes(H, I, 1), 2) as t:
        with t.layer(1, 0, E) as layer:
            layer.run(w)
        for e in range(E):
            ref = R.expert_shard(again, 1, 0, e)
            assert all(torch.equal(t.expert_view(k, e), ref[k]) for k in range(4)), e
    del w
    gc.collect()
    assert all(r() is None for r in refs)  # and releases them with the writer


def _low_level_transports(tp, nb=16, experts=4, slots=2, timeout_ms=5000):
    """tp low-level transports (CPU backend) on one control region in this process; the tensors they
    point into are returned too and must outlive them."""
    from fp8_layerwise import _C

    seg = _C.ShmSegment.create("fp8lw_test", 8192)
    seg.unlink()
    _C.initialize_fp8_layerwise_control(seg.ptr, 8192, tp, slots)
    keep = [seg]
    ts = []
    nbs = list(nb) if isinstance(nb, (list, tuple)) else [nb] * 4
    for rank in range(tp):
        k = [torch.zeros(max(4096, n), dtype=torch.uint8) for n in nbs]
        dst = [torch.zeros(experts * n, dtype=torch.uint8) for n in nbs]
        keep += k + dst
        host = [k[i].data_ptr() for _ in range(slots) for i in range(4)]
        all_ = [k[i].data_ptr() for _ in range(slots) for _ in range(tp) for i in range(4)] if rank == 0 else []
        ts.append(_C.FP8LayerwiseTransport(seg.ptr, 8192, rank, tp, -1, host, [d.data_ptr() for d in dst], all_,
                                           nbs, experts, timeout_ms, backend="cpu"))
    return ts, keep


def test_reset_names_the_first_rank_that_left_not_a_rank_that_left_after_it():
    # Rank 2 leaves; rank 0's reset() reports it and rank 0 then closes (what a program does after an
    # unrecoverable error). Rank 1's reset() must still name rank 2, not rank 0.
    ts, keep = _low_level_transports(3)
    ts[0].poison(int(F.ErrorCode.USER), "some failure")
    ts[2].close()
    seen = {}
    for r in (0, 1):
        with pytest.raises(F.PeerDied) as e:
            ts[r].reset()
        seen[r] = (e.value.rank, str(e.value))
        ts[r].close()
    assert seen[0][0] == 2 and seen[1][0] == 2, seen
    assert "reported by rank 0" in seen[1][1], seen


def test_close_from_the_writer_while_another_thread_closes_returns_at_once():
    # The main thread closes while the writer is inside expert 0; the writer then closes too. Neither
    # may wait for the other (the main close waits for the writer's call to leave, and the writer's
    # close cannot wait for itself): each returns at once, not after the drain deadline (timeout_ms).
    timeout_ms = 30000
    ts, keep = _low_level_transports(1, timeout_ms=timeout_ms)
    t = ts[0]
    in_writer = threading.Event()
    res = {}

    def writer(e, *slots):
        if e == 0:
            in_writer.set()
            deadline = time.monotonic() + 30
            while not t.closed and time.monotonic() < deadline:  # the main thread is in close() now
                time.sleep(0.002)
            res["saw_main_close"] = t.closed
            t0 = time.monotonic()
            res["writer_close"] = t.close()
            res["writer_close_s"] = time.monotonic() - t0

    def call():
        try:
            t.join(1, 0, 4)
            t.run(1, 0, 4, writer)
            res["run_exc"] = None
        except BaseException as exc:  # noqa: BLE001 - asserted in the main thread
            res["run_exc"] = type(exc).__name__

    th = threading.Thread(target=call)
    th.start()
    assert in_writer.wait(30)
    t0 = time.monotonic()
    res["main_close"] = t.close()
    res["main_close_s"] = time.monotonic() - t0
    th.join(30)
    assert not th.is_alive()
    bound = fast_bound(0, timeout_ms / 1000)
    assert res["saw_main_close"] is True, res
    assert res["writer_close"] is False and res["writer_close_s"] < bound, res
    assert res["main_close"] is True and res["main_close_s"] < bound, res
    assert res["run_exc"] == "TransportClosed", res


def test_numpy_integer_arguments_are_accepted(tmp_path):
    np = pytest.importorskip("numpy")
    ex = F.FileExchange(str(tmp_path), 0, 1)
    with F.Transport(np.int64(0), np.int64(1), np.int64(4), [np.int64(16)] * 4, num_slots=np.int64(2), backend="cpu",
                     exchange=ex) as t:
        assert t.num_experts == 4 and t.num_slots == 2 and type(t.num_experts) is int


def test_reset_while_a_producer_thread_is_inside_the_writer():
    # Rank 0's producer runs in its own thread and is inside expert 0's writer when the region is
    # poisoned and reset() (every rank: here the only one) completes on the main thread. That run()
    # belongs to the abandoned generation: once its writer returns it must raise at once and publish
    # nothing, else it keeps filling and publishing slots of the old layer (and waits for acks that
    # no consumer will send) while the next layer uses the same slots.
    timeout_ms = 20000
    nb = [256, 32, 128, 16]
    t = make(8, nb, 2, timeout_ms=timeout_ms)
    try:
        t.join(1, 0, 8)
        in_writer, release = threading.Event(), threading.Event()
        res = {}

        def stale_writer(e, slots):
            if e == 0:
                in_writer.set()
                release.wait(30)
            pattern_writer(1)(e, slots)

        def produce():
            try:
                t.run(1, 0, 8, stale_writer)
                res["run"] = None
            except BaseException as exc:  # noqa: BLE001 - asserted in the main thread
                res["run"] = exc
            res["t_run"] = time.monotonic()

        th = threading.Thread(target=produce)
        th.start()
        assert in_writer.wait(30)
        assert t.poison(F.ErrorCode.USER, "poisoned by the test") is True
        assert t.reset() == 1
        t0 = time.monotonic()
        release.set()
        th.join(timeout_ms / 1000 + 30)
        assert not th.is_alive()
        exc = res["run"]
        assert isinstance(exc, F.TransportError) and not isinstance(exc, F.TransportPoisoned), repr(exc)
        assert "reset" in str(exc), str(exc)
        assert res["t_run"] - t0 < fast_bound(0, timeout_ms / 1000)
        assert not t.poisoned
        # The new generation is clean: the next layer is exact.
        with t.layer(2, 0, 8) as layer:
            layer.run(pattern_writer(2))
        assert not layer.stats.poisoned
        for e in range(8):
            for k in range(4):
                assert torch.equal(t.expert_view(k, e), expect(2, e, k, nb[k])), (e, k)
    finally:
        t.close()


def test_shard_writer_cut_for_fewer_ranks_is_refused():
    # A layer of I=256 cut for TP 1 has the per-rank expert_nbytes of a layer of I=512 at TP 2, so the
    # shard sizes agree; but rank 1's rows would come from past the end of each expert (the next
    # expert, or past the source tensor for the last one).
    E, H, I = 2, 128, 256
    src = F.make_block_fp8_sources(E, H, I, generator=torch.Generator().manual_seed(3))
    nb = F.block_fp8_expert_nbytes(H, I, 1)
    assert nb == F.block_fp8_expert_nbytes(H, 2 * I, 2)
    w1 = F.make_shard_writer(src, 1, threads=1)
    dst = [[torch.zeros(n, dtype=torch.uint8) for _ in range(2)] for n in nb]
    ptrs = [[d.data_ptr() for d in ds] for ds in dst]
    with pytest.raises(ValueError, match="built for fewer ranks"):
        w1.write(0, ptrs)
    w1.write(0, [p[:1] for p in ptrs])  # its own TP size is fine
    F.make_shard_writer(F.make_block_fp8_sources(E, H, 2 * I), 2, threads=1).write(E - 1, ptrs)
    ts, keep = _low_level_transports(2, nb=nb, experts=E)
    try:
        ts[0].join(1, 0, E)
        ts[1].join(1, 0, E)
        with pytest.raises(ValueError, match="built for fewer ranks"):
            ts[0].run(1, 0, E, w1)
        assert not ts[0].poisoned  # refused before the layer started
    finally:
        for t in ts:
            t.close()


# Byte offsets in the control block (csrc/control.hpp, version 6) for tests that forge one field.
_LAYER_PRODUCER_DONE = 384 + 4 * 8  # LayerState follows Header (64) and PoisonRecord (320)
_RANKS, _RANK_BYTES = 512, 320  # RankState[8] follows ProducerStats
_RANK_CONSUMER_DONE, _RANK_STATUS = 8, 24


def _forge(region_ptr, offset, value):
    import ctypes

    from fp8_layerwise import _C

    assert _C.CONTROL_STRUCT_BYTES == 4096, "the offsets above no longer match csrc/control.hpp"
    ctypes.c_uint64.from_address(region_ptr + offset).value = value


def _blocking_wait(t, epoch):
    return t.wait(epoch)  # the line InsideCall watches


def test_wait_no_longer_depends_on_rank_0_once_it_produced_the_layer():
    # Rank 1's wait() started while rank 0 was producing, so it watched rank 0's process. Once rank 0's
    # producer has finished the layer (every slot acknowledged), rank 0 may return from its own wait()
    # and close or exit while rank 1's consumer still finishes up: rank 1's wait() must return, not
    # raise PeerDied for a rank it no longer needs. Forged: the producer's done epoch, rank 0's closed
    # record, and (later) rank 1's consumer done epoch.
    from tests.fp8_layerwise._timing import InsideCall

    liveness_s = 0.02
    ts, keep = _low_level_transports(2, timeout_ms=30000)
    region = keep[0].ptr
    res = {}
    try:
        ts[0].join(1, 0, 4)
        ts[1].join(1, 0, 4)

        def finish_layer(probe):
            try:
                probe.wait()  # rank 1 is inside wait(1), watching rank 0
                _forge(region, _LAYER_PRODUCER_DONE, 1)
                _forge(region, _RANKS + 0 * _RANK_BYTES + _RANK_STATUS, 2)  # kRankClosed
                time.sleep(25 * liveness_s)  # many liveness checks
                _forge(region, _RANKS + 1 * _RANK_BYTES + _RANK_CONSUMER_DONE, 1)
            except BaseException as exc:  # noqa: BLE001 - asserted in the main thread
                res["helper"] = exc

        with InsideCall(_blocking_wait, "t.wait(") as probe:
            helper = threading.Thread(target=finish_layer, args=(probe,))
            helper.start()
            stats = _blocking_wait(ts[1], 1)
            helper.join(30)
        assert "helper" not in res, res
        assert stats["epoch"] == 1 and not stats["poisoned"], stats
    finally:
        for t in ts:
            t.close()


@pytest.mark.parametrize("pad", [0, 1, 2, 3])
def test_poison_message_cut_to_the_record_stays_valid_utf8(pad):
    # The record holds 255 bytes of message; a writer exception in any language may have a multi-byte
    # character across that limit. Cut inside it, the message could not be decoded: every rank would
    # raise UnicodeDecodeError instead of the poison, and last_poison() would fail too.
    with make(2, [16] * 4) as t:
        text = "x" * pad + "é" * 100 + "中文" * 40

        def writer(e, slots):
            raise ValueError(text)

        with pytest.raises(F.TransportPoisoned) as info:
            with t.layer(1, 0, 2) as layer:
                layer.run(writer)
        exc = info.value
        assert exc.code == F.ErrorCode.WRITER
        prefix = "writer failed at expert 0: ValueError: "
        assert exc.message.startswith(prefix) and text.startswith(exc.message[len(prefix):]), exc.message
        assert 255 - 3 <= len(exc.message.encode()) <= 255, len(exc.message.encode())
        assert t.native.last_poison()["error_message"] == exc.message


def test_expert_view_refuses_indices_outside_the_layer():
    # A slice past the layer buffer is an empty tensor, and a negative expert another empty (or
    # wrong) slice: both would pass unnoticed into a kernel. They raise ValueError naming the index.
    with make(3, [16, 8, 4, 2]) as t:
        assert t.expert_view(3, 2).numel() == 2
        for kind, expert, name in [(0, 3, "expert"), (0, -1, "expert"), (4, 0, "kind"), (-1, 0, "kind"),
                                   (0, 1.0, "expert")]:
            with pytest.raises(ValueError, match=name):
                t.expert_view(kind, expert)


def test_a_rank_that_skips_an_epoch_rank_0_opened_fails_at_once():
    # Rank 0 opened epoch 1; rank 1 joins epoch 2 instead. Rank 0 will not open 2 before rank 1
    # returned from wait(1), so rank 1 would wait for the whole timeout: it is a ProtocolError, now.
    timeout_ms = 20000
    ts, keep = _low_level_transports(2, timeout_ms=timeout_ms)
    try:
        ts[0].join(1, 0, 4)
        t0 = time.monotonic()
        with pytest.raises(F.ProtocolError, match="rank 1 joined epoch 2 but rank 0 opened epoch 1, which rank 1 "
                                                  "skipped") as info:
            ts[1].join(2, 0, 4)
        assert time.monotonic() - t0 < fast_bound(0, timeout_ms / 1000)
        assert info.value.rank == 1
        with pytest.raises(F.ProtocolError):
            ts[0].run(1, 0, 4, lambda *a: None)  # every rank sees it
    finally:
        for t in ts:
            t.close()
