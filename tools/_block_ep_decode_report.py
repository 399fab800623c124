"""The decode block's report (tools/_block_ep_decode.py runs the block and imports these): the run's
record from every rank's results (``summarize``: the slowest rank's median times per configuration and
runtime, the checks over every rank and the verdict ``ok``), its markdown (``render``: a header, the step
table and the checks) and the files ``--out`` writes (``block_elastic_ep_decode.{json,md,png}``, through
tools/_results.py: the plot drawn only where matplotlib is installed)."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence

import torch

from _results import pyplot, run_record, save, write_results

NAME = "block_elastic_ep_decode"
BITWISE_CHECKS = ("ll_reference", "v2_reference", "same_rows", "pow2", "nohook", "repeatable", "graph")


def _all_true(values) -> Optional[bool]:
    """True/False over the non-None booleans of ``values`` (dicts flattened); None when there are none."""
    flat = []
    for v in values:
        flat.extend(v.values() if isinstance(v, dict) else [v])
    flat = [bool(v) for v in flat if v is not None]
    return all(flat) if flat else None


def summarize(cfg: Any, results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The run's record (``cfg``: the run's ``DecodeConfig``): per configuration and runtime the slowest rank's
    medians; the checks over every rank (``ok`` False when any of them failed)."""
    r0 = results[0]
    rows = []
    configs = [c for r in results for c in r["configs"]]
    for i, c0 in enumerate(r0["configs"]):
        per_rank = [r["configs"][i] for r in results]
        slowest = {}
        for name in c0["runtimes"]:
            figs = [c["runtimes"][name] for c in per_rank]
            slowest[name] = {k: (max(f[k] for f in figs) if figs[0][k] is not None else None) for k in figs[0]}
        for name, fig in slowest.items():
            rows.append(dict(tokens=c0["tokens"], dispatch=c0["dispatch"], micro_batches=c0["micro_batches"],
                             runtime=name, name=r0["runtimes"][name], **fig,
                             vs_v2=slowest["v2"]["eager_ms"] / fig["eager_ms"]))
    checks: Dict[str, Any] = {k: _all_true(c["checks"].get(k) for c in configs) for k in BITWISE_CHECKS}
    lv = [c["checks"]["ll_vs_v2"] for c in configs]
    checks["ll_vs_v2"] = dict(runtime=lv[0]["runtime"], differ=sum(x["differ"] for x in lv),
                              elements=sum(x["elements"] for x in lv),
                              max_relative=max(x["max_relative"] for x in lv), error=max(x["error"] for x in lv))
    checks["row_invariant"] = _all_true(c["checks"]["row_invariant"] for c in configs)
    ok = all(checks[k] is not False for k in BITWISE_CHECKS) and checks["ll_reference"] is True and \
        checks["ll_vs_v2"]["error"] <= 1.0
    env = dict(torch=torch.__version__, device=r0["device_name"], world=cfg.world, group=r0["group"], gemm=r0["gemm"],
               native_missing=r0["native_missing"], graph_missing=r0["graph_missing"], runtimes=r0["runtimes"],
               max_micro_batch=cfg.max_micro_batch, capacity=cfg.capacity)
    try:
        import elastic_ep

        env["elastic_ep"] = elastic_ep.__version__
    except ImportError:
        pass
    config = asdict(cfg)
    config.pop("return_outputs")
    return dict(config=config, environment=env, steps=rows, checks=checks, ok=bool(ok),
                per_rank=[{k: v for k, v in r.items() if k != "outputs"} for r in results])


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def _verdict(v: Optional[bool], yes: str = "bitwise equal") -> str:
    return "not run" if v is None else yes if v else "DIFFERENT"


def render(record: Dict[str, Any]) -> str:
    """The record as markdown: a header, the step table and the checks."""
    cfg, env, checks = record["config"], record["environment"], record["checks"]
    moe = cfg["moe"]
    where = (f"{cfg['world']} CPU processes over gloo (CPU times, not a benchmark)" if cfg["device"] == "cpu"
             else f"{cfg['world']} rank(s) on {env['device']}")
    gemm = "torch._grouped_mm over cumsum(recv_count)" if env["gemm"] == "grouped" else "a matmul per expert"
    lines = [
        f"DeepSeek-V3 MoE layer, decode, EP {cfg['world']}: {where}; torch {env['torch']}, elastic_ep "
        f"{env.get('elastic_ep', '?')}",
        f"top-{moe['num_topk']} of {moe['num_experts']} experts, hidden {moe['hidden']}, intermediate "
        f"{moe['intermediate']}; each step's tokens in two micro-batches, num_max_dispatch_tokens_per_rank "
        f"{env['max_micro_batch']}; expert GEMMs: {gemm} on {env['capacity']} compact rows",
        "low-latency step: dispatch(mb0), dispatch(mb1), hook0, experts(mb0), combine(mb0), hook1, experts(mb1), "
        "combine(mb1), combine hooks; no-hook: one micro-batch after the other; V2: one after the other",
        f"median of {cfg['iters']} steps after {cfg['warmup']} warm-up; the slowest rank's figures; speed-up: "
        "V2's step ms over the row's (eager)",
    ]
    if env["native_missing"]:
        lines.append(f"native runtimes not run: {env['native_missing']}")
    if env["graph_missing"]:
        lines.append(f"CUDA graph not run: {env['graph_missing']}")
    lines += ["", "| tokens/rank | micro-batches | dispatch | runtime | step ms | no-hook ms | CUDA graph ms | "
                  "speed-up vs V2 |", "|---:|---|---|---|---:|---:|---:|---:|"]
    for r in record["steps"]:
        lines.append(f"| {r['tokens']} | {' + '.join(map(str, r['micro_batches']))} | {r['dispatch']} | {r['name']} | "
                     f"{_ms(r['eager_ms'])} | {_ms(r['nohook_ms'])} | {_ms(r['graph_ms'])} | {r['vs_v2']:.2f} x |")
    lv = checks["ll_vs_v2"]
    ri = checks["row_invariant"]
    lines += [
        "", "Checks (every rank, every configuration):",
        "- low-latency == reference (all-gathered inputs, the experts on the same packed rows, fp32 `acc + y * w` "
        "in lane order; rows past recv_count NaN): " + _verdict(checks["ll_reference"]),
        "- V2 == V2-order reference (rows weighted and rounded to BF16, then summed in fp32): "
        + _verdict(checks["v2_reference"]),
        "- low-latency, V2 and reference give the GEMMs the same rows and get the same expert outputs: "
        + _verdict(checks["same_rows"]),
        "- low-latency == V2 with power-of-two routing weights (products exact in both): " + _verdict(checks["pow2"]),
        f"- low-latency vs V2 with the real weights ({lv['runtime']}): {lv['differ']} of {lv['elements']} elements "
        f"differ, by at most {lv['max_relative']:.2g} x sum_k |w_k y_k|, {100 * lv['error']:.1f} % of the bound "
        f"2^-7 (sum_k |w_k y_k| + |out|) "
        + ("(passed)" if lv["error"] <= 1 else "(FAILED)")
        + ": V2's combine takes BF16 rows, so the weight is applied and rounded to BF16 before the sum, while "
          "the low-latency combine multiplies in fp32",
        "- low-latency with hooks == without: " + _verdict(checks["nohook"]),
        "- every timed step == the checked one: " + _verdict(checks["repeatable"]),
        "- CUDA-graph replay == eager: " + _verdict(checks["graph"]),
        "- expert rows alone == in their batch (reported, not relied on): "
        + ("not run" if ri is None else "yes" if ri else "no (the reference uses the packed rows)"),
    ]
    return "\n".join(lines) + "\n"


def _plot(record: Dict[str, Any], path: str) -> None:
    plt = pyplot()
    rows = record["steps"]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * len(rows)))
    labels = [f"{r['tokens']} tok {r['dispatch']}, {r['runtime']}" for r in rows]
    y = list(range(len(rows)))
    h = 0.27
    for off, key, color in ((-h, "eager_ms", "tab:blue"), (0, "nohook_ms", "tab:gray"), (h, "graph_ms", "tab:green")):
        ax.barh([v + off for v in y], [r[key] or 0 for r in rows], height=h, color=color,
                label={"eager_ms": "step (hooks)", "nohook_ms": "no hooks", "graph_ms": "CUDA graph"}[key])
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode step (slowest rank, median)")
    ax.set_title("MoE layer decode step")
    ax.legend(fontsize=8, loc="lower right")
    save(fig, path)


def write_outputs(out: str, record: Dict[str, Any], table: str, command: str) -> List[str]:
    """``block_elastic_ep_decode.{json,md,png}`` in ``out``; the paths written."""
    return write_results(out, NAME, dict(record, command=command),
                         f"# elastic_ep model block: decode\n\n`{command}`\n\n{table}", lambda p: _plot(record, p),
                         quiet=True, run=run_record(command))
