"""A short correctness demo of fp8_layerwise: streamed expert shards, checked byte for byte.

    python -m fp8_layerwise.demo [--tp 2] [--experts 4] [--layers 2] [--hidden 256] [--intermediate 256]
                                 [--slots 4] [--threads 1] [--backend auto|cpu|cuda]

It spawns ``--tp`` processes. Each builds a :class:`fp8_layerwise.Transport` (names exchanged
through a private temporary folder); rank 0 streams every layer with the native shard writer out of
whole-layer block-FP8 source tensors (w13 [E, 2I, H], w2 [E, H, I], fp32 128x128 scales),
alternating between two source sets so that a stale expert would be caught, and every rank compares
its delivered shards byte for byte with a plain-torch slice of the same sources
(:func:`fp8_layerwise.reference_shard`). It prints one line per rank and ``demo OK`` (exit status 0),
or the failing rank's error (exit status 1), in seconds on a CPU (the CPU backend where no GPU is
usable).

Throughput tables and the prefill loop are in the repository's tools: ``tools/block_fp8_layerwise.py``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import List, Optional, Sequence


def stream_layers(rank: int, cfg: dict, tmp: str, barrier=None) -> dict:
    """Stream ``cfg["layers"]`` layers to this rank and check every delivered byte.

    Arguments:
        rank: this TP rank (rank 0 writes the layers).
        cfg: ``tp``, ``experts``, ``layers``, ``hidden``, ``intermediate``, ``slots``, ``threads``,
            ``backend`` (as the command line's options).
        tmp: a folder shared by the ranks (the transport's name exchange).
        barrier: a multiprocessing ``Barrier`` of the ranks, waited on before each layer (so that no
            layer's time includes a peer still checking the previous one), or None.

    Returns:
        ``dict(rows, backend, times)``: per layer ``ok`` (every byte equal to the reference) and the
        layer's :class:`~fp8_layerwise.LayerStats` fields with its start and end (``time.monotonic``,
        one clock for every process of the machine); ``times``: ``imported``, ``ready`` and ``done``
        instants and ``verify_s``, the time spent checking.
    """
    import torch

    import fp8_layerwise as F

    times = dict(imported=time.monotonic())
    tp, E = cfg["tp"], cfg["experts"]
    nb = F.block_fp8_expert_nbytes(cfg["hidden"], cfg["intermediate"], tp)
    # Two source sets, generated identically on every rank (rank 0 writes, all verify).
    sets = [F.make_block_fp8_sources(E, cfg["hidden"], cfg["intermediate"],
                                     generator=torch.Generator().manual_seed(1000 + i)) for i in range(2)]
    writers = [F.make_shard_writer(s, tp, threads=cfg["threads"]) for s in sets] if rank == 0 else None
    # What this rank must receive, cut by plain torch slicing (independent of the native writer).
    expected = [[F.reference_shard(s, tp, rank, e) for e in range(E)] for s in sets]
    ex = F.FileExchange(os.path.join(tmp, "names"), rank, tp)
    rows = []
    with F.Transport(rank, tp, E, nb, num_slots=cfg["slots"], backend=cfg["backend"], exchange=ex,
                     timeout_ms=60000) as t:
        times["ready"] = time.monotonic()
        verify_s = 0.0
        for layer in range(cfg["layers"]):
            if barrier is not None:
                barrier.wait(timeout=120)
            start = time.monotonic()
            with t.layer(layer + 1, layer, E) as L:
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
    return dict(rows=rows, backend=backend, times=times)


def _rank(rank: int, cfg: dict, tmp: str) -> None:
    res = stream_layers(rank, cfg, tmp)
    bad = [r["layer"] for r in res["rows"] if not r["ok"]]
    nbytes = sum(r["bytes"] for r in res["rows"])
    if bad:
        raise RuntimeError(f"rank {rank}: the delivered bytes of layer(s) {bad} differ from the reference shards")
    # One write per line: the ranks print at once, and a separate newline could interleave.
    print(f"  rank {rank} ({res['backend']} backend): {cfg['layers']} layers x {cfg['experts']} experts, "
          f"{nbytes / 1e6:.2f} MB received, every byte equal to the reference shards\n", end="", flush=True)


def parser(prog: str = "python -m fp8_layerwise.demo", description: Optional[str] = None,
           **defaults) -> argparse.ArgumentParser:
    """The demo's options (``defaults`` override their defaults; the repository's streaming run in
    tools/ takes the same ones)."""
    p = argparse.ArgumentParser(prog=prog, description=description or __doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (processes), 1..8")
    p.add_argument("--experts", type=int, default=4, help="experts per layer")
    p.add_argument("--layers", type=int, default=2, help="layers to stream")
    p.add_argument("--hidden", type=int, default=256, help="hidden size H, a multiple of 128")
    p.add_argument("--intermediate", type=int, default=256, help="MoE intermediate I, a multiple of 128 x tp")
    p.add_argument("--slots", type=int, default=4, help="host slots per rank")
    p.add_argument("--threads", type=int, default=1, help="native writer threads")
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda"))
    p.set_defaults(**defaults)
    return p


def expert_nbytes(p: argparse.ArgumentParser, args: argparse.Namespace) -> List[int]:
    """Per-rank bytes of one expert for ``args``' shapes; a bad option ends the program through
    ``p.error`` (exit status 2) before anything is launched."""
    import fp8_layerwise as F

    for name in ("tp", "experts", "layers", "slots", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.tp > F.MAX_TP:
        p.error(f"--tp must be at most {F.MAX_TP}, got {args.tp}")
    try:
        return F.block_fp8_expert_nbytes(args.hidden, args.intermediate, args.tp)
    except ValueError as e:
        p.error(f"--hidden / --intermediate / --tp: {e}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse, check the shapes, run the ranks; 0 when every byte matched (2: bad usage; a failed rank
    raises, with its traceback)."""
    p = parser()
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    nb = expert_nbytes(p, args)
    print(f"fp8_layerwise demo: tp={args.tp}, {args.layers} layers x {args.experts} experts "
          f"(H={args.hidden}, I={args.intermediate}, {sum(nb) / 1e6:.3f} MB per expert and rank), "
          f"backend={args.backend}", flush=True)
    cfg = dict(vars(args))
    with tempfile.TemporaryDirectory(prefix="fp8lw_demo_") as tmp:
        # A failing rank raises here (ProcessRaisedException, with its traceback: exit status 1).
        mp.spawn(_rank, args=(cfg, tmp), nprocs=args.tp)
    print("demo OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
