"""One rank calls ``dispatch`` or ``combine`` with other arguments on the torch runtime (gloo, CPU): the
ranks' per-call geometry travels with the counts the first exchange sends anyway, so every rank raises
the native runtime's ``ValueError`` naming the argument and both values (the lowest differing rank),
before any row moves; the buffer stays usable and the next dispatch and combine are bitwise those made
before the fault. Direct mode at 3 ranks (the odd one in the middle) and hybrid mode at 2 x 2 (the odd
one neither in rank 0's domain nor on its rail).

Dispatch: ``num_max_tokens_per_rank``, hidden size, dtype (bytes per row and scale packs), ``num_experts``,
top-k, scale packs (also 257 against 1), ``expert_alignment``, ``zero_copy``. Combine: the hidden size of
``x`` and a handle of another dispatch (its ``num_max_tokens_per_rank`` or top-k; one of the same shapes:
test_torch_handle_cpu.py). ``topk_weights`` on some ranks only is no mismatch: the call works and the
weights of the rank that passed none arrive as zeros. The native runtime's side: test_refusals_cpu.py
(host) and test_geometry_gpu.py (kernels).
"""
from __future__ import annotations

import pytest
import torch

from tests._dist import run_workers

HID, K, M, M_BIG = 256, 4, 48, 64  # bf16 rows of 512 bytes; the odd rank's narrower ones have 256
FP8 = torch.float8_e4m3fn
TOKENS = [40, 17, 48, 0]

# case -> (the differing argument as the message names it, the odd rank's value, the other ranks')
DISPATCH = {
    "num_max_tokens_per_rank": ("num_max_tokens_per_rank", M_BIG, M),
    "hidden": ("bytes per row of x (hidden x element size)", 256, 512),
    "dtype": ("bytes per row of x (hidden x element size)", 256, 512),  # FP8: scale packs differ too
    "num_experts": ("num_experts", "2E", "E"),
    "num_topk": ("num_topk", 2, K),
    "scale_packs": ("scale packs per token", 2, 1),
    "scale_packs_256": ("scale packs per token", 257, 1),  # equal modulo 256: whole values are compared
    "expert_alignment": ("expert_alignment", 4, 1),
    "zero_copy": ("zero_copy", 1, 0),
}
COMBINE = {
    "combine_hidden": ("bytes per row of x (hidden x element size)", 256, 512),
    "combine_handle_topk": ("num_topk", 2, K),
    "combine_handle_max_tokens": ("num_max_tokens_per_rank", M_BIG, M),
}


def _dispatch_call(name, odd: bool, x, topk, w, E, stats):
    """``(x, kwargs)`` of a fault case's dispatch on one rank (the odd rank's differs)."""
    kw = dict(topk_idx=topk, topk_weights=w, num_experts=E, num_max_tokens_per_rank=M,
              cumulative_local_expert_recv_stats=stats)
    if name in ("dtype", "scale_packs", "scale_packs_256") and (odd or name.startswith("scale_packs")):
        packs = DISPATCH[name][1] if odd and name.startswith("scale_packs") else 1
        x = (x.float().to(FP8), torch.full((x.shape[0], packs), 0.5))
    if not odd:
        return x, kw
    if name == "num_max_tokens_per_rank":
        kw["num_max_tokens_per_rank"] = M_BIG
    elif name == "hidden":
        x = x[:, :HID // 2].contiguous()
    elif name == "num_experts":
        kw["num_experts"] = 2 * E
        kw["cumulative_local_expert_recv_stats"] = None
    elif name == "num_topk":
        kw.update(topk_idx=topk[:, :2].contiguous(), topk_weights=w[:, :2].contiguous())
    elif name == "expert_alignment":
        kw["expert_alignment"] = 4
    elif name == "zero_copy":
        kw["zero_copy"] = True
    return x, kw


def _outcome(fn):
    """``None`` when ``fn()`` returns, else ``(exception type name, message)``."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reports what each rank raised
        return type(e).__name__, str(e)
    return None


def _worker(rank, world, rdzv, scaleup, odd, names):
    import torch.distributed as dist

    from tests._dist import init_gloo
    from tests.elastic_ep._common import bytes_of, import_elastic_ep, make_inputs, scaleup_override

    ep = import_elastic_ep()
    group = init_gloo(rank, world, rdzv)
    E = 4 * world
    nbytes = ep.ElasticBuffer.get_buffer_size_hint(group, M_BIG, HID, K, zero_copy=True)
    with scaleup_override(scaleup):
        buf = ep.ElasticBuffer(group, nbytes, num_max_tokens_per_rank=M_BIG, hidden=HID, num_topk=K,
                               backend="torch", num_cpu_timeout_secs=30)
    assert (buf.runtime.hybrid is not None) == (scaleup is not None)
    inp = make_inputs(rank, TOKENS[rank], HID, K, E, "bf16", seed=5, device="cpu")
    x, topk, w = inp["x"], inp["topk_idx"], inp["topk_weights"]

    def good():
        recv, _, rw, h, _ = buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=E, num_max_tokens_per_rank=M)
        combined, cw, _ = buf.combine(recv, h, topk_weights=rw)
        return [bytes_of(t) for t in (recv, rw, combined, cw)], h

    ref, _ = good()
    got = {}
    for name in names:
        is_odd = rank == odd
        if name in DISPATCH:
            stats = torch.zeros(E // world, dtype=torch.int32)
            cx, kw = _dispatch_call(name, is_odd, x, topk, w, E, stats)
            got[name] = _outcome(lambda: buf.dispatch(cx, **kw))
            assert not stats.any(), f"{name}: rows were counted into the stats of a refused dispatch"
        elif name == "topk_weights":
            recv, _, rw, h, _ = buf.dispatch(x, topk_idx=topk, topk_weights=None if is_odd else w, num_experts=E,
                                             num_max_tokens_per_rank=M)
            assert torch.equal(bytes_of(recv), ref[0]), "topk_weights on some ranks only: other rows"
            if not is_odd:
                psum = [0] + h.psum_num_recv_tokens_per_scaleup_rank.tolist()
                want = ref[1].view(torch.float32).clone()
                want[psum[odd]:psum[odd + 1]] = 0
                assert torch.equal(rw, want), "topk_weights on some ranks only: other weights"
            got[name] = None
        else:  # every rank makes dispatch a and b; the odd rank combines b's rows with b's handle
            a = b = buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=E, num_max_tokens_per_rank=M)
            if name == "combine_hidden":
                b = (a[0][:, :HID // 2].contiguous(),) + a[1:]
            else:
                k = 2 if name == "combine_handle_topk" else K
                b = buf.dispatch(x, topk_idx=topk[:, :k].contiguous(), topk_weights=w[:, :k].contiguous(),
                                 num_experts=E, num_max_tokens_per_rank=M_BIG if name.endswith("max_tokens") else M)
            recv, _, rw, h, _ = b if is_odd else a
            got[name] = _outcome(lambda: buf.combine(recv, h, topk_weights=rw))
        after, _ = good()  # the buffer stays usable: the next calls are bitwise those before the fault
        for a, b in zip(ref, after):
            assert torch.equal(a, b), f"{name}: the next dispatch / combine differs"
    buf.destroy()
    dist.destroy_process_group()
    return got


def _expect(name: str, rank: int, odd: int, world: int) -> str:
    field, theirs, mine = (DISPATCH.get(name) or COMBINE[name])
    E = 4 * world
    theirs, mine = {"2E": 2 * E, "E": E}.get(theirs, theirs), {"E": E}.get(mine, mine)
    if rank == odd:
        return f"{field}: rank 0 passed {mine}, rank {rank} (this one) {theirs}"
    return f"{field}: rank {odd} passed {theirs}, rank {rank} (this one) {mine}"


@pytest.mark.fault
@pytest.mark.parametrize("world,scaleup,odd", [(3, None, 1), (4, 2, 3)], ids=["direct-3", "hybrid-2x2"])
def test_torch_refuses_a_rank_with_other_arguments(tmp_path, world, scaleup, odd):
    names = list(DISPATCH) + list(COMBINE) + ["topk_weights"]
    got = run_workers(_worker, world, scaleup, odd, names, tmp_path=tmp_path, timeout=400)
    for name in names:
        for rank in range(world):
            res = got[rank][name]
            if name == "topk_weights":
                assert res is None, (name, rank, res)
                continue
            assert res is not None, f"{name}: rank {rank} returned"
            kind, msg = res
            op = "combine" if name in COMBINE else "dispatch"
            assert kind == "ValueError" and msg.startswith(f"{op}: the ranks called it with different arguments"), \
                (name, rank, res)
            assert _expect(name, rank, odd, world) in msg, (name, rank, msg)
            assert "no row moved and the buffer stays usable" in msg, (name, rank, msg)
            assert msg.count(" passed ") == 1, (name, rank, msg)  # the first differing word's argument only
