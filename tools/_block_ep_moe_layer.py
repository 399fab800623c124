"""The DeepSeek-V3 MoE layer that ``tools/block_elastic_ep.py`` runs (elastic_ep's model block), and its
single-process reference.

The layer (routed experts only; DeepSeek-V3's shared expert is a dense FFN on every token that never
communicates, so it is left out):

1. **Router.** ``scores = sigmoid(x @ gate^T)`` in FP32, one affinity per expert. Selection uses
   ``scores + bias`` (a per-expert correction bias that balances the load); the experts form
   ``num_groups`` equal groups, a group's score is the sum of its two best biased scores, the
   ``num_topk_groups`` best groups are kept and the ``num_topk`` best experts among them are chosen.
   The weights are the chosen experts' *unbiased* scores normalised to sum to 1, times
   ``routed_scaling_factor``.
2. **FP8 cast.** Per token and per block of 128 columns: ``scale = amax / 448`` (FP32) and
   ``x / scale`` as ``float8_e4m3fn``; the row travels as 1 byte per value plus one FP32 per block.
3. **Dispatch** (``ElasticBuffer.dispatch``) in expand mode: one row per (token, local expert),
   grouped into per-expert segments that start at multiples of ``expert_alignment`` (128, what a
   grouped GEMM wants), padding zeroed; ``do_cpu_sync=True`` gives exact-size outputs and the segment
   sizes on the host. With ``deterministic=True`` the rows of a segment are sorted by source token,
   so every runtime hands the GEMMs the same rows in the same order.
4. **Experts.** Dequantise to BF16, then per local expert ``e`` the SwiGLU FFN
   ``y = (silu(x w1_e^T) * (x w3_e^T)) w2_e^T`` with ``w13_e = [w1_e; w3_e]`` (``[2I, H]``) and
   ``w2_e`` (``[H, I]``): two grouped GEMMs over the segments (``torch._grouped_mm`` with the
   segments' end offsets where torch has it and it runs on the device, else one matmul per segment).
   Each row is then multiplied by its routing weight (``recv_topk_weights``), rounded to BF16.
5. **Combine** (``ElasticBuffer.combine``) returns every row to its token and sums them in FP32 in a
   fixed order, rounding to BF16 once per reduction.

Data layout of one rank with ``L = num_experts / world`` local experts (experts ``rank*L ..
rank*L+L-1``): ``gate [E, H]`` FP32 and ``bias [E]`` FP32 (replicated), ``w13 [L, 2I, H]`` and
``w2 [L, H, I]`` BF16. Every tensor is drawn from a seeded generator per tensor (per expert for the
experts), so any process can rebuild any part of the layer bit for bit: the reference regenerates
the experts one at a time instead of holding all of them.

The layer runs on any ``ElasticBuffer``: the native runtime, or the torch.distributed reference
runtime (``backend="torch"``, ``all_to_all_single`` plus permutes). When the buffer lives on another
device than the layer (the torch runtime over gloo while the experts run on a GPU), tensors are
copied to the buffer's device and back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BLOCK = 128  # columns per FP32 scale
#: Relative tolerance of the comparison with the single-process reference (see ``reference_error``).
REFERENCE_TOLERANCE = 2.0 ** -5


# ------------------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class MoEConfig:
    """The layer's shape (DeepSeek-V3's by default) and the seed of its synthetic weights and tokens."""

    hidden: int = 7168
    intermediate: int = 2048
    num_experts: int = 256
    num_topk: int = 8
    num_groups: int = 8
    num_topk_groups: int = 4
    routed_scaling_factor: float = 2.5
    expert_alignment: int = 128
    seed: int = 0

    def validate(self, world: int = 1) -> None:
        """ValueError naming the first field that does not fit (``world``: the expert-parallel ranks)."""
        for name in ("hidden", "intermediate", "num_experts", "num_topk", "num_groups", "num_topk_groups",
                     "expert_alignment"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if self.hidden % SCALE_BLOCK:
            raise ValueError(f"hidden: expected a multiple of {SCALE_BLOCK} (one FP32 scale per {SCALE_BLOCK} "
                             f"columns), got {self.hidden}")
        if self.intermediate % 8:
            raise ValueError(f"intermediate: expected a multiple of 8 (16-byte BF16 rows for the GEMMs), got "
                             f"{self.intermediate}")
        if self.num_experts % self.num_groups:
            raise ValueError(f"num_experts: expected a multiple of num_groups={self.num_groups}, got "
                             f"{self.num_experts}")
        if self.num_experts // self.num_groups < 2:
            raise ValueError(f"num_experts: a group's score sums its 2 best experts, so each of the "
                             f"{self.num_groups} groups needs >= 2, got {self.num_experts} experts")
        if self.num_topk_groups > self.num_groups:
            raise ValueError(f"num_topk_groups: expected <= num_groups={self.num_groups}, got {self.num_topk_groups}")
        candidates = self.num_topk_groups * (self.num_experts // self.num_groups)
        if self.num_topk > candidates:
            raise ValueError(f"num_topk: expected <= {candidates} (the experts of the {self.num_topk_groups} kept "
                             f"groups), got {self.num_topk}")
        if not isinstance(world, int) or world < 1 or self.num_experts % world:
            raise ValueError(f"num_experts: expected a multiple of the number of ranks (world={world}), got "
                             f"{self.num_experts}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"seed: expected an int in [0, 2**32), got {self.seed!r}")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor: expected > 0, got {self.routed_scaling_factor}")


# ------------------------------------------------------------------------------------------ weights
def _generator(device: torch.device, cfg: MoEConfig, stream: int, index: int = 0) -> torch.Generator:
    # One seeded generator per tensor: (seed, stream, index) never collide for index < 2**20.
    g = torch.Generator(device=device)
    g.manual_seed(((cfg.seed * 8 + stream) << 20) + index)
    return g


def router_weights(cfg: MoEConfig, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(gate [E, H] fp32, bias [E] fp32)``: gate rows ~ N(0, 1/H) so that logits are ~ N(0, 1) for
    unit inputs; the correction bias is small enough to reorder near choices only."""
    gate = torch.randn((cfg.num_experts, cfg.hidden), generator=_generator(device, cfg, 1), device=device)
    gate *= cfg.hidden ** -0.5
    bias = (torch.rand((cfg.num_experts,), generator=_generator(device, cfg, 2), device=device) - 0.5) * 0.1
    return gate, bias


def expert_weights(cfg: MoEConfig, expert: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [2I, H], w2 [H, I])`` BF16 of one expert, scaled so activations stay of order 1."""
    g = _generator(device, cfg, 3, expert)
    w13 = (torch.randn((2 * cfg.intermediate, cfg.hidden), generator=g, device=device)
           * cfg.hidden ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn((cfg.hidden, cfg.intermediate), generator=g, device=device)
          * cfg.intermediate ** -0.5).to(torch.bfloat16)
    return w13, w2


def local_expert_weights(cfg: MoEConfig, rank: int, world: int,
                         device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [L, 2I, H], w2 [L, H, I])``: the experts ``rank*L .. rank*L+L-1`` this rank holds."""
    L = cfg.num_experts // world
    w13 = torch.empty((L, 2 * cfg.intermediate, cfg.hidden), dtype=torch.bfloat16, device=device)
    w2 = torch.empty((L, cfg.hidden, cfg.intermediate), dtype=torch.bfloat16, device=device)
    for i in range(L):
        w13[i], w2[i] = expert_weights(cfg, rank * L + i, device)
    return w13, w2


def make_tokens(cfg: MoEConfig, rank: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """``[num_tokens, H]`` BF16 inputs of one rank (a prefix of a longer draw is the shorter draw)."""
    g = _generator(device, cfg, 4, rank)
    return torch.randn((num_tokens, cfg.hidden), generator=g, device=device).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------ router
def select_experts(scores: torch.Tensor, bias: torch.Tensor,
                   cfg: MoEConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's grouped top-k on ``scores [T, E]`` (sigmoid affinities); see the module docstring.

    Returns:
        ``(topk_idx [T, K] int64, topk_weights [T, K] fp32)``, lanes in descending biased score.
    """
    T, E = scores.shape
    G, per_group = cfg.num_groups, cfg.num_experts // cfg.num_groups
    biased = scores + bias  # the bias steers the choice only; the weights use the plain scores
    group_scores = biased.view(T, G, per_group).topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    kept = group_scores.topk(cfg.num_topk_groups, dim=-1).indices
    kept_mask = torch.zeros((T, G), dtype=torch.bool, device=scores.device).scatter_(1, kept, True)
    # -inf, not 0: a biased score may be negative and must still beat every expert of a dropped group.
    candidates = biased.masked_fill(~kept_mask.repeat_interleave(per_group, dim=1), float("-inf"))
    topk_idx = candidates.topk(cfg.num_topk, dim=-1).indices
    w = scores.gather(1, topk_idx)
    w = w / w.sum(dim=-1, keepdim=True) * cfg.routed_scaling_factor
    return topk_idx.to(torch.int64), w.to(torch.float32)


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor,
          cfg: MoEConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """Router of ``x [T, H]``: FP32 logits, sigmoid, then :func:`select_experts`."""
    return select_experts(torch.sigmoid(x.float() @ gate.t()), bias, cfg)


# ------------------------------------------------------------------------------------------ FP8
def quantize_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` -> ``(q [T, H] float8_e4m3fn, sf [T, H/128] fp32)`` with ``x ~= q * sf`` per block."""
    T, H = x.shape
    blocks = x.float().view(T, H // SCALE_BLOCK, SCALE_BLOCK)
    # The floor keeps an all-zero block finite (its values quantise to 0 whatever the scale).
    sf = blocks.abs().amax(dim=-1).clamp(min=1e-4) / FP8_MAX
    # The clamp guards the rounding of amax / (amax / 448), which may land a hair above 448.
    q = (blocks / sf.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(T, H), sf


def dequantize_fp8(q: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`quantize_fp8`, in BF16 (what the GEMMs take)."""
    N, H = q.shape
    blocks = q.float().view(N, H // SCALE_BLOCK, SCALE_BLOCK) * sf.unsqueeze(-1)
    return blocks.view(N, H).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------ GEMMs
_GROUPED_SUPPORT: Dict[str, Tuple[bool, str]] = {}


def grouped_mm_support(device: torch.device) -> Tuple[bool, str]:
    """Whether ``torch._grouped_mm`` runs BF16 on ``device`` (probed once per device), and why not."""
    key = str(device)
    if key not in _GROUPED_SUPPORT:
        if not hasattr(torch, "_grouped_mm"):
            _GROUPED_SUPPORT[key] = (False, f"torch {torch.__version__} has no torch._grouped_mm")
        else:
            # Two groups of 16 rows, B in the column-major layout the expert weights are passed in.
            g = torch.Generator(device=device).manual_seed(0)
            a = torch.randn((32, 64), generator=g, device=device).to(torch.bfloat16)
            b = torch.randn((2, 48, 64), generator=g, device=device).to(torch.bfloat16)
            offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
            try:
                got = torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
                want = torch.cat([a[:16] @ b[0].t(), a[16:] @ b[1].t()])
                ok = bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))
                _GROUPED_SUPPORT[key] = (ok, "" if ok else "torch._grouped_mm gave wrong results in the probe")
            except (RuntimeError, NotImplementedError, TypeError) as e:
                _GROUPED_SUPPORT[key] = (False, f"torch._grouped_mm failed on {device}: {str(e).splitlines()[0]}")
    return _GROUPED_SUPPORT[key]


def resolve_gemm(gemm: str, device: torch.device) -> str:
    """``"auto"`` -> ``"grouped"`` where :func:`grouped_mm_support` says so, else ``"loop"``."""
    if gemm not in ("auto", "grouped", "loop"):
        raise ValueError(f"gemm: expected 'auto', 'grouped' or 'loop', got {gemm!r}")
    if gemm == "loop":
        return gemm
    ok, why = grouped_mm_support(device)
    if gemm == "grouped" and not ok:
        raise ValueError(f"gemm: 'grouped' is not available here: {why}")
    return "grouped" if ok else "loop"


@dataclass
class Segments:
    """Where each local expert's rows are: ``sizes`` (aligned, on the host) and ``ends`` (their
    inclusive prefix sum, int32 on the compute device: ``torch._grouped_mm``'s ``offs``)."""

    sizes: List[int]
    ends: torch.Tensor


def segmented_linear(x: torch.Tensor, w: torch.Tensor, seg: Segments, gemm: str) -> torch.Tensor:
    """``out[rows of segment e] = x[rows of e] @ w[e]^T`` for ``x [N, K]`` and ``w [L, N_out, K]``."""
    if gemm == "grouped":
        # w[e]^T as a column-major [K, N_out] view: the operand layout the grouped kernels take.
        return torch._grouped_mm(x, w.transpose(1, 2), offs=seg.ends)
    out = x.new_empty((x.shape[0], w.shape[1]))
    start = 0
    for e, n in enumerate(seg.sizes):
        if n:
            torch.matmul(x[start:start + n], w[e].t(), out=out[start:start + n])
        start += n
    return out


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gu = [gate | up]`` in FP32, rounded to BF16 for the second GEMM."""
    gate, up = gu.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(torch.bfloat16)


def expert_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, seg: Segments, gemm: str) -> torch.Tensor:
    """The experts' SwiGLU FFN over segmented rows ``x [N, H]`` BF16 -> ``[N, H]`` BF16."""
    return segmented_linear(swiglu(segmented_linear(x, w13, seg, gemm)), w2, seg, gemm)


# ------------------------------------------------------------------------------------------ timing
class Marks:
    """Named points on the current stream's timeline: CUDA events on a GPU, the host clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.points: Dict[str, object] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.points[name] = ev
        else:
            self.points[name] = time.perf_counter()

    def ms(self, a: str, b: str) -> float:
        """Milliseconds from mark ``a`` to mark ``b`` (waits for ``b`` on a GPU)."""
        pa, pb = self.points[a], self.points[b]
        if self.cuda:
            pb.synchronize()
            return float(pa.elapsed_time(pb))
        return (pb - pa) * 1e3


# ------------------------------------------------------------------------------------------ the layer
@dataclass
class Routed:
    """One micro-batch after the router and the FP8 cast."""

    q: torch.Tensor
    sf: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


@dataclass
class Dispatched:
    """What ``dispatch`` returned for one micro-batch (on the buffer's device)."""

    q: torch.Tensor
    sf: torch.Tensor
    weights: torch.Tensor
    handle: object
    event: object  # EventOverlap


class EPMoELayer:
    """The MoE layer of one expert-parallel rank over an ``ElasticBuffer`` (see the module docstring).

    Arguments:
        cfg: the layer's shape.
        gate, bias: the router (:func:`router_weights`), on the compute device.
        w13, w2: this rank's experts (:func:`local_expert_weights`), on the compute device.
        buffer: an ``ElasticBuffer`` made with ``deterministic=True`` (so that every runtime gives the
            GEMMs the same rows in the same order), ``use_fp8_dispatch=True``, ``hidden`` and
            ``num_topk`` of ``cfg``.
        gemm: ``"auto"``, ``"grouped"`` (``torch._grouped_mm``) or ``"loop"`` (a matmul per expert).
    """

    def __init__(self, cfg: MoEConfig, gate: torch.Tensor, bias: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor, buffer, gemm: str = "auto") -> None:
        if not getattr(buffer, "deterministic", False):
            raise ValueError("buffer: expected an ElasticBuffer made with deterministic=True (the rows of an "
                             "expert segment must reach the GEMMs in source order)")
        self.cfg = cfg
        self.gate, self.bias, self.w13, self.w2 = gate, bias, w13, w2
        self.buffer = buffer
        self.device = w13.device
        self.comm_device = buffer.device
        self.gemm = resolve_gemm(gemm, self.device)

    # -- stages
    def _to_comm(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.comm_device else t.to(self.comm_device)

    def _to_compute(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

    def route_and_quantize(self, x: torch.Tensor) -> Routed:
        """Router and per-token FP8 cast of one micro-batch ``x [T, H]`` BF16."""
        topk_idx, topk_weights = route(x, self.gate, self.bias, self.cfg)
        q, sf = quantize_fp8(x)
        return Routed(q, sf, topk_idx, topk_weights)

    def dispatch(self, r: Routed, *, num_sms: int = 0, previous_event=None) -> Dispatched:
        """Expand-mode FP8 dispatch. With ``previous_event`` it is asynchronous as DeepEP users write it:
        the communication stream waits for that event only (not for the compute queued after it), the
        outputs are allocated on it, and the returned event must be waited on before they are read
        (:meth:`experts` does)."""
        overlapped = previous_event is not None
        (q, sf), _, weights, handle, event = self.buffer.dispatch(
            (self._to_comm(r.q), self._to_comm(r.sf)), topk_idx=self._to_comm(r.topk_idx),
            topk_weights=self._to_comm(r.topk_weights), num_experts=self.cfg.num_experts,
            expert_alignment=self.cfg.expert_alignment, num_sms=num_sms, previous_event=previous_event,
            allocate_on_comm_stream=overlapped, async_with_compute_stream=overlapped, do_cpu_sync=True,
            do_expand=True, do_zero_padding=True)  # zeroed padding: the GEMMs never read garbage
        return Dispatched(q, sf, weights, handle, event)

    def segments(self, handle) -> Segments:
        """The expert segments of a dispatch, computed on the device (no host round trip, so queuing
        the GEMMs never waits for the GPU)."""
        a = self.cfg.expert_alignment
        real = self._to_compute(handle.num_unaligned_recv_tokens_per_expert).to(torch.int64)
        ends = torch.cumsum((real + a - 1) // a * a, 0).to(torch.int32)
        return Segments(list(handle.num_recv_tokens_per_expert_list), ends)

    def experts(self, d: Dispatched) -> torch.Tensor:
        """Dequantise, FFN, scale by the routing weights: ``[N_exp, H]`` BF16 rows ready for combine."""
        d.event.current_stream_wait()  # the dispatch landed (and, deterministic, its rows are sorted)
        x = dequantize_fp8(self._to_compute(d.q), self._to_compute(d.sf))
        y = expert_ffn(x, self.w13, self.w2, self.segments(d.handle), self.gemm)
        # combine sums rows as they are: the weight is applied here, rounded to BF16 with the row.
        return (y.float() * self._to_compute(d.weights).unsqueeze(1)).to(torch.bfloat16)

    def combine(self, y: torch.Tensor, d: Dispatched, *, previous_event=None):
        """``(combined [T, H], event)``; wait on the event before reading (:meth:`finish`)."""
        overlapped = previous_event is not None
        out, _, event = self.buffer.combine(self._to_comm(y), d.handle, previous_event=previous_event,
                                            allocate_on_comm_stream=overlapped,
                                            async_with_compute_stream=overlapped)
        return out, event

    def finish(self, combined) -> torch.Tensor:
        out, event = combined
        event.current_stream_wait()
        return self._to_compute(out)

    # -- schedules
    def forward(self, x: torch.Tensor, *, num_sms: int = 0, marks: Optional[Marks] = None) -> torch.Tensor:
        """One micro-batch, stage after stage on the current stream (optionally marking each stage)."""
        mark = marks.mark if marks is not None else (lambda name: None)
        mark("start")
        r = self.route_and_quantize(x)
        mark("routed")
        d = self.dispatch(r, num_sms=num_sms)
        d.event.current_stream_wait()
        mark("dispatched")
        y = self.experts(d)
        mark("computed")
        out = self.finish(self.combine(y, d))
        mark("end")
        return out

    def forward_overlapped(self, xs: Sequence[torch.Tensor], *, num_sms: int = 0) -> List[torch.Tensor]:
        """Micro-batches pipelined: while micro-batch ``i``'s experts run on the current stream, ``i+1``
        dispatches and ``i-1`` combines on the buffer's communication stream.

        The order of the calls is the schedule: ``experts(i)`` is queued on the compute stream before
        ``dispatch(i+1)`` is called, whose ``previous_event`` (the routed inputs are ready) is all the
        communication stream waits for, so the dispatch runs beside those GEMMs even though the host
        then blocks on its CPU sync; ``combine(i)`` waits for ``experts(i)`` through its own event. The
        outputs are bitwise those of :meth:`forward` on each micro-batch: the same rows reach the same
        GEMMs and combine's summation order does not depend on timing.
        """
        routed = [self.route_and_quantize(x) for x in xs]
        ready = self.buffer.capture()
        pending = self.dispatch(routed[0], num_sms=num_sms, previous_event=ready) if routed else None
        combined = []
        for i in range(len(routed)):
            d = pending
            y = self.experts(d)
            y_ready = self.buffer.capture()
            if i + 1 < len(routed):
                pending = self.dispatch(routed[i + 1], num_sms=num_sms, previous_event=ready)
            combined.append(self.combine(y, d, previous_event=y_ready))
        return [self.finish(c) for c in combined]


# ------------------------------------------------------------------------------------------ reference
def reference_forward(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor,
                      expert: Callable[[int], Tuple[torch.Tensor, torch.Tensor]],
                      cfg: MoEConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """The layer for one rank's tokens in one process: no buffer, no segments, no padding.

    Each expert's weights come from ``expert(e)`` (e.g. :func:`expert_weights`, regenerated one expert
    at a time), its rows are gathered from the tokens that chose it, and the weighted BF16 rows are
    summed per token in FP32 in lane order, rounded once. The router is the layer's own function on
    the same ``[T, H]`` tensor, so both select the same experts (a last-bit difference in a logit
    could flip a near tie, which no tolerance covers); :func:`select_experts` is tested on its own.

    Returns:
        ``(out [T, H] BF16, magnitude [T, H] FP32)``: the output and ``sum_k |term_k|``, the scale
        that :func:`reference_error` measures differences against.
    """
    topk_idx, topk_w = route(x, gate, bias, cfg)
    xd = dequantize_fp8(*quantize_fp8(x))
    T, K = topk_idx.shape
    terms = torch.zeros((T, K, cfg.hidden), dtype=torch.bfloat16, device=x.device)
    for e in torch.unique(topk_idx).tolist():
        t, k = (topk_idx == e).nonzero(as_tuple=True)
        w13, w2 = expert(e)
        y = swiglu(xd[t] @ w13.t()) @ w2.t()
        terms[t, k] = (y.float() * topk_w[t, k].unsqueeze(1)).to(torch.bfloat16)
    acc = torch.zeros((T, cfg.hidden), dtype=torch.float32, device=x.device)
    magnitude = torch.zeros_like(acc)
    for k in range(K):
        acc += terms[:, k].float()
        magnitude += terms[:, k].float().abs()
    return acc.to(torch.bfloat16), magnitude


def reference_error(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> float:
    """``max |out - ref| / (REFERENCE_TOLERANCE * (magnitude + mean(magnitude)))``: <= 1 passes.

    Why a tolerance: the layer and the reference round at the same points, but (1) the GEMMs see
    different row counts (aligned segments vs the real rows), so a GEMM library may pick another
    kernel and accumulation order, moving BF16 results by about one unit in the last place
    (2^-8 relative); (2) with ``allow_multiple_reduction`` combine rounds each rank's partial sum
    to BF16 before the final sum. Each bounded by a few 2^-9..2^-8 of ``sum_k |term_k|``; the mean
    term covers elements where every term nearly cancels. A lost, doubled or mis-weighted lane
    moves an output by about one term (~1/K of the magnitude), far above 2^-5.
    """
    bound = REFERENCE_TOLERANCE * (magnitude + magnitude.mean())
    return float(((out.float() - ref.float()).abs() / bound).max()) if out.numel() else 0.0


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (``torch.equal`` would call NaN != NaN and -0 == +0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
