"""DeepEP V1's low-latency mode (``elastic_ep.Buffer(..., low_latency_mode=True)``) on CPU ranks (torch
backend over gloo), bitwise against a plain-loop reference built here from every rank's inputs.

What DeepEP V1's tests/test_low_latency.py checks, written here from the semantics of its
``deep_ep/buffer.py`` (the packed order made deterministic, see ``_low_latency``'s docstring):

* ``low_latency_dispatch`` in every mode (BF16; FP8 with ``round_scale`` off and on; UE8M0 scales), with
  each completion mode (plain, ``async_finish``, ``return_recv_hook``), int64 and int32 ``topk_idx``: per
  local expert ``recv_count``, ``layout_range`` ((begin << 32) | count per source rank), ``src_info`` and
  the received rows, FP8 bytes and scales against DeepEP's per-token cast (written here), scales in the
  column-major layout; ``cumulative_local_expert_recv_stats`` accumulating; the wait statistics.
* ``low_latency_combine`` of expert outputs made from the received rows: plain, with ``out=``, zero-copy
  through ``get_next_low_latency_combine_buffer``, ``async_finish``, ``return_recv_hook``; each token's
  lanes summed in lane order in fp32 (``acc + row * w``) and rounded to BF16 once, lanes with id -1
  skipped; rows past ``recv_count`` (NaN here) never read.
* Two micro-batches overlapped with the hooks (dispatch A, dispatch B, receive A, receive B, combine A,
  combine B, receive both); ``clean_low_latency_buffer`` and a round after it.
* Shrink mode (``enable_shrink``): a rank masked by every rank is neither sent to nor received from, the
  mask calls report and clear it.
The refusals, the size hint and the README's port are in ``test_v1_low_latency_args_cpu``.

On 1, 2 and 4 ranks with different token counts (one rank with none), hidden 512 (UE8M0 packs 4 scales of
128 channels per int32), some top-k lanes -1, a token without any lane and a token naming one expert in two
lanes. ``ll_worker`` is also the GPU test's (``test_v1_low_latency_gpu``: native backend).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Set, Tuple

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_workers
from tests.elastic_ep._common import gather_inputs, import_elastic_ep

ep = import_elastic_ep()

FP8 = torch.float8_e4m3fn
HIDDEN = 512
GROUPS = HIDDEN // 128          # FP8 scale groups per row
TOKENS = [13, 0, 9, 5]          # tokens of rank r (rank 1 dispatches none)
MAX_TOKENS = 16                 # num_max_dispatch_tokens_per_rank: a bit above the largest count
# (use_fp8, round_scale, use_ue8m0) of each dispatch mode
MODES = {"bf16": (False, False, False), "fp8": (True, False, False), "fp8_round": (True, True, False),
         "ue8m0": (True, True, True)}
# The planted FP8 rounding tie (token 1, second scale group): 1.125 * 448 / 1.5 = 336 exactly, halfway between
# the E4M3 values 320 and 352. 448 / 1.5 rounded once to fp32 is below 298.666..., so the product rounds down
# to 320; torch's ``448.0 / t`` is ``t.reciprocal() * 448`` (two roundings), just above it: 352.
TIE_AMAX, TIE_X, TIE_Q = 1.5, 1.125, 320.0


def geometry(world: int) -> Tuple[int, int]:
    """(num_experts, top-k) of a world: 8 experts on 1-2 ranks, 16 on 4; top-4, top-3 on 4 ranks."""
    return (8, 4) if world <= 2 else (16, 3)


def num_tokens(rank: int, world: int) -> int:
    return TOKENS[rank % len(TOKENS)] if world > 1 else TOKENS[0]


# ------------------------------------------------------------------------------------------ inputs
def rank_inputs(rank: int, world: int, seed: int) -> Dict[str, torch.Tensor]:
    """One rank's x [T, 512] bf16, topk_idx [T, K] int64 and topk_weights [T, K] f32 (CPU).

    x has a different magnitude per scale group (so the FP8 scales differ), token 0's first group is zero
    (amax clamped at 1e-4), token 1's second group holds the planted FP8 tie. topk_idx: distinct experts,
    some lanes -1, token 2 with no lane at all, token 3 naming one expert in lanes 0 and K-1 (two rows
    for that expert, each combined back into its own lane). The lanes of the +-2**20 experts of a token
    share one weight (see ``expert_scale``)."""
    E, K = geometry(world)
    T = num_tokens(rank, world)
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    mag = 2.0 ** torch.randint(-6, 7, (T, GROUPS, 1), generator=g).float()
    x = (torch.randn((T, GROUPS, 128), generator=g) * mag).view(T, HIDDEN)
    if T > 0:
        x[0, :128] = 0.0
    if T > 1:
        grp = (torch.rand(128, generator=g) * 2 - 1) * TIE_AMAX * 0.7
        grp[5], grp[77], grp[100] = TIE_AMAX, TIE_X, -TIE_X
        x[1, 128:256] = grp
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
        torch.empty((0, K), dtype=torch.int64)
    topk = torch.where(torch.rand((T, K), generator=g) < 0.15, torch.full_like(topk, -1), topk)
    if T > 2:
        topk[2] = -1
    if T > 3:
        e = int(topk[3, 1]) if int(topk[3, 1]) >= 0 else 0
        topk[3, 0], topk[3, K - 1] = e, e
    w = torch.randn((T, K), generator=g)
    big = (topk >= 0) & (topk % 4 < 2)  # experts of factor +-2**20: one weight per token (see expert_scale)
    w = torch.where(big, w[:, :1], w)
    return {"x": x.to(torch.bfloat16), "topk_idx": topk.to(torch.int64), "topk_weights": w}


# ------------------------------------------------------------------------------------------ reference
def round_up_pow2(sf: torch.Tensor) -> torch.Tensor:
    """f32 values rounded up to powers of two by their bits: a non-zero mantissa carries into the exponent."""
    out = []
    for b in sf.view(torch.int32).tolist():
        exp, mant = b >> 23, b & 0x7FFFFF
        out.append((exp + (1 if mant else 0)) << 23)
    return torch.tensor(out, dtype=torch.int32).view(torch.float32)


def cast_row(x: torch.Tensor, round_scale: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepEP V1's per-token FP8 cast of one bf16 row [H]: (E4M3 [H], f32 scales [H / 128]).

    Per 128 channels: amax = max |x| clamped at 1e-4, sf = amax x float32(1 / 448) (DeepEP V1's kernel:
    ``scale_inv = amax * kFP8AmaxInv``); plain: q = x * (448 / amax), the quotient rounded once (IEEE
    division, written tensor / tensor: torch's ``448.0 / t`` is ``t.reciprocal() * 448``, two roundings);
    round_scale: sf rounded up to a power of two, q = x * (1 / sf) (exact)."""
    g = x.float().view(-1, 128)
    amax = g.abs().amax(dim=-1).clamp(min=1e-4)
    sf = amax * torch.tensor(1.0 / 448.0, dtype=torch.float32)
    if round_scale:
        sf = round_up_pow2(sf)
        scale = torch.ones_like(sf) / sf
    else:
        scale = torch.full_like(amax, 448.0) / amax
    return (g * scale.unsqueeze(-1)).to(FP8).view(-1), sf


def pack_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """Power-of-two f32 scales [G] -> their exponent bytes, 4 per int32 little-endian: [G / 4] int32."""
    exps = [(b >> 23) & 0xFF for b in sf.view(torch.int32).tolist()]
    words = []
    for i in range(0, len(exps), 4):
        v = exps[i] | exps[i + 1] << 8 | exps[i + 2] << 16 | exps[i + 3] << 24
        words.append(v - (1 << 32) if v >= 1 << 31 else v)
    return torch.tensor(words, dtype=torch.int32)


BIG = 2.0 ** 20


def expert_scale(e: int) -> float:
    """The fake expert ``e``'s factor: +2**20 (e % 4 == 0), -2**20 (e % 4 == 1), else small. A token's big
    lanes share one weight (``rank_inputs``), so a +big and a -big lane cancel exactly and the small lanes
    survive whole only where they are added after both: the bits of a sum depend on the lane order."""
    return (BIG, -BIG)[e % 4] if e % 4 < 2 else 1.0 + 0.125 * (e % 5)


def expert_input(x: torch.Tensor, mode: str) -> torch.Tensor:
    """The f32 row an expert computes on, from the source's bf16 row: the row itself, or its FP8 cast
    dequantised (q * scale per 128 channels)."""
    use_fp8, round_scale, _ = MODES[mode]
    if not use_fp8:
        return x.float()
    q, sf = cast_row(x, round_scale)
    return (q.float().view(-1, 128) * sf.unsqueeze(-1)).view(-1)


Views = List[Set[int]]  # views[s]: the ranks rank s has masked (shrink mode)


def reference_dispatch(all_inp: List[Dict[str, torch.Tensor]], me: int, E: int,
                       views: Views) -> List[Tuple[List[Tuple[int, int, int]], List[Tuple[int, int]]]]:
    """Per local expert of rank ``me``: its rows as (source rank, token, lane), source rank 0's first, each
    rank's in (token, lane) order, and each source's (begin, count). Rank s's rows reach ``me`` unless s
    masked ``me`` (nothing sent) or ``me`` masked s (nothing received)."""
    R = len(all_inp)
    L = E // R
    out = []
    for l in range(L):
        rows: List[Tuple[int, int, int]] = []
        ranges = []
        for s in range(R):
            begin = len(rows)
            if me not in views[s] and s not in views[me]:
                for t, lanes in enumerate(all_inp[s]["topk_idx"].tolist()):
                    rows += [(s, t, k) for k, e in enumerate(lanes) if e == me * L + l]
            ranges.append((begin, len(rows) - begin))
        out.append((rows, ranges))
    return out


def reference_combine(all_inp: List[Dict[str, torch.Tensor]], me: int, E: int, views: Views, mode: str,
                      weights: torch.Tensor) -> torch.Tensor:
    """Rank ``me``'s combined_x: per token, over its lanes in order, acc = acc + expert_out.float() * w in
    fp32 (a multiply, then an add), skipping lanes with id -1 or on a rank ``me`` masked; one rounding."""
    L = E // len(all_inp)
    inp = all_inp[me]
    T = inp["x"].shape[0]
    out = torch.empty((T, HIDDEN), dtype=torch.bfloat16)
    for t in range(T):
        row = expert_input(inp["x"][t], mode)
        acc = torch.zeros(HIDDEN, dtype=torch.float32)
        for k, e in enumerate(inp["topk_idx"][t].tolist()):
            if e < 0 or e // L in views[me]:
                continue
            y = (row * expert_scale(e)).to(torch.bfloat16)
            acc = acc + y.float() * weights[t, k]
        out[t] = acc.to(torch.bfloat16)
    return out


# ------------------------------------------------------------------------------------------ the experts
def expert_outputs(recv_x, recv_count: torch.Tensor, mode: str, scales: torch.Tensor) -> torch.Tensor:
    """What the local experts return ([L, R * M, H] bf16) from ``low_latency_dispatch``'s outputs: the
    received row (FP8: dequantised with its scales) times the expert's factor (``scales`` [L] f32 on the
    buffer's device), rounded to BF16; NaN past ``recv_count``, which combine must not read. Torch ops
    only, no host sync (the CUDA-graph test captures it)."""
    use_fp8, _, ue8m0 = MODES[mode]
    if use_fp8:
        q, s = recv_x
        L, RM, H = q.shape
        if ue8m0:  # exponent bytes, 4 per int32 little-endian -> 2 ** (e - 127)
            exps = torch.stack([(s >> (8 * j)) & 0xFF for j in range(4)], dim=-1).reshape(L, RM, H // 128)
            s = (exps << 23).view(torch.float32)
        rows = (q.float().view(L, RM, H // 128, 128) * s.unsqueeze(-1)).view(L, RM, H)
    else:
        rows = recv_x.float()
        L, RM, H = rows.shape
    y = (rows * scales.view(L, 1, 1)).to(torch.bfloat16)
    valid = torch.arange(RM, device=y.device).view(1, RM) < recv_count.view(L, 1)
    return torch.where(valid.unsqueeze(-1), y, torch.full_like(y, math.nan))


# ------------------------------------------------------------------------------------------ checks
def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor's bytes, [rows, bytes per row], whatever its strides (a [n, 1] view of column-major
    scales counts as contiguous but cannot be viewed as bytes)."""
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return dense.view(torch.uint8).reshape(t.shape[0], math.prod(t.shape[1:]) * t.element_size())


class Checks:
    """Records failed checks (every rank keeps issuing the same calls; the test reports them all)."""

    def __init__(self, rank: int, suite: str) -> None:
        self.rank, self.suite, self.failures, self.count, self.where = rank, suite, [], 0, ""

    def __call__(self, cond: bool, what: str) -> None:
        self.count += 1
        if not cond:
            self.failures.append(f"rank {self.rank} [{self.suite} {self.where}] {what}")

    def same(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        got = got.cpu()
        if got.shape != want.shape or got.dtype != want.dtype:
            self(False, f"{what}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}")
            return
        a, b = raw_bytes(got), raw_bytes(want)
        if torch.equal(a, b):
            self(True, what)
            return
        bad = int((a != b).reshape(a.shape[0], -1).any(-1).sum()) if a.dim() > 1 else 1
        self(False, f"{what}: bits differ ({bad} of {a.shape[0]} rows)")

    def raises(self, exc: type, name: str, fn: Callable, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except exc as e:
            self(name in str(e), f"{exc.__name__} without {name!r}: {e}")
            return
        self(False, f"no {exc.__name__} naming {name!r}")


class Ctx:
    """A worker's fixed state: rank, group, device, backend, window, geometry, the expert factors."""

    def __init__(self, rank: int, world: int, group, cfg: dict, device: torch.device) -> None:
        self.rank, self.world, self.group, self.cfg, self.device = rank, world, group, cfg, device
        self.E, self.K = geometry(world)
        self.L = self.E // world
        self.M, self.H = MAX_TOKENS, HIDDEN
        self.hint = ep.Buffer.get_low_latency_rdma_size_hint(self.M, self.H, world, self.E)
        self.scales = torch.tensor([expert_scale(rank * self.L + l) for l in range(self.L)], dtype=torch.float32,
                                   device=device)

    def buffer(self, shrink: bool = False):
        return ep.Buffer(self.group, 0, self.hint, low_latency_mode=True, enable_shrink=shrink,
                         backend=self.cfg["backend"], window=self.cfg["window"])


class Round:
    """One micro-batch: this rank's inputs on the device, every rank's on the CPU, the mask views."""

    def __init__(self, c: Ctx, seed: int, mode: str, views: Optional[Views] = None, idx32: bool = False) -> None:
        self.c, self.mode = c, mode
        inp = rank_inputs(c.rank, c.world, seed)
        self.all_inp = gather_inputs(inp, c.group)
        self.views = views if views is not None else [set() for _ in range(c.world)]
        self.x = inp["x"].to(c.device)
        self.idx = inp["topk_idx"].to(torch.int32 if idx32 else torch.int64).to(c.device)
        self.w = inp["topk_weights"].to(c.device)

    def dispatch(self, buf, how: str, cum: Optional[torch.Tensor] = None, wait: Optional[torch.Tensor] = None):
        use_fp8, round_scale, ue8m0 = MODES[self.mode]
        return buf.low_latency_dispatch(self.x, self.idx, self.c.M, self.c.E, cumulative_local_expert_recv_stats=cum,
                                        dispatch_wait_recv_cost_stats=wait, use_fp8=use_fp8, round_scale=round_scale,
                                        use_ue8m0=ue8m0, async_finish=how == "async",
                                        return_recv_hook=how == "hook")


def finish(res, how: str):
    """Completes a call made with ``how``: waits for the event, or runs the receive hook."""
    event, hook = res[-2], res[-1]
    if how == "hook":
        hook()
    else:
        event.current_stream_wait()
        hook()  # without return_recv_hook a no-op, as DeepEP V1's
    return res


def check_dispatch(ck: Checks, r: Round, res) -> None:
    """recv_x / recv_count / handle against ``reference_dispatch``; rows past recv_count unchecked."""
    c = r.c
    recv_x, recv_count, handle = res[0], res[1], res[2]
    L, R, M, H, RM = c.L, c.world, c.M, c.H, c.world * c.M
    use_fp8, round_scale, ue8m0 = MODES[r.mode]
    ck(len(handle) == 5 and tuple(handle[2:]) == (M, H, c.E), "handle[2:] == (M, hidden, num_experts)")
    src_info, layout_range = handle[0].cpu(), handle[1].cpu()
    ck(src_info.dtype == torch.int32 and src_info.shape == (L, RM), "src_info int32 [L, R * M]")
    ck(layout_range.dtype == torch.int64 and layout_range.shape == (L, R), "layout_range int64 [L, R]")
    ck(recv_count.dtype == torch.int32 and recv_count.shape == (L,), "recv_count int32 [L]")
    if use_fp8:
        ck(isinstance(recv_x, tuple) and len(recv_x) == 2, "FP8 recv_x is (rows, scales)")
        q, s = recv_x
        ck(q.dtype == FP8 and q.shape == (L, RM, H), "FP8 rows [L, R * M, hidden] e4m3")
        G = H // 512 if ue8m0 else H // 128
        ck(s.dtype == (torch.int32 if ue8m0 else torch.float32) and s.shape == (L, RM, G),
           f"scales {'int32' if ue8m0 else 'f32'} [L, R * M, {G}]")
        ck(s.stride() == (G * RM, 1, RM), f"scales column-major (strides {s.stride()})")
        q, s = q.cpu(), s.cpu()
    else:
        ck(isinstance(recv_x, torch.Tensor) and recv_x.dtype == torch.bfloat16 and recv_x.shape == (L, RM, H),
           "BF16 recv_x [L, R * M, hidden]")
        q = recv_x.cpu()
    counts = recv_count.cpu()
    for l, (rows, ranges) in enumerate(reference_dispatch(r.all_inp, c.rank, c.E, r.views)):
        n = len(rows)
        ck(int(counts[l]) == n, f"recv_count[{l}] {int(counts[l])} != {n}")
        ck(layout_range[l].tolist() == [(b << 32) | cnt for b, cnt in ranges],
           f"layout_range[{l}] {layout_range[l].tolist()} != {[(b << 32) | cnt for b, cnt in ranges]}")
        n = min(n, int(counts[l]))
        rows = rows[:n]
        ck(src_info[l, :n].tolist() == [t for _, t, _ in rows], f"src_info[{l}]")
        src = [r.all_inp[s]["x"][t] for s, t, _ in rows]
        if not use_fp8:
            ck.same(q[l, :n], torch.stack(src) if src else torch.empty((0, H), dtype=torch.bfloat16),
                    f"recv_x[{l}]")
            continue
        casts = [cast_row(x, round_scale) for x in src]
        ck.same(q[l, :n], torch.stack([a for a, _ in casts]) if casts else torch.empty((0, H), dtype=FP8),
                f"FP8 rows[{l}]")
        if ue8m0:
            want = torch.stack([pack_ue8m0(b) for _, b in casts]) if casts else torch.empty((0, H // 512),
                                                                                             dtype=torch.int32)
        else:
            want = torch.stack([b for _, b in casts]) if casts else torch.empty((0, H // 128))
        ck.same(s[l, :n], want, f"scales[{l}]")


def check_combine(ck: Checks, r: Round, combined: torch.Tensor, what: str = "combined_x") -> None:
    R = r.c.world
    # A rank masked by a peer it did not mask has no defined result (DeepEP V1's shrink mode: it waits
    # for that peer's rows until the deadline, then masks it).
    if any(r.c.rank in r.views[o] and o not in r.views[r.c.rank] for o in range(R)):
        return
    ck.same(combined, reference_combine(r.all_inp, r.c.rank, r.c.E, r.views, r.mode, r.all_inp[r.c.rank]
                                        ["topk_weights"]), what)


def combine(ck: Checks, buf, r: Round, res, how: str, wait: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Expert outputs of ``res`` combined back with ``how``: plain, out, zero_copy, async, hook,
    zero_copy_hook; returns combined_x."""
    c = r.c
    y = expert_outputs(res[0], res[1], r.mode, c.scales)
    handle = res[2]
    kw: dict = dict(combine_wait_recv_cost_stats=wait)
    x = y
    if how.startswith("zero_copy"):  # the outputs go into the buffer; x (NaN) must not be read
        zc = buf.get_next_low_latency_combine_buffer(handle)
        zc.copy_(y)
        x = torch.full_like(y, math.nan)
        kw["zero_copy"] = True
    out = None
    if how == "out":
        out = kw["out"] = torch.full((r.x.shape[0], c.H), math.nan, dtype=torch.bfloat16, device=c.device)
    hook = how.endswith("hook")
    combined, event, recv_hook = buf.low_latency_combine(x, r.idx, r.w, handle, async_finish=how == "async",
                                                          return_recv_hook=hook, **kw)
    if out is not None:
        ck(combined is out, "combine(out=...) returns out")
    finish((combined, event, recv_hook), "hook" if hook else "sync")
    return combined


class Stats:
    """The statistics tensors of a buffer's calls and what they must hold."""

    def __init__(self, c: Ctx) -> None:
        self.c = c
        self.cum_start = torch.arange(3, 3 + c.L, dtype=torch.int32)  # += must keep what is there
        self.cum = self.cum_start.clone().to(c.device)
        self.added = torch.zeros(c.L, dtype=torch.int32)
        self.dwait = torch.zeros(c.world, dtype=torch.int64, device=c.device)
        self.cwait = torch.zeros(c.world, dtype=torch.int64, device=c.device)
        self.last = (self.dwait.cpu().clone(), self.cwait.cpu().clone())

    def check(self, ck: Checks, r: Round) -> None:
        """After a dispatch of ``r`` (and any combine): recv stats += reference counts; ns never decrease."""
        self.added += torch.tensor([len(rows) for rows, _ in reference_dispatch(r.all_inp, self.c.rank, self.c.E,
                                                                                  r.views)], dtype=torch.int32)
        ck(self.cum.cpu().tolist() == (self.cum_start + self.added).tolist(),
           f"cumulative_local_expert_recv_stats {self.cum.cpu().tolist()} != {(self.cum_start + self.added).tolist()}")
        now = (self.dwait.cpu().clone(), self.cwait.cpu().clone())
        ck(bool((now[0] >= self.last[0]).all() and (now[1] >= self.last[1]).all()), "wait statistics decreased")
        self.last = now


def one_round(ck: Checks, buf, r: Round, dispatch_how: str, combine_how: str, stats: Optional[Stats] = None,
              label: str = "") -> None:
    """A dispatch of ``r`` completed with ``dispatch_how``, checked, and its combine with ``combine_how``."""
    ck.where = f"{label}{r.mode} dispatch={dispatch_how} combine={combine_how}"
    res = finish(r.dispatch(buf, dispatch_how, stats.cum if stats else None, stats.dwait if stats else None),
                 dispatch_how)
    check_dispatch(ck, r, res)
    check_combine(ck, r, combine(ck, buf, r, res, combine_how, stats.cwait if stats else None))
    if stats:
        stats.check(ck, r)


# ------------------------------------------------------------------------------------------ suites
def suite_modes(c: Ctx, ck: Checks) -> None:
    """BF16, FP8 with rounded scales and UE8M0 dispatches; each completion mode and each combine form;
    two micro-batches overlapped; a clean and a round after it."""
    buf = c.buffer()
    stats = Stats(c)
    rounds = [("bf16", "sync", "plain"), ("fp8_round", "async", "out"), ("ue8m0", "hook", "zero_copy"),
              ("bf16", "hook", "async"), ("fp8_round", "sync", "hook"), ("ue8m0", "async", "plain"),
              ("bf16", "async", "zero_copy_hook")]
    for i, (mode, dh, chow) in enumerate(rounds):
        one_round(ck, buf, Round(c, 100 + i, mode, idx32=i % 2 == 1), dh, chow, stats)
    # Two micro-batches (DeepEP V1's decode overlap): both sends, both receives, then the combines alike.
    ck.where = "overlap"
    a, b = Round(c, 200, "bf16"), Round(c, 201, "ue8m0", idx32=True)
    ra, rb = a.dispatch(buf, "hook"), b.dispatch(buf, "hook")
    ra[-1]()
    rb[-1]()
    check_dispatch(ck, a, ra)
    check_dispatch(ck, b, rb)
    ca = buf.low_latency_combine(expert_outputs(ra[0], ra[1], "bf16", c.scales), a.idx, a.w, ra[2],
                                 return_recv_hook=True)
    cb = buf.low_latency_combine(expert_outputs(rb[0], rb[1], "ue8m0", c.scales), b.idx, b.w, rb[2],
                                 return_recv_hook=True)
    ca[-1]()
    cb[-1]()
    check_combine(ck, a, ca[0], "overlap combine A")
    check_combine(ck, b, cb[0], "overlap combine B")
    # A clean (collective; DeepEP V1 needs it after a failed call) leaves the buffer usable.
    buf.clean_low_latency_buffer(c.M, c.H, c.E)
    one_round(ck, buf, Round(c, 300, "fp8_round"), "hook", "zero_copy")
    one_round(ck, buf, Round(c, 301, "bf16", idx32=True), "sync", "out")
    if c.world > 1:  # refused on every rank alike, before anything collective
        ck.where = "refusal"
        r = Round(c, 302, "bf16")
        ck.raises(ValueError, "num_experts", buf.low_latency_dispatch, r.x, r.idx, c.M, c.E + 1)
    buf.destroy()


def suite_fp8(c: Ctx, ck: Checks) -> None:
    """FP8 dispatch with unrounded scales (q = x * (448 / amax)), each completion mode, and the planted
    rounding tie read back where it arrived."""
    buf = c.buffer()
    stats = Stats(c)
    for i, (dh, chow) in enumerate([("sync", "plain"), ("hook", "zero_copy"), ("async", "out")]):
        r = Round(c, 400 + i, "fp8", idx32=i == 1)
        one_round(ck, buf, r, dh, chow, stats)
    # Where rank s's token 1 arrived, its channel 128 + 77 holds the tie: 320, not 352.
    r = Round(c, 410, "fp8")
    ck.where = "planted tie"
    res = finish(r.dispatch(buf, "sync"), "sync")
    q = res[0][0].cpu()
    for l, (rows, _) in enumerate(reference_dispatch(r.all_inp, c.rank, c.E, r.views)):
        for pos, (s, t, _) in enumerate(rows):
            if t == 1 and pos < int(res[1][l]):
                got = float(q[l, pos, 128 + 77].float())
                ck(got == TIE_Q, f"rank {s}'s x={TIE_X} in a group of amax {TIE_AMAX} cast to {got}, not {TIE_Q} "
                                 "(448 / amax rounded once)")
    buf.destroy()


def suite_shrink(c: Ctx, ck: Checks) -> None:
    """Shrink mode: unmasked it is the normal mode; every rank masks rank r (r = 2 % R, one with tokens):
    nothing goes to r or comes from r, lanes on r add nothing; the query reports the mask, the clean
    clears it, and rounds after it are whole again."""
    buf = c.buffer(shrink=True)
    status = torch.full((c.world,), 7, dtype=torch.int32, device=c.device)
    buf.low_latency_query_mask_buffer(status)
    ck.where = "unmasked"
    ck(status.cpu().tolist() == [0] * c.world, f"mask at start {status.cpu().tolist()}")
    one_round(ck, buf, Round(c, 500, "bf16"), "sync", "plain")
    r = 2 % c.world
    # "isolated": r also masks every peer (what a rank cut off sees), so no rank waits for a signal its peer
    # will not send. "all": r masks only itself, as the other ranks do; r still sends its tokens, which the
    # others must drop (r's own combine is undefined then: it waits for peers that skip it; the native
    # kernels would wait the 100 s device deadline, so only the torch backend runs it).
    scenarios = ["isolated"] + (["all"] if c.world > 1 and c.cfg["backend"] == "torch" else [])
    for k, sc in enumerate(scenarios):
        views = [{r} for _ in range(c.world)]
        if sc == "isolated":
            views[r] = set(range(c.world))
        for q in sorted(views[c.rank]):
            buf.low_latency_update_mask_buffer(q, True)
        if c.world > 1 and (c.rank + 1) % c.world not in views[c.rank]:
            buf.low_latency_update_mask_buffer((c.rank + 1) % c.world, False)  # unmasking an unmasked rank: no-op
        buf.low_latency_query_mask_buffer(status)
        ck.where = f"masked {r} ({sc})"
        want = [int(q in views[c.rank]) for q in range(c.world)]
        ck(status.cpu().tolist() == want, f"mask {status.cpu().tolist()} != {want}")
        label = f"masked {r} ({sc}): "
        one_round(ck, buf, Round(c, 510 + 2 * k, "fp8_round", views), "hook", "hook", label=label)
        one_round(ck, buf, Round(c, 511 + 2 * k, "bf16", views, idx32=True), "sync", "plain", label=label)
        buf.low_latency_clean_mask_buffer()
        buf.low_latency_query_mask_buffer(status)
        ck(status.cpu().tolist() == [0] * c.world, f"mask after clean {status.cpu().tolist()}")
    one_round(ck, buf, Round(c, 520, "ue8m0"), "async", "zero_copy")
    buf.destroy()


SUITES: Dict[str, Callable[[Ctx, Checks], None]] = {"modes": suite_modes, "fp8": suite_fp8, "shrink": suite_shrink}


def ll_worker(rank: int, world: int, rdzv: str, cfg: dict) -> Dict[str, Tuple[int, List[str]]]:
    """The suites ``cfg["suites"]`` (default all) on ``Buffer``s of ``cfg``'s device ("cpu" / "cuda"),
    backend and window. Returns {suite: (checks made, failures)}; an exception ends the worker."""
    from tests._dist import init_gloo
    from tests.elastic_ep._common import init_ep_group

    if cfg["device"] == "cuda":
        group = init_ep_group(rank, world, rdzv, cfg["window"])
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        group, device = init_gloo(rank, world, rdzv), torch.device("cpu")
    c = Ctx(rank, world, group, cfg, device)
    out = {}
    for name in cfg.get("suites", list(SUITES)):
        ck = Checks(rank, name)
        SUITES[name](c, ck)
        out[name] = (ck.count, ck.failures)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module", params=[1, 2, 4])
def ll_results(request, tmp_path_factory):
    """Every suite on ``world`` ranks, run once for the tests below (one spawn per world)."""
    world = request.param
    cfg = dict(device="cpu", backend="torch", window="auto")
    return run_workers(ll_worker, world, cfg, tmp_path=tmp_path_factory.mktemp(f"ll{world}"), timeout=300)


def assert_suite(results: List[dict], suite: str) -> None:
    failures = [f for res in results for f in res[suite][1]]
    assert all(res[suite][0] > 0 for res in results), f"{suite}: no checks ran"
    assert not failures, f"{len(failures)} failed checks:\n  " + "\n  ".join(failures[:30])


def test_low_latency_modes(ll_results):
    """BF16 / FP8-rounded / UE8M0 dispatch and every combine form, the overlap, the clean."""
    assert_suite(ll_results, "modes")


def test_low_latency_fp8_unrounded_scales(ll_results):
    """FP8 dispatch with round_scale=False: q = x * (448 / amax), the quotient rounded once."""
    assert_suite(ll_results, "fp8")


def test_low_latency_shrink(ll_results):
    """Shrink mode: a rank masked by every rank is neither sent to nor received from."""
    assert_suite(ll_results, "shrink")
