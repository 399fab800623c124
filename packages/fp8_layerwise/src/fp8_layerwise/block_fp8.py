"""Block-FP8 expert weights: per-rank shard sizes, random whole-layer sources, and the reference shard.

The layout is DeepSeek-V3's block-FP8 MoE weights as KTransformers' FP8LayerwiseTransport streams
them: per expert ``w13 [2I, H]`` (gate rows then up rows) and ``w2 [H, I]`` as FP8 bytes, each with
FP32 scales of 128x128 blocks. TP rank ``r`` of ``tp`` gets rows (w13) or columns (w2)
``[r*I/tp, (r+1)*I/tp)``. :func:`reference_shard` cuts that shard with plain torch slicing: the
independent reference the tests compare the native writer and the transport against.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ._checks import _I64_MAX, MAX_TP, _check, _int_arg, _sources_arg

BLOCK = 128


def block_fp8_expert_nbytes(hidden: int, intermediate: int, tp_size: int, block: int = BLOCK) -> List[int]:
    """Per-rank bytes of one expert's four kinds for block-FP8 weights (128x128 fp32 scales).

    Arguments:
        hidden: model hidden size H (multiple of ``block``).
        intermediate: MoE intermediate size I; the rank shard I/tp must be a multiple of ``block``.
        tp_size: tensor-parallel size, 1..8.
        block: quantisation block edge.

    Returns:
        ``[w13, w13_scale, w2, w2_scale]`` bytes: ``2*(I/tp)*H``, ``4*2*(I/tp/128)*(H/128)``,
        ``H*(I/tp)``, ``4*(H/128)*(I/tp/128)``.
    """
    tp_size = _int_arg("tp_size", tp_size, 1, MAX_TP)
    hidden, intermediate = _int_arg("hidden", hidden, 1), _int_arg("intermediate", intermediate, 1)
    block = _int_arg("block", block, 1)
    _check(hidden > 0 and hidden % block == 0, f"hidden must be a positive multiple of {block}, got {hidden}")
    _check(intermediate > 0 and intermediate % tp_size == 0,
           f"intermediate {intermediate} must be divisible by tp_size {tp_size}")
    shard = intermediate // tp_size
    _check(shard % block == 0,
           f"block-FP8 shard intermediate/tp = {shard} is not a multiple of {block} (tp_size {tp_size})")
    hb, sb = hidden // block, shard // block
    return [2 * shard * hidden, 4 * 2 * sb * hb, hidden * shard, 4 * hb * sb]


def make_block_fp8_sources(num_experts: int, hidden: int, intermediate: int,
                           generator: Optional[torch.Generator] = None) -> List[torch.Tensor]:
    """Random whole-layer source tensors in the upstream layout (CPU).

    Returns:
        ``[w13 uint8 [E, 2I, H], w13_scale fp32 [E, 2I/128, H/128], w2 uint8 [E, H, I],
        w2_scale fp32 [E, H/128, I/128]]`` (FP8 carried as raw bytes).
    """
    # Sizes that are not 128-multiples gave scales of truncated (even empty) shapes, refused only later
    # by make_shard_writer, and a float or a negative size torch's own errors, naming no argument.
    E = _int_arg("num_experts", num_experts, 1)
    H, I = _int_arg("hidden", hidden, 1), _int_arg("intermediate", intermediate, 1)
    block_fp8_expert_nbytes(H, I, 1)
    _check(E * 2 * I * H <= _I64_MAX, f"num_experts {E} x 2*intermediate {2 * I} x hidden {H} bytes of w13 exceed "
                                      "what a tensor can hold (2**63-1)")
    _check(generator is None or isinstance(generator, torch.Generator),
           f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    g = generator
    w13 = torch.randint(0, 256, (E, 2 * I, H), dtype=torch.uint8, generator=g)
    w13s = torch.rand((E, 2 * I // BLOCK, H // BLOCK), generator=g)
    w2 = torch.randint(0, 256, (E, H, I), dtype=torch.uint8, generator=g)
    w2s = torch.rand((E, H // BLOCK, I // BLOCK), generator=g)
    return [w13, w13s, w2, w2s]


def reference_shard(sources: Sequence[torch.Tensor], tp_size: int, rank: int, expert: int) -> List[torch.Tensor]:
    """Plain-torch rank shard of one expert, as uint8 (the independent reference for tests).

    Arguments:
        sources: the whole-layer tensors, as for :func:`make_shard_writer`.
        tp_size: tensor-parallel size; rank: 0..tp_size-1; expert: 0..E-1.

    Returns:
        ``[w13, w13_scale, w2, w2_scale]`` flat uint8 tensors: what ``rank`` receives for ``expert``.

    w13 keeps rows ``[r*I/tp, (r+1)*I/tp)`` of the gate half and of the up half; w2 keeps columns
    ``[r*I/tp, (r+1)*I/tp)``; the scales follow the same split in 128-blocks.
    """
    # Slicing past the tensors does not fail: a rank >= tp_size, a negative one or a tp_size that
    # does not cut I into 128-blocks gave empty or shifted shards, a silently wrong reference.
    w13, w13s, w2, w2s = _sources_arg(sources)
    _check(w2.dim() == 3, f"sources[2] (w2_weight) must be [E, H, I], got {tuple(w2.shape)}")
    tp_size = _int_arg("tp_size", tp_size, 1, MAX_TP)
    rank = _int_arg("rank", rank, 0, tp_size - 1)
    expert = _int_arg("expert", expert, 0, w2.shape[0] - 1)
    block_fp8_expert_nbytes(w2.shape[1], w2.shape[2], tp_size)
    I = w2.shape[2]
    s, sb = I // tp_size, I // tp_size // BLOCK
    Ib = I // BLOCK
    out13 = torch.cat([w13[expert, r0 + rank * s: r0 + (rank + 1) * s] for r0 in (0, I)])
    out13s = torch.cat([w13s[expert, r0 + rank * sb: r0 + (rank + 1) * sb] for r0 in (0, Ib)])
    out2 = w2[expert, :, rank * s:(rank + 1) * s]
    out2s = w2s[expert, :, rank * sb:(rank + 1) * sb]
    return [t.contiguous().view(-1).view(torch.uint8) for t in (out13, out13s, out2, out2s)]
