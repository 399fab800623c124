"""CPU check of the kernel's data movement: ipc_all2all._C.simulate runs the kernel's own addressing
code (a2a_geometry.hpp) on the host for every (sender, target) pair; the result must equal plain
torch slicing/concatenation of the global tensor, byte for byte, for every dtype, world size, batch,
head_dim, even and uneven counts (zeros included), in host-count and device-count mode."""
from __future__ import annotations

import pytest
import torch

from ipc_all2all import _C, _shapes as S

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    it = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, list(shape[:-1]) + [shape[-1] * it], dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def _fb(data):
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


def _b(t):
    return t.contiguous().view(torch.uint8)


def _simulate(plan, W, counts, inputs, cap_bytes):
    outs = _C.simulate(plan.op, W, plan.batch, plan.x_rows, plan.out_rows, plan.cap_rows, plan.chunk_bytes,
                       plan.wide_bytes, counts, [bytes(_b(x).reshape(-1).numpy()) for x in inputs], cap_bytes)
    # Bytes past the output must stay zero: no sender writes outside the planned output.
    for o in outs:
        assert o[plan.out_bytes:].count(0) == len(o) - plan.out_bytes
    return [_fb(o[:plan.out_bytes]) for o in outs]


def _count_sets(W):
    sets = {"even": [5] * W}
    if W > 1:
        sets["uneven_zero"] = [0] + [3 * r + 1 for r in range(1, W)]
        sets["one_rank"] = [0] * (W - 1) + [7]
    return sets


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("b,D", [(1, 64), (2, 128)])
def test_host_mode_matches_torch(dtype, W, b, D):
    it = torch.empty((), dtype=dtype).element_size()
    H = 8 * W if W != 3 else 24
    hpr = H // W
    cap = 1 << 22
    for name, counts in _count_sets(W).items():
        T, P = sum(counts), S.prefix_sums(counts)
        xs = [_rand((b, counts[r], H, D), dtype, 10 * r + 1) for r in range(W)]
        plans = [S.plan_send_recv_heads(tuple(xs[r].shape), it, W, r, counts, cap) for r in range(W)]
        row = hpr * D * it
        got = [torch.zeros(b, T, row, dtype=torch.uint8) for _ in range(W)]
        # In host mode x_rows is each sender's own count, so each sender is simulated on its own and
        # its rows [P[q], P[q] + n[q]) are collected from every target.
        for q in range(W):
            p = plans[q]
            outs = _C.simulate(p.op, W, p.batch, p.x_rows, p.out_rows, p.cap_rows, p.chunk_bytes, p.wide_bytes,
                               counts, [bytes(_b(x).reshape(-1).numpy()) for x in xs], cap, only_sender=q)
            for r in range(W):
                o = _fb(outs[r][:b * T * row]).view(b, T, row)
                got[r][:, P[q]:P[q] + counts[q]] = o[:, P[q]:P[q] + counts[q]]
        for r in range(W):
            want = torch.cat([xs[s][:, :, r * hpr:(r + 1) * hpr] for s in range(W)], dim=1)
            assert plans[r].out_shape == tuple(want.shape)
            assert torch.equal(got[r], _b(want).reshape(b, T, row)), f"send_recv_heads {name} rank {r}"

        # gather_heads: every rank holds [b, T, hpr, D]; x_rows = T on every rank
        gs = [_rand((b, T, hpr, D), dtype, 100 + r) for r in range(W)]
        gp = S.plan_gather_heads((b, T, hpr, D), it, W, 0, counts, cap)
        outs = _C.simulate(gp.op, W, b, T, -1, -1, gp.chunk_bytes, gp.wide_bytes, counts,
                           [bytes(_b(g).reshape(-1).numpy()) for g in gs], cap)
        for r in range(W):
            want = torch.cat([gs[s][:, P[r]:P[r] + counts[r]] for s in range(W)], dim=2)  # heads in rank order
            n_bytes = b * counts[r] * H * D * it
            got = _fb(outs[r][:n_bytes])
            assert torch.equal(got, _b(want).reshape(-1)), f"gather_heads {name} rank {r}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32], ids=str)
@pytest.mark.parametrize("W", [2, 4, 8])
def test_round_trip_and_allgather(dtype, W):
    it = torch.empty((), dtype=dtype).element_size()
    H, D, b = 4 * W, 64, 2
    hpr = H // W
    counts = [7] * W  # the same x_rows on every rank, so one simulate call covers all senders
    T = sum(counts)
    cap = 1 << 22
    xs = [_rand((b, 7, H, D), dtype, r) for r in range(W)]
    sp = S.plan_send_recv_heads((b, 7, H, D), it, W, 0, counts, cap)
    sent = _simulate(sp, W, counts, xs, cap)
    ys = [s.view(b, T, hpr, D * it).view(dtype) for s in sent]
    gp = S.plan_gather_heads((b, T, hpr, D), it, W, 0, counts, cap)
    back = _simulate(gp, W, counts, ys, cap)
    for r in range(W):
        assert torch.equal(back[r], _b(xs[r]).reshape(-1)), f"round trip rank {r}"
    ap = S.plan_allgather((b, 7, H, D), it, W, 0, counts, cap)
    ag = _simulate(ap, W, counts, xs, cap)
    want = _b(torch.cat(xs, dim=1)).reshape(-1)
    for r in range(W):
        assert torch.equal(ag[r], want), f"allgather rank {r}"


@pytest.mark.parametrize("W", [2, 4])
def test_device_mode_layout_and_clamp(W):
    dtype, it = torch.bfloat16, 2
    H, D, b, L = 4 * W, 64, 2, 6
    hpr = H // W
    cap = 1 << 22
    counts = [L + 3] + [r % (L + 1) for r in range(1, W)]  # rank 0 over capacity: clamped to L
    eff = [min(c, L) for c in counts]
    T, P = sum(eff), S.prefix_sums(eff)
    xs = [_rand((b, L, H, D), dtype, 7 * r) for r in range(W)]
    sp = S.plan_send_recv_heads((b, L, H, D), it, W, 0, None, cap)
    assert sp.out_shape == (b, W * L, hpr, D)
    sent = _simulate(sp, W, counts, xs, cap)
    for r in range(W):
        got = sent[r].view(b, W * L, hpr * D * it)
        want = torch.cat([_b(xs[s][:, :eff[s], r * hpr:(r + 1) * hpr]).view(b, eff[s], -1) for s in range(W)], dim=1)
        assert torch.equal(got[:, :T], want), f"device-mode send rank {r}"
        assert int(got[:, T:].count_nonzero()) == 0, "rows past the total must stay untouched"
    ys = [s.view(b, W * L, hpr, D * it).view(dtype) for s in sent]
    gp = S.plan_gather_heads((b, W * L, hpr, D), it, W, 0, None, cap)
    back = _simulate(gp, W, counts, ys, cap)
    for r in range(W):
        got = back[r].view(b, L, H * D * it)[:, :eff[r]]
        assert torch.equal(got, _b(xs[r][:, :eff[r]]).view(b, eff[r], -1)), f"device-mode round trip rank {r}"


def test_simulation_catches_out_of_bounds():
    # A slot smaller than the output must be reported, not written past.
    W, b, H, D = 2, 1, 8, 64
    counts = [4, 4]
    xs = [torch.zeros(b, 4, H, D, dtype=torch.bfloat16) for _ in range(W)]
    with pytest.raises(RuntimeError, match="beyond slot"):
        _C.simulate(S.OP_SEND_RECV_HEADS, W, b, 4, -1, -1, 4 * D * 2, H * D * 2, counts,
                    [bytes(_b(x).reshape(-1).numpy()) for x in xs], 1024)


def _highest_written(plan, W, q, counts, xs, slot_bytes):
    outs = _C.simulate(plan.op, W, plan.batch, plan.x_rows, plan.out_rows, plan.cap_rows, plan.chunk_bytes,
                       plan.wide_bytes, counts, [bytes(_b(x).reshape(-1).numpy()) for x in xs], slot_bytes,
                       only_sender=q)
    top = 0
    for o in outs:
        nz = _fb(o).nonzero()
        if nz.numel():
            top = max(top, int(nz.max()) + 1)
    return top


@pytest.mark.parametrize("W,b", [(1, 2), (2, 1), (3, 2), (8, 1)])
def test_slot_bound_matches_the_kernels_writes_and_admits_every_plan(W, b):
    """Core.launch refuses any call whose writes would leave a peer's slot (_C.slot_bytes_needed).
    That bound must equal the highest byte the kernel's addressing writes, and every plan the Python
    layer accepts must pass it (the C++ check is a second line, never a stricter one)."""
    H, D, it = 8 * W if W != 3 else 24, 64, 2
    hpr = H // W
    cap = 1 << 18

    def ones(b_, t, h):  # every byte 0xFF, so the highest written byte shows in the slot
        return torch.full((b_, t, h, D * it), 0xFF, dtype=torch.uint8).view(torch.bfloat16)

    def need_of(p, q, counts):
        return _C.slot_bytes_needed(p.op, W, q, p.batch, p.x_rows, p.out_rows, p.cap_rows, p.chunk_bytes,
                                    p.wide_bytes, counts)

    for counts in ([5] * W, [0] + [3 * r + 1 for r in range(1, W)], [9] + [0] * (W - 1)):
        T = sum(counts)
        send = [S.plan_send_recv_heads((b, counts[r], H, D), it, W, r, counts, cap) for r in range(W)]
        gather = [S.plan_gather_heads((b, T, hpr, D), it, W, r, counts, cap) for r in range(W)]
        ag = [S.plan_allgather((b, counts[r], 2, D), it, W, r, counts, cap) for r in range(W)]
        inputs = ([ones(b, counts[r], H) for r in range(W)], [ones(b, T, hpr) for _ in range(W)],
                  [ones(b, counts[r], 2) for r in range(W)])
        for plans, xs in zip((send, gather, ag), inputs):
            biggest = max(p.out_bytes for p in plans)  # what the Python layer checks (gather: every target)
            for q, p in enumerate(plans):
                need = need_of(p, q, counts)
                assert need == _highest_written(p, W, q, counts, xs, cap), (p, q, counts)
                assert need <= biggest, (p, q, counts)
    # device counts: the bound is the worst case (every rank at cap_rows), again within the plan
    L = 6
    for q in range(W):
        sp = S.plan_send_recv_heads((b, L, H, D), it, W, q, None, cap)
        gp = S.plan_gather_heads((b, W * L, hpr, D), it, W, q, None, cap)
        for p, h in ((sp, H), (gp, hpr)):
            need = need_of(p, q, [L] * W)  # what Core.launch checks with device counts: all at cap_rows
            xs = [ones(b, p.x_rows, h) for _ in range(W)]
            assert need == _highest_written(p, W, q, [L + 5] * W, xs, cap) <= p.out_bytes
