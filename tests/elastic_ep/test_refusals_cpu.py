"""A dispatch refused for a peer's word (CPU, the native runtime's Python layer over a fake ``_C``
runtime, as test_lowlevel_host_cpu.py): another geometry is a ValueError naming the argument and both
ranks' values, at once with a CPU sync and at the next call without, and the buffer stays usable; a
corrupted count or record word is a CommError naming the peer and the value, and the buffer is unusable.
The kernels' side runs on a GPU in test_geometry_gpu.py."""
from __future__ import annotations

import pytest
import torch

from tests.elastic_ep.test_lowlevel_host_cpu import (T, FakeRuntime, _C, dispatch, ll, make_buffer,  # noqa: F401
                                                     streams)


def _w2(num_experts, num_topk, packs):
    """Geometry word 2 as the kernels make it (kernels/geometry.hpp)."""
    return _C.dispatch_geometry_words(64, 512, num_experts, num_topk, packs, 1, False)[2]


@pytest.mark.parametrize("word,theirs,mine,says", [
    (1, 256, 512, "bytes per row of x (hidden x element size): rank 1 passed 256, rank 0 (this one) 512"),
    (0, 64, 48, "num_max_tokens_per_rank: rank 1 passed 64, rank 0 (this one) 48"),
    (2, _w2(16, 2, 0), _w2(16, 4, 0), "num_topk: rank 1 passed 2, rank 0 (this one) 4"),
    (2, _w2(16, 4, 257), _w2(16, 4, 1), "scale packs per token: rank 1 passed 257, rank 0 (this one) 1"),
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
    # Signed fields a peer wrote negative, reported as the kernels store them (their 32 bits): shown signed.
    (5, 2 ** 32 - 5, 1, "a record in rank 1's area names source token -5, outside that rank's range"),
    (10, 2 ** 32 - 1, 8, "rank 1 sent a low-latency count of -1 tokens, outside [0, "
                         "num_max_dispatch_tokens_per_rank=8]"),
    (11, 2 ** 32 - 7, 8, "from rank 1 names a token, lane or rank out of range (-7, bound 8;"),
    (13, 2 ** 32 - 1, 4, "a combine slot of this rank's own row holds row index -1, outside x's 4 rows"),
    # An expert's row count (notify, as the token count: at once) names itself, not the token count.
    (14, 4 * T + 1, 4 * T, f"rank 1 sent a count of {4 * T + 1} rows for one of this rank's experts, outside "
                           f"[0, num_topk x num_max_tokens_per_rank={4 * T}]"),
    (14, 2 ** 32 - 1, 4 * T, "rank 1 sent a count of -1 rows for one of this rank's experts, outside [0, "),
])
@pytest.mark.fault
def test_corrupted_peer_word_is_a_protocol_error_and_the_buffer_unusable(streams, what, theirs, mine, says):
    # A corrupted count (notify, CPU sync: at once) or record (epilogue: at the next call) is a
    # CommError naming the peer and the value; the runtime is marked unusable.
    compute, comm, current = streams
    notify = what in (4, 14)
    rt = FakeRuntime(status=4 if notify else 0, geometry=(1, what, theirs, mine) if notify else None)
    b = make_buffer(rt, comm)
    if not notify:
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

    assert geometry_fields(2, _w2(256, 8, 56), _w2(288, 8, 56)) == (
        ("num_experts", "num_topk", "scale packs per token"), (256, 8, 56), (288, 8, 56))
    limit = int(_C.MAX_SF_PACKS)  # every field whole at its limit
    assert geometry_fields(2, _w2(2048, 32, limit), _w2(2048, 32, 257))[1:] == ((2048, 32, limit), (2048, 32, 257))
    assert geometry_fields(3, (128 << 8) | 1, 1 << 8) == (("expert_alignment", "zero_copy"), (128, 1), (1, 0))
    assert geometry_fields(0, 4096, 2048)[1:] == ((4096,), (2048,))


@pytest.mark.parametrize("packs", [0, 1, 56, 256, 257, 16383])
@pytest.mark.parametrize("experts,topk,alignment,zero_copy", [(8, 2, 1, False), (2048, 32, 128, True)])
def test_torch_geometry_words_are_the_kernels(packs, experts, topk, alignment, zero_copy):
    # The torch runtime's words (Python) and the native kernels' (kernels/geometry.hpp, bound): one layout,
    # so ranks whose scale packs differ by 256 (or any amount) differ in word 2 on both backends.
    from types import SimpleNamespace

    from elastic_ep._geometry import GEOMETRY_WORDS, dispatch_geometry

    x = torch.zeros((1, 7168), dtype=torch.float8_e4m3fn)
    a = SimpleNamespace(x=x, hidden=7168, sf=torch.zeros((1, packs)) if packs else None, num_max_tokens_per_rank=96,
                        num_experts=experts, num_topk=topk, expert_alignment=alignment, zero_copy=zero_copy)
    assert GEOMETRY_WORDS == int(_C.GEOMETRY_WORDS)
    assert list(dispatch_geometry(a)) == list(_C.dispatch_geometry_words(96, 7168, experts, topk, packs, alignment,
                                                                         zero_copy))
    if packs >= 256:
        fewer = SimpleNamespace(**{**vars(a), "sf": a.sf[:, :packs - 256] if packs > 256 else None})
        assert dispatch_geometry(a)[2] != dispatch_geometry(fewer)[2]
