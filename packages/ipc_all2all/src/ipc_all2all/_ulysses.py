"""A Ulysses (sequence-parallel) self-attention layer, the block of ``python -m ipc_all2all.demo``.

Each of ``W`` ranks holds ``n[r]`` tokens of a sequence of ``T`` and all ``H`` heads. The layer:

    q, k, v = x @ Wq, x @ Wk, x @ Wv          [b, n[r], H, D]     (local tokens, all heads)
    q, k, v = send_recv_heads(q, k, v)        [b, T, H/W, D]      (all tokens, this rank's heads)
    o = scaled_dot_product_attention(q, k, v)                     (flash on a GPU)
    o = gather_heads(o)                       [b, n[r], H, D]
    y = o @ Wo                                [b, n[r], H*D]

The communication is a pluggable object with ``send(t, which)`` and ``gather(t)``:
:class:`IpcComm` (ipc_all2all, one instance per q, k, v: their zero-copy outputs live until
the attention has read them) and :class:`TorchComm` (the DeepSpeed-Ulysses path: permute ->
``all_to_all_single`` -> permute, over NCCL, or over gloo through host memory). The compute is the
same code for both, so with exact communication the outputs are the same bits.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F


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


class Weights:
    """The layer's projections, the same on every rank (generated on the CPU from ``seed``, so any
    device and rank gets the same bits): ``q``, ``k``, ``v`` and ``o`` of shape ``[H*D, H*D]``."""

    def __init__(self, hidden: int, dtype: torch.dtype, device, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        scale = hidden ** -0.5
        self.q, self.k, self.v, self.o = (
            (torch.randn(hidden, hidden, generator=g) * scale).to(dtype=dtype, device=device) for _ in range(4))


def layer_input(tokens: int, hidden: int, dtype: torch.dtype, device, rank: int, batch: int = 1,
                seed: int = 1) -> torch.Tensor:
    """Rank ``rank``'s input ``[batch, tokens, hidden]``, a fixed function of the seed, the rank and the
    device type (generated on ``device``)."""
    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    return torch.randn(batch, tokens, hidden, generator=g, device=device).to(dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flash: bool) -> torch.Tensor:
    """``[b, T, h, D]`` in, ``[b, T, h, D]`` (contiguous) out; flash attention where asked (GPU)."""
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    if flash:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            o = F.scaled_dot_product_attention(*args)
    else:
        o = F.scaled_dot_product_attention(*args)
    return o.transpose(1, 2).contiguous()


def layer(x: torch.Tensor, w: Weights, comm, heads: int, head_dim: int, flash: bool,
          marks: Optional[Callable[[Callable[[], torch.Tensor]], torch.Tensor]] = None) -> torch.Tensor:
    """One forward of the layer on this rank's tokens ``x[b, n, H*D]``; ``marks(fn)``, if given, runs each
    communication call ``fn`` (so a caller can time it)."""
    run = marks or (lambda fn: fn())
    b, n, _ = x.shape
    q, k, v = (F.linear(x, p).view(b, n, heads, head_dim) for p in (w.q, w.k, w.v))
    qh = run(lambda: comm.send(q, 0))
    kh = run(lambda: comm.send(k, 1))
    vh = run(lambda: comm.send(v, 2))
    o = attention(qh, kh, vh, flash)
    out = run(lambda: comm.gather(o))
    return F.linear(out.view(b, n, heads * head_dim), w.o)


class IpcComm:
    """ipc_all2all: three instances built with LTX's constructor over ``group`` (one each for q, k and
    v, as LTX's AttentionManager does; the q instance also gathers), zero-copy outputs; ``fp8_wire``
    sends e4m3 plus a scale per head vector."""

    def __init__(self, rank: int, world: int, seqlen: int, hidden: int, group, timeout_seconds: float = 60.0):
        import ipc_all2all

        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self.a2a = [ipc_all2all.All2All(rank, world, seqlen, hidden, sms, torch.bfloat16, group=group,
                                        timeout_seconds=timeout_seconds) for _ in range(3)]
        self.fp8_wire = False

    def set_counts(self, counts: Sequence[int]) -> None:
        for a in self.a2a:
            a.set_rank_tokens(list(counts))

    def send(self, t: torch.Tensor, which: int) -> torch.Tensor:
        return self.a2a[which].send_recv_heads(t, fp8_wire=self.fp8_wire)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return self.a2a[0].gather_heads(t, fp8_wire=self.fp8_wire)

    def synchronize(self) -> None:
        for a in self.a2a:
            a.synchronize()

    def destroy(self) -> None:
        for a in self.a2a:
            a.destroy()


class TorchComm:
    """permute -> ``torch.distributed.all_to_all_single`` -> permute (the layout DeepSpeed-Ulysses
    uses), on bytes. ``via_host``: the collective runs on host copies (gloo, e.g. ranks sharing one
    GPU, where NCCL refuses two ranks on a device). ``pre``: applied to every tensor before it is sent
    (the demo's fp8 reference applies the e4m3 round trip there)."""

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


def qdq_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp8 on the wire in plain torch: per head vector (last dim) ``s = amax / 448`` (1 where amax is 0),
    ``bf16(float(e4m3(x / s)) * s)``, each step IEEE round-to-nearest as the kernels do it."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # A tensor divisor: torch turns division by a Python scalar into a multiply by its reciprocal,
    # which rounds differently.
    scale = torch.where(amax > 0, amax / torch.full_like(amax, 448.0), torch.ones_like(amax))
    return ((xf / scale).to(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16)


def full_layer(x_full: torch.Tensor, w: Weights, heads: int, head_dim: int, flash: bool) -> torch.Tensor:
    """The same layer on one process over the whole sequence (no sharding): the CPU check's reference."""
    b, T, _ = x_full.shape
    q, k, v = (F.linear(x_full, p).view(b, T, heads, head_dim) for p in (w.q, w.k, w.v))
    o = attention(q, k, v, flash)
    return F.linear(o.view(b, T, heads * head_dim), w.o)
