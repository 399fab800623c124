#!/usr/bin/env python3
"""elastic_ep's model block: a DeepSeek-V3 MoE layer on elastic_ep, against the same layer on the
torch.distributed reference runtime, at prefill sizes and (``--mode decode``) at decode sizes.

    python tools/block_elastic_ep.py [--mode all|prefill|decode] [--tokens 4096[,1024,...]] [--experts 256]
                                     [--hidden 7168] [--intermediate 2048] [--iters 20] [--warmup 3] [--world W]
                                     [--out DIR] [--device auto|cuda|cpu] [--gemm auto|grouped|loop]
                                     [--overlap-sms 24] [--seed 0] [--timeout 900] [--decode-tokens 1,32,128]

``--mode all`` (the default, what tools/gpu.sh's ``blocks`` step and so tools/run.sh run) runs the
prefill block described below, then the decode block with the same shape, device, ranks, iterations,
GEMMs and output folder (``--decode-tokens``: its tokens per rank; its own defaults otherwise);
``--mode prefill`` the first only; ``--mode decode [decode options]`` the second only, with the options
of tools/_block_ep_decode.py, whose docstring describes it: the low-latency API
(``low_latency_dispatch`` -> grouped expert GEMMs on the packed layout -> ``low_latency_combine``, two
micro-batches overlapped through the receive hooks, eager and as a CUDA graph) against V2's API and a
torch reference, bit for bit; it writes ``block_elastic_ep_decode.{md,json,png}`` beside this block's
files. The exit status is 0 only when every block that ran passed.

It starts ``--world`` ranks (tools/_launch.py; default one per GPU). Each rank holds
``experts / world`` experts and ``--tokens`` tokens, and runs the layer of tools/_block_ep_moe_layer.py:
router (DeepSeek-V3's grouped top-8 of 256) -> FP8 cast -> ``dispatch`` in expand mode (segments
aligned to 128 rows) -> the experts' SwiGLU FFN as a grouped GEMM -> rows times their routing
weights -> ``combine``. Both runtimes are ``ElasticBuffer``s made with ``deterministic=True``:

* **elastic_ep** (``backend="native"``): the package's kernels, on an NCCL window with one GPU per
  rank, or on the CUDA-IPC window (``window="ipc"``) when ranks share GPUs;
* **torch reference** (``backend="torch"``): ``all_to_all_single`` plus permutes. NCCL cannot run two
  ranks on one GPU, so with shared GPUs the group is gloo and this runtime moves the rows through
  host memory: its output is still compared bit for bit, but its time is no baseline.

For each ``--tokens`` value it measures (CUDA events, median of ``--iters`` after ``--warmup``, ranks
lined up by a barrier before each iteration, the slowest rank reported) the layer and its stages:
router + FP8 cast, dispatch (including its CPU sync), experts (dequantise + GEMMs + weights), combine;
the communication share is (dispatch + combine) / layer and the speed-up is the reference's layer time
over elastic_ep's. Then two micro-batches of half the tokens each, once one after the other and once
pipelined (``EPMoELayer.forward_overlapped``: one computes its experts while the next dispatches and
the previous combines, through ``previous_event``, ``async_with_compute_stream`` and the buffer's
communication stream), with the communication kernels on ``--overlap-sms`` SMs in both runs.

Checks, each failing the run (exit status 1): the two runtimes' outputs are bitwise equal (the same
rows reach the same GEMMs, and combine's summation order is fixed); every repetition of a runtime is
bitwise equal to its first; each rank's output matches a plain single-process computation of its
tokens (``reference_forward``: no buffer, no padding, experts regenerated one at a time) within the
tolerance documented at ``reference_error``; the pipelined micro-batches are bitwise equal to the
sequential ones.

Without a GPU it says what it would do on one and runs the layer on the CPU with the torch runtime
over gloo (2 ranks, 64 tokens each, hidden 256, intermediate 128, 32 experts), checked against the
reference the same way; the CPU times are not a benchmark. ``--out DIR`` writes the table
(``block_elastic_ep.md``), every figure (``.json``) and a plot (``.png``, with matplotlib), through
tools/_results.py. The ranks run under tools/env.sh's settings (NVLink multicast off).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _block_ep_moe_layer import (REFERENCE_TOLERANCE, EPMoELayer, Marks, MoEConfig, bitwise_equal,  # noqa: E402
                                 expert_weights, local_expert_weights, make_tokens, reference_error,
                                 reference_forward, router_weights)
from _launch import RankFailure, parse_run, run_ranks  # noqa: E402
from _results import command_line, pyplot, run_record, save, write_results  # noqa: E402

PHASES = (("router", "start", "routed"), ("dispatch", "routed", "dispatched"),
          ("experts", "dispatched", "computed"), ("combine", "computed", "end"))
GPU_DEFAULTS = dict(tokens="4096", experts=256, hidden=7168, intermediate=2048, iters=20, warmup=3)
CPU_DEFAULTS = dict(tokens="64", experts=32, hidden=256, intermediate=128, iters=3, warmup=1, world=2)
CPU_MAX_WEIGHT_BYTES = 8 << 30  # all ranks' experts live in this machine's memory on the CPU

CPU_EXPLANATION = """\
No usable CUDA GPU: running the CPU fallback. On GPUs this block runs a DeepSeek-V3 MoE layer (4096
tokens per rank, hidden 7168, top-8 of 256 experts, intermediate 2048), one rank per GPU: router ->
FP8 cast -> elastic_ep's native dispatch into per-expert segments aligned to 128 rows ->
torch._grouped_mm SwiGLU experts -> combine, against the same layer on the torch.distributed
reference runtime (all_to_all_single + permutes), whose output must be bitwise equal; it reports the
layer time, the communication share, the speed-up and the gain from pipelining two micro-batches.
Here: the same layer, small, with the torch runtime over gloo on CPU processes, checked against a
plain single-process computation; the times are CPU times, not a benchmark."""


# ------------------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class BlockConfig:
    """One run of the block (what every rank receives)."""

    moe: MoEConfig
    world: int
    tokens: Tuple[int, ...]
    device: str  # "cuda" or "cpu"
    iters: int
    warmup: int
    gemm: str = "auto"
    overlap_sms: int = 24
    timeout_s: float = 900.0
    #: Tests only: return every output (as int16 numpy arrays) with the figures.
    return_outputs: bool = False

    def validate(self) -> None:
        """ValueError naming the first argument that does not fit, before anything starts."""
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"world: expected a positive int, got {self.world!r}")
        self.moe.validate(self.world)
        if not self.tokens or any(not isinstance(t, int) or t < 1 for t in self.tokens):
            raise ValueError(f"tokens: expected positive ints, got {self.tokens!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device: expected 'cuda' or 'cpu', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was asked for, but torch sees no CUDA device")
        if not isinstance(self.iters, int) or self.iters < 1:
            raise ValueError(f"iters: expected a positive int, got {self.iters!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup: expected an int >= 0, got {self.warmup!r}")
        if self.gemm not in ("auto", "grouped", "loop"):
            raise ValueError(f"gemm: expected 'auto', 'grouped' or 'loop', got {self.gemm!r}")
        if not isinstance(self.overlap_sms, int) or self.overlap_sms < 0:
            raise ValueError(f"overlap_sms: expected an int >= 0 (0: every SM), got {self.overlap_sms!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout: expected > 0 seconds, got {self.timeout_s!r}")
        m = self.moe
        weight_bytes = m.num_experts * 3 * m.hidden * m.intermediate * 2
        if self.device == "cpu" and weight_bytes > CPU_MAX_WEIGHT_BYTES:
            raise ValueError(f"experts/hidden/intermediate: on the CPU the experts' weights ({weight_bytes / 2**30:.1f} "
                             f"GiB) must stay under {CPU_MAX_WEIGHT_BYTES >> 30} GiB; use smaller shapes")

    @property
    def max_tokens(self) -> int:
        return max(self.tokens)

    @property
    def shares_gpus(self) -> bool:
        """Ranks share GPUs (more ranks than devices): gloo group, CUDA-IPC window."""
        return self.device == "cuda" and self.world > torch.cuda.device_count()


def _parse_tokens(text: str) -> Tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"tokens: expected comma-separated ints, got {text!r}") from None


def build_config(args: argparse.Namespace) -> BlockConfig:
    """The run ``args`` asks for, with the defaults of the device it runs on; ValueError on bad input."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    defaults = dict(GPU_DEFAULTS, world=max(torch.cuda.device_count(), 1)) if device == "cuda" else CPU_DEFAULTS

    def pick(name: str):
        v = getattr(args, name)
        return defaults[name] if v is None else v

    moe = MoEConfig(hidden=pick("hidden"), intermediate=pick("intermediate"), num_experts=pick("experts"),
                    seed=args.seed)
    cfg = BlockConfig(moe=moe, world=pick("world"), tokens=_parse_tokens(str(pick("tokens"))), device=device,
                     iters=pick("iters"), warmup=pick("warmup"), gemm=args.gemm, overlap_sms=args.overlap_sms,
                     timeout_s=args.timeout)
    cfg.validate()
    return cfg


# ------------------------------------------------------------------------------------------ one rank
def _make_buffers(cfg: BlockConfig, device: torch.device) -> Tuple[Dict[str, Any], Dict[str, str], Optional[str]]:
    """``({runtime: ElasticBuffer}, {runtime: description}, why the native runtime is missing)``.
    Collective: every rank creates the same buffers in the same order."""
    import torch.distributed as dist

    import elastic_ep

    group = dist.group.WORLD
    kw = dict(num_max_tokens_per_rank=cfg.max_tokens, hidden=cfg.moe.hidden, num_topk=cfg.moe.num_topk,
              use_fp8_dispatch=True, deterministic=True)
    buffers, names, missing = {}, {}, None
    if device.type == "cuda" and elastic_ep.native_available():
        window = "ipc" if cfg.shares_gpus else "auto"
        buffers["native"] = elastic_ep.ElasticBuffer(group, backend="native", window=window, **kw)
        names["native"] = "elastic_ep native" + (" (CUDA-IPC window)" if window == "ipc" else "")
    elif device.type == "cuda":
        missing = "elastic_ep's native backend is unavailable (built without CUDA kernels?)"
    else:
        missing = "no GPU: the native kernels need one"
    buffers["torch"] = elastic_ep.ElasticBuffer(group, backend="torch", **kw)
    via_host = buffers["torch"].device.type != device.type
    names["torch"] = "torch reference" + (" (gloo, via host memory)" if via_host else "")
    return buffers, names, missing


def _line_up(device: torch.device) -> None:
    """Every rank idle and at the same point: an iteration's time then starts together everywhere."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def _time_layer(layer: EPMoELayer, x: torch.Tensor, cfg: BlockConfig):
    """``(median ms per stage and layer, first output, every repetition bitwise equal to it)``."""
    samples: Dict[str, List[float]] = {name: [] for name, _, _ in PHASES}
    samples["layer"] = []
    first, repeatable = None, True
    for it in range(cfg.warmup + cfg.iters):
        _line_up(layer.device)
        marks = Marks(layer.device)
        out = layer.forward(x, marks=marks)
        if it >= cfg.warmup:
            for name, a, b in PHASES:
                samples[name].append(marks.ms(a, b))
            samples["layer"].append(marks.ms("start", "end"))
        if first is None:
            first = out
        else:
            repeatable &= bitwise_equal(out, first)
    return {f"{k}_ms": statistics.median(v) for k, v in samples.items()}, first, repeatable


def _time_overlap(layer: EPMoELayer, x: torch.Tensor, cfg: BlockConfig):
    """Two micro-batches, sequential then pipelined: ``(figures, sequential outputs, pipelined outputs)``;
    ``figures["bitwise"]``: every pipelined run equals the first sequential one, ``figures["repeatable"]``:
    every sequential run does."""
    T = x.shape[0]
    halves = [x[:T - T // 2], x[T - T // 2:]]
    seq_ms, ovl_ms = [], []
    first: Optional[List[torch.Tensor]] = None
    bitwise = repeatable = True
    for it in range(cfg.warmup + cfg.iters):
        _line_up(layer.device)
        m = Marks(layer.device)
        m.mark("start")
        seq = [layer.forward(h, num_sms=cfg.overlap_sms) for h in halves]
        m.mark("end")
        _line_up(layer.device)
        m2 = Marks(layer.device)
        m2.mark("start")
        ovl = layer.forward_overlapped(halves, num_sms=cfg.overlap_sms)
        m2.mark("end")
        if it >= cfg.warmup:
            seq_ms.append(m.ms("start", "end"))
            ovl_ms.append(m2.ms("start", "end"))
        first = seq if first is None else first
        repeatable &= all(bitwise_equal(a, b) for a, b in zip(first, seq))
        bitwise &= len(ovl) == len(first) and all(bitwise_equal(a, b) for a, b in zip(first, ovl))
    figures = dict(micro_batches=[h.shape[0] for h in halves], num_sms=cfg.overlap_sms,
                   sequential_ms=statistics.median(seq_ms), overlapped_ms=statistics.median(ovl_ms),
                   bitwise=bitwise, repeatable=repeatable)
    return figures, first, ovl


def _as_numpy(t: torch.Tensor):
    # BF16 has no numpy type: its bits travel as int16 (no torch pickling between processes).
    return t.detach().cpu().contiguous().view(torch.int16).numpy()


def run_rank(rank: int, world: int, rdzv: str, cfg: BlockConfig) -> Dict[str, Any]:
    """One rank of the block (under tools/_launch.py, or tests/_dist.run_workers): set up, measure, check.

    Returns the rank's figures and checks as plain Python values (see ``summarize``).
    """
    import torch.distributed as dist

    t0 = time.monotonic()
    from elastic_ep.demo import init_rank

    device, _ = init_rank(rank, world, rdzv, cfg.device)
    moe = cfg.moe
    gate, bias = router_weights(moe, device)
    w13, w2 = local_expert_weights(moe, rank, world, device)
    x_all = make_tokens(moe, rank, cfg.max_tokens, device)
    buffers, names, missing = _make_buffers(cfg, device)
    layers = {name: EPMoELayer(moe, gate, bias, w13, w2, buf, gemm=cfg.gemm) for name, buf in buffers.items()}
    primary = "native" if "native" in layers else "torch"
    res: Dict[str, Any] = dict(
        rank=rank, device=str(device), group=dist.get_backend(), runtimes=names, native_missing=missing,
        gemm=layers[primary].gemm, configs=[],
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU")
    outputs: Dict[int, Dict[str, Any]] = {}
    if rank == 0:
        print(f"[rank 0] set up in {time.monotonic() - t0:.1f} s: {world} rank(s), {', '.join(names.values())}",
              flush=True)
    for T in cfg.tokens:
        x = x_all[:T]
        entry: Dict[str, Any] = dict(tokens=T, layers={})
        outs = {}
        for name, layer in layers.items():
            figures, outs[name], repeatable = _time_layer(layer, x, cfg)
            entry["layers"][name] = dict(figures, repeatable=repeatable)
        entry["native_equals_torch"] = bitwise_equal(outs["native"], outs["torch"]) if "native" in outs else None
        ref, magnitude = reference_forward(x, gate, bias, lambda e: expert_weights(moe, e, device), moe)
        entry["reference_error"] = reference_error(outs[primary], ref, magnitude)
        entry["overlap"] = None
        if T >= 2:
            figures, seq, ovl = _time_overlap(layers[primary], x, cfg)
            entry["overlap"] = dict(figures, runtime=primary)
        if cfg.return_outputs:
            outputs[T] = {name: _as_numpy(o) for name, o in outs.items()}
            if T >= 2:
                outputs[T]["sequential"] = [_as_numpy(o) for o in seq]
                outputs[T]["overlapped"] = [_as_numpy(o) for o in ovl]
        res["configs"].append(entry)
        if rank == 0:
            print(f"[rank 0] {T} tokens per rank measured", flush=True)
    for buf in buffers.values():
        buf.destroy()
    dist.destroy_process_group()
    if cfg.return_outputs:
        res["outputs"] = outputs
    return res


# ------------------------------------------------------------------------------------------ launcher
def launch(cfg: BlockConfig) -> List[Dict[str, Any]]:
    """Runs ``run_rank`` on ``cfg.world`` spawned processes; returns their results by rank.

    Raises:
        RankFailure: a rank failed (its traceback included), died, or the run outlived
            ``cfg.timeout_s``; the remaining ranks are killed (10 s after the first failure, since
            they may wait for the failed one until their own timeouts).
    """
    return run_ranks(run_rank, cfg.world, cfg, timeout=cfg.timeout_s, grace_s=10)


# ------------------------------------------------------------------------------------------ report
def summarize(cfg: BlockConfig, results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The run's record: per configuration the slowest rank's figures per runtime, the overlap, and the
    checks over every rank (``ok`` is False when any check failed)."""
    r0 = results[0]
    rows, overlap = [], []
    for i, T in enumerate(cfg.tokens):
        per_rank = [r["configs"][i] for r in results]
        slowest = {}
        for name in per_rank[0]["layers"]:
            fig = max((c["layers"][name] for c in per_rank), key=lambda f: f["layer_ms"])
            slowest[name] = fig
            rows.append(dict(tokens=T, runtime=name, name=r0["runtimes"][name],
                             comm_share=(fig["dispatch_ms"] + fig["combine_ms"]) / fig["layer_ms"],
                             **{k: v for k, v in fig.items() if k != "repeatable"}))
        if "native" in slowest:
            native_row = next(r for r in rows if r["tokens"] == T and r["runtime"] == "native")
            native_row["speedup"] = slowest["torch"]["layer_ms"] / slowest["native"]["layer_ms"]
        ov = [c["overlap"] for c in per_rank if c["overlap"] is not None]
        if ov:
            seq, ovl = max(o["sequential_ms"] for o in ov), max(o["overlapped_ms"] for o in ov)
            overlap.append(dict(tokens=T, runtime=ov[0]["runtime"], name=r0["runtimes"][ov[0]["runtime"]],
                                micro_batches=ov[0]["micro_batches"], num_sms=ov[0]["num_sms"],
                                sequential_ms=seq, overlapped_ms=ovl, gain=seq / ovl))
    configs = [c for r in results for c in r["configs"]]
    bitwise = [c["native_equals_torch"] for c in configs if c["native_equals_torch"] is not None]
    checks = dict(
        native_equals_torch=all(bitwise) if bitwise else None,
        repeatable=all(f["repeatable"] for c in configs for f in c["layers"].values())
        and all(c["overlap"]["repeatable"] for c in configs if c["overlap"] is not None),
        reference_error=max(c["reference_error"] for c in configs),
        overlap_bitwise=all(c["overlap"]["bitwise"] for c in configs if c["overlap"] is not None),
    )
    ok = (checks["native_equals_torch"] is not False and checks["repeatable"] and checks["reference_error"] <= 1.0
          and checks["overlap_bitwise"])
    env = dict(torch=torch.__version__, device=r0["device_name"], world=cfg.world, group=r0["group"],
               shares_gpus=cfg.shares_gpus, gemm=r0["gemm"], native_missing=r0["native_missing"],
               runtimes=r0["runtimes"])
    try:
        import elastic_ep

        env["elastic_ep"] = elastic_ep.__version__
    except ImportError:
        pass
    config = asdict(cfg)
    config.pop("return_outputs")
    return dict(config=config, environment=env, layer=rows, overlap=overlap, checks=checks, ok=bool(ok),
                per_rank=[{k: v for k, v in r.items() if k != "outputs"} for r in results])


def _fmt_pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def render(record: Dict[str, Any]) -> str:
    """The record as markdown: a header, the layer table, the overlap table and the checks."""
    cfg, env, checks = record["config"], record["environment"], record["checks"]
    moe = cfg["moe"]
    where = (f"{cfg['world']} rank(s) on {env['device']}" + (" (ranks share GPUs: times are not a benchmark)"
                                                             if env["shares_gpus"] else ""))
    if cfg["device"] == "cpu":
        where = f"{cfg['world']} CPU processes over gloo (CPU times, not a benchmark)"
    lines = [
        f"DeepSeek-V3 MoE layer, EP {cfg['world']}: {where}; torch {env['torch']}, elastic_ep "
        f"{env.get('elastic_ep', '?')}",
        f"top-{moe['num_topk']} of {moe['num_experts']} experts ({moe['num_groups']} groups, best "
        f"{moe['num_topk_groups']} kept, scaling {moe['routed_scaling_factor']}), hidden {moe['hidden']}, "
        f"intermediate {moe['intermediate']}, FP8 dispatch (e4m3, FP32 scale per 128), segments aligned to "
        f"{moe['expert_alignment']}, expert GEMMs: {'torch._grouped_mm' if env['gemm'] == 'grouped' else 'a matmul per expert'}",
        f"median of {cfg['iters']} iterations after {cfg['warmup']} warm-up; the slowest rank's figures",
    ]
    if env["native_missing"]:
        lines.append(f"elastic_ep's native runtime not run: {env['native_missing']}")
    lines += ["", "| tokens/rank | runtime | layer ms | router ms | dispatch ms | experts ms | combine ms | "
              "comm share | speed-up |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in record["layer"]:
        speedup = f"{r['speedup']:.2f} x" if "speedup" in r else "-"
        lines.append(f"| {r['tokens']} | {r['name']} | {r['layer_ms']:.3f} | {r['router_ms']:.3f} | "
                     f"{r['dispatch_ms']:.3f} | {r['experts_ms']:.3f} | {r['combine_ms']:.3f} | "
                     f"{_fmt_pct(r['comm_share'])} | {speedup} |")
    if record["overlap"]:
        lines += ["", "Two micro-batches, one after the other vs pipelined (one computes while the other "
                      "communicates), communication on the same SMs in both:", "",
                  "| tokens/rank | runtime | micro-batches | comm SMs | sequential ms | overlapped ms | gain |",
                  "|---:|---|---|---:|---:|---:|---:|"]
        for o in record["overlap"]:
            # the torch runtime runs no kernels of its own: an SM count means nothing to it
            sms = "-" if o["runtime"] == "torch" else (o["num_sms"] or "DeepEP model")
            lines.append(f"| {o['tokens']} | {o['name']} | {' + '.join(map(str, o['micro_batches']))} | {sms} | "
                         f"{o['sequential_ms']:.3f} | {o['overlapped_ms']:.3f} | {o['gain']:.2f} x |")
    ne = checks["native_equals_torch"]
    lines += ["", "Checks (every rank, every configuration):",
              "- elastic_ep == torch reference: " + ("not run" if ne is None else
                                                     "bitwise equal" if ne else "DIFFERENT"),
              "- repetitions of each runtime: " + ("bitwise equal" if checks["repeatable"] else "DIFFERENT"),
              f"- vs the single-process reference: largest error {_fmt_pct(checks['reference_error'])} of the "
              f"tolerance {REFERENCE_TOLERANCE:g} x (sum_k |term_k| + its mean) "
              + ("(passed)" if checks["reference_error"] <= 1 else "(FAILED)"),
              "- pipelined == sequential micro-batches: " + ("bitwise equal" if checks["overlap_bitwise"]
                                                              else "DIFFERENT")]
    return "\n".join(lines) + "\n"


def _plot(record: Dict[str, Any], path: str) -> None:
    plt = pyplot()
    rows = record["layer"]
    fig, axes = plt.subplots(1, 2 if record["overlap"] else 1, figsize=(12, 1.2 + 0.5 * len(rows)), squeeze=False)
    ax = axes[0][0]
    labels = [f"{r['tokens']} tok, {r['runtime']}" for r in rows]
    left = [0.0] * len(rows)
    for name, _, _ in PHASES:
        widths = [r[f"{name}_ms"] for r in rows]
        ax.barh(labels, widths, left=left, label=name)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()  # rows top-down, in the table's order
    ax.set_xlabel("ms (slowest rank, median)")
    ax.set_title("layer time by stage")
    ax.legend(fontsize=8, loc="lower right")
    if record["overlap"]:
        ax = axes[0][1]
        labels, values = [], []
        for o in record["overlap"]:
            labels += [f"{o['tokens']} tok, sequential", f"{o['tokens']} tok, overlapped"]
            values += [o["sequential_ms"], o["overlapped_ms"]]
        ax.barh(labels, values, color=["tab:gray", "tab:green"] * len(record["overlap"]))
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        ax.set_title("two micro-batches")
    save(fig, path)


def write_outputs(out: str, record: Dict[str, Any], table: str, command: str) -> List[str]:
    """``block_elastic_ep.{json,md,png}`` in ``out`` (the plot only with matplotlib); the paths written."""
    return write_results(out, "block_elastic_ep", dict(record, command=command),
                         f"# elastic_ep model block\n\n`{command}`\n\n{table}", lambda path: _plot(record, path),
                         quiet=True, run=run_record(command))


# ------------------------------------------------------------------------------------------ main
MODES = ("all", "prefill", "decode")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/block_elastic_ep.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="all", choices=MODES,
                   help="all: prefill then decode; decode: see python tools/block_elastic_ep.py --mode decode --help")
    p.add_argument("--decode-tokens", default=None, help="--mode all: the decode block's tokens per rank "
                                                         "(GPU 1,32,128, CPU 1,8,32)")
    p.add_argument("--tokens", default=None, help="tokens per rank, comma-separated for several configurations "
                                                  "(GPU 4096, CPU 64)")
    p.add_argument("--experts", type=int, default=None, help="routed experts (GPU 256, CPU 32)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size, a multiple of 128 (GPU 7168, CPU 256)")
    p.add_argument("--intermediate", type=int, default=None, help="MoE intermediate size (GPU 2048, CPU 128)")
    p.add_argument("--iters", type=int, default=None, help="measured iterations (GPU 20, CPU 3)")
    p.add_argument("--warmup", type=int, default=None, help="iterations before measuring (GPU 3, CPU 1)")
    p.add_argument("--world", type=int, default=None, help="ranks (GPU: one per GPU; more share GPUs; CPU 2)")
    p.add_argument("--out", default=None, help="also write block_elastic_ep.{md,json,png} into this folder")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="auto: cuda when torch sees a GPU")
    p.add_argument("--gemm", default="auto", choices=("auto", "grouped", "loop"),
                   help="expert GEMMs: torch._grouped_mm, a matmul per expert, or auto (grouped where it runs)")
    p.add_argument("--overlap-sms", type=int, default=24,
                   help="SMs of the communication kernels in the micro-batch runs (0: get_theoretical_num_sms, DeepEP's model)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights and tokens")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    return p


def _mode(argv: Sequence[str]) -> str:
    """The ``--mode`` of a command line (exit status 2 for an unknown one), before the mode's own parser."""
    p = argparse.ArgumentParser(prog="python tools/block_elastic_ep.py", add_help=False)
    p.add_argument("--mode", default="all", choices=MODES)
    return p.parse_known_args(argv)[0].mode


def _decode_argv(args: argparse.Namespace) -> List[str]:
    """The decode block's command line in ``--mode all``: this run's shared options."""
    argv = ["--mode", "decode", "--device", args.device, "--gemm", args.gemm, "--seed", str(args.seed),
            "--timeout", str(args.timeout)]
    for name in ("experts", "hidden", "intermediate", "world", "iters", "warmup"):
        if getattr(args, name) is not None:
            argv += [f"--{name}", str(getattr(args, name))]
    if args.decode_tokens is not None:
        argv += ["--tokens", args.decode_tokens]
    if args.out:
        argv += ["--out", args.out]
    return argv


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The block's command line: 0 when every check passed, 1 otherwise, 2 for a bad option."""
    import _block_ep_decode as decode

    argv = list(sys.argv[1:] if argv is None else argv)
    if _mode(argv) == "decode":
        return decode.main(argv)
    args, cfg = parse_run(_parser(), argv, build_config)
    decode_run = None
    if args.mode == "all":
        # Checked before anything runs; a decode refusal (e.g. ranks sharing GPUs) skips only the decode block.
        dargv = _decode_argv(args)
        dargs = decode.parser().parse_args(dargv)
        try:
            decode_run = (dargs, decode.build_config(dargs), dargv)
        except ValueError as e:
            print(f"decode block not run: {e}")
    rc = _prefill(args, cfg, argv)
    if decode_run is not None:
        print()
        rc = max(rc, decode.run(*decode_run))
    return rc


def _prefill(args: argparse.Namespace, cfg: BlockConfig, argv: Sequence[str]) -> int:
    """Runs a parsed prefill command line: launch, report, write."""
    if cfg.device == "cpu":
        print(CPU_EXPLANATION)
    elif cfg.shares_gpus:
        print(f"{cfg.world} ranks on {torch.cuda.device_count()} GPU(s): ranks share GPUs (gloo group, CUDA-IPC "
              "window); the torch reference moves its rows through host memory: correctness only, no timing "
              "comparison")
    m = cfg.moe
    print(f"elastic_ep block: EP {cfg.world} on {cfg.device}, tokens/rank {list(cfg.tokens)}, experts {m.num_experts}, "
          f"hidden {m.hidden}, intermediate {m.intermediate}, {cfg.iters} iterations after {cfg.warmup} warm-up",
          flush=True)
    try:
        results = launch(cfg)
    except RankFailure as e:
        print(f"block FAILED: {e}", file=sys.stderr)
        return 1
    record = summarize(cfg, results)
    table = render(record)
    print(table, end="")
    if args.out:
        command = command_line("python tools/block_elastic_ep.py", list(argv))
        written = write_outputs(args.out, record, table, command)
        print("wrote " + ", ".join(written))
    print("block OK" if record["ok"] else "block FAILED: a check failed (above)")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
