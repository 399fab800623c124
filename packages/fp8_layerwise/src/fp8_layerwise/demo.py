"""Runnable demo: stream synthetic DeepSeek-V3-shaped MoE layers between TP processes.

    python -m fp8_layerwise.demo [--tp 2] [--experts 32] [--layers 6] [--backend cpu|cuda|auto]
                                 [--hidden 1024] [--intermediate 1024] [--slots 4] [--threads 2]

It spawns ``--tp`` processes. Each builds a :class:`fp8_layerwise.Transport` (names exchanged
through a private temporary folder), rank 0 streams every layer with the native shard writer out
of whole-layer block-FP8 source tensors (w13 [E, 2I, H], w2 [E, H, I], fp32 128x128 scales), and
every rank checks its delivered shards byte for byte against a plain-torch slice of the same
sources. Consecutive layers alternate between two different source sets, so a stale expert
would be caught. The default shapes are DeepSeek-V3's layout scaled down (hidden 1024 instead of
7168) so that it runs in about 20 s on a 2-core CPU machine with the CPU backend; pass
``--hidden 7168 --intermediate 2048 --backend cuda`` for the real per-expert sizes on GPUs.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time


def _rank_main(rank: int, args: argparse.Namespace, tmp: str, q) -> None:
    try:
        import torch

        import fp8_layerwise as F

        tp, E = args.tp, args.experts
        nb = F.block_fp8_expert_nbytes(args.hidden, args.intermediate, tp)
        # Two source sets, generated identically on every rank (rank 0 writes, all verify).
        sets = [F.make_block_fp8_sources(E, args.hidden, args.intermediate,
                                         generator=torch.Generator().manual_seed(1000 + i)) for i in range(2)]
        writers = [F.make_shard_writer(s, tp, threads=args.threads) for s in sets] if rank == 0 else None
        ex = F.FileExchange(os.path.join(tmp, "names"), rank, tp)
        rows = []
        with F.Transport(rank, tp, E, nb, num_slots=args.slots, backend=args.backend, exchange=ex,
                         timeout_ms=60000) as t:
            for layer in range(args.layers):
                epoch = layer + 1
                with t.layer(epoch, layer, E) as L:
                    if rank == 0:
                        L.run(writers[layer % 2])
                src = sets[layer % 2]
                ok = all(torch.equal(t.expert_view(k, e).cpu(), F.reference_shard(src, tp, rank, e)[k])
                         for e in range(E) for k in range(4))
                s = L.stats
                rows.append(dict(layer=layer, ok=ok, bytes=s.bytes, total_ms=s.total_ms, h2d_ms=s.h2d_ms,
                                 writer_ms=s.writer_ms, slot_wait_ms=s.slot_wait_ms, copies=s.copies))
            backend = t.backend
        q.put((rank, True, dict(rows=rows, backend=backend)))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        import traceback

        q.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (processes), 1..8")
    p.add_argument("--experts", type=int, default=32, help="experts per layer")
    p.add_argument("--layers", type=int, default=6, help="layers to stream")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size H (DeepSeek-V3: 7168)")
    p.add_argument("--intermediate", type=int, default=1024, help="MoE intermediate I (DeepSeek-V3: 2048)")
    p.add_argument("--slots", type=int, default=4, help="host slots per rank")
    p.add_argument("--threads", type=int, default=1, help="native writer threads")
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda"))
    args = p.parse_args(argv)
    import fp8_layerwise as F

    F.block_fp8_expert_nbytes(args.hidden, args.intermediate, args.tp)  # fail fast on bad shapes
    nb = F.block_fp8_expert_nbytes(args.hidden, args.intermediate, args.tp)
    print(f"fp8_layerwise demo: tp={args.tp} experts={args.experts} layers={args.layers} "
          f"H={args.hidden} I={args.intermediate} slots={args.slots} backend={args.backend}")
    print(f"  per-rank expert bytes [w13, w13_scale, w2, w2_scale] = {nb} ({sum(nb) / 1e6:.3f} MB), "
          f"per layer {args.experts * sum(nb) * args.tp / 1e6:.1f} MB over all ranks")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fp8lw_demo_") as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, args, tmp, q), daemon=True) for r in range(args.tp)]
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
    if failed or len(results) != args.tp:
        for r, msg in sorted(failed.items()):
            print(f"rank {r} FAILED: {msg}", file=sys.stderr)
        print("demo FAILED", file=sys.stderr)
        return 1
    print(f"  backend: {results[0]['backend']}")
    print(f"  {'layer':>5} {'rank':>4} {'MB':>8} {'total ms':>9} {'writer ms':>9} {'h2d ms':>8} "
          f"{'slot wait':>9} {'copies':>6} {'GB/s':>7}  bytes")
    all_ok = True
    for layer in range(args.layers):
        for r in range(args.tp):
            row = results[r]["rows"][layer]
            all_ok &= row["ok"] and row["bytes"] == args.experts * sum(nb)
            gbs = row["bytes"] / (row["total_ms"] * 1e6) if row["total_ms"] else float("nan")
            print(f"  {layer:>5} {r:>4} {row['bytes'] / 1e6:>8.2f} {row['total_ms']:>9.2f} {row['writer_ms']:>9.2f} "
                  f"{row['h2d_ms']:>8.2f} {row['slot_wait_ms']:>9.2f} {row['copies']:>6} {gbs:>7.2f}  "
                  f"{'exact' if row['ok'] else 'MISMATCH'}")
    moved = args.layers * args.tp * args.experts * sum(nb)
    print(f"  moved {moved / 1e6:.1f} MB in {args.layers} layers; wall {time.monotonic() - t0:.1f} s "
          f"(process start and source generation included)")
    print("demo OK: every rank received byte-exact shards" if all_ok else "demo FAILED: byte mismatch")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
