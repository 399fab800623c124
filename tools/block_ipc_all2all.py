#!/usr/bin/env python3
"""ipc_all2all's model block: a Ulysses (sequence-parallel) attention layer of a video DiT on
ipc_all2all, against the NCCL path.

    python tools/block_ipc_all2all.py [--world W] [--tokens 8k,16k,32k,64k,128k] [--heads 32] [--head-dim 128]
                                      [--batch 1] [--uneven] [--warmup 3] [--iters 10] [--no-fp8] [--cpu] [--out DIR]

It spawns ``W`` processes (tools/_launch.py; default: one per GPU). Each holds ``tokens / W`` tokens of
the sequence and runs the layer of tools/_block_ulysses_layer.py: QKV projection -> ``send_recv_heads`` of q, k, v ->
flash ``scaled_dot_product_attention`` over the whole sequence with ``H / W`` heads ->
``gather_heads`` -> output projection, in bf16 with LTX-2's attention shape (32 heads x 128).
Three ways, in the same run and on the same inputs:

* ``nccl``: the baseline, permute -> ``torch.distributed.all_to_all_single`` -> permute;
* ``ipc``: ipc_all2all, built with LTX's constructor (``All2All(rank, W, seqlen, hidden, num_sms,
  torch.bfloat16, group=group)``), zero-copy outputs;
* ``ipc fp8``: ipc_all2all with fp8 on the wire (``fp8_wire=True``: e4m3 and one fp32 scale per head
  vector; bf16 in and out, lossy).

The ``ipc`` output must be bitwise equal to the ``nccl`` output (the communication is exact and the
compute is the same code), and the ``ipc fp8`` output bitwise equal to the ``nccl`` path with the e4m3
round trip applied in plain torch before each exchange; the block asserts both and exits with 1
otherwise. Per size it reports the layer time (CUDA events after warm-up, the slowest rank's
median), the communication share of it (events around the exchanges, permutes included) and the
speed-up over the baseline. ``--out DIR`` writes ``block_ipc_all2all.md``, ``.json`` and ``.png``
(tools/_results.py).

With one GPU it runs W = 2 ranks sharing it, for correctness only (the kernels of the two processes
are time-sliced: the times mean nothing), and the baseline's collectives go over gloo through host
memory (NCCL refuses two ranks on one device). Without a GPU (or with ``--cpu``) it says what the
GPU run does and runs what it can on the CPU: the layer with the baseline's exchange over gloo,
checked bitwise against the same exchange done by all-gathers and slicing, and against the
unsharded layer on one process. The ranks run under tools/env.sh's settings (NVLink multicast off),
which every figure in BENCHMARKS.md was measured with; ``tools/gpu.sh`` (preset ``blocks`` or
``bench``) runs it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _block_ulysses_layer as U  # noqa: E402
from _launch import RankFailure, run_ranks  # noqa: E402
from _results import command_line, pyplot, run_record, save, utc_now, write_results  # noqa: E402

DEFAULT_TOKENS = "8k,16k,32k,64k,128k"
SHARED_TOKENS = "8k"   # ranks sharing one GPU: correctness only, one size
CPU_TOKENS = "1k"
PATHS = ("nccl", "ipc", "ipc_fp8")


def parse_tokens(text: str):
    """``"8k,16k,1000"`` -> ``[8192, 16384, 1000]``; ValueError naming a bad entry."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        try:
            n = int(p[:-1]) * 1024 if p.endswith("k") else int(p)
        except ValueError:
            raise ValueError(f"--tokens: {part!r} is not a token count (e.g. 8k or 8192)") from None
        if n <= 0:
            raise ValueError(f"--tokens: {part!r} must be positive")
        out.append(n)
    return out


# ------------------------------------------------------------------ the rank processes
def _gpu_rank(rank: int, world: int, rdzv: str, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    from ipc_all2all._ulysses import TorchComm, split_tokens
    from ipc_all2all.demo import init_rank

    dev, shared = init_rank(rank, world, rdzv, cpu=False)
    H, D, b = cfg["heads"], cfg["head_dim"], cfg["batch"]
    hidden = H * D
    plan = [(T, split_tokens(T, world, cfg["uneven"])) for T in cfg["tokens"]]
    seqlen = b * max(max(max(c), -(-T // world)) for T, c in plan)
    w = U.Weights(hidden, torch.bfloat16, dev)
    comms = {"nccl": TorchComm(rank, world, via_host=shared),
             "ipc": U.IpcComm(rank, world, seqlen, hidden, dist.group.WORLD)}
    fp8 = cfg["fp8"]
    check_fp8 = TorchComm(rank, world, via_host=shared, pre=U.qdq_e4m3)
    rows = []
    for T, counts in plan:
        for c in list(comms.values()) + [check_fp8]:
            c.set_counts(counts)
        x = U.layer_input(counts[rank], hidden, torch.bfloat16, dev, rank, batch=b)
        row = {"tokens": T, "counts": counts}
        # correctness first: the same input through every path
        ref = U.layer(x, w, comms["nccl"], H, D, flash=True)
        comms["ipc"].fp8_wire = False
        got = U.layer(x, w, comms["ipc"], H, D, flash=True)
        row["bitwise"] = bool(torch.equal(got.view(torch.int16), ref.view(torch.int16)))
        if fp8:
            comms["ipc"].fp8_wire = True
            got8 = U.layer(x, w, comms["ipc"], H, D, flash=True)
            ref8 = U.layer(x, w, check_fp8, H, D, flash=True)
            row["fp8_bitwise"] = bool(torch.equal(got8.view(torch.int16), ref8.view(torch.int16)))
            err = (got8.float() - ref.float()).abs().max()
            row["fp8_rel_err"] = float(err / ref.float().abs().max().clamp_min(1e-30))
        comms["ipc"].synchronize()
        del ref, got
        for path in PATHS:
            if path == "ipc_fp8" and not fp8:
                continue
            comm = comms["nccl" if path == "nccl" else "ipc"]
            if path != "nccl":
                comm.fp8_wire = path == "ipc_fp8"
            row[path] = _time_layer(x, w, comm, H, D, cfg["warmup"], cfg["iters"])
        rows.append(row)
    comms["ipc"].destroy()
    v = torch.cuda.nccl.version()
    nccl = "n/a (gloo)" if shared else ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {"rows": rows, "shared": shared, "device": torch.cuda.get_device_name(dev), "nccl": nccl}


def _time_layer(x, w, comm, H, D, warmup: int, iters: int) -> dict:
    """Median layer and communication time (ms) over ``iters`` forwards after ``warmup``, CUDA events."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        U.layer(x, w, comm, H, D, flash=True)
    torch.cuda.synchronize()
    dist.barrier()
    spans = []
    for _ in range(iters):
        marks = []

        def timed(fn, marks=marks):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = fn()
            e.record()
            marks.append((s, e))
            return out

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        U.layer(x, w, comm, H, D, flash=True, marks=timed)
        end.record()
        spans.append((start, end, marks))
    torch.cuda.synchronize()
    layer_ms = [s.elapsed_time(e) for s, e, _ in spans]
    comm_ms = [sum(a.elapsed_time(b) for a, b in m) for _, _, m in spans]
    dist.barrier()
    return {"layer_ms": statistics.median(layer_ms), "comm_ms": statistics.median(comm_ms)}


def _cpu_rank(rank: int, world: int, rdzv: str, cfg: dict) -> dict:
    import torch

    from ipc_all2all._ulysses import GatherComm, TorchComm, split_tokens
    from ipc_all2all.demo import init_rank

    init_rank(rank, world, rdzv, cpu=True)
    H, D, b = cfg["heads"], cfg["head_dim"], cfg["batch"]
    hidden, dtype = H * D, torch.float32
    w = U.Weights(hidden, dtype, "cpu")
    rows = []
    for T in cfg["tokens"]:
        counts = split_tokens(T, world, cfg["uneven"])
        xs = [U.layer_input(c, hidden, dtype, "cpu", r, batch=b) for r, c in enumerate(counts)]
        torch_path, by_gather = TorchComm(rank, world), GatherComm(rank, world)
        torch_path.set_counts(counts)
        by_gather.set_counts(counts)
        t0 = time.perf_counter()
        out = U.layer(xs[rank], w, torch_path, H, D, flash=False)
        layer_s = time.perf_counter() - t0
        other = U.layer(xs[rank], w, by_gather, H, D, flash=False)
        s = sum(counts[:rank])
        full = U.full_layer(torch.cat(xs, dim=1), w, H, D, flash=False)[:, s:s + counts[rank]]
        # the output shape ipc_all2all's send_recv_heads op promises here (its fake implementation)
        fake = torch.ops.ipc_all2all.send_recv_heads(torch.empty(b, counts[rank], H, D, device="meta"),
                                                     torch.empty(1, device="meta"), 0, T, world)
        rows.append({"tokens": T, "counts": counts, "layer_ms": layer_s * 1e3,
                     "bitwise_vs_gather": bool(torch.equal(out, other)),
                     "bitwise_vs_unsharded": bool(torch.equal(out, full)),
                     "max_abs_diff_vs_unsharded": float((out - full).abs().max()) if out.numel() else 0.0,
                     "scale": float(full.abs().max()) if full.numel() else 0.0,
                     "op_shape": list(fake.shape), "expected_shape": [b, T, H // world, D]})
    return {"rows": rows, "shared": False, "device": "cpu", "nccl": "n/a (gloo)"}


def _rank(rank: int, world: int, rdzv: str, cfg: dict) -> dict:
    """One rank under tools/_launch.py: the CPU check or the GPU run."""
    return (_cpu_rank if cfg["cpu"] else _gpu_rank)(rank, world, rdzv, cfg)


# ------------------------------------------------------------------ the report
def _gpu_plan() -> list:
    return [
        "On GPUs this block spawns W processes (--world, default one per GPU), each holding tokens / W tokens",
        "of a video-DiT sequence, and runs one self-attention layer three ways on the same bf16 inputs",
        "(32 heads x 128, 8k-128k tokens in total):",
        "  nccl    : QKV projection -> permute -> all_to_all_single (NCCL) -> permute -> flash attention",
        "            -> permute -> all_to_all_single -> permute -> output projection",
        "  ipc     : the same with ipc_all2all's send_recv_heads / gather_heads (LTX's All2All API,",
        "            one push kernel per exchange over NVLink, zero-copy outputs)",
        "  ipc fp8 : ipc_all2all with fp8 on the wire (e4m3 + one scale per head vector)",
        "It asserts that ipc's output is bitwise nccl's (and ipc fp8's bitwise nccl's with the e4m3 round",
        "trip applied in torch), and reports per size the layer time, the communication share and the",
        "speed-up. With one GPU it runs W = 2 ranks sharing it, for correctness only.",
    ]


def _merge(results: list, cfg: dict) -> list:
    """One row per size: the checks of every rank, the slowest rank's times."""
    rows = []
    for i, T in enumerate(cfg["tokens"]):
        per = [r["rows"][i] for r in results]
        row = {"tokens": T, "counts": per[0]["counts"]}
        if cfg["cpu"]:
            row.update(layer_ms=max(p["layer_ms"] for p in per),
                       bitwise_vs_gather=all(p["bitwise_vs_gather"] for p in per),
                       bitwise_vs_unsharded=all(p["bitwise_vs_unsharded"] for p in per),
                       rel_diff_vs_unsharded=max(p["max_abs_diff_vs_unsharded"] / max(p["scale"], 1e-30) for p in per),
                       op_shapes_ok=all(p["op_shape"] == p["expected_shape"] for p in per))
            rows.append(row)
            continue
        row["bitwise"] = all(p["bitwise"] for p in per)
        if cfg["fp8"]:
            row["fp8_bitwise"] = all(p["fp8_bitwise"] for p in per)
            row["fp8_rel_err"] = max(p["fp8_rel_err"] for p in per)
        for path in PATHS:
            if path not in per[0]:
                continue
            slow = max(per, key=lambda p: p[path]["layer_ms"])[path]
            row[path] = dict(slow, comm_share=slow["comm_ms"] / slow["layer_ms"] if slow["layer_ms"] else 0.0)
        row["speedup"] = row["nccl"]["layer_ms"] / row["ipc"]["layer_ms"]
        if "ipc_fp8" in row:
            row["speedup_fp8"] = row["nccl"]["layer_ms"] / row["ipc_fp8"]["layer_ms"]
        rows.append(row)
    return rows


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _table(data: dict) -> str:
    rows, cpu = data["rows"], data["mode"] == "cpu"
    if cpu:
        md = ["| tokens | per rank | torch path ms (gloo, CPU) | bitwise vs all-gather exchange | "
              "vs unsharded layer | ops' shapes |", "|---|---|---|---|---|---|"]
        for r in rows:
            md.append(f"| {_k(r['tokens'])} | {'/'.join(map(str, r['counts']))} | {r['layer_ms']:.1f} | "
                      f"{'yes' if r['bitwise_vs_gather'] else 'NO'} | "
                      + ("bitwise" if r["bitwise_vs_unsharded"] else f"max rel. diff {r['rel_diff_vs_unsharded']:.1e}")
                      + f" | {'ok' if r['op_shapes_ok'] else 'WRONG'} |")
        return "\n".join(md)
    fp8 = any("ipc_fp8" in r for r in rows)
    head = "| tokens | per rank | NCCL path ms (comm) | ipc_all2all ms (comm) | speed-up | bitwise |"
    sep = "|---|---|---|---|---|---|"
    if fp8:
        head += " fp8 wire ms (comm) | fp8 speed-up | fp8 bitwise (vs torch e4m3) | fp8 rel. error |"
        sep += "---|---|---|---|"
    md = [head, sep]
    for r in rows:
        cell = lambda p: f"{r[p]['layer_ms']:.3f} ({100 * r[p]['comm_share']:.0f} %)"  # noqa: E731
        line = (f"| {_k(r['tokens'])} | {'/'.join(map(str, r['counts']))} | {cell('nccl')} | {cell('ipc')} | "
                f"{r['speedup']:.2f}x | {'yes' if r['bitwise'] else 'NO'} |")
        if fp8:
            line += (f" {cell('ipc_fp8')} | {r['speedup_fp8']:.2f}x | {'yes' if r['fp8_bitwise'] else 'NO'} | "
                     f"{r['fp8_rel_err']:.1e} |")
        md.append(line)
    return "\n".join(md)


def _markdown(data: dict) -> str:
    m = data["meta"]
    lines = ["# Ulysses attention layer: ipc_all2all vs permute + NCCL all_to_all_single + permute", "",
             f"{m['mode_text']}; W = {m['world']}, {m['heads']} heads x {m['head_dim']}, batch {m['batch']}, "
             f"{m['dtype']}; {m['device']}; torch {m['torch']}, NCCL {m['nccl']}; {m['date']}", "",
             f"`{m['command']}`", "", _table(data), ""]
    if data["mode"] != "cpu":
        lines += [f"Layer time: the slowest rank's median of {m['iters']} forwards after {m['warmup']} warm-up "
                  "ones (CUDA events); comm: the share of it spent in the exchanges (permutes included); "
                  "speed-up: NCCL path time / ipc_all2all time. bitwise: every rank's output equal to the NCCL "
                  "path's; fp8: equal to the NCCL path with the e4m3 round trip applied in torch, rel. error "
                  "against the exact layer (max |diff| / max |out|)."]
    return "\n".join(lines) + "\n"


def _plot(data: dict, path: str) -> None:
    plt = pyplot()
    rows = data["rows"]
    xs = [r["tokens"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if data["mode"] == "cpu":
        axes[0].plot(xs, [r["layer_ms"] for r in rows], "o-", label="torch path over gloo (CPU)")
        axes[1].axis("off")
        axes[1].text(0.0, 0.5, "CPU run: no ipc_all2all timing\n(it needs CUDA GPUs)", fontsize=11)
    else:
        for way, style in (("nccl", "--o"), ("ipc", "-o"), ("ipc_fp8", "-s")):
            if way in rows[0]:
                axes[0].plot(xs, [r[way]["layer_ms"] for r in rows], style, label=way)
        axes[1].plot(xs, [r["speedup"] for r in rows], "-o", label="ipc_all2all")
        if "speedup_fp8" in rows[0]:
            axes[1].plot(xs, [r["speedup_fp8"] for r in rows], "-s", label="ipc_all2all, fp8 wire")
        axes[1].axhline(1.0, color="gray", lw=0.8, ls=":")
        axes[1].set(xscale="log", xlabel="tokens (total)", ylabel="speed-up over the NCCL path", title="layer speed-up")
        axes[1].legend(fontsize=8)
        axes[1].grid(True, which="both", alpha=0.3)
    axes[0].set(xscale="log", yscale="log", xlabel="tokens (total)", ylabel="layer time (ms)", title="attention layer")
    axes[0].legend(fontsize=8)
    axes[0].grid(True, which="both", alpha=0.3)
    fig.suptitle(f"Ulysses attention layer, W = {data['meta']['world']} ({data['meta']['mode_text']})", fontsize=10)
    save(fig, path)


def write_outputs(out: str, data: dict) -> list:
    """``block_ipc_all2all.json``, ``.md`` and ``.png`` (when matplotlib is installed) into ``out``; returns
    the paths written."""
    return write_results(out, "block_ipc_all2all", data, _markdown(data), lambda path: _plot(data, path), quiet=True,
                         run=run_record(data["meta"]["command"]))


def _failures(data: dict) -> list:
    bad = []
    for r in data["rows"]:
        t = _k(r["tokens"])
        if data["mode"] == "cpu":
            if not r["bitwise_vs_gather"]:
                bad.append(f"{t}: the all-to-all exchange differs from the all-gather exchange")
            if not r["op_shapes_ok"]:
                bad.append(f"{t}: the send_recv_heads op's shape differs from the layer's")
            if r["rel_diff_vs_unsharded"] > 1e-4:
                bad.append(f"{t}: the sharded layer differs from the unsharded one by {r['rel_diff_vs_unsharded']:.1e}")
            continue
        if not r["bitwise"]:
            bad.append(f"{t}: ipc_all2all's layer output is not bitwise the NCCL path's")
        if r.get("fp8_bitwise") is False:
            bad.append(f"{t}: the fp8-wire layer output is not bitwise the NCCL path's with the e4m3 round trip")
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/block_ipc_all2all.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=0, help="ranks (processes), 2..8; default one per GPU (2 on one GPU or a CPU)")
    p.add_argument("--tokens", default="", help=f"total tokens per size, comma-separated (default {DEFAULT_TOKENS}; "
                                                f"{SHARED_TOKENS} with ranks sharing a GPU, {CPU_TOKENS} on the CPU)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--uneven", action="store_true", help="tokens per rank proportional to rank + 1 instead of even")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-fp8", action="store_true", help="leave out the fp8-on-the-wire variant")
    p.add_argument("--cpu", action="store_true", help="the CPU check even where a GPU is visible")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run (stragglers are killed)")
    p.add_argument("--out", default=None, help="write block_ipc_all2all.{md,json,png} here")
    args = p.parse_args(argv)

    import torch

    import ipc_all2all

    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cpu = args.cpu or ngpu == 0
    why_cpu = "--cpu" if args.cpu else "no CUDA device is visible"
    if not cpu and not ipc_all2all.built_with_cuda():
        cpu, why_cpu = True, "ipc_all2all was built without its CUDA kernels"
    world = args.world or (2 if cpu or ngpu == 1 else min(ngpu, 8))
    shared = not cpu and world > ngpu
    tokens_text = args.tokens or (CPU_TOKENS if cpu else SHARED_TOKENS if shared else DEFAULT_TOKENS)
    try:
        tokens = parse_tokens(tokens_text)
    except ValueError as e:
        p.error(str(e))
    if not 2 <= world <= ipc_all2all.MAX_WORLD_SIZE:
        p.error(f"--world must be 2..{ipc_all2all.MAX_WORLD_SIZE}, got {world}")
    if args.heads % world:
        p.error(f"--heads ({args.heads}) must be divisible by the world size ({world})")
    if min(args.heads, args.head_dim, args.batch, args.iters) < 1 or args.warmup < 0:
        p.error("--heads, --head-dim, --batch and --iters must be >= 1, --warmup >= 0")
    fp8 = not args.no_fp8 and not cpu
    notes = []
    if not args.no_fp8 and not cpu and args.head_dim not in ipc_all2all.FP8_WIRE_HEAD_DIMS:
        fp8 = False
        notes.append(f"fp8 on the wire left out: it takes head_dim in {ipc_all2all.FP8_WIRE_HEAD_DIMS}, "
                     f"not {args.head_dim}")
    if cpu:
        mode, mode_text = "cpu", f"CPU check ({why_cpu}): torch path over gloo, fp32"
        print(f"ipc_all2all block: {why_cpu}, so no GPU run here.")
        for line in _gpu_plan():
            print("  " + line)
        print(f"On this CPU: W = {world} processes over gloo run the layer (fp32, {args.heads} heads x "
              f"{args.head_dim}) with the baseline's exchange (permute -> all_to_all_single -> permute) and check it "
              "bitwise against the same exchange done by all-gathers and slicing, and against the unsharded "
              "layer on one process; ipc_all2all itself needs CUDA GPUs with peer access.")
    elif shared:
        mode = "shared"
        mode_text = f"{world} ranks sharing {ngpu} GPU(s): correctness only (time-sliced kernels, gloo for NCCL)"
        print(f"ipc_all2all block: {mode_text}; the times below mean nothing.")
    else:
        mode, mode_text = "gpu", f"{world} GPUs, one rank each"
        print(f"ipc_all2all block: {mode_text}")
    print(f"  layer: {args.heads} heads x {args.head_dim}, batch {args.batch}, tokens {', '.join(map(_k, tokens))}"
          + (" (uneven split)" if args.uneven else "")
          + ("" if cpu else f", bf16, flash attention; fp8 on the wire: {'yes (fp8_wire=True)' if fp8 else 'no'}"))
    for n in notes:
        print("  " + n)
    cfg = dict(cpu=cpu, heads=args.heads, head_dim=args.head_dim, batch=args.batch, uneven=args.uneven,
               tokens=tokens, warmup=args.warmup, iters=args.iters, fp8=fp8)
    try:
        results = run_ranks(_rank, world, cfg, timeout=args.timeout, grace_s=20)
    except RankFailure as e:
        print(f"block FAILED:\n{e}", file=sys.stderr)
        return 1
    nccl = results[0]["nccl"]
    data = {"mode": mode, "rows": _merge(results, cfg), "notes": notes,
            "meta": {"mode_text": mode_text, "world": world, "heads": args.heads, "head_dim": args.head_dim,
                     "batch": args.batch, "uneven": args.uneven, "dtype": "fp32" if cpu else "bf16",
                     "warmup": args.warmup, "iters": args.iters, "device": results[0]["device"],
                     "torch": torch.__version__, "nccl": nccl, "ipc_all2all": ipc_all2all.__version__,
                     "date": utc_now("iso"), "command": command_line("python tools/block_ipc_all2all.py", argv)}}
    print(_table(data))
    bad = _failures(data)
    data["failures"] = bad
    if args.out:
        print("wrote " + ", ".join(write_outputs(args.out, data)))
    for b in bad:
        print("FAILED: " + b, file=sys.stderr)
    if not bad:
        print("all checks passed" + ("" if cpu else " (ipc_all2all's layer output is bitwise the NCCL path's)"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
