"""Hybrid mode's exchange (DeepEP V2's two-hop routing over ``torch.distributed``, the torch runtime's) and
the forwarders' metadata layout both runtimes return (``forward_metadata``). The domains, the GIN request
and the SM / QP model are ``_domains``'.

With ``S > 1`` scale-out domains of ``U`` ranks (``_domains``), rank ``r = s * U + u`` talks across
domains only to its *rail peers* ``s' * U + u``. The torch runtime builds the same rows as in direct
mode (one per destination rank, grouped by destination) and hands them here instead of to one
all-to-all:

dispatch
    1. *Scale-out stage*: each token goes once to each destination domain ``s'`` that owns one of its
       experts, to the rail peer ``s' * U + u`` (the forwarder), with the ``U``-bit mask of the ranks
       it goes to there. A token therefore crosses the network once per destination domain, not once
       per destination rank -- the point of hybrid mode.
    2. *Scale-up stage*: each forwarder sends every row it received to the ranks of its own domain that
       the mask names, in the order it received them.
    3. The receiver orders the rows by (source rank, source token): the order direct mode delivers, so
       everything downstream -- expanded layout, metadata, combine -- is the same computation on the
       same rows, and the outputs are bitwise those of direct mode.

    The forwarder records what it relayed (``forward_metadata``): ``token_metadata_at_forward [F, 2 + U]``
    int32, one row per relayed token in arrival order: ``[src_global_idx, scale-up mask, then per
    scale-up rank b the row's index in the stream sent to b, or -1]``; and ``channel_linked_list [U,
    F]`` int32: per scale-up rank b, the relayed rows sent to b in order, padded with -1 (one channel:
    the exchange has no SM channels).

combine
    The reverse path: 1. *scale-up stage*: every partial row goes to the forwarder of its destination's
    rail in the sender's domain (``s * U + dst % U``); 2. *scale-out stage*: the forwarder sends it to
    its destination. The destination orders rows by original sender, keeping each sender's order, and
    reduces exactly as direct mode does. Partials are not summed per domain on the way (DeepEP's
    hybrid combine does, which changes the fp32 summation order): the outputs stay bitwise those of
    direct mode, at the cost of one row per (token, expert rank) on the network instead of one per
    (token, domain).

Every stage is an ``all_to_all_single`` over the whole group with zero counts outside the stage's
peers (so a refusal of bad expert ids, carried with the first stage's counts, still reaches every
rank), and every wait is bounded as in direct mode, naming the stage.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from ._domains import Domains

__all__ = ["HybridExchange", "ForwardMetadata", "forward_metadata", "as_bytes", "from_bytes"]

_EXTRA = 16  # bytes appended to each row in flight: two int64 (see each stage)

# (send rows, per-destination counts, stage name, bad ids or None, num_experts) -> (recv rows, per-source counts)
AllToAll = Callable[[torch.Tensor, List[int], str, Optional[Tuple[int, int]], int], Tuple[torch.Tensor, List[int]]]

ForwardMetadata = Tuple[torch.Tensor, torch.Tensor]  # (token_metadata_at_forward, channel_linked_list)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 2-D contiguous tensor viewed as ``[rows, row_bytes]`` uint8."""
    t = t.contiguous()
    row_bytes = t.element_size()
    for d in t.shape[1:]:
        row_bytes *= d
    if t.numel() == 0:  # e.g. no tokens: an empty tensor may keep strides (0) that view() refuses
        return torch.empty((t.shape[0], row_bytes), dtype=torch.uint8, device=t.device)
    return t.view(torch.uint8).reshape(t.shape[0], row_bytes)


def from_bytes(b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    """Columns of a ``[rows, bytes]`` uint8 tensor read as ``dtype`` (``[rows, cols]``)."""
    # A fresh copy unless the view is safe: one row's slice counts as contiguous but may keep an odd
    # row stride or a misaligned offset, which view() refuses.
    if not (b.is_contiguous() and b.stride(0) == b.shape[1] and b.storage_offset() % dtype.itemsize == 0):
        b = b.clone(memory_format=torch.contiguous_format)
    return b.view(dtype).reshape(b.shape[0], cols)


def _i64_cols(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` uint8: two int64 columns."""
    return as_bytes(torch.stack([a, b], 1).to(torch.int64))


def _split(rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(payload, first int64, second int64)`` of rows carrying ``_i64_cols``."""
    tail = from_bytes(rows[:, -_EXTRA:], torch.int64, 2)
    return rows[:, :-_EXTRA], tail[:, 0], tail[:, 1]


def _token(payload: torch.Tensor) -> torch.Tensor:
    """The source token index of dispatch records (their last int64)."""
    return from_bytes(payload[:, -8:], torch.int64, 1).reshape(-1)


def _fanout(mask: torch.Tensor, num_scaleup_ranks: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(bits [F, U], fi, fb)``: which scale-up ranks each relayed row goes to, and the (rank, row) pairs
    destination-major, arrival order inside."""
    bits = ((mask.view(-1, 1).to(torch.int64) >> torch.arange(num_scaleup_ranks, device=mask.device).view(1, -1))
            & 1).bool()
    fi, fb = torch.nonzero(bits.t(), as_tuple=True)
    return bits, fi, fb


def forward_metadata(src_global: torch.Tensor, mask: torch.Tensor, num_scaleup_ranks: int,
                     fanout: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> ForwardMetadata:
    """The handle's forwarder metadata (layout: the module docstring) from what a forwarder relayed.

    Arguments:
        src_global: ``[F]`` ``src_rank * num_max_tokens_per_rank + token`` of each relayed token, in
            arrival order (by source rank, then token).
        mask: ``[F]`` the scale-up ranks of this domain each one went to (bit ``b``: rank ``b``).
        num_scaleup_ranks: ``U``.
        fanout: ``_fanout(mask, U)`` when the caller has it already.

    Returns:
        ``(token_metadata_at_forward [F, 2 + U], channel_linked_list [U, width])`` int32.
    """
    U, dev, F = num_scaleup_ranks, mask.device, mask.numel()
    bits, fi, fb = fanout if fanout is not None else _fanout(mask, U)
    meta = torch.full((F, 2 + U), -1, dtype=torch.int32, device=dev)
    meta[:, 0] = src_global.to(torch.int32)
    meta[:, 1] = mask.to(torch.int32)
    # position of each (row, b) in the stream to b
    per_b = bits.sum(0)
    start = torch.cumsum(per_b, 0) - per_b  # [U]
    pos = torch.arange(fi.numel(), device=dev) - start[fi]
    meta[fb, 2 + fi] = pos.to(torch.int32)
    width = int(per_b.max()) if F else 0
    linked = torch.full((U, width), -1, dtype=torch.int32, device=dev)
    linked[fi, pos] = fb.to(torch.int32)
    return meta, linked


class HybridExchange:
    """Two-hop dispatch and combine exchanges of one rank (see the module docstring).

    Arguments:
        domains: the rank's domains (``domains.hybrid`` must be True).
        all_to_all: the runtime's bounded exchange of rows over the whole group.
    """

    def __init__(self, domains: Domains, all_to_all: AllToAll) -> None:
        self.d = domains
        self._a2a = all_to_all
        #: Rows this rank sent to other scale-out domains in the last dispatch / combine (for tests
        #: and benchmarks: what crossed the network).
        self.last_scaleout_rows = 0

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, send: torch.Tensor, send_counts: List[int], tokens: torch.Tensor, num_tokens: int,
                 num_max_tokens_per_rank: int, bad_ids: Optional[Tuple[int, int]],
                 num_experts: int) -> Tuple[torch.Tensor, List[int], ForwardMetadata]:
        """Delivers direct mode's ``send`` (rows grouped by destination rank, ``send_counts`` each; row
        ``i`` is token ``tokens[i]`` of this rank's ``num_tokens``) along the two hops.

        Returns:
            ``(recv, recv_counts, (token_metadata_at_forward, channel_linked_list))``: the rows direct
            mode would receive, in its order, with its per-source counts; and what this rank relayed.
        """
        d = self.d
        R, S, U, me = d.num_ranks, d.num_scaleout_ranks, d.num_scaleup_ranks, d.rank_idx
        s_me, u_me = d.scaleout_rank_idx, d.scaleup_rank_idx
        dev, T, M = send.device, num_tokens, num_max_tokens_per_rank
        dst = torch.repeat_interleave(torch.arange(R, device=dev), torch.tensor(send_counts, device=dev))
        # 1. One row per (destination domain, token), domain-major and ascending token, with its mask.
        key = (dst // U) * T + tokens
        mask = torch.zeros(S * T, dtype=torch.int64, device=dev)
        mask.index_add_(0, key, torch.ones_like(key) << (dst % U))  # distinct bits per key: sum == OR
        # A row of each key: every row of a token holds the same record, so any one of them will do.
        first = torch.zeros(S * T, dtype=torch.int64, device=dev)
        first[key] = torch.arange(key.numel(), device=dev)
        keys = torch.nonzero(mask, as_tuple=True)[0]
        rows = torch.cat([send[first[keys]], _i64_cols(torch.full_like(keys, me), mask[keys])], 1)
        per_domain = torch.bincount(keys // T, minlength=S).tolist() if T else [0] * S
        counts1 = [0] * R
        for s in range(S):
            counts1[s * U + u_me] = int(per_domain[s])
        self.last_scaleout_rows = sum(counts1) - counts1[me]
        recv1, _ = self._a2a(rows, counts1, "dispatch scale-out stage", bad_ids, num_experts)

        # 2. Forward each relayed row to the ranks of this domain its mask names, in arrival order.
        payload1, src1, mask1 = _split(recv1)
        F = recv1.shape[0]
        _, fi, fb = fanout = _fanout(mask1, U)
        counts2 = [0] * R
        per_b = torch.bincount(fi, minlength=U).tolist() if F else [0] * U
        for b in range(U):
            counts2[s_me * U + b] = int(per_b[b])
        recv2, _ = self._a2a(recv1[fb], counts2, "dispatch scale-up stage", None, num_experts)
        forward = forward_metadata(src1 * M + _token(payload1), mask1, U, fanout)

        # 3. Direct mode's order: by source rank, then source token (the record's last int64).
        payload, src, _ = _split(recv2)
        tok = _token(payload)
        order = torch.argsort(src * M + tok, stable=True)
        recv_counts = torch.bincount(src, minlength=R).tolist() if recv2.shape[0] else [0] * R
        return payload[order], [int(c) for c in recv_counts], forward

    # ------------------------------------------------------------------ combine
    def combine(self, send: torch.Tensor, send_counts: List[int]) -> Tuple[torch.Tensor, List[int]]:
        """Delivers combine's ``send`` (partial rows grouped by destination rank) along the reverse path.

        Returns:
            ``(recv, recv_counts)``: the rows direct mode would receive, grouped by the rank that
            computed them (rank order), each sender's rows in its order; and the per-sender counts.
        """
        d = self.d
        R, U, me = d.num_ranks, d.num_scaleup_ranks, d.rank_idx
        s_me = d.scaleout_rank_idx
        dev = send.device
        dst = torch.repeat_interleave(torch.arange(R, device=dev), torch.tensor(send_counts, device=dev))
        # 1. To the forwarder of each destination's rail in this domain (stable: per-destination order kept).
        fwd = s_me * U + dst % U
        order1 = torch.argsort(fwd, stable=True)
        rows1 = torch.cat([send, _i64_cols(dst, torch.full_like(dst, me))], 1)[order1]
        counts1 = torch.bincount(fwd, minlength=R).tolist() if dst.numel() else [0] * R
        recv1, _ = self._a2a(rows1, [int(c) for c in counts1], "combine scale-up stage", None, 0)
        # 2. Across the rail to the destination.
        _, dst1, _ = _split(recv1)
        order2 = torch.argsort(dst1, stable=True)
        counts2 = torch.bincount(dst1, minlength=R).tolist() if recv1.shape[0] else [0] * R
        self.last_scaleout_rows = sum(counts2) - int(counts2[me])
        recv2, _ = self._a2a(recv1[order2], [int(c) for c in counts2], "combine scale-out stage", None, 0)
        payload, _, sender = _split(recv2)
        order = torch.argsort(sender, stable=True)
        recv_counts = torch.bincount(sender, minlength=R).tolist() if recv2.shape[0] else [0] * R
        return payload[order], [int(c) for c in recv_counts]
