"""What DeepEP V1's normal mode computes around its kernels, done with torch ops over ``ElasticBuffer``:
the dispatch layout (``get_dispatch_layout``), the ``ElasticBuffer`` routing of a dispatch (one lane per
rank without top-k; with top-k, marker lanes that make combine add the ranks in rank order), the tokens
per rank a buffer holds, the worst-case output shapes (``num_worst_tokens``), the V1 handle, the outputs
filled once a call's results may be read (``Deferred``), and the byte-exact return of per-rank top-k
weights that DeepEP V1's combine sums.

None of these functions communicates except ``global_expert_counts`` (one all-reduce); none waits for the
GPU except where noted.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _checks
from ._handle import EPHandle
from ._hybrid import as_bytes, from_bytes

__all__ = ["DispatchHandle", "Deferred", "dispatch_layout", "marker_lanes_fit", "ranked_routing", "rank_routing",
           "max_tokens_fit", "fit_rows", "mask_rows_past", "output", "global_expert_counts", "aligned_counts",
           "encode_weights", "decode_weights", "rank_prefix_matrix"]


class DispatchHandle(tuple):
    """The handle of ``Buffer.dispatch``: DeepEP V1's six-tuple, with what this package needs beside it.

    The tuple is DeepEP V1's intranode handle, in its order: ``(rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)``:

    * ``rank_prefix_matrix`` ``[R, R]`` int32: column ``rank`` holds, for each source rank ``i``, the
      received rows from ranks ``0..i`` (where rank ``i``'s rows end in ``recv_x``); the other columns
      are -1 (other ranks' counts, which this rank never learns);
    * ``recv_src_idx`` ``[num_rows]`` int32: each received row's token index on its source rank (rows past
      the received count in a ``num_worst_tokens`` dispatch hold no token);
    * ``is_token_in_rank``: the dispatch's argument (a dispatch without top-k routes by it);
    * the channel matrices and ``send_head`` are DeepEP V1's channel bookkeeping, which has no
      counterpart here: None.

    Attributes:
        ep_handle: the ``EPHandle`` of the underlying ``ElasticBuffer`` dispatch.
        num_rows: rows of the dispatch's outputs (and of ``combine``'s input): the received count, or
            ``num_worst_tokens``.
        buffer_serial: the serial number of the ``ElasticBuffer`` that made it.
        has_topk: whether the dispatch had top-k (without it, routing follows ``is_token_in_rank``).
    """

    def __new__(cls, rank_prefix_matrix: torch.Tensor, recv_src_idx: torch.Tensor, is_token_in_rank: torch.Tensor,
                ep_handle: EPHandle, num_rows: int, buffer_serial: int, has_topk: bool) -> "DispatchHandle":
        self = super().__new__(cls, (rank_prefix_matrix, None, None, recv_src_idx, is_token_in_rank, None))
        self.ep_handle = ep_handle
        self.num_rows = num_rows
        self.buffer_serial = buffer_serial
        self.has_topk = has_topk
        return self


def _token_ranks(ids: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """``[T, R]`` bool: whether a token names an expert of each rank (ids outside ``[0, E)`` name none)."""
    valid = (ids >= 0) & (ids < num_experts)
    ranks = torch.where(valid, ids // (num_experts // num_ranks), torch.full_like(ids, num_ranks))
    in_rank = torch.zeros((ids.shape[0], num_ranks + 1), dtype=torch.bool, device=ids.device)
    in_rank.scatter_(1, ranks, True)
    return in_rank[:, :num_ranks].contiguous()


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int,
                    num_ranks: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepEP V1's layout of ``topk_idx`` (no host sync): ``(num_tokens_per_rank [R] int32,
    num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)``.

    A token goes to rank ``e // (E / R)`` of each of its experts ``e``; ids outside ``[0, E)`` (-1) go
    nowhere. ``num_tokens_per_expert`` counts (token, lane) pairs, ``num_tokens_per_rank`` tokens.
    """
    ids = topk_idx.to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    # Invalid ids land in one extra bin that is cut off: scatter_add needs no size from the host.
    bins = torch.where(valid, ids, torch.full_like(ids, num_experts)).reshape(-1)
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    per_expert.scatter_add_(0, bins, torch.ones_like(bins, dtype=torch.int32))
    is_token_in_rank = _token_ranks(ids, num_experts, num_ranks)
    return is_token_in_rank.sum(dim=0, dtype=torch.int32), per_expert[:num_experts].contiguous(), is_token_in_rank


def marker_lanes_fit(num_topk: int, num_ranks: int, num_experts: Optional[int] = None) -> bool:
    """Whether ``ranked_routing`` adds its marker lanes (more than one rank, and within the kernels' limits;
    ``num_experts`` None: the lane limit only)."""
    R = num_ranks
    if R == 1 or num_topk + R > _checks.MAX_TOPK:
        return False
    return num_experts is None or (num_experts // R + 1 <= _checks.MAX_LOCAL_EXPERTS and
                                   num_experts + R <= _checks.MAX_EXPERTS)


def ranked_routing(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                   num_ranks: int) -> Optional[Tuple[torch.Tensor, torch.Tensor, int]]:
    """``ElasticBuffer`` top-k for a dispatch whose combine adds the ranks in rank order, as DeepEP V1's:
    ``(ids [T, K + R], weights [T, K + R], experts)``, or None where it does not fit the kernels' limits
    (``K + R`` lanes at most 32, ``E / R + 1`` experts per rank at most 256, ``E + R`` at most 2048) or
    is not needed (one rank).

    ``ElasticBuffer``'s combine adds each rank's row at the last lane naming that rank. Each rank gets one
    marker expert after its real ones (expert ``e`` becomes ``e + e // L``, keeping its local id
    ``e - r * L``), and each token one lane per rank it reaches, naming that rank's marker with weight 0:
    the markers are every rank's last lane, in rank order. They send no extra rows (only ranks the token
    reaches get one) and are cut from the outputs (the first K lanes are the caller's).
    """
    T, K = topk_idx.shape
    R, E = num_ranks, num_experts
    L = E // R
    if not marker_lanes_fit(K, R, E):
        return None
    ids = topk_idx.to(torch.int64)
    valid = (ids >= 0) & (ids < E)
    # Ids outside [-1, E) stay outside [-1, E + R), for ElasticBuffer to refuse.
    shifted = torch.where(valid, ids + ids // L, torch.where(ids >= E, ids + R, ids))
    marks = torch.arange(R, dtype=torch.int64, device=ids.device) * (L + 1) + L
    markers = torch.where(_token_ranks(ids, E, R), marks.expand(T, R), torch.full((T, R), -1, dtype=torch.int64,
                                                                                   device=ids.device))
    weights = torch.cat([topk_weights, topk_weights.new_zeros((T, R))], dim=1)
    return torch.cat([shifted, markers], dim=1).contiguous(), weights, E + R


def rank_routing(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """``ElasticBuffer`` top-k ids that send each token to exactly the ranks of ``is_token_in_rank``: one
    lane per rank, lane ``r`` naming expert ``r`` of ``R`` experts (one per rank) or -1. The lanes are in
    rank order, so combine sums the ranks' rows in rank order, as DeepEP V1."""
    R = is_token_in_rank.shape[1]
    lanes = torch.arange(R, dtype=torch.int64, device=is_token_in_rank.device).expand(is_token_in_rank.shape[0], R)
    return torch.where(is_token_in_rank, lanes, torch.full_like(lanes, -1)).contiguous()


def max_tokens_fit(num_bytes: int, num_ranks: int, hidden: int, num_sf_packs: int, num_topk: int, elem_size: int,
                   allow_multiple_reduction: bool) -> int:
    """The most tokens per rank whose dispatch (rows of ``hidden`` x ``elem_size`` bytes, ``num_sf_packs``
    scale packs, ``num_topk`` lanes) and bf16 combine both fit ``num_bytes`` (0 if none does).

    Both sizes grow with the token count, so the largest fitting count is found by bisection; it
    depends only on arguments every rank passes alike, so every rank finds the same count.
    """
    def fits(m: int) -> bool:
        return (_checks.dispatch_bytes(m, hidden, num_sf_packs, num_topk, elem_size, num_ranks) <= num_bytes and
                _checks.combine_bytes(m, hidden, num_topk, num_ranks, allow_multiple_reduction) <= num_bytes)

    lo, hi = 0, min(_checks.INT32_MAX, num_bytes // max(1, hidden * elem_size) + 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def fit_rows(t: Optional[torch.Tensor], rows: int, deferred: "Deferred") -> Optional[torch.Tensor]:
    """``t`` with exactly ``rows`` rows: its first rows (a view), or (``deferred``) a copy of ``t`` followed
    by uninitialised rows."""
    if t is None or t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        return t[:rows]
    pad = (rows - t.shape[0],) + tuple(t.shape[1:])
    return deferred.tensor((rows,) + tuple(t.shape[1:]), t.dtype, t.device, lambda: torch.cat([t, t.new_empty(pad)]))


def output(t: torch.Tensor, rows: int, dtype: torch.dtype, deferred: "Deferred",
           num_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``t`` as a contiguous output of ``rows`` rows and ``dtype``: ``t`` itself where it is one, else a
    ``deferred`` copy; with ``num_valid`` (a device count) rows at or past it are -1."""
    v = fit_rows(t, rows, deferred)
    if num_valid is None and v.dtype == dtype and v.is_contiguous():
        return v
    return deferred.tensor(v.shape, dtype, v.device,
                           (lambda: v) if num_valid is None else (lambda: mask_rows_past(v, num_valid, -1)))


def mask_rows_past(t: torch.Tensor, num_valid: torch.Tensor, value: int) -> torch.Tensor:
    """``t`` with every row at or past the device count ``num_valid`` set to ``value`` (no host sync)."""
    rows = torch.arange(t.shape[0], device=t.device).view(-1, *([1] * (t.dim() - 1)))
    return torch.where(rows < num_valid.to(t.device), t, torch.full_like(t, value))


def global_expert_counts(num_tokens_per_expert: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The per-expert counts summed over every rank (collective: one all-reduce; over host memory on a
    gloo group, which may not reduce device tensors)."""
    t = num_tokens_per_expert.to(torch.int64)
    if dist.get_backend(group) == "gloo" and t.device.type != "cpu":
        host = t.cpu()
        dist.all_reduce(host, group=group)
        return host
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def aligned_counts(counts: Sequence[int], alignment: int) -> List[int]:
    """Each count rounded up to a multiple of ``alignment`` (DeepEP V1's per-expert receive counts)."""
    return [(int(c) + alignment - 1) // alignment * alignment for c in counts]


def encode_weights(topk_weights: torch.Tensor, rank: int, num_ranks: int, rows: int) -> torch.Tensor:
    """bf16 rows carrying this rank's top-k weights byte by byte in its own column block.

    Each byte (0..255) is exact in bf16, and a column is non-zero on one rank only, so combine's fp32 sum
    of the ranks' rows returns every rank's bytes unchanged: the source gets each rank's weights exactly.
    Rows past ``rows`` (a worst-case layout) are zero.
    """
    n, K = topk_weights.shape
    width = 4 * K
    cols = (num_ranks * width + 7) // 8 * 8  # rows of a multiple of 16 bytes
    out = torch.zeros((rows, cols), dtype=torch.bfloat16, device=topk_weights.device)
    m = min(n, rows)
    out[:m, rank * width:(rank + 1) * width] = as_bytes(topk_weights[:m].contiguous()).to(torch.bfloat16)
    return out


def decode_weights(combined: torch.Tensor, num_ranks: int, num_topk: int) -> torch.Tensor:
    """DeepEP V1's combined top-k weights from ``encode_weights``' combined rows: every rank's weights,
    summed in fp32 in rank order from 0 (ranks a token did not reach add 0, which changes no bit)."""
    width = 4 * num_topk
    raw = combined[:, :num_ranks * width].to(torch.uint8)
    acc = torch.zeros((combined.shape[0], num_topk), dtype=torch.float32, device=combined.device)
    for r in range(num_ranks):
        acc += from_bytes(raw[:, r * width:(r + 1) * width], torch.float32, num_topk)
    return acc


def rank_prefix_matrix(psum: torch.Tensor, rank: int, num_ranks: int) -> torch.Tensor:
    """DeepEP V1's ``rank_prefix_matrix`` as far as this rank knows it: its own column (``psum``)."""
    m = torch.full((num_ranks, num_ranks), -1, dtype=torch.int32, device=psum.device)
    m[:, rank] = psum.to(torch.int32)
    return m


class Deferred:
    """Outputs computed from a call's communication results, filled once those results may be read.

    With DeepEP V1's ``async_finish`` the results are valid only after the caller waits on the returned
    event, so the outputs derived from them are allocated now and filled by the event's hook (which runs
    on the caller's stream right after that wait); otherwise ``run`` is called at once.
    """

    def __init__(self) -> None:
        self._steps: List[Tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []

    def tensor(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
               fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A new tensor that ``run`` fills with ``fn()``."""
        t = torch.empty(tuple(shape), dtype=dtype, device=device)
        self._steps.append((t, fn))
        return t

    def run(self) -> None:
        """Fills every tensor (once)."""
        steps, self._steps = self._steps, []
        for t, fn in steps:
            t.copy_(fn())

    def schedule(self, event: Any, async_finish: bool) -> None:
        """``run`` now, or (``async_finish``) at the wait on ``event`` (an ``EventOverlap``)."""
        if not self._steps:
            return
        if async_finish:
            event.register_hook_after_wait(self.run)
        else:
            self.run()
