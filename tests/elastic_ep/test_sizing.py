"""Buffer sizing (csrc/kernels/sizing.hpp, the one implementation, bound into every build of ``_C``) against DeepEP
V2's published formulas, worked out by hand here:

* dispatch record = hidden * elem | sf packs * 4 | K * 4 (idx) | K * 4 (weights) | 8 B source meta, each
  part rounded up to 16 B; combine record = hidden * 2 | K * 4;
* direct mode: dispatch = (send regions: 0 on NVLink, else 1) + R receive regions of max_tokens records;
  combine = (send: 0 on NVLink, else R regions of max_tokens x (1 with multiple reduction, else K)) +
  min(R, K) slots (K without multiple reduction) of max_tokens records;
* hybrid (S scale-out x U scale-up, C = 1280 channels): dispatch = U regions of S * max_tokens + 1 of
  max_tokens + S of (max_tokens + C); combine = min(U, K) slots of S * max_tokens + min(S, K) of
  max_tokens + 1 of S * (max_tokens + C) (K, K and K without multiple reduction);
* the buffer = max(dispatch, combine) rounded up to 2 MiB; top-k 0 means 32; FP8 sizes ceil(hidden / 32)
  packs.
"""
import random

import pytest

from tests.elastic_ep._common import import_elastic_ep, native_module_or_skip

ep = import_elastic_ep()
C = native_module_or_skip()  # skips only without a built package; a broken extension fails
from elastic_ep import _low_level as ll  # noqa: E402
from elastic_ep import calculate_elastic_buffer_size  # noqa: E402

MiB2 = 2 * 1024 * 1024
DSV3 = dict(num_max_tokens_per_rank=4096, hidden=7168, num_topk=8)


def test_sizing_is_in_every_build():
    # The host-only build binds the same functions (COMMKIT_BUILD_CUDA=OFF); the native ones exist in both.
    for name in ("calculate_elastic_buffer_size", "get_dispatch_buffer_size", "get_combine_buffer_size",
                 "worst_case_num_expanded_tokens", "DispatchParams", "EpilogueParams", "CombineParams"):
        assert hasattr(C, name), name
    assert ep.ALIGNMENT_BYTES == ep.get_elastic_buffer_alignment() == C.get_elastic_buffer_alignment() == MiB2


def test_token_records_by_hand():
    assert C.dispatch_token_bytes(7168, 2, 0, 8) == 14336 + 0 + 32 + 32 + 16 == 14416
    assert C.dispatch_token_bytes(7168, 1, 224, 8) == 7168 + 896 + 32 + 32 + 16 == 8144
    assert C.combine_token_bytes(7168, 8) == 14336 + 32 == 14368
    assert C.combine_token_bytes(7168, 3) == 14336 + 16  # 12 B of weights padded to 16
    assert C.dispatch_token_bytes(1024, 1, 32, 32) == 1024 + 128 + 128 + 128 + 16 == 1424
    t = C.dispatch_token_layout(7168, 1, 56, 8)
    regions = [t[n] for n in ("x", "sf", "topk_idx", "topk_weights", "src_meta")]
    assert all(off % 16 == 0 for off, _ in regions) and t["sf"][0] == 7168 and t["bytes"] == 7168 + 224 + 32 + 32 + 16
    assert all(o1 + s1 <= o2 for (o1, s1), (o2, s2) in zip(regions, regions[1:]))


def test_deepseek_v3_at_ep8_by_hand():
    # BF16: dispatch 8 ranks x 4096 x 14416 = 472,383,488 B; combine min(8, 8) slots x 4096 x 14368 =
    # 470,810,624 B; the larger rounded up to 2 MiB: 226 x 2 MiB.
    assert calculate_elastic_buffer_size(8, **DSV3) == 226 * MiB2
    assert C.get_dispatch_buffer_size(4096, 7168, 0, 8, 2, 1, 8, True) == 472_383_488
    assert C.get_combine_buffer_size(4096, 7168, 8, 1, 8, True, True) == 470_810_624
    # FP8: records of 8144 B -> dispatch 266,862,592 B; combine (unchanged) is the larger: 225 x 2 MiB.
    assert calculate_elastic_buffer_size(8, **DSV3, use_fp8_dispatch=True) == 225 * MiB2
    # Without multiple reduction the combine area has K = 8 slots, the same as min(R, K) at EP 8.
    assert calculate_elastic_buffer_size(8, **DSV3, allow_multiple_reduction=False) == 226 * MiB2
    # Hybrid mode allowed or not: one NVLink domain of 8 is direct mode either way.
    assert calculate_elastic_buffer_size(8, **DSV3, allow_hybrid_mode=False, num_nvl_ranks=8) == 226 * MiB2
    # The public hint and the low level's DeepEP-named static agree (a rank count stands in for a comm).
    assert ll.NativeRuntime.calculate_buffer_size(8, 4096, 7168, 8, False, True, True) == 226 * MiB2


def test_deepseek_v3_at_ep2_by_hand():
    # FP8 at EP 2: dispatch 8144 x 2 x 4096 = 66,715,648 B; combine (14336 + 32) x min(2, 8) x 4096 =
    # 117,702,656 B -> 57 x 2 MiB (117,440,512 < it <= 119,537,664).
    assert calculate_elastic_buffer_size(2, **DSV3, use_fp8_dispatch=True) == 57 * MiB2
    # BF16: dispatch 14416 x 2 x 4096 = 118,095,872 B, now the larger: 57 x 2 MiB as well.
    assert calculate_elastic_buffer_size(2, **DSV3) == 57 * MiB2
    # Without multiple reduction: 8 slots x 4096 x 14368 = 470,810,624 B -> 225 x 2 MiB.
    assert calculate_elastic_buffer_size(2, **DSV3, allow_multiple_reduction=False) == 225 * MiB2


def test_deepseek_v3_at_ep16_hybrid_by_hand():
    # 2 NVLink domains of 8 (S = 2, U = 8), BF16: dispatch 14416 x (8*2*4096 + 4096 + 2*(4096 + 1280)) =
    # 14416 x 80384 = 1,158,815,744 B; combine 14368 x (8*2*4096 + 2*4096 + 1*2*(4096 + 1280)) =
    # 14368 x 84480 = 1,213,808,640 B -> 579 x 2 MiB. FP8 only shrinks the (smaller) dispatch.
    assert C.get_dispatch_buffer_size(4096, 7168, 0, 8, 2, 2, 8, True) == 1_158_815_744
    assert C.get_combine_buffer_size(4096, 7168, 8, 2, 8, True, True) == 1_213_808_640
    assert calculate_elastic_buffer_size(16, **DSV3, num_nvl_ranks=8) == 579 * MiB2
    assert calculate_elastic_buffer_size(16, **DSV3, use_fp8_dispatch=True, num_nvl_ranks=8) == 579 * MiB2
    # Without multiple reduction every combine area has K = 8 slots: 14368 x (8*2*4096 + 8*4096 +
    # 8*2*(4096 + 1280)) = 2,648,309,760 B -> 1263 x 2 MiB.
    assert calculate_elastic_buffer_size(16, **DSV3, allow_multiple_reduction=False, num_nvl_ranks=8) == 1263 * MiB2
    # Hybrid mode not allowed: one scale-up domain of 16 that is not all on NVLink, so with send areas:
    # dispatch 14416 x (1 + 16) x 4096 = 1,003,814,912 B; combine 14368 x (16 x 4096 + 8 x 4096) =
    # 1,412,431,872 B -> 674 x 2 MiB.
    assert calculate_elastic_buffer_size(16, **DSV3, allow_hybrid_mode=False, num_nvl_ranks=8) == 674 * MiB2


def test_topk_zero_means_32_and_fp8_worst_case():
    # 4 ranks, 4096 tokens, hidden 1024, FP8, top-k 0 (sized as 32), 32 packs: dispatch 4 x 4096 x 1424 =
    # 23,330,816 B; combine 4 x 4096 x (2048 + 128) = 35,651,584 B = exactly 17 x 2 MiB; one token more
    # per rank: 4 x 4097 x 2176 = 35,660,288 B -> 18 x 2 MiB.
    assert calculate_elastic_buffer_size(4, 4096, 1024, 0, use_fp8_dispatch=True) == 17 * MiB2
    assert calculate_elastic_buffer_size(4, 4097, 1024, 0, use_fp8_dispatch=True) == 18 * MiB2
    assert calculate_elastic_buffer_size(4, 128, 1024, 0) == calculate_elastic_buffer_size(4, 128, 1024, 32)


def test_random_direct_mode_shapes_follow_the_formula():
    def a16(v):
        return (v + 15) // 16 * 16

    rng = random.Random(1234)
    for _ in range(300):
        H = rng.choice([128, 256, 512, 1024, 2048, 4096, 5120, 7168, 8192])
        M, k, fp8 = rng.randint(1, 8192), rng.choice([0, 1, 2, 4, 6, 8, 9, 16, 32]), rng.random() < 0.5
        R, multi = rng.choice([1, 2, 4, 8, 16, 72]), rng.random() < 0.5
        K = k or 32
        d = R * M * (a16(H * (1 if fp8 else 2)) + a16((H + 31) // 32 * 4 if fp8 else 0) + 2 * a16(K * 4) + 16)
        c = (min(R, K) if multi else K) * M * (a16(H * 2) + a16(K * 4))
        want = (max(d, c) + MiB2 - 1) // MiB2 * MiB2
        assert calculate_elastic_buffer_size(R, M, H, k, fp8, True, multi) == want, (R, M, H, k, fp8, multi)


def test_worst_case_rows_by_hand():
    # R * max rows; expand: align(R * max * K + (align - 1) * L, align)
    assert C.worst_case_num_recv_tokens(2, 4096) == 8192
    assert C.worst_case_num_expanded_tokens(2, 4096, 8, 128, 128) == 81792  # 65536 + 16256, a multiple of 128
    assert C.worst_case_num_expanded_tokens(4, 100, 8, 2, 1) == 3200
    assert C.worst_case_num_expanded_tokens(2, 16, 4, 2, 4) == 136  # 128 + 3 * 2 = 134, to 4
    assert C.worst_case_num_expanded_tokens(8, 2 ** 31, 32, 256, 2 ** 62) == 2 ** 63 - 1  # saturates, never wraps


@pytest.mark.parametrize("ranks, nvl", [(6, 4), (3, 2), (4, 8), (5, 3)])
def test_ranks_not_a_multiple_of_nvl_ranks_raise(ranks, nvl):
    # DeepEP's scale-out size is num_ranks / num_nvl_ranks: rounding it down would undersize.
    with pytest.raises(ValueError, match=rf"num_ranks \({ranks}\) must be a multiple of num_nvl_ranks \({nvl}\)"):
        calculate_elastic_buffer_size(ranks, 128, 1024, 8, num_nvl_ranks=nvl)
    with pytest.raises(ValueError, match="must be a multiple of num_nvl_ranks"):
        calculate_elastic_buffer_size(ranks, 128, 1024, 8, allow_hybrid_mode=False, num_nvl_ranks=nvl)


@pytest.mark.parametrize("kw, word", [
    (dict(num_max_tokens_per_rank=0), "num_max_tokens_per_rank must be positive"),
    (dict(hidden=0), "hidden must be positive"), (dict(hidden=-4), "hidden must be positive"),
    (dict(hidden=2), "hidden too small: the worst-case SF bytes"),
    (dict(num_topk=33), r"num_topk must be in \[0, 32\]"), (dict(num_topk=-1), r"num_topk must be in \[0, 32\]"),
])
def test_bad_sizing_arguments_raise_value_error(kw, word):
    args = dict(num_ranks=2, num_max_tokens_per_rank=128, hidden=1024, num_topk=8)
    args.update(kw)
    with pytest.raises(ValueError, match=word):
        calculate_elastic_buffer_size(**args)


@pytest.mark.parametrize("bad", [dict(num_max_tokens_per_rank=0), dict(hidden=0), dict(num_topk=0), dict(num_topk=-1),
                                 dict(num_scaleout_ranks=0), dict(num_scaleup_ranks=-2), dict(num_sf_packs=-1),
                                 dict(elem_size=0), dict(num_topk=33)])
def test_bad_layout_arguments_raise_value_error(bad):
    d = dict(num_max_tokens_per_rank=128, hidden=1024, num_sf_packs=0, num_topk=8, elem_size=2, num_scaleout_ranks=1,
             num_scaleup_ranks=2, is_scaleup_nvlink=True)
    d.update(bad)
    with pytest.raises(ValueError, match="get_dispatch_buffer_size"):
        ll.NativeRuntime.get_dispatch_buffer_size(**d)
    if "num_sf_packs" in bad or "elem_size" in bad:
        return  # not arguments of the combine layout
    c = {k: d[k] for k in ("num_max_tokens_per_rank", "hidden", "num_topk", "num_scaleout_ranks", "num_scaleup_ranks",
                           "is_scaleup_nvlink")}
    with pytest.raises(ValueError, match="get_combine_buffer_size"):
        ll.NativeRuntime.get_combine_buffer_size(**c, allow_multiple_reduction=True)


@pytest.mark.parametrize("call", [
    lambda: ll.NativeRuntime.get_dispatch_buffer_size(2 ** 30, 2 ** 31 - 1, 0, 8, 2, 1, 8, True),
    lambda: ll.NativeRuntime.get_combine_buffer_size(2 ** 30, 2 ** 28, 32, 1, 64, True, True),
    lambda: ll.NativeRuntime.calculate_buffer_size(8, 2 ** 30, 2 ** 31 - 1, 8, False, True, True),
    lambda: calculate_elastic_buffer_size(8, 2 ** 30, 2 ** 31 - 1, 8),
    lambda: C.get_dispatch_buffer_size(2 ** 31 - 1, 2 ** 31 - 1, 0, 32, 8, 2 ** 31 - 1, 2 ** 31 - 1, False),
    lambda: C.get_combine_buffer_size(2 ** 31 - 1, 2 ** 31 - 1, 32, 2 ** 31 - 1, 2 ** 31 - 1, False, False),
    lambda: C.get_combine_buffer_size(2 ** 31 - 1, 2 ** 31 - 1, 32, 1, 2 ** 31 - 1, False, False),
    lambda: C.calculate_buffer_size_for_domain(2 ** 31 - 1, 2 ** 31 - 1, 32, False, 2 ** 31 - 1, 2 ** 31 - 1,
                                               True, True),
    lambda: C.dispatch_token_bytes(2 ** 62, 4, 0, 8),
    lambda: C.combine_token_bytes(2 ** 62, 8),
], ids=["dispatch", "combine", "calculate", "public", "native_dispatch_hybrid", "native_combine_hybrid",
        "native_combine_direct", "native_calculate", "native_dispatch_token", "native_combine_token"])
def test_sizes_beyond_int64_are_refused_not_wrapped(call):
    # int64 products wrapped to small positive sizes (e.g. 687 GB for a 3.7e19-byte request), which a
    # buffer-too-small check would then accept; the sizing saturates and the binding refuses it.
    with pytest.raises(ValueError, match="more than any buffer can hold"):
        call()


def test_largest_size_below_int64_is_exact():
    # 2**27 tokens x 8 ranks x record(2**31 - 1 bf16 + 32 + 32 + 16 B), below 2**63: exact
    n, H = 2 ** 27, 2 ** 31 - 1
    record = (H * 2 + 15) // 16 * 16 + 32 + 32 + 16
    assert C.get_dispatch_buffer_size(n, H, 0, 8, 2, 1, 8, True) == 8 * n * record < 2 ** 63


def test_hybrid_layouts_are_larger_than_direct():
    # Hybrid mode's size hints follow DeepEP's formulas (our hybrid layouts fit them; sizing.hpp checks
    # that at compile time): a direct-mode figure for the same 8 ranks would undersize a hybrid buffer. 2 x 4 ranks, 128 tokens,
    # hidden 1024 bf16, top-8: dispatch 2128 x (4*2*128 + 128 + 2*(128 + 1280)) = 2128 x 3968.
    assert C.get_dispatch_buffer_size(128, 1024, 0, 8, 2, 2, 4, True) == 2128 * 3968
    assert C.get_dispatch_buffer_size(128, 1024, 0, 8, 2, 1, 8, True) == 2128 * 8 * 128
    # combine 2080 x (4*2*128 + 2*128 + 2*(128 + 1280)) = 2080 x 4096
    assert C.get_combine_buffer_size(128, 1024, 8, 2, 4, True, True) == 2080 * 4096
    assert C.calculate_buffer_size_for_domain(128, 1024, 8, False, 2, 4, True, True) == 5 * MiB2  # 8,519,680 B


def test_workspace_and_overlap_capacity():
    assert C.workspace_bytes() == MiB2
    # 65536 u32 arrival counters in the workspace, one per (rank, 32-token chunk).
    for ranks, tokens in ((1, 1), (2, 4096), (8, 65536), (256, 8192), (64, 32768)):
        assert C.overlap_fits(ranks, tokens) == (ranks * ((tokens + 31) // 32) <= 65536)
    assert not C.overlap_fits(256, 8193) and not C.overlap_fits(2, 32 * 32768 + 1)


@pytest.mark.parametrize("R,rank,rows", [(1, 0, [70]), (2, 0, [4096, 4090]), (2, 1, [0, 33]), (3, 2, [5, 64, 0]),
                                         (8, 5, [random.Random(s).randint(0, 300) for s in range(8)])])
def test_chunk_order_visits_every_row_once_chunk_major(R, rank, rows):
    """The walk of the overlapped kernels: every (source, slot < rows[source]) exactly once; chunks of 32
    slots in increasing order; within a chunk the sources rank+1, rank+2, ... and this rank last."""
    order = C.chunk_order(R, rank, rows)
    assert sorted(order) == sorted((s, q) for s in range(R) for q in range(rows[s]))
    keys = [(q // 32, (s - rank - 1) % R, q % 32) for s, q in order]
    assert keys == sorted(keys)
    with pytest.raises(ValueError):
        C.chunk_order(R, R, rows)


def test_node_shapes_1x8_to_8x8_by_hand():
    # DeepSeek-V3, BF16, multiple reduction, nodes of 8 NVLink ranks (U = 8), S = 1, 2, 4, 8 nodes.
    # 1 x 8 is direct mode: dispatch 14416 x 8 x 4096 = 472,383,488 B -> 226 x 2 MiB (see the EP 8 test).
    assert calculate_elastic_buffer_size(8, **DSV3, num_nvl_ranks=8) == 226 * MiB2
    # 2 x 8: 579 x 2 MiB (the EP 16 test above).
    assert calculate_elastic_buffer_size(16, **DSV3, num_nvl_ranks=8) == 579 * MiB2
    # 4 x 8: dispatch 14416 x (8*4*4096 + 4096 + 4*(4096 + 1280)) = 14416 x 156672 = 2,258,583,552 B;
    # combine 14368 x (8*4*4096 + 4*4096 + 1*4*(4096 + 1280)) = 14368 x 168960 = 2,427,617,280 B -> 1158 x 2 MiB.
    assert C.get_dispatch_buffer_size(4096, 7168, 0, 8, 2, 4, 8, True) == 2_258_583_552
    assert C.get_combine_buffer_size(4096, 7168, 8, 4, 8, True, True) == 2_427_617_280
    assert calculate_elastic_buffer_size(32, **DSV3, num_nvl_ranks=8) == 1158 * MiB2
    # 8 x 8: dispatch 14416 x (8*8*4096 + 4096 + 8*5376) = 14416 x 309248 = 4,458,119,168 B; combine
    # 14368 x (8*8*4096 + min(8, 8)*4096 + 8*5376) = 14368 x 337920 = 4,855,234,560 B -> 2316 x 2 MiB.
    assert C.get_dispatch_buffer_size(4096, 7168, 0, 8, 2, 8, 8, True) == 4_458_119_168
    assert C.get_combine_buffer_size(4096, 7168, 8, 8, 8, True, True) == 4_855_234_560
    assert calculate_elastic_buffer_size(64, **DSV3, num_nvl_ranks=8) == 2316 * MiB2
