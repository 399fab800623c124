"""DeepEP V2's combine order, written from its published reference, as an independent test oracle.

DeepEP checks its ``ElasticBuffer.combine`` bitwise against a reference that works on the expert
outputs seen from the source token, ``y[T, K, H]`` (one row per top-k lane, zero on masked lanes):

1. *Local reduction* (multiple reduction, and every non-expanded combine): the lanes routed to the same
   rank form a group; each group is summed in fp32 starting from +0.0, in lane order, rounded to bf16,
   and the result stands at the group's LAST lane; the group's other lanes become zero.
   Without multiple reduction in expand mode this step is skipped: every lane keeps its own row.
2. *Global accumulation*: an fp32 accumulator starts at the bias (``bias_0``, or ``bias_0 + bias_1``
   in fp32; +0.0 without bias) and adds the K lanes in lane order; the result is rounded to bf16.

This module implements that with whole-tensor operations (a different computation from the per-token
oracle in ``_common.py`` and from both backends), plus the data it is fed: bf16 values with a wide
exponent range, so that fp32 sums round often and any other summation order shows within a few tokens
(with DeepEP's own ``sin()`` data a wrong order shows in about one element of 30 million).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

_M32 = 0xFFFFFFFF
_TABLE_SIZE = 65521  # prime
_tables = {}


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash step on int64 tensors (exact on every device)."""
    h = h & _M32
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & _M32
    return h ^ (h >> 16)


def _table(device) -> torch.Tensor:
    """``[_TABLE_SIZE]`` bf16: random sign and mantissa, exponent in [2^-30, 2^0] (never zero)."""
    key = str(device)
    if key not in _tables:
        h = _mix(torch.arange(_TABLE_SIZE, dtype=torch.int64) * 0x9E3779B1 + 0x27D4EB2F)
        bits = (((h >> 31) & 1) << 15) | ((97 + (h >> 8) % 31) << 7) | (h & 0x7F)
        bits = torch.where(bits >= 0x8000, bits - 0x10000, bits)
        _tables[key] = bits.to(torch.int16).view(torch.bfloat16).to(device)
    return _tables[key]


def wide_bf16(key: torch.Tensor, cols: int, salt: int) -> torch.Tensor:
    """``[len(key), cols]`` bf16 values, a pure function of ``(key, column, salt)`` drawn from a table
    of wide-range values (see ``_table``), so that every rank and every device computes the same bits."""
    row = _mix(key.to(torch.int64) * 0x85EBCA77 + salt * 0xC2B2AE3D) % _TABLE_SIZE          # [N]
    col = torch.arange(cols, device=key.device, dtype=torch.int64) * 7919                    # [cols]
    return _table(key.device)[(row.view(-1, 1) + col.view(1, -1)) % _TABLE_SIZE]


def lane_rows(src_global_idx: torch.Tensor, num_topk: int, hidden: int, lane: int, seed: int) -> torch.Tensor:
    """The expert output of lane ``lane`` of the tokens ``src_global_idx``: ``[N, hidden]`` bf16."""
    return wide_bf16(src_global_idx.to(torch.int64) * num_topk + lane, hidden, seed)


def expert_outputs(src_global_idx: torch.Tensor, valid: torch.Tensor, hidden: int, seed: int) -> torch.Tensor:
    """``y[N, K, hidden]`` bf16 for tokens ``src_global_idx`` (``[N]``), zero where ``valid[N, K]`` is False."""
    K = valid.shape[1]
    y = torch.stack([lane_rows(src_global_idx, K, hidden, k, seed) for k in range(K)], dim=1)
    return y.masked_fill(~valid.unsqueeze(-1), 0)


def local_partial(y: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A rank's non-expanded combine input: the fp32 sum (from +0.0, lane order) of its lanes, in bf16.

    y: ``[N, K, H]`` bf16; local: ``[N, K]`` bool (the lanes this rank holds). Returns ``[N, H]`` bf16.
    """
    acc = torch.zeros((y.shape[0], y.shape[2]), dtype=torch.float32, device=y.device)
    for k in range(y.shape[1]):
        acc += torch.where(local[:, k:k + 1], y[:, k].float(), torch.zeros_like(acc))
    return acc.to(torch.bfloat16)


def combine_reference(y: torch.Tensor, topk_idx: torch.Tensor, num_ranks: int, num_experts: int,
                      bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                      reduce_in_local: bool) -> torch.Tensor:
    """DeepEP's combine result for one source rank (no hybrid step).

    Arguments:
        y: ``[T, K, H]`` bf16 expert outputs per top-k lane (zero on masked lanes).
        topk_idx: ``[T, K]`` global expert ids, -1 for masked lanes.
        num_ranks, num_experts: the EP group's sizes.
        bias: None, one ``[T, H]`` bf16 tensor, or a pair of them.
        reduce_in_local: step 1 above (False only for expand mode without multiple reduction).

    Returns:
        ``[T, H]`` bf16.
    """
    T, K, H = y.shape
    L = num_experts // num_ranks
    if reduce_in_local:
        group = torch.where(topk_idx >= 0, topk_idx // L, torch.full_like(topk_idx, -1))  # [T, K]
        reduced = torch.zeros_like(y)
        for k in range(K):
            same = group == group[:, k:k + 1]                      # [T, K]: lanes of k's group
            is_last = ~(same[:, k + 1:].any(dim=1))                # no later lane in the group
            acc = torch.zeros((T, H), dtype=torch.float32, device=y.device)
            for j in range(k + 1):                                 # the group's lanes up to k, in order
                acc += torch.where(same[:, j:j + 1], y[:, j].float(), torch.zeros_like(acc))
            reduced[:, k] = torch.where(is_last.view(-1, 1), acc.to(torch.bfloat16), torch.zeros_like(y[:, k]))
        y = reduced
    if isinstance(bias, (tuple, list)):
        acc = bias[0].float() + bias[1].float()
    elif bias is not None:
        acc = bias.float().clone()
    else:
        acc = torch.zeros((T, H), dtype=torch.float32, device=y.device)
    for k in range(K):
        acc += y[:, k].float()
    return acc.to(torch.bfloat16)


def combine_inputs(handle, recv_topk_idx: Optional[torch.Tensor], num_recv: int, hidden: int,
                   expanded_rows: Optional[int], seed: int, device) -> torch.Tensor:
    """The combine input a receiving rank builds from its dispatch handle, as DeepEP's test does.

    Non-expanded (``expanded_rows is None``): row i = ``local_partial`` of received token i over the
    lanes this rank holds (``recv_topk_idx[i] >= 0``). Expanded: each local lane's own row at its
    expanded position (``recv_src_metadata[:, 2 + k]``), zero elsewhere.
    """
    meta = handle.recv_src_metadata[:num_recv].to(torch.int64)
    gidx, rows = meta[:, 0], meta[:, 2:]
    local = recv_topk_idx[:num_recv] >= 0 if expanded_rows is None else rows >= 0
    y = expert_outputs(gidx, local, hidden, seed)
    if expanded_rows is None:
        return local_partial(y, local)
    out = torch.zeros((expanded_rows + 1, hidden), dtype=torch.bfloat16, device=device)
    target = torch.where(local, rows, torch.full_like(rows, expanded_rows))  # masked lanes -> spare row
    out[target.flatten()] = y.reshape(-1, hidden)
    return out[:expanded_rows]


def biases(num_tokens: int, hidden: int, count: int, rank: int, seed: int, device) -> Sequence[torch.Tensor]:
    key = torch.arange(num_tokens, device=device, dtype=torch.int64) + rank * 1_000_003
    return [wide_bf16(key, hidden, seed * 7 + 101 + i) for i in range(count)]
