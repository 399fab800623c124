"""DeepEP V1's normal-mode API (``elastic_ep.Buffer``) on CPU ranks (torch backend over gloo), bitwise
against a plain-loop reference built from every rank's inputs.

What DeepEP V1's tests/test_intranode.py checks, written here from the semantics of its
``deep_ep/buffer.py`` and kernels: ``get_dispatch_layout`` (tokens per rank, (token, lane) pairs per
expert, ``is_token_in_rank``); dispatch with and without top-k (routing by ``is_token_in_rank`` then),
BF16 and FP8 (FP32 and int32 scales), int64 and int32 ``topk_idx``, with each event mode (sync, async,
previous event, allocation on the communication stream): received rows by source rank then token, the
handle's rank prefix column and source indices, local expert ids with -1 and weight 0 elsewhere,
per-expert counts with ``expert_alignment``; ``num_worst_tokens`` (worst-case shapes, -1 past the
received rows, an empty count list); cached dispatch of new rows with either handle; combine with 0, 1
and 2 biases, its rows summed in DeepEP V1's order (ranks in rank order; ``ElasticBuffer``'s where the
marker lanes do not fit, 30 of 32 experts on 4 ranks), the top-k weights by V1's rule (every reached
rank's weights summed in rank order, non-local lanes included). On 1, 2 and 4 ranks with different
token counts, one rank with none. Also the README's "From DeepEP V1" call sequence, run as written there.
"""
from __future__ import annotations

import itertools
import pathlib
import re
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_workers
from tests.elastic_ep._common import bytes_of, gather_inputs, import_elastic_ep, make_inputs

HIDDEN, TOPK, EXPERTS = 128, 4, 8
TOKENS = [13, 0, 9, 5]
NUM_NVL_BYTES = 4 << 20
README = pathlib.Path(__file__).resolve().parents[2] / "packages" / "elastic_ep" / "README.md"


# ------------------------------------------------------------------------------------------ reference
def expert_out(x: torch.Tensor, rank: int) -> torch.Tensor:
    """The fake experts of rank ``rank``: row-wise, so the reference can redo them row by row. Ranks 2 and 3
    (mod 4) return +-2**20 x, which cancel: ranks 0 and 1's rows survive whole only when added after both
    of them, so the bits of a sum depend on the order of its terms."""
    scale = (1.0, 1.5, 2.0 ** 20, -2.0 ** 20)[rank % 4]
    return (x.to(torch.float32) * scale).to(torch.bfloat16)


def combine_weights(recv_idx: torch.Tensor, recv_w: torch.Tensor, rank: int) -> torch.Tensor:
    """What rank ``rank`` returns as top-k weights: its received weights on local lanes, a non-zero
    constant elsewhere (DeepEP V1 sums those too)."""
    return torch.where(recv_idx >= 0, recv_w, torch.full_like(recv_w, 0.3 + 0.1371 * rank))


def owner(e: int, R: int, E: int) -> int:
    return e // (E // R) if 0 <= e < E else -1


def reached(inp: Dict[str, torch.Tensor], t: int, R: int, has_topk: bool) -> List[int]:
    """Ranks token ``t`` goes to: its experts' (with top-k), else its ``in_rank`` row."""
    if has_topk:
        E = inp["per_expert"].shape[0]
        return sorted({owner(int(e), R, E) for e in inp["topk_idx"][t].tolist()} - {-1})
    return [r for r in range(R) if bool(inp["in_rank"][t, r])]


def reference_dispatch(all_inp: List[Dict[str, torch.Tensor]], me: int, has_topk: bool, alignment: int) -> dict:
    """What rank ``me`` receives: rows from rank 0's tokens in token order, then rank 1's, ..."""
    R, (T0, K), E = len(all_inp), all_inp[me]["topk_idx"].shape, all_inp[me]["per_expert"].shape[0]
    L = E // R
    rows, prefix = [], []
    for src, inp in enumerate(all_inp):
        rows += [(src, t) for t in range(inp["x"].shape[0]) if me in reached(inp, t, R, has_topk)]
        prefix.append(len(rows))
    out = dict(rows=rows, prefix=prefix)
    out["x"] = torch.stack([all_inp[s]["x"][t] for s, t in rows]) if rows else all_inp[me]["x"][:0]
    if "sf" in all_inp[me]:
        out["sf"] = torch.stack([all_inp[s]["sf"][t] for s, t in rows]) if rows else all_inp[me]["sf"][:0]
    if has_topk:
        idx, w = [], []
        for s, t in rows:
            ids, ws = all_inp[s]["topk_idx"][t].tolist(), all_inp[s]["topk_weights"][t]
            idx.append([e - me * L if owner(e, R, E) == me else -1 for e in ids])
            w.append(torch.stack([ws[k] if owner(e, R, E) == me else torch.tensor(0.0) for k, e in enumerate(ids)]))
        out["idx"] = torch.tensor(idx, dtype=torch.int64).view(-1, K)
        out["w"] = torch.stack(w) if w else torch.zeros((0, K))
        counts = [sum(int((inp["topk_idx"] == me * L + j).sum()) for inp in all_inp) for j in range(L)]
    else:
        counts = [sum(int(inp["per_expert"][me * L + j]) for inp in all_inp) for j in range(L)]
    out["per_expert"] = [(c + alignment - 1) // alignment * alignment for c in counts]
    return out


def rank_order(R: int, K: int) -> bool:
    """Whether combine adds the ranks in rank order (DeepEP V1's order): one rank, or room for a marker
    lane per rank (at most 32 lanes); else ElasticBuffer's (each rank at its last lane)."""
    return R == 1 or K + R <= 32


def reference_combine(all_inp: List[Dict[str, torch.Tensor]], me: int, has_topk: bool,
                      biases: List[torch.Tensor]) -> dict:
    """Rank ``me``'s combined rows and V1 top-k weights from its inputs and every rank's fake experts."""
    R, inp = len(all_inp), all_inp[me]
    (T, K), E = inp["topk_idx"].shape, inp["per_expert"].shape[0]
    xs, ws = [], []
    for t in range(T):
        acc = torch.zeros(HIDDEN, dtype=torch.float32)
        if len(biases) == 2:
            acc = biases[0][t].to(torch.float32) + biases[1][t].to(torch.float32)
        elif biases:
            acc = biases[0][t].to(torch.float32).clone()
        if has_topk and not rank_order(R, K):  # ElasticBuffer's order: a rank at the last lane naming it
            lanes = [owner(int(e), R, E) for e in inp["topk_idx"][t].tolist()]
            terms = [r if r >= 0 and r not in lanes[k + 1:] else -1 for k, r in enumerate(lanes)]
        else:  # DeepEP V1's: the ranks in rank order
            terms = [r if r in reached(inp, t, R, has_topk) else -1 for r in range(R)]
        for r in terms:
            acc = acc + (expert_out(inp["x"][t], r).to(torch.float32) if r >= 0 else torch.zeros(HIDDEN))
        xs.append(acc.to(torch.bfloat16))
        if has_topk:  # DeepEP V1: 0, plus every reached rank's returned weights in rank order
            wacc = torch.zeros(K, dtype=torch.float32)
            for r in reached(inp, t, R, True):
                local = torch.tensor([owner(int(e), R, E) == r for e in inp["topk_idx"][t].tolist()])
                wacc = wacc + torch.where(local, inp["topk_weights"][t], torch.full((K,), 0.3 + 0.1371 * r))
            ws.append(wacc)
    return dict(x=torch.stack(xs) if xs else torch.zeros((0, HIDDEN), dtype=torch.bfloat16),
                w=torch.stack(ws) if ws else torch.zeros((0, K)))


def negate(x: torch.Tensor) -> torch.Tensor:
    """``-x`` by flipping the sign bit (float8 has no negation on the CPU)."""
    return (x.view(torch.uint8) ^ 0x80).view(x.dtype) if x.element_size() == 1 else -x


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
    assert torch.equal(bytes_of(a.cpu()), bytes_of(b.cpu())), f"{what}: bits differ"


# ------------------------------------------------------------------------------------------ worker
def rank_inputs(me: int, R: int, dtype: str, seed: int, device, K: int = TOPK,
                E: int = EXPERTS) -> Dict[str, torch.Tensor]:
    """One rank's inputs: ``make_inputs``' plus a routing by rank (for dispatch without top-k) and
    per-expert counts that dispatch without top-k reports summed."""
    inp = make_inputs(me, TOKENS[me % len(TOKENS)] if R > 1 else TOKENS[0], HIDDEN, K, E, dtype, seed, device)
    g = torch.Generator().manual_seed(seed * 31 + me)
    T = inp["x"].shape[0]
    if "sf" in inp and T == 0:  # (0, n) scales with standard strides (gather_inputs views their bytes)
        inp["sf"] = torch.empty(inp["sf"].shape, dtype=inp["sf"].dtype, device=device)
    inp["in_rank"] = (torch.rand((T, R), generator=g) < 0.6).to(device)
    inp["per_expert"] = torch.randint(0, 50, (E,), generator=g, dtype=torch.int32).to(device)
    return inp


def event_kwargs(buf, mode: str) -> dict:
    return {"sync": {}, "async": dict(async_finish=True),
            "prev": dict(previous_event=buf.capture()),
            "prev_alloc": dict(previous_event=buf.capture(), async_finish=True, allocate_on_comm_stream=True)}[mode]


def check_dispatch(out, ref: dict, has_topk: bool, me: int, topk_dtype: torch.dtype) -> None:
    recv, ridx, rw, per_expert, handle, _ = out
    rx, rsf = recv if isinstance(recv, tuple) else (recv, None)
    same(rx, ref["x"], "recv_x")
    if rsf is not None:
        same(rsf, ref["sf"], "recv scales")
    assert per_expert == ref["per_expert"], f"per-expert {per_expert} != {ref['per_expert']}"
    assert handle[0][:, me].tolist() == ref["prefix"], "rank_prefix_matrix column"
    assert handle[3].tolist() == [t for _, t in ref["rows"]], "recv_src_idx"
    if has_topk:
        assert ridx.dtype == topk_dtype, f"recv_topk_idx dtype {ridx.dtype} != topk_idx's {topk_dtype}"
        same(ridx.to(torch.int64), ref["idx"], "recv_topk_idx")
        same(rw, ref["w"], "recv_topk_weights")
    else:
        assert ridx is None and rw is None


def check_layout(layout: tuple, inp: Dict[str, torch.Tensor], R: int) -> None:
    """``get_dispatch_layout`` against the token loop: tokens per rank, (token, lane) pairs per expert."""
    n_rank, n_rdma, n_expert, in_rank, _ = layout
    T, E = inp["x"].shape[0], inp["per_expert"].shape[0]
    ref_in = torch.tensor([[r in reached(inp, t, R, True) for r in range(R)] for t in range(T)],
                          dtype=torch.bool).view(T, R)
    assert n_rdma is None
    same(in_rank, ref_in, "is_token_in_rank")
    same(n_rank, ref_in.sum(0).to(torch.int32), "num_tokens_per_rank")
    ids = inp["topk_idx"].cpu().tolist()
    same(n_expert, torch.tensor([sum(row.count(e) for row in ids) for e in range(E)], dtype=torch.int32),
         "num_tokens_per_expert")


def run_case(buf, group, me: int, R: int, case: dict) -> None:
    """One dispatch (+ worst case, + cached) and combine of ``case`` against the reference."""
    K, E = case.get("K", TOPK), case.get("E", EXPERTS)
    inp = rank_inputs(me, R, case["dtype"], case["seed"], buf.runtime.device, K, E)
    if case.get("idx32"):  # DeepEP V1's 32-bit topk_idx_t
        inp["topk_idx"] = inp["topk_idx"].to(torch.int32)
    all_inp = gather_inputs(inp, group)
    has_topk, a = case["topk"], case["alignment"]
    x = (inp["x"], inp["sf"]) if "sf" in inp else inp["x"]
    if has_topk:
        n_rank, _, n_expert, in_rank, _ = layout = buf.get_dispatch_layout(inp["topk_idx"], E)
        check_layout(layout, all_inp[me], R)
        kw = dict(topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"])
    else:
        in_rank, n_expert = inp["in_rank"], inp["per_expert"]
        n_rank = in_rank.sum(0, dtype=torch.int32)
        kw = {}
    layout = dict(num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert)
    out = buf.dispatch(x, **layout, **kw, expert_alignment=a, **event_kwargs(buf, case["events"]))
    out[5].current_stream_wait()
    ref = reference_dispatch(all_inp, me, has_topk, a)
    check_dispatch(out, ref, has_topk, me, inp["topk_idx"].dtype)
    recv, ridx, rw, _, handle, _ = out
    N = len(ref["rows"])
    if has_topk:  # no CPU sync: worst-case rows, the received ones first
        nwt = R * max(TOKENS[:R]) + 3
        worst = buf.dispatch(x, **layout, **kw, expert_alignment=a, num_worst_tokens=nwt,
                             **event_kwargs(buf, case["events"]))
        worst[5].current_stream_wait()
        wx = worst[0][0] if isinstance(worst[0], tuple) else worst[0]
        assert wx.shape[0] == nwt and worst[1].shape == (nwt, K) and worst[2].shape[0] == nwt and worst[3] == []
        same(wx[:N], ref["x"], "worst recv_x")
        same(worst[1][:N].to(torch.int64), ref["idx"], "worst recv_topk_idx")
        same(worst[2][:N], ref["w"], "worst recv_topk_weights")
        assert bool((worst[1][N:] == -1).all()), "worst recv_topk_idx past the received rows"
        assert worst[4][3].shape[0] == nwt and worst[4][3][:N].tolist() == [t for _, t in ref["rows"]]
    # Cached mode: the handle's routing for new rows (-x); a worst-case handle's rows are its worst case
    neg = (negate(inp["x"]), inp["sf"]) if "sf" in inp else negate(inp["x"])
    for h, rows in [(handle, N)] + ([(worst[4], nwt)] if has_topk else []):
        cached = buf.dispatch(neg, handle=h, **event_kwargs(buf, case["events"]))
        cached[5].current_stream_wait()
        assert cached[1:5] == (None, None, None, None)
        cx0 = cached[0][0] if isinstance(cached[0], tuple) else cached[0]
        assert cx0.shape[0] == rows, f"cached rows {cx0.shape[0]} != {rows}"
        same(cx0[:N], negate(ref["x"]), "cached recv_x")
    # Combine
    g = torch.Generator().manual_seed(case["seed"] * 7 + me)
    dev = inp["x"].device
    biases = [torch.randn((inp["x"].shape[0], HIDDEN), generator=g).to(torch.bfloat16) for _ in range(case["bias"])]
    on_dev = [b.to(dev) for b in biases]
    bias = None if not on_dev else (on_dev[0] if len(on_dev) == 1 else tuple(on_dev))
    rx = recv[0] if isinstance(recv, tuple) else recv
    cw_in = combine_weights(ridx, rw, me) if has_topk else None
    handles = [(handle, expert_out(rx, me), cw_in)]
    if has_topk:  # the worst-case handle combines the same (its padding rows are never read)
        wy = expert_out(wx, me)
        handles.append((worst[4], wy, torch.cat([cw_in, torch.full((nwt - N, K), 7.0, device=dev)])))
    cref = reference_combine(all_inp, me, has_topk, biases)
    for h, y, w in handles:
        cx, cw, ev = buf.combine(y, h, topk_weights=w, bias=bias, **event_kwargs(buf, case["events"]))
        ev.current_stream_wait()
        same(cx, cref["x"], f"combined_x ({'worst' if h is not handle else 'exact'} handle)")
        if has_topk:
            same(cw, cref["w"], "combined_topk_weights")
        else:
            assert cw is None


def cases(world: int) -> List[dict]:
    out = []
    for i, (dtype, topk, events) in enumerate(itertools.product(["bf16", "fp8"], [True, False],
                                                                ["sync", "async", "prev", "prev_alloc"])):
        out.append(dict(dtype=dtype if i % 5 else "fp8_ue8m0", topk=topk, events=events, alignment=[1, 4, 3][i % 3],
                        bias=i % 3, seed=world * 100 + i, idx32=i % 4 == 1))
    if world > 1:  # 30 of 32 experts: marker lanes up to the 32-lane limit (2 ranks), past it (4 ranks)
        out += [dict(dtype="bf16", topk=True, events="sync", alignment=1, bias=2, seed=world * 100 + 50, K=30, E=32),
                dict(dtype="fp8", topk=True, events="async", alignment=2, bias=1, seed=world * 100 + 51, K=30, E=32)]
    return out


def v1_worker(rank: int, world: int, rdzv: str, cfg: dict) -> int:
    """Every case of ``cases(world)`` on a ``Buffer`` of ``cfg``'s backend and window."""
    from tests._dist import init_gloo
    from tests.elastic_ep._common import init_ep_group

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, cfg["window"]) if cfg["device"] == "cuda" else init_gloo(rank, world, rdzv)
    done = 0
    buf = ep.Buffer(group, NUM_NVL_BYTES, backend=cfg["backend"], window=cfg["window"])
    for case in cases(world):
        try:
            run_case(buf, group, rank, world, case)
        except Exception as e:  # noqa: BLE001 - named by case; no collective destroy after a failure
            raise AssertionError(f"rank {rank}, case {case}: {type(e).__name__}: {e}") from e
        done += 1
    buf.destroy()
    dist.destroy_process_group()
    return done


@pytest.mark.parametrize("world", [1, 2, 4])
def test_v1_normal_mode_matches_reference(tmp_path, world):
    cfg = dict(device="cpu", backend="torch", window="auto")
    assert run_workers(v1_worker, world, cfg, tmp_path=tmp_path, timeout=300) == [len(cases(world))] * world


# ------------------------------------------------------------------------------------------ README port
def readme_port_snippet() -> str:
    """The first Python block of the README's "From DeepEP V1" section."""
    text = README.read_text()
    section = text[text.index("## From DeepEP V1"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def readme_worker(rank: int, world: int, rdzv: str) -> list:
    from tests._dist import init_gloo

    import_elastic_ep()
    group = init_gloo(rank, world, rdzv)
    inp = rank_inputs(rank, world, "bf16", 5, torch.device("cpu"))
    all_inp = gather_inputs(inp, group)

    def run_experts(recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert):
        return expert_out(recv_x, rank)

    ns = dict(group=group, hidden_states=inp["x"], topk_ids=inp["topk_idx"], topk_weights=inp["topk_weights"],
              num_experts=EXPERTS, run_experts=run_experts)
    exec(compile(readme_port_snippet(), str(README), "exec"), ns)
    ref = reference_dispatch(all_inp, rank, True, 128)
    assert ns["num_recv_tokens_per_expert"] == ref["per_expert"]
    same(ns["recv_topk_ids"], ref["idx"], "README recv_topk_ids")
    same(ns["combined_x"], reference_combine(all_inp, rank, True, [])["x"], "README combined_x")
    ns["buffer"].destroy()
    dist.destroy_process_group()
    return ns["num_recv_tokens_per_expert"]


def test_readme_port_call_sequence(tmp_path):
    """The README's SGLang-style port (layout -> dispatch -> experts -> combine) runs as written."""
    got = run_workers(readme_worker, 2, tmp_path=tmp_path, timeout=120)
    assert all(sum(g) > 0 for g in got)
