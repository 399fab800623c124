"""The reporting half of tools/bench_elastic_ep.py: the per-rank results summarised per case (mean over
ranks, speed-ups against the baselines), the markdown table, the plot and the files (through
tools/_results.py), so that a GPU run cannot be lost to a bug after its measurements (the CPU tests
run all of it on synthetic results)."""
from __future__ import annotations

from typing import Optional

from _results import cell, md_row, pyplot, save, write_results


def _summarise(per_rank, meta):
    """One row per (backend, case, SMs): the per-rank figures averaged, and the speed-ups against the torch
    reference path, the torch backend and the bare all_to_all."""
    rows = {}
    for r in per_rank:
        for res in r["results"]:
            rows.setdefault((res["backend"], res["case"], res["num_sms"]), []).append(res)

    def mean(lst, k):
        vals = [v[k] for v in lst if v.get(k) is not None]
        return sum(vals) / len(vals) if vals else None

    table = []
    for (backend, case, sms), lst in rows.items():
        table.append(dict(backend=backend, case=case, num_sms=sms,
                          **{k: mean(lst, k) for k in ("e2e_us", "e2e_mean_us", "kernel_us", "comm_kernel_us",
                                                        "epilogue_us", "span_us", "busy_us",
                                                        "e2e_gbps_excl_local", "e2e_gbps_incl_local",
                                                        "kernel_gbps_excl_local", "kernel_gbps_incl_local",
                                                        "comm_gbps_excl_local", "comm_gbps_incl_local")},
                          per_kernel_us={k: sum(v.get("per_kernel_us", {}).get(k, 0.0) for v in lst) / len(lst)
                                         for k in sorted({k for v in lst for k in v.get("per_kernel_us", {})})},
                          per_kernel_us_by_rank=[v.get("per_kernel_us", {}) for v in lst]))
    ref = {t["case"]: t for t in table if t["backend"] == "torch"}
    lean = {t["case"]: t for t in table if t["backend"] == "torch_ref"}
    a2a = {t["case"]: t for t in table if t["backend"] == "torch_a2a"}
    for t in table:
        # the overlapped and sequential-push variants are compared with the same references
        base = t["case"].split("_overlap")[0].split("_nopdl")[0]
        # the cached dispatch against the full BF16 dispatch of the reference (which has no cached mode)
        r = lean.get(t["case"], lean.get(base, lean.get(base.replace("_cached", "").replace("_nosync", ""))))
        t["speedup_vs_ref_e2e"] = (r["e2e_us"] / t["e2e_us"]) if r and t["e2e_us"] else None
        r = ref.get(t["case"], ref.get(base))
        t["speedup_vs_torch_e2e"] = (r["e2e_us"] / t["e2e_us"]) if r and t["e2e_us"] else None
        r = a2a.get(t["case"], a2a.get(base))
        t["speedup_vs_a2a_e2e"] = (r["e2e_us"] / t["e2e_us"]) if r and t["e2e_us"] else None
    return table


#: The table's time and bandwidth columns (one decimal), then its speed-ups (two).
_TIMES_AND_RATES = ("kernel_us", "comm_kernel_us", "epilogue_us", "e2e_us", "comm_gbps_excl_local",
                    "comm_gbps_incl_local", "kernel_gbps_excl_local", "kernel_gbps_incl_local", "e2e_gbps_excl_local")
_SPEEDUPS = ("speedup_vs_ref_e2e", "speedup_vs_torch_e2e", "speedup_vs_a2a_e2e")


def _markdown(table, meta) -> str:
    """The table of :func:`_summarise` (and the device time per kernel and rank) as markdown."""
    lines = [f"elastic_ep benchmark, {meta['date']}, {meta['gpus']} x {meta['gpu_name']}, git {meta['git']}, "
             f"torch {meta['torch']}, NCCL {meta['nccl']}",
             f"shape: {meta['tokens']} tokens/rank, hidden 7168, top-8 of 256 experts, uniform routing; "
             f"per-GPU averages of: kernel time (mean), e2e (median of the iterations), each iteration started "
             f"{'aligned on all GPUs (all-reduce + GEMM)' if meta.get('align', 'gemm') == 'gemm' else 'after a host barrier'}; "
             "GB/s = received bytes / time (1e9 B/s); DeepEP's GB/s divide by the communication kernels' time "
             "(dispatch: notify + push = its dispatch_impl; combine: push = its combine_impl), all-kernels GB/s "
             "by the time any of the call's kernels runs (epilogue / reduce included)",
             "",
             "| backend | case | SMs | kernel us | comm us | epilogue us | e2e us | DeepEP GB/s excl. local | "
             "DeepEP GB/s incl. local | all-kernels GB/s excl. local | all-kernels GB/s incl. local | "
             "e2e GB/s excl. local | e2e speed-up vs torch "
             "reference path | e2e speed-up vs torch backend | e2e speed-up vs bare all_to_all | kernel span us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        lines.append(md_row([t["backend"], t["case"], t["num_sms"] or "all"]
                            + [cell(t.get(k)) for k in _TIMES_AND_RATES]
                            + [cell(t.get(k), 2) for k in _SPEEDUPS] + [cell(t.get("span_us"))]))
    kern = [t for t in table if t.get("per_kernel_us")]
    if kern:
        lines += ["", "Device time per kernel (us), per rank:", "",
                  "| case | SMs | kernel | " + " | ".join(f"rank {r}" for r in range(len(kern[0]["per_kernel_us_by_rank"])))
                  + " |", "|---|---|---|" + "---|" * len(kern[0]["per_kernel_us_by_rank"])]
        for t in kern:
            for k in t["per_kernel_us"]:
                lines.append(md_row([t["case"], t["num_sms"] or "all", k]
                                    + [cell(r.get(k)) for r in t["per_kernel_us_by_rank"]]))
    return "\n".join(lines) + "\n"


def _plot(table, path):
    """GB/s per case (native: DeepEP's count over the communication kernels; torch: end to end)."""
    plt = pyplot()
    labels, vals, colors, whole = [], [], [], []
    for t in table:
        # native: DeepEP's GB/s (communication kernels), and over all kernels as a black tick
        v = t.get("comm_gbps_excl_local") if t["backend"] == "native" else t["e2e_gbps_excl_local"]
        labels.append(f"{t['backend']}\n{t['case']}\n{t['num_sms'] or 'all'} SMs" if t["backend"] == "native"
                      else f"{t['backend']}\n{t['case']}\n(e2e)")
        vals.append(v or 0.0)
        whole.append(t["kernel_gbps_excl_local"] if t["backend"] == "native" else None)
        colors.append("tab:green" if t["backend"] == "native" else "tab:gray")
    fig, ax = plt.subplots(figsize=(max(6, len(vals) * 1.2), 4))
    ax.bar(range(len(vals)), vals, color=colors)
    pts = [(i, w) for i, w in enumerate(whole) if w is not None]
    if pts:
        ax.scatter([i for i, _ in pts], [w for _, w in pts], marker="_", s=400, color="k",
                   label="native, over all kernels (epilogue included)")
    ax.axhline(320, color="tab:red", linestyle="--", label="target 320 GB/s")
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("GB/s per GPU, excl. local traffic\n(native: DeepEP's, comm kernels; torch: e2e)")
    ax.legend()
    save(fig, path, dpi=120)


def write_outputs(out: str, meta: dict, table: list, per_rank: list, p2p_table: str = "",
                  run: Optional[dict] = None) -> list:
    """bench_elastic_ep.{json,md,png} into ``out`` (``run``: tools/_results.py's run record for the JSON);
    returns the paths written."""
    return write_results(out, "bench_elastic_ep", dict(meta=meta, table=table, per_rank=per_rank),
                         _markdown(table, meta) + p2p_table, lambda path: _plot(table, path), run=run)
