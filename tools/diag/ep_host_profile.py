#!/usr/bin/env python3
"""Where elastic_ep's end-to-end time goes on the host, at EP 1 (one GPU, one process).

    python tools/diag/ep_host_profile.py [--iters 50] [--tokens 4096]

For BF16 dispatch (CPU sync) and combine at the DeepSeek-V3 shape it prints
* e2e: CUDA events around the call on an idle GPU (what tools/bench_elastic_ep.py reports),
* wall: host time of the call (perf_counter), and the device time of its kernels is in the bench,
* the host time spent inside each runtime entry point (launches, the count wait) per call,
* the top functions by own time under cProfile (relative weights only: cProfile adds overhead).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from bench_elastic_ep import _inputs  # noqa: E402


class _Timed:
    """Proxy of the native runtime object that adds up the host time spent in each method."""

    def __init__(self, inner, acc):
        self._inner, self._acc = inner, acc

    def __getattr__(self, n):
        f = getattr(self._inner, n)
        if not callable(f):
            return f

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self._acc[n] = self._acc.get(n, 0.0) + time.perf_counter() - t0

        return timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    import elastic_ep as ep

    torch.cuda.set_device(0)
    rdzv = "file://" + os.path.join(tempfile.mkdtemp(), "rdzv")
    dist.init_process_group("nccl", init_method=rdzv, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    T, H, K, E = args.tokens, 7168, 8, 256
    inp = _inputs(0, T, H, K, E)
    buf = ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=T, hidden=H, num_topk=K,
                           use_fp8_dispatch=True, backend="native", explicitly_destroy=True)
    disp = lambda: buf.dispatch(inp["xb"], topk_idx=inp["topk"], topk_weights=inp["w"], num_experts=E)  # noqa: E731
    recv, _, rw, handle, _ = disp()
    comb = lambda: buf.combine(recv, handle, topk_weights=rw)  # noqa: E731
    low = buf.runtime
    acc: dict = {}
    low._rt = _Timed(low._rt, acc)
    for name, fn in (("dispatch_bf16", disp), ("combine_bf16", comb)):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        acc.clear()
        e2e, wall = [], []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            t0 = time.perf_counter()
            fn()
            wall.append(time.perf_counter() - t0)
            e.record()
            torch.cuda.synchronize()
            e2e.append(s.elapsed_time(e) * 1e3)
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        print(f"\n== {name}: e2e median {med(e2e):.1f} us, host wall median {med(wall) * 1e6:.1f} us")
        for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
            print(f"   in runtime.{k}: {v / args.iters * 1e6:.1f} us/call")
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(args.iters):
            fn()
            torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
        print("\n".join(s.getvalue().splitlines()[:40]))
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
