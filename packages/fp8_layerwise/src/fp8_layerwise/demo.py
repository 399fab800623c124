"""Runnable demo of fp8_layerwise: the prefill loop on a GPU, the streaming demo without one.

    python -m fp8_layerwise.demo                  # GPU usable: the prefill loop; else the streaming demo
    python -m fp8_layerwise.demo --prefill [...]  # the prefill loop (fp8_layerwise.prefill; --prefill --help)
    python -m fp8_layerwise.demo --stream [...]   # the streaming demo (below; --stream --help)

**The prefill loop** (:mod:`fp8_layerwise.prefill`): MoE layers whose block-FP8 experts live in
host memory; layer L+1's experts stream to every TP rank into one of two GPU layer buffers while
layer L's expert GEMMs run on the other; it reports compute alone, transfer alone and the loop's
time per layer against its goals, and checks every weight byte and every layer's output.

Without a usable GPU the plain command explains that, runs the streaming demo with the arguments
given, then the prefill loop on the CPU backend at tiny sizes (CPU matmuls on a worker thread), which
checks its schedule, bytes and outputs but whose timings mean nothing.

**The streaming demo**: stream synthetic DeepSeek-V3-shaped MoE layers between TP processes.

    python -m fp8_layerwise.demo --stream [--tp 2] [--experts 32] [--layers 6] [--warmup 1]
        [--backend cpu|cuda|auto] [--hidden 1024] [--intermediate 1024] [--slots 4] [--threads 1] [--out DIR]

It spawns ``--tp`` processes. Each builds a :class:`fp8_layerwise.Transport` (names exchanged
through a private temporary folder), rank 0 streams every layer with the native shard writer out
of whole-layer block-FP8 source tensors (w13 [E, 2I, H], w2 [E, H, I], fp32 128x128 scales), and
every rank checks its delivered shards byte for byte against a plain-torch slice of the same
sources. Consecutive layers alternate between two different source sets, so a stale expert
would be caught.

It prints one row per layer and rank, then each rank's steady-state throughput over the layers
after the ``--warmup`` ones (the first layer also pays the first-touch page faults of the shared
slots and of the destination buffers), and where the wall time went: process start and imports,
set-up (sources, references, writers, transport), streaming, verification. ``--out DIR`` also writes the table
(demo.md) and every figure (demo.json) there.

The default shapes are DeepSeek-V3's layout scaled down (hidden 1024 instead of 7168) so that it
runs in about 10 s on a 2-core CPU machine with the CPU backend; pass
``--hidden 7168 --intermediate 2048 --backend cuda`` for the real per-expert sizes on GPUs.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time


def _rank_main(rank: int, args: argparse.Namespace, tmp: str, q, barrier) -> None:
    # time.monotonic is CLOCK_MONOTONIC on Linux: one clock for every process of the machine.
    times = dict(enter=time.monotonic())
    try:
        import torch

        import fp8_layerwise as F

        times["imported"] = time.monotonic()
        tp, E = args.tp, args.experts
        nb = F.block_fp8_expert_nbytes(args.hidden, args.intermediate, tp)
        # Two source sets, generated identically on every rank (rank 0 writes, all verify).
        sets = [F.make_block_fp8_sources(E, args.hidden, args.intermediate,
                                         generator=torch.Generator().manual_seed(1000 + i)) for i in range(2)]
        writers = [F.make_shard_writer(s, tp, threads=args.threads) for s in sets] if rank == 0 else None
        # What this rank must receive, cut by plain torch slicing (independent of the native writer).
        expected = [[F.reference_shard(s, tp, rank, e) for e in range(E)] for s in sets]
        ex = F.FileExchange(os.path.join(tmp, "names"), rank, tp)
        rows = []
        with F.Transport(rank, tp, E, nb, num_slots=args.slots, backend=args.backend, exchange=ex,
                         timeout_ms=60000) as t:
            times["ready"] = time.monotonic()
            verify_s = 0.0
            for layer in range(args.layers):
                epoch = layer + 1
                # Every rank joins together, so that no layer's time includes a peer still verifying
                # the previous one.
                barrier.wait(timeout=120)
                start = time.monotonic()
                with t.layer(epoch, layer, E) as L:
                    if rank == 0:
                        L.run(writers[layer % 2])
                end = time.monotonic()
                ref = expected[layer % 2]
                ok = all(torch.equal(t.expert_view(k, e).cpu(), ref[e][k]) for e in range(E) for k in range(4))
                verify_s += time.monotonic() - end
                s = L.stats
                rows.append(dict(layer=layer, ok=ok, bytes=s.bytes, total_ms=s.total_ms, h2d_ms=s.h2d_ms,
                                 writer_ms=s.writer_ms, slot_wait_ms=s.slot_wait_ms, copies=s.copies,
                                 start=start, end=end))
            backend = t.backend
        times.update(done=time.monotonic(), verify_s=verify_s)
        q.put((rank, True, dict(rows=rows, backend=backend, times=times)))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        import traceback

        q.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _gbs(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e6) if ms > 0 else float("nan")


def _report(args, nb, results, t0: float, t_end: float):
    """The printed lines and the JSON record of a finished run (``results[rank]`` from _rank_main)."""
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
    """The streaming demo (``--stream``)."""
    p = argparse.ArgumentParser(prog="python -m fp8_layerwise.demo --stream",
                                description="Stream synthetic block-FP8 MoE layers between TP processes and "
                                            "verify every byte.")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (processes), 1..8")
    p.add_argument("--experts", type=int, default=32, help="experts per layer")
    p.add_argument("--layers", type=int, default=6, help="layers to stream")
    p.add_argument("--warmup", type=int, default=1, help="layers left out of the steady-state figure")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size H (DeepSeek-V3: 7168)")
    p.add_argument("--intermediate", type=int, default=1024, help="MoE intermediate I (DeepSeek-V3: 2048)")
    p.add_argument("--slots", type=int, default=4, help="host slots per rank")
    p.add_argument("--threads", type=int, default=1, help="native writer threads")
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", default=None, help="also write demo.md (table) and demo.json (all figures) here")
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error(f"--layers must be >= 1, got {args.layers}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    import fp8_layerwise as F

    nb = F.block_fp8_expert_nbytes(args.hidden, args.intermediate, args.tp)  # fails fast on bad shapes
    print(f"fp8_layerwise demo: tp={args.tp} experts={args.experts} layers={args.layers} "
          f"H={args.hidden} I={args.intermediate} slots={args.slots} backend={args.backend}")
    print(f"  per-rank expert bytes [w13, w13_scale, w2, w2_scale] = {nb} ({sum(nb) / 1e6:.3f} MB), "
          f"per layer {args.experts * sum(nb) * args.tp / 1e6:.1f} MB over all ranks")
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(args.tp)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fp8lw_demo_") as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, args, tmp, q, barrier), daemon=True) for r in range(args.tp)]
        for pr in procs:
            pr.start()
        results, failed = {}, {}
        deadline = time.monotonic() + 600
        while len(results) + len(failed) < args.tp and time.monotonic() < deadline:
            try:
                rank, ok, payload = q.get(timeout=1.0)
            except Exception:  # noqa: BLE001 - queue.Empty
                if any(pr.exitcode not in (None, 0) for pr in procs):
                    break
                continue
            (results if ok else failed)[rank] = payload
        for pr in procs:
            pr.join(timeout=10)
            if pr.is_alive():
                pr.kill()
    t_end = time.monotonic()
    if failed or len(results) != args.tp:
        for r, msg in sorted(failed.items()):
            print(f"rank {r} FAILED: {msg}", file=sys.stderr)
        missing = sorted(set(range(args.tp)) - set(results) - set(failed))
        if missing:
            print(f"ranks {missing} reported nothing (died or timed out)", file=sys.stderr)
        print("demo FAILED", file=sys.stderr)
        return 1
    lines, table, record, all_ok = _report(args, nb, results, t0, t_end)
    for line in lines:
        print("  " + line)
    if args.out:
        out = os.path.abspath(args.out)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "demo.md"), "w") as f:
            command = " ".join(["python -m fp8_layerwise.demo --stream"]
                               + list(sys.argv[1:] if argv is None else argv))
            f.write("\n".join(["# fp8_layerwise demo", "", f"`{command}`", ""] + lines) + "\n")
        with open(os.path.join(out, "demo.json"), "w") as f:
            json.dump(record, f, indent=1)
        print(f"  wrote {os.path.join(out, 'demo.md')}, {os.path.join(out, 'demo.json')}")
    moved = record["timing"]["moved_bytes"]
    print(f"demo OK: every rank received byte-exact shards ({moved / 1e6:.1f} MB checked)" if all_ok
          else "demo FAILED: byte mismatch")
    return 0 if all_ok else 1


_NO_GPU = """no usable GPU here ({why}), so no prefill loop at full size.
On a GPU, `python -m fp8_layerwise.demo` runs the prefill loop (fp8_layerwise.prefill): MoE layers of
block-FP8 experts in host memory; while layer L's expert GEMMs (FP8 -> bf16 dequantisation, batched
matmuls) run on the GPU, layer L+1's experts stream to every TP rank into the other of two GPU layer
buffers. It reports per layer the compute alone, the transfer alone and the loop's time, against the
goals loop <= 1.05 x sum of max(compute, transfer) and compute slowdown <= 5 %, and checks every
weight byte and every layer's output.
Here: the streaming demo on the CPU backend, then the prefill loop at tiny sizes on the CPU backend
(CPU matmuls): its schedule, bytes and outputs are checked, its timings mean nothing."""


def _no_gpu_reason() -> str:
    import torch

    from . import _C

    if not _C.built_with_cuda():
        return "fp8_layerwise was built without CUDA"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "torch sees no CUDA device"
    return ""


def main(argv=None) -> int:
    """``--prefill`` / ``--stream`` pick the mode; without either, the prefill loop where a GPU is
    usable, else the streaming demo with the remaining arguments and then a tiny CPU prefill loop
    (writing into the same ``--out``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argparse.ArgumentParser(add_help=False)
    which = mode.add_mutually_exclusive_group()
    which.add_argument("--prefill", action="store_true")
    which.add_argument("--stream", action="store_true")
    picked, rest = mode.parse_known_args(argv)
    from . import prefill

    if picked.prefill:
        return prefill.main(rest)
    if picked.stream:
        return stream_main(rest)
    if any(a in ("-h", "--help") for a in rest):
        print(__doc__)
        return 0
    why = _no_gpu_reason()
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
