#!/usr/bin/env python3
"""Benchmark of fp8_layerwise: per-rank H2D GB/s on DeepSeek-V3 expert shapes.

    python tools/bench_fp8_layerwise.py --out DIR [--quick] [--backend auto|cuda|cpu]

Configurations (one process per rank, one rank per GPU):
  * DSV3 TP1            1 rank,  44.05 MB per expert (w13 29.4 MB, w2 14.7 MB, fp32 block scales)
  * DSV3 TP2            2 ranks, 22.0 MB per rank and expert
  * TP4-sized shard     2 ranks, 11.0 MB per rank and expert (the source is cut as TP4 would)
  * TP8-sized shard     2 ranks,  5.5 MB per rank and expert
  (with one GPU: DSV3 TP1 and the two shard sizes with one rank)
For each configuration, in the same processes and with the same number of GPUs copying at once:
  * peak     plain pinned cudaMemcpyAsync of 256 MiB buffers (registered shm, like the slots);
  * ktransformers  the baseline, KTransformers' FP8LayerwiseTransport design: 2 slots, one expert in
              flight, 4 separate copies, each waited for;
  * slotsN   this package with N host slots (N experts in flight, coalesced copies, 2 copy streams);
  * "-wait"   the same with coalesce_wait=True (a short run of ready slots waits for the next ones);
  * "-perexpert" the same with batch_small_kinds=False (every kind copied per expert; the default
              copies the scales once per layer);
  each with the native shard writer (rank 0 cuts every rank's shard out of whole-layer tensors)
  and "prestaged" (the writer does nothing, so the transport itself is measured).
Per rank it reports h2d GB/s (bytes over copy-engine busy time), effective GB/s (bytes over the
layer's total time), the slot-wait fraction (producer time spent waiting for acks), and
total_ms / max(writer_ms, h2d_ms) (overlap; target <= 1.1). Without a GPU the CPU backend runs
on scaled-down shapes and says so: those numbers are memcpy, not PCIe.
Writes bench_fp8_layerwise.json, .md (the table) and .png (the plot) into --out.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import run_ranks  # noqa: E402
from _results import command_line, git_revision, out_dir, pyplot, run_record, save, write_results  # noqa: E402


def _mode_summary(ranks, mode):
    """The figures of one (configuration, mode) from every rank's medians (``ranks[r]["modes"][mode]``:
    bytes, h2d_ms, total_ms, writer_ms, slot_wait_ms, copies, verified) and pinned peak
    (``ranks[r]["peak_gbs"]``, measured with the same GPUs copying at once). GB/s = 1e9 B/s.

    * h2d: per rank bytes / copy-engine busy time (h2d_ms); ``h2d`` is the slowest rank's;
    * eff: per rank bytes / the layer's total time (total_ms, the producer's, writer included);
    * pct / eff_pct: the worst rank's h2d / eff as a percentage of **that rank's own** peak (the issue's
      "≥ 90 % of that pinned peak per rank");
    * wait_frac: producer time waiting for slot acks / total (writer_ms, slot_wait_ms and total_ms are
      the producer's, the same on every rank);
    * overlap: the worst rank's total_ms / max(writer_ms, h2d_ms) (target <= 1.1);
    * cpe: copies per expert on rank 0 (bytes / sum(expert_nbytes) = experts)."""
    ms = [r["modes"][mode] for r in ranks]
    peaks = [r["peak_gbs"] for r in ranks]
    h2d = [m["bytes"] / (m["h2d_ms"] * 1e6) for m in ms]
    eff = [m["bytes"] / (m["total_ms"] * 1e6) for m in ms]
    r0 = ms[0]
    return dict(peak=min(peaks), h2d=min(h2d), eff=min(eff),
                pct=min(100 * g / p for g, p in zip(h2d, peaks)),
                eff_pct=min(100 * g / p for g, p in zip(eff, peaks)),
                wait_frac=r0["slot_wait_ms"] / r0["total_ms"],
                overlap=max(m["total_ms"] / max(m["writer_ms"], m["h2d_ms"]) for m in ms),
                cpe=r0["copies"] / (r0["bytes"] / sum(ranks[0]["expert_nbytes"])),
                ok=all(m["verified"] for m in ms) if ms[0]["verified"] is not None else None)


def _worker(rank, tp, rdzv, cfg, tmp):
    """One rank under tools/_launch.py (the rendezvous is unused: the transports exchange their names
    through ``tmp``)."""
    return _run_rank(rank, tp, cfg, tmp)


def _run_rank(rank, tp, cfg, tmp):
    import torch

    import fp8_layerwise as F
    from fp8_layerwise import _C

    backend = cfg["backend"]
    H, I_eff, E = cfg["hidden"], cfg["intermediate_eff"], cfg["experts"]
    nb = F.block_fp8_expert_nbytes(H, I_eff, tp)
    ex_n = [0]

    def exchange(obj=None, name="sync"):
        ex_n[0] += 1
        return F.FileExchange(os.path.join(tmp, f"{name}{ex_n[0]}"), rank, tp)(obj)

    if backend == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    out = {"rank": rank, "expert_nbytes": nb, "modes": {}}

    # ---- pinned peak with every rank copying at once ------------------------------------------
    peak_bytes = cfg["peak_mb"] << 20
    seg = _C.ShmSegment.create("fp8lw_bench", peak_bytes)
    try:
        from fp8_layerwise._shm import _host_view

        host = _host_view(seg.ptr, peak_bytes)
        host.fill_(7)
        if backend == "cuda":
            _C.cuda_host_register(seg.ptr, peak_bytes, rank)
            dst = torch.empty(peak_bytes, dtype=torch.uint8, device=dev)
            _C.cuda_h2d_seconds(rank, dst.data_ptr(), seg.ptr, peak_bytes, 2)  # warm-up
            exchange()  # every rank starts copying at once
            secs = _C.cuda_h2d_seconds(rank, dst.data_ptr(), seg.ptr, peak_bytes, cfg["peak_iters"])
            del dst
            _C.cuda_host_unregister(seg.ptr)
        else:
            dst = torch.empty(peak_bytes, dtype=torch.uint8)
            dst.copy_(host)
            exchange()
            t0 = time.perf_counter()
            for _ in range(cfg["peak_iters"]):
                dst.copy_(host)
            secs = time.perf_counter() - t0
        out["peak_gbs"] = peak_bytes * cfg["peak_iters"] / secs / 1e9
    finally:
        seg.close()

    # ---- whole-layer sources on rank 0 ---------------------------------------------------------
    writer = None
    sources = None
    if rank == 0:
        g = torch.Generator().manual_seed(5)
        sources = [torch.empty((E, 2 * I_eff, H), dtype=torch.uint8), torch.rand((E, 2 * I_eff // 128, H // 128), generator=g),
                   torch.empty((E, H, I_eff), dtype=torch.uint8), torch.rand((E, H // 128, I_eff // 128), generator=g)]
        for e in range(E):  # distinct, cheap content per expert (pages are touched here, not in the run)
            sources[0][e].fill_(e % 251)
            sources[2][e].fill_((e * 3 + 1) % 251)
        writer = F.make_shard_writer(sources, tp, threads=cfg["writer_threads"], cache_hint=cfg["cache_hint"])

    def noop(expert, slots):
        return None

    for mode in cfg["modes"]:
        name, slots, inflight, coalesce, staged = mode["name"], mode["slots"], mode["inflight"], mode["coalesce"], mode["prestaged"]
        ex = F.FileExchange(os.path.join(tmp, f"t_{name}"), rank, tp)
        rows = []
        with F.Transport(rank, tp, E, nb, num_slots=slots, backend=backend, exchange=ex, timeout_ms=60000,
                         max_inflight=inflight, coalesce=coalesce, copy_streams=mode.get("streams", 2),
                         coalesce_wait=mode.get("wait", False), batch_small_kinds=mode.get("batch", True)) as t:
            for layer in range(cfg["layers"] + 1):
                with t.layer(layer + 1, layer, E) as L:
                    if rank == 0:
                        L.run(noop if staged else writer)
                if layer > 0:  # layer 0 warms up pages, registrations and streams
                    s = L.stats
                    rows.append(dict(total_ms=s.total_ms, writer_ms=s.writer_ms, h2d_ms=s.h2d_ms,
                                     slot_wait_ms=s.slot_wait_ms, bytes=s.bytes, copies=s.copies))
            verified = None
            if not staged:
                # Check the first and last expert's w13 / w2 bytes against the fill pattern.
                verified = True
                for e in (0, E - 1):
                    v13 = t.expert_view(0, e).cpu()
                    v2 = t.expert_view(2, e).cpu()
                    verified &= bool((v13 == e % 251).all()) and bool((v2 == (e * 3 + 1) % 251).all())
        med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
        out["modes"][name] = dict(
            total_ms=med("total_ms"), writer_ms=med("writer_ms"), h2d_ms=med("h2d_ms"),
            slot_wait_ms=med("slot_wait_ms"), bytes=rows[0]["bytes"], copies=rows[0]["copies"], verified=verified,
            layers=rows)
    return out


def run_config(cfg, tp):
    """Every rank's figures of one configuration; RankFailure (a RuntimeError) when a rank fails."""
    with tempfile.TemporaryDirectory(prefix="fp8lw_bench_") as tmp:
        return run_ranks(_worker, tp, cfg, tmp, timeout=400, grace_s=10)


def _plot(results, summary, backend, path):
    """Effective GB/s per configuration and mode (min over ranks), the pinned peak dashed."""
    plt = pyplot()
    cfgs = [r["config"] for r in results]
    mnames = list(results[0]["ranks"][0]["modes"]) if results else []
    fig, ax = plt.subplots(figsize=(12, 5))
    w = 0.8 / max(1, len(mnames))
    for i, m in enumerate(mnames):
        ax.bar([j + i * w for j in range(len(cfgs))], [summary.get((c, m), {}).get("eff", 0) for c in cfgs], w,
               label=m)
    for j, c in enumerate(cfgs):
        pk = summary[(c, mnames[0])]["peak"]
        ax.hlines(pk, j - w / 2, j + 0.8 - w / 2, colors="k", linestyles="dashed")
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(cfgs))])
    ax.set_xticklabels(cfgs)
    ax.set_ylabel("effective GB/s per rank (min over ranks)")
    ax.set_title(f"fp8_layerwise ({backend}); dashed: pinned cudaMemcpyAsync peak, same GPUs copying")
    if mnames:
        ax.legend(fontsize=7, ncol=2)
    save(fig, path, dpi=100)


def write_outputs(out, meta, results, table, targets, summary, run=None) -> list:
    """bench_fp8_layerwise.{json,md,png} into ``out``; ``summary`` maps (config, mode) to the figures of
    ``_mode_summary``; ``run``: tools/_results.py's run record for the JSON. Returns the paths written."""
    data = dict(meta=meta, results=results, table=table, targets=targets,
                summary=[dict(config=c, mode=m, **v) for (c, m), v in summary.items()])
    md = "\n".join([f"# fp8_layerwise benchmark, {meta['date']}", "",
                    "; ".join(f"{k} {v}" for k, v in meta.items() if k != "date"), "", table, "", "## Targets", ""]
                   + [f"- {t}" for t in targets])
    return write_results(out, "bench_fp8_layerwise", data, md,
                         lambda path: _plot(results, summary, meta.get("backend", ""), path), run=run)


def main(argv=None):
    ap = argparse.ArgumentParser(description="fp8_layerwise H2D benchmark")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="fewer experts and layers")
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--writer-threads", type=int, default=0, help="native writer threads (0: the library's default_writer_threads)")
    ap.add_argument("--cache-hint", default=None,
                    help="native writer cache hint (none, demote, writeback, flush; default: the library's default_cache_hint)")
    ap.add_argument("--configs", default=None,
                    help="comma-separated substrings: run only the configurations whose name contains one")
    ap.add_argument("--modes", default=None, help="comma-separated mode names to run (default: all)")
    args = ap.parse_args(argv)
    args.out = out_dir(args.out)
    import torch

    import fp8_layerwise as F
    from fp8_layerwise import _C

    backend = args.backend
    if backend == "auto":
        backend = "cuda" if F.built_with_cuda() and torch.cuda.is_available() else "cpu"
    ngpu = torch.cuda.device_count() if backend == "cuda" else 0
    cpus = os.cpu_count() or 2
    if backend == "cuda":
        H, I, E, layers, peak_mb, peak_iters = 7168, 2048, (24 if args.quick else 48), (2 if args.quick else 3), 256, 24
        note = "CUDA backend on GPUs"
    else:
        H, I, E, layers, peak_mb, peak_iters = 1024, 1024, 16, 2, 64, 8
        note = ("NO GPU: CPU backend on scaled-down shapes (H=1024, I=1024); GB/s are host memcpy, "
                "not PCIe, and say nothing about the GPU targets")
    print(f"fp8_layerwise benchmark: {note}")
    print(f"  shm free {_C.shm_free_bytes() / 2**30:.1f} GiB, {cpus} CPUs, {ngpu} GPUs")
    configs = [("DSV3 TP1", 1, 1), ("DSV3 TP2", 2, 2), ("TP4-sized shard", 2, 4), ("TP8-sized shard", 2, 8)]
    if backend == "cuda" and ngpu < 2:
        # One GPU: the small-shard sizes with one rank (so one GPU copying; the writer's cut of a
        # 1-rank layer is contiguous, unlike the strided w2 cut of a real TP4/TP8 rank).
        configs = [configs[0], ("TP4-sized shard, 1 rank", 1, 4), ("TP8-sized shard, 1 rank", 1, 8)]
    # streams: CUDA copy streams per consumer (KTransformers' design has one). wait: coalesce_wait (off by
    # default); the "-wait" rows turn it on (what waiting for longer runs buys or costs).
    # batch: batch_small_kinds (the default; the scales copied once per layer); "-perexpert" rows turn it
    # off (4 copies per expert). KTransformers' design copies every kind per expert.
    modes = [dict(name="ktransformers", slots=2, inflight=1, coalesce=False, prestaged=False, streams=1, batch=False),
             dict(name="slots2", slots=2, inflight=0, coalesce=True, prestaged=False, streams=2),
             dict(name="slots4", slots=4, inflight=0, coalesce=True, prestaged=False, streams=2),
             dict(name="slots4-wait", slots=4, inflight=0, coalesce=True, prestaged=False, streams=2, wait=True),
             dict(name="slots4-perexpert", slots=4, inflight=0, coalesce=True, prestaged=False, streams=2, batch=False),
             dict(name="slots8", slots=8, inflight=0, coalesce=True, prestaged=False, streams=2),
             dict(name="ktransformers-prestaged", slots=2, inflight=1, coalesce=False, prestaged=True, streams=1, batch=False),
             dict(name="slots2-prestaged", slots=2, inflight=0, coalesce=True, prestaged=True, streams=2),
             dict(name="slots4-prestaged", slots=4, inflight=0, coalesce=True, prestaged=True, streams=2),
             dict(name="slots8-prestaged", slots=8, inflight=0, coalesce=True, prestaged=True, streams=2),
             dict(name="slots4-prestaged-wait", slots=4, inflight=0, coalesce=True, prestaged=True, streams=2,
                  wait=True),
             dict(name="slots4-prestaged-perexpert", slots=4, inflight=0, coalesce=True, prestaged=True, streams=2,
                  batch=False)]
    if args.configs:
        configs = [c for c in configs if any(k.strip() in c[0] for k in args.configs.split(","))]
    if args.modes:
        wanted = [m.strip() for m in args.modes.split(",")]
        unknown = [m for m in wanted if m not in {x["name"] for x in modes}]
        if unknown:
            ap.error(f"unknown --modes {unknown}; known: {[x['name'] for x in modes]}")
        modes = [m for m in modes if m["name"] in wanted]
    cache_hint = args.cache_hint or F.default_cache_hint()
    print(f"  native writer cache hint: {cache_hint}")
    results = []
    for name, tp, shard_tp in configs:
        I_eff = I * tp // shard_tp  # cut by tp ranks, each shard is what shard_tp would give
        per_rank = sum(F.block_fp8_expert_nbytes(H, I_eff, tp))
        need = max(m["slots"] for m in modes) * per_rank * tp + (peak_mb << 20) * tp
        free = _C.shm_free_bytes()
        use_modes = modes
        if free and need > free * 0.9:
            use_modes = [m for m in modes if m["slots"] * per_rank * tp + (peak_mb << 20) * tp < free * 0.9]
            print(f"  {name}: /dev/shm has {free / 2**20:.0f} MiB free; running only {[m['name'] for m in use_modes]}")
        if not use_modes:
            continue
        cfg = dict(backend=backend, hidden=H, intermediate_eff=I_eff, experts=E, layers=layers, peak_mb=peak_mb,
                   peak_iters=peak_iters, modes=use_modes, writer_threads=args.writer_threads or F.default_writer_threads(tp, cpus),
                   cache_hint=cache_hint)
        t0 = time.monotonic()
        ranks = run_config(cfg, tp)
        print(f"  ran {name} (tp={tp}, {per_rank / 1e6:.2f} MB per rank and expert, {E} experts/layer, "
              f"{cfg['writer_threads']} writer threads) in {time.monotonic() - t0:.0f} s")
        results.append(dict(config=name, tp=tp, shard_tp=shard_tp, expert_mb_per_rank=per_rank / 1e6, ranks=ranks))

    # ---- table -----------------------------------------------------------------------------------
    lines = []
    hdr = (f"| config | mode | MB/expert/rank | peak GB/s (min rank) | h2d GB/s (min rank) | % of peak (worst rank) | "
           f"effective GB/s (min rank) | slot-wait frac | total/max(writer,h2d) | copies/expert | bytes ok |")
    lines.append(hdr)
    lines.append("|---" * (hdr.count("|") - 1) + "|")
    summary = {}
    for res in results:
        ranks = res["ranks"]
        for mode in ranks[0]["modes"]:
            v = summary[(res["config"], mode)] = _mode_summary(ranks, mode)
            ok = v["ok"]
            lines.append(f"| {res['config']} | {mode} | {res['expert_mb_per_rank']:.2f} | {v['peak']:.1f} | {v['h2d']:.1f} | "
                         f"{v['pct']:.0f}% (eff {v['eff_pct']:.0f}%) | {v['eff']:.1f} | {v['wait_frac']:.2f} | "
                         f"{v['overlap']:.2f} | {v['cpe']:.2f} | {'-' if ok is None else ('yes' if ok else 'NO')} |")
    table = "\n".join(lines)
    print(table)
    # Default slot count: the best mean end-to-end throughput (native writer included) over the
    # configurations; within 2 % of it, the better worst-case transport-only (prestaged) figure.
    best = None
    scores = {}
    for n in (2, 4, 8):
        e2e = [v["eff_pct"] / 100 for (c, m), v in summary.items() if m == f"slots{n}"]
        pre = [v["eff_pct"] / 100 for (c, m), v in summary.items() if m == f"slots{n}-prestaged"]
        if e2e and pre:
            scores[n] = (sum(e2e) / len(e2e), min(pre))
            print(f"  slots{n}: mean end-to-end effective/peak {scores[n][0]:.2f}, "
                  f"worst transport-only (prestaged) {scores[n][1]:.2f}")
    if scores:
        top = max(v[0] for v in scores.values())
        near = [n for n, v in scores.items() if v[0] >= top - 0.02]
        best = (max(near, key=lambda n: scores[n][1]), scores)
        print(f"  recommended default num_slots = {best[0]}")
    targets = []
    default_of = {r["config"]: F.default_num_slots(r["ranks"][0]["expert_nbytes"]) for r in results}
    for n in sorted({F.DEFAULT_SLOTS, F.SMALL_EXPERT_SLOTS, 8}):
        for (c, m), v in summary.items():
            if n != 8 and n != default_of.get(c):
                continue  # report each configuration's default slot count, and 8
            if m == f"slots{n}-prestaged":
                targets.append(f"{c}: transport only (prestaged, {n} slots): effective {v['eff_pct']:.0f}% of peak "
                               f"-> {'MET' if v['eff_pct'] >= 90 else 'MISSED'} (>= 90%)")
            if m == f"slots{n}":
                targets.append(f"{c}: native writer, {n} slots: h2d {v['pct']:.0f}% of peak -> "
                               f"{'MET' if v['pct'] >= 90 else 'MISSED'}, end-to-end {v['eff_pct']:.0f}%; "
                               f"total/max(writer,h2d) = {v['overlap']:.2f} -> "
                               f"{'MET' if v['overlap'] <= 1.1 else 'MISSED'} (<= 1.1)")
    for t in targets:
        print("  " + t)
    rev = git_revision()
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), host=platform.node(), backend=backend,
                note=note, gpus=[torch.cuda.get_device_name(i) for i in range(ngpu)], cpus=cpus, git_rev=rev,
                command=command_line(os.path.basename(sys.argv[0]), argv), torch=torch.__version__,
                recommended_slots=best[0] if best else None, default_slots=default_of, cache_hint=cache_hint)
    write_outputs(args.out, meta, results, table, targets, summary, run=run_record(meta["command"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
