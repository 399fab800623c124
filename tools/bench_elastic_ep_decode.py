#!/usr/bin/env python3
"""Decode-size latency of elastic_ep: DeepEP V1's low-latency mode and DeepEP V2's API at 1-256 tokens
per rank, against the plain torch path, one process per GPU.

    python tools/bench_elastic_ep_decode.py --out DIR [--quick] [--tokens 1,8,32,64,128,256] [--experts 256,384]

Shape: hidden 7168, top-8 of 256 (DeepSeek-V3) or 384 (Kimi-K2) experts, uniform random routing,
``num_max_dispatch_tokens_per_rank`` = the token count. FP8 dispatch (E4M3 + f32 scales per 128 channels),
BF16 combine. Per (experts, tokens):

* ``ll``: ``Buffer(low_latency_mode=True)``'s ``low_latency_dispatch`` (use_fp8) and ``low_latency_combine``;
* ``v2``: ``ElasticBuffer.dispatch`` of FP8 rows without CPU sync (worst-case shapes) and its ``combine``;
* ``torch_ref``: tools/_ep_torch_ref.py, the lean plain-torch path a user writes (all_to_all_single with a
  host sync for the counts: it cannot be captured in a graph).

Times (microseconds per call, the median over the iterations):

* ``kernel_us``: device time of the call's elastic_ep kernels (CUDA profiler; the sum of their
  durations, which do not overlap here); ``send_us`` / ``recv_us`` (``ll``): the two kernels of the call
  made with ``return_recv_hook`` (DeepEP V1's "send/recv time");
* ``in_graph_us``: CUDA events around the replay of a CUDA graph holding ``IN_GRAPH`` calls in a row,
  divided by their number: a call inside a decode step's graph (every kernel and the gaps between them,
  no graph launch, no host work). The figure the decode targets are read against;
* ``graph_us``: CUDA events around the replay of a CUDA graph holding the one call (the above plus the
  graph's launch, which a step of many layers pays once);
* ``eager_us``: CUDA events around the Python call (host time included when the GPU waits for it).

Each iteration starts after a device synchronisation and a host barrier. Writes
``bench_elastic_ep_decode.{json,md,png}`` into --out.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from _env import apply as apply_env
from _launch import run_ranks
from _results import command_line, md_row, cell, out_dir, pyplot, run_record, save, write_results

H, K = 7168, 8
IN_GRAPH = 8  # calls per graph for in_graph_us
KERNELS = {"ll": ("low_latency_dispatch", "low_latency_combine"),
           "v2": (("dispatch_notify", "dispatch_impl", "dispatch_copy_epilogue"),
                  ("combine_impl", "combine_reduce_epilogue"))}


def _inputs(rank: int, T: int, E: int):
    g = torch.Generator().manual_seed(1000 * T + rank)
    x = torch.randn((T, H), generator=g)
    topk = torch.rand((T, E), generator=g).topk(K, dim=1).indices.to(torch.int64)
    w = torch.rand((T, K), generator=g)
    blocks = x.view(T, H // 128, 128)
    sf = blocks.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    x8 = (blocks / sf.unsqueeze(2)).view(T, H).to(torch.float8_e4m3fn)
    dev = torch.device("cuda", torch.cuda.current_device())
    return [t.to(dev) for t in (x.to(torch.bfloat16), x8, sf, topk, w)]


def _sync(group):
    torch.cuda.synchronize()
    dist.barrier(group=group)


def _events_us(fn, iters: int, group) -> float:
    times = []
    for _ in range(iters):
        _sync(group)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)


def _kernel_us(fn, iters: int, names, group) -> float:
    names = names if isinstance(names, tuple) else (names,)
    _sync(group)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total = sum(e.time_range.end - e.time_range.start for e in prof.events()
                if "CUDA" in str(getattr(e, "device_type", "")) and any(n in e.name for n in names))
    return total / iters


def _split_us(fn, iters: int, name: str, group):
    """DeepEP V1's "send/recv time": with the receive hook a call is two kernels, the send and the
    receive; their mean durations, from the profiler."""
    _sync(group)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    ks = sorted((e.time_range.start, e.time_range.end - e.time_range.start) for e in prof.events()
                if "CUDA" in str(getattr(e, "device_type", "")) and name in e.name)
    send, recv = [d for _, d in ks[0::2]], [d for _, d in ks[1::2]]
    return (sum(send) / len(send) if send else None), (sum(recv) / len(recv) if recv else None)


def _graph(fn, calls: int = 1):
    """A CUDA graph of ``calls`` calls of ``fn`` (warmed up on a side stream first, as torch requires),
    replayed once: what the call stored for later calls (a handle) is then real data, not the capture's
    unwritten memory."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def _measure(api: str, op: str, fn, graph, iters: int, group, graph_n=None) -> dict:
    names = KERNELS[api][0 if op == "dispatch" else 1] if api in KERNELS else ()
    r = dict(api=api, op=op, eager_us=_events_us(fn, iters, group))
    if graph is not None:
        r["graph_us"] = _events_us(graph.replay, iters, group)
        r["kernel_us"] = _kernel_us(graph.replay, iters, names, group)
    if graph_n is not None:
        r["in_graph_us"] = _events_us(graph_n.replay, iters, group) / IN_GRAPH
    return r


def _ll_cases(ep, group, buf, T: int, E: int, inp, iters: int) -> list:
    x, _, _, topk, w = inp
    R = dist.get_world_size(group)
    state = {}

    def dispatch():
        state["d"] = buf.low_latency_dispatch(x, topk, T, E, use_fp8=True)

    dispatch()
    y = torch.randn((E // R, R * T, H), device=x.device).to(torch.bfloat16)

    def combine():
        buf.low_latency_combine(y, topk, w, state["d"][2])

    combine()
    # One graph per call, replayed in the decode order (dispatch, combine); each replays the same half.
    gd, gc = _graph(dispatch), _graph(combine)
    gdn, gcn = _graph(dispatch, IN_GRAPH), _graph(combine, IN_GRAPH)
    out = [_measure("ll", "dispatch", dispatch, gd, iters, group, gdn),
           _measure("ll", "combine", combine, gc, iters, group, gcn)]
    del gdn, gcn

    def hooked(op):
        def run():
            d = buf.low_latency_dispatch(x, topk, T, E, use_fp8=True, return_recv_hook=True)
            d[4]()
            c = buf.low_latency_combine(y, topk, w, d[2], return_recv_hook=True)
            c[2]()
        return run
    for r, name in zip(out, KERNELS["ll"]):
        r["send_us"], r["recv_us"] = _split_us(hooked(r["op"]), iters, name, group)
    return out


def _v2_cases(ep, group, T: int, E: int, inp, iters: int) -> list:
    _, x8, sf, topk, w = inp
    nbytes = ep.ElasticBuffer.get_buffer_size_hint(group, T, H, K, True)
    buf = ep.ElasticBuffer(group, nbytes, num_max_tokens_per_rank=T, hidden=H, num_topk=K, use_fp8_dispatch=True,
                           explicitly_destroy=True)
    state = {}

    def dispatch():
        state["d"] = buf.dispatch((x8, sf), topk_idx=topk, topk_weights=w, num_experts=E, num_max_tokens_per_rank=T,
                                  do_cpu_sync=False)

    dispatch()
    rows = state["d"][0][0] if isinstance(state["d"][0], tuple) else state["d"][0]
    y = torch.randn(rows.shape, device=x8.device).to(torch.bfloat16)

    def combine():
        buf.combine(y, state["d"][3], topk_weights=state["d"][2])

    combine()
    gd, gc = _graph(dispatch), _graph(combine)
    gdn, gcn = _graph(dispatch, IN_GRAPH), _graph(combine, IN_GRAPH)
    out = [_measure("v2", "dispatch", dispatch, gd, iters, group, gdn),
           _measure("v2", "combine", combine, gc, iters, group, gcn)]
    del gd, gc, gdn, gcn
    torch.cuda.synchronize()
    buf.destroy()
    return out


def _ref_cases(group, E: int, inp, iters: int) -> list:
    from _ep_torch_ref import TorchRefEP

    x, x8, sf, topk, w = inp
    ref = TorchRefEP(group, E)
    rx, _, _, rw, rh = ref.dispatch(x, topk, w)
    y = rx.clone()
    return [_measure("torch_ref", "dispatch", lambda: ref.dispatch(x8, topk, w, sf=sf), None, iters, group),
            _measure("torch_ref", "combine", lambda: ref.combine(y, rh, rw), None, iters, group)]


def _worker(rank: int, world: int, rdzv: str, args) -> dict:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=rdzv, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    import elastic_ep as ep

    tokens = [int(t) for t in args.tokens.split(",")]
    experts = [int(e) for e in args.experts.split(",")]
    iters = 10 if args.quick else 50
    hint = max(ep.Buffer.get_low_latency_rdma_size_hint(max(tokens), H, world, e) for e in experts)
    buf = ep.Buffer(group, 0, hint, low_latency_mode=True, explicitly_destroy=True)
    out = {"rank": rank, "results": [], "errors": []}
    for E in experts:
        for T in tokens:
            inp = _inputs(rank, T, E)
            for api in args.apis.split(","):
                try:
                    if api == "ll":
                        rows = _ll_cases(ep, group, buf, T, E, inp, iters)
                    elif api == "v2":
                        rows = _v2_cases(ep, group, T, E, inp, iters)
                    else:
                        rows = _ref_cases(group, E, inp, iters)
                except Exception as e:  # noqa: BLE001 - report and keep measuring the others
                    import traceback

                    traceback.print_exc()
                    out["errors"].append(f"{api} E={E} T={T}: {type(e).__name__}: {e}")
                    continue
                for r in rows:
                    out["results"].append(dict(r, experts=E, tokens=T))
    torch.cuda.synchronize()
    buf.destroy()
    dist.destroy_process_group()
    return out


def _table(rows: list, meta: dict) -> str:
    lines = [f"Decode latency, {meta['gpus']} x {meta['gpu_name']}, hidden {H}, top-{K}, FP8 dispatch / BF16 combine, "
             f"us per call (median); {meta['date']}, {meta['git']}", "",
             md_row(["experts", "tokens/rank", "api", "op", "kernel", "hook: send + recv kernels",
                     f"in graph ({IN_GRAPH} calls)", "graph of one call", "eager"]),
             md_row(["---:", "---:", "---", "---", "---:", "---:", "---:", "---:", "---:"])]
    for r in rows:
        split = f"{cell(r['send_us'])} + {cell(r['recv_us'])}" if r.get("send_us") is not None else "-"
        lines.append(md_row([r["experts"], r["tokens"], r["api"], r["op"], cell(r.get("kernel_us")), split,
                             cell(r.get("in_graph_us")), cell(r.get("graph_us")), cell(r.get("eager_us"))]))
    return "\n".join(lines) + "\n"


def _plot(rows: list):
    def draw(path: str):
        plt = pyplot()
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, op in zip(axes, ("dispatch", "combine")):
            for api, key in (("ll", "in_graph_us"), ("v2", "in_graph_us"), ("torch_ref", "eager_us")):
                for E in sorted({r["experts"] for r in rows}):
                    pts = sorted((r["tokens"], r[key]) for r in rows
                                 if r["api"] == api and r["op"] == op and r["experts"] == E and r.get(key))
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=f"{api} ({key[:-3]}), E={E}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel("us per call")
            ax.set_title(op)
            if ax.get_legend_handles_labels()[0]:  # a run without rows for this op draws no curve
                ax.legend(fontsize=7)
        save(fig, path)
    return draw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="10 iterations instead of 50")
    ap.add_argument("--tokens", default="1,8,32,64,128,256")
    ap.add_argument("--experts", default="256,384")
    ap.add_argument("--apis", default="ll,v2,torch_ref", help="comma-separated: ll, v2, torch_ref")
    ap.add_argument("--world", type=int, default=0, help="GPUs to use (default: all)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    command = command_line("bench_elastic_ep_decode.py")
    args.out = out_dir(args.out)
    if not torch.cuda.is_available():
        print("bench_elastic_ep_decode: no CUDA device, nothing to measure")
        return 0
    world = args.world or torch.cuda.device_count()
    apply_env()
    t0 = time.time()
    per_rank = run_ranks(_worker, world, args, timeout=args.timeout, grace_s=60)
    from _results import git_revision, utc_now

    meta = dict(date=utc_now(), gpus=world, gpu_name=torch.cuda.get_device_name(0), git=git_revision(),
                torch=torch.__version__, seconds=round(time.time() - t0, 1),
                errors=[e for r in per_rank for e in r["errors"]])
    rows = per_rank[0]["results"]
    table = _table(rows, meta)
    print(table + ("errors:\n  " + "\n  ".join(meta["errors"]) if meta["errors"] else ""))
    write_results(args.out, "bench_elastic_ep_decode", dict(meta=meta, per_rank=per_rank), table, _plot(rows),
                  run=run_record(command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
