"""The plain torch expert-parallel dispatch / combine that a user writes without elastic_ep.

Issue 5 compares elastic_ep end to end with "the torch reference path" (its EP 2 figures: dispatch
648 us, combine 876 us). The repository's own torch backend (``backend="torch"``) cannot be that
reference: it reproduces every output of DeepEP V2's ElasticBuffer (handles, expert layouts, statistics,
slot indices) and takes milliseconds. This is the lean path, measured in the same run by
``tools/bench_elastic_ep.py`` as backend ``torch_ref``:

dispatch (non-expand, CPU-synced, one row per (token, destination rank)):
  1. ``goes[T, R]``: does token t have an expert on rank r;
  2. the per-destination counts through one ``all_to_all_single`` and one host sync;
  3. pack each token's bytes ``[x | scales | top-k ids | top-k weights]`` and gather them in
     destination-major, token-ascending order (``index_select``);
  4. one ``all_to_all_single`` of the packed rows;
  5. unpack into contiguous ``recv_x`` (and ``recv_sf``), ``recv_topk_idx`` as local expert ids
     (-1 where the expert lives elsewhere), ``recv_topk_weights``.
combine: one ``all_to_all_single`` of ``[row | top-k weights]`` back along the reversed splits, then
an fp32 ``index_add_`` into the source tokens (rows and weights), cast to bf16.

Works with any backend whose ``all_to_all_single`` takes the tensors' device (NCCL on CUDA, gloo
on CPU: the CPU test suite runs it that way).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist


@dataclass
class RefHandle:
    """What combine needs from a dispatch: the source token of every sent row and the splits."""

    src_token: torch.Tensor  # [sum(send_counts)] int64, destination-major
    send_counts: List[int]   # rows this rank sent to each rank
    recv_counts: List[int]   # rows this rank received from each rank
    num_tokens: int


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``[N, C]`` of any dtype -> ``[N, C * element_size]`` uint8 (a view when contiguous)."""
    return t.contiguous().view(torch.uint8)


class TorchRefEP:
    """Lean torch dispatch / combine over ``group`` (see the module docstring).

    Arguments:
        group: the process group (its backend must support ``all_to_all_single`` on the tensors' device).
        num_experts: experts over all ranks; rank r owns ``[r * E / R, (r + 1) * E / R)``.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], num_experts: int):
        self.group = group
        self.R = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.R:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the world size ({self.R})")
        self.E, self.L = num_experts, num_experts // self.R

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 sf: Optional[torch.Tensor] = None
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, RefHandle]:
        """Returns ``(recv_x, recv_sf, recv_topk_idx, recv_topk_weights, handle)``; rows in source-rank
        order, ascending source token within a source."""
        T, K = topk_idx.shape
        dev = x.device
        owner = torch.where(topk_idx >= 0, topk_idx // self.L, torch.full_like(topk_idx, -1))
        goes = (owner.unsqueeze(2) == torch.arange(self.R, device=dev).view(1, 1, -1)).any(1)  # [T, R]
        counts = goes.sum(0).to(torch.int64)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        sc, rc = counts.tolist(), recv_counts.tolist()  # the host sync: exact-size outputs
        src_token = goes.t().nonzero(as_tuple=True)[1]  # destination-major, ascending token
        parts = [_bytes(x)] + ([_bytes(sf)] if sf is not None else []) + [_bytes(topk_idx), _bytes(topk_weights)]
        widths = [p.shape[1] for p in parts]
        send = torch.cat(parts, 1).index_select(0, src_token)
        recv = torch.empty((sum(rc), send.shape[1]), dtype=torch.uint8, device=dev)
        dist.all_to_all_single(recv, send, rc, sc, group=self.group)
        cols = torch.split(recv, widths, dim=1)
        recv_x = cols[0].contiguous().view(x.dtype).view(-1, x.shape[1])
        recv_sf = cols[1].contiguous().view(sf.dtype).view(-1, sf.shape[1]) if sf is not None else None
        ids = cols[-2].contiguous().view(torch.int64).view(-1, K)
        lo = self.rank * self.L
        local = (ids >= lo) & (ids < lo + self.L)
        recv_topk_idx = torch.where(local, ids - lo, torch.full_like(ids, -1))
        recv_w = cols[-1].contiguous().view(topk_weights.dtype).view(-1, K)
        return recv_x, recv_sf, recv_topk_idx, recv_w, RefHandle(src_token, sc, rc, T)

    def combine(self, x: torch.Tensor, handle: RefHandle, topk_weights: torch.Tensor
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x[N, H]`` bf16 rows in the dispatch's receive order -> ``(combined_x[T, H], combined_w[T, K])``:
        every rank's row of a token summed in fp32."""
        H, K = x.shape[1], topk_weights.shape[1]
        send = torch.cat([_bytes(x), _bytes(topk_weights.to(torch.float32))], 1)
        back = torch.empty((sum(handle.send_counts), send.shape[1]), dtype=torch.uint8, device=x.device)
        dist.all_to_all_single(back, send, handle.send_counts, handle.recv_counts, group=self.group)
        rows, w = torch.split(back, [H * x.element_size(), K * 4], dim=1)
        out = torch.zeros((handle.num_tokens, H), dtype=torch.float32, device=x.device)
        out.index_add_(0, handle.src_token, rows.contiguous().view(x.dtype).view(-1, H).float())
        ow = torch.zeros((handle.num_tokens, K), dtype=torch.float32, device=x.device)
        ow.index_add_(0, handle.src_token, w.contiguous().view(torch.float32).view(-1, K))
        return out.to(x.dtype), ow
