"""Decode mode of elastic_ep's model block (``python tools/block_elastic_ep.py --mode decode``): the
DeepSeek-V3 MoE layer of tools/_block_ep_moe_layer.py at decode batch sizes, through DeepEP V1's
low-latency API (``elastic_ep.Buffer(..., low_latency_mode=True)``), against the same layer through
V2's API (``elastic_ep.ElasticBuffer``) and against a torch reference built from every rank's inputs.

    python tools/block_elastic_ep.py --mode decode [--tokens 1,32,128] [--dispatch bf16,fp8] [--quick]
                                     [--experts 256] [--hidden 7168] [--intermediate 2048] [--world W]
                                     [--iters 20] [--warmup 3] [--gemm auto|grouped|loop] [--no-graph]
                                     [--out DIR] [--device auto|cuda|cpu] [--seed 0] [--timeout 900]

One decode step on every rank: ``T`` tokens (``--tokens``, one configuration per value), routed once per
configuration by the layer's router (DeepSeek-V3's grouped top-8; the same for every runtime, so it
stays outside the timed step), split into two micro-batches of ``T - T // 2`` and ``T // 2`` tokens
(a micro-batch may be empty: every rank still takes part in every call).

**Low-latency step** (the two micro-batches overlapped through the receive hooks, DeepEP V1's decode
schedule; every call alternates the buffer's two halves, so at most two results are in flight)::

    dispatch(mb0, hook) ; dispatch(mb1, hook) ; hook0() ; experts(mb0) ; combine(mb0, hook)
                        ; hook1() ; experts(mb1) ; combine(mb1, hook) ; combine hooks 0, 1

``low_latency_dispatch`` (BF16, or FP8: E4M3 rows with one f32 scale per 128 channels) returns the packed
layout ``recv_x [L, R * M, H]`` (``L`` local experts, ``R`` ranks, ``M = num_max_dispatch_tokens_per_rank``,
the largest micro-batch of the run): expert ``l``'s rows are the first ``recv_count[l]`` of its slot,
source rank by source rank, each rank's in token order; the rest of the slot is garbage. The experts run
as grouped GEMMs over the valid rows only (DeepGEMM's masked grouped GEMM reads the packed layout in
place; torch has no masked grouped GEMM, so the valid rows are first gathered into a compact ``[C, H]``
buffer, ``C = R * M * min(K, L)``, the most rows a rank can receive, fixed so that a CUDA graph can hold
it): ``torch._grouped_mm`` with the group ends ``cumsum(recv_count)`` computed on the device (no host
sync), or one matmul per expert (``--gemm loop``, which reads the counts on the host). Per row: FP8
dequantised to BF16 (``q * scale``), SwiGLU FFN ``(silu(x w1^T) * (x w3^T)) w2^T`` with BF16 operands and
the activation rounded to BF16 (the prefill block's ``expert_ffn``). The outputs are scattered back to
``[L, R * M, H]`` and ``low_latency_combine`` sums each token's lanes: ``acc = acc + row * w`` in fp32
(product and sum separately rounded), lane by lane in top-k order, rounded to BF16 once.

**V2 step** (``ElasticBuffer.dispatch`` / ``combine``, the micro-batches one after the other):
expand-mode dispatch with ``expert_alignment=1`` and ``deterministic=True`` (each expert's rows
contiguous and, like the packed layout, ordered by source rank then token), ``do_cpu_sync=True`` as the
prefill block; the same FP8 cast as the low-latency dispatch (``elastic_ep._low_latency_torch.cast_to_fp8``,
the kernels' arithmetic), the same compact buffer and the same expert function; the rows are then
multiplied by their routing weights and rounded to BF16 (V2's combine applies no weights) and
``combine`` (``allow_multiple_reduction=False``: no per-rank partial sums) adds them in fp32 in lane order
and rounds once.

**Torch reference** (per configuration, untimed): every rank's tokens and routing are all-gathered; for every owner rank ``o`` this rank rebuilds ``o``'s packed rows (the rows of the tokens
that chose each of ``o``'s experts, by source rank then token; FP8 rows cast with the same cast and
dequantised), regenerates ``o``'s expert weights and runs the same expert function on the same compact
shape (``C`` rows, rows past the valid ones NaN); the outputs of this rank's tokens are then combined
per token in plain torch: ``acc + y * w`` in fp32 (the low-latency order) and ``acc + bf16(y * w)``
(the V2 order).

Why the reference runs the GEMMs on the packed rows and not row by row: a batched BF16 GEMM need not
give a row the bits it gets alone (with torch 2.14 on a CPU, a 1-row BF16 matmul at hidden 7168 takes a
GEMV path whose sums differ in the last bit from the batched ones; cuBLAS/CUTLASS choose kernels by
shape). Giving the reference the
same GEMM shapes makes the comparison exact on any deterministic GEMM; whether the expert function is
also row-invariant (each row alone equal to its batched result) is measured and reported
(``row_invariant``), not relied on.

Checks (every rank, every configuration and dispatch format; any failing fails the run, exit status 1,
except ``row_invariant``, which is reported only):

* ``ll_reference``: each low-latency runtime's output == the low-latency-order reference, bitwise (the
  checked step fills every row past ``recv_count``, of ``recv_x`` and of the expert outputs, with NaN);
* ``v2_reference``: V2's output == the V2-order reference, bitwise;
* ``same_rows``: the low-latency runtimes, V2 and the reference give the GEMMs the same rows (same
  counts, same bytes, same order) and get the same expert outputs, bitwise;
* ``pow2``: with the routing weights truncated to powers of two (``row * w`` then exact in fp32 and in
  BF16) the low-latency and V2 outputs are bitwise equal, and equal to the reference;
* ``nohook``: the low-latency step without hooks (micro-batches one after the other) == with hooks;
* ``repeatable``: every timed step == the checked one; ``graph``: the CUDA-graph replay == eager;
* ``ll_vs_v2`` (real weights; not bitwise, by design): V2's combine takes BF16 rows and applies no
  weight, so the experts weight each row and round it to BF16 before the sum (relative error up to
  2^-8 per term), while the low-latency combine multiplies in fp32; both sums then round to BF16 once
  (up to 2^-8 of the result each), so ``|ll - v2| <= 2^-8 (sum_k |w_k y_k| + 2 |out|)`` up to second-order
  terms. Reported: the elements that differ, the largest difference relative to ``sum_k |w_k y_k|`` and
  ``max |ll - v2| / (2^-7 (sum_k |w_k y_k| + |ll|))`` (that bound with room for the second-order terms),
  which must be <= 1; a lost or doubled lane moves an output by about 1/K of the sum, far outside it;
* ``row_invariant`` (reported only): the expert function on single rows == on the batch.

Timing (CUDA events on a GPU, the host clock on a CPU; median of ``--iters`` after ``--warmup``, ranks
lined up by a barrier before each step, the slowest rank reported): the low-latency step eager with
hooks, eager without hooks, and (GPU, native, grouped GEMM) a CUDA graph of the whole step with hooks
replayed; the V2 step eager (its CPU sync keeps it out of a graph). On a GPU the runtimes are the native
low-latency kernels, the low-latency API on the torch backend (``backend="torch"``, the reference
implementation over ``all_to_all_single``) and V2 native; on the CPU (gloo) both APIs run their torch
backends. Ranks sharing GPUs are not supported in decode mode (one GPU per rank).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _block_ep_moe_layer import (Marks, MoEConfig, Segments, bitwise_equal, dequantize_fp8, expert_ffn,  # noqa: E402
                                 local_expert_weights, make_tokens, resolve_gemm, route, router_weights)
from _launch import RankFailure, parse_run, run_ranks  # noqa: E402
from _results import command_line, pyplot, run_record, save, write_results  # noqa: E402

NAME = "block_elastic_ep_decode"
FORMATS = ("bf16", "fp8")
GPU_DEFAULTS = dict(tokens="1,32,128", experts=256, hidden=7168, intermediate=2048, iters=20, warmup=3)
CPU_DEFAULTS = dict(tokens="1,8,32", experts=32, hidden=256, intermediate=128, iters=3, warmup=1, world=2)
QUICK = dict(cuda=dict(iters=5, warmup=2), cpu=dict(iters=1, warmup=1))
CPU_MAX_WEIGHT_BYTES = 8 << 30
#: rows whose expert output is recomputed alone for the row-invariance report (per micro-batch)
ROW_CHECK_ROWS = 64
#: |ll - v2| <= LL_V2_BOUND * (sum_k |w_k y_k| + |ll|) (see the module docstring)
LL_V2_BOUND = 2.0 ** -7

CPU_EXPLANATION = """\
No usable CUDA GPU: running the decode block's CPU fallback. On GPUs it runs a DeepSeek-V3 MoE layer at
decode sizes (1, 32, 128 tokens per rank, hidden 7168, top-8 of 256 experts), one rank per GPU: two
micro-batches overlapped through the receive hooks of elastic_ep's native low-latency dispatch/combine,
grouped expert GEMMs on the packed layout, eager and as a CUDA graph, against the same layer through V2's
ElasticBuffer and the low-latency API's torch backend, all checked bit for bit against a reference built
from every rank's inputs. Here: the same steps, small, on the torch backends over gloo on CPU processes;
the times are CPU times, not a benchmark."""


# ------------------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class DecodeConfig:
    """One run of the decode block (what every rank receives)."""

    moe: MoEConfig
    world: int
    tokens: Tuple[int, ...]
    device: str  # "cuda" or "cpu"
    iters: int
    warmup: int
    formats: Tuple[str, ...] = FORMATS
    gemm: str = "auto"
    graph: bool = True
    row_check: bool = True
    timeout_s: float = 900.0
    #: Tests only: return every output (as int16 numpy arrays) with the figures.
    return_outputs: bool = False

    def validate(self) -> None:
        """ValueError naming the first argument that does not fit, before anything starts."""
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"world: expected a positive int, got {self.world!r}")
        self.moe.validate(self.world)
        if not self.tokens or any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in self.tokens):
            raise ValueError(f"tokens: expected positive ints, got {self.tokens!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device: expected 'cuda' or 'cpu', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was asked for, but torch sees no CUDA device")
        if self.device == "cuda" and self.world > torch.cuda.device_count():
            raise ValueError(f"world: decode mode runs one rank per GPU, {self.world} ranks asked for, "
                             f"{torch.cuda.device_count()} GPU(s) seen")
        if not isinstance(self.iters, int) or self.iters < 1:
            raise ValueError(f"iters: expected a positive int, got {self.iters!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup: expected an int >= 0, got {self.warmup!r}")
        if not self.formats or any(f not in FORMATS for f in self.formats) or \
                len(set(self.formats)) != len(self.formats):
            raise ValueError(f"dispatch: expected distinct formats from {FORMATS}, got {self.formats!r}")
        if self.gemm not in ("auto", "grouped", "loop"):
            raise ValueError(f"gemm: expected 'auto', 'grouped' or 'loop', got {self.gemm!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout: expected > 0 seconds, got {self.timeout_s!r}")
        from elastic_ep import _C

        m = self.moe
        if m.num_experts // self.world > int(_C.MAX_LOCAL_EXPERTS):
            raise ValueError(f"experts: the low-latency kernels hold at most {int(_C.MAX_LOCAL_EXPERTS)} experts per "
                             f"rank, {m.num_experts} experts on {self.world} rank(s) asked for")
        if self.max_micro_batch > int(_C.LL_MAX_TOKENS):
            raise ValueError(f"tokens: a micro-batch holds at most {int(_C.LL_MAX_TOKENS)} tokens "
                             f"(num_max_dispatch_tokens_per_rank), {max(self.tokens)} tokens make one of "
                             f"{self.max_micro_batch}")
        weight_bytes = m.num_experts * 3 * m.hidden * m.intermediate * 2
        if self.device == "cpu" and weight_bytes > CPU_MAX_WEIGHT_BYTES:
            raise ValueError(f"experts/hidden/intermediate: on the CPU the experts' weights "
                             f"({weight_bytes / 2**30:.1f} GiB) must stay under {CPU_MAX_WEIGHT_BYTES >> 30} GiB; "
                             "use smaller shapes")

    @property
    def max_micro_batch(self) -> int:
        """``M``, every low-latency call's ``num_max_dispatch_tokens_per_rank`` (as a framework fixes it)."""
        return max(micro_batches(t)[0] for t in self.tokens)

    @property
    def capacity(self) -> int:
        """``C``: the most rows a rank can receive in one call (every token of every rank sends each of
        its ``min(K, L)`` possible lanes here), the compact buffer's fixed row count."""
        L = self.moe.num_experts // self.world
        return self.world * self.max_micro_batch * min(self.moe.num_topk, L)


def micro_batches(T: int) -> List[int]:
    """The two micro-batches of a step of ``T`` tokens (the first takes the odd one)."""
    return [T - T // 2, T // 2]


def _parse_list(name: str, text: str, conv: Callable[[str], Any]) -> Tuple[Any, ...]:
    try:
        return tuple(conv(t.strip()) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"{name}: expected a comma-separated list, got {text!r}") from None


def build_config(args: argparse.Namespace) -> DecodeConfig:
    """The run ``args`` asks for, with the defaults of the device it runs on; ValueError on bad input."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    defaults = dict(GPU_DEFAULTS, world=max(torch.cuda.device_count(), 1)) if device == "cuda" else dict(CPU_DEFAULTS)
    if args.quick:
        defaults.update(QUICK[device])

    def pick(name: str):
        v = getattr(args, name)
        return defaults[name] if v is None else v

    moe = MoEConfig(hidden=pick("hidden"), intermediate=pick("intermediate"), num_experts=pick("experts"),
                    seed=args.seed)
    cfg = DecodeConfig(moe=moe, world=pick("world"), tokens=_parse_list("tokens", str(pick("tokens")), int),
                       device=device, iters=pick("iters"), warmup=pick("warmup"),
                       formats=_parse_list("dispatch", args.dispatch, str), gemm=args.gemm,
                       graph=not args.no_graph, row_check=not args.quick, timeout_s=args.timeout)
    cfg.validate()
    return cfg


# ------------------------------------------------------------------------------------------ the step
@dataclass
class MicroBatch:
    """One micro-batch's tokens and routing (on the compute device)."""

    x: torch.Tensor  # [T_mb, H] bf16
    idx: torch.Tensor  # [T_mb, K] int64
    w: torch.Tensor  # [T_mb, K] f32


@dataclass
class Experts:
    """What the expert stage of every runtime shares: the local experts and the shapes."""

    w13: torch.Tensor  # [L, 2I, H] bf16
    w2: torch.Tensor  # [L, H, I] bf16
    num_ranks: int
    num_experts: int
    M: int  # num_max_dispatch_tokens_per_rank
    capacity: int  # C
    fp8: bool
    gemm: str  # "grouped" or "loop"

    @property
    def L(self) -> int:
        return self.num_experts // self.num_ranks

    def run(self, rows: torch.Tensor, counts: torch.Tensor, sizes: Optional[List[int]] = None,
            w13: Optional[torch.Tensor] = None, w2: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The expert FFN over compact rows ``[C, H]`` bf16: expert ``l``'s ``counts[l]`` rows follow expert
        ``l - 1``'s; rows past ``sum(counts)`` are not read (their outputs are garbage). Grouped: the group
        ends stay on the device; loop: ``sizes`` (the counts on the host) are read when not given."""
        ends = torch.cumsum(counts.to(torch.int64), 0).to(torch.int32)
        if self.gemm == "loop" and sizes is None:
            sizes = counts.tolist()
        return expert_ffn(rows, self.w13 if w13 is None else w13, self.w2 if w2 is None else w2,
                          Segments(sizes, ends), self.gemm)

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` bf16 rows as the GEMMs take them: BF16 as it is, FP8 ``(q, scales)`` dequantised."""
        return dequantize_fp8(*x) if isinstance(x, tuple) else x


def packed_index(counts: torch.Tensor, L: int, RM: int, C: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the compact rows come from in the packed layout, on the device (no host sync, graph-safe).

    Compact row ``i`` belongs to expert ``l`` with ``ends[l-1] <= i < ends[l]`` (``ends = cumsum(counts)``)
    and is that expert's row ``j = i - ends[l-1]``. Returns ``(l, j, valid)``, each ``[C]``; rows past
    ``sum(counts)`` point at ``(0, 0)`` and are not valid.
    """
    counts = counts.to(torch.int64)
    ends = torch.cumsum(counts, 0)
    i = torch.arange(C, device=counts.device)
    l = torch.searchsorted(ends, i, right=True).clamp(max=L - 1)
    j = i - (ends[l] - counts[l])
    valid = i < ends[-1]
    zero = torch.zeros_like(i)
    return torch.where(valid, l, zero), torch.where(valid, j, zero), valid


def _poison_packed(recv_x, counts: torch.Tensor) -> None:
    """Rows past ``recv_count`` set to NaN (BF16 NaN, E4M3 NaN 0x7F, NaN scales): nothing may read them."""
    parts = recv_x if isinstance(recv_x, tuple) else (recv_x,)
    RM = parts[0].shape[1]
    past = torch.arange(RM, device=counts.device).view(1, RM) >= counts.view(-1, 1).to(torch.int64)
    for t in parts:
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8)[past] = 0x7F
        else:
            t[past] = float("nan")


def ll_experts(ex: Experts, recv_x, recv_count: torch.Tensor, *, poison: bool = False,
               probe: Optional[List[Dict[str, torch.Tensor]]] = None) -> torch.Tensor:
    """The experts on the low-latency layout: ``recv_x [L, R * M, H]`` (FP8: ``(q, scales)``) ->
    ``[L, R * M, H]`` bf16 outputs, valid in the first ``recv_count[l]`` rows of each expert (the rest:
    garbage, or NaN with ``poison``). ``probe``: gets the compact input and output rows (host sync)."""
    L, RM, H = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).shape
    if poison:
        _poison_packed(recv_x, recv_count)
    l, j, valid = packed_index(recv_count, L, RM, ex.capacity)
    packed = tuple(t[l, j] for t in recv_x) if isinstance(recv_x, tuple) else recv_x[l, j]  # gather: [C, H]
    rows = ex.rows_of(packed)
    y = ex.run(rows, recv_count)
    # One spare row takes the writes of the invalid compact rows (index_copy_ needs a target for each).
    out = torch.empty((L * RM + 1, H), dtype=torch.bfloat16, device=y.device)
    if poison:
        out.fill_(float("nan"))
    out.index_copy_(0, torch.where(valid, l * RM + j, torch.full_like(l, L * RM)), y)
    if probe is not None:
        n = int(recv_count.sum())
        probe.append(dict(counts=recv_count.to(torch.int64).cpu(), rows=rows[:n].cpu(), y=y[:n].cpu()))
    return out[:L * RM].view(L, RM, H)


def ll_step(buf, ex: Experts, mbs: Sequence[MicroBatch], *, hooks: bool = True, poison: bool = False,
            weights: Optional[Sequence[torch.Tensor]] = None,
            probe: Optional[List[Dict[str, torch.Tensor]]] = None) -> torch.Tensor:
    """One decode step through the low-latency API; returns the combined ``[T, H]`` bf16 of every micro-batch
    (concatenated). ``hooks``: the overlapped schedule of the module docstring; else one micro-batch after
    the other, each call complete when it returns. ``weights``: other routing weights per micro-batch."""
    ws = [mb.w for mb in mbs] if weights is None else list(weights)
    fp8 = ex.fp8
    if not hooks:
        outs = []
        for mb, w in zip(mbs, ws):
            recv_x, count, handle, _, _ = buf.low_latency_dispatch(mb.x, mb.idx, ex.M, ex.num_experts, use_fp8=fp8)
            y = ll_experts(ex, recv_x, count, poison=poison, probe=probe)
            outs.append(buf.low_latency_combine(y, mb.idx, w, handle)[0])
        return torch.cat(outs)
    # Both sends first: the second micro-batch's tokens travel while the first one's are received and
    # computed; the combine receives come last, after both micro-batches' experts were queued.
    sent = [buf.low_latency_dispatch(mb.x, mb.idx, ex.M, ex.num_experts, use_fp8=fp8, return_recv_hook=True)
            for mb in mbs]
    pending = []
    for mb, w, (recv_x, count, handle, _, recv_hook) in zip(mbs, ws, sent):
        recv_hook()
        y = ll_experts(ex, recv_x, count, poison=poison, probe=probe)
        out, _, combine_hook = buf.low_latency_combine(y, mb.idx, w, handle, return_recv_hook=True)
        pending.append((out, combine_hook))
    for _, combine_hook in pending:
        combine_hook()
    return torch.cat([out for out, _ in pending])


def cast_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The low-latency dispatch's FP8 cast (the kernels' arithmetic), for V2 and the reference."""
    from elastic_ep._low_latency_torch import cast_to_fp8

    return cast_to_fp8(x, False)


def v2_step(buf, ex: Experts, mbs: Sequence[MicroBatch], *, weights: Optional[Sequence[torch.Tensor]] = None,
            probe: Optional[List[Dict[str, torch.Tensor]]] = None) -> torch.Tensor:
    """One decode step through V2's ``ElasticBuffer`` (micro-batches one after the other); ``[T, H]`` bf16."""
    ws = [mb.w for mb in mbs] if weights is None else list(weights)
    outs = []
    for mb, w in zip(mbs, ws):
        x = cast_fp8(mb.x) if ex.fp8 else mb.x
        recv, _, recv_w, handle, event = buf.dispatch(x, topk_idx=mb.idx, topk_weights=w,
                                                      num_experts=ex.num_experts, expert_alignment=1,
                                                      do_cpu_sync=True, do_expand=True)
        event.current_stream_wait()
        rows = ex.rows_of(recv)
        n = rows.shape[0]
        # The compact buffer of the low-latency path, same shape: the GEMMs see what they see there.
        compact = rows.new_empty((ex.capacity, rows.shape[1]))
        compact[:n] = rows
        counts = handle.num_unaligned_recv_tokens_per_expert
        y = ex.run(compact, counts, sizes=list(handle.num_recv_tokens_per_expert_list))[:n]
        if probe is not None:
            probe.append(dict(counts=counts.to(torch.int64).cpu(), rows=rows.cpu(), y=y.cpu()))
        # V2's combine sums BF16 rows and applies no weight: each row is weighted here, rounded to BF16.
        out, _, event = buf.combine((y.float() * recv_w.unsqueeze(1)).to(torch.bfloat16), handle)
        event.current_stream_wait()
        outs.append(out)
    return torch.cat(outs)


# ------------------------------------------------------------------------------------------ reference
def combine_ll_order(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``y [T, K, H]`` bf16 lane rows, ``w [T, K]`` f32: ``acc = acc + y_k * w_k`` in fp32 lane by lane
    (two separately rounded ops, as the low-latency combine), rounded to BF16 once."""
    acc = torch.zeros((y.shape[0], y.shape[2]), dtype=torch.float32, device=y.device)
    for k in range(y.shape[1]):
        acc = acc + y[:, k].float() * w[:, k:k + 1]
    return acc.to(torch.bfloat16)


def combine_v2_order(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same sum with each weighted row first rounded to BF16 (V2: weights applied by the experts)."""
    acc = torch.zeros((y.shape[0], y.shape[2]), dtype=torch.float32, device=y.device)
    for k in range(y.shape[1]):
        acc = acc + (y[:, k].float() * w[:, k:k + 1]).to(torch.bfloat16).float()
    return acc.to(torch.bfloat16)


def pow2_weights(w: torch.Tensor) -> torch.Tensor:
    """``w`` truncated to a power of two (sign and exponent bits kept): ``row * w`` is then exact in fp32
    and in BF16, so where the product is rounded no longer matters."""
    return (w.contiguous().view(torch.int32) & -0x800000).view(torch.float32)


@dataclass
class RefRows:
    """The reference of one micro-batch: the expert outputs of this rank's tokens, ``y [T_mb, K, H]``, and
    what this rank's own experts see (``counts``, compact ``rows`` and outputs ``y_own``)."""

    y: torch.Tensor
    counts: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None
    y_own: Optional[torch.Tensor] = None
    row_invariant: Optional[bool] = None


def reference_rows(rank: int, jobs: Sequence[Tuple[Experts, torch.Tensor, torch.Tensor]],
                   owner_weights: Callable[[int], Tuple[torch.Tensor, torch.Tensor]],
                   row_check: bool) -> List[RefRows]:
    """The expert outputs of this rank's tokens from every rank's inputs, one ``RefRows`` per job
    ``(experts, x_all [R, T_mb, H] bf16, idx_all [R, T_mb, K])`` (a micro-batch in a dispatch format),
    computed owner rank by owner rank on the packed rows that owner receives (see the module docstring).
    ``owner_weights(o)``: rank ``o``'s ``(w13, w2)``, each asked for once."""
    refs, inputs = [], []
    for ex, x_all, idx_all in jobs:
        R, T, K = idx_all.shape
        refs.append(RefRows(y=torch.full((T, K, x_all.shape[2]), float("nan"), dtype=torch.bfloat16,
                                         device=x_all.device)))
        if ex.fp8:  # every source rank's rows through the dispatch's cast, dequantised as the experts do
            q, sf = zip(*[cast_fp8(x_all[r]) for r in range(R)])
            inputs.append(torch.stack([dequantize_fp8(a, b) for a, b in zip(q, sf)]))
        else:
            inputs.append(x_all)
    for o in range(jobs[0][0].num_ranks if jobs else 0):
        w13, w2 = owner_weights(o)
        for ref, rows_all, (ex, x_all, idx_all) in zip(refs, inputs, jobs):
            R, T, K = idx_all.shape
            L, C, H = ex.L, ex.capacity, x_all.shape[2]
            src, t, k = ((idx_all >= o * L) & (idx_all < (o + 1) * L)).nonzero(as_tuple=True)
            lo = idx_all[src, t, k] - o * L
            order = torch.sort((lo * R + src) * max(T, 1) + t).indices  # expert, then source rank, then token
            src, t, k, lo = src[order], t[order], k[order], lo[order]
            counts = torch.bincount(lo, minlength=L)
            rows = rows_all[src, t]
            n = rows.shape[0]
            compact = torch.full((C, H), float("nan"), dtype=torch.bfloat16, device=rows.device)
            compact[:n] = rows  # the rows past n are NaN: no output may depend on them
            y = ex.run(compact, counts, w13=w13, w2=w2)[:n]
            mine = src == rank
            ref.y[t[mine], k[mine]] = y[mine]
            if o == rank:
                ref.counts, ref.rows, ref.y_own = counts.cpu(), rows.cpu(), y.cpu()
                if row_check:
                    ref.row_invariant = _row_invariant(ex, rows, y, lo, w13, w2)
    return refs


def _row_invariant(ex: Experts, rows: torch.Tensor, y: torch.Tensor, lo: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor) -> bool:
    """Each of the first ``ROW_CHECK_ROWS`` rows through the expert function alone (a batch of 1) == its
    row of the batched result ``y``."""
    for i in range(min(rows.shape[0], ROW_CHECK_ROWS)):
        e = int(lo[i])
        one = expert_ffn(rows[i:i + 1], w13[e:e + 1], w2[e:e + 1],
                         Segments([1], torch.ones(1, dtype=torch.int32, device=rows.device)), ex.gemm)
        if not bitwise_equal(one, y[i:i + 1]):
            return False
    return True


# ------------------------------------------------------------------------------------------ one rank
def _line_up(device: torch.device) -> None:
    """Every rank idle and at the same point: a step's time then starts together everywhere."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def _all_gather(t: torch.Tensor) -> torch.Tensor:
    """``[R, *t.shape]``: every rank's ``t`` (same shape everywhere); BF16 travels as bytes (gloo)."""
    import torch.distributed as dist

    R = dist.get_world_size()
    if t.numel() == 0:
        return t.new_empty((R,) + tuple(t.shape))
    raw = t.contiguous().view(torch.uint8) if t.dtype == torch.bfloat16 else t.contiguous()
    parts = [torch.empty_like(raw) for _ in range(R)]
    dist.all_gather(parts, raw)
    out = torch.stack(parts)
    return out.view(torch.bfloat16) if t.dtype == torch.bfloat16 else out


def _time(step: Callable[[], torch.Tensor], want: torch.Tensor, cfg: DecodeConfig, device: torch.device):
    """``(median ms, every output bitwise == want)`` over ``warmup + iters`` lined-up steps."""
    samples, same = [], True
    for it in range(cfg.warmup + cfg.iters):
        _line_up(device)
        m = Marks(device)
        m.mark("start")
        out = step()
        m.mark("end")
        ms = m.ms("start", "end")
        if it >= cfg.warmup:
            samples.append(ms)
        same &= bitwise_equal(out, want)
    return statistics.median(samples), same


def _graph(step: Callable[[], torch.Tensor], want: torch.Tensor, cfg: DecodeConfig, device: torch.device):
    """The whole step captured in a CUDA graph and replayed: ``(median ms, every replay == want)``."""
    # A warm-up step on a side stream first, as torch asks before a capture (lazy initialisations).
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    _line_up(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    try:
        return _time(lambda: (graph.replay(), out)[1], want, cfg, device)
    finally:
        del graph


def _as_numpy(t: torch.Tensor):
    return t.detach().cpu().contiguous().view(torch.int16).numpy()


def _same_rows(probes: Sequence[Sequence[Dict[str, torch.Tensor]]], refs: Sequence[RefRows]) -> bool:
    """Every probe (one list per runtime, one entry per micro-batch) has the reference's counts, rows and
    expert outputs, bitwise."""
    for probe in probes:
        if len(probe) != len(refs):
            return False
        for p, r in zip(probe, refs):
            if not (torch.equal(p["counts"], r.counts) and bitwise_equal(p["rows"], r.rows)
                    and bitwise_equal(p["y"], r.y_own)):
                return False
    return True


def _make_buffers(cfg: DecodeConfig, device: torch.device):
    """``({runtime: (api, buffer)}, {runtime: description}, why native is missing)``, collective (every rank
    creates the same buffers in the same order)."""
    import torch.distributed as dist

    import elastic_ep

    group = dist.group.WORLD
    m, R, M = cfg.moe, cfg.world, cfg.max_micro_batch
    native = device.type == "cuda" and elastic_ep.native_available()
    missing = None if native else ("no GPU: the native kernels need one" if device.type != "cuda"
                                   else "elastic_ep's native backend is unavailable (built without CUDA kernels?)")
    hint = elastic_ep.Buffer.get_low_latency_rdma_size_hint(M, m.hidden, R, m.num_experts)
    bufs, names = {}, {}
    if native:
        bufs["ll_native"] = ("ll", elastic_ep.Buffer(group, 0, hint, low_latency_mode=True, backend="native"))
        names["ll_native"] = "low-latency API, native"
    bufs["ll_torch"] = ("ll", elastic_ep.Buffer(group, 0, hint, low_latency_mode=True, backend="torch"))
    names["ll_torch"] = "low-latency API, torch backend"
    # Sized for BF16 rows (FP8 ones fit too); no per-rank partial sums: every lane's row reaches the sum.
    bufs["v2"] = ("v2", elastic_ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=m.hidden,
                                                 num_topk=m.num_topk, use_fp8_dispatch=False, deterministic=True,
                                                 allow_multiple_reduction=False,
                                                 backend="native" if native else "torch"))
    names["v2"] = "V2 API (ElasticBuffer), " + ("native" if native else "torch backend")
    return bufs, names, missing


def run_rank(rank: int, world: int, rdzv: str, cfg: DecodeConfig) -> Dict[str, Any]:
    """One rank of the decode block (under tools/_launch.py or tests/_dist.run_workers): set up, check,
    measure. Returns the rank's figures and checks as plain Python values (see ``summarize``)."""
    import torch.distributed as dist

    from elastic_ep.demo import init_rank

    t0 = time.monotonic()
    device, _ = init_rank(rank, world, rdzv, cfg.device)
    moe = cfg.moe
    gate, bias = router_weights(moe, device)
    w13, w2 = local_expert_weights(moe, rank, world, device)
    gemm = resolve_gemm(cfg.gemm, device)
    bufs, names, missing = _make_buffers(cfg, device)
    experts = {fmt: Experts(w13, w2, world, moe.num_experts, cfg.max_micro_batch, cfg.capacity, fmt == "fp8", gemm)
               for fmt in cfg.formats}
    graph_why = None
    if device.type != "cuda":
        graph_why = "no GPU"
    elif "ll_native" not in bufs:
        graph_why = "no native low-latency kernels"
    elif gemm != "grouped":
        graph_why = "the per-expert matmuls read the counts on the host"
    elif not cfg.graph:
        graph_why = "--no-graph"
    res: Dict[str, Any] = dict(rank=rank, device=str(device), group=dist.get_backend(), runtimes=names,
                               native_missing=missing, gemm=gemm, graph_missing=graph_why, configs=[],
                               device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU")
    if rank == 0:
        print(f"[rank 0] decode: set up in {time.monotonic() - t0:.1f} s: {world} rank(s), "
              f"{', '.join(names.values())}", flush=True)

    # Inputs of every configuration and their all-gathered copies (the reference's inputs).
    cases = []
    for T in cfg.tokens:
        x = make_tokens(moe, rank, T, device)
        idx, w = route(x, gate, bias, moe)
        mbs, start = [], 0
        for n in micro_batches(T):
            mbs.append(MicroBatch(x[start:start + n], idx[start:start + n].contiguous(),
                                  w[start:start + n].contiguous()))
            start += n
        gathered = [(_all_gather(mb.x), _all_gather(mb.idx)) for mb in mbs]
        cases.append((T, mbs, gathered))

    # The references, owner rank by owner rank (each owner's experts regenerated once for every case).
    t1 = time.monotonic()
    cache: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def owner_weights(o: int):
        if o == rank:
            return w13, w2
        if o not in cache:
            cache.clear()  # one other owner's experts at a time
            cache[o] = local_expert_weights(moe, o, world, device)
        return cache[o]

    keys = [(T, fmt, i) for T, _, gathered in cases for fmt in cfg.formats for i in range(len(gathered))]
    jobs = [(experts[fmt], *gathered[i]) for _, _, gathered in cases for fmt in cfg.formats
            for i in range(len(gathered))]
    refs: Dict[Tuple[int, str], List[RefRows]] = {}
    for (T, fmt, _), r in zip(keys, reference_rows(rank, jobs, owner_weights, cfg.row_check)):
        refs.setdefault((T, fmt), []).append(r)
    cache.clear()
    if rank == 0:
        print(f"[rank 0] decode: references in {time.monotonic() - t1:.1f} s", flush=True)

    outputs: Dict[str, Any] = {}
    for T, mbs, _ in cases:
        for fmt in cfg.formats:
            ex, ref = experts[fmt], refs[(T, fmt)]
            w_all = [mb.w for mb in mbs]
            w_pow2 = [pow2_weights(w) for w in w_all]
            y_ref = [r.y for r in ref]
            want_ll = torch.cat([combine_ll_order(y, w) for y, w in zip(y_ref, w_all)])
            want_v2 = torch.cat([combine_v2_order(y, w) for y, w in zip(y_ref, w_all)])
            want_pow2 = torch.cat([combine_ll_order(y, w) for y, w in zip(y_ref, w_pow2)])
            magnitude = torch.cat([(y.float() * w.unsqueeze(-1)).abs().sum(1) for y, w in zip(y_ref, w_all)])
            entry: Dict[str, Any] = dict(tokens=T, dispatch=fmt, micro_batches=micro_batches(T), runtimes={})
            checks: Dict[str, Any] = dict(ll_reference={}, pow2={}, nohook={}, repeatable={}, graph={})
            probes, got = [], {}
            for name, (api, buf) in bufs.items():
                probe: List[Dict[str, torch.Tensor]] = []
                fig: Dict[str, Any] = dict(eager_ms=None, nohook_ms=None, graph_ms=None)
                if api == "ll":
                    # The checked step: every row past recv_count (inputs and outputs of the experts) is NaN.
                    out = ll_step(buf, ex, mbs, poison=True, probe=probe)
                    checks["ll_reference"][name] = bitwise_equal(out, want_ll)
                    checks["pow2"][name] = bitwise_equal(ll_step(buf, ex, mbs, weights=w_pow2), want_pow2)
                    nohook = ll_step(buf, ex, mbs, hooks=False)
                    checks["nohook"][name] = bitwise_equal(nohook, out)
                    fig["eager_ms"], same = _time(lambda: ll_step(buf, ex, mbs), out, cfg, device)
                    fig["nohook_ms"], same_nohook = _time(lambda: ll_step(buf, ex, mbs, hooks=False), out, cfg, device)
                    checks["repeatable"][name] = same and same_nohook
                    if name == "ll_native" and graph_why is None:
                        fig["graph_ms"], checks["graph"][name] = _graph(lambda: ll_step(buf, ex, mbs), out, cfg, device)
                else:
                    out = v2_step(buf, ex, mbs, probe=probe)
                    checks["v2_reference"] = bitwise_equal(out, want_v2)
                    checks["pow2"][name] = bitwise_equal(v2_step(buf, ex, mbs, weights=w_pow2), want_pow2)
                    fig["eager_ms"], checks["repeatable"][name] = _time(lambda: v2_step(buf, ex, mbs), out, cfg, device)
                probes.append(probe)
                got[name] = out
                entry["runtimes"][name] = fig
            checks["same_rows"] = _same_rows(probes, ref)
            ll_name = "ll_native" if "ll_native" in got else "ll_torch"
            ll, v2 = got[ll_name].float(), got["v2"].float()
            diff = (ll - v2).abs()
            bound = LL_V2_BOUND * (magnitude + ll.abs())
            empty = diff.numel() == 0
            checks["ll_vs_v2"] = dict(
                runtime=ll_name, differ=int((got[ll_name].view(torch.int16) != got["v2"].view(torch.int16)).sum()),
                elements=int(diff.numel()),
                # relative to sum_k |w_k y_k| (a difference near a cancelling sum is many ulps of the result)
                max_relative=0.0 if empty else float((diff / magnitude.clamp(min=1e-30)).max()),
                error=0.0 if empty else float((diff / bound.clamp(min=1e-30)).max()))
            checks["row_invariant"] = (None if not cfg.row_check or any(r.row_invariant is None for r in ref)
                                       else all(r.row_invariant for r in ref))
            entry["checks"] = checks
            res["configs"].append(entry)
            if cfg.return_outputs:
                outputs[f"{T}/{fmt}"] = dict({n: _as_numpy(o) for n, o in got.items()}, ll_reference=_as_numpy(want_ll),
                                             v2_reference=_as_numpy(want_v2))
            if rank == 0:
                print(f"[rank 0] decode: {T} tokens per rank, {fmt} dispatch measured", flush=True)
    for _, buf in bufs.values():
        buf.destroy()
    dist.destroy_process_group()
    if cfg.return_outputs:
        res["outputs"] = outputs
    return res


def launch(cfg: DecodeConfig) -> List[Dict[str, Any]]:
    """Runs ``run_rank`` on ``cfg.world`` spawned processes; their results by rank (RankFailure on a failure)."""
    return run_ranks(run_rank, cfg.world, cfg, timeout=cfg.timeout_s, grace_s=10)


# ------------------------------------------------------------------------------------------ report
BITWISE_CHECKS = ("ll_reference", "v2_reference", "same_rows", "pow2", "nohook", "repeatable", "graph")


def _all_true(values) -> Optional[bool]:
    """True/False over the non-None booleans of ``values`` (dicts flattened); None when there are none."""
    flat = []
    for v in values:
        flat.extend(v.values() if isinstance(v, dict) else [v])
    flat = [bool(v) for v in flat if v is not None]
    return all(flat) if flat else None


def summarize(cfg: DecodeConfig, results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The run's record: per configuration and runtime the slowest rank's medians; the checks over every rank
    (``ok`` False when any of them failed)."""
    r0 = results[0]
    rows = []
    configs = [c for r in results for c in r["configs"]]
    for i, c0 in enumerate(r0["configs"]):
        per_rank = [r["configs"][i] for r in results]
        slowest = {}
        for name in c0["runtimes"]:
            figs = [c["runtimes"][name] for c in per_rank]
            slowest[name] = {k: (max(f[k] for f in figs) if figs[0][k] is not None else None) for k in figs[0]}
        for name, fig in slowest.items():
            rows.append(dict(tokens=c0["tokens"], dispatch=c0["dispatch"], micro_batches=c0["micro_batches"],
                             runtime=name, name=r0["runtimes"][name], **fig,
                             vs_v2=slowest["v2"]["eager_ms"] / fig["eager_ms"]))
    checks: Dict[str, Any] = {k: _all_true(c["checks"].get(k) for c in configs) for k in BITWISE_CHECKS}
    lv = [c["checks"]["ll_vs_v2"] for c in configs]
    checks["ll_vs_v2"] = dict(runtime=lv[0]["runtime"], differ=sum(x["differ"] for x in lv),
                              elements=sum(x["elements"] for x in lv),
                              max_relative=max(x["max_relative"] for x in lv), error=max(x["error"] for x in lv))
    checks["row_invariant"] = _all_true(c["checks"]["row_invariant"] for c in configs)
    ok = all(checks[k] is not False for k in BITWISE_CHECKS) and checks["ll_reference"] is True and \
        checks["ll_vs_v2"]["error"] <= 1.0
    env = dict(torch=torch.__version__, device=r0["device_name"], world=cfg.world, group=r0["group"], gemm=r0["gemm"],
               native_missing=r0["native_missing"], graph_missing=r0["graph_missing"], runtimes=r0["runtimes"],
               max_micro_batch=cfg.max_micro_batch, capacity=cfg.capacity)
    try:
        import elastic_ep

        env["elastic_ep"] = elastic_ep.__version__
    except ImportError:
        pass
    config = asdict(cfg)
    config.pop("return_outputs")
    return dict(config=config, environment=env, steps=rows, checks=checks, ok=bool(ok),
                per_rank=[{k: v for k, v in r.items() if k != "outputs"} for r in results])


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def _verdict(v: Optional[bool], yes: str = "bitwise equal") -> str:
    return "not run" if v is None else yes if v else "DIFFERENT"


def render(record: Dict[str, Any]) -> str:
    """The record as markdown: a header, the step table and the checks."""
    cfg, env, checks = record["config"], record["environment"], record["checks"]
    moe = cfg["moe"]
    where = (f"{cfg['world']} CPU processes over gloo (CPU times, not a benchmark)" if cfg["device"] == "cpu"
             else f"{cfg['world']} rank(s) on {env['device']}")
    gemm = "torch._grouped_mm over cumsum(recv_count)" if env["gemm"] == "grouped" else "a matmul per expert"
    lines = [
        f"DeepSeek-V3 MoE layer, decode, EP {cfg['world']}: {where}; torch {env['torch']}, elastic_ep "
        f"{env.get('elastic_ep', '?')}",
        f"top-{moe['num_topk']} of {moe['num_experts']} experts, hidden {moe['hidden']}, intermediate "
        f"{moe['intermediate']}; each step's tokens in two micro-batches, num_max_dispatch_tokens_per_rank "
        f"{env['max_micro_batch']}; expert GEMMs: {gemm} on {env['capacity']} compact rows",
        "low-latency step: dispatch(mb0), dispatch(mb1), hook0, experts(mb0), combine(mb0), hook1, experts(mb1), "
        "combine(mb1), combine hooks; no-hook: one micro-batch after the other; V2: one after the other",
        f"median of {cfg['iters']} steps after {cfg['warmup']} warm-up; the slowest rank's figures; speed-up: "
        "V2's step ms over the row's (eager)",
    ]
    if env["native_missing"]:
        lines.append(f"native runtimes not run: {env['native_missing']}")
    if env["graph_missing"]:
        lines.append(f"CUDA graph not run: {env['graph_missing']}")
    lines += ["", "| tokens/rank | micro-batches | dispatch | runtime | step ms | no-hook ms | CUDA graph ms | "
                  "speed-up vs V2 |", "|---:|---|---|---|---:|---:|---:|---:|"]
    for r in record["steps"]:
        lines.append(f"| {r['tokens']} | {' + '.join(map(str, r['micro_batches']))} | {r['dispatch']} | {r['name']} | "
                     f"{_ms(r['eager_ms'])} | {_ms(r['nohook_ms'])} | {_ms(r['graph_ms'])} | {r['vs_v2']:.2f} x |")
    lv = checks["ll_vs_v2"]
    ri = checks["row_invariant"]
    lines += [
        "", "Checks (every rank, every configuration):",
        "- low-latency == reference (all-gathered inputs, the experts on the same packed rows, fp32 `acc + y * w` "
        "in lane order; rows past recv_count NaN): " + _verdict(checks["ll_reference"]),
        "- V2 == V2-order reference (rows weighted and rounded to BF16, then summed in fp32): "
        + _verdict(checks["v2_reference"]),
        "- low-latency, V2 and reference give the GEMMs the same rows and get the same expert outputs: "
        + _verdict(checks["same_rows"]),
        "- low-latency == V2 with power-of-two routing weights (products exact in both): " + _verdict(checks["pow2"]),
        f"- low-latency vs V2 with the real weights ({lv['runtime']}): {lv['differ']} of {lv['elements']} elements "
        f"differ, by at most {lv['max_relative']:.2g} x sum_k |w_k y_k|, {100 * lv['error']:.1f} % of the bound "
        f"2^-7 (sum_k |w_k y_k| + |out|) "
        + ("(passed)" if lv["error"] <= 1 else "(FAILED)")
        + ": V2's combine takes BF16 rows, so the weight is applied and rounded to BF16 before the sum, while "
          "the low-latency combine multiplies in fp32",
        "- low-latency with hooks == without: " + _verdict(checks["nohook"]),
        "- every timed step == the checked one: " + _verdict(checks["repeatable"]),
        "- CUDA-graph replay == eager: " + _verdict(checks["graph"]),
        "- expert rows alone == in their batch (reported, not relied on): "
        + ("not run" if ri is None else "yes" if ri else "no (the reference uses the packed rows)"),
    ]
    return "\n".join(lines) + "\n"


def _plot(record: Dict[str, Any], path: str) -> None:
    plt = pyplot()
    rows = record["steps"]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * len(rows)))
    labels = [f"{r['tokens']} tok {r['dispatch']}, {r['runtime']}" for r in rows]
    y = list(range(len(rows)))
    h = 0.27
    for off, key, color in ((-h, "eager_ms", "tab:blue"), (0, "nohook_ms", "tab:gray"), (h, "graph_ms", "tab:green")):
        ax.barh([v + off for v in y], [r[key] or 0 for r in rows], height=h, color=color,
                label={"eager_ms": "step (hooks)", "nohook_ms": "no hooks", "graph_ms": "CUDA graph"}[key])
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode step (slowest rank, median)")
    ax.set_title("MoE layer decode step")
    ax.legend(fontsize=8, loc="lower right")
    save(fig, path)


def write_outputs(out: str, record: Dict[str, Any], table: str, command: str) -> List[str]:
    """``block_elastic_ep_decode.{json,md,png}`` in ``out``; the paths written."""
    return write_results(out, NAME, dict(record, command=command),
                         f"# elastic_ep model block: decode\n\n`{command}`\n\n{table}", lambda p: _plot(record, p),
                         quiet=True, run=run_record(command))


# ------------------------------------------------------------------------------------------ main
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/block_elastic_ep.py --mode decode",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="decode", choices=("decode",), help=argparse.SUPPRESS)
    p.add_argument("--tokens", default=None,
                   help="tokens per rank per step, comma-separated (GPU 1,32,128; CPU 1,8,32)")
    p.add_argument("--dispatch", default=",".join(FORMATS), help="dispatch formats, from bf16,fp8 (default both)")
    p.add_argument("--experts", type=int, default=None, help="routed experts (GPU 256, CPU 32)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size, a multiple of 128 (GPU 7168, CPU 256)")
    p.add_argument("--intermediate", type=int, default=None, help="MoE intermediate size (GPU 2048, CPU 128)")
    p.add_argument("--iters", type=int, default=None, help="measured steps (GPU 20, CPU 3; --quick 5 / 1)")
    p.add_argument("--warmup", type=int, default=None, help="steps before measuring (GPU 3, CPU 1; --quick 2 / 1)")
    p.add_argument("--world", type=int, default=None, help="ranks (GPU: one per GPU; CPU 2)")
    p.add_argument("--quick", action="store_true", help="fewer steps, no row-invariance report")
    p.add_argument("--gemm", default="auto", choices=("auto", "grouped", "loop"),
                   help="expert GEMMs: torch._grouped_mm, a matmul per expert, or auto (grouped where it runs)")
    p.add_argument("--no-graph", action="store_true", help="no CUDA-graph replay")
    p.add_argument("--out", default=None, help=f"also write {NAME}.{{md,json,png}} into this folder")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="auto: cuda when torch sees a GPU")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights and tokens")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The decode block's command line: 0 when every check passed, 1 otherwise, 2 for a bad option."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, cfg = parse_run(parser(), argv, build_config)
    return run(args, cfg, argv)


def run(args: argparse.Namespace, cfg: DecodeConfig, argv: Sequence[str]) -> int:
    """Runs a parsed decode command line (``argv``, recorded with the results): launch, report, write."""
    argv = list(argv)
    if cfg.device == "cpu":
        print(CPU_EXPLANATION)
    m = cfg.moe
    print(f"elastic_ep decode block: EP {cfg.world} on {cfg.device}, tokens/rank {list(cfg.tokens)}, dispatch "
          f"{'/'.join(cfg.formats)}, experts {m.num_experts}, hidden {m.hidden}, intermediate {m.intermediate}, "
          f"{cfg.iters} steps after {cfg.warmup} warm-up", flush=True)
    try:
        results = launch(cfg)
    except RankFailure as e:
        print(f"decode block FAILED: {e}", file=sys.stderr)
        return 1
    record = summarize(cfg, results)
    table = render(record)
    print(table, end="")
    if args.out:
        command = command_line("python tools/block_elastic_ep.py",
                               argv if "--mode" in argv or "--mode=decode" in argv else ["--mode", "decode"] + argv)
        written = write_outputs(args.out, record, table, command)
        print("wrote " + ", ".join(written))
    print("decode block OK" if record["ok"] else "decode block FAILED: a check failed (above)")
    return 0 if record["ok"] else 1
