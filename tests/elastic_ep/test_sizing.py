"""Buffer sizing: hand-computed values, DeepEP semantics (2 MiB alignment, top-k 0 = 32), and
agreement of the Python port with the native constexpr layouts when the extension is built."""
import pytest

from tests.elastic_ep._common import import_elastic_ep, native_module_or_skip

ep = import_elastic_ep()
from elastic_ep import _sizing  # noqa: E402
from elastic_ep.buffer import calculate_elastic_buffer_size  # noqa: E402

MiB2 = 2 * 1024 * 1024


def test_token_records_by_hand():
    # bf16 hidden 7168, top-8: 14336 + 0 + 32 (idx) + 32 (weights) + 16 (src meta)
    assert _sizing.dispatch_token_bytes(7168, 2, 0, 8) == 14416
    # fp8 with 224 scale packs: 7168 + 896 + 32 + 32 + 16
    assert _sizing.dispatch_token_bytes(7168, 1, 224, 8) == 8144
    # combine: bf16 row + weights, top-3 weights pad to 16 B
    assert _sizing.combine_token_bytes(7168, 2, 3) == 14336 + 16


def test_deepseek_two_ranks_by_hand():
    # dispatch (NVLink: no send area): 8144 B x 2 ranks x 4096; combine: (14336+32) x min(2, 8) slots x 4096
    d = 8144 * 2 * 4096
    c = (14336 + 32) * 2 * 4096
    assert _sizing.get_dispatch_buffer_size(4096, 7168, 224, 8, 1, 1, 2, True) == d
    assert _sizing.get_combine_buffer_size(4096, 7168, 8, 1, 2, True, True) == c
    size = calculate_elastic_buffer_size(2, 4096, 7168, 8, use_fp8_dispatch=True)
    assert size == -(-max(d, c) // MiB2) * MiB2 and size % MiB2 == 0
    # without multiple reduction the combine area has K = 8 slots
    assert _sizing.get_combine_buffer_size(4096, 7168, 8, 1, 2, True, False) == (14336 + 32) * 8 * 4096


def test_topk_zero_means_32_and_monotonic():
    assert calculate_elastic_buffer_size(4, 128, 1024, 0) == calculate_elastic_buffer_size(4, 128, 1024, 32)
    assert calculate_elastic_buffer_size(4, 256, 1024, 8) >= calculate_elastic_buffer_size(4, 128, 1024, 8)


@pytest.mark.parametrize("bad", [dict(num_max_tokens_per_rank=0), dict(hidden=0), dict(hidden=2)])
def test_bad_sizing_arguments(bad):
    kw = dict(num_ranks=2, num_max_tokens_per_rank=128, hidden=1024, num_topk=8)
    kw.update(bad)
    with pytest.raises(ValueError):
        calculate_elastic_buffer_size(**kw)


def test_python_port_matches_native_layouts():
    native_module_or_skip()  # skips only without a built package; a broken extension fails here
    from elastic_ep import _low_level as ll

    native = ll.ElasticBuffer.calculate_buffer_size
    for R in (1, 2, 4, 8):
        for (M, H, K, fp8, mr) in [(4096, 7168, 8, True, True), (128, 256, 0, False, True),
                                   (96, 512, 8, True, False), (1, 2048, 3, False, False)]:
            assert native(R, M, H, K, fp8, True, mr) == calculate_elastic_buffer_size(R, M, H, K, fp8, True, mr), \
                (R, M, H, K, fp8, mr)


def _native_c():
    return native_module_or_skip()


def test_hybrid_sizes_by_hand():
    # 2 scale-out x 4 scale-up ranks, 128 tokens, hidden 1024 bf16, top-8 (the seed's hybrid layouts;
    # 1280 = its kNumMaxChannels). Dispatch record 2048 + 32 + 32 + 16, combine record 2048 + 32.
    d = 2128 * (4 * 2 * 128 + 1 * 128 + 2 * (128 + 1280))
    c = 2080 * (min(4, 8) * 2 * 128 + min(2, 8) * 128 + 1 * 2 * (128 + 1280))
    assert _sizing.get_dispatch_buffer_size(128, 1024, 0, 8, 2, 2, 4, True) == d
    assert _sizing.get_combine_buffer_size(128, 1024, 8, 2, 4, True, True) == c
    # without multiple reduction every area has K slots
    assert _sizing.get_combine_buffer_size(128, 1024, 8, 2, 4, True, False) == \
        2080 * (8 * 2 * 128 + 8 * 128 + 8 * 2 * (128 + 1280))
    size = calculate_elastic_buffer_size(8, 128, 1024, 8, num_nvl_ranks=4)
    assert size == -(-max(d, c) // MiB2) * MiB2
    # allow_hybrid_mode=False: one scale-up domain of 8 ranks, of which only 4 share NVLink, so it is not
    # on NVLink and has send areas. Dispatch: (1 send + 8 receive) x 128 records of 2128 B = 2451456;
    # combine: 8 ranks x 128 x 2080 (send) + min(8, 8) slots x 128 x 2080 (receive) = 4259840 -> 3 x 2 MiB.
    assert _sizing.get_dispatch_buffer_size(128, 1024, 0, 8, 2, 1, 8, False) == 2451456
    assert _sizing.get_combine_buffer_size(128, 1024, 8, 1, 8, False, True) == 4259840
    assert calculate_elastic_buffer_size(8, 128, 1024, 8, allow_hybrid_mode=False, num_nvl_ranks=4) == 3 * MiB2
    # without multiple reduction: send 8 ranks x (128 x 8) x 2080 + receive 8 slots x 128 x 2080 = 19169280
    # -> 10 x 2 MiB (the dispatch area is unchanged and smaller)
    assert calculate_elastic_buffer_size(8, 128, 1024, 8, allow_hybrid_mode=False, allow_multiple_reduction=False,
                                         num_nvl_ranks=4) == 10 * MiB2


def test_fp8_worst_case_topk_by_hand():
    # 4 ranks on NVLink, 4096 tokens, hidden 1024, FP8, top-k 0 (sized as 32), ceil(1024 / 32) = 32 scale packs.
    # Dispatch record 1024 + 128 (sf) + 128 (idx) + 128 (weights) + 16 = 1424 B: 4 x 4096 x 1424 = 23330816.
    # Combine record 2048 + 128 = 2176 B, min(4, 32) = 4 slots: 4 x 4096 x 2176 = 35651584 = exactly 17 x 2 MiB.
    assert _sizing.dispatch_token_bytes(1024, 1, 32, 32) == 1424
    assert _sizing.combine_token_bytes(1024, 2, 32) == 2176
    assert calculate_elastic_buffer_size(4, 4096, 1024, 0, use_fp8_dispatch=True) == 17 * MiB2
    # one token more per rank: 4 x 4097 x 2176 = 35660288 -> 18 x 2 MiB
    assert calculate_elastic_buffer_size(4, 4097, 1024, 0, use_fp8_dispatch=True) == 18 * MiB2


@pytest.mark.parametrize("ranks, nvl", [(6, 4), (3, 2), (4, 8), (5, 3)])
def test_ranks_not_a_multiple_of_nvl_ranks_raise(ranks, nvl):
    # The seed's scale-out size is num_ranks / num_nvl_ranks: rounding it down would undersize.
    with pytest.raises(ValueError, match=rf"num_ranks \({ranks}\) must be a multiple of num_nvl_ranks \({nvl}\)"):
        calculate_elastic_buffer_size(ranks, 128, 1024, 8, num_nvl_ranks=nvl)
    with pytest.raises(ValueError, match="must be a multiple of num_nvl_ranks"):
        calculate_elastic_buffer_size(ranks, 128, 1024, 8, allow_hybrid_mode=False, num_nvl_ranks=nvl)


DOMAINS = [(1, 1, True), (1, 2, True), (1, 8, True), (1, 8, False), (2, 4, True), (2, 4, False), (4, 8, True),
           (3, 2, False), (8, 72, True)]
SHAPES = [(4096, 7168, 224, 8, 1), (128, 256, 0, 1, 2), (96, 512, 16, 3, 1), (1, 2048, 0, 32, 2), (7, 64, 2, 9, 2)]


def test_python_and_native_layouts_agree_direct_and_hybrid():
    C = _native_c()
    for (S, U, nvl) in DOMAINS:
        for (M, H, packs, K, elem) in SHAPES:
            args = (M, H, packs, K, elem, S, U, nvl)
            assert _sizing.get_dispatch_buffer_size(*args) == C.get_dispatch_buffer_size(*args), args
            for mr in (True, False):
                cargs = (M, H, K, S, U, nvl, mr)
                assert _sizing.get_combine_buffer_size(*cargs) == C.get_combine_buffer_size(*cargs), cargs


def test_calculate_buffer_size_agrees_with_native_for_every_topology():
    C = _native_c()
    for (ranks, nvl) in [(1, 1), (2, 2), (8, 8), (8, 4), (16, 8), (8, 2), (72, 72), (144, 72), (4, 1)]:
        for hybrid in (True, False):
            for (M, H, K, fp8, mr) in [(4096, 7168, 8, True, True), (128, 256, 0, False, True),
                                       (96, 512, 8, True, False), (1, 2048, 3, False, False)]:
                # The seed's topology: scale-out = ranks / nvl when hybrid mode is allowed, and the
                # scale-up domain is on NVLink only when it is the whole NVLink domain.
                S, U = (ranks // nvl, nvl) if hybrid and nvl < ranks else (1, ranks)
                want = C.calculate_buffer_size_for_domain(M, H, K, fp8, S, U, U == nvl, mr)
                got = calculate_elastic_buffer_size(ranks, M, H, K, fp8, hybrid, mr, num_nvl_ranks=nvl)
                assert got == want, (ranks, nvl, hybrid, M, H, K, fp8, mr)


@pytest.mark.parametrize("kw", [dict(num_max_tokens_per_rank=0), dict(hidden=-4), dict(hidden=2), dict(num_topk=-1),
                                dict(num_topk=33), dict(num_topk=1000)])
def test_bad_arguments_same_message_in_python_and_native(kw):
    C = _native_c()
    args = dict(num_max_tokens_per_rank=128, hidden=1024, num_topk=8)
    args.update(kw)
    with pytest.raises(ValueError) as py:
        _sizing.calculate_buffer_size(args["num_max_tokens_per_rank"], args["hidden"], args["num_topk"], False,
                                      num_ranks=2, num_nvl_ranks=2)
    with pytest.raises(ValueError) as native:
        C.calculate_buffer_size_for_domain(args["num_max_tokens_per_rank"], args["hidden"], args["num_topk"], False,
                                           1, 2, True, True)
    # The native message adds where it was raised, e.g. " (bindings.cpp:212)".
    assert str(native.value).startswith(str(py.value)), (str(py.value), str(native.value))


@pytest.mark.parametrize("bad", [dict(num_max_tokens_per_rank=0), dict(hidden=0), dict(num_topk=0), dict(num_topk=-1),
                                 dict(num_scaleout_ranks=0), dict(num_scaleup_ranks=-2), dict(num_sf_packs=-1),
                                 dict(elem_size=0), dict(num_topk=33)])
def test_bad_layout_arguments_same_message_in_python_and_native(bad):
    C = _native_c()
    d = dict(num_max_tokens_per_rank=128, hidden=1024, num_sf_packs=0, num_topk=8, elem_size=2, num_scaleout_ranks=1,
             num_scaleup_ranks=2, is_scaleup_nvlink=True)
    d.update(bad)
    with pytest.raises(ValueError) as py:
        _sizing.get_dispatch_buffer_size(*d.values())
    with pytest.raises(ValueError) as native:
        C.get_dispatch_buffer_size(*d.values())
    assert str(native.value).startswith(str(py.value))
    if "num_sf_packs" in bad or "elem_size" in bad:
        return  # not arguments of the combine layout
    c = dict(num_max_tokens_per_rank=d["num_max_tokens_per_rank"], hidden=d["hidden"], num_topk=d["num_topk"],
             num_scaleout_ranks=d["num_scaleout_ranks"], num_scaleup_ranks=d["num_scaleup_ranks"],
             is_scaleup_nvlink=True, allow_multiple_reduction=True)
    with pytest.raises(ValueError) as py:
        _sizing.get_combine_buffer_size(*c.values())
    with pytest.raises(ValueError) as native:
        C.get_combine_buffer_size(*c.values())
    assert str(native.value).startswith(str(py.value))
