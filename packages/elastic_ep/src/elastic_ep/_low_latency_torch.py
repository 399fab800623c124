"""Low-latency mode on ``torch.distributed`` collectives: the reference the native kernels are tested
against, and the backend on groups without them (gloo on the CPU in CI).

dispatch
    Send phase: the rows are cast (FP8: per 128 channels, amax clamped at 1e-4, scale = amax x (1 / 448),
    optionally rounded up to a power of two, ``x * (448 / amax)`` or ``x * (1 / scale)`` in fp32 rounded
    to E4M3: the kernels' arithmetic) and one record per (token, lane) whose expert is on an unmasked
    rank is built, ``[token, lane, local expert, 0]`` int32 + the row bytes (+ the scales), sorted per
    destination by (local expert, token, lane). Receive phase: one ``all_to_all_single`` of the counts,
    one of the records; each expert's rows are packed source rank by source rank in rank order, each in
    the order sent (the native kernels' order).
combine
    Send phase: each received row goes back to its source rank as ``[token, lane]`` + the BF16 row.
    Receive phase: the exchange, then per token the lanes are summed in order in fp32 (``acc + row *
    weight``, separately rounded) and rounded to BF16 once; lanes with id ``-1`` or on a masked rank add
    nothing.
The hook splits the phases as the native kernels do (the exchange happens when the hook is called, in
the same order on every rank). Shrink mode's mask is this rank's tensor; the collectives still include
every rank (a masked rank is skipped, not waited for less).
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ._checks import FP8
from ._low_latency import LlCombineArgs, LlDispatchArgs, LlDispatchOut, LowLatencyPart

__all__ = ["TorchLowLatency", "cast_to_fp8"]

_HEADER = 16  # bytes: four int32


def cast_to_fp8(x: torch.Tensor, round_scale: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The kernels' FP8 cast of ``x`` ([T, H] bf16): ``(E4M3 [T, H], f32 scales [T, H / 128])``."""
    T, H = x.shape
    xv = x.view(T, H // 128, 128).float()
    amax = xv.abs().amax(dim=-1).clamp(min=1e-4)
    # Spelled out so that CPU and CUDA compute the same bits: torch's CUDA kernels turn a division by a
    # scalar into a multiplication by its reciprocal, its CPU kernels do not.
    sf = amax * (1.0 / 448.0)  # float32 x float32(1 / 448), as DeepEP V1's kernel
    if round_scale:
        bits = sf.view(torch.int32)
        up = (bits & ~0x7FFFFF) + 0x800000
        sf = torch.where((bits & 0x7FFFFF) != 0, up, bits).view(torch.float32)
        scale = torch.ones_like(sf) / sf  # exact: a power of two
    else:
        scale = torch.full_like(amax, 448.0) / amax  # IEEE division, tensor by tensor
    return (xv * scale.unsqueeze(-1)).to(FP8).view(T, H), sf


def _ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """f32 scales [..., G] (powers of two) -> their exponent bytes packed 4 per int32, [..., G / 4]."""
    e = ((sf.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return e.contiguous().view(torch.int32)


class TorchLowLatency(LowLatencyPart):
    """Low-latency mode on the torch runtime ``rt`` (its group, device and bounded all-to-all)."""

    def __init__(self, rt: Any, shrink: bool) -> None:
        self.rt, self.shrink = rt, shrink
        self.num_ranks, self.rank = rt.num_ranks, rt.rank_idx
        self.mask = torch.zeros(self.num_ranks, dtype=torch.int32, device=rt.device)
        self._pending: Dict[Tuple[str, int], Any] = {}
        self._zero_copy: Dict[int, torch.Tensor] = {}

    def _alive_ranks(self) -> torch.Tensor:
        if self.shrink:
            return self.mask == 0
        return torch.ones(self.num_ranks, dtype=torch.bool, device=self.mask.device)

    def _exchange(self, rows: torch.Tensor, dest: torch.Tensor, stage: str) -> Tuple[torch.Tensor, List[int]]:
        """Rows (uint8 [n, B]) to their destination ranks (sorted by destination, stable)."""
        order = torch.sort(dest, stable=True).indices
        counts = torch.bincount(dest, minlength=self.num_ranks).tolist()
        return self.rt._all_to_all(rows[order], counts, stage)

    # ------------------------------------------------------------------ dispatch
    def _dispatch_send(self, a: LlDispatchArgs) -> Tuple[torch.Tensor, torch.Tensor]:
        T, H, K, E = a.num_tokens, a.hidden, a.num_topk, a.num_experts
        L = E // self.num_ranks
        if a.use_fp8:
            q, sf = cast_to_fp8(a.x, a.round_scale)
            payload = torch.cat([q.view(torch.uint8), sf.contiguous().view(torch.uint8)], dim=1)
        else:
            payload = a.x.contiguous().view(torch.uint8)
        idx = a.topk_idx
        valid = (idx >= 0) & (idx < E)
        bad = ~valid & (idx != -1)
        if bool(bad.any()):  # this backend synchronises anyway: refuse before anything moves
            raise ValueError(f"topk_idx: expert ids must be in [-1, {E}), got {int(idx[bad][0])} "
                             f"({int(bad.sum())} such ids)")
        owner = torch.where(valid, idx // L, torch.zeros_like(idx))
        valid &= self._alive_ranks()[owner]
        t, k = valid.nonzero(as_tuple=True)
        e = idx[t, k]
        d, lo = e // L, e % L
        # Sorted by (destination, local expert, token, lane): nonzero gives (token, lane) order.
        key = (d * L + lo) * (T * K) + t * K + k
        order = torch.sort(key).indices
        t, k, d, lo = t[order], k[order], d[order], lo[order]
        header = torch.stack([t, k, lo, torch.zeros_like(t)], dim=1).to(torch.int32).view(torch.uint8)
        return torch.cat([header, payload[t]], dim=1), d

    def _dispatch_recv(self, a: LlDispatchArgs, o: LlDispatchOut, rows: torch.Tensor, dest: torch.Tensor) -> None:
        R, H, M = self.num_ranks, a.hidden, a.num_max_tokens
        L = a.num_experts // R
        recv, counts = self._exchange(rows, dest, "low_latency_dispatch")
        dev = o.recv_x.device
        src = torch.repeat_interleave(torch.arange(R, device=dev), torch.tensor(counts, device=dev))
        head = recv[:, :_HEADER].contiguous().view(torch.int32).to(torch.int64)
        t, k, lo = head[:, 0], head[:, 1], head[:, 2]
        order = torch.sort(lo * R + src, stable=True).indices
        t, k, lo, src, body = t[order], k[order], lo[order], src[order], recv[order, _HEADER:]
        # Shrink mode: nothing is taken from a rank this rank masked (the native receiver waits for none
        # of its words), whatever that rank sent.
        keep = self._alive_ranks()[src]
        t, k, lo, src, body = t[keep], k[keep], lo[keep], src[keep], body[keep]
        per_expert = torch.bincount(lo, minlength=L)
        first = torch.cumsum(per_expert, 0) - per_expert
        pos = torch.arange(lo.numel(), device=dev) - first[lo]
        o.recv_count.copy_(per_expert.to(torch.int32))
        pair = torch.bincount(lo * R + src, minlength=L * R).view(L, R)
        o.layout_range.copy_(((torch.cumsum(pair, 1) - pair) << 32) | pair)
        o.src_info[lo, pos] = t.to(torch.int32)
        o.route[lo, pos] = ((src << 8) | k).to(torch.int32)
        if a.use_fp8:
            o.recv_x.view(torch.uint8)[lo, pos] = body[:, :H]
            sf = body[:, H:].contiguous().view(torch.float32)
            if a.use_ue8m0:
                o.recv_scales.transpose(1, 2)[lo, pos] = _ue8m0(sf)
            else:
                o.recv_scales.transpose(1, 2)[lo, pos] = sf
        else:
            o.recv_x.view(torch.uint8).view(L, R * M, 2 * H)[lo, pos] = body
        if a.cumulative_stats is not None:
            a.cumulative_stats += per_expert.to(torch.int32)
        o.self_pos.fill_(-1)  # the native combine's in-place rows; this runtime's combine sends every row

    def dispatch(self, a: LlDispatchArgs, o: LlDispatchOut, phases: int) -> None:
        if phases & 1:
            self._pending[("dispatch", a.half)] = self._dispatch_send(a)
        if phases & 2:
            self._dispatch_recv(a, o, *self._pending.pop(("dispatch", a.half)))

    # ------------------------------------------------------------------ combine
    def _combine_send(self, a: LlCombineArgs) -> Tuple[torch.Tensor, torch.Tensor]:
        h = a.handle
        L = a.num_experts // self.num_ranks
        counts = h.recv_count.to(torch.int64)
        dev = counts.device
        lo = torch.repeat_interleave(torch.arange(L, device=dev), counts)
        first = torch.cumsum(counts, 0) - counts
        pos = torch.arange(lo.numel(), device=dev) - first[lo]
        route, t = h.route[lo, pos].to(torch.int64), h[0][lo, pos].to(torch.int64)
        src, k = route >> 8, route & 0xFF
        keep = self._alive_ranks()[src]
        lo, pos, src, k, t = lo[keep], pos[keep], src[keep], k[keep], t[keep]
        header = torch.stack([t, k, torch.zeros_like(t), torch.zeros_like(t)], dim=1).to(torch.int32).view(torch.uint8)
        return torch.cat([header, a.x[lo, pos].contiguous().view(torch.uint8)], dim=1), src

    def _combine_recv(self, a: LlCombineArgs, rows: torch.Tensor, dest: torch.Tensor) -> None:
        T, K, H = a.num_tokens, a.num_topk, a.hidden
        L = a.num_experts // self.num_ranks
        recv, _ = self._exchange(rows, dest, "low_latency_combine")
        dev = a.out.device
        head = recv[:, :_HEADER].contiguous().view(torch.int32).to(torch.int64)
        slots = torch.zeros((T, K, H), dtype=torch.bfloat16, device=dev)
        slots[head[:, 0], head[:, 1]] = recv[:, _HEADER:].contiguous().view(torch.bfloat16)
        idx = a.topk_idx
        valid = (idx >= 0) & (idx < a.num_experts)
        valid &= self._alive_ranks()[torch.where(valid, idx // L, torch.zeros_like(idx))]
        acc = torch.zeros((T, H), dtype=torch.float32, device=dev)
        for k in range(K):
            acc = torch.where(valid[:, k:k + 1], acc + slots[:, k].float() * a.topk_weights[:, k:k + 1], acc)
        a.out.copy_(acc.to(torch.bfloat16))

    def combine(self, a: LlCombineArgs, phases: int) -> None:
        if phases & 1:
            self._pending[("combine", a.half)] = self._combine_send(a)
        if phases & 2:
            self._combine_recv(a, *self._pending.pop(("combine", a.half)))

    # ------------------------------------------------------------------ buffer, mask
    def clean(self) -> None:
        self._pending.clear()

    def zero_copy_source(self, half: int, shape: Tuple[int, int, int]) -> torch.Tensor:
        t = self._zero_copy.get(half)
        if t is None or tuple(t.shape) != tuple(shape):
            t = self._zero_copy[half] = torch.zeros(shape, dtype=torch.bfloat16, device=self.rt.device)
        return t

    def set_mask(self, rank: int, masked: bool) -> None:
        self.mask[rank] = int(masked)

    def mask_status(self) -> torch.Tensor:
        return self.mask.clone()

    def clean_mask(self) -> None:
        self.mask.zero_()
