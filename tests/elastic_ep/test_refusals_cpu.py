"""A dispatch refused for a peer's word (CPU, the native runtime's Python layer over a fake ``_C``
runtime, as test_lowlevel_host_cpu.py): another geometry is a ValueError naming the argument and both
ranks' values, at once with a CPU sync and at the next call without, and the buffer stays usable; a
corrupted count or record word is a CommError naming the peer and the value, and the buffer is unusable.
The kernels' side runs on a GPU in test_geometry_gpu.py."""
from __future__ import annotations

import pytest

from tests.elastic_ep.test_lowlevel_host_cpu import T, FakeRuntime, dispatch, ll, make_buffer, streams  # noqa: F401


@pytest.mark.parametrize("word,theirs,mine,says", [
    (1, 256, 512, "bytes per row of x (hidden x element size): rank 1 passed 256, rank 0 (this one) 512"),
    (0, 64, 48, "num_max_tokens_per_rank: rank 1 passed 64, rank 0 (this one) 48"),
    (2, (16 << 16) | (2 << 8) | 0, (16 << 16) | (4 << 8) | 0, "num_topk: rank 1 passed 2, rank 0 (this one) 4"),
    (3, (4 << 8) | 1, (1 << 8) | 1, "expert_alignment: rank 1 passed 4, rank 0 (this one) 1"),
])
@pytest.mark.fault
def test_dispatch_refused_for_a_peers_geometry_names_the_argument(streams, word, theirs, mine, says):
    # CPU sync: notify flags the host words (status 4) and reports the first differing word; the
    # dispatch raises at once, nothing is owed (the push ended the operation), the buffer stays usable.
    compute, comm, current = streams
    rt = FakeRuntime(status=4, geometry=(1, word, theirs, mine))
    b = make_buffer(rt, comm)
    with pytest.raises(ValueError, match="different arguments") as info:
        dispatch(b, allocate_on_comm_stream=True)
    assert says in str(info.value) and "no row moved" in str(info.value)
    assert "num_experts:" not in str(info.value)  # only the argument that differs is named
    assert "dispatch_epilogue" not in rt.calls and "mark_broken" not in rt.calls and not rt.broken
    assert current[0] is compute
    b._alive()  # reported once: still usable


@pytest.mark.fault
def test_geometry_refusal_without_cpu_sync_is_raised_by_the_next_call(streams):
    # Without a CPU sync (or cached) the host learns of the refusal from the health word: the next
    # call raises before launching anything, once.
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    dispatch(b, do_cpu_sync=False)
    rt.geometry = (1, 3, (1 << 8) | 1, (1 << 8) | 0)
    launched = len(rt.calls)
    with pytest.raises(ValueError, match="zero_copy: rank 1 passed 1, rank 0 \\(this one\\) 0"):
        dispatch(b, do_cpu_sync=False)
    assert len(rt.calls) == launched
    dispatch(b, do_cpu_sync=False)  # usable again
    assert rt.calls[-1] == "dispatch_epilogue"


@pytest.mark.parametrize("what,theirs,mine,says", [
    (4, T + 1, T, f"rank 1 sent a count of {T + 1} tokens, more than num_max_tokens_per_rank={T}"),
    (5, 3 * T + 2, 1, f"a record in rank 1's area names source token {3 * T + 2}, outside that rank's range"),
    (6, 2, 5, "put more rows into local expert 2 than the 5 its count said"),
])
@pytest.mark.fault
def test_corrupted_peer_word_is_a_protocol_error_and_the_buffer_unusable(streams, what, theirs, mine, says):
    # A corrupted count (notify, CPU sync: at once) or record (epilogue: at the next call) is a
    # CommError naming the peer and the value; the runtime is marked unusable.
    compute, comm, current = streams
    rt = FakeRuntime(status=4 if what == 4 else 0, geometry=(1, what, theirs, mine) if what == 4 else None)
    b = make_buffer(rt, comm)
    if what != 4:
        dispatch(b)
        rt.geometry = (1, what, theirs, mine)
    with pytest.raises(ll.CommError, match="protocol error") as info:
        dispatch(b)
    assert says in str(info.value) and "destroy it on every rank" in str(info.value)
    assert rt.broken and "mark_broken" in rt.calls
    with pytest.raises(ll.CommError, match="unusable"):
        dispatch(b)


def test_geometry_fields_unpack_every_word():
    from elastic_ep._geometry import geometry_fields

    assert geometry_fields(2, (256 << 16) | (8 << 8) | 56, (288 << 16) | (8 << 8) | 56) == (
        ("num_experts", "num_topk", "scale packs per token (mod 256)"), (256, 8, 56), (288, 8, 56))
    assert geometry_fields(3, (128 << 8) | 1, 1 << 8) == (("expert_alignment", "zero_copy"), (128, 1), (1, 0))
    assert geometry_fields(0, 4096, 2048)[1:] == ((4096,), (2048,))
