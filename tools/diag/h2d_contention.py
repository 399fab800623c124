#!/usr/bin/env python3
"""Does host memory traffic slow the copy engine's reads of pinned memory, and which traffic?

    python tools/diag/h2d_contention.py [--mb 5.5,44] [--threads 4,8,12] [--seconds 0.4]

Why: fp8_layerwise's copies run at 92-99 % of the pinned peak alone but at 78-84 % for TP8-sized
shards (5.5 MB per expert) while the writer fills the next slots (BENCHMARKS.md, runs 9-10). Two
explanations need different fixes:
  * any host copy traffic competes with the DMA for DRAM: then only moving fewer bytes through
    host memory helps (no writer copy at all, i.e. the DMA reading the source itself);
  * the DMA reading lines the CPU just wrote (dirty in its caches) is what costs: then where and
    when the writer writes matters (slot distance, cache flushes, streaming stores).
This times back-to-back host-to-device copies of S bytes rotating over 4 pinned slots while a
background thread runs torch ``copy_`` with N intra-op threads, in five settings:
  idle            nothing else runs;
  dram            copies between two 1 GiB buffers that never touch the slots;
  cache           copies between two 8 MiB buffers (L3-resident: CPU busy, little DRAM traffic);
  slots<-dram     copies from a 1 GiB buffer into the pinned slots themselves (the writer's pattern);
  slots<-cache    copies from an 8 MiB buffer into the slots.
Prints GB/s of the H2D copies and of the background copy for each. torch only.
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import torch


def h2d_rate(slots: list[torch.Tensor], dst: torch.Tensor, seconds: float) -> float:
    stream = torch.cuda.Stream()
    nbytes = slots[0].numel()
    with torch.cuda.stream(stream):
        for i in range(8):  # warm-up
            dst.copy_(slots[i % len(slots)], non_blocking=True)
        stream.synchronize()
        t_end = time.perf_counter() + seconds
        total, ms = 0, 0.0
        while time.perf_counter() < t_end:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            n = 64
            for i in range(n):
                dst.copy_(slots[i % len(slots)], non_blocking=True)
            stop.record(stream)
            stop.synchronize()
            ms += start.elapsed_time(stop)
            total += n * nbytes
    return total / (ms * 1e-3) / 1e9


class Background:
    """Loops dst[i].copy_(src[i]) on N torch intra-op threads until stopped; counts bytes."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], threads: int):
        self.pairs, self.threads = pairs, threads
        self.stop, self.bytes, self.seconds = False, 0, 0.0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        torch.set_num_threads(self.threads)
        t0, i = time.perf_counter(), 0
        while not self.stop:
            d, s = self.pairs[i % len(self.pairs)]
            d.copy_(s)
            self.bytes += d.numel()
            i += 1
        self.seconds = time.perf_counter() - t0

    def __enter__(self):
        self.thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()

    def rate(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", default="5.5,44")
    ap.add_argument("--threads", default="4,8,12")
    ap.add_argument("--seconds", type=float, default=0.4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    big = 1 << 30
    a = torch.full((big,), 3, dtype=torch.uint8)
    b = torch.full((big,), 5, dtype=torch.uint8)
    ca = torch.full((8 << 20,), 3, dtype=torch.uint8)
    cb = torch.full((8 << 20,), 5, dtype=torch.uint8)
    rows = []
    print("| MB | setting | threads | H2D GB/s | background GB/s |")
    print("|---|---|---|---|---|")
    for mb in (float(x) for x in args.mb.split(",")):
        s = int(mb * 1e6) // 4096 * 4096
        slots = [torch.full((s,), 7, dtype=torch.uint8).pin_memory() for _ in range(4)]
        dst = torch.empty(s, dtype=torch.uint8, device="cuda")
        n_dram = big // s
        settings = {
            "dram": [(b[i * s:(i + 1) * s], a[i * s:(i + 1) * s]) for i in range(n_dram)],
            "cache": [(cb[:min(s, cb.numel())], ca[:min(s, ca.numel())])],
            "slots<-dram": [(slots[(i + 2) % 4], a[i * s:(i + 1) * s]) for i in range(n_dram)],
            "slots<-cache": [(slots[(i + 2) % 4][:min(s, ca.numel())], ca[:min(s, ca.numel())]) for i in range(4)],
        }
        idle = h2d_rate(slots, dst, args.seconds)
        rows.append({"mb": mb, "setting": "idle", "threads": 0, "h2d": idle, "bg": 0.0})
        print(f"| {mb} | idle | 0 | {idle:.1f} | - |", flush=True)
        for th in (int(x) for x in args.threads.split(",")):
            for name, pairs in settings.items():
                with Background(pairs, th) as bg:
                    r = h2d_rate(slots, dst, args.seconds)
                rows.append({"mb": mb, "setting": name, "threads": th, "h2d": r, "bg": bg.rate()})
                print(f"| {mb} | {name} | {th} | {r:.1f} | {bg.rate():.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
