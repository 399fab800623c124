"""Test-side reference of the block-FP8 tensor-parallel sharding rule (independent of the package).

The rule, as documented (``block_fp8_expert_nbytes``, ``make_shard_writer`` and the README's
"Writers"): the whole-layer sources are

    w13       [E, 2I, H]            1-byte values: the gate projection (rows 0..I-1), then up (I..2I-1)
    w13_scale [E, 2I/128, H/128]    float32, one per 128x128 block of w13
    w2        [E, H, I]             1-byte values
    w2_scale  [E, H/128, I/128]     float32, one per 128x128 block of w2

and TP rank r of tp, with s = I/tp (a multiple of 128), receives for expert e, row-major:

    w13:       its s rows of the gate half, then its s rows of the up half    -> [2, s, H]
    w13_scale: the matching s/128 block rows of each half                     -> [2, s/128, H/128]
    w2:        every one of the H rows, restricted to its s columns           -> [H, s]
    w2_scale:  every block row, restricted to its s/128 block columns         -> [H/128, s/128]

This module derives those shards by splitting each dimension into its tp equal parts with
``reshape`` and indexing rank r (no slicing arithmetic, no copy of the package's code), and returns
them as the raw bytes the transport delivers: one flat uint8 tensor per kind.
"""
from __future__ import annotations

from typing import List, Sequence

import torch

BLOCK = 128


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def expert_shard(sources: Sequence[torch.Tensor], tp: int, rank: int, expert: int,
                 block: int = BLOCK) -> List[torch.Tensor]:
    """Rank ``rank``'s bytes of ``expert`` for the four kinds (w13, w13_scale, w2, w2_scale)."""
    w13, w13s, w2, w2s = (t[expert] for t in sources)
    two_i, h = w13.shape
    i = two_i // 2
    assert tuple(w2.shape) == (h, i), (tuple(w13.shape), tuple(w2.shape))
    assert i % tp == 0 and (i // tp) % block == 0 and h % block == 0, (h, i, tp, block)
    assert tuple(w13s.shape) == (2 * i // block, h // block) and tuple(w2s.shape) == (h // block, i // block)
    # [half, rank, rows of one rank, columns]: half 0 = gate, 1 = up.
    out13 = w13.reshape(2, tp, i // tp, h)[:, rank]
    out13s = w13s.reshape(2, tp, i // tp // block, h // block)[:, rank]
    # [rows, rank, columns of one rank].
    out2 = w2.reshape(h, tp, i // tp)[:, rank]
    out2s = w2s.reshape(h // block, tp, i // tp // block)[:, rank]
    return [_as_bytes(t) for t in (out13, out13s, out2, out2s)]


def shard_nbytes(hidden: int, intermediate: int, tp: int, block: int = BLOCK) -> List[int]:
    """Bytes of one rank's shard of one expert per kind, from the shapes above."""
    s = intermediate // tp
    return [2 * s * hidden, 4 * 2 * (s // block) * (hidden // block), hidden * s, 4 * (hidden // block) * (s // block)]
