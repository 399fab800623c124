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


def rate(src: torch.Tensor, dst: torch.Tensor, size: int, streams: list, reps: int = 3) -> float:
    # At most 256 copies per measurement: Python issues them, and at small sizes the count, not
    # the bytes, is what is measured.
    n = max(1, min(src.numel() // size, 256))
    best = 0.0
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        main = streams[0]
        start.record(main)
        for s in streams[1:]:
            s.wait_event(start)
        for i in range(n):
            s = streams[i % len(streams)]
            with torch.cuda.stream(s):
                dst[i * size:(i + 1) * size].copy_(src[i * size:(i + 1) * size], non_blocking=True)
        for s in streams[1:]:
            ev = torch.cuda.Event()
            ev.record(s)
            main.wait_event(ev)
        stop.record(main)
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
    one = [torch.cuda.Stream()]
    two = [one[0], torch.cuda.Stream()]
    rate(src, dst, 256 << 20, one)  # warm-up
    print(f"H2D from pinned memory, min({args.total_mb} MiB, 256 copies) per measurement, best of 3, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'copy size':>12} {'1 stream GB/s':>14} {'2 streams GB/s':>15}")
    for size in SIZES:
        if size > total:
            continue
        print(f"{size:>12} {rate(src, dst, size, one):>14.1f} {rate(src, dst, size, two):>15.1f}")


if __name__ == "__main__":
    main()
