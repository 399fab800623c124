"""Hybrid mode's relayed words on the native runtime (2 x 2 logical domains of ELASTIC_EP_NUM_SCALEUP_RANKS,
the CUDA-IPC window, ranks sharing one GPU where fewer are lent).

In hybrid mode a rank hears from its own domain and its rail peers only: the other ranks' geometry
words and counts reach it through the rail peer in its domain, and their records through that rail
peer's forward kernel (csrc/kernels/hybrid.cuh).

* A rank with other arguments (rank 3: neither in rank 0's domain nor its rail peer, so rank 0 sees its
  geometry only as relayed): every rank refuses the dispatch before anything is pushed or relayed and
  raises ValueError naming the argument and both values (at once with a CPU sync, at the next call
  without), within seconds; the buffer stays usable: the next good dispatch, cached dispatch and
  combine are bitwise equal to the oracle.
* A corrupted relayed word (ELASTIC_EP_TEST_CORRUPT): a count word relayed to another domain, the source
  ids of the records a rank stages for its rail peers, or their routes. The rank that reads it raises
  CommError naming the peer and the value (the count at once; the records at its next call), nothing
  is written where the word points, that buffer is unusable (its next call says so) and CUDA stays
  usable. A forwarder that finds a corrupted route tells no other rank of its domain that the rows are
  complete: those time out (or see a peer end) instead of returning rows it never relayed.
* The raw ``_C`` runtime's hybrid epilogue with a parameter block the forward kernel would index past
  the buffer by is refused before anything launches, naming the member; the buffer stays usable.
"""
from __future__ import annotations

import pytest
import torch

from tests._dist import run_workers

H, K, T = 256, 4, 48


def _hybrid_buffer(ep, group, **kw):
    from tests.elastic_ep._common import scaleup_override

    with scaleup_override(2):
        buf = ep.ElasticBuffer(group, hidden=H, num_topk=K, backend="native", explicitly_destroy=True,
                               window="ipc", **kw)
    assert buf.get_logical_domain_size() == (2, 2)
    return buf


def geometry_worker(rank, world, rdzv, field, cpu_sync):
    """test_geometry_gpu's worker (rank 3 passes another `field`; every rank must refuse by name, then
    run a good dispatch, cached dispatch and combine against the oracle) on hybrid buffers."""
    from tests.elastic_ep import test_geometry_gpu
    from tests.elastic_ep._common import import_elastic_ep, scaleup_override

    ep = import_elastic_ep()
    made = []
    init = ep.ElasticBuffer.__init__

    def hybrid_init(self, *args, **kw):
        init(self, *args, **kw)
        made.append(self.get_logical_domain_size())

    ep.ElasticBuffer.__init__ = hybrid_init
    with scaleup_override(2):
        got = test_geometry_gpu.geometry_worker(rank, world, rdzv, field, cpu_sync)
    assert made == [(2, 2)], made
    return got


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("field,cpu_sync", [("hidden", True), ("hidden", False), ("num_max_tokens_per_rank", True),
                                            ("num_topk", True), ("expert_alignment", False)])
@pytest.mark.fault
def test_native_hybrid_refuses_a_rank_with_other_geometry(tmp_path, field, cpu_sync):
    res = run_workers(geometry_worker, 4, field, cpu_sync, tmp_path=tmp_path, timeout=240)
    assert res == ["refused"] * 4


def corrupt_worker(rank, world, rdzv, kind, corrupting_rank):
    """``corrupting_rank`` sends a corrupted word (ELASTIC_EP_TEST_CORRUPT, read when the buffer is made):
    "count": the count word for rank (r + 1) % 4, in the other domain (relayed by its rail peer there);
    "source": records naming source tokens outside its range (relayed by its rail peer to the other
    domain; its own domain's rows directly); "route": the records it stages for its rail peer route
    their lanes past num_max_tokens_per_rank. Returns what this rank raised (or "no error"), and
    whether its next call then said the buffer is unusable."""
    import os

    from tests.elastic_ep._common import import_elastic_ep, init_ep_group, make_inputs
    from tests.elastic_ep._workers import calls_until_error

    if rank == corrupting_rank:
        os.environ["ELASTIC_EP_TEST_CORRUPT"] = kind
    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, "ipc")
    E = 8 * world
    buf = _hybrid_buffer(ep, group, num_max_tokens_per_rank=T, num_cpu_timeout_secs=15, num_gpu_timeout_secs=5)
    inp = make_inputs(rank, T, H, K, E, "bf16", 7, "cuda", mask_prob=0.0)
    got, unusable = calls_until_error(ep, buf, inp, E), False
    if "protocol error" in got:
        try:
            buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], num_experts=E)
        except ep.CommError as e:
            unusable = "unusable" in str(e)
    buf.destroy()
    torch.cuda.synchronize()  # the context stays usable
    assert int(torch.arange(10, device="cuda").sum()) == 45
    return got, unusable


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("kind,corrupting,readers,says", [
    ("count", 1, [2], f"rank 1 sent a count of {T + 1} tokens"),
    ("source", 0, [1, 2, 3], "a record in rank 0's area names source token"),
    ("route", 0, [2], "a record rank 0 staged for this rank to relay (hybrid mode) routes a lane to"),
])
@pytest.mark.fault
def test_native_hybrid_reports_a_corrupted_relayed_word(tmp_path, kind, corrupting, readers, says):
    res = run_workers(corrupt_worker, 4, kind, corrupting, tmp_path=tmp_path, timeout=200)
    for rank, (got, unusable) in enumerate(res):
        if rank in readers:
            assert got.startswith("CommError") and "protocol error" in got and says in got, (rank, got)
            assert unusable, f"rank {rank}: the call after a protocol error did not say the buffer is unusable"
        else:  # told through a named timeout or the peer watch (a reader exits once it raised), or not at all
            assert got == "no error" or got.startswith("CommTimeoutError") or \
                ("CommError" in got and "process" in got and "died" in got), (rank, got)
    if kind == "route":
        # Rank 3 shares rank 2's domain: it must not return rows rank 2 never relayed.
        assert res[3][0] != "no error", res[3]


def raw_epilogue_worker(rank, world, rdzv):
    """A caller of the raw ``_C`` runtime's hybrid epilogue (the forward kernel first) with a parameter block
    the forward kernel would index past the buffer or an array by: refused before anything is launched
    (host/ops_ep.cpp: the shape, the relay area inside the buffer, neither overlapped nor zero-copy), naming
    the member; the buffer then dispatches and combines bitwise as before. Returns the refusals."""
    from elastic_ep import _C
    from tests.elastic_ep._common import bytes_of, import_elastic_ep, init_ep_group, make_inputs

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, "ipc")
    E = 8 * world
    buf = _hybrid_buffer(ep, group, num_max_tokens_per_rank=T, num_cpu_timeout_secs=30, num_gpu_timeout_secs=20)
    inp = make_inputs(rank, T, H, K, E, "bf16", 7, "cuda")

    def good():
        recv, _, w, handle, _ = buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"],
                                             num_experts=E)
        out, cw, _ = buf.combine(recv, handle, topk_weights=w)
        torch.cuda.synchronize()
        return [bytes_of(t) for t in (recv, w, out, cw)]

    ref = good()
    rt = buf.runtime
    record = int(_C.dispatch_token_bytes(2 * H, 1, 0, K))
    # Direct mode's receive area fits, hybrid mode's relay area after it does not.
    past_relay = rt.num_buffer_bytes // (world * record) * 9 // 10
    base = dict(num_max_tokens_per_rank=T, hidden_bytes=2 * H, num_experts=E, num_topk=K, expert_alignment=1,
                num_sms=8)
    bad = [(dict(num_topk=33), "num_topk"), (dict(num_experts=E + 1), "multiple"),
           (dict(hidden_bytes=2 * H + 8), "multiple of 16"),
           (dict(num_sf_packs=int(_C.MAX_SF_PACKS) + 1), "num_sf_packs"),
           (dict(num_max_tokens_per_rank=past_relay), "hybrid mode needs"),
           (dict(overlap=1), "neither an overlapped nor a zero-copy"), (dict(zero_copy=1), "nor a zero-copy")]
    refused = 0
    for change, says in bad:
        try:
            rt._rt.dispatch_epilogue(_C.EpilogueParams(**{**base, **change}), rt._comm_raw)
        except Exception as e:  # noqa: BLE001 - ValueError or CommError, each naming what it refuses
            assert says in str(e), (change, str(e))
            refused += 1
    torch.cuda.synchronize()
    for a, b in zip(ref, good()):
        assert torch.equal(a, b), "the dispatch / combine after the refused epilogues differ"
    buf.destroy()
    return refused


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.fault
def test_native_hybrid_raw_epilogue_rechecks_what_the_forward_kernel_indexes(tmp_path):
    assert run_workers(raw_epilogue_worker, 4, tmp_path=tmp_path, timeout=200) == [7] * 4
