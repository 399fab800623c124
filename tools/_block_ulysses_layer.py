"""The Ulysses (sequence-parallel) self-attention layer of ``tools/block_ipc_all2all.py``.

Each of ``W`` ranks holds ``n[r]`` tokens of a sequence of ``T`` and all ``H`` heads. The layer:

    q, k, v = x @ Wq, x @ Wk, x @ Wv          [b, n[r], H, D]     (local tokens, all heads)
    q, k, v = send_recv_heads(q, k, v)        [b, T, H/W, D]      (all tokens, this rank's heads)
    o = scaled_dot_product_attention(q, k, v)                     (flash on a GPU)
    o = gather_heads(o)                       [b, n[r], H, D]
    y = o @ Wo                                [b, n[r], H*D]

The communication is a pluggable object with ``send(t, which)`` and ``gather(t)``:
:class:`IpcComm` (ipc_all2all, one instance per q, k, v: their zero-copy outputs live until
the attention has read them), or the plain-torch exchanges of ``ipc_all2all._ulysses``
(``TorchComm``: permute -> ``all_to_all_single`` -> permute, the baseline; ``GatherComm``: all-gather
and slice, the CPU check). The compute is the same code for all, so with exact communication the
outputs are the same bits.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F


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
