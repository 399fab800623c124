"""One rank calls dispatch with other arguments than its peers (native runtime, ranks sharing one GPU).

Every rank sends its peers the call's geometry (num_max_tokens_per_rank, bytes per row, num_experts,
top-k, scale packs, expert_alignment, zero_copy) at notify's entry and compares theirs with its own
before any count or record is used: on a difference every rank refuses the dispatch, nothing is
written, and each raises ValueError naming the argument and both values, at once with a CPU sync,
at the next call without. The buffer stays usable: the next good dispatch and combine are bitwise
equal to the oracle.
"""
from __future__ import annotations

import pytest
import torch

from tests._dist import run_workers

H, K, T = 256, 4, 48


def geometry_worker(rank, world, rdzv, field, cpu_sync):
    import time

    from tests.elastic_ep._common import import_elastic_ep, init_ep_group, make_inputs, raise_failures
    from tests.elastic_ep._workers import run_case

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, "ipc")
    E = 8 * world
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=2 * T, hidden=H, num_topk=K, backend="native",
                           num_cpu_timeout_secs=20, num_gpu_timeout_secs=20, explicitly_destroy=True, window="ipc")
    odd = rank == world - 1
    hidden = H // 2 if odd and field == "hidden" else H
    topk = K // 2 if odd and field == "num_topk" else K
    inp = make_inputs(rank, T, hidden, topk, E, "bf16", 7, "cuda")
    kw = dict(topk_weights=inp["topk_weights"], num_experts=E, do_cpu_sync=cpu_sync,
              num_max_tokens_per_rank=T + 16 if odd and field == "num_max_tokens_per_rank" else T,
              expert_alignment=4 if odd and field == "expert_alignment" else 1)
    name = {"hidden": "bytes per row of x", "num_topk": "num_topk", "expert_alignment": "expert_alignment",
            "num_max_tokens_per_rank": "num_max_tokens_per_rank"}[field]
    t0 = time.monotonic()
    msg = ""
    try:
        buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], **kw)
        if not cpu_sync:  # reported by the next call, before it launches anything
            torch.cuda.synchronize()
            buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], **kw)
    except ValueError as e:
        msg = str(e)
    assert msg, f"rank {rank}: a dispatch with another rank's {field} was not refused"
    assert time.monotonic() - t0 < 10, "the refusal waited for a deadline"
    assert name in msg and "different arguments" in msg and "no row moved" in msg, msg
    peer = 0 if odd else world - 1
    assert f"rank {peer} passed" in msg, msg
    case = dict(dtype="bf16", expand=False, cpu_sync=True, alignment=1, zero_padding=False, num_bias=1,
                cached=True, tma_sf=False, sf_strided_input=False, stream_opt="sync", handle_copy=False)
    # The buffer's num_max_tokens_per_rank (2 T) is the default of the calls below (source ids are s * M + t).
    run_case(buf, None, group, rank, world, case, dict(hidden=H, topk=K, experts=E, max_tokens=2 * T, tokens=T - rank),
             seed=5, with_oracle=True)
    buf.destroy()
    raise_failures(rank)
    return "refused"


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("field,cpu_sync", [("hidden", True), ("hidden", False), ("num_max_tokens_per_rank", True),
                                            ("num_topk", True), ("expert_alignment", False)])
@pytest.mark.fault
def test_native_dispatch_refuses_a_rank_with_other_geometry(tmp_path, field, cpu_sync):
    res = run_workers(geometry_worker, 2, field, cpu_sync, tmp_path=tmp_path, timeout=150)
    assert res == ["refused", "refused"]


def corrupt_worker(rank, world, rdzv, kind):
    """Rank 0 sends rank 1 a corrupted word (ELASTIC_EP_TEST_CORRUPT, read when the buffer is made):
    a count above num_max_tokens_per_rank, a row count for one of rank 1's experts above top-k x that,
    or records naming source tokens outside rank 0's range (with "own_row", rank 0's combine corrupts
    its own slots instead: see the last test). Rank 1 reports a protocol error naming rank 0 (at once
    for the counts, which notify checks before sizing anything; at its next call for the records, which the epilogue checks as it copies) and writes
    nothing where the word points; rank 0 learns of rank 1 through a named timeout or the peer watch
    (rank 1's process ends after it raised), never a hang."""
    import os

    from tests.elastic_ep._common import import_elastic_ep, init_ep_group, make_inputs
    from tests.elastic_ep._workers import calls_until_error

    if rank == 0:
        os.environ["ELASTIC_EP_TEST_CORRUPT"] = kind
    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, "ipc")
    E = 8 * world
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, backend="native",
                           num_cpu_timeout_secs=15, num_gpu_timeout_secs=5, explicitly_destroy=True, window="ipc")
    got = calls_until_error(ep, buf, make_inputs(rank, T, H, K, E, "bf16", 7, "cuda"), E)
    buf.destroy()
    torch.cuda.synchronize()  # the context stays usable
    return got


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("kind,says", [("count", f"rank 0 sent a count of {T + 1} tokens"),
                                       ("expert_count", f"rank 0 sent a count of {K * T + 1} rows for one of this "
                                                        "rank's experts"),
                                       ("source", "a record in rank 0's area names source token")])
@pytest.mark.fault
def test_native_dispatch_reports_a_corrupted_peer_word(tmp_path, kind, says):
    zero, one = run_workers(corrupt_worker, 2, kind, tmp_path=tmp_path, timeout=150)
    assert one.startswith("CommError") and "protocol error" in one and says in one, one
    # Rank 0 hears of rank 1 through a named timeout, or (rank 1 exits once it raised) the peer watch.
    assert zero == "no error" or ("CommTimeoutError" in zero and "peer 1" in zero) or \
        ("CommError" in zero and "rank 1's process" in zero and "died" in zero), zero


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.fault
def test_native_combine_reports_an_own_slot_index_outside_x(tmp_path):
    """Rank 0's combine leaves row indices past x in its own slots (ELASTIC_EP_TEST_CORRUPT=own_row), as a
    peer writing into its window could: its reduce reports a protocol error and reads nothing past x (the
    index is checked before x is read at it); rank 1 ends by a named timeout, the peer watch, or not at all."""
    zero, one = run_workers(corrupt_worker, 2, "own_row", tmp_path=tmp_path, timeout=150)
    assert zero.startswith("CommError") and "protocol error" in zero and "outside x's" in zero, zero
    assert one == "no error" or ("CommTimeoutError" in one and "peer 0" in one) or \
        ("CommError" in one and "rank 0's process" in one and "died" in one), one
