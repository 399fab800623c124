#!/usr/bin/env python3
"""Benchmark of elastic_ep dispatch/combine against the torch reference path, one process per GPU.

    python tools/bench_elastic_ep.py --out DIR [--quick] [--num-sms N[,N..]] [--tokens 4096]

Shape (DeepSeek-V3): 4096 tokens per rank, hidden 7168, top-8 of 256 experts, uniform random
routing (each token picks 8 distinct experts uniformly). Cases: BF16 dispatch, FP8 dispatch
(float8_e4m3fn rows + FP32 scales per 128 elements), BF16 dispatch in cached mode (with the BF16
dispatch's handle: no counting, no CPU sync; DeepEP's published figures are of this mode), BF16
combine (of the BF16 dispatch's rows). Each also overlapped (``<case>_overlap_pN``, N push blocks,
``--overlap-push-blocks``): the dispatch copy epilogue beside the push on the other blocks, copying
each chunk of slots as it lands; the combine as one kernel whose first blocks push while the others
reduce each token chunk as it lands. For overlapped dispatch the kernel time is the span (first
kernel start to last kernel end), since push and epilogue run at once. ``--pdl both`` (the default)
adds ``<dispatch case>_nopdl``: the same dispatch with the push launched after notify
(``dispatch_pdl = False``, the design before 2026-12-02) instead of beside it, in the same process.

Measurements per case, over the iterations. Each iteration starts aligned on every GPU, as DeepEP's
``bench_kineto`` does with ``barrier_comm_profiling``: a 256 MiB L2 flush, a host barrier, then a tiny
all-reduce (the GPUs leave it together) and a ~0.4 ms GEMM queued behind it, so that every host has
enqueued the call before its GPU reaches it. Without that, the first kernel of a rank whose host is
late (by 100+ us on the H100/H200 VMs we measure on) is counted on the other rank as waiting time, which is
host skew, not communication (``--align barrier`` measures that way: barrier, then the call):
* kernel time: device time of the elastic_ep kernels of the call, from the CUDA profiler (Kineto):
  the time at least one of them runs (the union of their intervals, so overlapping kernels count
  once and host gaps between kernels, such as a CPU-synced dispatch's wait for the counts, not at
  all), split into the communication kernels (each group its own union: the push runs beside
  notify; dispatch: notify + push, what DeepEP's one
  ``dispatch_impl`` kernel does; combine: push, DeepEP's ``combine_impl``) and the epilogue
  (dispatch copy epilogue; combine reduce), which DeepEP times separately and leaves out of its GB/s;
* end-to-end time: CUDA events around the Python call on the current stream (includes the CPU sync
  of dispatch and every allocation), the median over the iterations (mean and minimum in the JSON),
  all measured in the same run, for
  - the native backend;
  - the torch reference path ("torch_ref", tools/_ep_torch_ref.py): the lean plain-torch dispatch /
    combine a user writes without elastic_ep (counts through all_to_all_single and one host sync,
    index_select packing, one all_to_all_single of packed rows; combine back and index_add_). This
    is the reference of issue 5's "3x end to end" target; its rows are checked against native's;
  - the repository's torch backend ("torch": every output of DeepEP V2's ElasticBuffer, handles and
    expert layouts included; a correctness oracle that takes milliseconds);
  - a bare ``all_to_all_single`` of exactly the bytes that must move ("torch_a2a"): the floor of any
    all_to_all-based path.

Bandwidth: bytes received by this GPU / time, where a dispatched token carries ``hidden * elem +
scale bytes + top-k ids (int64) + top-k weights (fp32)`` (DeepEP's ``count_bytes(recv_x,
recv_topk_idx, recv_topk_weights)`` per token) and a combined row ``hidden * 2 + top-k weights``.
"excl. local" counts only tokens that crossed NVLink (from / to other ranks; DeepEP's
``--ignore-local-traffic``); "incl. local" counts every received token (DeepEP's default). GB/s =
1e9 bytes/s. Three times per case:
* ``comm_gbps_*``: over the communication kernels' time: **DeepEP's definition** (its test_ep.py
  divides by the ``dispatch_impl`` / ``combine_impl`` kernel time, not the epilogues; the overlapped
  combine is one kernel that also reduces, so its figure includes the reduce);
* ``kernel_gbps_*``: over all of the call's kernels (epilogue included; stricter than DeepEP's);
* ``e2e_gbps_*``: over the end-to-end time.

Writes ``bench_elastic_ep.json``, ``bench_elastic_ep.md`` (table) and ``bench_elastic_ep.png`` into --out.

``--hybrid N`` runs, instead, hybrid mode against direct mode (EMULATED, logical domains of N ranks): on
CPU ranks over gloo with the torch backend (no GPU needed), or with ``--hybrid-backend native`` the native
kernels over the NVLink-emulated scale-out; rows and bytes crossing scale-out domains, and times that are
no network figures (tools/_bench_ep_hybrid.py).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_ep_report import _markdown, _summarise, write_outputs  # noqa: E402
from _env import apply as apply_env  # noqa: E402
from _launch import run_ranks  # noqa: E402
from _results import command_line, git_revision, out_dir, run_record, utc_now  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "packages", "elastic_ep", "src")

KERNEL_COMM = ("dispatch_notify", "dispatch_impl", "combine_impl", "combine_overlapped")
KERNEL_EPI = ("dispatch_copy_epilogue", "combine_reduce_epilogue")


def _import_ep():
    """elastic_ep: the installed package, else the source tree's (then on ``sys.path``, which the ranks
    inherit)."""
    try:
        import elastic_ep
    except ImportError:
        sys.path.insert(0, SRC)
        import elastic_ep
    return elastic_ep


def _inputs(rank: int, T: int, H: int, K: int, E: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn((T, H), generator=g)
    topk = torch.rand((T, E), generator=g).topk(K, dim=1).indices.to(torch.int64)
    w = torch.rand((T, K), generator=g)
    xb = x.to(torch.bfloat16)
    blocks = x.view(T, H // 128, 128)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    sf = (amax / 448.0).to(torch.float32)
    x8 = (blocks / sf.unsqueeze(2)).view(T, H).to(torch.float8_e4m3fn)
    dev = torch.device("cuda", torch.cuda.current_device())
    return {k: v.to(dev) for k, v in dict(xb=xb, x8=x8, sf=sf, topk=topk, w=w).items()}


class _Aligner:
    """Starts an iteration on every rank's GPU at the same moment, from a cold L2 (see the module
    docstring). mode "gemm": flush, barrier, all-reduce, GEMM; mode "barrier": flush and barrier only."""

    def __init__(self, group, mode: str):
        self.group, self.mode = group, mode
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        self.one = torch.ones(1, device="cuda")
        self.a = torch.randn((8192, 4096), device="cuda").to(torch.bfloat16)
        self.b = torch.randn((4096, 4096), device="cuda").to(torch.bfloat16)

    def __call__(self):
        self.flush.zero_()
        torch.cuda.synchronize()
        dist.barrier(group=self.group)
        torch.cuda.synchronize()
        if self.mode == "gemm":
            dist.all_reduce(self.one, group=self.group)
            torch.mm(self.a, self.b)


def _timed_us(fn, iters, align):
    """Microseconds of ``fn`` per iteration (CUDA events on the current stream), each iteration
    started by ``align`` (every rank together, cold cache)."""
    out = []
    for _ in range(iters):
        align()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(stop) * 1000.0)
    return out


def _e2e_stats(times_us):
    """The end-to-end figures of one case: the median (what the tables report: the host side of a
    call sees one-off stalls of tens of microseconds on a VM, which move a mean), the mean and the
    minimum."""
    return dict(e2e_us=statistics.median(times_us), e2e_mean_us=sum(times_us) / len(times_us),
                e2e_min_us=min(times_us))


def _gbps(nbytes, us):
    """GB/s (1e9 bytes per second) of ``nbytes`` moved in ``us`` microseconds; None without a time."""
    return nbytes / us / 1e3 if us else None


def _bandwidths(remote, total, e2e_us, kernel_us=None, comm_us=None) -> dict:
    """The GB/s of one case from its received bytes (``remote``: from other ranks; ``total``: all) and
    times: over the end-to-end time, over all kernels, and over the communication kernels (DeepEP's
    definition: dispatch_impl / combine_impl time, epilogues excluded)."""
    return dict(e2e_gbps_excl_local=_gbps(remote, e2e_us), e2e_gbps_incl_local=_gbps(total, e2e_us),
                kernel_gbps_excl_local=_gbps(remote, kernel_us), kernel_gbps_incl_local=_gbps(total, kernel_us),
                comm_gbps_excl_local=_gbps(remote, comm_us), comm_gbps_incl_local=_gbps(total, comm_us))


def _token_bytes(hidden: int, topk: int, fp8: bool) -> int:
    """Bytes of one dispatched token as DeepEP counts them: the row (1 byte per element in FP8, 2 in
    BF16), FP8's FP32 scale per 128 elements, top-k ids (int64) and top-k weights (fp32)."""
    return hidden * (1 if fp8 else 2) + (hidden // 128 * 4 if fp8 else 0) + topk * 8 + topk * 4


def _case_bytes(name: str, hidden: int, topk: int, sent, recv_counts, rank: int):
    """(bytes per row, bytes received from other ranks, bytes received in all) of case ``name`` on
    ``rank``, from ``sent[d]`` (tokens this rank sends to rank d: tokens with an expert there) and
    ``recv_counts[s]`` (tokens it receives from rank s). A dispatch receives one token record per
    (token, destination rank); a combine receives back one row (``hidden * 2`` BF16 + top-k weights)
    per token it sent."""
    if name.startswith("combine"):
        b, counts = hidden * 2 + topk * 4, sent
    else:
        b, counts = _token_bytes(hidden, topk, "fp8" in name), recv_counts
    return b, (sum(counts) - counts[rank]) * b, sum(counts) * b


def _busy_us(ranges, iters: int):
    """Mean device time per iteration during which at least one of ``ranges`` (kernel start, end) runs:
    the length of their union / ``iters``; None without ranges."""
    if not ranges:
        return None
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(ranges):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy / iters


def _kernel_times(prof, iters: int):
    """Average device time (us) per iteration of the elastic_ep kernels, from the profiler's kernel
    records: ``_group_times`` of their (name, start, end)."""
    records = []
    for e in prof.events():
        if getattr(e, "device_type", None) is None or "CUDA" not in str(e.device_type):
            continue
        records.append((e.name, e.time_range.start, e.time_range.end))
    return _group_times(records, iters)


def _group_times(records, iters: int):
    """(comm, epilogue, per kernel, span, busy) in us per iteration from kernel records (name, start,
    end) of ``iters`` calls. comm / epilogue: the union of the communication / epilogue kernels'
    intervals (the dispatch push runs beside notify, so their durations overlap and must not be
    summed). Per kernel: mean duration by kernel (a push launched beside notify counts its wait for
    the slots). The span is from the first kernel's start to the last one's end in each iteration
    (every call launches the same number of kernels); it also contains host gaps between kernels (CPU
    sync). Busy is the union of all the kernels' intervals: the device time of the call, counting
    overlapping kernels once and gaps not at all."""
    per_kernel = {}
    ranges, comm_ranges, epi_ranges = [], [], []
    for name, start, end in records:
        key = next((k for k in KERNEL_COMM + KERNEL_EPI if k in name), None)
        if key is None:
            continue
        per_kernel[key] = per_kernel.get(key, 0.0) + (end - start) / iters
        ranges.append((start, end))
        (comm_ranges if key in KERNEL_COMM else epi_ranges).append((start, end))
    return (_busy_us(comm_ranges, iters) or 0.0, _busy_us(epi_ranges, iters) or 0.0, per_kernel,
            _span_us(ranges, iters), _busy_us(ranges, iters))


def _span_us(ranges, iters: int):
    """Mean over iterations of (last end - first start) of each iteration's kernels, or None."""
    if not ranges or len(ranges) % iters:
        return None
    ranges = sorted(ranges)
    n = len(ranges) // iters
    groups = [ranges[i * n:(i + 1) * n] for i in range(iters)]
    return sum(max(e for _, e in g) - g[0][0] for g in groups) / iters


def _e2e_only_result(backend: str, case: str, times_us, remote: int, total: int) -> dict:
    """The result row of a backend timed end to end only (no elastic_ep kernels to profile)."""
    stats = _e2e_stats(times_us)
    return dict(backend=backend, case=case, num_sms=0, **stats, comm_kernel_us=None, epilogue_us=None,
                kernel_us=None, bytes_remote=remote, bytes_total=total, **_bandwidths(remote, total, stats["e2e_us"]))


def _row_checksums(rows: torch.Tensor) -> torch.Tensor:
    """Sorted per-row checksums (fp32 dot products with a fixed vector) of ``rows[N, H]``: equal
    multisets of rows give equal results, whatever their order."""
    v = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(11)).to(rows.device)
    return (rows.float() @ v).sort().values


def _native_variants(buf, rank: int, num_sms: int, args, cases: dict):
    """The overlapped and sequential-push variants of the native cases (added to ``cases``):
    ``(overlap: case -> (OverlapConfig, push blocks), nopdl: cases run with dispatch_pdl off)``. They
    switch the native runtime's documented knobs (``runtime.dispatch_overlap`` / ``combine_overlap``,
    ``runtime.dispatch_pdl``) for the case and back after it."""
    case_overlap = {}
    grid = num_sms or torch.cuda.get_device_properties(rank).multi_processor_count
    for spec in args.overlap_push_blocks.split(","):
        if spec == "none":
            continue
        n = grid * 3 // 8 if spec == "default" else int(spec)
        for base in ("dispatch_bf16", "dispatch_fp8", "dispatch_bf16_cached", "combine_bf16"):
            cfg = buf.runtime.combine_overlap if base.startswith("combine") else buf.runtime.dispatch_overlap
            cases[f"{base}_overlap_p{n}"] = cases[base]
            case_overlap[f"{base}_overlap_p{n}"] = (cfg, n)
    case_nopdl = set()
    buf.runtime.dispatch_pdl = args.pdl != "off"
    if args.pdl == "both":
        for base in ("dispatch_bf16", "dispatch_fp8", "dispatch_bf16_nosync", "dispatch_bf16_cached"):
            cases[f"{base}_nopdl"] = cases[base]
            case_nopdl.add(f"{base}_nopdl")
    return case_overlap, case_nopdl


def _buffer_cases(ep, group, rank: int, backend: str, num_sms: int, inp: dict, T: int, args):
    """A buffer of ``backend`` and its cases: ``(buf, {case: call}, BF16 dispatch row checksums)``."""
    H, K, E = inp["xb"].shape[1], inp["topk"].shape[1], 256
    # Room for the zero-copy cases too (their receive area lies past the combine area).
    nbytes = max(ep.ElasticBuffer.get_buffer_size_hint(group, T, H, K, True),
                 ep.ElasticBuffer.get_buffer_size_hint(group, T, H, K, False, zero_copy=True))
    buf = ep.ElasticBuffer(group, nbytes, num_max_tokens_per_rank=T, hidden=H, num_topk=K,
                           use_fp8_dispatch=True, backend=backend, explicitly_destroy=True)
    # --num-sms 0: every SM, what the benchmark always measured (elastic_ep's own num_sms=0 is
    # DeepEP's get_theoretical_num_sms, which leaves SMs to overlapped compute).
    sms = num_sms or torch.cuda.get_device_properties(rank).multi_processor_count
    x, x8, sf, topk, w = inp["xb"], inp["x8"], inp["sf"], inp["topk"], inp["w"]
    cases = {
        "dispatch_bf16": lambda: buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=E, num_sms=sms),
        "dispatch_fp8": lambda: buf.dispatch((x8, sf), topk_idx=topk, topk_weights=w, num_experts=E, num_sms=sms),
        # Without the CPU sync (worst-case outputs, counts on the GPU): with the aligned start the host
        # has queued all of it before the GPU reaches it, so its e2e is the device time of the whole
        # call, measured with no profiler attached.
        "dispatch_bf16_nosync": lambda: buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=E, num_sms=sms,
                                                     do_cpu_sync=False),
    }
    recv, _, rw, handle, _ = cases["dispatch_bf16"]()
    rows = _row_checksums(recv) if backend == "native" else None
    # Cached mode (the handle's routing, no counting and no CPU sync): what DeepEP's own figures time
    # (its tuning runs dispatch with a handle, so no notify kernel is counted).
    cases["dispatch_bf16_cached"] = lambda: buf.dispatch(x, topk_weights=w, handle=handle, num_sms=sms)
    cases["combine_bf16"] = lambda: buf.combine(recv, handle, topk_weights=rw, num_sms=sms)
    if backend == "native":
        # Zero-copy receive: recv_x is a view of the buffer the senders wrote in place (no copy
        # epilogue for the hidden bytes; its push also writes this rank's own rows).
        cases["dispatch_bf16_zc"] = lambda: buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=E,
                                                         num_sms=sms, zero_copy=True)
        cases["dispatch_fp8_zc"] = lambda: buf.dispatch((x8, sf), topk_idx=topk, topk_weights=w, num_experts=E,
                                                        num_sms=sms, zero_copy=True)
        zc = {}

        def cached_zc():
            # A zero-copy handle is refused once another dispatch overwrote its views (the handle's
            # views_serial against the buffer's dispatch serial): take a fresh one then (in the
            # warm-up calls; the timed calls follow each other).
            h = zc.get("handle")
            if h is None or h.views_serial != buf._dispatch_serial:
                h = zc["handle"] = cases["dispatch_bf16_zc"]()[3]
            return buf.dispatch(x, topk_weights=w, handle=h, num_sms=sms, zero_copy=True)

        cases["dispatch_bf16_cached_zc"] = cached_zc
    return buf, cases, rows


def _measure_case(backend: str, name: str, fn, num_sms: int, iters: int, align, group, case_bytes) -> dict:
    """One case's result row: e2e over ``iters`` aligned iterations, then (native) the same under the
    CUDA profiler for the kernel times."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    e2e = _timed_us(fn, iters, align)  # CUDA events on the current stream
    comm_us = epi_us = span_us = busy_us = None
    per_kernel = {}
    if backend == "native":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                align()
                fn()
                torch.cuda.synchronize()
        comm_us, epi_us, per_kernel, span_us, busy_us = _kernel_times(prof, iters)
    _, remote, total = case_bytes(name)
    stats = _e2e_stats(e2e)
    # The union of the kernels' intervals: for sequential kernels the sum comm + epilogue; for
    # overlapped dispatch (push and epilogue at once) each instant once, and without the host's gap
    # between notify and epilogue that the span (first start to last end) of a CPU-synced dispatch contains.
    kern_us = busy_us if busy_us else ((comm_us + epi_us) if comm_us is not None else None)
    return dict(backend=backend, case=name, num_sms=num_sms, **stats, comm_kernel_us=comm_us, epilogue_us=epi_us,
                kernel_us=kern_us, span_us=span_us, busy_us=busy_us, per_kernel_us=per_kernel,
                bytes_remote=remote, bytes_total=total, **_bandwidths(remote, total, stats["e2e_us"], kern_us, comm_us))


def _run_cases(buf, backend, num_sms, cases, args, rank, iters, align, group, case_bytes, results: list) -> None:
    """Every case of one buffer (and, native, its variants), each row appended to ``results`` as it is
    measured (a failing case keeps the rows before it)."""
    case_overlap, case_nopdl = _native_variants(buf, rank, num_sms, args, cases) if backend == "native" else ({}, set())
    for name, fn in cases.items():
        if name in case_overlap:
            cfg, n = case_overlap[name]
            cfg.enabled, cfg.push_blocks = True, n
        if name in case_nopdl:
            buf.runtime.dispatch_pdl = False
        results.append(_measure_case(backend, name, fn, num_sms, iters, align, group, case_bytes))
        if name in case_overlap:
            case_overlap[name][0].enabled = False
        if name in case_nopdl:
            buf.runtime.dispatch_pdl = True
    buf.destroy()


def _torch_ref_results(group, inp, native_rows, iters, align, case_bytes, out) -> None:
    """The torch reference path's cases, appended to ``out["results"]``."""
    # The torch reference path (tools/_ep_torch_ref.py): the lean plain-torch dispatch / combine a user
    # writes without elastic_ep, measured like the native cases; its rows are checked against native's.
    from _ep_torch_ref import TorchRefEP

    tref = TorchRefEP(group, 256)
    rx, _, _, rw_ref, rh = tref.dispatch(inp["xb"], inp["topk"], inp["w"])
    if native_rows is not None:
        same = torch.equal(_row_checksums(rx), native_rows)
        out["torch_ref_rows_match_native"] = same
        if not same:
            out.setdefault("errors", []).append("torch_ref: dispatched rows differ from the native dispatch's")
    for name, fn in (("dispatch_bf16", lambda: tref.dispatch(inp["xb"], inp["topk"], inp["w"])),
                     ("dispatch_fp8", lambda: tref.dispatch(inp["x8"], inp["topk"], inp["w"], sf=inp["sf"])),
                     ("combine_bf16", lambda: tref.combine(rx, rh, rw_ref))):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        dist.barrier(group=group)
        _, remote, total = case_bytes(name)
        out["results"].append(_e2e_only_result("torch_ref", name, _timed_us(fn, iters, align), remote, total))


def _a2a_results(group, iters, align, case_bytes, sent, recv_counts, out) -> None:
    """The bare all_to_all cases, appended to ``out["results"]``."""
    # The reference: one bare all_to_all_single of exactly the bytes that cross ranks (plus the
    # local copy), i.e. what a plain torch implementation cannot avoid; no packing or index work.
    for name in ("dispatch_bf16", "dispatch_fp8", "combine_bf16"):
        b, remote, total = case_bytes(name)
        is_combine = name.startswith("combine")
        in_splits = recv_counts if is_combine else sent
        out_splits = sent if is_combine else recv_counts
        send = torch.empty((sum(in_splits), b), dtype=torch.uint8, device="cuda")
        recv = torch.empty((sum(out_splits), b), dtype=torch.uint8, device="cuda")

        def a2a():
            dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)

        for _ in range(2):
            a2a()
        out["results"].append(_e2e_only_result("torch_a2a", name, _timed_us(a2a, iters, align), remote, total))


def _worker(rank: int, world: int, rdzv: str, args) -> dict:
    """One rank of the benchmark (under tools/_launch.py); returns its results."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=rdzv, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    ep = _import_ep()
    T, H, K, E = args.tokens, 7168, 8, 256
    L = E // world
    inp = _inputs(rank, T, H, K, E)
    align = _Aligner(group, args.align)
    iters = 5 if args.quick else 30
    out = {"rank": rank, "world": world, "results": []}

    # bytes per received token / row, and how many crossed NVLink
    owner = torch.where(inp["topk"] >= 0, inp["topk"] // L, torch.full_like(inp["topk"], -1))
    sent = torch.stack([(owner == d).any(1) for d in range(world)]).sum(1).tolist()  # tokens sent to each rank
    recv_from = [None] * world
    dist.all_gather_object(recv_from, sent, group=group)
    recv_counts = [recv_from[s][rank] for s in range(world)]

    def case_bytes(name: str):
        return _case_bytes(name, H, K, sent, recv_counts, rank)

    native_rows = None  # checksums of the native BF16 dispatch's rows, to check the torch reference path
    for backend in ["native", "torch"] if ep.native_available() else ["torch"]:
        for num_sms in [int(s) for s in args.num_sms.split(",")] if backend == "native" else [0]:
            try:
                buf, cases, rows = _buffer_cases(ep, group, rank, backend, num_sms, inp, T, args)
                native_rows = rows if native_rows is None else native_rows
                _run_cases(buf, backend, num_sms, cases, args, rank, iters, align, group, case_bytes, out["results"])
            except Exception as e:  # noqa: BLE001 - report and keep measuring the other configurations
                import traceback

                traceback.print_exc()
                out.setdefault("errors", []).append(f"{backend} num_sms={num_sms}: {type(e).__name__}: {e}")
                break
    _torch_ref_results(group, inp, native_rows, iters, align, case_bytes, out)
    _a2a_results(group, iters, align, case_bytes, sent, recv_counts, out)
    p2p_ops = [o for o in args.ops.split(",") if o in ("agrs", "pp", "engram")]
    if p2p_ops and ep.native_available():
        from _bench_ep_p2p import bench_agrs_pp

        try:
            out["p2p"] = bench_agrs_pp(ep, group, rank, world, p2p_ops, args.quick,
                                       lambda fn: statistics.median(_timed_us(fn, iters, align)))
        except Exception as e:  # noqa: BLE001 - report and keep the dispatch/combine results
            out.setdefault("errors", []).append(f"agrs/pp/engram: {type(e).__name__}: {e}")
    dist.destroy_process_group()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="5 iterations instead of 30")
    ap.add_argument("--num-sms", default="0", help="comma-separated SM counts for the native kernels (0: all)")
    ap.add_argument("--overlap-push-blocks", default="default",
                    help="comma-separated push-block counts of the overlapped combine ('default': 3/8 of the "
                         "grid; 'none': skip it)")
    ap.add_argument("--pdl", default="both", choices=("both", "on", "off"),
                    help="dispatch push beside notify (on), after it (off), or every dispatch case both ways")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--world", type=int, default=0, help="GPUs to use (default: all)")
    ap.add_argument("--ops", default="dispatch,agrs,pp,engram",
                    help="also the AGRS all-gather and PP ring cases against NCCL (two or more GPUs) and the "
                         "Engram fetch against a host gather + copy (tools/_bench_ep_p2p.py)")
    ap.add_argument("--align", default="gemm", choices=("gemm", "barrier"),
                    help="how each iteration starts on every rank (see the module docstring)")
    ap.add_argument("--hybrid", type=int, default=0, metavar="N",
                    help="instead: hybrid mode (logical scale-up domains of N ranks) against direct mode, EMULATED "
                         "on --world CPU ranks (default 4) over gloo with the torch backend; --tokens defaults to "
                         "512 there (tools/_bench_ep_hybrid.py)")
    ap.add_argument("--hybrid-backend", default="torch", choices=("torch", "native"),
                    help="--hybrid on the torch runtime (CPU ranks over gloo) or on the native one (its hybrid "
                         "kernels over the NVLink-emulated scale-out, ranks sharing the GPUs there are)")
    ap.add_argument("--timeout", type=float, default=3000.0, help="seconds for the whole run (stragglers are killed)")
    args = ap.parse_args()
    command = command_line("bench_elastic_ep.py")
    args.out = out_dir(args.out)
    _import_ep()
    if args.hybrid:
        from _bench_ep_hybrid import run as run_hybrid

        tokens = args.tokens if "--tokens" in sys.argv else 512
        if args.hybrid_backend == "native":
            apply_env()  # tools/env.sh (NVLink multicast off), inherited by the worker processes
        run_hybrid(args.out, args.world or 4, args.hybrid, tokens, 2 if args.quick else 10, command,
                   args.hybrid_backend, args.timeout)
        return 0
    if not torch.cuda.is_available():
        print("bench_elastic_ep: no CUDA device, nothing to measure")
        return 0
    world = args.world or torch.cuda.device_count()
    apply_env()  # tools/env.sh (NVLink multicast off), inherited by the worker processes
    t0 = time.time()
    per_rank = run_ranks(_worker, world, args, timeout=args.timeout, grace_s=60)
    errors = [e for r in per_rank for e in r.get("errors", [])]
    if errors:
        print("errors:\n  " + "\n  ".join(errors))
    meta = dict(errors=errors, date=utc_now(), host=socket.gethostname(), gpus=world,
                gpu_name=torch.cuda.get_device_name(0), git=git_revision(), torch=torch.__version__,
                nccl=".".join(map(str, torch.cuda.nccl.version())), tokens=args.tokens,
                command=command, align=args.align, seconds=round(time.time() - t0, 1))
    table = _summarise(per_rank, meta)
    from _bench_ep_p2p import markdown as p2p_markdown

    p2p = p2p_markdown(per_rank[0].get("p2p", []))
    print(_markdown(table, meta) + p2p)
    write_outputs(args.out, meta, table, per_rank, p2p, run=run_record(command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
