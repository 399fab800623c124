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

**Torch reference and checks** (tools/_block_ep_decode_ref.py, whose docstring describes them): every
rank's inputs all-gathered, the same expert function run on the packed rows each owner rank receives,
the two combine orders in plain torch; every check but ``row_invariant`` must pass (exit status 1
otherwise). The run's record, table and files: tools/_block_ep_decode_report.py.

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
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _block_ep_decode_ref import (LL_V2_BOUND, RefRows, cast_fp8, combine_ll_order, combine_v2_order,  # noqa: E402
                                  pow2_weights, reference_rows, same_rows)
from _block_ep_decode_config import (CPU_EXPLANATION, DecodeConfig, build_config, micro_batches,  # noqa: E402
                                    parser)
from _block_ep_decode_report import render, summarize, write_outputs  # noqa: E402
from _block_ep_moe_layer import (Marks, Segments, bitwise_equal, dequantize_fp8, expert_ffn,  # noqa: E402
                                 local_expert_weights, make_tokens, resolve_gemm, route, router_weights)
from _launch import RankFailure, parse_run, run_ranks  # noqa: E402
from _results import command_line  # noqa: E402

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
            checks["same_rows"] = same_rows(probes, ref)
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


# ------------------------------------------------------------------------------------------ main
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
