"""CPU tests of the native sizing (constexpr layouts in csrc/sizing.hpp) against hand-derived figures.

The expected numbers are re-derived here from the record definitions (each part rounded up to 16 B):
dispatch record = hidden*elem | sf packs*4 | K*4 idx | K*4 weights | 8 B source meta;
combine record  = hidden*2 | K*4 weights.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.elastic_ep._common import native_module_or_skip

_C = native_module_or_skip()  # skips only without a built package; a broken extension fails
from elastic_ep import _low_level as ll  # noqa: E402
from elastic_ep import _sizing  # noqa: E402

MIB2 = 2 << 20


def a16(x: int) -> int:
    return (x + 15) // 16 * 16


def ref_dispatch_record(hidden, elem, packs, k):
    return a16(hidden * elem) + a16(packs * 4) + a16(k * 4) + a16(k * 4) + 16


def ref_combine_record(hidden, k):
    return a16(hidden * 2) + a16(k * 4)


def ref_buffer_size(max_tokens, hidden, k, fp8, ranks, multi):
    k = 32 if k == 0 else k
    packs = (hidden + 31) // 32 if fp8 else 0
    d = ranks * max_tokens * ref_dispatch_record(hidden, 1 if fp8 else 2, packs, k)
    slots = min(ranks, k) if multi else k
    c = slots * max_tokens * ref_combine_record(hidden, k)
    return (max(d, c) + MIB2 - 1) // MIB2 * MIB2


def test_alignment_constant():
    assert ll.get_elastic_buffer_alignment() == MIB2


def test_deepseek_v3_shape_exact_bytes():
    # 2 ranks, 4096 tokens, hidden 7168, top-8: the dispatch record is 14336 + 0 + 32 + 32 + 16 B.
    assert _C.dispatch_token_bytes(7168, 2, 0, 8) == 14416
    assert _C.combine_token_bytes(7168, 8) == 14368
    assert ll.ElasticBuffer.get_dispatch_buffer_size(4096, 7168, 0, 8, 2, 1, 2, True) == 2 * 4096 * 14416
    assert ll.ElasticBuffer.get_combine_buffer_size(4096, 7168, 8, 1, 2, True, True) == 2 * 4096 * 14368
    assert ll.ElasticBuffer.get_combine_buffer_size(4096, 7168, 8, 1, 2, True, False) == 8 * 4096 * 14368
    # max(118095872, 117702656) rounded up to 2 MiB = 57 * 2 MiB
    assert ll.ElasticBuffer.calculate_buffer_size(2, 4096, 7168, 8, False, True, True) == 57 * MIB2


def test_send_buffer_only_outside_nvlink():
    inside = ll.ElasticBuffer.get_dispatch_buffer_size(128, 512, 4, 4, 1, 1, 4, True)
    outside = ll.ElasticBuffer.get_dispatch_buffer_size(128, 512, 4, 4, 1, 1, 4, False)
    assert outside - inside == 128 * ref_dispatch_record(512, 1, 4, 4)


def test_token_layout_regions_are_aligned_and_disjoint():
    t = _C.dispatch_token_layout(7168, 1, 56, 8)
    regions = [t[n] for n in ("x", "sf", "topk_idx", "topk_weights", "src_meta")]
    for off, size in regions:
        assert off % 16 == 0
    for (o1, s1), (o2, s2) in zip(regions, regions[1:]):
        assert o1 + s1 <= o2
    assert t["bytes"] == ref_dispatch_record(7168, 1, 56, 8)
    assert t["sf"][0] == 7168


def test_random_shapes_match_reference():
    rng = random.Random(1234)
    for _ in range(300):
        hidden = rng.choice([128, 256, 512, 1024, 2048, 4096, 5120, 7168, 8192])
        max_tokens = rng.randint(1, 8192)
        k = rng.choice([0, 1, 2, 4, 6, 8, 9, 16, 32])
        fp8 = rng.random() < 0.5
        ranks = rng.choice([1, 2, 4, 8, 16, 72])
        multi = rng.random() < 0.5
        got = ll.ElasticBuffer.calculate_buffer_size(ranks, max_tokens, hidden, k, fp8, True, multi)
        assert got == ref_buffer_size(max_tokens, hidden, k, fp8, ranks, multi), (hidden, max_tokens, k, fp8, ranks)
        assert got % MIB2 == 0 and got > 0


def test_topk_zero_sizes_for_32():
    assert ll.ElasticBuffer.calculate_buffer_size(8, 1024, 4096, 0, False, True, True) == \
        ll.ElasticBuffer.calculate_buffer_size(8, 1024, 4096, 32, False, True, True)


@pytest.mark.parametrize("args, word", [
    ((2, 0, 7168, 8, False, True, True), "num_max_tokens_per_rank"),
    ((2, 128, 0, 8, False, True, True), "hidden"),
    ((2, 128, 2, 8, False, True, True), "SF"),
    ((2, 128, 7168, 33, False, True, True), "num_topk"),
])
def test_bad_sizing_arguments_raise_value_error(args, word):
    with pytest.raises(ValueError, match=word):
        ll.ElasticBuffer.calculate_buffer_size(*args)


def test_worst_case_sizes():
    # R * max rows; expand: align(R * max * K + (align - 1) * L, align): K rows per token even when a
    # rank has fewer experts than K (repeated ids give one row per lane; the seed's min(K, L) bound
    # then overflowed, see test_arguments_cpu.py)
    assert _C.worst_case_num_recv_tokens(2, 4096) == 8192
    assert _C.worst_case_num_expanded_tokens(2, 4096, 8, 128, 128) == 81792  # 65536 + 16256, already a multiple of 128
    assert _C.worst_case_num_expanded_tokens(4, 100, 8, 2, 1) == 3200
    assert _C.worst_case_num_expanded_tokens(2, 16, 4, 2, 4) == 136  # 128 + 3 * 2 = 134, to 4


def test_workspace_fits_alignment():
    assert _C.workspace_bytes() == MIB2


def test_import_without_gpu_is_clean_and_gpu_use_is_clear():
    assert isinstance(_C.built_with_cuda(), bool)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="CUDA"):
        ll.ElasticBuffer(0, 1, 1234, None, MIB2)


def test_window_kind_checked_first():
    # An unknown window kind is refused before anything else (no CUDA needed to see it).
    with pytest.raises(ValueError, match="window must be 'nccl' or 'ipc', got 'shm'"):
        ll.ElasticBuffer(0, 1, 0, None, MIB2, window="shm")


@pytest.mark.parametrize("op", ["DISPATCH", "COMBINE"])
def test_overlap_capacity_and_policy(monkeypatch, op):
    # 65536 u32 arrival counters in the workspace, one per (rank, 32-token chunk).
    for ranks, tokens in ((1, 1), (2, 4096), (8, 65536), (256, 8192), (64, 32768)):
        assert _C.overlap_fits(ranks, tokens) == (ranks * ((tokens + 31) // 32) <= 65536)
    assert not _C.overlap_fits(256, 8193) and not _C.overlap_fits(2, 32 * 32768 + 1)
    monkeypatch.delenv(f"ELASTIC_EP_{op}_OVERLAP", raising=False)
    monkeypatch.delenv(f"ELASTIC_EP_{op}_PUSH_BLOCKS", raising=False)
    cfg = ll.OverlapConfig.from_env(op)
    assert not cfg.enabled and cfg.push_blocks is None  # sequential kernels by default
    pick = ll._overlap_push_blocks
    assert pick(cfg, 2, 132, 4096) == 0
    monkeypatch.setenv(f"ELASTIC_EP_{op}_OVERLAP", "1")
    other = "COMBINE" if op == "DISPATCH" else "DISPATCH"
    assert not ll.OverlapConfig.from_env(other).enabled  # each operation has its own switch
    cfg = ll.OverlapConfig.from_env(op)
    assert pick(cfg, 2, 132, 4096) == 132 * 3 // 8
    assert pick(cfg, 2, 1, 4096) == 0  # one block cannot both push and receive
    assert pick(cfg, 2, 2, 4096) == 1
    assert pick(cfg, 256, 132, 8193) == 0  # counters do not fit: sequential kernels
    monkeypatch.setenv(f"ELASTIC_EP_{op}_PUSH_BLOCKS", "500")
    assert pick(ll.OverlapConfig.from_env(op), 2, 132, 4096) == 131  # at least one receiving block stays
    assert pick(ll.OverlapConfig(True, 0), 2, 132, 4096) == 1
    assert repr(ll.OverlapConfig(True, 7)) == "OverlapConfig(enabled=True, push_blocks=7)"


@pytest.mark.parametrize("R,rank,rows", [(1, 0, [70]), (2, 0, [4096, 4090]), (2, 1, [0, 33]), (3, 2, [5, 64, 0]),
                                         (8, 5, [random.Random(s).randint(0, 300) for s in range(8)])])
def test_chunk_order_visits_every_row_once_chunk_major(R, rank, rows):
    """The walk of the overlapped kernels: every (source, slot < rows[source]) exactly once; chunks of 32
    slots in increasing order; within a chunk the sources rank+1, rank+2, ... and this rank last."""
    order = _C.chunk_order(R, rank, rows)
    assert sorted(order) == sorted((s, q) for s in range(R) for q in range(rows[s]))
    keys = [(q // 32, (s - rank - 1) % R, q % 32) for s, q in order]
    assert keys == sorted(keys)
    with pytest.raises(ValueError):
        _C.chunk_order(R, R, rows)


def test_hybrid_layouts_follow_the_seed():
    # Hybrid mode (scale-out > 1) is not implemented by the runtime, but its size hints follow the
    # seed's formulas (as _sizing.py does) instead of direct-mode figures. 2 x 4 ranks, 128 tokens,
    # hidden 1024 bf16, top-8; 1280 = the seed's kNumMaxChannels.
    tok_d, tok_c = ref_dispatch_record(1024, 2, 0, 8), ref_combine_record(1024, 8)
    d = tok_d * (4 * 2 * 128 + 128 + 2 * (128 + 1280))
    c = tok_c * (4 * 2 * 128 + 2 * 128 + 2 * (128 + 1280))
    assert ll.ElasticBuffer.get_dispatch_buffer_size(128, 1024, 0, 8, 2, 2, 4, True) == d
    assert ll.ElasticBuffer.get_combine_buffer_size(128, 1024, 8, 2, 4, True, True) == c
    assert _C.calculate_buffer_size_for_domain(128, 1024, 8, False, 2, 4, True, True) == \
        (max(d, c) + MIB2 - 1) // MIB2 * MIB2
    # Larger than the direct-mode figure of the same 8 ranks, which would undersize a hybrid buffer.
    assert d > ll.ElasticBuffer.get_dispatch_buffer_size(128, 1024, 0, 8, 2, 1, 8, True)


@pytest.mark.parametrize("call", [
    lambda: ll.ElasticBuffer.get_dispatch_buffer_size(2 ** 30, 2 ** 31 - 1, 0, 8, 2, 1, 8, True),
    lambda: ll.ElasticBuffer.get_combine_buffer_size(2 ** 30, 2 ** 28, 32, 1, 64, True, True),
    lambda: ll.ElasticBuffer.calculate_buffer_size(8, 2 ** 30, 2 ** 31 - 1, 8, False, True, True),
    # the native functions themselves (the low-level class adds nothing), hybrid domains included
    lambda: _C.get_dispatch_buffer_size(2 ** 31 - 1, 2 ** 31 - 1, 0, 32, 8, 2 ** 31 - 1, 2 ** 31 - 1, False),
    lambda: _C.get_combine_buffer_size(2 ** 31 - 1, 2 ** 31 - 1, 32, 2 ** 31 - 1, 2 ** 31 - 1, False, False),
    lambda: _C.get_combine_buffer_size(2 ** 31 - 1, 2 ** 31 - 1, 32, 1, 2 ** 31 - 1, False, False),
    lambda: _C.calculate_buffer_size_for_domain(2 ** 31 - 1, 2 ** 31 - 1, 32, False, 2 ** 31 - 1, 2 ** 31 - 1,
                                                True, True),
    lambda: _C.dispatch_token_bytes(2 ** 62, 4, 0, 8),
    lambda: _C.combine_token_bytes(2 ** 62, 8),
], ids=["dispatch", "combine", "calculate", "native_dispatch_hybrid", "native_combine_hybrid",
        "native_combine_direct", "native_calculate", "native_dispatch_token", "native_combine_token"])
def test_sizes_beyond_int64_are_refused_not_wrapped(call):
    # The native sizing is int64: these products wrapped to small positive sizes (e.g. 687 GB for a
    # 3.7e19-byte request), which a buffer-too-small check would then accept. It saturates instead
    # and the binding refuses the saturated size.
    with pytest.raises(ValueError, match="more than any buffer can hold"):
        call()


def test_largest_size_below_int64_is_exact():
    # Just below the limit the native sizing is still exact (saturation only where int64 ends).
    for n in (2 ** 20, 2 ** 24, 2 ** 27):
        want = _sizing.get_dispatch_buffer_size(n, 2 ** 31 - 1, 0, 8, 2, 1, 8, True)
        assert want < 2 ** 63
        assert _C.get_dispatch_buffer_size(n, 2 ** 31 - 1, 0, 8, 2, 1, 8, True) == want


def test_large_sizes_below_int64_still_agree_with_the_python_sizing():
    got = ll.ElasticBuffer.get_dispatch_buffer_size(2 ** 20, 2 ** 24, 0, 8, 2, 1, 8, True)
    assert got == _sizing.get_dispatch_buffer_size(2 ** 20, 2 ** 24, 0, 8, 2, 1, 8, True) < 2 ** 63
