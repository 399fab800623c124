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
peers (so a refusal of bad expert ids, or of a rank whose geometry words differ, carried with the first
stage's counts, still reaches every rank, also one that hears from that rank through a forwarder only),
and every wait is bounded as in direct mode, naming the stage.

Every word a rank takes from a peer is checked before it is used as a rank, mask or token index: the
source rank, scale-up mask and token of each dispatch row (a forwarder: that they are its sender's,
for this rail; a receiver: that the row's source is on its forwarder's rail and the mask names it),
the destination and sender of each combine row. A row that fails is placed nowhere and the call raises
``CommError`` naming the stage, the rank, the peer and the word; a forwarder that finds one still runs
the next stage (nobody is left waiting), sending each of that stage's peers a row marked invalid in
place of what it dropped (its rank word ``_MARK - r``, r the rank whose row it dropped), so those ranks
raise too instead of returning rows with a gap, naming both the forwarder and that rank; every rank's
exchanges of the call complete and the next call starts in step.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from . import _C
from ._domains import Domains

__all__ = ["HybridExchange", "ForwardMetadata", "forward_metadata", "as_bytes", "from_bytes"]

_EXTRA = 16  # bytes appended to each row in flight: two int64 (see each stage)
_MARK = -2   # a marker row's rank word is _MARK - r: r's row could not be relayed (module docstring)

# (send rows, per-destination counts, stage name, bad ids or None, num_experts, geometry words or None)
#   -> (recv rows, per-source counts)
AllToAll = Callable[[torch.Tensor, List[int], str, Optional[Tuple[int, int]], int, Optional[Tuple[int, ...]]],
                    Tuple[torch.Tensor, List[int]]]

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


def _sources(counts: List[int], device: torch.device) -> torch.Tensor:
    """The rank each row of an exchange came from (rows grouped by source rank, ``counts`` each)."""
    return torch.repeat_interleave(torch.arange(len(counts), device=device), torch.tensor(counts, device=device))


Check = Tuple[torch.Tensor, str, torch.Tensor]  # (bad [n] bool, the word's name, its values [n])


def _violation(stage: str, rank: int, peers: torch.Tensor, verb: str,
               checks: List[Check]) -> Tuple[Optional[Exception], Optional[torch.Tensor]]:
    """The first row that fails one of ``checks``, as a ``CommError`` naming the stage, this rank, the
    peer the row came from (``peers``) and the word; and which rows fail any check (None: every row
    passes)."""
    err, bad_rows = None, None
    found = torch.stack([bad.any() for bad, _, _ in checks]).tolist()  # one device sync for them all
    for (bad, word, values), any_bad in zip(checks, found):
        if not any_bad:
            continue
        bad_rows = bad if bad_rows is None else bad_rows | bad
        if err is None:
            i = int(torch.nonzero(bad)[0, 0])
            err = _C.CommError(f"hybrid {stage} [rank {rank}]: protocol error: rank {int(peers[i])} {verb} a row whose "
                               f"{word} is {int(values[i])} (a corrupted word); no row was placed where it points. "
                               "Every rank's exchanges of this call completed: the buffer stays usable")
    return err, bad_rows


def _marker_error(stage: str, rank: int, peers: torch.Tensor, words: torch.Tensor,
                  num_ranks: int) -> Optional[Exception]:
    """The error of the first marker row (a rank word ``_MARK - r``, ``0 <= r < num_ranks``) among rows
    received from ``peers``: that peer could not relay a row rank ``r`` sent it; None when none is."""
    marked = (words <= _MARK) & (words > _MARK - num_ranks)
    if not bool(marked.any()):
        return None
    i = int(torch.nonzero(marked)[0, 0])
    relayer, origin = int(peers[i]), _MARK - int(words[i])
    return _C.CommError(f"hybrid {stage} [rank {rank}]: protocol error: rank {relayer} could not relay a row rank "
                        f"{origin} sent it (that row carried a corrupted word; rank {relayer} raised naming it), so "
                        "this call's rows here are incomplete and none was placed. Every rank's exchanges of this "
                        "call completed: the buffer stays usable")


def _replace(rows: torch.Tensor, bad: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``rows`` without the ``bad`` ones, plus one zero row per entry of ``first`` / ``second`` carrying them
    as its two int64 (a row marked invalid for each next-stage peer, see the module docstring)."""
    mark = torch.zeros((first.numel(), rows.shape[1]), dtype=torch.uint8, device=rows.device)
    mark[:, -_EXTRA:] = _i64_cols(first, second)
    return torch.cat([rows[~bad], mark], 0)


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
                 num_max_tokens_per_rank: int, bad_ids: Optional[Tuple[int, int]], num_experts: int,
                 geometry: Optional[Tuple[int, ...]] = None) -> Tuple[torch.Tensor, List[int], ForwardMetadata]:
        """Delivers direct mode's ``send`` (rows grouped by destination rank, ``send_counts`` each; row
        ``i`` is token ``tokens[i]`` of this rank's ``num_tokens``) along the two hops. ``bad_ids`` and
        ``geometry`` (this call's words) travel with the first stage's counts (the runtime's exchange).

        Returns:
            ``(recv, recv_counts, (token_metadata_at_forward, channel_linked_list))``: the rows direct
            mode would receive, in its order, with its per-source counts; and what this rank relayed.

        Raises:
            CommError: a row this rank received carries a corrupted word (see the module docstring).
            ValueError: some rank has bad expert ids or other geometry words (every rank raises it, before
                any row moves).
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
        recv1, got1 = self._a2a(rows, counts1, "dispatch scale-out stage", bad_ids, num_experts, geometry)

        # 2. Forward each relayed row to the ranks of this domain its mask names, in arrival order.
        payload1, src1, mask1 = _split(recv1)
        from1, tok1, full = _sources(got1, dev), _token(payload1), (1 << U) - 1
        err1, bad1 = _violation("dispatch scale-out stage", me, from1, "sent this rank to relay", [
            (src1 != from1, "source rank", src1), ((mask1 < 1) | (mask1 > full), "scale-up mask", mask1),
            ((tok1 < 0) | (tok1 >= M), "token index", tok1)])
        if bad1 is not None:  # every rank here gets a marker naming the first bad row's sender
            origin = from1[torch.nonzero(bad1)[0, 0]]
            recv1 = _replace(recv1, bad1, (_MARK - origin).view(1), torch.full((1,), full, device=dev))
            payload1, src1, mask1 = _split(recv1)
        F = recv1.shape[0]
        _, fi, fb = fanout = _fanout(mask1, U)
        counts2 = [0] * R
        per_b = torch.bincount(fi, minlength=U).tolist() if F else [0] * U
        for b in range(U):
            counts2[s_me * U + b] = int(per_b[b])
        recv2, got2 = self._a2a(recv1[fb], counts2, "dispatch scale-up stage", None, num_experts, None)
        if err1 is not None:
            raise err1
        forward = forward_metadata(src1 * M + _token(payload1), mask1, U, fanout)

        # 3. Direct mode's order: by source rank, then source token (the record's last int64).
        payload, src, mask2 = _split(recv2)
        tok = _token(payload)
        from2 = _sources(got2, dev)
        marker = _marker_error("dispatch scale-up stage", me, from2, src, R)
        if marker is not None:
            raise marker
        err2, _ = _violation("dispatch scale-up stage", me, from2, "relayed", [
            ((src < 0) | (src >= R) | (src % U != from2 % U), "source rank", src),
            ((mask2 < 1) | (mask2 > full) | ((mask2 >> u_me) & 1 == 0), "scale-up mask", mask2),
            ((tok < 0) | (tok >= M), "token index", tok)])
        if err2 is not None:
            raise err2
        order = torch.argsort(src * M + tok, stable=True)
        recv_counts = torch.bincount(src, minlength=R).tolist() if recv2.shape[0] else [0] * R
        return payload[order], [int(c) for c in recv_counts], forward

    # ------------------------------------------------------------------ combine
    def combine(self, send: torch.Tensor, send_counts: List[int],
                geometry: Optional[Tuple[int, ...]] = None) -> Tuple[torch.Tensor, List[int]]:
        """Delivers combine's ``send`` (partial rows grouped by destination rank) along the reverse path;
        ``geometry`` (this call's words) travels with the first stage's counts.

        Returns:
            ``(recv, recv_counts)``: the rows direct mode would receive, grouped by the rank that
            computed them (rank order), each sender's rows in its order; and the per-sender counts.

        Raises:
            CommError: a row this rank received carries a corrupted word (see the module docstring).
            ValueError: some rank's geometry words differ (every rank raises it, before any row moves).
        """
        d = self.d
        R, S, U, me = d.num_ranks, d.num_scaleout_ranks, d.num_scaleup_ranks, d.rank_idx
        s_me, u_me = d.scaleout_rank_idx, d.scaleup_rank_idx
        dev = send.device
        dst = torch.repeat_interleave(torch.arange(R, device=dev), torch.tensor(send_counts, device=dev))
        # 1. To the forwarder of each destination's rail in this domain (stable: per-destination order kept).
        fwd = s_me * U + dst % U
        order1 = torch.argsort(fwd, stable=True)
        rows1 = torch.cat([send, _i64_cols(dst, torch.full_like(dst, me))], 1)[order1]
        counts1 = torch.bincount(fwd, minlength=R).tolist() if dst.numel() else [0] * R
        recv1, got1 = self._a2a(rows1, [int(c) for c in counts1], "combine scale-up stage", None, 0, geometry)
        # 2. Across the rail to the destination.
        _, dst1, sender1 = _split(recv1)
        from1 = _sources(got1, dev)
        err1, bad1 = _violation("combine scale-up stage", me, from1, "sent this rank to relay", [
            (sender1 != from1, "sender rank", sender1),
            ((dst1 < 0) | (dst1 >= R) | (dst1 % U != u_me), "destination rank", dst1)])
        if bad1 is not None:  # every rail peer gets a marker naming the first bad row's sender
            rails = torch.arange(S, device=dev) * U + u_me
            origin = from1[torch.nonzero(bad1)[0, 0]]
            recv1 = _replace(recv1, bad1, rails, torch.full_like(rails, _MARK) - origin)
            _, dst1, _ = _split(recv1)
        order2 = torch.argsort(dst1, stable=True)
        counts2 = torch.bincount(dst1, minlength=R).tolist() if recv1.shape[0] else [0] * R
        self.last_scaleout_rows = sum(counts2) - int(counts2[me])
        recv2, got2 = self._a2a(recv1[order2], [int(c) for c in counts2], "combine scale-out stage", None, 0, None)
        if err1 is not None:
            raise err1
        payload, dst2, sender = _split(recv2)
        from2 = _sources(got2, dev)
        marker = _marker_error("combine scale-out stage", me, from2, sender, R)
        if marker is not None:
            raise marker
        err2, _ = _violation("combine scale-out stage", me, from2, "relayed", [
            (dst2 != me, "destination rank", dst2),
            ((sender < 0) | (sender >= R) | (sender // U != from2 // U), "sender rank", sender)])
        if err2 is not None:
            raise err2
        order = torch.argsort(sender, stable=True)
        recv_counts = torch.bincount(sender, minlength=R).tolist() if recv2.shape[0] else [0] * R
        return payload[order], [int(c) for c in recv_counts]
