"""Shared helpers of the elastic_ep tests: inputs, an independent oracle, canonical forms, group set-up.

The oracle gathers every rank's inputs (``all_gather_object``) and computes, with plain per-token
loops, what this rank must receive and what combine must return. Outputs of any backend are turned
into a canonical form (rows sorted by source token, per expert in expand mode; only valid rows) and
compared bitwise (``torch.equal`` on raw bytes).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Dict, List, Optional, Set

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


# ------------------------------------------------------------------------------------------ /dev/shm
#: Name prefixes of the POSIX shared-memory segments this repository's packages create. commkit::ShmSegment
#: names a segment "/<prefix>_<32 hex digits>" (common/include/commkit/shm.hpp, random_shm_name), which is
#: /dev/shm/<prefix>_<hex>; the prefixes in use: elastic_ep's Engram host segments ("elastic_ep_engram",
#: csrc/host/engram.cpp) and fp8_layerwise's control region and slots ("fp8lw_ctl", "fp8lw_slots", _shm.py).
#: ipc_all2all creates none.
OUR_SHM_PREFIXES = ("elastic_ep_engram_", "fp8lw_ctl_", "fp8lw_slots_")
SHM_DIR = "/dev/shm"


def shm_entries(shm_dir: str = SHM_DIR) -> Set[str]:
    """The names in ``shm_dir`` now (empty when there is no such folder)."""
    try:
        return set(os.listdir(shm_dir))
    except FileNotFoundError:
        return set()


def new_shm_segments(before: Set[str], grace_s: float = 1.0, shm_dir: str = SHM_DIR) -> List[str]:
    """Sorted names in ``shm_dir`` with one of ``OUR_SHM_PREFIXES`` that were not in ``before`` and are still
    there ``grace_s`` seconds later: a leaked segment stays, one that another process (a concurrent test)
    creates and unlinks within milliseconds is not counted."""
    def ours() -> Set[str]:
        return {n for n in shm_entries(shm_dir) - before if n.startswith(OUR_SHM_PREFIXES)}

    new = ours()
    if new and grace_s > 0:
        time.sleep(grace_s)
        new &= ours()
    return sorted(new)


@contextlib.contextmanager
def no_shm_leftovers(what: str, shm_dir: str = SHM_DIR, grace_s: float = 1.0):
    """Asserts that the block (e.g. ``run_workers``, in the test's parent process) leaves no new segment of
    ours in ``shm_dir`` (``new_shm_segments``); not checked when the block raises (its error is reported)."""
    before = shm_entries(shm_dir)
    yield
    left = new_shm_segments(before, grace_s, shm_dir)
    assert not left, f"{what}: left behind in {shm_dir}: {left}"
