"""Shared helpers of the elastic_ep tests: inputs, an independent oracle, canonical forms, workers.

The oracle gathers every rank's inputs (``all_gather_object``) and computes, with plain per-token
loops, what this rank must receive and what combine must return. Outputs of any backend are turned
into a canonical form (rows sorted by source token, per expert in expand mode; only valid rows) and
compared bitwise (``torch.equal`` on raw bytes).
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
_SRC = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "packages", "elastic_ep", "src")


def import_elastic_ep():
    """Import the installed package; fall back to the source tree (CPU-only checkouts)."""
    try:
        import elastic_ep  # noqa: F401
    except ImportError:
        sys.path.insert(0, _SRC)
        import elastic_ep  # noqa: F401
    return sys.modules["elastic_ep"]


def native_module_or_skip():
    """``elastic_ep._C``; a (module-level) skip only when there is no built package at all.

    The extension is built with every install of the package (without nvcc as a host-only module whose
    ``built_with_cuda()`` is False), so it is missing only when ``elastic_ep`` is this checkout's unbuilt
    source tree (``import_elastic_ep``'s fallback). An installed package without it, or an extension that
    is there but fails to load (a broken build), raises instead of hiding as a skip.
    """
    import importlib

    import pytest

    ep = import_elastic_ep()
    try:
        return importlib.import_module("elastic_ep._C")
    except ModuleNotFoundError as e:
        pkg_dir = os.path.realpath(os.path.dirname(ep.__file__))
        if e.name == "elastic_ep._C" and pkg_dir == os.path.realpath(os.path.join(_SRC, "elastic_ep")):
            pytest.skip(f"elastic_ep is the unbuilt source tree ({pkg_dir}): no extension module",
                        allow_module_level=True)
        raise


FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------ inputs
def make_inputs(rank: int, num_tokens: int, hidden: int, num_topk: int, num_experts: int, dtype: str,
                seed: int, device, mask_prob: float = 0.1) -> Dict[str, torch.Tensor]:
    """Random inputs of one rank: x (+ sf), distinct top-k experts with some masked lanes, weights.

    dtype: "bf16", "fp8" (FP32 scales per 128 elements) or "fp8_ue8m0" (int32 packs, per 32 elements).
    """
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    T, H, K, E = num_tokens, hidden, num_topk, num_experts
    xf = torch.randn((T, H), generator=g)
    out: Dict[str, torch.Tensor] = {}
    if dtype == "bf16":
        out["x"] = xf.to(torch.bfloat16)
    else:
        out["x"] = xf.clamp(-400, 400).to(FP8)
        if dtype == "fp8":
            out["sf"] = torch.rand((T, (H + 127) // 128), generator=g) + 0.5
        else:
            out["sf"] = torch.randint(0, 2 ** 31 - 1, (T, (H + 127) // 128), generator=g, dtype=torch.int32)
    scores = torch.rand((T, E), generator=g)
    topk = torch.topk(scores, K, dim=1).indices.to(torch.int64) if T else torch.empty((0, K), dtype=torch.int64)
    if mask_prob > 0 and T:
        mask = torch.rand((T, K), generator=g) < mask_prob
        topk = torch.where(mask, torch.full_like(topk, -1), topk)
    out["topk_idx"] = topk
    out["topk_weights"] = torch.rand((T, K), generator=g)
    return {k: v.to(device) for k, v in out.items()}


def gather_inputs(inp: Dict[str, torch.Tensor], group) -> List[Dict[str, torch.Tensor]]:
    # Tensors travel as raw bytes: pickling float8 tensors is not supported by every torch.
    packed = {k: (str(v.dtype).replace("torch.", ""), tuple(v.shape), v.cpu().contiguous().view(torch.uint8)
                  .numpy().tobytes()) for k, v in inp.items()}
    objs: List = [None] * dist.get_world_size(group)
    dist.all_gather_object(objs, packed, group=group)
    out = []
    for o in objs:
        d = {}
        for k, (dt, shape, raw) in o.items():
            buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            d[k] = buf.view(getattr(torch, dt)).reshape(shape)
        out.append(d)
    return out


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.dim() <= 1:
        return t.view(torch.uint8)
    row_bytes = t.element_size()
    for d in t.shape[1:]:
        row_bytes *= d
    return t.view(torch.uint8).reshape(t.shape[0], row_bytes)


# ------------------------------------------------------------------------------------------ oracle
def oracle_dispatch(all_inp, me: int, num_experts: int, max_tokens: int, alignment: int):
    """What rank ``me`` must receive, from plain loops over every rank's tokens (CPU tensors).

    Returns a dict: ``src`` [N] global source ids ascending, ``x``/``sf``/``local_idx``/``weights`` rows
    in that order, ``counts_rank`` [R], ``real`` [L], ``aligned`` [L], ``experts`` {e: list of (src, k, row)}.
    """
    R = len(all_inp)
    L = num_experts // R
    src, rows, sfs, lidx, ws = [], [], [], [], []
    counts_rank = [0] * R
    real = [0] * L
    experts: Dict[int, list] = {e: [] for e in range(L)}
    for s, inp in enumerate(all_inp):
        topk = inp["topk_idx"].tolist()
        for t, lanes in enumerate(topk):
            local = [(k, e - me * L) for k, e in enumerate(lanes) if e >= 0 and e // L == me]
            if not local:
                continue
            counts_rank[s] += 1
            src.append(s * max_tokens + t)
            rows.append(inp["x"][t])
            if "sf" in inp:
                sfs.append(inp["sf"][t])
            li = [-1] * len(lanes)
            w = [0.0] * len(lanes)
            for k, e in local:
                li[k] = e
                w[k] = float(inp["topk_weights"][t, k])
                real[e] += 1
                experts[e].append((s * max_tokens + t, k, len(src) - 1))
            lidx.append(li)
            ws.append(w)
    K = all_inp[0]["topk_idx"].shape[1]
    H = all_inp[0]["x"].shape[1]
    dtype = all_inp[0]["x"].dtype
    x = torch.stack(rows) if rows else torch.empty((0, H), dtype=dtype)
    out = {
        "src": torch.tensor(src, dtype=torch.int64),
        "x": x,
        "local_idx": torch.tensor(lidx, dtype=torch.int64).view(-1, K),
        "weights": torch.tensor(ws, dtype=torch.float32).view(-1, K),
        "counts_rank": counts_rank,
        "real": real,
        "aligned": [(c + alignment - 1) // alignment * alignment for c in real],
        "experts": experts,
    }
    if sfs or "sf" in all_inp[0]:
        P = all_inp[0]["sf"].shape[1]
        out["sf"] = torch.stack(sfs) if sfs else torch.empty((0, P), dtype=all_inp[0]["sf"].dtype)
    return out


def expert_scale(global_expert: int) -> float:
    """Per-expert factor applied by the fake experts in combine tests (exact in bf16)."""
    return 1.0 + 0.25 * (global_expert % 4)


def rank_scale(rank: int) -> float:
    return 1.0 + 0.5 * (rank % 3)


def oracle_combine(all_inp, me: int, num_experts: int, expanded: bool, multi_red: bool,
                   biases: List[Optional[torch.Tensor]]) -> torch.Tensor:
    """Expected ``combined_x`` of rank ``me`` given the fake experts used by ``fake_experts``, summed in
    DeepEP V2's order: fp32 from the biases (``bias_0 + bias_1``), then per top-k lane in lane order the
    partial of the rank whose last lane it is (each lane's own row without multiple reduction in expand
    mode), ``+0.0`` at the other lanes; one rounding to bf16."""
    R = len(all_inp)
    L = num_experts // R
    inp = all_inp[me]
    T, H = inp["x"].shape
    xf = inp["x"].to(torch.float32)
    bs = [b.cpu().to(torch.float32) for b in biases if b is not None]
    out = torch.empty((T, H), dtype=torch.bfloat16)
    for t in range(T):
        lanes = inp["topk_idx"][t].tolist()
        owner = [e // L if e >= 0 else -1 for e in lanes]
        acc = (bs[0][t] + bs[1][t]) if len(bs) == 2 else (bs[0][t].clone() if bs else torch.zeros(H))
        for k, e in enumerate(lanes):
            r = owner[k]
            if expanded and not multi_red:
                term = (xf[t] * expert_scale(e)).to(torch.bfloat16) if r >= 0 else None
            elif r >= 0 and r not in owner[k + 1:]:  # the last lane routed to rank r
                if not expanded:
                    term = (xf[t] * rank_scale(r)).to(torch.bfloat16)
                else:
                    part = torch.zeros(H, dtype=torch.float32)
                    for j in range(k + 1):
                        if owner[j] == r:
                            part += (xf[t] * expert_scale(lanes[j])).to(torch.bfloat16).to(torch.float32)
                    term = part.to(torch.bfloat16)
            else:
                term = None
            acc += term.to(torch.float32) if term is not None else 0.0
        out[t] = acc.to(torch.bfloat16)
    return out


def fake_experts(recv_x: torch.Tensor, handle, me: int, num_experts: int, R: int) -> torch.Tensor:
    """Expert outputs derived from the received rows: non-expand rows scaled per rank, expanded rows
    per expert (a segment's expert is known from the handle's per-expert counts)."""
    xf = recv_x.to(torch.float32)
    if not handle.do_expand:
        return (xf * rank_scale(me)).to(torch.bfloat16)
    L = num_experts // R
    real = handle.num_unaligned_recv_tokens_per_expert.to(torch.int64).cpu()
    starts = handle.psum_num_recv_tokens_per_expert.to(torch.int64).cpu() - real
    scale = torch.ones(recv_x.shape[0], dtype=torch.float32)
    for e in range(L):
        scale[int(starts[e]):int(starts[e] + real[e])] = expert_scale(me * L + e)
    return (xf * scale.to(recv_x.device).view(-1, 1)).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------ canonical
def canonical_dispatch(recv, recv_topk_idx, recv_topk_weights, handle, deterministic: bool) -> Dict[str, object]:
    """Valid rows of a dispatch's outputs, keyed by source token, on the CPU.

    ``handle.recv_src_metadata`` describes the rows the user got, as in DeepEP (in deterministic mode
    too: sorted rows in non-expand mode, remapped row pointers in expand mode), so reading the outputs
    through it checks the metadata as well. In deterministic mode the user's rows must already be
    sorted by source token (inside each expert segment in expand mode).
    """
    recv_x, recv_sf = recv if isinstance(recv, tuple) else (recv, None)
    meta = handle.recv_src_metadata.cpu().to(torch.int64)
    n = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
    src = meta[:n, 0]
    src_user = src
    out: Dict[str, object] = {
        "psum_rank": handle.psum_num_recv_tokens_per_scaleup_rank.cpu().tolist(),
        "real": handle.num_unaligned_recv_tokens_per_expert.cpu().tolist(),
        "psum_expert": handle.psum_num_recv_tokens_per_expert.cpu().tolist(),
        "master": (meta[:n, 1] % handle.num_topk)[torch.argsort(src)].tolist(),
    }
    if not handle.do_expand:
        if deterministic:
            check(src_user.tolist() == sorted(src_user.tolist()), "deterministic mode: rows not sorted by source")
        order = torch.argsort(src_user)
        out["src"] = src_user[order].tolist()
        out["x"] = bytes_of(recv_x.cpu()[:n][order])
        # sf / weights are always keys (None when absent), so an output that lost them cannot match an
        # expected form that has them.
        out["sf"] = bytes_of(recv_sf.cpu()[:n][order].contiguous()) if recv_sf is not None else None
        out["local_idx"] = recv_topk_idx.cpu()[:n][order] if recv_topk_idx is not None else None
        out["weights"] = bytes_of(recv_topk_weights.cpu()[:n][order]) if recv_topk_weights is not None else None
        return out
    # expand: per expert segment, rows sorted by source token
    real = handle.num_unaligned_recv_tokens_per_expert.to(torch.int64).cpu()
    starts = handle.psum_num_recv_tokens_per_expert.to(torch.int64).cpu() - real
    lanes = meta[:n, 2:]
    row_src = {}  # user row -> source token
    for i in range(n):
        for k in range(lanes.shape[1]):
            r = int(lanes[i, k])
            if r >= 0:
                row_src[r] = int(src[i])
    x = recv_x.cpu()
    sf = recv_sf.cpu() if recv_sf is not None else None
    w = recv_topk_weights.cpu() if recv_topk_weights is not None else None
    segs = []
    for e in range(real.numel()):
        a, b = int(starts[e]), int(starts[e] + real[e])
        rows = list(range(a, b))
        if deterministic:
            srcs = [row_src.get(r, -1) for r in rows]
            check(srcs == sorted(srcs), f"deterministic mode: expert {e} rows not sorted by source")
        rows.sort(key=lambda r: row_src.get(r, -1))
        seg = {"src": [row_src.get(r, -1) for r in rows], "x": bytes_of(x[rows]) if rows else None,
               # always keys: None when the output has no scales / weights, bytes (maybe 0 rows) otherwise
               "sf": _rows_bytes(sf, rows), "w": _rows_bytes(w, rows)}
        segs.append(seg)
    out["segments"] = segs
    out["starts"] = starts.tolist()
    return out


def _rows_bytes(t: Optional[torch.Tensor], rows: List[int]) -> Optional[torch.Tensor]:
    """Raw bytes of ``t[rows]`` (0 rows allowed), or None when ``t`` is None."""
    if t is None:
        return None
    return bytes_of(t[torch.tensor(rows, dtype=torch.int64)].contiguous())


def oracle_canonical(orc, expand: bool, alignment: int, has_weights: bool = True) -> Dict[str, object]:
    """The oracle in the same canonical form as ``canonical_dispatch``."""
    import itertools

    out: Dict[str, object] = {
        "psum_rank": list(itertools.accumulate(orc["counts_rank"])),
        "real": orc["real"],
    }
    n = len(orc["src"])
    li = orc["local_idx"]
    out["master"] = [next(k for k in range(li.shape[1]) if li[i, k] >= 0) for i in range(n)]
    starts = [0]
    for a in orc["aligned"][:-1]:
        starts.append(starts[-1] + a)
    if not expand:
        out["psum_expert"] = list(itertools.accumulate(orc["aligned"]))
        out["src"] = orc["src"].tolist()
        out["x"] = bytes_of(orc["x"])
        out["sf"] = bytes_of(orc["sf"]) if "sf" in orc else None
        out["local_idx"] = orc["local_idx"]
        out["weights"] = bytes_of(orc["weights"]) if has_weights else None
        return out
    out["psum_expert"] = [s + r for s, r in zip(starts, orc["real"])]
    segs = []
    for e, lst in orc["experts"].items():
        rows = [i for (_, _, i) in lst]
        seg = {"src": [s for (s, _, _) in lst], "x": bytes_of(orc["x"][rows]) if rows else None,
               "sf": _rows_bytes(orc["sf"], rows) if "sf" in orc else None,
               "w": bytes_of(torch.tensor([float(orc["weights"][i, k]) for (_, k, i) in lst], dtype=torch.float32))
               if has_weights else None}
        segs.append(seg)
    out["segments"] = segs
    out["starts"] = starts
    return out


FAILURES: List[str] = []


def refusal_checker(seen: list):
    """Returns bad(match, fn): fn() must raise ValueError whose message contains `match`, which is then
    appended to `seen` (so a test can also assert how many refusals it checked)."""

    def bad(match: str, fn) -> None:
        try:
            fn()
        except ValueError as e:
            assert match in str(e), f"expected {match!r} in {e!r}"
            seen.append(match)
            return
        raise AssertionError(f"no ValueError for {match}")

    return bad


def check(cond, what: str) -> None:
    """Records a failed check instead of raising, so every rank keeps issuing the same collectives
    (a rank that stopped early would leave its peers waiting); ``raise_failures`` reports them."""
    if not cond:
        FAILURES.append(str(what))


def raise_failures(rank: int) -> None:
    if FAILURES:
        msg = f"rank {rank}: {len(FAILURES)} failed checks:\n  " + "\n  ".join(FAILURES[:20])
        FAILURES.clear()
        raise AssertionError(msg)


def assert_same(a: Dict[str, object], b: Dict[str, object], what: str) -> None:
    """Bitwise equality of two canonical forms: the same keys, and every field equal (a field that is
    None in one form must be None in the other); failures are recorded with ``check``."""
    def eq(u, v):
        if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
            return isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and u.shape == v.shape and torch.equal(u, v)
        if isinstance(u, list) and isinstance(v, list):
            return len(u) == len(v) and all(eq(x, y) for x, y in zip(u, v))
        if isinstance(u, dict) and isinstance(v, dict):
            return u.keys() == v.keys() and all(eq(u[k], v[k]) for k in u)
        return u == v
    if a.keys() != b.keys():
        check(False, f"{what}: fields differ: only in the first {sorted(a.keys() - b.keys())}, "
                     f"only in the second {sorted(b.keys() - a.keys())}")
    for k in a:
        if k not in b:
            continue
        if (a[k] is None) != (b[k] is None):
            check(False, f"{what}: field {k!r} is None in {'the first' if a[k] is None else 'the second'} only")
        elif not eq(a[k], b[k]):
            check(False, f"{what}: field {k!r} differs")


# ------------------------------------------------------------------------------------------ matrix
def case_matrix(kind: str) -> List[dict]:
    """Dispatch/combine cases; options that do not multiply are cycled through the product."""
    import itertools

    dtypes = ["bf16", "fp8", "fp8_ue8m0"]
    cases = []
    for i, (dtype, expand, cpu_sync) in enumerate(itertools.product(dtypes, [False, True], [True, False])):
        cases.append(dict(
            dtype=dtype, expand=expand, cpu_sync=cpu_sync,
            alignment=[1, 128, 4][i % 3] if expand else [1, 128][i % 2],
            zero_padding=expand and i % 2 == 0,
            num_bias=i % 3,
            cached=i % 2 == 1,
            tma_sf=dtype != "bf16" and i % 4 >= 2,
            sf_strided_input=dtype != "bf16" and i % 3 == 1,
            stream_opt=["sync", "async", "prev_event", "alloc_comm"][i % 4] if kind == "gpu" else ["sync", "async"][i % 2],
            handle_copy=i % 5 != 4,
            zero_copy=not expand and i % 3 != 2,
        ))
    return cases


def run_case(buf, ref, group, me: int, R: int, case: dict, shape: dict, seed: int, with_oracle: bool = True) -> None:
    """One dispatch (+ cached dispatch) + combine on ``buf`` checked against the oracle and, if given,
    against the same calls on the reference buffer ``ref`` (bitwise, canonical form)."""
    ep = sys.modules["elastic_ep"]
    dev = buf.device
    H, K, E, M = shape["hidden"], shape["topk"], shape["experts"], shape["max_tokens"]
    tokens = shape["tokens"](me) if callable(shape["tokens"]) else shape["tokens"]
    inp = make_inputs(me, tokens, H, K, E, case["dtype"], seed, dev)
    all_inp = gather_inputs(inp, group) if with_oracle else None
    L = E // R

    def do(b, handle=None):
        x = inp["x"]
        if "sf" in inp:
            sf = inp["sf"]
            if case["sf_strided_input"]:
                sf = sf.t().contiguous().t()  # column-major input scales
            x = (x, sf)
        stats = torch.zeros(L, dtype=torch.int32, device=dev)
        kw = dict(num_experts=E, expert_alignment=case["alignment"], do_expand=case["expand"],
                  do_zero_padding=case["zero_padding"], do_cpu_sync=case["cpu_sync"],
                  use_tma_aligned_col_major_sf=case["tma_sf"], do_handle_copy=case["handle_copy"],
                  cumulative_local_expert_recv_stats=stats, zero_copy=case.get("zero_copy", False))
        if handle is not None:
            kw = dict(handle=handle, do_expand=case["expand"], do_zero_padding=case["zero_padding"],
                      use_tma_aligned_col_major_sf=case["tma_sf"], zero_copy=case.get("zero_copy", False))
        opt = case["stream_opt"]
        if opt == "async":
            kw.update(async_with_compute_stream=True)
        elif opt == "prev_event":
            kw.update(previous_event=b.capture(), allocate_on_comm_stream=True, async_with_compute_stream=True)
        elif opt == "alloc_comm":
            kw.update(allocate_on_comm_stream=True, previous_event_before_epilogue=b.capture())
        out = b.dispatch(x, topk_idx=None if handle is not None else inp["topk_idx"],
                         topk_weights=inp["topk_weights"] if handle is None else inp["topk_weights"], **kw)
        if b.deterministic and kw.get("async_with_compute_stream") and out[4].event is not None:
            check(out[4].hook_after_wait is not None, f"deterministic async dispatch: the sort must run at the wait {case}")
        out[4].current_stream_wait()
        return out, stats

    (recv, ridx, rw, handle, _), stats = do(buf)
    if case["cpu_sync"]:
        n_alloc = handle.num_expanded_tokens if case["expand"] else handle.num_recv_tokens
        check((recv[0] if isinstance(recv, tuple) else recv).shape[0] == n_alloc, f"rows != {n_alloc} {case}")
    else:
        worst = R * M
        check(handle.num_recv_tokens == worst, f"worst case {handle.num_recv_tokens} != {worst} {case}")
        check(handle.num_recv_tokens_per_expert_list == [], f"per-expert list not empty without CPU sync {case}")
    if isinstance(recv, tuple) and case["tma_sf"]:
        n_alloc = recv[1].shape[0]
        check(recv[1].stride() == (1, (n_alloc + 3) // 4 * 4), f"sf strides {recv[1].stride()} {case}")
    canon = canonical_dispatch(recv, ridx, rw, handle, buf.deterministic)
    if case.get("zero_copy"):
        check(handle.views_serial == buf._dispatch_serial, f"zero-copy handle not marked {case}")
        if buf.backend == "native":  # a view of the receive buffer, not a copy
            x0 = recv[0] if isinstance(recv, tuple) else recv
            lo = int(buf.runtime._rt.buffer_ptr)
            check(lo <= x0.data_ptr() and x0.data_ptr() + x0.numel() * x0.element_size() <= lo + buf.num_bytes,
                  f"zero-copy recv_x is not inside the buffer {case}")
    if with_oracle:
        orc = oracle_dispatch(all_inp, me, E, M, case["alignment"])
        assert_same(oracle_canonical(orc, case["expand"], case["alignment"]), canon, f"oracle vs {buf.backend} {case}")
        check(stats.cpu().tolist() == orc["real"], f"stats {stats.cpu().tolist()} != {orc['real']} {case}")
        if case["cpu_sync"]:
            check(handle.num_recv_tokens_per_expert_list == orc["aligned"], f"per-expert list {case}")
    if case["zero_padding"]:
        x0 = recv[0] if isinstance(recv, tuple) else recv
        real = handle.num_unaligned_recv_tokens_per_expert.to(torch.int64).cpu()
        ends = handle.psum_num_recv_tokens_per_expert.to(torch.int64).cpu()
        a = case["alignment"]
        for e in range(L):
            pad_end = int(ends[e] - real[e]) + (int(real[e]) + a - 1) // a * a
            check(bool((x0[int(ends[e]):pad_end].to(torch.float32) == 0).all()), f"expert {e} padding not zero {case}")
    if ref is not None:
        (r_recv, r_idx, r_w, r_handle, _), _ = do(ref)
        assert_same(canonical_dispatch(r_recv, r_idx, r_w, r_handle, ref.deterministic), canon,
                    f"{ref.backend} vs {buf.backend} {case}")
    if case["cached"]:
        (c_recv, c_idx, c_w, c_handle, _), c_stats = do(buf, handle)
        check(c_handle is handle, "cached dispatch returned another handle")
        assert_same(canonical_dispatch(c_recv, c_idx, c_w, handle, buf.deterministic), canon, f"cached {case}")
        check(int(c_stats.abs().sum()) == 0, "cached mode must not touch the stats")

    # combine
    x0 = recv[0] if isinstance(recv, tuple) else recv
    y = fake_experts(x0, handle, me, E, R)
    w2 = rw * 2 if rw is not None else None
    g = torch.Generator().manual_seed(seed * 7 + me)
    biases = [torch.randn((tokens, H), generator=g).to(torch.bfloat16).to(dev) for _ in range(case["num_bias"])]
    bias = None if not biases else (biases[0] if len(biases) == 1 else tuple(biases))
    kw = {}
    if case["stream_opt"] == "async":
        kw = dict(async_with_compute_stream=True)
    elif case["stream_opt"] == "prev_event":
        kw = dict(previous_event=buf.capture(), allocate_on_comm_stream=True, async_with_compute_stream=True)
    cx, cw, ev = buf.combine(y, handle, topk_weights=w2, bias=bias, **kw)
    ev.current_stream_wait()
    check(cx.shape == (tokens, H) and cx.dtype == torch.bfloat16, f"combined shape {tuple(cx.shape)} {case}")
    if case.get("zero_copy"):  # the views outlive the combine
        assert_same(canonical_dispatch(recv, ridx, rw, handle, buf.deterministic), canon,
                    f"zero-copy views after combine {case}")
    if with_oracle:
        exp = oracle_combine(all_inp, me, E, case["expand"], buf.allow_multiple_reduction, biases + [None])
        check(torch.equal(bytes_of(cx.cpu()), bytes_of(exp)), f"combine vs oracle {case}")
        tk = all_inp[me]["topk_idx"]
        expw = torch.where(tk >= 0, all_inp[me]["topk_weights"] * 2, torch.zeros_like(all_inp[me]["topk_weights"]))
        check(cw is not None and torch.equal(bytes_of(cw.cpu()), bytes_of(expw)), f"combined weights vs oracle {case}")
    if ref is not None:
        ry = fake_experts(r_recv[0] if isinstance(r_recv, tuple) else r_recv, r_handle, me, E, R)
        rcx, rcw, rev = ref.combine(ry, r_handle, topk_weights=r_w * 2 if r_w is not None else None, bias=bias)
        rev.current_stream_wait()
        check(torch.equal(bytes_of(rcx.cpu()), bytes_of(cx.cpu())), f"combine {ref.backend} vs {buf.backend} {case}")
        check((rcw is None) == (cw is None), f"combined weights None in one backend only {case}")
        if rcw is not None and cw is not None:
            check(torch.equal(bytes_of(rcw.cpu()), bytes_of(cw.cpu())), f"combined weights {ref.backend} vs {buf.backend} {case}")


def init_ep_group(rank: int, world: int, rdzv: str, window: str = "auto"):
    """The group a native elastic_ep GPU test talks over: NCCL (one GPU per rank), or for the CUDA-IPC
    window whatever ``init_gpu_group`` picks (gloo when the ranks share a GPU, which NCCL refuses)."""
    from tests._dist import init_gpu_group, init_nccl

    if window == "ipc":
        init_gpu_group(rank, world, rdzv)
        return dist.group.WORLD
    return init_nccl(rank, world, rdzv)


def ops_buffer(rank: int, world: int, rdzv: str, backend: str, **kw):
    """``(group, buffer)`` of the AGRS / PP / Engram workers: the torch runtime over gloo, or
    (``backend="native"``) the native runtime on its CUDA-IPC window (the ranks may share a GPU)."""
    from tests._dist import init_gloo

    ep = import_elastic_ep()
    if backend == "native":
        group = init_ep_group(rank, world, rdzv, "ipc")
        return group, ep.ElasticBuffer(group, backend="native", window="ipc", **kw)
    group = init_gloo(rank, world, rdzv)
    return group, ep.ElasticBuffer(group, backend="torch", **kw)


@contextlib.contextmanager
def scaleup_override(n: Optional[int]):
    """``ELASTIC_EP_NUM_SCALEUP_RANKS=n`` while buffers are created inside (nothing when ``n`` is None)."""
    old = os.environ.pop("ELASTIC_EP_NUM_SCALEUP_RANKS", None)
    if n is not None:
        os.environ["ELASTIC_EP_NUM_SCALEUP_RANKS"] = str(n)
    try:
        yield
    finally:
        os.environ.pop("ELASTIC_EP_NUM_SCALEUP_RANKS", None)
        if old is not None:
            os.environ["ELASTIC_EP_NUM_SCALEUP_RANKS"] = old


def matrix_worker(rank: int, world: int, rdzv: str, cfg: dict):
    """Runs ``case_matrix(cfg['kind'])`` for each buffer option set in ``cfg['buffers']``.

    ``cfg['window'] == 'ipc'``: the native buffer on its CUDA-IPC window, over a gloo group when the
    ranks share a GPU (then only the oracle can check it: the torch backend needs NCCL for GPU tensors).
    ``cfg['compare_torch']``: a torch-backend reference buffer; ``cfg['compare_direct']``: a direct-mode
    buffer of the same backend and window (for ``cfg['num_scaleup_ranks']``, hybrid mode's reference).
    ``cfg['cases']``: the cases (default ``case_matrix(cfg['kind'])``).
    """
    from tests._dist import init_gloo

    ep = import_elastic_ep()
    window = cfg.get("window", "auto")
    group = init_ep_group(rank, world, rdzv, window) if cfg["device"] == "cuda" else init_gloo(rank, world, rdzv)
    shape = dict(cfg["shape"])
    tok = shape["tokens"]
    if isinstance(tok, list):
        shape["tokens"] = tok[rank % len(tok)]
    done = 0
    for bopts in cfg["buffers"]:
        kw = dict(num_max_tokens_per_rank=shape["max_tokens"], hidden=shape["hidden"], num_topk=shape["topk"],
                  use_fp8_dispatch=True, **bopts)
        # Room for the zero-copy cases (bf16 rows: the larger receive area).
        nbytes = max(ep.ElasticBuffer.get_buffer_size_hint(group, shape["max_tokens"], shape["hidden"], shape["topk"],
                                                           False, True, bopts.get("allow_multiple_reduction", True),
                                                           zero_copy=True),
                     ep.ElasticBuffer.get_buffer_size_hint(group, shape["max_tokens"], shape["hidden"], shape["topk"],
                                                           True, True, bopts.get("allow_multiple_reduction", True)))
        # cfg["num_scaleup_ranks"]: the buffer under test in hybrid mode (logical domains of that size);
        # the reference buffer (compare_torch) stays in direct mode.
        with scaleup_override(cfg.get("num_scaleup_ranks")):
            buf = ep.ElasticBuffer(group, nbytes, backend=cfg["backend"], window=window, **kw)
        if cfg.get("num_scaleup_ranks"):
            check(buf.get_logical_domain_size() == (world // cfg["num_scaleup_ranks"], cfg["num_scaleup_ranks"]),
                  f"logical domains {buf.get_logical_domain_size()}")
        if cfg.get("shuffle") and buf.backend == "torch":  # emulate the native kernels' row order
            buf.runtime.shuffle_generator = torch.Generator().manual_seed(1000 + rank)
        ref = None
        if cfg.get("compare_torch"):
            ref = ep.ElasticBuffer(group, nbytes, backend="torch", **kw)
        elif cfg.get("compare_direct"):  # the same backend and window in direct mode
            ref = ep.ElasticBuffer(group, nbytes, backend=cfg["backend"], window=window, **kw)
        for i, case in enumerate(cfg.get("cases") or case_matrix(cfg["kind"])):
            run_case(buf, ref, group, rank, world, case, shape, seed=cfg.get("seed", 0) * 100 + i,
                     with_oracle=cfg.get("oracle", True))
            done += 1
        buf.destroy()
        if ref is not None:
            ref.destroy()
    dist.destroy_process_group()
    raise_failures(rank)
    return done


def soak_worker(rank, world, rdzv, iters, window="auto", seed_epoch=0, num_scaleup_ranks=None):
    """Random cases of the native buffer against the oracle, and also against the torch backend (except
    window="ipc": the ranks may share a GPU, where the group is gloo, which the torch backend cannot use
    for GPU tensors). seed_epoch: start as if that many operations had run (the 32-bit tags of the count
    words wrap at 2^32 operations; the kernels' u64 epoch must carry on across it). num_scaleup_ranks:
    the buffer in hybrid mode (logical domains of that size), checked against a direct-mode buffer of
    the same window as well."""
    import random

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, window)
    shape = dict(hidden=256, topk=4, experts=16, max_tokens=64)
    kw = dict(num_max_tokens_per_rank=64, hidden=256, num_topk=4, use_fp8_dispatch=True)
    with scaleup_override(num_scaleup_ranks):
        buf = ep.ElasticBuffer(group, backend="native", window=window, **kw)
    if num_scaleup_ranks:  # hybrid mode: direct mode on the same window is the reference too
        ref = ep.ElasticBuffer(group, backend="native", window=window, **kw)
    else:
        ref = None if window == "ipc" else ep.ElasticBuffer(group, backend="torch", **kw)
    if seed_epoch:
        buf.runtime._rt.debug_seed_epoch(seed_epoch)
        group.barrier()  # every rank seeded before any kernel of the next operation runs
    rng = random.Random(1234)  # same sequence of cases on every rank
    for it in range(iters):
        tokens = [rng.randint(0, 64) for _ in range(world)]
        expand = rng.random() < 0.5
        case = dict(dtype=rng.choice(["bf16", "fp8"]), expand=expand, cpu_sync=rng.random() < 0.7,
                    alignment=rng.choice([1, 4, 128]), zero_padding=expand and rng.random() < 0.5,
                    num_bias=rng.randint(0, 2), cached=rng.random() < 0.2, tma_sf=False, sf_strided_input=False,
                    stream_opt=rng.choice(["sync", "async"]), handle_copy=True)
        run_case(buf, ref, group, rank, world, case, dict(shape, tokens=tokens[rank]), seed=10_000 + it,
                 with_oracle=True)
    buf.destroy()
    if ref is not None:
        ref.destroy()
    raise_failures(rank)
    return iters


def check_forward_metadata(handle, everyone, rank: int, world: int, U: int, num_experts: int, M: int) -> int:
    """A hybrid dispatch handle's ``token_metadata_at_forward`` / ``channel_linked_list`` against an
    independent derivation from every rank's routing (``everyone``: ``gather_inputs``). The tokens a
    rank relays come from its rail (same scale-up index), in source-domain then token order, when one
    of their experts lives in its domain; the mask names those ranks. Returns the relayed count."""
    meta, linked = handle.token_metadata_at_forward, handle.channel_linked_list
    L, s_me, u_me = num_experts // world, rank // U, rank % U
    want = []
    for s in range(world // U):
        src = s * U + u_me
        for t, row in enumerate(everyone[src]["topk_idx"].tolist()):
            mask = 0
            for e in row:
                if e >= 0 and (e // L) // U == s_me:
                    mask |= 1 << ((e // L) % U)
            if mask:
                want.append((src * M + t, mask))
    got = [(int(a), int(b)) for a, b in meta[:, :2].tolist()]
    assert got == want, f"rank {rank}: relayed {got}, expected {want}"
    for b in range(U):
        rows = [i for i, (_, mask) in enumerate(want) if mask >> b & 1]
        listed = [int(v) for v in linked[b].tolist() if v >= 0]
        assert listed == rows, f"rank {rank}: linked list to scale-up rank {b}: {listed}, expected {rows}"
        assert [int(meta[i, 2 + b]) for i in rows] == list(range(len(rows)))
        others = [i for i in range(len(want)) if i not in rows]
        assert all(int(meta[i, 2 + b]) == -1 for i in others)
    return len(want)


def expect_timeout(buf, stage, call, rank=0, peer=1):
    """A waiting rank's side of a timeout test: `call` must raise TimeoutError naming `stage`, `rank` and
    `peer` (the device record names who waited for whom) within 14 s, and CUDA must stay usable."""
    import time

    t0 = time.monotonic()
    try:
        call()
        torch.cuda.synchronize()
        buf.barrier(with_cpu_sync=True)
    except TimeoutError as e:
        msg = str(e)
        assert time.monotonic() - t0 < 14, "the timeout took too long"
        assert stage in msg.lower(), msg
        assert f"rank {rank}" in msg and f"peer {peer}" in msg, msg
        assert int(torch.arange(10, device="cuda").sum()) == 45
        return "timeout"
    raise AssertionError(f"{stage} without a peer did not time out")
