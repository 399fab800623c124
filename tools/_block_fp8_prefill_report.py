"""The prefill loop's report (tools/_block_fp8_prefill.py): the goal figures of each rank, the
printed lines and markdown, and the files ``--out`` writes (``prefill.json``, ``prefill.md`` and
``prefill.png``, through tools/_results.py: the plot drawn last and only where matplotlib is
installed)."""
from __future__ import annotations

from typing import List, Sequence

from _results import pyplot, run_record, save, write_results

import _block_fp8_moe as M

LOOP_GOAL = 1.05      #: loop time <= LOOP_GOAL x sum over layers of max(compute, transfer)
SLOWDOWN_GOAL = 0.05  #: compute in the loop <= (1 + SLOWDOWN_GOAL) x compute alone


def layer_bound_ms(results: Sequence[dict]) -> List[float]:
    """Per layer, max(compute alone, transfer alone) of the slowest rank: a layer's transfer is
    collective (it starts when every rank joined), so the loop of every rank runs at the pace of the
    slowest one."""
    n = len(results[0]["alone"])
    return [max(max(r["alone"][layer]["compute_ms"] for r in results),
                max(r["alone"][layer]["transfer_ms"] for r in results)) for layer in range(n)]


def summarize_rank(res: dict, bound_ms: float) -> dict:
    """One rank's figures for the goals, from the loop run with the median loop time; ``bound_ms`` is
    the sum of :func:`layer_bound_ms`."""
    C = [a["compute_ms"] for a in res["alone"]]
    T = [a["transfer_ms"] for a in res["alone"]]
    runs = sorted((i for i, lp in enumerate(res["loops"]) if not lp.get("warmup")),
                  key=lambda i: res["loops"][i]["loop_ms"])
    median = runs[len(runs) // 2]
    run = res["loops"][median]
    in_loop = sum(run["compute_ms"])
    return dict(run=median, loop_ms=run["loop_ms"], fill_ms=run["fill_ms"], bound_ms=bound_ms,
                serial_ms=sum(C) + sum(T), compute_alone_ms=sum(C), transfer_alone_ms=sum(T),
                compute_in_loop_ms=in_loop, loop_ratio=run["loop_ms"] / bound_ms if bound_ms > 0 else float("nan"),
                slowdown=in_loop / sum(C) - 1 if sum(C) > 0 else float("nan"), overlap_ms=run["overlap_ms"],
                bytes_exact=all(res["warm_exact"]) and all(a["exact"] for a in res["alone"])
                and all(res["end_exact"].values()),
                reproducible=all(a["reproducible"] for a in res["alone"]),
                outputs_equal=all(all(r["outputs_equal"]) for r in res["loops"]),
                timeline_ok=not any(r["violations"] for r in res["loops"]))


def flops_text(f: float) -> str:
    """``f`` FLOP (or FLOP/s, with the unit's suffix added by the caller) with a readable prefix."""
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if f >= scale:
            return f"{f / scale:.2f} {unit}"
    return f"{f:.0f} FLOP"


def _goal(judged: bool, met: bool) -> str:
    return ("met" if met else "MISSED") if judged else "not judged"


def report(cfg: dict, results: List[dict], ndev: int) -> tuple:
    """(printed lines, the same as markdown, JSON record, correctness ok) of a finished run."""
    tp, N = cfg["tp"], cfg["layers"]
    backend = results[0]["backend"]
    shared = backend == "cuda" and tp > ndev
    judged = backend == "cuda" and not shared
    nb = results[0]["expert_nbytes"]
    layer_bytes = cfg["experts"] * sum(nb)
    flops = M.moe_flops(cfg["tokens"], cfg["top_k"], cfg["hidden"], cfg["intermediate"] // tp)
    bound = layer_bound_ms(results)
    summ = [summarize_rank(r, sum(bound)) for r in results]
    lines = []
    if backend != "cuda":
        lines.append("CPU backend: CPU matmuls and memcpy share the cores, so the timings check nothing; the "
                     "schedule, the bytes and the outputs are checked")
    elif shared:
        lines.append(f"{tp} ranks share {ndev} GPU(s): their kernels and copies are time-sliced, so the timings "
                     "check nothing (correctness only); the goals are judged with one rank per GPU")
    head = ("| layer | compute alone ms | transfer alone ms | max ms | compute in loop ms | transfer in loop ms "
            "| weights | outputs |")
    table = [f"Per layer, the slowest of {tp} rank(s); in the loop: the run with the median loop time of each rank.",
             "", head, "|---" * (head.count("|") - 1) + "|"]
    for layer in range(N):
        ca = max(r["alone"][layer]["compute_ms"] for r in results)
        ta = max(r["alone"][layer]["transfer_ms"] for r in results)
        cl = max(r["loops"][s["run"]]["compute_ms"][layer] for r, s in zip(results, summ))
        tl = max(r["loops"][s["run"]]["transfer_ms"][layer] for r, s in zip(results, summ))
        ok = all(r["alone"][layer]["exact"] for r in results)
        eq = all(lp["outputs_equal"][layer] for r in results for lp in r["loops"])
        table.append(f"| {layer} | {ca:.2f} | {ta:.2f} | {bound[layer]:.2f} | {cl:.2f} | "
                     f"{tl:.2f}{' (fill)' if layer == 0 else ''} | {'exact' if ok else 'MISMATCH'} | "
                     f"{'equal' if eq else 'DIFFER'} |")
    notes = list(lines)
    lines += table
    all_ok = True
    for r, s in zip(results, summ):
        ok = s["bytes_exact"] and s["timeline_ok"] and (s["outputs_equal"] or not s["reproducible"])
        all_ok &= ok
        loop_met, slow_met = s["loop_ratio"] <= LOOP_GOAL, s["slowdown"] <= SLOWDOWN_GOAL
        s.update(loop_goal=_goal(judged, loop_met), slowdown_goal=_goal(judged, slow_met), ok=ok)
        where = f"GPU {r['device']}" if r["device"] is not None else "CPU"
        lines += [
            f"rank {r['rank']} ({where}): loop {s['loop_ms']:.1f} ms from layer 0's arrival (+ {s['fill_ms']:.1f} ms "
            f"for layer 0's transfer before it) vs the sum over layers of max(compute, transfer) "
            f"{s['bound_ms']:.1f} ms = {s['loop_ratio']:.3f}x -> goal <= {LOOP_GOAL}x: {s['loop_goal']}",
            f"  compute in the loop {s['compute_in_loop_ms']:.1f} ms vs alone {s['compute_alone_ms']:.1f} ms = "
            f"{100 * s['slowdown']:+.1f} % -> goal <= {100 * SLOWDOWN_GOAL:.0f} %: {s['slowdown_goal']}",
            f"  alone: compute {s['compute_alone_ms']:.1f} ms ({flops_text(flops * N / s['compute_alone_ms'] * 1e3)}/s), "
            f"transfer {s['transfer_alone_ms']:.1f} ms ({layer_bytes * N / s['transfer_alone_ms'] / 1e6:.2f} GB/s "
            f"per rank); one after the other {s['serial_ms']:.1f} ms; in the loop {s['overlap_ms']:.1f} ms of "
            "transfer ran during compute",
            "  checks: weights " + ("byte-exact" if s["bytes_exact"] else "MISMATCH") + ", outputs "
            + ("bitwise equal to the layers computed alone" if s["outputs_equal"] else
               "DIFFER from the layers computed alone" if s["reproducible"] else
               "not comparable (a layer computed alone twice gave different bits)")
            + ", timeline " + ("double-buffered" if s["timeline_ok"] else "VIOLATED: " + "; ".join(
                v for lp in r["loops"] for v in lp["violations"][:3]))]
    worst_loop = max(summ, key=lambda x: x["loop_ratio"])
    worst_slow = max(summ, key=lambda x: x["slowdown"])
    met = dict(loop=worst_loop["loop_ratio"] <= LOOP_GOAL if judged else None,
               slowdown=worst_slow["slowdown"] <= SLOWDOWN_GOAL if judged else None)
    lines.append(f"goals: loop <= {LOOP_GOAL}x the sum of max(compute, transfer): {_goal(judged, bool(met['loop']))} "
                 f"(worst {worst_loop['loop_ratio']:.3f}x); compute slowdown in the loop <= "
                 f"{100 * SLOWDOWN_GOAL:.0f} %: {_goal(judged, bool(met['slowdown']))} "
                 f"(worst {100 * worst_slow['slowdown']:+.1f} %)"
                 + ("" if judged else " -- judged on the CUDA backend with one rank per GPU only"))
    record = dict(config=cfg, backend=backend, gpus=ndev, ranks_share_gpus=shared, goals_judged=judged,
                  goals=dict(loop_ratio=LOOP_GOAL, slowdown=SLOWDOWN_GOAL), goals_met=met, expert_nbytes=nb,
                  layer_bytes_per_rank=layer_bytes, flops_per_rank_and_layer=flops, ok=bool(all_ok),
                  summary=summ, ranks=results)
    summary = lines[len(notes) + len(table):]
    md = notes + ([""] if notes else []) + table + ["", "```text"] + summary + ["```"]
    return lines, "\n".join(md), record, all_ok


def _plot(record: dict, path: str) -> None:
    plt = pyplot()
    import matplotlib.patches

    r0, s0 = record["ranks"][0], record["summary"][0]
    n = len(r0["alone"])
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7))
    xs = range(n)
    w = 0.27
    ax1.bar([i - w for i in xs], [a["compute_ms"] for a in r0["alone"]], w, label="compute alone")
    ax1.bar(list(xs), [a["transfer_ms"] for a in r0["alone"]], w, label="transfer alone")
    ax1.bar([i + w for i in xs], r0["loops"][s0["run"]]["compute_ms"], w, label="compute in the loop")
    ax1.set_xticks(list(xs))
    ax1.set_xlabel("layer")
    ax1.set_ylabel("ms")
    ax1.set_title(f"rank 0: loop {s0['loop_ms']:.1f} ms = {s0['loop_ratio']:.3f} x sum max(compute, transfer); "
                  f"compute {100 * s0['slowdown']:+.1f} % in the loop")
    ax1.legend(fontsize=8)
    colours = ("tab:purple", "tab:olive")
    for e in r0["loops"][s0["run"]]["events"]:
        y = 1 if e["kind"] == "transfer" else 0
        ax2.barh(y, e["end_ms"] - e["start_ms"], left=e["start_ms"], color=colours[e["buffer"]], edgecolor="k")
        ax2.text((e["start_ms"] + e["end_ms"]) / 2, y, str(e["layer"]), ha="center", va="center", fontsize=7)
    ax2.set_yticks([0, 1], ["compute", "transfer"])
    ax2.legend(handles=[matplotlib.patches.Patch(color=c, label=f"layer buffer {b}") for b, c in enumerate(colours)],
               fontsize=8, loc="upper right")
    ax2.set_xlabel("ms since the loop started (bars: layers)")
    ax2.set_title("rank 0's timeline")
    save(fig, path)


def write_outputs(out: str, name: str, record: dict, table_md: str, command: str) -> List[str]:
    """``<name>.json`` (with the run's date, revision, command and machine), ``<name>.md`` and
    ``<name>.png`` into ``out``; returns the paths written."""
    return write_results(out, name, record, table_md, lambda path: _plot(record, path), quiet=True,
                         run=run_record(command))
