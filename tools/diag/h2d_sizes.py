#!/usr/bin/env python3
"""Host-to-device copy rate against copy size, on one or two CUDA streams.

    python tools/diag/h2d_sizes.py [--total-mb 512] [--device 0]

Why: fp8_layerwise moves a TP8-sized expert (5.5 MB) as 4 copies, two of them under 1 KB, and
reached ~88 % of the 256 MB pinned peak where DeepSeek-V3 TP1 experts (44 MB) reach 98 %. This
measures what the copy engine gives per copy size from pinned memory, back to back on one stream
(what the transport does) and alternating over two streams (its copy_streams=2), so the transport's
figures can be read against the engine's own curve. Prints one line per size; torch only.
"""
from __future__ import annotations

import argparse

import torch

SIZES = [1 << 10, 16 << 10, 256 << 10, 1 << 20, 1835008, 3670016, 8 << 20, 16 << 20, 64 << 20, 256 << 20]


def rate(src: torch.Tensor, dst: torch.Tensor, size: int, nstreams: int, reps: int = 3) -> float:
    """GB/s of n back-to-back copies of `size` bytes, spread round-robin over `nstreams` streams.

    The copies are captured in a CUDA graph and replayed, so the copy engine, not Python's launch
    rate, is what small sizes measure."""
    # At most 256 copies per measurement: at small sizes the count, not the bytes, is measured.
    n = max(1, min(src.numel() // size, 256))
    capture = torch.cuda.Stream()
    side = [torch.cuda.Stream() for _ in range(nstreams - 1)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        fork = torch.cuda.Event()
        fork.record(capture)
        for s in side:
            s.wait_event(fork)
        streams = [capture] + side
        for i in range(n):
            with torch.cuda.stream(streams[i % nstreams]):
                dst[i * size:(i + 1) * size].copy_(src[i * size:(i + 1) * size], non_blocking=True)
        for s in side:
            join = torch.cuda.Event()
            join.record(s)
            capture.wait_event(join)
    graph.replay()  # warm-up
    best = 0.0
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        best = max(best, n * size / (start.elapsed_time(stop) * 1e6))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--total-mb", type=int, default=512)
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    torch.cuda.set_device(args.device)
    total = args.total_mb << 20
    src = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    print(f"H2D from pinned memory, min({args.total_mb} MiB, 256 copies) per measurement as one CUDA graph, "
          f"best of 3, {torch.cuda.get_device_name()}")
    print(f"{'copy size':>12} {'1 stream GB/s':>14} {'2 streams GB/s':>15}")
    for size in SIZES:
        if size > total:
            continue
        print(f"{size:>12} {rate(src, dst, size, 1):>14.1f} {rate(src, dst, size, 2):>15.1f}")


if __name__ == "__main__":
    main()
