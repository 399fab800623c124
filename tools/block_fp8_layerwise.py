#!/usr/bin/env python3
"""fp8_layerwise's blocks: the prefill loop on a GPU, the multi-process streaming run without one.

    python tools/block_fp8_layerwise.py [--out DIR] [...]   # GPU usable: the prefill loop; else both below
    python tools/block_fp8_layerwise.py --prefill [...]     # the prefill loop (--prefill --help)
    python tools/block_fp8_layerwise.py --stream [...]      # the streaming run (below; --stream --help)

**The prefill loop** (tools/_block_fp8_prefill.py): MoE layers whose block-FP8 experts live in host
memory; layer L+1's experts stream to every TP rank into one of two GPU layer buffers while layer L's
expert GEMMs run on the other; it reports compute alone, transfer alone and the loop's time per
layer against its goals, and checks every weight byte and every layer's output. ``tools/gpu.sh``
runs it as fp8_layerwise's model block.

Without a usable GPU the plain command explains that, runs the streaming run with the arguments
given, then the prefill loop on the CPU backend at tiny sizes (CPU matmuls on a worker thread), which
checks its schedule, bytes and outputs but whose timings mean nothing. ``tools/run.sh`` runs that on
a machine without a GPU.

**The streaming run**: synthetic DeepSeek-V3-shaped MoE layers streamed between TP processes.

    python tools/block_fp8_layerwise.py --stream [--tp 2] [--experts 32] [--layers 6] [--warmup 1]
        [--backend cpu|cuda|auto] [--hidden 1024] [--intermediate 1024] [--slots 4] [--threads 1] [--out DIR]

It spawns ``--tp`` processes (tools/_launch.py), each running ``fp8_layerwise.demo.stream_layers``
(the package demo's ranks: rank 0 streams every layer with the native shard writer, every rank
checks its delivered shards byte for byte against a plain-torch slice of the same sources). It
prints one row per layer and rank, then each rank's steady-state throughput over the layers after
the ``--warmup`` ones (the first layer also pays the first-touch page faults of the shared slots and
of the destination buffers), and where the wall time went: process start and imports, set-up
(sources, references, writers, transport), streaming, verification. ``--out DIR`` also writes the
table (demo.md) and every figure (demo.json) there.

The default shapes are DeepSeek-V3's layout scaled down (hidden 1024 instead of 7168) so that it
runs in about 10 s on a 2-core CPU machine with the CPU backend; pass
``--hidden 7168 --intermediate 2048 --backend cuda`` for the real per-expert sizes on GPUs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _block_fp8_prefill as prefill  # noqa: E402
from _launch import RankFailure, abort_on_failure, run_ranks, spawn_context  # noqa: E402
from _results import command_line, run_record, write_results  # noqa: E402


def _stream_rank(rank: int, world: int, rdzv: str, cfg: dict, tmp: str, barrier) -> dict:
    """One rank of the streaming run (the rendezvous is unused: the transport exchanges its names
    through ``tmp``)."""
    from fp8_layerwise.demo import stream_layers

    return abort_on_failure(barrier, stream_layers, rank, cfg, tmp, barrier)


def _gbs(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e6) if ms > 0 else float("nan")


def _report(args, nb, results, t0: float, t_end: float):
    """The printed lines and the JSON record of a finished run (``results[rank]`` from
    ``stream_layers``)."""
    tp, layers, warm = args.tp, args.layers, args.warmup
    backend = results[0]["backend"]
    cuda = backend == "cuda"
    lines = [f"backend: {backend}" + ("" if cuda else " (shared-memory slots -> destination buffers in host "
                                                        "memory: no host-to-device copy, so no H2D column)")]
    head = f"| layer | rank | MB | total ms | writer ms | {'h2d ms | ' if cuda else ''}slot wait ms | copies | GB/s | bytes |"
    table = [head, "|---" * (head.count("|") - 1) + "|"]
    all_ok = True
    for layer in range(layers):
        for r in range(tp):
            row = results[r]["rows"][layer]
            all_ok &= row["ok"] and row["bytes"] == args.experts * sum(nb)
            table.append(f"| {layer} | {r} | {row['bytes'] / 1e6:.2f} | {row['total_ms']:.2f} | {row['writer_ms']:.2f} | "
                         + (f"{row['h2d_ms']:.2f} | " if cuda else "")
                         + f"{row['slot_wait_ms']:.2f} | {row['copies']} | {_gbs(row['bytes'], row['total_ms']):.2f} | "
                         f"{'exact' if row['ok'] else 'MISMATCH'} |")
    lines += table
    steady = {}
    if layers > warm:
        lines.append(f"steady state per rank, layers {warm}..{layers - 1} (after {warm} warm-up layer"
                     f"{'s' if warm != 1 else ''}; layer 0 also pays the first-touch page faults of the shared slots "
                     "and the destination buffers):")
        for r in range(tp):
            rows = results[r]["rows"][warm:]
            nbytes, ms = sum(x["bytes"] for x in rows), sum(x["total_ms"] for x in rows)
            med = statistics.median(_gbs(x["bytes"], x["total_ms"]) for x in rows)
            steady[r] = dict(bytes=nbytes, ms=ms, gbs=_gbs(nbytes, ms), median_layer_gbs=med)
            lines.append(f"  rank {r}: {nbytes / 1e6:.1f} MB in {ms:.1f} ms = {steady[r]['gbs']:.2f} GB/s "
                         f"(median layer {med:.2f} GB/s)")
    else:
        lines.append(f"no steady-state figure: --layers {layers} leaves no layer after --warmup {warm}")
    # Where the wall time went (one monotonic clock for all processes).
    tm = [results[r]["times"] for r in range(tp)]
    start_s = max(x["imported"] for x in tm) - t0
    setup_s = max(x["ready"] for x in tm) - max(x["imported"] for x in tm)
    stream_s = sum(max(results[r]["rows"][l]["end"] for r in range(tp)) - min(results[r]["rows"][l]["start"] for r in range(tp))
                   for l in range(layers))
    verify_s = max(x["verify_s"] for x in tm)
    moved = layers * tp * args.experts * sum(nb)
    timing = dict(process_start_and_imports_s=start_s, setup_s=setup_s, streaming_s=stream_s,
                  verification_s=verify_s, wall_s=t_end - t0, moved_bytes=moved)
    lines.append(f"streaming: {moved / 1e6:.1f} MB over all ranks in {layers} layers took {stream_s:.2f} s "
                 f"({_gbs(moved, stream_s * 1e3):.2f} GB/s; each layer from the ranks' common start to the last "
                 "rank's delivery)")
    lines.append(f"wall {t_end - t0:.1f} s: process start and imports {start_s:.1f} s, set-up (sources, references, writers, "
                 f"transport) {setup_s:.1f} s, streaming {stream_s:.2f} s, verification {verify_s:.2f} s, "
                 "the rest exit and scheduling")
    record = dict(args=vars(args), expert_nbytes=list(nb), backend=backend, ok=bool(all_ok), timing=timing,
                  steady_state={str(r): v for r, v in steady.items()},
                  rows=[dict(rank=r, **{k: v for k, v in row.items() if k not in ("start", "end")})
                        for r in range(tp) for row in results[r]["rows"]])
    return lines, "\n".join(table), record, all_ok


def stream_main(argv=None) -> int:
    """The streaming run (``--stream``)."""
    from fp8_layerwise.demo import expert_nbytes, parser

    p = parser("python tools/block_fp8_layerwise.py --stream", "Stream synthetic block-FP8 MoE layers between TP "
               "processes and verify every byte.", experts=32, layers=6, hidden=1024, intermediate=1024)
    p.add_argument("--warmup", type=int, default=1, help="layers left out of the steady-state figure")
    p.add_argument("--out", default=None, help="also write demo.md (table) and demo.json (all figures) here")
    args = p.parse_args(argv)
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    nb = expert_nbytes(p, args)
    print(f"fp8_layerwise demo: tp={args.tp} experts={args.experts} layers={args.layers} "
          f"H={args.hidden} I={args.intermediate} slots={args.slots} backend={args.backend}")
    print(f"  per-rank expert bytes [w13, w13_scale, w2, w2_scale] = {nb} ({sum(nb) / 1e6:.3f} MB), "
          f"per layer {args.experts * sum(nb) * args.tp / 1e6:.1f} MB over all ranks")
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="fp8lw_stream_") as tmp:
            results = run_ranks(_stream_rank, args.tp, vars(args), tmp, spawn_context().Barrier(args.tp),
                                timeout=600, grace_s=10)
    except RankFailure as exc:
        print(f"{exc}\ndemo FAILED", file=sys.stderr)
        return 1
    t_end = time.monotonic()
    lines, table, record, all_ok = _report(args, nb, results, t0, t_end)
    for line in lines:
        print("  " + line)
    if args.out:
        command = command_line("python tools/block_fp8_layerwise.py --stream", argv)
        written = write_results(args.out, "demo", record, "\n".join(["# fp8_layerwise demo", "", f"`{command}`", ""]
                                                                     + lines), quiet=True, run=run_record(command))
        print("  wrote " + ", ".join(reversed(written)))
    moved = record["timing"]["moved_bytes"]
    print(f"demo OK: every rank received byte-exact shards ({moved / 1e6:.1f} MB checked)" if all_ok
          else "demo FAILED: byte mismatch")
    return 0 if all_ok else 1


_NO_GPU = """no usable GPU here ({why}), so no prefill loop at full size.
On a GPU, `python tools/block_fp8_layerwise.py` runs the prefill loop: MoE layers of block-FP8 experts
in host memory; while layer L's expert GEMMs (FP8 -> bf16 dequantisation, batched matmuls) run on the
GPU, layer L+1's experts stream to every TP rank into the other of two GPU layer buffers. It reports
per layer the compute alone, the transfer alone and the loop's time, against the goals loop <= 1.05 x
sum of max(compute, transfer) and compute slowdown <= 5 %, and checks every weight byte and every
layer's output.
Here: the streaming run on the CPU backend, then the prefill loop at tiny sizes on the CPU backend
(CPU matmuls): its schedule, bytes and outputs are checked, its timings mean nothing."""


def no_gpu_reason() -> str:
    """Why the prefill loop cannot run on a GPU here ("" when it can)."""
    import torch

    import fp8_layerwise as F

    if not F.built_with_cuda():
        return "fp8_layerwise was built without CUDA"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "torch sees no CUDA device"
    return ""


def main(argv=None) -> int:
    """``--prefill`` / ``--stream`` pick the run; without either, the prefill loop where a GPU is
    usable, else the streaming run with the remaining arguments and then a tiny CPU prefill loop
    (writing into the same ``--out``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argparse.ArgumentParser(add_help=False)
    which = mode.add_mutually_exclusive_group()
    which.add_argument("--prefill", action="store_true")
    which.add_argument("--stream", action="store_true")
    picked, rest = mode.parse_known_args(argv)
    if picked.prefill:
        return prefill.main(rest)
    if picked.stream:
        return stream_main(rest)
    if any(a in ("-h", "--help") for a in rest):
        print(__doc__)
        return 0
    why = no_gpu_reason()
    if not why:
        return prefill.main(rest)
    print(_NO_GPU.format(why=why))
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--out", default=None)
    out = out.parse_known_args(rest)[0].out
    rc = stream_main(rest)
    print()
    rc_prefill = prefill.main(["--backend", "cpu"] + (["--out", out] if out else []))
    return rc or rc_prefill


if __name__ == "__main__":
    sys.exit(main())
