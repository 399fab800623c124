"""Buffer sizing: hand-computed values, DeepEP semantics (2 MiB alignment, top-k 0 = 32), and
agreement of the Python port with the native constexpr layouts when the extension is built."""
import pytest

from tests.elastic_ep._common import import_elastic_ep

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
    try:
        from elastic_ep import _low_level as ll
        native = ll.ElasticBuffer.calculate_buffer_size
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"native extension not built: {e}")
    for R in (1, 2, 4, 8):
        for (M, H, K, fp8, mr) in [(4096, 7168, 8, True, True), (128, 256, 0, False, True),
                                   (96, 512, 8, True, False), (1, 2048, 3, False, False)]:
            assert native(R, M, H, K, fp8, True, mr) == calculate_elastic_buffer_size(R, M, H, K, fp8, True, mr), \
                (R, M, H, K, fp8, mr)
