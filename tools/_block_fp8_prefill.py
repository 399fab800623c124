"""The prefill loop: MoE layers whose FP8 experts live in host memory, each streamed to every TP rank
while the previous layer's expert GEMMs run.

    python tools/block_fp8_layerwise.py [--prefill] [--tp N] [--layers 12] [--experts 8] [--hidden 7168]
        [--intermediate 2048] [--tokens 16384] [--top-k 4] [--repeat 3] [--backend auto|cuda|cpu]
        [--slots S] [--threads N] [--seed 0] [--timeout 600] [--out DIR]

It launches ``--tp`` processes (tools/_launch.py), one per TP rank (default: one per GPU; ranks
beyond the number of GPUs share them, which checks correctness only).
Each rank holds two :class:`~fp8_layerwise.Transport` objects, whose layer buffers are the two GPU
layer buffers: layer L goes into buffer ``L % 2``. Rank 0 keeps every layer's whole-layer block-FP8
experts (DeepSeek-V3's layout: per expert ``w13 [2I, H]`` and ``w2 [H, I]`` in float8_e4m3fn with
fp32 128x128 block scales) in host memory and streams them with the native shard writer. A layer's
compute is this rank's share of the experts' FFN for a prefill chunk of ``--tokens`` tokens routed
top-``k`` (balanced: every expert gets ``tokens * k / experts`` rows): dequantise the FP8 shard to
bf16, batched matmuls, SiLU gate (``tools/_block_fp8_moe.py``).

The schedule (:func:`run_loop`): stream layer 0; then for every layer L, enqueue L's compute on the
compute stream, wait until layer L-1's compute (which read the other buffer) finished, and stream
layer L+1 into that buffer while L computes. Phases on every rank:

1. set-up: sources (generated on the rank's device from a seed: every rank has the same bytes),
   this rank's reference shards (:func:`~fp8_layerwise.reference_shard`), rank 0's writers;
2. warm-up: layers 0 and 1 streamed once (the first touch of slots and buffers), one compute;
3. alone: per layer, all ranks start together, the layer is streamed with the GPU idle (transfer
   alone), its delivered bytes are compared with the reference shard, then it is computed
   ``--repeat`` times with nothing else running (compute alone: the median; the first output is the
   layer's reference output);
4. the loop, once to warm up and ``--repeat`` times timed: every layer's output is compared bit
   for bit with its reference
   output (a buffer overwritten while a layer computes would show there), and the timeline is
   checked (no layer streamed into a buffer before the compute that read it finished, no compute
   before its layer arrived); after the last run, the bytes of the layers still in the buffers.

Goals (the run with the median loop time): the loop, from layer 0's arrival to the last layer's
output (layer 0's transfer precedes every compute, nothing can hide it: it is reported apart),
within 1.05 x the sum over layers of max(compute alone, transfer alone); the compute inside the
loop at most 5 % slower than alone. They are judged on the CUDA backend with one rank per GPU only.
``--out DIR`` writes prefill.md (the table), prefill.json (every figure and the timelines) and
prefill.png (per-layer times and rank 0's timeline; needs matplotlib).

Defaults: with CUDA, DeepSeek-V3's expert shapes (H 7168, I 2048), 8 experts per layer (352 MB per
layer at TP 1), 16384 tokens top-4 (8192 rows per expert), 12 layers: 5.8 TFLOP and 352 MB per layer
and rank at TP 1 (both divided by the TP size), sized so that on an H200 (~700 TFLOP/s of bf16
matmuls, ~40 GB/s from host memory with the writer) compute and transfer take similar times, about
9 ms each. On the CPU backend, tiny shapes with CPU matmuls: the schedule, the bytes and the outputs
are checked, the timings mean nothing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, List, Optional, Sequence

from _block_fp8_prefill_report import flops_text, report, write_outputs
from _launch import RankFailure, abort_on_failure, parse_run, run_ranks, spawn_context
from _results import command_line

GPU_DEFAULTS = dict(layers=12, experts=8, hidden=7168, intermediate=2048, tokens=16384, top_k=4, repeat=3)
CPU_DEFAULTS = dict(tp=2, layers=4, experts=4, hidden=256, intermediate=256, tokens=64, top_k=2, repeat=2, threads=1)


# ---- the schedule ---------------------------------------------------------------------------------
def run_loop(num_layers: int, stream: Callable[[int], object], submit: Callable[[int], object]):
    """The double-buffered prefill loop; returns (the tickets, ``time.monotonic()`` at layer 0's arrival).

    Arguments:
        stream: ``stream(L)`` delivers layer L into buffer ``L % 2`` on every rank (blocking).
        submit: ``submit(L)`` enqueues layer L's compute on buffer ``L % 2`` and returns at once a
            ticket whose ``wait()`` blocks until that compute finished.

    Layer L+1 is streamed while layer L computes, into the buffer layer L-1 computed on, once that
    compute finished (the only wait for the GPU in the loop).
    """
    stream(0)
    first = time.monotonic()
    tickets = []
    for layer in range(num_layers):
        tickets.append(submit(layer))
        if layer + 1 < num_layers:
            if layer >= 1:
                tickets[layer - 1].wait()
            stream(layer + 1)
    for ticket in tickets[-2:]:
        ticket.wait()
    return tickets, first


def check_timeline(events: Sequence[dict], tolerance_ms: float = 0.0) -> List[str]:
    """Violations of the double-buffering rules in one loop's timeline (empty: none).

    ``events``: dicts with ``kind`` ("transfer" or "compute"), ``layer``, ``buffer``, ``start_ms``,
    ``end_ms``. A transfer into a buffer must start after every earlier layer's compute on that
    buffer ended; a compute must start after its layer's transfer ended. ``tolerance_ms`` absorbs the
    offset between the GPU's event clock and the host clock (the former is mapped onto the latter).
    """
    transfers = {e["layer"]: e for e in events if e["kind"] == "transfer"}
    computes = {e["layer"]: e for e in events if e["kind"] == "compute"}
    bad = []
    for layer, c in sorted(computes.items()):
        t = transfers.get(layer)
        if t is None:
            bad.append(f"layer {layer} computed but never streamed")
        elif c["buffer"] != t["buffer"]:
            bad.append(f"layer {layer} streamed into buffer {t['buffer']} but computed on buffer {c['buffer']}")
        elif c["start_ms"] < t["end_ms"] - tolerance_ms:
            bad.append(f"layer {layer}'s compute started at {c['start_ms']:.3f} ms, before its transfer ended "
                       f"at {t['end_ms']:.3f} ms")
    for layer, t in sorted(transfers.items()):
        for prev, c in sorted(computes.items()):
            if prev < layer and c["buffer"] == t["buffer"] and c["end_ms"] > t["start_ms"] + tolerance_ms:
                bad.append(f"layer {layer} was streamed into buffer {t['buffer']} from {t['start_ms']:.3f} ms while "
                           f"layer {prev}'s compute on it ran until {c['end_ms']:.3f} ms")
    return bad


def overlap_ms(events: Sequence[dict]) -> float:
    """Time during which a transfer and a compute ran at once (the intervals of each kind do not overlap
    one another)."""
    tr = [(e["start_ms"], e["end_ms"]) for e in events if e["kind"] == "transfer"]
    co = [(e["start_ms"], e["end_ms"]) for e in events if e["kind"] == "compute"]
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in tr for b0, b1 in co)


# ---- one rank -----------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, rdzv: str, cfg: dict, tmp: str, barrier) -> dict:
    """One rank under tools/_launch.py (the rendezvous is unused: the transports exchange their names
    through ``tmp``)."""
    return abort_on_failure(barrier, _run_rank, rank, cfg, tmp, barrier)


def _run_rank(rank: int, cfg: dict, tmp: str, barrier) -> dict:
    import contextlib
    import functools

    import torch

    import fp8_layerwise as F

    import _block_fp8_moe as M

    tp, N, E, H, I = cfg["tp"], cfg["layers"], cfg["experts"], cfg["hidden"], cfg["intermediate"]
    T, k, reps, seed = cfg["tokens"], cfg["top_k"], cfg["repeat"], cfg["seed"]
    cuda = cfg["backend"] == "cuda"
    s = I // tp
    barrier_s = cfg["timeout"]
    if cuda:
        device_index = rank % torch.cuda.device_count()
        torch.cuda.set_device(device_index)
        device = torch.device("cuda", device_index)
    else:
        device_index, device = None, torch.device("cpu")
    times = dict(start=time.monotonic())

    # 1. set-up: every layer's sources from its seed; this rank's reference shards; rank 0's writers.
    nb = F.block_fp8_expert_nbytes(H, I, tp)
    refs, writers = [], []
    for layer in range(N):
        src = M.make_layer_sources(E, H, I, seed=seed * 100003 + layer, device=device)
        shards = [F.reference_shard(src, tp, rank, e) for e in range(E)]
        refs.append([torch.cat([sh[kind] for sh in shards]) for kind in range(4)])
        del shards
        if rank == 0:
            writers.append(F.make_shard_writer([t.cpu().contiguous() for t in src], tp, threads=cfg["threads"]))
        del src
    xg = torch.Generator(device=device).manual_seed(seed * 100003 + 99991)
    x = torch.randn((T, H), device=device, generator=xg).to(torch.bfloat16)
    routing = M.balanced_routing(T, E, k, seed=seed * 100003 + 77773, device=device)
    compute = M.GpuCompute(device) if cuda else M.CpuCompute()

    with contextlib.ExitStack() as stack:
        transports = []
        for b in range(2):
            names = os.path.join(tmp, f"names{b}")
            transports.append(stack.enter_context(F.Transport(
                rank, tp, E, nb, num_slots=cfg["slots"], backend=cfg["backend"], device=device_index,
                exchange=F.FileExchange(names, rank, tp, timeout_s=120), timeout_ms=60000)))
        stack.callback(compute.close)
        if cuda:
            torch.cuda.synchronize(device)  # x, routing and the buffers exist before the compute stream reads them
        times["ready"] = time.monotonic()
        epochs = [0, 0]

        def stream(layer: int):
            b = layer % 2
            epochs[b] += 1
            with transports[b].layer(epochs[b], layer, E, sync_stream=False) as lay:
                if rank == 0:
                    lay.run(writers[layer])
            return lay.stats

        def forward(layer: int):
            return M.moe_forward(x, routing, *M.shard_views(transports[layer % 2].buffers, E, H, s))

        def exact(layer: int) -> bool:
            return all(torch.equal(transports[layer % 2].buffers[kind], refs[layer][kind]) for kind in range(4))

        # 2. warm-up.
        warm_exact = []
        for layer in range(min(2, N)):
            stream(layer)
            warm_exact.append(exact(layer))
        compute.submit(functools.partial(forward, 0)).wait()

        # 3. each layer alone: transfer (GPU idle, every rank starting together), bytes, compute.
        alone, ref_out = [], []
        for layer in range(N):
            barrier.wait(timeout=barrier_s)
            t0 = time.monotonic()
            st = stream(layer)
            transfer_ms = (time.monotonic() - t0) * 1e3
            ok = exact(layer)
            runs, outs = [], []
            for _ in range(reps):
                ticket = compute.submit(functools.partial(forward, layer)).wait()
                runs.append(ticket.elapsed_ms())
                outs.append(ticket.result)
            ref_out.append(outs[0])
            alone.append(dict(layer=layer, transfer_ms=transfer_ms, compute_ms=statistics.median(runs),
                              compute_runs_ms=runs, exact=ok,
                              reproducible=all(M.bitwise_equal(o, outs[0]) for o in outs[1:]),
                              writer_ms=st.writer_ms, h2d_ms=st.h2d_ms, copies=st.copies, bytes=st.bytes))
            del outs

        # 4. the loop: a warm-up run (the caching allocator grows to hold every layer's output), then
        # the timed runs; every run's outputs and timeline are checked.
        loops = []
        for attempt in range(reps + 1):
            barrier.wait(timeout=barrier_s)
            events: List[dict] = []

            def stream_timed(layer: int):
                a = time.monotonic()
                st = stream(layer)
                events.append(dict(kind="transfer", layer=layer, buffer=layer % 2, start=a, end=time.monotonic(),
                                   writer_ms=st.writer_ms, h2d_ms=st.h2d_ms))

            compute.mark()
            t_start = time.monotonic()
            tickets, t_first = run_loop(N, stream_timed,
                                        lambda layer: compute.submit(functools.partial(forward, layer)))
            t_end = time.monotonic()
            for layer, ticket in enumerate(tickets):
                a, b = ticket.interval()
                events.append(dict(kind="compute", layer=layer, buffer=layer % 2, start=a, end=b,
                                   elapsed_ms=ticket.elapsed_ms()))
            for e in events:
                e["start_ms"], e["end_ms"] = (e.pop("start") - t_start) * 1e3, (e.pop("end") - t_start) * 1e3
            equal = [M.bitwise_equal(ticket.wait().result, ref_out[layer]) for layer, ticket in enumerate(tickets)]
            del tickets
            events.sort(key=lambda e: e["start_ms"])
            loops.append(dict(warmup=attempt == 0, loop_ms=(t_end - t_first) * 1e3, fill_ms=(t_first - t_start) * 1e3,
                              total_ms=(t_end - t_start) * 1e3,
                              compute_ms=[e["elapsed_ms"] for e in sorted(
                                  (e for e in events if e["kind"] == "compute"), key=lambda e: e["layer"])],
                              transfer_ms=[e["end_ms"] - e["start_ms"] for e in sorted(
                                  (e for e in events if e["kind"] == "transfer"), key=lambda e: e["layer"])],
                              outputs_equal=equal, overlap_ms=overlap_ms(events),
                              violations=check_timeline(events, tolerance_ms=0.2 if cuda else 0.0),
                              events=events))
        end_exact = {layer: exact(layer) for layer in range(max(0, N - 2), N)}
        backend = transports[0].backend
    times["done"] = time.monotonic()
    return dict(rank=rank, device=device_index, backend=backend, expert_nbytes=nb, warm_exact=warm_exact,
                alone=alone, loops=loops, end_exact=end_exact, times=times)


# ---- the command --------------------------------------------------------------------------------
def _cuda_usable() -> bool:
    import torch

    import fp8_layerwise as F

    return F.built_with_cuda() and torch.cuda.is_available() and torch.cuda.device_count() > 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _host_available_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resolve_config(args: argparse.Namespace) -> dict:
    """The run's settings: the backend resolved, the defaults of that backend filled in, every value
    checked (ValueError naming the option) before anything is launched."""
    import torch

    from fp8_layerwise import MAX_SLOTS, MAX_TP, block_fp8_expert_nbytes, built_with_cuda, default_writer_threads

    backend = args.backend
    if backend == "auto":
        backend = "cuda" if _cuda_usable() else "cpu"
    _check(backend != "cuda" or built_with_cuda(), "--backend cuda: fp8_layerwise was built without CUDA")
    _check(backend != "cuda" or torch.cuda.is_available(), "--backend cuda: no CUDA device is visible")
    ndev = torch.cuda.device_count() if backend == "cuda" else 0
    defaults = dict(GPU_DEFAULTS if backend == "cuda" else CPU_DEFAULTS)
    cfg = {key: (getattr(args, key) if getattr(args, key) is not None else defaults.get(key))
           for key in ("tp", "layers", "experts", "hidden", "intermediate", "tokens", "top_k", "repeat", "slots",
                       "threads")}
    if cfg["tp"] is None:  # one rank per GPU, as many as cut the layer into 128-blocks
        cfg["tp"] = max([t for t in range(1, min(ndev, MAX_TP) + 1) if cfg["intermediate"] % (128 * t) == 0] or [1])
    for key, lo in (("tp", 1), ("layers", 1), ("experts", 1), ("tokens", 1), ("top_k", 1), ("repeat", 1),
                    ("threads", 1)):
        _check(cfg[key] is None or cfg[key] >= lo, f"--{key.replace('_', '-')} must be >= {lo}, got {cfg[key]}")
    _check(cfg["tp"] <= MAX_TP, f"--tp must be at most {MAX_TP}, got {cfg['tp']}")
    _check(cfg["slots"] is None or 2 <= cfg["slots"] <= MAX_SLOTS,
           f"--slots must be in 2..{MAX_SLOTS}, got {cfg['slots']}")
    _check(cfg["top_k"] <= cfg["experts"], f"--top-k ({cfg['top_k']}) must be at most --experts ({cfg['experts']})")
    _check(cfg["tokens"] % cfg["experts"] == 0,
           f"--tokens ({cfg['tokens']}) must be a multiple of --experts ({cfg['experts']}) (balanced routing)")
    try:
        nb = block_fp8_expert_nbytes(cfg["hidden"], cfg["intermediate"], cfg["tp"])
    except ValueError as exc:
        raise ValueError(f"--hidden / --intermediate / --tp: {exc}") from None
    _check(args.timeout > 0, f"--timeout must be > 0 seconds, got {args.timeout}")
    _check(args.seed >= 0, f"--seed must be >= 0, got {args.seed}")
    full = cfg["layers"] * cfg["experts"] * sum(block_fp8_expert_nbytes(cfg["hidden"], cfg["intermediate"], 1))
    avail = _host_available_bytes()
    _check(avail is None or full <= 0.7 * avail,
           f"--layers x --experts: rank 0 keeps {full / 1e9:.1f} GB of experts in host memory, more than 70 % of "
           f"the {avail / 1e9 if avail else 0:.1f} GB available")
    if cfg["threads"] is None:
        cfg["threads"] = default_writer_threads(cfg["tp"])
    cfg.update(backend=backend, seed=args.seed, timeout=args.timeout, expert_nbytes=nb, gpus=ndev)
    return cfg


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/block_fp8_layerwise.py --prefill",
                                description="The prefill loop: FP8 experts streamed from host memory to every TP "
                                            "rank while the previous layer's expert GEMMs run.")
    g, c = GPU_DEFAULTS, CPU_DEFAULTS
    p.add_argument("--tp", type=int, default=None,
                   help=f"TP ranks (processes), 1..8 (default: one per GPU; CPU backend {c['tp']})")
    p.add_argument("--layers", type=int, default=None, help=f"MoE layers (default {g['layers']}; CPU {c['layers']})")
    p.add_argument("--experts", type=int, default=None,
                   help=f"experts per layer (default {g['experts']}; CPU {c['experts']})")
    p.add_argument("--hidden", type=int, default=None, help=f"hidden size H (default {g['hidden']}; CPU {c['hidden']})")
    p.add_argument("--intermediate", type=int, default=None,
                   help=f"expert intermediate size I (default {g['intermediate']}; CPU {c['intermediate']})")
    p.add_argument("--tokens", type=int, default=None, help=f"tokens of the prefill chunk (default {g['tokens']}; "
                                                            f"CPU {c['tokens']})")
    p.add_argument("--top-k", dest="top_k", type=int, default=None,
                   help=f"experts per token (default {g['top_k']}; CPU {c['top_k']})")
    p.add_argument("--repeat", type=int, default=None,
                   help=f"loop runs, and computes of each layer alone (default {g['repeat']}; CPU {c['repeat']})")
    p.add_argument("--slots", type=int, default=None, help="host slots per rank (default: the transport's)")
    p.add_argument("--threads", type=int, default=None,
                   help=f"native writer threads (default: the writer's for the TP size; CPU {c['threads']})")
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: CUDA when a GPU is usable, else the CPU backend with tiny shapes")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, tokens and routing")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run (ranks are killed after)")
    p.add_argument("--out", default=None, help="also write prefill.md, prefill.json and prefill.png here")
    return p


def run(cfg: dict) -> List[dict]:
    """Launch the ranks and wait for them (at most ``cfg['timeout']`` s); returns their results.

    Raises:
        RankFailure: a rank failed, died or did not finish (the others get 15 s after a failure:
            they fail too, through the poison or the aborted barrier, or wait for the failed rank).
    """
    barrier = spawn_context().Barrier(cfg["tp"])
    with tempfile.TemporaryDirectory(prefix="fp8lw_prefill_") as tmp:
        return run_ranks(_rank_main, cfg["tp"], cfg, tmp, barrier, timeout=cfg["timeout"], grace_s=15)


def main(argv: Optional[List[str]] = None) -> int:
    """The prefill loop's command line (``--prefill`` of tools/block_fp8_layerwise.py): 0 when every
    check passed, 1 otherwise, 2 for a bad option."""
    args, cfg = parse_run(parser(), argv, resolve_config)
    import _block_fp8_moe as M

    tp, s = cfg["tp"], cfg["intermediate"] // cfg["tp"]
    nb = cfg["expert_nbytes"]
    rows = cfg["tokens"] * cfg["top_k"] // cfg["experts"]
    ndev = cfg["gpus"]
    print(f"fp8_layerwise prefill loop: backend={cfg['backend']} tp={tp} layers={cfg['layers']} "
          f"experts={cfg['experts']} H={cfg['hidden']} I={cfg['intermediate']} tokens={cfg['tokens']} "
          f"top-k={cfg['top_k']} ({rows} rows per expert) repeat={cfg['repeat']}")
    print(f"  per rank and layer: {cfg['experts'] * sum(nb) / 1e6:.1f} MB of FP8 experts "
          f"({sum(nb) / 1e6:.2f} MB per expert) and "
          f"{flops_text(M.moe_flops(cfg['tokens'], cfg['top_k'], cfg['hidden'], s))} of expert GEMMs; "
          f"rank 0 holds {cfg['layers'] * cfg['experts'] * sum(nb) * tp / 1e6:.1f} MB of experts in host memory")
    if cfg["backend"] == "cuda":
        print(f"  {tp} rank(s) on {ndev} GPU(s)" + (f": ranks share GPUs (rank r on GPU r % {ndev}), which checks "
                                                    "correctness only" if tp > ndev else ", one per GPU"))
    t0 = time.monotonic()
    try:
        results = run(cfg)
    except RankFailure as exc:
        print(f"{exc}\nprefill FAILED", file=sys.stderr)
        return 1
    lines, md, record, ok = report(cfg, results, ndev)
    record["wall_s"] = time.monotonic() - t0
    for line in lines:
        print("  " + line)
    if args.out:
        command = command_line("python tools/block_fp8_layerwise.py --prefill", argv)
        md = "\n".join(["# fp8_layerwise prefill loop", "", f"`{command}`", "", md])
        print("  wrote " + ", ".join(write_outputs(args.out, "prefill", record, md, command)))
    print(f"prefill OK: weights byte-exact and outputs checked on every rank ({record['wall_s']:.1f} s)" if ok
          else "prefill FAILED: see the checks above")
    return 0 if ok else 1
