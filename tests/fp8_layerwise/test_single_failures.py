"""TP 1 in one process on the CPU backend (and low-level TP groups on one control region): what
happens when something goes wrong: range errors and protocol violations poison the region, a writer
that raises, reset(), close() while active and from other threads or from inside the writer, the
timeout that restarts on progress, the poison claim and its message, and ranks that skip an epoch
or leave."""
import threading
import time

import pytest
import torch

import fp8_layerwise as F
from tests.fp8_layerwise._one_process import expect, low_level_transports, make, pattern_writer, poison_of
from tests.fp8_layerwise._timing import InsideCall, fast_bound


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
@pytest.mark.fault
def test_protocol_violations_poison(case):
    with make(4, [16, 16, 16, 16]) as t:
        with t.layer(5, 0, 4) as layer:
            layer.run(pattern_writer(5))
        if case == "reuse":
            exc = poison_of(lambda: t.join(5, 0, 4))
        elif case == "decrease":
            exc = poison_of(lambda: t.join(4, 0, 4))
        elif case == "wait_before_join":
            exc = poison_of(lambda: t.wait(6))
        elif case == "double_wait":
            exc = poison_of(lambda: t.wait(5))
        else:
            t.join(6, 0, 4)
            args = (6, 1, 4) if case == "layer_mismatch" else (6, 0, 3)
            exc = poison_of(lambda: t.run(*args, pattern_writer(6)))
        assert isinstance(exc, F.ProtocolError) and exc.code == F.ErrorCode.PROTOCOL and exc.rank == 0
        # sticky: the next call raises the same original cause
        again = poison_of(lambda: t.join(99, 0, 4))
        assert again.message == exc.message
        t.reset()
        with t.layer(100, 0, 4) as layer:
            layer.run(pattern_writer(100))
        assert torch.equal(t.expert_view(2, 3), expect(100, 3, 2, 16))


@pytest.mark.parametrize("k", [0, 3, 7])
@pytest.mark.fault
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
        assert poison_of(lambda: t.join(2, 0, 8)).message == exc.message
        assert t.reset() == 1
        with t.layer(3, 0, 8) as layer:
            layer.run(pattern_writer(3))
        for e in range(8):
            assert torch.equal(t.expert_view(0, e), expect(3, e, 0, nb[0]))


@pytest.mark.fault
def test_exception_inside_layer_block_poisons():
    with make(2, [16] * 4) as t:
        with pytest.raises(ZeroDivisionError):
            with t.layer(1, 0, 2):
                1 / 0
        exc = poison_of(lambda: t.join(2, 0, 2))
        assert exc.code == F.ErrorCode.USER and "ZeroDivisionError" in exc.message


@pytest.mark.fault
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


@pytest.mark.fault
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


@pytest.mark.fault
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


@pytest.mark.fault
def test_claimer_died_while_claimed_is_reported():
    # A process that died between claiming the record and publishing it leaves state CLAIMED:
    # readers must not hang on it, and report the incomplete publication after ~10 ms.
    import ctypes

    timeout_ms = 20000  # a reader that waited for the claim to complete would run into it
    with make(2, [16] * 4, timeout_ms=timeout_ms) as t:
        state = ctypes.c_uint64.from_address(t._control.ptr + 64)  # PoisonRecord follows the 64 B header
        state.value = 2**64 - 1
        t0 = time.monotonic()
        exc = poison_of(lambda: t.join(1, 0, 2))
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


@pytest.mark.fault
def test_join_next_epoch_without_wait_raises_at_once():
    timeout_ms = 20000
    with make(4, [16] * 4, timeout_ms=timeout_ms) as t:
        t.join(1, 0, 4)
        t.run(1, 0, 4, pattern_writer(1))
        t0 = time.monotonic()
        exc = poison_of(lambda: t.join(2, 0, 4))  # wait(1) was never called
        assert time.monotonic() - t0 < fast_bound(0, timeout_ms / 1000)  # at once, not at the timeout
        assert isinstance(exc, F.ProtocolError) and exc.code == F.ErrorCode.PROTOCOL and exc.rank == 0
        assert "without calling wait(1)" in exc.message and "call wait(1) before joining" in exc.message
        t.reset()  # like every protocol violation: poisoned, recoverable
        with t.layer(2, 0, 4) as layer:
            layer.run(pattern_writer(2))
        assert torch.equal(t.expert_view(3, 3), expect(2, 3, 3, 16))


@pytest.mark.fault
def test_reset_names_the_first_rank_that_left_not_a_rank_that_left_after_it():
    # Rank 2 leaves; rank 0's reset() reports it and rank 0 then closes (what a program does after an
    # unrecoverable error). Rank 1's reset() must still name rank 2, not rank 0.
    ts, keep = low_level_transports(3)
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


@pytest.mark.fault
def test_close_from_the_writer_while_another_thread_closes_returns_at_once():
    # The main thread closes while the writer is inside expert 0; the writer then closes too. Neither
    # may wait for the other (the main close waits for the writer's call to leave, and the writer's
    # close cannot wait for itself): each returns at once, not after the drain deadline (timeout_ms).
    timeout_ms = 30000
    ts, keep = low_level_transports(1, timeout_ms=timeout_ms)
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


@pytest.mark.fault
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


# Byte offsets in the control block (csrc/control.hpp, version 7) for tests that forge one field.
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
    ts, keep = low_level_transports(2, timeout_ms=30000)
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


@pytest.mark.fault
def test_a_rank_that_skips_an_epoch_rank_0_opened_fails_at_once():
    # Rank 0 opened epoch 1; rank 1 joins epoch 2 instead. Rank 0 will not open 2 before rank 1
    # returned from wait(1), so rank 1 would wait for the whole timeout: it is a ProtocolError, now.
    timeout_ms = 20000
    ts, keep = low_level_transports(2, timeout_ms=timeout_ms)
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
