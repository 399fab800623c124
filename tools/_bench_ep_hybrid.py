"""``bench_elastic_ep.py --hybrid N``: hybrid mode against direct mode on the same routing, **emulated**.

``ELASTIC_EP_NUM_SCALEUP_RANKS=N`` splits the ranks into ``R / N`` logical scale-out domains. Two
backends (``--hybrid-backend``):

* ``torch`` (default; no GPU needed): CPU processes over gloo running the torch runtime.
* ``native``: the native runtime's hybrid kernels over the NVLink-emulated scale-out transport, on its
  CUDA-IPC window, rank r on GPU ``r % num_gpus`` (ranks share a GPU when there are fewer GPUs than
  ranks: then the times are of ranks taking turns on one GPU, not of a network).

Shape: DeepSeek-V3 (hidden 7168 BF16, top-8 of 256 experts, uniform routing), ``--tokens`` per rank
(default 512 here). Per iteration every rank dispatches and combines on a hybrid and on a direct
buffer; hybrid's outputs are checked bitwise against direct's.

What it shows, per rank (mean over ranks):
* **rows crossing scale-out domains** (what would go over the network): hybrid dispatch sends a token
  once per remote destination domain; direct mode once per remote destination rank. Combine sends a
  row per (token, remote expert rank) in both (ours forwards each rank's partial unreduced, to keep
  direct mode's bits); DeepEP's per-domain reduction would send hybrid dispatch's count back, shown as
  ``deepep_combine_rows``. Bytes = rows x (7168 x 2 + 8 x 8 + 8 x 4) for dispatch (DeepEP's token
  bytes) and rows x (7168 x 2 + 8 x 4) for combine. The torch runtime counts what it sent; for the
  native runtime the counts come from the routing (the same formula the tests check the torch one by).
* **times** of the calls (median, ms): emulated either way (gloo on the CPU, or ranks on one node's
  NVLink standing in for a network), so they are labelled and are no network figures.

Writes ``bench_elastic_ep_hybrid.{json,md,png}``.
"""
from __future__ import annotations

import os
import socket
import statistics
import time
from typing import List

import torch
import torch.distributed as dist
from _launch import run_ranks
from _results import git_revision, pyplot, run_record, save, utc_now, write_results

H, K, E = 7168, 8, 256
DISPATCH_ROW = H * 2 + K * 8 + K * 4
COMBINE_ROW = H * 2 + K * 4


def _hybrid_dispatch_rows(topk: torch.Tensor, L: int, scaleup: int, me_dom: int) -> int:
    """Rows a hybrid dispatch sends across domains: one per (token, remote domain holding its experts)."""
    return sum(len({int(e) // (L * scaleup) for e in row if int(e) // (L * scaleup) != me_dom})
               for row in topk.tolist())


def _worker(rank: int, world: int, rdzv: str, scaleup: int, tokens: int, iters: int, backend: str = "torch") -> dict:
    """One rank under tools/_launch.py (elastic_ep from the parent's ``sys.path``); returns its figures."""
    import elastic_ep as ep

    dist.init_process_group("gloo", init_method=rdzv, rank=rank, world_size=world)
    group = dist.group.WORLD
    kw = dict(num_max_tokens_per_rank=tokens, hidden=H, num_topk=K, backend=backend)
    dev = torch.device("cpu")
    if backend == "native":  # the CUDA-IPC window works over gloo, and with ranks sharing a GPU
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
        kw.update(window="ipc")

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()
    os.environ["ELASTIC_EP_NUM_SCALEUP_RANKS"] = str(scaleup)
    hybrid = ep.ElasticBuffer(group, **kw)
    del os.environ["ELASTIC_EP_NUM_SCALEUP_RANKS"]
    direct = ep.ElasticBuffer(group, **kw)
    L, me_dom = E // world, rank // scaleup
    res = dict(rank=rank, hybrid_dispatch_ms=[], direct_dispatch_ms=[], hybrid_combine_ms=[], direct_combine_ms=[],
               hybrid_dispatch_rows=[], direct_dispatch_rows=[], hybrid_combine_rows=[], direct_combine_rows=[],
               bitwise_equal=True)
    for it in range(iters + 1):  # the first is a warm-up
        g = torch.Generator().manual_seed(1000 * it + rank)
        x = torch.randn((tokens, H), generator=g).to(torch.bfloat16).to(dev)
        topk = torch.rand((tokens, E), generator=g).topk(K, dim=1).indices
        w = torch.rand((tokens, K), generator=g).to(dev)
        outs, rows = {}, {}
        for name, buf in (("hybrid", hybrid), ("direct", direct)):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            rx, _, rw, h, _ = buf.dispatch(x, topk_idx=topk.to(dev), topk_weights=w, num_experts=E)
            sync()
            t1 = time.perf_counter()
            if name == "hybrid":
                rows["hybrid_dispatch_rows"] = buf.runtime.hybrid.last_scaleout_rows if backend == "torch" else \
                    _hybrid_dispatch_rows(topk, L, scaleup, me_dom)
            dist.barrier()
            t2 = time.perf_counter()
            cx, _, _ = buf.combine(rx, h, topk_weights=rw)
            sync()
            t3 = time.perf_counter()
            if name == "hybrid" and backend == "torch":
                rows["hybrid_combine_rows"] = buf.runtime.hybrid.last_scaleout_rows
            else:  # direct: rows sent to ranks of other domains (dispatch), partials sent back to them (combine)
                dst = topk // L
                rows["direct_dispatch_rows"] = sum(len({int(r) for r in row if r // scaleup != me_dom})
                                                   for row in dst.tolist())
                per_src = torch.diff(h.psum_num_recv_tokens_per_scaleup_rank.to(torch.int64).cpu(), prepend=torch.zeros(1))
                rows["direct_combine_rows"] = int(sum(int(c) for r, c in enumerate(per_src.tolist())
                                                      if r // scaleup != me_dom))
                if backend == "native":  # partials go back unreduced: as many as direct mode sends
                    rows["hybrid_combine_rows"] = rows["direct_combine_rows"]
            outs[name] = (rx, cx)
            if it:
                res[f"{name}_dispatch_ms"].append((t1 - t0) * 1e3)
                res[f"{name}_combine_ms"].append((t3 - t2) * 1e3)
        if it:
            for k, v in rows.items():
                res[k].append(int(v))
        res["bitwise_equal"] &= all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                                    for a, b in zip(outs["hybrid"], outs["direct"]))
    hybrid.destroy()
    direct.destroy()
    dist.destroy_process_group()
    return res


def _mean(per_rank: List[dict], key: str) -> float:
    return statistics.fmean(v for r in per_rank for v in r[key])


def _median(per_rank: List[dict], key: str) -> float:
    return statistics.median(v for r in per_rank for v in r[key])


def summarise(per_rank: List[dict], world: int, scaleup: int) -> List[dict]:
    """One row per (op, mode): mean rows and MB crossing domains per rank, median time (emulated)."""
    table = []
    for op, row_bytes in (("dispatch", DISPATCH_ROW), ("combine", COMBINE_ROW)):
        for mode in ("hybrid", "direct"):
            rows = _mean(per_rank, f"{mode}_{op}_rows")
            table.append(dict(op=op, mode=mode, layout=f"{world // scaleup}x{scaleup}", scaleout_rows=rows,
                              scaleout_mb=rows * row_bytes / 1e6, emulated_ms=_median(per_rank, f"{mode}_{op}_ms")))
    # DeepEP's hybrid combine reduces per domain first: one row back per (token, remote domain), as
    # many as hybrid dispatch sends.
    rows = _mean(per_rank, "hybrid_dispatch_rows")
    table.append(dict(op="combine", mode="deepep_per_domain_reduction (computed)", layout=f"{world // scaleup}x{scaleup}",
                      scaleout_rows=rows, scaleout_mb=rows * COMBINE_ROW / 1e6, emulated_ms=None))
    return table


def markdown(table: List[dict], meta: dict) -> str:
    where = meta.get("where", "CPU ranks, torch backend over gloo")
    lines = [f"### Hybrid vs direct mode, EMULATED ({meta['layout']} logical domains of {meta['world']} ranks, "
             f"{where}; {meta['tokens']} tokens per rank, hidden {H}, top-{K} of {E})", "",
             f"{meta['date']}, {meta['host']}, revision {meta['git']}, `{meta['command']}`; hybrid outputs bitwise "
             f"equal to direct mode's: {meta['bitwise_equal']}", "",
             f"| op | mode | rows crossing domains / rank | MB crossing / rank | time, ms (emulated: {where}) |",
             "|---|---|---:|---:|---:|"]
    for t in table:
        ms = "–" if t["emulated_ms"] is None else f"{t['emulated_ms']:.1f}"
        lines.append(f"| {t['op']} | {t['mode']} | {t['scaleout_rows']:.0f} | {t['scaleout_mb']:.1f} | {ms} |")
    return "\n".join(lines) + "\n"


def _plot(table: List[dict], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{t['op']}\n{t['mode'].split(' ')[0]}" for t in table]
    ax.bar(range(len(table)), [t["scaleout_mb"] for t in table],
           color=["tab:green" if t["mode"] == "hybrid" else "tab:gray" for t in table])
    ax.set_xticks(range(len(table)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("MB per rank crossing scale-out domains")
    ax.set_title("hybrid vs direct (emulated; bytes, not times)", fontsize=9)
    save(fig, path, dpi=120)


def run(out: str, world: int, scaleup: int, tokens: int, iters: int, command: str, backend: str = "torch",
        timeout: float = 1800.0) -> dict:
    """Runs the ranks, writes bench_elastic_ep_hybrid.{json,md,png} into ``out``; returns the data."""
    if world % scaleup or scaleup >= world:
        raise SystemExit(f"--hybrid {scaleup}: expected a divisor of --world {world} below it")
    t0 = time.time()
    where = "CPU ranks, torch backend over gloo"
    if backend == "native":
        if not torch.cuda.is_available():
            raise SystemExit("--hybrid-backend native: no CUDA device")
        gpus = torch.cuda.device_count()
        where = (f"native runtime, NVLink-emulated scale-out, CUDA-IPC window on {min(gpus, world)} "
                 f"{torch.cuda.get_device_name(0)}" + (" shared by the ranks" if gpus < world else ""))
    per_rank = run_ranks(_worker, world, scaleup, tokens, iters, backend, timeout=timeout, grace_s=30)
    meta = dict(date=utc_now(), host=socket.gethostname(), git=git_revision(), command=command, world=world,
                scaleup=scaleup, layout=f"{world // scaleup}x{scaleup}", tokens=tokens, iterations=iters, emulated=True,
                backend=backend, where=where,
                bitwise_equal=all(r["bitwise_equal"] for r in per_rank), seconds=round(time.time() - t0, 1))
    table = summarise(per_rank, world, scaleup)
    md = markdown(table, meta)
    print(md)
    write_results(out, "bench_elastic_ep_hybrid", dict(meta=meta, table=table, per_rank=per_rank), md,
                  lambda path: _plot(table, path), run=run_record(command))
    return dict(meta=meta, table=table)
