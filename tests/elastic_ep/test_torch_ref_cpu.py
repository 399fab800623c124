"""tools/_ep_torch_ref.py, the lean torch dispatch / combine that the benchmark measures as "the torch
reference path", on the CPU with gloo: its outputs equal a direct computation from every rank's
inputs (bf16 and fp8 with scales, masked top-k lanes, a rank with no tokens)."""
import pytest
import torch

from tests._dist import init_gloo, run_workers
from tests._tools import load_tool

H, K, E = 256, 4, 12
TOKENS = [5, 0, 7]  # rank 1 sends nothing


def _inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    T = TOKENS[rank]
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    topk = torch.rand((T, E), generator=g).topk(K, dim=1).indices
    topk[::3, -1] = -1  # masked lanes
    w = torch.rand((T, K), generator=g)
    x8 = torch.randn((T, H), generator=g).to(torch.float8_e4m3fn)
    sf = torch.rand((T, H // 128), generator=g)
    return x, topk, w, x8, sf


def _worker(rank, world, rdzv):
    group = init_gloo(rank, world, rdzv)
    ref = load_tool("_ep_torch_ref").TorchRefEP(group, E)
    L = E // world
    x, topk, w, x8, sf = _inputs(rank)
    recv_x, recv_sf, recv_idx, recv_w, handle = ref.dispatch(x, topk, w)
    recv_x8, recv_sf8, recv_idx8, _, _ = ref.dispatch(x8, topk, w, sf=sf)
    # expected: every source's tokens with an expert on this rank, source-major, ascending token
    rows, rows8, sfs, ids, ws = [], [], [], [], []
    for s in range(world):
        xs, ts, wsrc, x8s, sfsrc = _inputs(s)
        for t in range(TOKENS[s]):
            mine = (ts[t] >= rank * L) & (ts[t] < (rank + 1) * L)
            if mine.any():
                rows.append(xs[t])
                rows8.append(x8s[t])
                sfs.append(sfsrc[t])
                ids.append(torch.where(mine, ts[t] - rank * L, torch.full_like(ts[t], -1)))
                ws.append(wsrc[t])
    n = len(rows)
    assert recv_x.shape == (n, H) and recv_x.dtype == torch.bfloat16 and recv_sf is None
    if n:
        assert torch.equal(recv_x, torch.stack(rows))
        assert torch.equal(recv_x8.view(torch.uint8), torch.stack(rows8).view(torch.uint8))
        assert torch.equal(recv_sf8, torch.stack(sfs))
        assert torch.equal(recv_idx, torch.stack(ids)) and torch.equal(recv_idx8, recv_idx)
        assert torch.equal(recv_w, torch.stack(ws))
    # combine: each rank sends its received rows back; a token's rows from its k ranks sum in fp32
    out, out_w = ref.combine(recv_x, handle, recv_w)
    owner = torch.where(topk >= 0, topk // L, torch.full_like(topk, -1))
    times = torch.stack([(owner == r).any(1) for r in range(world)], 1).sum(1) if TOKENS[rank] else torch.zeros(0)
    assert out.shape == (TOKENS[rank], H)
    if TOKENS[rank]:
        assert torch.equal(out, (x.float() * times.view(-1, 1).float()).to(torch.bfloat16))
        assert torch.allclose(out_w, w * times.view(-1, 1).float())
    return n


def test_torch_ref_matches_direct_computation(tmp_path):
    counts = run_workers(_worker, 3, tmp_path=tmp_path, timeout=120)
    assert sum(counts) > 0


def test_torch_ref_rejects_uneven_experts(tmp_path):
    run_workers(_reject_worker, 3, tmp_path=tmp_path, timeout=60)


def _reject_worker(rank, world, rdzv):
    group = init_gloo(rank, world, rdzv)
    with pytest.raises(ValueError, match="divisible"):
        load_tool("_ep_torch_ref").TorchRefEP(group, 8)
