#!/usr/bin/env python3
"""Host cost of elastic_ep's Python layers alone, on any machine (no GPU, no NCCL).

    python tools/diag/ep_python_overhead.py [--iters 2000] [--tokens 4096]

``ElasticBuffer`` (validation into typed arguments) and the native runtime (allocations, plans, the real
``_C`` parameter blocks with the call's pointers set on them, handle and event objects) run on CPU
tensors against a stub ``_C.Runtime`` whose launches return at once, so what is timed is exactly the
Python between the user's call and the native launches. The stub answers the CPU sync with the
DeepSeek-V3 counts of EP 1 (every token local). Prints microseconds
per call (median over --iters) for a CPU-synced BF16 dispatch and a combine. A relative measure for
changes to the Python path (filling the parameter blocks is included, the launch calls are not; a GPU
host's CPU may be slower): tools/diag/ep_host_profile.py measures the real calls on a GPU.
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch


class _StubRuntime:
    """Answers every call of the native runtime (``_C.Runtime``) instantly."""

    def __init__(self, T: int, L: int) -> None:
        self.T, self.L = T, L
        self.num_device_sms = 132
        self.broken = False

    def pending_health(self) -> int:
        return 0

    def dispatch(self, params, stream, wait_stream=-1) -> None:
        pass

    def wait_dispatch_counts(self, L):
        per = [self.T * 8 // L] * L
        return SimpleNamespace(status=0, num_recv_tokens=self.T, num_expanded_tokens=sum(per),
                               num_recv_tokens_per_expert=per, ranks_ready=1, experts_ready=L)

    def dispatch_epilogue(self, params, stream, join_stream=-1) -> None:
        pass

    def combine(self, params, stream, wait_event=0, wait_stream=-1, join_stream=-1) -> None:
        pass


def make_buffer(T: int, E: int):
    """An ElasticBuffer at EP 1 on the native runtime, both made without CUDA around the stub."""
    from elastic_ep import _domains, _env, _native_runtime
    from elastic_ep import buffer as fe

    low = object.__new__(_native_runtime.NativeRuntime)
    low.rank_idx, low.num_ranks, low.num_buffer_bytes, low.buffer_id = 0, 1, 1 << 30, 1
    low.allow_multiple_reduction, low._destroyed, low.explicitly_destroy = True, False, True
    low.num_cpu_timeout_secs, low.device, low.num_device_sms = 100, 0, 132
    low._rt, low._comm_raw, low.comm_stream, low._refuse_bad_ids = _StubRuntime(T, E), 1, None, True
    low._configure(_env.Settings())  # the operations' settings and parameter-block caches
    _native_runtime._current_raw_stream = lambda device: 0  # no CUDA here
    buf = object.__new__(fe.ElasticBuffer)
    buf.backend, buf.device, buf._serial, buf.runtime = "native", torch.device("cpu"), 1, low
    buf.num_ranks, buf.rank, buf.num_bytes, buf.num_max_tokens_per_rank = 1, 0, 1 << 30, T
    buf.deterministic, buf.allow_multiple_reduction, buf.destroyed = False, True, False
    buf._settings, buf.num_allocated_qps, buf.prefer_overlap_with_compute = _env.Settings(), 17, True
    buf._device_sms = buf._max_sms = 132
    buf.domains = _domains.Domains(1, 0, 1, 1, 1, 1)
    buf._sms_cache, buf._routing_cache, buf._need_cache, buf._combine_need_cache = {}, {}, {}, {}
    buf._capturing = lambda: False
    return buf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168,
                    help="a small value (e.g. 128) leaves out the cost of large CPU allocations, which "
                         "the CUDA caching allocator does not have")
    ap.add_argument("--profile", action="store_true", help="also print the top functions under cProfile")
    args = ap.parse_args()
    T, H, K, E = args.tokens, args.hidden, 8, 256
    buf = make_buffer(T, E)
    x = torch.zeros((T, H), dtype=torch.bfloat16)
    topk = torch.randint(0, E, (T, K))
    w = torch.rand((T, K))

    def disp():
        return buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=E)

    recv, _, rw, handle, _ = disp()

    def comb():
        return buf.combine(recv, handle, topk_weights=rw)

    for name, fn in (("dispatch (CPU sync, bf16)", disp), ("combine", comb)):
        for _ in range(50):
            fn()
        ts = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        print(f"{name}: median {statistics.median(ts) * 1e6:.1f} us, p10 {sorted(ts)[len(ts) // 10] * 1e6:.1f} us "
              f"per call (Python layers + CPU allocations; no launches)")
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.iters):
                fn()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
