"""The raw native runtime (``_C.Runtime``) re-checks what its kernels index before it launches anything:
a caller of the bindings directly gets a ValueError naming the member, never a kernel writing past an
array or the buffer; the runtime stays usable (checked bitwise against the reference of
test_lowlevel_gpu.py)."""
from __future__ import annotations

import pytest

from tests._dist import init_nccl, run_workers
from tests.elastic_ep.test_lowlevel_gpu import (_assert, _combine, _combine_ref, _dispatch, _inputs, _make_comm,
                                                _new_buffer)

torch = pytest.importorskip("torch")


def _worker_raw_runtime_checks(rank, world_size, rdzv):
    """The raw _C.Runtime re-checks what its kernels index before it launches anything: a parameter
    block with num_tokens past num_max_tokens_per_rank, num_topk past 32, num_experts not a multiple
    of the ranks, a row that is no multiple of 16 bytes or records that do not fit the buffer raises
    ValueError naming it, and the runtime then still dispatches and combines bitwise right."""
    init_nccl(rank, world_size, rdzv)
    import torch.distributed as dist

    from elastic_ep import _C
    from elastic_ep import _low_level as ll

    comm = _make_comm(rank, world_size)
    T, H, K, E = 64, 512, 4, 8
    buf = _new_buffer(rank, world_size, comm, ll.NativeRuntime.calculate_buffer_size(comm, T, H, K, False, True, True),
                      True)
    good = dict(num_tokens=T, num_max_tokens_per_rank=T, hidden_bytes=2 * H, num_experts=E, num_topk=K,
                expert_alignment=1, num_sms=8)
    bad = [(dict(num_tokens=T + 1), "num_tokens"), (dict(num_topk=33), "num_topk"),
           (dict(num_experts=7 * 64), "multiple"), (dict(hidden_bytes=2 * H + 8), "multiple of 16"),
           (dict(num_max_tokens_per_rank=64 * T), "bytes of buffer"), (dict(expert_alignment=0), "expert_alignment")]
    refused = 0
    for change, says in bad:
        params = _C.DispatchParams(**{**good, **change})
        try:
            buf._rt.dispatch(params, buf._comm_raw, -1)
        except ValueError as e:
            _assert(says in str(e), f"{change}: {e}")
            refused += 1
    cparams = _C.CombineParams(num_combined_tokens=T + 1, num_max_tokens_per_rank=T, hidden=H, num_experts=E,
                               num_topk=K, num_sms=8)
    try:
        buf._rt.combine(cparams, buf._comm_raw, 0, -1, -1)
    except ValueError as e:
        _assert("num_combined_tokens" in str(e), str(e))
        refused += 1
    x, _, topk, w = _inputs(rank, T, H, K, E, False, False, 3)
    out, handle = _dispatch(buf, x, None, topk, w, None, T, E, 1)
    N = int(out[8][-1].item())
    _assert(torch.equal(out[0][:N], x[(topk >= 0).any(dim=1)]), "dispatch rows after the refused blocks")
    y = (out[0].float() * (rank + 1)).to(torch.bfloat16)
    got = _combine(buf, y, handle)[0]
    ref, _ = _combine_ref(rank, world_size, K, E // world_size, T, T, topk, w, x, False, None, None, True, False)
    _assert(torch.equal(got.view(torch.int16), ref.view(torch.int16)), "combine after the refused blocks")
    buf.destroy()
    ll.destroy_nccl_comm(comm)
    dist.destroy_process_group()
    return refused


@pytest.mark.gpu
@pytest.mark.fault
def test_lowlevel_raw_runtime_rechecks_what_kernels_index(tmp_path):
    assert run_workers(_worker_raw_runtime_checks, 1, tmp_path=tmp_path, timeout=120) == [7]
