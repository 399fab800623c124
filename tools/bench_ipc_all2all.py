#!/usr/bin/env python3
"""Benchmark ipc_all2all against the standard Ulysses path (permute -> NCCL all_to_all_single ->
permute), measured in the same run.

    python tools/bench_ipc_all2all.py --out DIR [--quick] [--worlds 2,4] [--plot-only]

Launches one process per GPU for every world size W in {2, 4, 8, all GPUs} that the machine has,
bf16, 32 heads x 128, batch 1, total sequence 4k..128k tokens (each rank holds total/W tokens).
For send_recv_heads, gather_heads and their round trip, eager and CUDA-graphed, it reports the
latency (max over ranks of the mean per call), the algorithm bandwidth (bytes of one rank's input /
time) and the bus bandwidth (algbw * (W-1)/W, the share that crosses NVLink). It also checks once
per size that both paths give bitwise equal results, sweeps the grid at 16k and 32k tokens, and
writes bench_ipc_all2all.{json,md,png} into DIR. --plot-only redraws the PNG from the JSON.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import pathlib
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import apply as apply_env  # noqa: E402
from _launch import RankFailure, run_ranks  # noqa: E402
from _results import (cell, command_line, git_revision, md_row, out_dir, pyplot, run_record, save,  # noqa: E402
                      utc_now, write_results)

HEADS, HEAD_DIM = 32, 128
NCCL_RT_REF_US = {4096: 166, 8192: 261, 32768: 851, 131072: 3133}  # measured NCCL path, 2x H200
BUSBW_TARGET = 330.0  # GB/s, send_recv_heads at >= 64 MiB per rank, 2 GPUs


def _time_eager(fn, iters, warmup=3):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    import torch.distributed as dist

    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters  # us


def _time_graph(fn, iters, per_graph=5):
    import torch
    import torch.distributed as dist

    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        fn()  # warm-up on the side stream (NCCL needs it before capture)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            for _ in range(per_graph):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    reps = max(1, iters // per_graph)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * per_graph)


def _bytes_per_rank(total_tokens: int, world: int) -> int:
    """One rank's input of send_recv_heads (= its output of gather_heads): its total/W tokens of
    32 heads x 128 bf16 (2 bytes) elements."""
    return (total_tokens // world) * HEADS * HEAD_DIM * 2


def _bandwidths(nbytes: float, us: float, world: int):
    """(algbw, busbw) in GB/s (1e9 bytes/s) of an all-to-all that moves ``nbytes`` per rank in ``us``
    microseconds over ``world`` ranks, as nccl-tests counts an alltoall: algbw = bytes per rank / time,
    busbw = algbw * (W-1)/W (the share of each rank's bytes that leaves the GPU)."""
    algbw = nbytes / (us * 1e-6) / 1e9
    return algbw, algbw * (world - 1) / world


def _sweep_busbw(s) -> float:
    """Bus bandwidth (GB/s) of one grid-sweep point: one rank's input bytes * (W-1)/W over its time."""
    return _bandwidths(_bytes_per_rank(s["total_tokens"], s["world"]), s["send_us"], s["world"])[1]


def _worker(rank, world, rdzv, sizes, sweep, num_blocks=0):
    """One rank under tools/_launch.py; returns its rows and grid-sweep points."""
    import torch
    import torch.distributed as dist

    import ipc_all2all

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=rdzv, rank=rank, world_size=world, device_id=dev,
                            timeout=datetime.timedelta(seconds=120))
    hpr = HEADS // world
    max_local = max(sizes) // world
    a2a = ipc_all2all.All2All.from_group(num_tokens=max_local, hidden_dim=HEADS * HEAD_DIM,
                                         tensor_dtype=torch.bfloat16, timeout_seconds=10,
                                         num_sms=num_blocks or None)
    # A second instance for the CUDA graphs: once an instance has a captured call, its eager calls
    # return copies (a replay may rewrite either output slot behind the host's back), so eager
    # figures are taken on an instance that is never captured.
    a2a_graph = ipc_all2all.All2All.from_group(num_tokens=max_local, hidden_dim=HEADS * HEAD_DIM,
                                               tensor_dtype=torch.bfloat16, timeout_seconds=10,
                                               num_sms=num_blocks or None)
    results, sweep_res = [], []
    default_grid = tuple(a2a._core.grid[:2])  # (blocks, own-rank blocks) as constructed

    def mx(v):
        t = torch.tensor([v], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    for total in sizes:
        n = total // world
        a2a.set_rank_tokens([n] * world)
        a2a_graph.set_rank_tokens([n] * world)
        x = torch.randn(1, n, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        y_in = torch.randn(1, total, hpr, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        send_buf = torch.empty(world, 1, n, hpr, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        recv_buf = torch.empty_like(send_buf)

        def nccl_send(x=x):
            send_buf.copy_(x.view(1, n, world, hpr, HEAD_DIM).permute(2, 0, 1, 3, 4))
            dist.all_to_all_single(recv_buf, send_buf)
            return recv_buf.permute(1, 0, 2, 3, 4).reshape(1, total, hpr, HEAD_DIM).contiguous()

        def nccl_gather(y=y_in):
            send_buf.copy_(y.view(1, world, n, hpr, HEAD_DIM).permute(1, 0, 2, 3, 4))
            dist.all_to_all_single(recv_buf, send_buf)
            return recv_buf.permute(1, 2, 0, 3, 4).reshape(1, n, HEADS, HEAD_DIM).contiguous()

        def ours_send(a2a=a2a):
            return a2a.send_recv_heads(x)

        def ours_gather(a2a=a2a):
            return a2a.gather_heads(y_in)

        def ours_rt(a2a=a2a):
            return a2a.gather_heads(a2a.send_recv_heads(x))

        def nccl_rt():
            return nccl_gather(nccl_send())

        # fp8 on the wire (e4m3 + a scale per head vector; lossy, always a fresh bf16 output)
        def ours_fp8_send(a2a=a2a):
            return a2a.send_recv_heads(x, fp8_wire=True)

        def ours_fp8_gather(a2a=a2a):
            return a2a.gather_heads(y_in, fp8_wire=True)

        def ours_fp8_rt(a2a=a2a):
            return a2a.gather_heads(a2a.send_recv_heads(x, fp8_wire=True), fp8_wire=True)

        equal = bool(torch.equal(ours_send(), nccl_send()))
        equal &= bool(torch.equal(ours_gather(), nccl_gather()))
        equal &= bool(torch.equal(ours_rt(), x))
        bytes_rank = _bytes_per_rank(total, world)
        iters = int(max(10, min(200, 4e9 / max(bytes_rank, 1))))
        row = {"world": world, "total_tokens": total, "bytes_per_rank": bytes_rank, "bitwise_equal": equal}
        for name, fn in (("ours_send", ours_send), ("ours_gather", ours_gather), ("ours_rt", ours_rt),
                         ("nccl_send", nccl_send), ("nccl_gather", nccl_gather), ("nccl_rt", nccl_rt),
                         ("ours_fp8_send", ours_fp8_send), ("ours_fp8_gather", ours_fp8_gather),
                         ("ours_fp8_rt", ours_fp8_rt)):
            row[f"{name}_eager_us"] = mx(_time_eager(fn, iters))
            graph_fn = functools.partial(fn, a2a=a2a_graph) if name.startswith("ours") else fn
            try:
                row[f"{name}_graph_us"] = mx(_time_graph(graph_fn, iters))
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                row[f"{name}_graph_us"] = None
                row.setdefault("errors", []).append(f"{name} graph: {type(e).__name__}: {e}")
                torch.cuda.synchronize()
        results.append(row)
        if rank == 0:
            print(f"W={world} T={total}: ours send {row['ours_send_eager_us']:.1f} us rt {row['ours_rt_eager_us']:.1f}"
                  f" | nccl send {row['nccl_send_eager_us']:.1f} rt {row['nccl_rt_eager_us']:.1f} equal={equal}",
                  flush=True)
        del x, y_in, send_buf, recv_buf
        if total in sweep:
            x = torch.randn(1, n, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
            sm = torch.cuda.get_device_properties(dev).multi_processor_count
            # 46 registers x 512 threads: at most 2 blocks per SM are resident, so no more than 2*sm.
            # self_blocks 0 is the default split (num_blocks / (2W) to the own rank).
            for nb in (sm, 2 * sm):
                for self_b in (0, nb // 8, nb // 6, nb // 3):
                    a2a.set_grid(nb, self_b)
                    us = mx(_time_eager(lambda: a2a.send_recv_heads(x), 20))
                    sweep_res.append({"num_blocks": nb, "self_blocks": self_b, "grid": list(a2a._core.grid),
                                      "send_us": us, "total_tokens": total, "world": world})
            a2a.set_grid(*default_grid)
            del x
        torch.cuda.empty_cache()
    a2a.destroy()
    a2a_graph.destroy()
    dist.destroy_process_group()
    return {"rows": results, "sweep": sweep_res}


def _run_world(world, sizes, sweep, timeout, num_blocks=0):
    """``(rank 0's rows and sweep, {})``, or ``(None, {rank: error})`` when the ranks failed."""
    try:
        return run_ranks(_worker, world, sizes, sweep, num_blocks, timeout=timeout, grace_s=20)[0], {}
    except RankFailure as e:
        return None, {"-": str(e)}


def _derive(row):
    """Adds ``<name>_<mode>_algbw`` / ``_busbw`` (GB/s) for every timing ``<name>_<mode>_us`` of a row; a
    round trip (``_rt_``) is two all-to-alls, so it counts twice one rank's bytes."""
    W = row["world"]
    for k in list(row):
        if k.endswith("_us") and row[k]:
            base = k[:-3]
            b = row["bytes_per_rank"] * (2 if "_rt_" in k else 1)
            row[base + "_algbw"], row[base + "_busbw"] = _bandwidths(b, row[k], W)
    return row


def _table(rows):
    lines = ["| W | tokens | MiB/rank | mode | ours send us | ours gather us | ours RT us | NCCL send us | NCCL gather us "
             "| NCCL RT us | RT ratio | ours send busbw GB/s | NCCL send busbw GB/s | equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for mode in ("eager", "graph"):
            g = lambda k: r.get(f"{k}_{mode}_us")  # noqa: E731
            ratio = (g("ours_rt") / g("nccl_rt")) if g("ours_rt") and g("nccl_rt") else None
            lines.append(md_row([r["world"], r["total_tokens"], f"{r['bytes_per_rank'] / 2**20:.0f}", mode]
                                + [cell(g(k), missing="n/a") for k in ("ours_send", "ours_gather", "ours_rt",
                                                                       "nccl_send", "nccl_gather", "nccl_rt")]
                                + [cell(ratio, 2, "n/a"), cell(r.get(f"ours_send_{mode}_busbw"), missing="n/a"),
                                   cell(r.get(f"nccl_send_{mode}_busbw"), missing="n/a"), r["bitwise_equal"]]))
    fp8 = [r for r in rows if r.get("ours_fp8_send_eager_us")]
    if fp8:
        lines += ["", "fp8 on the wire (e4m3 + one fp32 scale per head vector, bf16 in and out; busbw counts the "
                  "bf16 bytes the call stands for):", "",
                  "| W | tokens | mode | fp8 send us | fp8 gather us | fp8 RT us | exact RT us | fp8 RT / exact RT "
                  "| fp8 send effective busbw GB/s |", "|---|---|---|---|---|---|---|---|---|"]
        for r in fp8:
            for mode in ("eager", "graph"):
                g = lambda k: r.get(f"{k}_{mode}_us")  # noqa: E731
                ratio = (g("ours_fp8_rt") / g("ours_rt")) if g("ours_fp8_rt") and g("ours_rt") else None
                lines.append(md_row([r["world"], r["total_tokens"], mode]
                                    + [cell(g(k), missing="n/a") for k in ("ours_fp8_send", "ours_fp8_gather",
                                                                           "ours_fp8_rt", "ours_rt")]
                                    + [cell(ratio, 2, "n/a"), cell(r.get(f"ours_fp8_send_{mode}_busbw"), missing="n/a")]))
    return "\n".join(lines)


def _targets(rows):
    out = []
    for r in rows:
        if r["world"] != 2:
            continue
        for mode in ("eager", "graph"):
            o, n = r.get(f"ours_rt_{mode}_us"), r.get(f"nccl_rt_{mode}_us")
            if o and n:
                out.append(f"W=2 {r['total_tokens']} tokens {mode}: RT {o:.1f} us vs NCCL {n:.1f} us "
                           f"(ratio {o / n:.2f}, target <= 0.5: {'MET' if o <= 0.5 * n else 'MISSED'})"
                           + (f"; reference NCCL RT {NCCL_RT_REF_US[r['total_tokens']]} us -> ours/ref "
                              f"{o / NCCL_RT_REF_US[r['total_tokens']]:.2f}" if r['total_tokens'] in NCCL_RT_REF_US else ""))
            bw = r.get(f"ours_send_{mode}_busbw")
            if bw and r["bytes_per_rank"] >= 64 * 2**20:
                out.append(f"W=2 {r['total_tokens']} tokens {mode}: send busbw {bw:.0f} GB/s "
                           f"(target >= {BUSBW_TARGET:.0f}: {'MET' if bw >= BUSBW_TARGET else 'MISSED'})")
    return out


def _plot(data, out_dir):
    """bench_ipc_all2all.png in ``out_dir`` (latency and bus bandwidth per size); its path, or None
    without matplotlib."""
    try:
        plt = pyplot()
    except ImportError as e:
        print(f"no plot: matplotlib unavailable ({e}); rerun with --plot-only where it is")
        return None
    rows = data["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for W in sorted({r["world"] for r in rows}):
        rs = [r for r in rows if r["world"] == W]
        xs = [r["total_tokens"] for r in rs]
        for key, style in (("ours_rt_eager", "-o"), ("nccl_rt_eager", "--o"), ("ours_rt_graph", "-s"),
                           ("nccl_rt_graph", "--s")):
            ys = [r.get(key + "_us") for r in rs]
            if any(y is not None for y in ys):
                axes[0].plot(xs, ys, style, label=f"W={W} {key.replace('_', ' ')}")
        for key, style in (("ours_send_eager", "-o"), ("nccl_send_eager", "--o"), ("ours_gather_eager", "-^")):
            ys = [r.get(key + "_busbw") for r in rs]
            axes[1].plot(xs, ys, style, label=f"W={W} {key.replace('_', ' ')}")
    axes[0].set(xscale="log", yscale="log", xlabel="total tokens (32 heads x 128, bf16, batch 1)",
                ylabel="round trip latency (us)", title="send_recv_heads + gather_heads")
    axes[1].axhline(BUSBW_TARGET, color="gray", lw=0.8, ls=":", label="target 330 GB/s")
    axes[1].set(xscale="log", xlabel="total tokens", ylabel="bus bandwidth (GB/s)", title="bus bandwidth")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"ipc_all2all vs permute+NCCL all_to_all_single+permute ({data['meta'].get('gpu', '')})")
    fig.tight_layout()
    path = pathlib.Path(out_dir) / "bench_ipc_all2all.png"
    save(fig, str(path))
    return path


def _markdown(data) -> str:
    meta, rows, sweeps = data["meta"], data["rows"], data.get("grid_sweep", [])
    md = [f"# ipc_all2all benchmark, {meta['date']}", "",
          f"{meta['gpus']}x {meta['gpu']}, torch {meta['torch']}, NCCL {meta['nccl']}, git {meta['git_rev']}", "",
          f"`{meta['command']}`", "", _table(rows), "", "## Targets", ""] + [f"- {t}" for t in data["targets"]]
    if sweeps:
        md += ["", "## Grid sweep (send_recv_heads, eager; self blocks 0 = the default split)", "",
               "| W | tokens | blocks | self blocks | grid (total, self, per peer) | us | send busbw GB/s |",
               "|---|---|---|---|---|---|---|"]
        md += [f"| {s['world']} | {s['total_tokens']} | {s['num_blocks']} | {s['self_blocks']} | {s['grid']} | "
               f"{s['send_us']:.1f} | {_sweep_busbw(s):.0f} |" for s in sweeps]
    if data.get("errors"):
        md += ["", "## Errors", ""] + [f"- W={w}: {e}" for w, e in data["errors"].items()]
    return "\n".join(md) + "\n"


def write_outputs(out, data, run=None) -> list:
    """bench_ipc_all2all.{json,md,png} into ``out`` (``run``: tools/_results.py's run record for the
    JSON); returns the paths written."""
    return write_results(str(out), "bench_ipc_all2all", data, _markdown(data),
                         lambda path: _plot(data, os.path.dirname(path)), run=run)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="4k and 32k tokens only")
    ap.add_argument("--worlds", default="", help="comma-separated world sizes (default: 2,4,8,all available)")
    ap.add_argument("--num-blocks", type=int, default=0, help="blocks per launch (default: the library's)")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from DIR/bench_ipc_all2all.json")
    args = ap.parse_args()
    out = pathlib.Path(out_dir(args.out))
    if args.plot_only:
        data = json.loads((out / "bench_ipc_all2all.json").read_text())
        print(_plot(data, out))
        return 0
    apply_env()  # tools/env.sh (NVLink multicast off), before torch and the worker processes start
    import torch

    n = torch.cuda.device_count()
    if n < 2:  # nothing to measure: say so in the output folder too
        why = f"bench_ipc_all2all: not run, it needs at least 2 GPUs and found {n}"
        print(why)
        write_results(str(out), "bench_ipc_all2all", {"skipped": why, "gpus": n, "git_rev": git_revision()}, why)
        return 0
    worlds = [int(w) for w in args.worlds.split(",") if w] or sorted({w for w in (2, 4, 8, n) if w <= n})
    sizes = [4096, 32768] if args.quick else [4096, 8192, 16384, 32768, 65536, 131072]
    rev = git_revision()
    command = command_line(f"{os.path.basename(sys.executable)} {sys.argv[0]}")
    meta = {"date": utc_now("iso"),
            "host": socket.gethostname(), "gpu": torch.cuda.get_device_name(0), "gpus": n,
            "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())), "git_rev": rev,
            "command": command, "heads": HEADS, "head_dim": HEAD_DIM,
            "dtype": "bfloat16", "batch": 1, "num_blocks": args.num_blocks or "default"}
    rows, sweeps, errors = [], [], {}
    for W in worlds:
        res, err = _run_world(W, sizes, {t for t in (16384, 32768) if t in sizes} or {sizes[-1]}, timeout=240,
                              num_blocks=args.num_blocks)
        if err:
            errors[W] = err
            print(f"W={W} failed: {err}")
            continue
        rows += [_derive(r) for r in res["rows"]]
        sweeps += res["sweep"]
    data = {"meta": meta, "rows": rows, "grid_sweep": sweeps, "errors": {str(k): v for k, v in errors.items()},
            "targets": _targets(rows)}
    print(_markdown(data))
    write_outputs(out, data, run=run_record(command))
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
