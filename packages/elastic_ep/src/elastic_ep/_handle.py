"""``EPHandle``: the routing of a dispatch, which ``combine`` and a cached ``dispatch`` take back, and
DeepEP V2's deterministic sort of a dispatch's outputs."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional

import torch

__all__ = ["EPHandle", "deterministic_perm", "sorted_metadata"]


@dataclass(eq=False)  # identity semantics, as DeepEP's class: hashable, and == never compares tensors
class EPHandle:
    """Everything ``combine`` (and a cached ``dispatch``) needs from an earlier ``dispatch``.

    The fields are DeepEP's, in its constructor order: the routing (``topk_idx [T, K]``, a copy when
    ``do_handle_copy``), the SM count of the dispatch (``num_sms``, which ``combine(num_sms=0)``
    reuses), the received counts (host and device), the source metadata ``recv_src_metadata
    [N, K+2]`` (``[src_rank*max_tokens+token, src_rank*K+master_lane, expanded row per lane or -1]``)
    and the per-token slots in the destination buffers. ``cached_recv_src_metadata_before_sort`` is
    DeepEP's plain attribute: None until a deterministic sort stores a clone of the metadata it
    replaced. Then ours: in deterministic mode ``perm`` (received row ``j`` the user sees is row
    ``perm[j]`` of the runtime's output) and ``raw_recv_src_metadata`` (the runtime's metadata, in
    its own row order, which ``combine`` reads), while ``recv_src_metadata`` describes the user's
    (sorted) rows as in DeepEP; ``buffer_id`` names the buffer that made the handle (a serial number
    never reused in the process, unlike ``id()``: a handle of a destroyed and collected buffer is
    refused by every later one). Zero-copy dispatches (``dispatch(zero_copy=True)``) keep
    ``direct_base`` (``[R]`` int32: where this rank's rows start at each destination, reused by cached
    zero-copy dispatches) and ``views_serial`` (the buffer's dispatch serial number whose ``recv_x``
    views the handle's outputs are; 0 when its outputs are plain tensors). ``dispatch_id``: the serial number
    of the dispatch that made the handle on its runtime, which every rank counts alike (the torch runtime's;
    0 on the native one): a combine or cached dispatch whose ranks pass handles of different dispatches is
    refused on every rank (``_geometry.handle_word``).
    """

    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: torch.Tensor
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: List[int]
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor
    psum_num_recv_tokens_per_expert: torch.Tensor
    num_unaligned_recv_tokens_per_expert: torch.Tensor
    recv_src_metadata: torch.Tensor
    dst_buffer_slot_idx: torch.Tensor
    token_metadata_at_forward: Optional[torch.Tensor] = None
    channel_linked_list: Optional[torch.Tensor] = None
    cached_recv_src_metadata_before_sort: Optional[torch.Tensor] = None
    perm: Optional[torch.Tensor] = None
    raw_recv_src_metadata: Optional[torch.Tensor] = None
    buffer_id: int = 0
    direct_base: Optional[torch.Tensor] = None
    views_serial: int = 0
    dispatch_id: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens the dispatch routed (``topk_idx.shape[0]``)."""
        return int(self.topk_idx.shape[0])

    @property
    def num_topk(self) -> int:
        """Experts per token (``topk_idx.shape[1]``)."""
        return int(self.topk_idx.shape[1])

    @property
    def backend_recv_src_metadata(self) -> torch.Tensor:
        """The metadata in the runtime's row order (what ``combine`` reads)."""
        return self.raw_recv_src_metadata if self.raw_recv_src_metadata is not None else self.recv_src_metadata

    @property
    def num_allocated_tokens(self) -> int:
        """Rows of ``recv_x`` (and of ``combine``'s input): expanded or per-token count."""
        return self.num_expanded_tokens if self.do_expand else self.num_recv_tokens

    def copy(self) -> "EPHandle":
        """A copy of the handle.

        Returns:
            An ``EPHandle`` whose tensors are clones (safe against later in-place changes by the caller).
        """
        def c(v):
            return v.clone() if isinstance(v, torch.Tensor) else (list(v) if isinstance(v, list) else v)
        return replace(self, **{f: c(getattr(self, f)) for f in self.__dataclass_fields__})

    def deterministic_sort(self, do_cpu_sync: bool, is_cached_dispatch: bool, recv_x: torch.Tensor,
                           recv_sf: Optional[torch.Tensor], recv_topk_idx: Optional[torch.Tensor],
                           recv_topk_weights: Optional[torch.Tensor],
                           channel_linked_list: Optional[torch.Tensor]) -> None:
        """Sorts a dispatch's outputs in place by source token (DeepEP's method, same arguments).

        A deterministic buffer calls this itself (when the caller waits, with
        ``async_with_compute_stream``); it is public because DeepEP's is, e.g. to sort the outputs
        of a non-deterministic buffer. The first sort of a handle fixes its permutation, stores a
        clone of the metadata in ``cached_recv_src_metadata_before_sort`` and turns
        ``recv_src_metadata`` into the sorted rows' metadata. A second non-cached call on a sorted
        handle does nothing (the outputs it was made with are sorted already). Outputs of a cached
        dispatch: non-expanded ones arrive in the runtime's order and get the handle's permutation;
        expanded ones are placed through ``recv_src_metadata``, so they are as sorted as it is and
        the call does nothing, as in DeepEP.

        Arguments:
            do_cpu_sync: accepted; rows past the real count are found on the device either way.
            is_cached_dispatch: the outputs come from ``dispatch(handle=self)``.
            recv_x, recv_sf, recv_topk_idx, recv_topk_weights: the dispatch's outputs (None skipped).
            channel_linked_list: None or the handle's own (hybrid mode); the sort leaves it as it is: it
                lists the rows a forwarder relayed, which the receiver's sort does not move.
        """
        if channel_linked_list is not None and channel_linked_list is not self.channel_linked_list:
            raise ValueError("channel_linked_list: expected None or this handle's channel_linked_list (hybrid mode)")
        if is_cached_dispatch and self.do_expand:
            return
        if self.perm is None:
            # Not sorted yet: recv_src_metadata is still the runtime's.
            self.perm = deterministic_perm(self)
            self.raw_recv_src_metadata = self.recv_src_metadata
            self.cached_recv_src_metadata_before_sort = self.recv_src_metadata.clone()
            self.recv_src_metadata = sorted_metadata(self.raw_recv_src_metadata, self.perm, self.do_expand)
        elif not is_cached_dispatch:
            return
        p = self.perm
        for t in (recv_x, recv_sf, recv_topk_idx, recv_topk_weights):
            if t is not None:
                # In place with strides kept, so TMA column-major scales stay so.
                t.copy_(t[p])

    def num_valid_recv_tokens(self) -> torch.Tensor:
        """The real received token count, without a CPU sync.

        Returns:
            A one-element device tensor (the last entry of ``psum_num_recv_tokens_per_scaleup_rank``).
        """
        return self.psum_num_recv_tokens_per_scaleup_rank[-1]


def sorted_metadata(meta: torch.Tensor, perm: torch.Tensor, do_expand: bool) -> torch.Tensor:
    """``recv_src_metadata`` for the rows the user sees (DeepEP's deterministic metadata).

    Non-expand: user row ``j`` is runtime row ``perm[j]``, so the metadata rows are permuted the same
    way. Expand: the metadata has one row per received token, not per output row, and keeps its row
    order; its columns 2.. (the output row of each top-k lane, or -1) are mapped to where those rows
    moved.
    """
    if not do_expand:
        return meta[perm]
    out = meta.clone()
    lanes = out[:, 2:]
    new_pos = torch.empty_like(perm)
    new_pos[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    lanes64 = lanes.to(torch.int64)
    sel = (lanes64 >= 0) & (lanes64 < perm.numel())
    lanes[sel] = new_pos[lanes64[sel]].to(lanes.dtype)
    return out


def deterministic_perm(h: EPHandle) -> torch.Tensor:
    """Row permutation sorting received rows by source token, without a CPU sync.

    Non-expand: rows ordered by ``src_global_idx``; rows past the real count stay at the end.
    Expand: inside each expert segment, rows ordered by source token; padding rows stay at the
    segment's end and rows past the last segment stay where they are.
    """
    meta = h.backend_recv_src_metadata
    dev = meta.device
    n_rows = meta.shape[0]
    n_valid = h.psum_num_recv_tokens_per_scaleup_rank[-1].to(torch.int64)
    tok_valid = torch.arange(n_rows, device=dev) < n_valid
    big = h.num_max_tokens_per_rank * h.psum_num_recv_tokens_per_scaleup_rank.numel() + 1
    src = meta[:, 0].to(torch.int64)
    if not h.do_expand:
        key = torch.where(tok_valid, src, torch.full_like(src, big))
        return torch.sort(key, stable=True).indices
    N_exp = h.num_expanded_tokens
    real = h.num_unaligned_recv_tokens_per_expert.to(torch.int64)
    starts = h.psum_num_recv_tokens_per_expert.to(torch.int64) - real
    rows = torch.arange(N_exp, device=dev)
    e_of_row = (torch.searchsorted(starts, rows, right=True) - 1).clamp(min=0)
    valid_row = rows < starts[e_of_row] + real[e_of_row]
    src_of_row = torch.zeros(N_exp, dtype=torch.int64, device=dev)
    lanes = meta[:, 2:].to(torch.int64)
    sel = (lanes >= 0) & (lanes < N_exp) & tok_valid.view(-1, 1)
    src_of_row[lanes[sel]] = src.view(-1, 1).expand_as(lanes)[sel]
    # Padding rows and rows past the last segment share the largest key of their segment, so the
    # stable sort leaves them after the valid rows, in place.
    key = e_of_row * (big + 1) + torch.where(valid_row, src_of_row, torch.full_like(src_of_row, big))
    return torch.sort(key, stable=True).indices
