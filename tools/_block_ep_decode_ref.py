"""The decode block's torch reference and checks (tools/_block_ep_decode.py runs the steps, imports
these and applies the checks in ``run_rank``): the dispatch's FP8 cast, the two combine orders, the
power-of-two weights, the reference expert rows from every rank's inputs, the row comparisons
(``same_rows``, ``row_invariant``) and the ``ll_vs_v2`` bound.

**Torch reference** (per configuration, untimed): every rank's tokens and routing are all-gathered;
for every owner rank ``o`` this rank rebuilds ``o``'s packed rows (the rows of the tokens that chose
each of ``o``'s experts, by source rank then token; FP8 rows cast with the same cast and dequantised),
regenerates ``o``'s expert weights and runs the same expert function on the same compact shape (``C``
rows, rows past the valid ones NaN); the outputs of this rank's tokens are then combined per token in
plain torch: ``acc + y * w`` in fp32 (the low-latency order) and ``acc + bf16(y * w)`` (the V2 order).

Why the reference runs the GEMMs on the packed rows and not row by row: a batched BF16 GEMM need not
give a row the bits it gets alone (with torch 2.14 on a CPU, a 1-row BF16 matmul at hidden 7168 takes a
GEMV path whose sums differ in the last bit from the batched ones; cuBLAS/CUTLASS choose kernels by
shape). Giving the reference the same GEMM shapes makes the comparison exact on any deterministic
GEMM; whether the expert function is also row-invariant (each row alone equal to its batched result)
is measured and reported (``row_invariant``), not relied on.

Checks (every rank, every configuration and dispatch format; any failing fails the run, exit status 1,
except ``row_invariant``, which is reported only):

* ``ll_reference``: each low-latency runtime's output == the low-latency-order reference, bitwise (the
  checked step fills every row past ``recv_count``, of ``recv_x`` and of the expert outputs, with NaN);
* ``v2_reference``: V2's output == the V2-order reference, bitwise;
* ``same_rows``: the low-latency runtimes, V2 and the reference give the GEMMs the same rows (same
  counts, same bytes, same order) and get the same expert outputs, bitwise;
* ``pow2``: with the routing weights truncated to powers of two (``row * w`` then exact in fp32 and in
  BF16) the low-latency and V2 outputs are bitwise equal, and equal to the reference;
* ``nohook``: the low-latency step without hooks (micro-batches one after the other) == with hooks;
* ``repeatable``: every timed step == the checked one; ``graph``: the CUDA-graph replay == eager;
* ``ll_vs_v2`` (real weights; not bitwise, by design): V2's combine takes BF16 rows and applies no
  weight, so the experts weight each row and round it to BF16 before the sum (relative error up to
  2^-8 per term), while the low-latency combine multiplies in fp32; both sums then round to BF16 once
  (up to 2^-8 of the result each), so ``|ll - v2| <= 2^-8 (sum_k |w_k y_k| + 2 |out|)`` up to second-order
  terms. Reported: the elements that differ, the largest difference relative to ``sum_k |w_k y_k|`` and
  ``max |ll - v2| / (2^-7 (sum_k |w_k y_k| + |ll|))`` (that bound with room for the second-order terms),
  which must be <= 1; a lost or doubled lane moves an output by about 1/K of the sum, far outside it;
* ``row_invariant`` (reported only): the expert function on single rows == on the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from _block_ep_moe_layer import Segments, bitwise_equal, dequantize_fp8, expert_ffn

#: rows whose expert output is recomputed alone for the row-invariance report (per micro-batch)
ROW_CHECK_ROWS = 64
#: |ll - v2| <= LL_V2_BOUND * (sum_k |w_k y_k| + |ll|) (see the module docstring)
LL_V2_BOUND = 2.0 ** -7


class ExpertStage(Protocol):
    """What the reference uses of the step's expert stage (``Experts`` in tools/_block_ep_decode.py)."""

    num_ranks: int
    capacity: int
    fp8: bool
    gemm: str

    @property
    def L(self) -> int: ...

    def run(self, rows: torch.Tensor, counts: torch.Tensor, sizes: Optional[List[int]] = None,
            w13: Optional[torch.Tensor] = None, w2: Optional[torch.Tensor] = None) -> torch.Tensor: ...


def cast_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The low-latency dispatch's FP8 cast (the kernels' arithmetic), for V2 and the reference."""
    from elastic_ep._low_latency_torch import cast_to_fp8

    return cast_to_fp8(x, False)


def combine_ll_order(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``y [T, K, H]`` bf16 lane rows, ``w [T, K]`` f32: ``acc = acc + y_k * w_k`` in fp32 lane by lane
    (two separately rounded ops, as the low-latency combine), rounded to BF16 once."""
    acc = torch.zeros((y.shape[0], y.shape[2]), dtype=torch.float32, device=y.device)
    for k in range(y.shape[1]):
        acc = acc + y[:, k].float() * w[:, k:k + 1]
    return acc.to(torch.bfloat16)


def combine_v2_order(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same sum with each weighted row first rounded to BF16 (V2: weights applied by the experts)."""
    acc = torch.zeros((y.shape[0], y.shape[2]), dtype=torch.float32, device=y.device)
    for k in range(y.shape[1]):
        acc = acc + (y[:, k].float() * w[:, k:k + 1]).to(torch.bfloat16).float()
    return acc.to(torch.bfloat16)


def pow2_weights(w: torch.Tensor) -> torch.Tensor:
    """``w`` truncated to a power of two (sign and exponent bits kept): ``row * w`` is then exact in fp32
    and in BF16, so where the product is rounded no longer matters."""
    return (w.contiguous().view(torch.int32) & -0x800000).view(torch.float32)


@dataclass
class RefRows:
    """The reference of one micro-batch: the expert outputs of this rank's tokens, ``y [T_mb, K, H]``, and
    what this rank's own experts see (``counts``, compact ``rows`` and outputs ``y_own``)."""

    y: torch.Tensor
    counts: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None
    y_own: Optional[torch.Tensor] = None
    row_invariant: Optional[bool] = None


def reference_rows(rank: int, jobs: Sequence[Tuple[ExpertStage, torch.Tensor, torch.Tensor]],
                   owner_weights: Callable[[int], Tuple[torch.Tensor, torch.Tensor]],
                   row_check: bool) -> List[RefRows]:
    """The expert outputs of this rank's tokens from every rank's inputs, one ``RefRows`` per job
    ``(experts, x_all [R, T_mb, H] bf16, idx_all [R, T_mb, K])`` (a micro-batch in a dispatch format),
    computed owner rank by owner rank on the packed rows that owner receives (see the module docstring).
    ``owner_weights(o)``: rank ``o``'s ``(w13, w2)``, each asked for once."""
    refs, inputs = [], []
    for ex, x_all, idx_all in jobs:
        R, T, K = idx_all.shape
        refs.append(RefRows(y=torch.full((T, K, x_all.shape[2]), float("nan"), dtype=torch.bfloat16,
                                         device=x_all.device)))
        if ex.fp8:  # every source rank's rows through the dispatch's cast, dequantised as the experts do
            q, sf = zip(*[cast_fp8(x_all[r]) for r in range(R)])
            inputs.append(torch.stack([dequantize_fp8(a, b) for a, b in zip(q, sf)]))
        else:
            inputs.append(x_all)
    for o in range(jobs[0][0].num_ranks if jobs else 0):
        w13, w2 = owner_weights(o)
        for ref, rows_all, (ex, x_all, idx_all) in zip(refs, inputs, jobs):
            R, T, K = idx_all.shape
            L, C, H = ex.L, ex.capacity, x_all.shape[2]
            src, t, k = ((idx_all >= o * L) & (idx_all < (o + 1) * L)).nonzero(as_tuple=True)
            lo = idx_all[src, t, k] - o * L
            order = torch.sort((lo * R + src) * max(T, 1) + t).indices  # expert, then source rank, then token
            src, t, k, lo = src[order], t[order], k[order], lo[order]
            counts = torch.bincount(lo, minlength=L)
            rows = rows_all[src, t]
            n = rows.shape[0]
            compact = torch.full((C, H), float("nan"), dtype=torch.bfloat16, device=rows.device)
            compact[:n] = rows  # the rows past n are NaN: no output may depend on them
            y = ex.run(compact, counts, w13=w13, w2=w2)[:n]
            mine = src == rank
            ref.y[t[mine], k[mine]] = y[mine]
            if o == rank:
                ref.counts, ref.rows, ref.y_own = counts.cpu(), rows.cpu(), y.cpu()
                if row_check:
                    ref.row_invariant = _row_invariant(ex, rows, y, lo, w13, w2)
    return refs


def _row_invariant(ex: ExpertStage, rows: torch.Tensor, y: torch.Tensor, lo: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor) -> bool:
    """Each of the first ``ROW_CHECK_ROWS`` rows through the expert function alone (a batch of 1) == its
    row of the batched result ``y``."""
    for i in range(min(rows.shape[0], ROW_CHECK_ROWS)):
        e = int(lo[i])
        one = expert_ffn(rows[i:i + 1], w13[e:e + 1], w2[e:e + 1],
                         Segments([1], torch.ones(1, dtype=torch.int32, device=rows.device)), ex.gemm)
        if not bitwise_equal(one, y[i:i + 1]):
            return False
    return True



def same_rows(probes: Sequence[Sequence[Dict[str, torch.Tensor]]], refs: Sequence[RefRows]) -> bool:
    """Every probe (one list per runtime, one entry per micro-batch) has the reference's counts, rows and
    expert outputs, bitwise."""
    for probe in probes:
        if len(probe) != len(refs):
            return False
        for p, r in zip(probe, refs):
            if not (torch.equal(p["counts"], r.counts) and bitwise_equal(p["rows"], r.rows)
                    and bitwise_equal(p["y"], r.y_own)):
                return False
    return True
