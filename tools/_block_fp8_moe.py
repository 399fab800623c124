"""The MoE layer of the prefill loop (tools/_block_fp8_prefill.py): synthetic block-FP8 experts,
balanced top-k routing, the experts' forward pass, and where that forward pass runs.

* :func:`make_layer_sources`: one layer's whole-layer tensors in the layout of
  :func:`~fp8_layerwise.make_block_fp8_sources` (so that :func:`~fp8_layerwise.make_shard_writer` and
  :func:`~fp8_layerwise.reference_shard` take them), but with finite FP8 values and scales that keep
  the activations of order one, so that the GEMMs compute numbers, not NaNs.
* :func:`balanced_routing`: top-k routing in which every expert gets exactly ``tokens * top_k /
  num_experts`` tokens, so that the experts run as batched matmuls.
* :func:`moe_forward`: dequantises this rank's shard to bf16 and runs the experts' FFN (SiLU-gated)
  on the tokens routed to them; the result is this rank's partial sum of the layer's output (the
  TP all-reduce that would follow is left out).
* :class:`GpuCompute` / :class:`CpuCompute`: run a forward pass asynchronously (a CUDA stream of its
  own / one worker thread) and time it; a :class:`Ticket` waits for it.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, List, Optional, Sequence

import torch

from fp8_layerwise._checks import _check, _int_arg
from fp8_layerwise.block_fp8 import BLOCK, block_fp8_expert_nbytes

#: FP8 e4m3 with the exponent's top bit cleared: |value| <= 1.875, never NaN (NaN is S.1111.111).
_FINITE_FP8_MASK = 0xBF


def make_layer_sources(num_experts: int, hidden: int, intermediate: int, seed: int,
                       device: "torch.device | str" = "cpu") -> List[torch.Tensor]:
    """Random whole-layer block-FP8 sources, generated on ``device`` from ``seed``.

    Returns:
        ``[w13 uint8 [E, 2I, H], w13_scale fp32 [E, 2I/128, H/128], w2 uint8 [E, H, I],
        w2_scale fp32 [E, H/128, I/128]]`` on ``device``: the bytes are FP8 e4m3 of magnitude at most
        1.875 (no NaN), the scales in ``[0.5, 1.5) / sqrt(fan-in)``. The same arguments give the same
        bytes on every process of one device type (each rank generates them itself).
    """
    E = _int_arg("num_experts", num_experts, 1)
    H, I = _int_arg("hidden", hidden, 1), _int_arg("intermediate", intermediate, 1)
    block_fp8_expert_nbytes(H, I, 1)  # 128-multiples, else ValueError naming the argument
    g = torch.Generator(device=device).manual_seed(_int_arg("seed", seed, 0))
    w13 = torch.randint(0, 256, (E, 2 * I, H), dtype=torch.uint8, device=device, generator=g)
    w13.bitwise_and_(_FINITE_FP8_MASK)
    w13s = (torch.rand((E, 2 * I // BLOCK, H // BLOCK), device=device, generator=g) + 0.5) / H ** 0.5
    w2 = torch.randint(0, 256, (E, H, I), dtype=torch.uint8, device=device, generator=g)
    w2.bitwise_and_(_FINITE_FP8_MASK)
    w2s = (torch.rand((E, H // BLOCK, I // BLOCK), device=device, generator=g) + 0.5) / I ** 0.5
    return [w13, w13s, w2, w2s]


@dataclasses.dataclass
class Routing:
    """Balanced top-k routing of ``tokens`` over ``num_experts`` (see :func:`balanced_routing`)."""

    experts: torch.Tensor      #: [T, k] int64: the experts of each token (distinct per token)
    weights: torch.Tensor      #: [T, k] fp32: their routing weights (each row sums to 1)
    token_index: torch.Tensor  #: [E, C] int64: the tokens each expert computes, in token order
    expert_weight: torch.Tensor  #: [E, C] bf16: the routing weight of each of those rows
    gather_pos: torch.Tensor   #: [T, k] int64: row of (token, choice j) in the experts' [E*C] output

    @property
    def tokens_per_expert(self) -> int:
        return self.token_index.shape[1]


def balanced_routing(tokens: int, num_experts: int, top_k: int, seed: int,
                     device: "torch.device | str" = "cpu") -> Routing:
    """Top-k routing in which every expert gets the same number of tokens.

    Token ``t`` goes to the ``top_k`` consecutive experts (mod ``num_experts``) that start at
    ``perm[t] % num_experts`` for a random permutation ``perm`` of the tokens: every start expert is
    drawn by exactly ``tokens / num_experts`` tokens, so every expert gets ``tokens * top_k /
    num_experts`` of them, and a token's experts are distinct. The weights are random and normalised.

    Raises:
        ValueError: ``tokens`` not a positive multiple of ``num_experts``, or ``top_k`` outside
            ``1..num_experts``.
    """
    T, E = _int_arg("tokens", tokens, 1), _int_arg("num_experts", num_experts, 1)
    k = _int_arg("top_k", top_k, 1, E)
    _check(T % E == 0, f"tokens ({T}) must be a multiple of num_experts ({E}) for balanced routing")
    g = torch.Generator().manual_seed(_int_arg("seed", seed, 0))
    start = torch.randperm(T, generator=g) % E
    experts = (start[:, None] + torch.arange(k)) % E                      # [T, k]
    weights = torch.rand((T, k), generator=g) + 0.1
    weights /= weights.sum(dim=1, keepdim=True)
    order = torch.argsort(experts.reshape(-1), stable=True)              # (token, j) pairs by expert
    pos = torch.empty(T * k, dtype=torch.int64)
    pos[order] = torch.arange(T * k)
    C = T * k // E
    return Routing(experts=experts.to(device), weights=weights.to(device),
                   token_index=(order // k).view(E, C).to(device),
                   expert_weight=weights.reshape(-1)[order].view(E, C).to(device=device, dtype=torch.bfloat16),
                   gather_pos=pos.view(T, k).to(device))


def dequantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block-FP8 ``w`` (uint8 bytes of e4m3, ``[E, R, C]``) times its 128x128 ``scale`` (fp32,
    ``[E, R/128, C/128]``) as bf16 ``[E, R, C]`` (FP8 -> bf16 is exact; the product is rounded)."""
    E, R, C = w.shape
    blocks = w.view(torch.float8_e4m3fn).to(torch.bfloat16).view(E, R // BLOCK, BLOCK, C // BLOCK, BLOCK)
    return (blocks * scale.to(torch.bfloat16)[:, :, None, :, None]).view(E, R, C)


def shard_views(buffers: Sequence[torch.Tensor], num_experts: int, hidden: int, shard: int) -> List[torch.Tensor]:
    """A transport's flat layer buffers (``Transport.buffers``) as this rank's shard tensors:
    ``w13 [E, 2s, H]``, ``w13_scale [E, 2s/128, H/128]``, ``w2 [E, H, s]``, ``w2_scale [E, H/128,
    s/128]`` for ``s = intermediate / tp`` (the layout :func:`~fp8_layerwise.reference_shard` cuts)."""
    E, H, s = num_experts, hidden, shard
    w13, w13s, w2, w2s = buffers
    return [w13[:E * 2 * s * H].view(E, 2 * s, H),
            w13s[:E * 2 * s * H // BLOCK ** 2 * 4].view(torch.float32).view(E, 2 * s // BLOCK, H // BLOCK),
            w2[:E * H * s].view(E, H, s),
            w2s[:E * H * s // BLOCK ** 2 * 4].view(torch.float32).view(E, H // BLOCK, s // BLOCK)]


def moe_forward(x: torch.Tensor, routing: Routing, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                w2_scale: torch.Tensor) -> torch.Tensor:
    """This rank's partial output ``[T, H]`` (bf16) of the experts' FFN for the tokens ``x [T, H]``.

    Per expert e (all at once, as batched matmuls): ``h = x[tokens of e] @ W13_e^T`` (``[C, 2s]``),
    ``a = silu(h[:, :s]) * h[:, s:]``, ``y = (a @ W2_e^T) * routing weight``; each token's output is
    the sum of its ``top_k`` rows of ``y``, added in choice order (no atomics: the result is
    bitwise reproducible).
    """
    W13, W2 = dequantize(w13, w13_scale), dequantize(w2, w2_scale)
    s = W13.shape[1] // 2
    h = torch.bmm(x[routing.token_index], W13.transpose(1, 2))           # [E, C, 2s]
    a = torch.nn.functional.silu(h[..., :s]) * h[..., s:]                # [E, C, s]
    y = torch.bmm(a, W2.transpose(1, 2)) * routing.expert_weight[..., None]  # [E, C, H]
    y = y.view(-1, y.shape[-1])
    out = y[routing.gather_pos[:, 0]]
    for j in range(1, routing.gather_pos.shape[1]):
        out += y[routing.gather_pos[:, j]]
    return out


def moe_flops(tokens: int, top_k: int, hidden: int, shard: int) -> int:
    """Matmul FLOPs of :func:`moe_forward` on one rank: ``2*T*k*H*2s + 2*T*k*s*H``."""
    return 6 * tokens * top_k * hidden * shard


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same bits (NaNs included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.view(torch.int16), b.view(torch.int16)) if a.element_size() == 2 else torch.equal(a, b)


class Ticket:
    """One forward pass in flight: ``wait()`` blocks until it finished (re-raising its error),
    ``result`` is its output, ``elapsed_ms()`` its run time, ``interval()`` its (start, end) on the
    host's monotonic clock in seconds."""

    def __init__(self, owner, handle):
        self._owner, self._handle = owner, handle
        self.result: Any = None

    def wait(self) -> "Ticket":
        self._owner._wait(self)
        return self

    def elapsed_ms(self) -> float:
        return self._owner._elapsed_ms(self)

    def interval(self):
        return self._owner._interval(self)


class GpuCompute:
    """Runs forward passes on a CUDA stream of its own, timed by CUDA events.

    ``submit(fn)`` enqueues ``fn()`` (which only launches kernels) behind an event and returns at
    once; ``mark()`` synchronises the device and records a reference event, after which
    ``Ticket.interval()`` maps a pass's events onto the host clock (as ``time.monotonic()`` at the
    mark plus the events' elapsed time since it; the error is the latency of one event record on an
    idle stream, some microseconds, always towards earlier times).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._mark_host: Optional[float] = None
        self._mark_event = None

    def mark(self) -> None:
        torch.cuda.synchronize(self.device)
        self._mark_event = torch.cuda.Event(enable_timing=True)
        self._mark_host = time.monotonic()
        self._mark_event.record(self.stream)

    def submit(self, fn: Callable[[], torch.Tensor]) -> Ticket:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            out = fn()
            end.record(self.stream)
        ticket = Ticket(self, (start, end))
        ticket.result = out
        return ticket

    def _wait(self, ticket: Ticket) -> None:
        ticket._handle[1].synchronize()

    def _elapsed_ms(self, ticket: Ticket) -> float:
        start, end = ticket._handle
        end.synchronize()
        return start.elapsed_time(end)

    def _interval(self, ticket: Ticket):
        start, end = ticket._handle
        end.synchronize()
        return (self._mark_host + self._mark_event.elapsed_time(start) / 1e3,
                self._mark_host + self._mark_event.elapsed_time(end) / 1e3)

    def close(self) -> None:
        torch.cuda.synchronize(self.device)


class CpuCompute:
    """Runs forward passes on one worker thread (the CPU backend's stand-in for a CUDA stream: the
    passes run in submission order while the caller streams the next layer), timed by the host clock."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-compute")

    def mark(self) -> None:
        pass

    def submit(self, fn: Callable[[], torch.Tensor]) -> Ticket:
        def job():
            t0 = time.monotonic()
            out = fn()
            return out, t0, time.monotonic()

        return Ticket(self, self._pool.submit(job))

    def _wait(self, ticket: Ticket) -> None:
        ticket.result = ticket._handle.result()[0]

    def _elapsed_ms(self, ticket: Ticket) -> float:
        _, t0, t1 = ticket._handle.result()
        return (t1 - t0) * 1e3

    def _interval(self, ticket: Ticket):
        return ticket._handle.result()[1:]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
