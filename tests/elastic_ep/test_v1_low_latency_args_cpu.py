"""DeepEP V1's low-latency mode on CPU ranks (torch backend over gloo), beside the suites of
``test_v1_low_latency_cpu`` (whose reference and helpers these use): the refusals (ValueError naming the
argument, before anything runs; RuntimeError off low-latency or shrink mode; NotImplementedError for
LogFMT), ``get_low_latency_rdma_size_hint`` by hand, and the README's decode port run as written.
"""
from __future__ import annotations

import pathlib
import re
from typing import Callable, List

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_workers
from tests.elastic_ep.test_v1_low_latency_cpu import (Checks, Ctx, Round, cast_row, ep, expert_outputs, finish,
                                                       one_round)

README = pathlib.Path(__file__).resolve().parents[2] / "packages" / "elastic_ep" / "README.md"


# ------------------------------------------------------------------------------------------ refusals
def refusals_worker(rank: int, world: int, rdzv: str) -> int:
    """Every refusal on one rank; none launches anything (the next call's half and the statistics stay
    as they were) and a round after them is right."""
    from tests._dist import init_gloo

    group = init_gloo(rank, world, rdzv)
    c = Ctx(rank, world, group, dict(backend="torch", window="auto"), torch.device("cpu"))
    ck = Checks(rank, "refusals")
    E, K, M, H, L = c.E, c.K, c.M, c.H, c.L
    buf = c.buffer()
    r = Round(c, 600, "bf16")
    x, idx, w = r.x, r.idx, r.w
    T = x.shape[0]
    D, C = buf.low_latency_dispatch, buf.low_latency_combine
    res = finish(D(x, idx, M, E, use_fp8=False), "sync")
    handle = res[2]
    y = expert_outputs(res[0], res[1], "bf16", c.scales)
    half = buf.get_next_low_latency_combine_buffer(handle).data_ptr()  # moves with every call launched
    cum = torch.zeros(L, dtype=torch.int32)

    def bad(name: str, fn: Callable, *a, **kw) -> None:
        ck.raises(ValueError, name, fn, *a, **kw)

    ck.where = "dispatch"
    bad("x", D, x.float(), idx, M, E, cumulative_local_expert_recv_stats=cum)
    bad("x", D, x[0], idx, M, E)
    bad("x", D, torch.empty((T, 2 * H), dtype=torch.bfloat16)[:, ::2], idx, M, E)  # not contiguous
    bad("topk_idx", D, x, idx.float(), M, E)
    bad("topk_idx", D, x, idx.to(torch.int16), M, E)
    bad("topk_idx", D, x, idx[:3], M, E)
    bad("topk_idx", D, x, torch.zeros((T, 33), dtype=torch.int64), M, E)  # top-k above 32
    bad("num_max_dispatch_tokens_per_rank", D, x, idx, T - 1, E, cumulative_local_expert_recv_stats=cum)
    bad("num_max_dispatch_tokens_per_rank", D, x, idx, 0, E)
    bad("hidden", D, torch.zeros((T, 200), dtype=torch.bfloat16), idx, M, E)
    bad("use_ue8m0", D, x, idx, M, E, use_fp8=True, round_scale=False, use_ue8m0=True)
    bad("round_scale", D, x, idx, M, E, use_fp8=False, round_scale=True)
    bad("use_ue8m0", D, torch.zeros((T, 384), dtype=torch.bfloat16), idx, M, E, round_scale=True, use_ue8m0=True)
    bad("async_finish", D, x, idx, M, E, async_finish=True, return_recv_hook=True)
    bad("cumulative_local_expert_recv_stats", D, x, idx, M, E,
        cumulative_local_expert_recv_stats=torch.zeros(L, dtype=torch.int64))
    bad("cumulative_local_expert_recv_stats", D, x, idx, M, E,
        cumulative_local_expert_recv_stats=torch.zeros(L + 1, dtype=torch.int32))
    bad("dispatch_wait_recv_cost_stats", D, x, idx, M, E,
        dispatch_wait_recv_cost_stats=torch.zeros(1, dtype=torch.int32))
    bad("dispatch_wait_recv_cost_stats", D, x, idx, M, E,
        dispatch_wait_recv_cost_stats=torch.zeros(2, dtype=torch.int64))
    bad("num_experts", D, x, idx, M, 0)
    ck.where = "combine"
    bad("x", C, y.float(), idx, w, handle)
    bad("x", C, y[:, :M - 1], idx, w, handle)
    bad("topk_idx", C, y, idx.float(), w, handle)
    bad("topk_idx", C, y, idx[:, :K - 1], w[:, :K - 1], handle)  # not the dispatch's top-k
    bad("topk_idx", C, y, torch.zeros((M + 1, K), dtype=torch.int64), torch.zeros((M + 1, K)), handle)
    bad("topk_weights", C, y, idx, w.double(), handle)
    bad("topk_weights", C, y, idx, w[:3], handle)
    bad("out", C, y, idx, w, handle, out=torch.empty((T, H)))
    bad("out", C, y, idx, w, handle, out=torch.empty((T + 1, H), dtype=torch.bfloat16))
    bad("combine_wait_recv_cost_stats", C, y, idx, w, handle,
        combine_wait_recv_cost_stats=torch.zeros(1, dtype=torch.int32))
    bad("async_finish", C, y, idx, w, handle, async_finish=True, return_recv_hook=True)
    bad("handle", C, y, idx, w, tuple(handle))
    other = c.buffer()
    other_handle = finish(other.low_latency_dispatch(x, idx, M, E, use_fp8=False), "sync")[2]
    bad("handle", C, y, idx, w, other_handle)
    bad("handle", buf.get_next_low_latency_combine_buffer, other_handle)
    ck.raises(NotImplementedError, "use_logfmt", C, y, idx, w, handle, use_logfmt=True)
    ck.where = "clean"
    bad("hidden", buf.clean_low_latency_buffer, M, 100, E)
    bad("get_low_latency_rdma_size_hint", buf.clean_low_latency_buffer, 4096, 7168, E)
    ck.where = "nothing launched"
    ck(buf.get_next_low_latency_combine_buffer(handle).data_ptr() == half, "a refused call flipped the half")
    ck(cum.tolist() == [0] * L, f"a refused call counted rows: {cum.tolist()}")
    # The receive hook runs once.
    ck.where = "hook"
    res2 = D(x, idx, M, E, use_fp8=False, return_recv_hook=True)
    res2[-1]()
    ck.raises(RuntimeError, "already", res2[-1])
    one_round(ck, buf, Round(c, 601, "ue8m0"), "sync", "plain")
    # A buffer below the hint refuses a call the hint's buffer takes (any top-k up to min(E, 32) there).
    ck.where = "size"
    Mb, Hb = 128, 7168
    hint = ep.Buffer.get_low_latency_rdma_size_hint(Mb, Hb, 1, E)
    xb, idxb = torch.ones((1, Hb), dtype=torch.bfloat16), torch.arange(K).view(1, K)
    small = ep.Buffer(group, 0, hint // 2, low_latency_mode=True, backend="torch")
    bad("get_low_latency_rdma_size_hint", small.low_latency_dispatch, xb, idxb, Mb, E)
    small.destroy()
    big = ep.Buffer(group, 0, hint, low_latency_mode=True, backend="torch")
    got = finish(big.low_latency_dispatch(xb, torch.arange(E).view(1, E), Mb, E, use_fp8=False), "sync")
    ck(got[1].tolist() == [1] * L, "the hint's buffer takes top-k = num_experts")
    big.destroy()
    # Buffer arguments, and calls outside low-latency / shrink mode.
    ck.where = "modes"
    bad("enable_shrink", ep.Buffer, group, 2 << 20, enable_shrink=True)
    bad("num_rdma_bytes", ep.Buffer, group, 0, 0, low_latency_mode=True)
    normal = ep.Buffer(group, 2 << 20)
    status = torch.zeros(1, dtype=torch.int32)
    calls = {"low_latency_dispatch": (x, idx, M, E), "low_latency_combine": (y, idx, w, handle),
             "clean_low_latency_buffer": (M, H, E), "get_next_low_latency_combine_buffer": (handle,),
             "low_latency_update_mask_buffer": (0, True), "low_latency_query_mask_buffer": (status,),
             "low_latency_clean_mask_buffer": ()}
    for name, args in calls.items():
        ck.raises(RuntimeError, "low_latency_mode", getattr(normal, name), *args)
    normal.destroy()
    for name in ("low_latency_update_mask_buffer", "low_latency_query_mask_buffer", "low_latency_clean_mask_buffer"):
        ck.raises(RuntimeError, "enable_shrink", getattr(buf, name), *calls[name])
    shrink = c.buffer(shrink=True)
    bad("rank_to_mask", shrink.low_latency_update_mask_buffer, 1, True)
    bad("rank_to_mask", shrink.low_latency_update_mask_buffer, -1, True)
    bad("mask_status", shrink.low_latency_query_mask_buffer, torch.zeros(2, dtype=torch.int32))
    bad("mask_status", shrink.low_latency_query_mask_buffer, torch.zeros(1, dtype=torch.int64))
    shrink.destroy()
    other.destroy()
    buf.destroy()
    ck.raises(RuntimeError, "destroyed", buf.low_latency_dispatch, x, idx, M, E)
    dist.destroy_process_group()
    assert not ck.failures, f"{len(ck.failures)} failed checks:\n  " + "\n  ".join(ck.failures)
    return ck.count


def test_low_latency_refusals(tmp_path):
    """ValueError naming the argument for each bad argument, RuntimeError / NotImplementedError where
    DeepEP V1's calls are unavailable; nothing launched by a refused call."""
    assert run_workers(refusals_worker, 1, tmp_path=tmp_path, timeout=120)[0] > 50


# ------------------------------------------------------------------------------------------ size hint
def hint_by_hand(M: int, H: int, R: int, E: int) -> int:
    """ll_sizing.hpp's layout: two halves, each the BF16 dispatch area [E][M][align16(16 + 2H)] aligned to
    4 KiB plus the combine area [M][min(E, 32)][H] bf16, rounded up to 2 MiB."""
    def up(v: int, a: int) -> int:
        return -(-v // a) * a
    msg = up(16 + 2 * H, 16)
    half = up(E * M * msg, 4096) + M * min(E, 32) * H * 2
    return 2 * up(half, 2 << 20)


def test_low_latency_rdma_size_hint():
    hint = ep.Buffer.get_low_latency_rdma_size_hint
    # DeepSeek-V3 decode on 8 ranks: msg 14352 B; 256 * 128 * 14352 + 128 * 32 * 14336 * 2 B -> 253 x 2 MiB.
    assert hint(128, 7168, 8, 256) == 2 * 253 * (2 << 20) == 1061158912
    for shape in [(16, 512, 4, 16), (1, 128, 1, 1), (128, 7168, 1, 8), (256, 4096, 16, 64), (8192, 128, 2, 2),
                  (100, 2560, 3, 48)]:
        assert hint(*shape) == hint_by_hand(*shape), shape
    for args, name in [((16, 512, 4, 10), "num_experts"), ((0, 512, 1, 8), "num_max_dispatch_tokens_per_rank"),
                       ((8193, 512, 1, 8), "num_max_dispatch_tokens_per_rank"), ((16, 0, 1, 8), "hidden"),
                       ((16, 512, 0, 8), "num_ranks")]:
        with pytest.raises(ValueError, match=name):
            hint(*args)


# ------------------------------------------------------------------------------------------ README port
def readme_blocks() -> List[str]:
    """The Python blocks of the README's "Low-latency mode" section: the decode port, the experts' stand-in."""
    text = README.read_text()
    section = text[text.index("### Low-latency mode"):]
    section = section[:section.index("\n### ", 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def readme_worker(rank: int, world: int, rdzv: str) -> int:
    from tests._dist import init_gloo

    group = init_gloo(rank, world, rdzv)
    H, E, K, T = 256, 8, 3, [5, 3][rank]
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[0, 1] = -1
    w = torch.rand((T, K), generator=g)
    blocks = readme_blocks()
    # The README's stand-in with identity matrices: each row comes back as its dequantised self.
    ns = dict(torch=torch, group=group, hidden_states=x, topk_idx=idx, topk_weights=w, num_experts=E,
              num_max_dispatch_tokens_per_rank=8,
              w=torch.eye(H, dtype=torch.bfloat16).expand(E // world, H, H).contiguous())
    exec(compile(blocks[1], str(README), "exec"), ns)
    exec(compile(blocks[0], str(README), "exec"), ns)
    acc = torch.zeros((T, H), dtype=torch.float32)
    for t in range(T):
        q, sf = cast_row(x[t], False)
        deq = (q.float().view(-1, 128) * sf.unsqueeze(-1)).view(-1).to(torch.bfloat16).float()
        for k in range(K):
            if int(idx[t, k]) >= 0:
                acc[t] = acc[t] + deq * w[t, k]
    assert torch.equal(ns["combined_x"], acc.to(torch.bfloat16)), "README decode port: combined_x differs"
    ns["buffer"].destroy()
    dist.destroy_process_group()
    return int(ns["recv_count"].sum())


def test_readme_low_latency_port(tmp_path):
    """The README's decode port (low_latency_dispatch with the hook, the experts' stand-in on the masked
    layout, low_latency_combine with the hook) runs as written, bitwise against a per-token reference."""
    got = run_workers(readme_worker, 2, tmp_path=tmp_path, timeout=120)
    assert sum(got) == (5 * 3 - 1) + (3 * 3 - 1)  # every (token, lane) but each rank's one -1 lane arrived
