"""The plain-torch exchanges of Ulysses sequence parallelism: the reference that ``python -m
ipc_all2all.demo`` checks ``send_recv_heads`` / ``gather_heads`` against, bit for bit.

Each of ``W`` ranks holds ``n[r]`` tokens of a sequence of ``T`` and all ``H`` heads;
``send`` turns ``[b, n[r], H, D]`` into ``[b, T, H/W, D]`` (all tokens, this rank's heads) and
``gather`` is its inverse:

* :class:`TorchComm`: the DeepSpeed-Ulysses path, permute -> ``all_to_all_single`` -> permute, over
  NCCL, or over gloo through host memory;
* :class:`GatherComm`: the same exchange by another route (every rank all-gathers every tensor and
  slices), for the CPU, where ipc_all2all itself cannot run.

Both have ``set_counts(counts)``, ``send(t, which)`` and ``gather(t)`` (the interface of the model
block's communication objects in the repository's tools/).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch


def split_tokens(total: int, world: int, uneven: bool = False) -> List[int]:
    """Tokens per rank: an even split (the first ``total % world`` ranks one more), or with ``uneven``
    a split proportional to ``rank + 1`` (rank 0 fewest), summing to ``total``."""
    if uneven:
        weights = [r + 1 for r in range(world)]
        counts = [total * w // sum(weights) for w in weights]
    else:
        counts = [total // world] * world
    for r in range(total - sum(counts)):
        counts[r % world] += 1
    return counts


class TorchComm:
    """permute -> ``torch.distributed.all_to_all_single`` -> permute (the layout DeepSpeed-Ulysses
    uses), on bytes. ``via_host``: the collective runs on host copies (gloo, e.g. ranks sharing one
    GPU, where NCCL refuses two ranks on a device). ``pre``: applied to every tensor before it is sent
    (e.g. the e4m3 round trip of an fp8-wire reference)."""

    def __init__(self, rank: int, world: int, group=None, via_host: bool = False,
                 pre: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        self.rank, self.world, self.group, self.via_host, self.pre = rank, world, group, via_host, pre
        self.counts: List[int] = []

    def set_counts(self, counts: Sequence[int]) -> None:
        self.counts = list(counts)

    def _all_to_all(self, inp: torch.Tensor, out_rows: List[int], in_rows: List[int], row_bytes: int) -> torch.Tensor:
        import torch.distributed as dist

        src = inp.reshape(-1).view(torch.uint8)
        out = torch.empty(sum(out_rows) * row_bytes, dtype=torch.uint8, device=inp.device)
        outs, ins = [r * row_bytes for r in out_rows], [r * row_bytes for r in in_rows]
        if self.via_host:
            host = torch.empty_like(out, device="cpu")
            dist.all_to_all_single(host, src.cpu(), outs, ins, group=self.group)
            out.copy_(host)
        else:
            dist.all_to_all_single(out, src, outs, ins, group=self.group)
        return out.view(inp.dtype)

    def send(self, x: torch.Tensor, which: int = 0) -> torch.Tensor:
        """``[b, n, H, D] -> [b, T, H/W, D]``: rank r receives heads ``r*H/W:(r+1)*H/W`` of every token."""
        if self.pre is not None:
            x = self.pre(x)
        b, n, H, D = x.shape
        W, counts = self.world, self.counts
        hpr = H // W
        inp = x.view(b, n, W, hpr, D).permute(2, 0, 1, 3, 4).contiguous()   # [W, b, n, hpr, D]: by target
        row = hpr * D * x.element_size()
        out = self._all_to_all(inp, [b * c for c in counts], [b * n] * W, row)
        if b == 1:  # senders' blocks already in token order
            return out.view(1, sum(counts), hpr, D)
        parts = out.split([b * c * hpr * D for c in counts])
        return torch.cat([p.view(b, c, hpr, D) for p, c in zip(parts, counts)], dim=1)

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """``[b, T, H/W, D] -> [b, n, H, D]``, the inverse of :meth:`send`."""
        if self.pre is not None:
            y = self.pre(y)
        b, T, hpr, D = y.shape
        W, counts, n = self.world, self.counts, self.counts[self.rank]
        if b == 1:  # every rank's rows are one block already
            inp = y
        else:
            starts = [sum(counts[:r]) for r in range(W)]
            inp = torch.cat([y[:, s:s + c].reshape(-1) for s, c in zip(starts, counts)])
        row = hpr * D * y.element_size()
        out = self._all_to_all(inp, [b * n] * W, [b * c for c in counts], row)
        return out.view(W, b, n, hpr, D).permute(1, 2, 0, 3, 4).reshape(b, n, W * hpr, D)

    def synchronize(self) -> None:
        pass

    def destroy(self) -> None:
        pass


class GatherComm(TorchComm):
    """The exchange by another route, for the CPU check: every rank all-gathers every rank's whole
    tensor and slices out what it receives (no permutes, no all-to-all)."""

    def _everyone(self, t: torch.Tensor, rows: List[int]) -> List[torch.Tensor]:
        import torch.distributed as dist

        b = t.shape[0]
        size = max(rows)
        padded = torch.zeros((b, size) + tuple(t.shape[2:]), dtype=t.dtype, device=t.device)
        padded[:, :t.shape[1]] = t
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather([p.view(torch.uint8) for p in parts], padded.view(torch.uint8), group=self.group)
        return [p[:, :r] for p, r in zip(parts, rows)]

    def send(self, x: torch.Tensor, which: int = 0) -> torch.Tensor:
        hpr = x.shape[2] // self.world
        xs = self._everyone(x, self.counts)
        return torch.cat([t[:, :, self.rank * hpr:(self.rank + 1) * hpr] for t in xs], dim=1).contiguous()

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        T = y.shape[1]
        ys = self._everyone(y, [T] * self.world)
        s, n = sum(self.counts[:self.rank]), self.counts[self.rank]
        return torch.cat([t[:, s:s + n] for t in ys], dim=2).contiguous()
