"""The sharding reference the delivery tests expect (tests/fp8_layerwise/_reference.py), pinned by a
hand-worked shard with literal values, and the package's own ``reference_shard`` pinned against it."""
import struct

import pytest
import torch

import fp8_layerwise as F
from tests.fp8_layerwise import _reference as R


def _hand_sources():
    """E=2, H=128, I=256 with values that name where each byte came from:

    * w13[e, row, :] = 10 * (row // 128) + e: row blocks 0..3 = gate rows of rank 0 / rank 1, up rows
      of rank 0 / rank 1 (at TP 2, each rank's I/2 = 128 rows per half);
    * w13_scale[e, b, 0] = 100 * e + b (b = block row 0..3);
    * w2[e, h, c] = 10 * (c // 128) + e + 100 * (h % 2): column blocks 0 / 1 = rank 0 / rank 1, and
      even / odd rows differ;
    * w2_scale[e, 0, b] = 100 * e + 50 + b (b = block column 0..1).
    """
    E, H, I = 2, 128, 256
    e = torch.arange(E).view(E, 1, 1)
    w13 = (10 * (torch.arange(2 * I).view(1, 2 * I, 1) // 128) + e).expand(E, 2 * I, H).to(torch.uint8).contiguous()
    w13s = (100 * e + torch.arange(4).view(1, 4, 1)).to(torch.float32)
    w2 = (10 * (torch.arange(I).view(1, 1, I) // 128) + e + 100 * (torch.arange(H).view(1, H, 1) % 2))
    w2 = w2.to(torch.uint8).contiguous()
    w2s = (100 * e + 50 + torch.arange(2).view(1, 1, 2)).to(torch.float32)
    assert [tuple(t.shape) for t in (w13, w13s, w2, w2s)] == [(2, 512, 128), (2, 4, 1), (2, 128, 256), (2, 1, 2)]
    return [w13, w13s, w2, w2s]


# Worked by hand from the rule in _reference's docstring, for expert 1 at TP 2:
#   w13: the rank's 128 gate rows (block 0 or 1), then its 128 up rows (block 2 or 3), 128 bytes each;
#   w13_scale: block rows (0, 2) or (1, 3); w2: all 128 rows, the rank's 128 columns (block 0 or 1),
#   alternating even / odd rows; w2_scale: block column 0 or 1.
HAND_WORKED = {
    0: [bytes([1]) * (128 * 128) + bytes([21]) * (128 * 128),
        struct.pack("<2f", 100.0, 102.0),
        (bytes([1]) * 128 + bytes([101]) * 128) * 64,
        struct.pack("<f", 150.0)],
    1: [bytes([11]) * (128 * 128) + bytes([31]) * (128 * 128),
        struct.pack("<2f", 101.0, 103.0),
        (bytes([11]) * 128 + bytes([111]) * 128) * 64,
        struct.pack("<f", 151.0)],
}


@pytest.mark.parametrize("impl", ["tests", "package"])
def test_hand_worked_shard(impl):
    shard = R.expert_shard if impl == "tests" else F.reference_shard
    src = _hand_sources()
    assert R.shard_nbytes(128, 256, 2) == F.block_fp8_expert_nbytes(128, 256, 2) == [32768, 8, 16384, 4]
    for rank, want in HAND_WORKED.items():
        got = shard(src, 2, rank, 1)
        assert [t.dtype for t in got] == [torch.uint8] * 4
        assert [len(t) for t in got] == [32768, 8, 16384, 4]
        for k in range(4):
            assert bytes(got[k].tolist()) == want[k], (impl, rank, F.KINDS[k])


@pytest.mark.parametrize("hidden,intermediate,tps", [(256, 1024, (1, 2, 4, 8)), (384, 768, (1, 2, 3, 6))])
def test_package_reference_shard_matches_the_independent_one(hidden, intermediate, tps):
    E = 3
    src = F.make_block_fp8_sources(E, hidden, intermediate, generator=torch.Generator().manual_seed(5))
    for tp in tps:
        assert R.shard_nbytes(hidden, intermediate, tp) == F.block_fp8_expert_nbytes(hidden, intermediate, tp)
        for rank in range(tp):
            for e in range(E):
                want, got = R.expert_shard(src, tp, rank, e), F.reference_shard(src, tp, rank, e)
                for k in range(4):
                    assert torch.equal(got[k], want[k]), (tp, rank, e, F.KINDS[k])
        # The ranks' shards partition the expert: every source byte goes to exactly one rank.
        for k in range(4):
            total = sum(len(R.expert_shard(src, tp, r, 0)[k]) for r in range(tp))
            assert total == src[k][0].numel() * src[k].element_size(), (tp, F.KINDS[k])


def test_native_writer_matches_the_hand_worked_shard():
    # The writer the delivery tests run, on the hand-worked sources: the same literal bytes.
    src = _hand_sources()
    w = F.make_shard_writer(src, 2, threads=1)
    nb = F.block_fp8_expert_nbytes(128, 256, 2)
    out = [[torch.zeros(nb[k], dtype=torch.uint8) for _ in range(2)] for k in range(4)]
    w.write(1, [[t.data_ptr() for t in out[k]] for k in range(4)])
    for rank, want in HAND_WORKED.items():
        for k in range(4):
            assert bytes(out[k][rank].tolist()) == want[k], (rank, F.KINDS[k])
