#!/usr/bin/env python3
"""How fast fp8_layerwise's native shard writer fills host slots, without any GPU.

    python tools/diag/writer_speed.py [--threads 1,4,8,12] [--seconds 1.0] [--hidden 7168 --intermediate 2048]

For DeepSeek-V3 block-FP8 experts cut as TP1 (44 MB per expert and rank), and as TP4- and
TP8-sized shards with one and with two ranks (the two-rank w2 cut is strided), it times
``ShardWriter.write`` per expert into page-aligned destination buffers and prints GB/s written
and microseconds per expert, next to a plain parallel copy of the same byte count (torch
``copy_`` of one contiguous block, which uses all intra-op threads) measured in the same run.
If GB/s falls with the shard size at a fixed thread count, a fixed cost per expert (the pool's
wake-up and join) matters against the copy itself.
"""
from __future__ import annotations

import argparse
import time

import torch

import fp8_layerwise as F


def _rate(fn, nbytes: int, seconds: float):
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    dt = time.perf_counter() - t0
    return nbytes * n / dt / 1e9, dt / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,4,8,12")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=2048, help="a multiple of 1024 (TP8-sized cuts)")
    ap.add_argument("--cache-hints", default="none",
                    help="comma-separated ShardWriter cache hints to time (none, demote, writeback, flush)")
    args = ap.parse_args()
    H, I, E = args.hidden, args.intermediate, 4
    print(f"{torch.get_num_threads()} torch intra-op threads")
    hints = [h for h in args.cache_hints.split(",") if h]
    for h in hints:
        if not F._C.cache_hint_supported(h):
            print(f"cache hint {h}: not supported by this CPU, skipped")
    hints = [h for h in hints if F._C.cache_hint_supported(h)]
    print("| cut | ranks | MB per expert (all ranks) | writer threads | cache hint | writer GB/s | us per expert | "
          "plain copy GB/s (same bytes) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, tp, shard_tp in (("DSV3 TP1", 1, 1), ("TP4-sized", 1, 4), ("TP4-sized", 2, 4),
                               ("TP8-sized", 1, 8), ("TP8-sized", 2, 8)):
        I_eff = I * tp // shard_tp
        src = F.make_block_fp8_sources(E, H, I_eff, generator=torch.Generator().manual_seed(0))
        nb = F.block_fp8_expert_nbytes(H, I_eff, tp)
        dst = [[torch.empty(nb[k] + 4096, dtype=torch.uint8) for _ in range(tp)] for k in range(4)]
        ptrs = [[(t.data_ptr() + 4095) // 4096 * 4096 for t in dst[k]] for k in range(4)]
        total = sum(nb) * tp
        a = torch.full((total,), 3, dtype=torch.uint8)  # touched: untouched pages read as the zero page
        b = torch.zeros(total, dtype=torch.uint8)
        for k in range(4):
            for t in dst[k]:
                t.zero_()
        plain, _ = _rate(lambda: b.copy_(a), total, args.seconds)
        for th in (int(x) for x in args.threads.split(",")):
            for hint in hints:
                w = F.make_shard_writer(src, tp, threads=th, cache_hint=hint)
                e = [0]

                def one():
                    w.write(e[0] % E, ptrs)
                    e[0] += 1

                gbs, us = _rate(one, total, args.seconds)
                # 3 significant digits: a loaded machine may copy a small shard at well under 0.1 GB/s.
                print(f"| {name} | {tp} | {total / 1e6:.2f} | {th} | {hint} | {gbs:.3g} | {us:.0f} | {plain:.3g} |",
                      flush=True)


if __name__ == "__main__":
    main()
