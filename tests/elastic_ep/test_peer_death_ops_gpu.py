"""A rank's process dies (SIGKILL) while its peer waits for it in an AGRS gather, a PP transfer or a
low-latency call (native runtime, ranks sharing one GPU on the CUDA-IPC window); dispatch and combine
are in test_peer_death_gpu.py, whose helpers and reasoning this module shares.

Each survivor first queues the operation that waits on the GPU for the dead rank and synchronises the
device: that returns only once the peer watch (commkit::PeerWatch, every 200 ms) found rank 1's process
gone and ended the wait through the timeout record, long before the 60 s deadlines. Its next call of the
same kind raises CommError naming itself, the dead rank and its pid, within 5 s of the death; its CUDA
context stays usable; destroy() returns at once. The waits:

* agrs_gather: rank 1 dies in an AGRS session after its first gather; the survivor's second gather waits
  for rank 1's data (the gather-done kernel, kOpAllGather).
* agrs_session_end: rank 1 dies with the session open; the survivor's destroy_agrs_session waits for
  rank 1 to end it (kOpAgrsSession).
* pp_recv: rank 1 sends one tensor (received, checked) and dies; the survivor's next pp_recv waits for a
  tensor rank 1 never sends (kOpPpRecv).
* pp_send: rank 1 never receives; the survivor's third pp_send with 2 tensors in flight waits for a
  free slot at rank 1 (kOpPpSend).
* ll_dispatch / ll_combine: after a whole low-latency round on both ranks (checked bitwise), rank 1
  dies before its next dispatch (the survivor's receive waits for rank 1's token counts,
  kOpLowLatencyDispatch), or after it (the survivor's combine waits for rank 1's rows and done signal,
  kOpLowLatencyCombine). Not in shrink mode: there a late rank is masked at the deadline instead.

Nothing of ours is left in /dev/shm (see test_peer_death_gpu.py): the ElasticBuffers of the AGRS / PP
cases have 2 MiB Engram segments, whose names every constructor unlinked; low-latency mode's Buffer has
none (its window is CUDA IPC memory, its host workspace cudaHostAlloc'd), so there the check is that
the path creates no named segment.
"""
from __future__ import annotations

import time

import pytest
import torch

from tests._dist import run_workers
from tests.elastic_ep._common import no_shm_leftovers
from tests.elastic_ep.test_peer_death_gpu import (DEADLINE_S, MiB2, destroy_at_once, die, process_ids,
                                                  survivor_raises)


# ------------------------------------------------------------------------------------------- AGRS / PP
def ops_worker(rank, world, rdzv, what):
    from tests.elastic_ep._common import import_elastic_ep, ops_buffer

    ep = import_elastic_ep()
    group, buf = ops_buffer(rank, world, rdzv, "native", num_bytes=MiB2, num_cpu_bytes=MiB2, explicitly_destroy=True,
                            num_cpu_timeout_secs=DEADLINE_S, num_gpu_timeout_secs=DEADLINE_S)
    pids = process_ids(group)
    x = torch.full((256,), float(rank + 1), device="cuda")
    if what.startswith("agrs"):
        buf.agrs_set_config(1 << 16, 4)
        buf.create_agrs_session()
        gathered, wait = buf.all_gather(x)  # a gather of both ranks: the session is under way
        wait()
        assert gathered[:, 0].tolist() == [1.0, 2.0], gathered[:, 0]
        if rank == 1:
            die()  # with the session open

        def call():
            if what == "agrs_gather":
                buf.all_gather(x)[1]()
            else:
                buf.destroy_agrs_session()
                buf.create_agrs_session()
            torch.cuda.synchronize()
            buf.all_gather(x)  # raises, if the waits above did not
    else:
        buf.pp_set_config(4096, 2)
        y = torch.empty_like(x)
        if rank == 1:
            if what == "pp_recv":
                buf.pp_send(x, 0)
            die()
        if what == "pp_recv":
            buf.pp_recv(y, 1)
            assert y.tolist() == [2.0] * 256, "the tensor rank 1 sent before it died"

        def call():
            if what == "pp_recv":
                buf.pp_recv(y, 1)
            else:
                for _ in range(3):  # the third waits for a slot rank 1 never frees
                    buf.pp_send(x, 1)
            torch.cuda.synchronize()
            if what == "pp_recv":  # raises, if the waits above did not
                buf.pp_recv(y, 1)
            else:
                buf.pp_send(x, 1)

    res = survivor_raises(ep, 0, 1, pids[1], time.monotonic(), call)
    destroy_at_once(buf)
    return res


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("what", ["agrs_gather", "agrs_session_end", "pp_recv", "pp_send"])
@pytest.mark.fault
def test_agrs_pp_survivor_names_a_dead_rank_at_once(tmp_path, what, record_property):
    with no_shm_leftovers(f"rank 1 killed during {what}"):
        res = run_workers(ops_worker, 2, what, tmp_path=tmp_path, timeout=120, expect_dead={1})
    assert res[0][0] == "noticed"
    record_property("detect_s", res[0][1])


# ------------------------------------------------------------------------------------------- low latency
def ll_worker(rank, world, rdzv, what):
    from tests.elastic_ep._common import import_elastic_ep, init_ep_group

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, "ipc")
    M, H, E = 8, 512, 8  # tokens per rank, hidden, experts (4 per rank)
    hint = ep.Buffer.get_low_latency_rdma_size_hint(M, H, world, E)
    buf = ep.Buffer(group, 0, hint, low_latency_mode=True, explicitly_destroy=True, backend="native", window="ipc",
                    num_gpu_timeout_secs=DEADLINE_S)
    pids = process_ids(group)
    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randn((M, H), generator=g).to(torch.bfloat16).cuda()
    t = torch.arange(M)
    # Every token on 2 experts of each rank, 4 distinct lanes of weight 1/4: with the received rows as the
    # experts' outputs, combine returns x bitwise (exact sums of powers of two times x).
    idx = torch.stack([t % 4, 4 + t % 4, (t + 1) % 4, 4 + (t + 1) % 4], dim=1).cuda()
    w = torch.full((M, 4), 0.25, device="cuda")

    def dispatch():
        return buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)

    def combine(res):
        return buf.low_latency_combine(res[0], idx, w, res[2])[0]

    out = combine(dispatch())  # a whole round of both ranks
    assert torch.equal(out.cpu(), x.cpu()), "the round before the death combined other rows"
    if rank == 1:
        if what == "ll_combine":
            dispatch()
        die()

    def call():
        res = dispatch()
        if what == "ll_combine":
            combine(res)
        torch.cuda.synchronize()
        if what == "ll_combine":  # raises, if the waits above did not
            combine(res)
        else:
            dispatch()

    res = survivor_raises(ep, 0, 1, pids[1], time.monotonic(), call)
    destroy_at_once(buf)
    return res


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("what", ["ll_dispatch", "ll_combine"])
@pytest.mark.fault
def test_low_latency_survivor_names_a_dead_rank_at_once(tmp_path, what, record_property):
    with no_shm_leftovers(f"rank 1 killed during {what}"):
        res = run_workers(ll_worker, 2, what, tmp_path=tmp_path, timeout=120, expect_dead={1})
    assert res[0][0] == "noticed"
    record_property("detect_s", res[0][1])
