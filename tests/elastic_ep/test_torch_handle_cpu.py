"""Ranks that pass handles of different dispatches of the same shapes (two micro-batches) to ``combine`` or
a cached ``dispatch`` (torch runtime, gloo, CPU; direct mode at 2 ranks and hybrid mode at 2 x 2).

Each handle carries the serial number of its dispatch, which every rank's runtime counts alike; the
counts' exchange carries it with the geometry words, so a rank whose handle comes from another dispatch
makes every rank raise the geometry refusal's ``ValueError`` (naming the handle and both dispatches)
before any row moves, and the buffer stays usable. Every rank passing the same older handle is what a
cached handle is for, and works: a combine with micro-batch a's handle after micro-batch b's dispatch,
a cached dispatch with it, are bitwise those made right after a's dispatch.
The native runtime does not compare handles (README's fault table).
"""
from __future__ import annotations

import pytest
import torch

from tests._dist import run_workers
from tests.elastic_ep.test_torch_geometry_cpu import _outcome

M, H, K, T = 32, 128, 4, 24


def _worker(rank, world, rdzv, scaleup, odd):
    import torch.distributed as dist

    from tests._dist import init_gloo
    from tests.elastic_ep._common import bytes_of, import_elastic_ep, make_inputs, scaleup_override

    ep = import_elastic_ep()
    group = init_gloo(rank, world, rdzv)
    E = 4 * world
    with scaleup_override(scaleup):
        buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch",
                               num_cpu_timeout_secs=30)
    assert (buf.runtime.hybrid is not None) == (scaleup is not None)
    # Two micro-batches of the same shapes and other routings.
    inp = [make_inputs(rank, T, H, K, E, "bf16", seed=s, device="cpu", mask_prob=0.0) for s in (3, 4)]

    def dispatch(i, handle=None):
        x = inp[i]["x"]
        if handle is not None:
            return buf.dispatch(x, handle=handle, topk_weights=inp[i]["topk_weights"])
        return buf.dispatch(x, topk_idx=inp[i]["topk_idx"], topk_weights=inp[i]["topk_weights"], num_experts=E)

    def combine(d):
        recv, _, w, h, _ = d
        out, cw, _ = buf.combine(recv, h, topk_weights=w)
        return [bytes_of(t) for t in (out, cw)]

    a = dispatch(0)  # dispatch #1
    ref_a = combine(a)
    b = dispatch(1)  # dispatch #2
    ref_b = combine(b)
    assert (a[3].dispatch_id, b[3].dispatch_id) == (1, 2)

    # Every rank with micro-batch a's handle after b's dispatch: the handle is cached, not stale.
    for got, want in zip(combine(a), ref_a):
        assert torch.equal(got, want), "combine with an older handle on every rank"
    cached = dispatch(0, a[3])  # dispatch #3 returns a's handle
    assert cached[3] is a[3]
    assert torch.equal(bytes_of(cached[0]), bytes_of(a[0])), "cached dispatch with an older handle on every rank"
    for got, want in zip(combine(cached), ref_a):
        assert torch.equal(got, want), "combine after a cached dispatch"

    mine = rank == odd
    got = {
        # The odd rank combines micro-batch b's rows with b's handle, the others a's.
        "combine": _outcome(lambda: combine(b if mine else a)),
        # The odd rank makes a cached dispatch with b's handle, the others with a's (dispatch #4).
        "cached dispatch": _outcome(lambda: dispatch(1 if mine else 0, (b if mine else a)[3])),
        # The odd rank makes a cached dispatch with a's handle, the others a new dispatch (dispatch #5).
        "cached and new dispatch": _outcome(lambda: dispatch(0, a[3] if mine else None)),
    }
    # The buffer stays usable: the next dispatches and combines are bitwise those before the faults.
    for i, ref in ((0, ref_a), (1, ref_b)):
        for g, want in zip(combine(dispatch(i)), ref):
            assert torch.equal(g, want), "the calls after the refusals differ"
    buf.destroy()
    dist.destroy_process_group()
    return got


# case -> (operation, the odd rank's dispatch, the other ranks')
CASES = {"combine": ("combine", 2, 1), "cached dispatch": ("dispatch", 2, 1),
         "cached and new dispatch": ("dispatch", 1, 0)}


def _handle(n: int) -> str:
    return f"the handle of this buffer's dispatch #{n}" if n else "no handle (a new dispatch)"


@pytest.mark.fault
@pytest.mark.parametrize("world,scaleup,odd", [(2, None, 1), (4, 2, 3)], ids=["direct-2", "hybrid-2x2"])
def test_torch_refuses_handles_of_different_dispatches(tmp_path, world, scaleup, odd):
    got = run_workers(_worker, world, scaleup, odd, tmp_path=tmp_path, timeout=300)
    for name, (op, theirs, mine) in CASES.items():
        for rank in range(world):
            res = got[rank][name]
            assert res is not None, f"{name}: rank {rank} returned (rows moved by another dispatch's routing)"
            kind, msg = res
            assert kind == "ValueError" and msg.startswith(f"{op}: the ranks called it with different arguments"), \
                (name, rank, res)
            if rank == odd:
                says = f"handle: rank 0 passed {_handle(mine)}, rank {rank} (this one) {_handle(theirs)}"
            else:
                says = f"handle: rank {odd} passed {_handle(theirs)}, rank {rank} (this one) {_handle(mine)}"
            assert says in msg and "no row moved and the buffer stays usable" in msg, (name, rank, msg)
