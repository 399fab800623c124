"""CPU tests of ipc_all2all's protections against ranks falling out of step and against memory misuse:
the handshake signature and the host's messages, the failure mark and the entry-post rule, the
handle checks of sync(), view lifetimes and the CUDA-graph rules of the Python layer. The GPU halves
of these live in test_gpu.py."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from ipc_all2all import _C
from tests.ipc_all2all._stand_ins import recording_instance, synced_instance

SEND, GATHER, ALLGATHER = _C.OP_SEND_RECV_HEADS, _C.OP_GATHER_HEADS, _C.OP_ALLGATHER


# ------------------------------------------------------------------ the handshake signature
def _word(op=SEND, world=2, batch=1, out_rows=-1, cap_rows=-1, chunk=256, wide=512, pack=0, slot=0, counts=(3, 5),
          call=7):
    return _C.ready_word(op, world, batch, out_rows, cap_rows, chunk, wide, pack, slot, list(counts), call)


def test_ready_word_carries_call_number_and_signature():
    w = _word()
    assert w >> 32 == 7 and _word(call=2**32 + 7) == w  # the call number wraps (serial-number order)
    assert (w & 0xffffffff) >> 28 == SEND + 1 and (w >> 27) & 1 == 0
    assert (_word(op=GATHER) & 0xffffffff) >> 28 == GATHER + 1
    assert (_word(slot=1) >> 27) & 1 == 1
    # everything every rank must agree on changes the signature
    variants = [_word(op=GATHER), _word(op=ALLGATHER), _word(slot=1), _word(batch=2), _word(chunk=128),
                _word(wide=1024), _word(out_rows=16, cap_rows=8), _word(pack=64), _word(counts=(3, 6)),
                _word(counts=(5, 3)), _word(world=3, counts=(3, 5, 0))]
    sigs = {v & 0xffffffff for v in variants} | {w & 0xffffffff}
    assert len(sigs) == len(variants) + 1
    assert _word() == w  # and it is deterministic


def test_mismatch_and_not_run_messages_name_operation_rank_and_peer():
    mine = _word(op=SEND, call=5)
    msg = _C.failure_message(SEND * 4 + _C.PHASE_MISMATCH, 0, 1, mine, _word(op=GATHER, call=5))
    assert "send_recv_heads on rank 0" in msg and "peer 1 is running gather_heads while this rank runs " \
        "send_recv_heads" in msg, msg
    assert "Nothing was written to the peer" in msg and "destroy()" in msg
    msg = _C.failure_message(GATHER * 4 + _C.PHASE_MISMATCH, 1, 0, _word(op=GATHER, slot=0),
                             _word(op=GATHER, slot=1))
    assert "slot" in msg and "peer 0" in msg, msg
    msg = _C.failure_message(SEND * 4 + _C.PHASE_MISMATCH, 0, 1, mine, _word(counts=(3, 6), call=5))
    assert "token counts" in msg and "signature" in msg, msg
    msg = _C.failure_message(SEND * 4 + _C.PHASE_MISMATCH, 0, 1, mine, _word(call=6))
    assert "peer 1 is at call 6 while this rank is at call 5" in msg, msg
    msg = _C.failure_message(ALLGATHER * 4 + _C.PHASE_BROKEN, 1, 0, 12, 1)
    assert "allgather on rank 1 (call 12) was abandoned" in msg and "marked failed by rank 0" in msg, msg
    msg = _C.failure_message(GATHER * 4 + _C.PHASE_BROKEN, 1, 1, 13, 2)
    assert "gather_heads on rank 1 (call 13) was abandoned" in msg and "(on this rank)" in msg, msg


# ------------------------------------------------------------------ the failure mark and the entry-post rule
_CALLS = [0, 1, 7, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**33 + 7, 2**64 - 1]


def test_broken_word_layout_and_round_trip():
    """broken_word(call, rank): the call number's low 32 bits in the high half, 1 + rank in the low
    (never 0, which means "not marked"); broken_rank reads the rank back, for any call number."""
    for call in _CALLS:
        for rank in range(_C.MAX_WORLD_SIZE):
            w = _C.broken_word(call, rank)
            assert w == ((call % 2**32) << 32) | (rank + 1), (call, rank)
            assert w != 0 and _C.broken_rank(w) == rank and w >> 32 == call % 2**32
    assert _C.broken_word(2**32 + 5, 3) == _C.broken_word(5, 3)  # the mark keeps 32 bits of the call
    assert _C.broken_word(2**32, 0) == 1  # call 2^32 wraps to 0: the word is still not 0
    assert _C.broken_rank(0) == -1
    for bad in (-1, _C.MAX_WORLD_SIZE):
        with pytest.raises(ValueError, match="rank"):
            _C.broken_word(1, bad)


@pytest.mark.parametrize("call", _CALLS)
def test_entry_post_rule_truth_table(call):
    """The kernel posts call `call`'s entry on `rank` iff the instance is not marked, or the mark is
    of this same call (by this rank or a peer); a mark of another call withholds it."""
    W = _C.MAX_WORLD_SIZE
    mod = 2**64
    for rank in range(W):
        post = lambda broken: _C.entry_post_allowed(broken, call, rank)  # noqa: E731
        assert post(0)
        assert post(_C.broken_word(call, rank))                      # another block of this call marked it
        assert not post(_C.broken_word((call - 1) % mod, rank))      # own mark, earlier call
        assert not post(_C.broken_word((call + 1) % mod, rank))
        for peer in range(W):
            if peer != rank:
                assert post(_C.broken_word(call, peer))              # a peer's mark of this same call
                assert not post(_C.broken_word((call - 1) % mod, peer))
        if call % 2**32:
            assert not post((call % 2**32) << 32)                    # a word naming no rank
        # call numbers compare modulo 2^32: a mark this rank set 2^32 calls earlier reads as this call's
        assert post(_C.broken_word((call - 2**32) % mod, rank))


# ------------------------------------------------------------------ sync()'s handle checks
_CAP = 1 << 20
_TOTAL = _C.buffer_layout(_CAP)["total"]


def _handles(world=2, caps=None, totals=None, ranks=None):
    caps = caps or [_CAP] * world
    totals = totals or [_TOTAL] * world
    ranks = ranks or list(range(world))
    return [_C.encode_handle(world, r, c, t, bytes([r + 1]) * 64) for r, c, t in zip(ranks, caps, totals)]


def test_handle_carries_what_must_match():
    hs = _handles(3)
    assert all(len(h) == _C.HANDLE_BYTES for h in hs)
    for rank in range(3):
        raw = _C.check_handles(hs, 3, rank, _CAP, _TOTAL)
        assert raw == [bytes([r + 1]) * 64 for r in range(3)]
    with pytest.raises(ValueError, match="64 bytes"):
        _C.encode_handle(2, 0, _CAP, _TOTAL, b"short")


@pytest.mark.parametrize("case,match", [
    ("capacity", r"rank 1 was built with output slots of 524288 bytes, this rank \(0\) with 1048576"),
    ("world", r"rank 1 was built with world_size 3, this rank \(0\) with 2"),
    ("order", r"entry 0 holds the handle of rank 1"),
    ("garbage", r"entry 1 \(64 bytes\) is not a handle"),
    ("count", r"expected 2 handles"),
    ("own", r"entry 0 is not this rank's own handle"),
    ("buffer", r"rank 1 has a buffer of"),
])
@pytest.mark.fault
def test_sync_refuses_mismatched_handles_before_opening_anything(case, match):
    hs = _handles(2)
    if case == "capacity":
        hs[1] = _handles(2, caps=[_CAP, _CAP // 2])[1]
    elif case == "world":
        hs[1] = _C.encode_handle(3, 1, _CAP, _TOTAL, bytes([2]) * 64)
    elif case == "order":
        hs = hs[::-1]
    elif case == "garbage":
        hs[1] = bytes(64)  # a bare CUDA IPC handle, as the old format was
    elif case == "count":
        hs = hs + hs[:1]
    elif case == "buffer":
        hs[1] = _handles(2, totals=[_TOTAL, _TOTAL + 4096])[1]
    own = hs[0]
    if case == "own":
        own = _C.encode_handle(2, 0, _CAP, _TOTAL, bytes([9]) * 64)  # this rank's, unlike entry 0
    with pytest.raises(ValueError, match=match):
        _C.check_handles(hs, 2, 0, _CAP, _TOTAL, own)


# ------------------------------------------------------------------ the Python layer: views and graphs
def test_views_keep_the_buffer_alive_past_destroy(monkeypatch):
    a, core = synced_instance(monkeypatch)
    y = a.send_recv_heads(torch.zeros(1, 5, 8, 32, dtype=torch.bfloat16))
    assert a._keeper() is not None and a._keeper().owner is core  # the view's owner holds the core
    a.destroy()
    assert core.destroyed and not core.released, "freed under a live view"
    y.sum()  # still readable
    del y
    gc.collect()
    assert core.released, "the buffer must be freed with its last view"
    # without views, destroy frees at once
    b, core_b = synced_instance(monkeypatch)
    b.send_recv_heads(torch.zeros(1, 5, 8, 32, dtype=torch.bfloat16), copy_output=True)
    b.destroy()
    assert core_b.destroyed and core_b.released


def test_a_dropped_instance_does_not_free_under_a_view(monkeypatch):
    a, core = synced_instance(monkeypatch)
    y = a.gather_heads(torch.zeros(1, 8, 4, 32, dtype=torch.bfloat16))
    core_ref = weakref.ref(core)
    with pytest.warns(ResourceWarning, match="not destroyed"):
        del a, core
        gc.collect()
    assert core_ref() is not None, "the core (and its buffer) must live as long as a view"
    del y
    gc.collect()
    assert core_ref() is None


def test_graph_capture_rules(monkeypatch):
    """Inside a capture an input may be a view only of a call of the same capture; once calls are
    captured, eager calls return copies (a replay may rewrite either slot behind the host's back)."""
    a, core = synced_instance(monkeypatch)
    buf = a._buf
    x = torch.zeros(1, 5, 8, 32, dtype=torch.bfloat16)
    eager_view = a.send_recv_heads(x)                                     # slot 0, eager
    assert eager_view.data_ptr() - buf.data_ptr() == core.slot_offset(0)
    core.capture = 41
    with pytest.raises(ValueError, match="outside this capture"):
        a.gather_heads(eager_view)                                        # would re-read slot 0 at every replay
    assert core.calls == 1, "a refused call must not launch"
    y = a.send_recv_heads(x)                                              # slot 1, captured: a view
    assert y.data_ptr() - buf.data_ptr() == core.slot_offset(1)
    z = a.gather_heads(y)                                                 # same capture: allowed
    assert z.data_ptr() - buf.data_ptr() == core.slot_offset(0)
    core.capture = 42
    with pytest.raises(ValueError, match="outside this capture"):
        a.send_recv_heads(z)                                              # a view of another capture
    core.capture = 0
    assert core.captured_calls == 2
    w = a.send_recv_heads(x)                                              # eager after a capture: a copy
    assert not (buf.data_ptr() <= w.data_ptr() < buf.data_ptr() + buf.numel())
    assert w.shape == (1, 8, 4, 32)
    w = a.send_recv_heads(x, copy_output=True)
    assert not (buf.data_ptr() <= w.data_ptr() < buf.data_ptr() + buf.numel())


def test_a_captured_counts_tensor_outlives_set_rank_tokens(monkeypatch):
    """A graph captured with device counts reads that tensor by address at every replay: replacing it
    with set_rank_tokens(other) must not let it be freed. An eager call keeps no extra reference."""
    a, core, _ = recording_instance(monkeypatch)
    x = torch.zeros(1, 5, 8, 32, dtype=torch.bfloat16)

    eager = torch.tensor([3, 5], dtype=torch.int32)
    a.set_rank_tokens(eager)
    a.send_recv_heads(x, copy_output=True)
    assert core.launches[-1][10] == eager.data_ptr()
    gone = weakref.ref(eager)
    a.set_rank_tokens(torch.tensor([5, 5], dtype=torch.int32))
    del eager
    assert gone() is None, "an eager call must not keep the counts tensor"

    captured = torch.tensor([2, 4], dtype=torch.int32)
    a.set_rank_tokens(captured)
    core.capture = 9
    a.send_recv_heads(x, copy_output=True)
    core.capture = 0
    kept = weakref.ref(captured)
    a.set_rank_tokens(torch.tensor([1, 1], dtype=torch.int32))
    del captured
    assert kept() is not None, "a replay would read a freed counts tensor"
    assert core.launches[-1][10] == kept().data_ptr()
