"""Hybrid mode's relayed words on the CPU: the torch runtime's two-hop exchange (``_hybrid``) over gloo,
and the native runtime's Python layer for the forwarder's report (a fake ``_C`` runtime).

* Torch runtime, 2 x 2 logical domains: one rank corrupts a word of the rows it sends in one stage (the
  source rank, scale-up mask or token of a dispatch row, the destination or sender of a combine row,
  written by a wrapper around the exchange): every rank that receives such a row raises ``CommError``
  naming the stage, the peer and the word's value; a forwarder that finds one marks the rows it would
  have relayed, so the ranks after it raise too, naming both the forwarder and the rank whose row it
  could not relay; every rank's exchanges complete, and the next dispatch and combine are bitwise those
  of a direct-mode buffer.
* Native runtime: the forwarder's report of a staged record with a route out of range is a
  ``CommError`` naming the rank and the value, and marks the buffer unusable; ELASTIC_EP_TEST_CORRUPT
  selects the route fault.
The native kernels' side runs on a GPU in test_hybrid_faults_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from tests._dist import run_workers
from tests.elastic_ep.test_lowlevel_host_cpu import FakeRuntime, dispatch, ll, make_buffer, streams  # noqa: F401

H, K, E, M, T = 64, 4, 16, 16, 12
_TAIL = 16  # _hybrid._EXTRA: the two int64 of each row in flight

# (operation, stage, corrupting rank, word, value) -> the error each rank raises (None: it returns).
CASES = {
    "dispatch source": (
        "dispatch", "dispatch scale-out stage", 1, 0, 3,
        {1: "rank 1 sent this rank to relay a row whose source rank is 3",
         3: "rank 1 sent this rank to relay a row whose source rank is 3",
         0: "rank 1 could not relay a row rank 1 sent it", 2: "rank 3 could not relay a row rank 1 sent it"}),
    "dispatch mask": (
        "dispatch", "dispatch scale-up stage", 2, 1, 0,
        {2: "rank 2 relayed a row whose scale-up mask is 0", 3: "rank 2 relayed a row whose scale-up mask is 0",
         0: None, 1: None}),
    "dispatch token": (
        "dispatch", "dispatch scale-out stage", 0, "token", M + 3,
        {0: f"rank 0 sent this rank to relay a row whose token index is {M + 3}",
         2: f"rank 0 sent this rank to relay a row whose token index is {M + 3}",
         1: "rank 0 could not relay a row rank 0 sent it", 3: "rank 2 could not relay a row rank 0 sent it"}),
    "combine destination": (
        "combine", "combine scale-up stage", 3, 0, 7,
        {2: "rank 3 sent this rank to relay a row whose destination rank is 7",
         3: "rank 3 sent this rank to relay a row whose destination rank is 7",
         0: "rank 2 could not relay a row rank 3 sent it", 1: "rank 3 could not relay a row rank 3 sent it"}),
    "combine sender": (
        "combine", "combine scale-out stage", 1, 1, 5,
        {1: "rank 1 relayed a row whose sender rank is 5", 3: "rank 1 relayed a row whose sender rank is 5",
         0: None, 2: None}),
}


def _corrupting(real, stage: str, word, value: int):
    """The exchange ``real`` with ``word`` (0 / 1: the row's first / second int64 in flight; "token": the
    dispatch record's token index, the payload's last int64) of every row sent in ``stage`` set to ``value``."""
    def exchange(send, counts, st, *rest):
        if st == stage and send.shape[0]:
            at = send.shape[1] - _TAIL + 8 * word if word != "token" else send.shape[1] - _TAIL - 8
            send = send.clone()
            send[:, at:at + 8] = torch.full((send.shape[0], 1), value, dtype=torch.int64).view(torch.uint8)
        return real(send, counts, st, *rest)
    return exchange


def _relay_worker(rank, world, rdzv, names):
    import torch.distributed as dist

    from tests._dist import init_gloo
    from tests.elastic_ep._common import bytes_of, import_elastic_ep, make_inputs, scaleup_override

    ep = import_elastic_ep()
    group = init_gloo(rank, world, rdzv)
    kw = dict(num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch", num_cpu_timeout_secs=30)
    with scaleup_override(2):
        hyb = ep.ElasticBuffer(group, **kw)
    direct = ep.ElasticBuffer(group, **kw)
    real = hyb.runtime.hybrid._a2a
    got = {}
    for i, name in enumerate(names):
        op, stage, who, word, value, _ = CASES[name]
        inp = make_inputs(rank, T, H, K, E, "bf16", seed=40 + i, device="cpu", mask_prob=0.0)
        call = dict(topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"], num_experts=E)
        if rank == who:
            hyb.runtime.hybrid._a2a = _corrupting(real, stage, word, value)
        try:  # a rank that returns makes no further call than those that raise (the ranks stay in step)
            recv, _, w, handle, _ = hyb.dispatch(inp["x"], **call)
            if op == "combine":
                hyb.combine(recv, handle, topk_weights=w)
            got[name] = None
        except ep.CommError as e:
            got[name] = str(e)
        hyb.runtime.hybrid._a2a = real
        # Every rank's exchanges completed: the next good dispatch and combine are direct mode's bits.
        outs = []
        for b in (hyb, direct):
            recv, _, w, handle, _ = b.dispatch(inp["x"], **call)
            combined, cw, _ = b.combine(recv, handle, topk_weights=w)
            outs.append((recv, w, combined, cw))
        for a, b in zip(*outs):
            assert torch.equal(bytes_of(a), bytes_of(b)), f"{name}: the next call differs from direct mode"
    hyb.destroy()
    direct.destroy()
    dist.destroy_process_group()
    return got


@pytest.mark.fault
def test_torch_hybrid_refuses_corrupted_relayed_words(tmp_path):
    names = list(CASES)
    got = run_workers(_relay_worker, 4, names, tmp_path=tmp_path, timeout=300)
    for name in names:
        op, stage, *_, expect = CASES[name]
        for rank in range(4):
            msg = got[rank][name]
            if expect[rank] is None:
                assert msg is None, f"{name}: rank {rank} raised {msg}"
                continue
            assert msg is not None, f"{name}: rank {rank} returned rows carrying a corrupted word"
            assert "protocol error" in msg and expect[rank] in msg and f"[rank {rank}]" in msg, (name, msg)


def test_native_route_report_is_a_protocol_error_and_the_buffer_unusable(streams):  # noqa: F811
    # The forward kernel's report (kProtocolRoute) reaches the host at the next call, as the epilogue's.
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    dispatch(b)
    rt.geometry = (2, 7, 48 + 5, 48)
    with pytest.raises(ll.CommError, match="protocol error") as info:
        dispatch(b)
    says = "a record rank 2 staged for this rank to relay (hybrid mode) routes a lane to 53, outside [0, 48)"
    assert says in str(info.value) and "destroy it on every rank" in str(info.value)
    assert rt.broken and "mark_broken" in rt.calls


def test_route_fault_is_selected_by_the_test_hook(monkeypatch):
    from tests.elastic_ep._common import import_elastic_ep

    import_elastic_ep()
    from elastic_ep import _env

    for kind, code in (("count", 1), ("source", 2), ("route", 3), ("", 0)):
        monkeypatch.setenv("ELASTIC_EP_TEST_CORRUPT", kind)
        assert _env.Settings.read().test_corrupt == code
