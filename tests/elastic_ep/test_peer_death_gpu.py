"""A rank's process dies (SIGKILL) while its peer waits for it in a dispatch or a combine (native runtime,
ranks sharing one GPU on the CUDA-IPC window); AGRS, PP and low-latency mode are in
test_peer_death_ops_gpu.py, which uses this module's helpers.

The runtime's peer watch (commkit::PeerWatch, every ELASTIC_EP_PEER_WATCH_MS = 200 ms) notices the dead
process and ends the survivor's waits at once through the timeout record, long before the device and
CPU deadlines (60 s here): the survivor raises CommError naming itself, the dead rank and its pid
within 5 s of the death, its CUDA context stays usable (a new tensor op, a device synchronisation), and
destroying its buffer returns at once (a buffer that saw a timeout is released without a device barrier).
The message does not name the operation the survivor waited in: the watch claims the timeout record with
its own operation ("peer watch"), so only the call that raised (the traceback) tells which it was.

Nothing is left in /dev/shm. What the code promises: the window is cudaMalloc'd device memory shared
through CUDA IPC handles and the host workspace is cudaHostAlloc'd pinned memory, neither a named
segment; the only named ones are the Engram host segments (num_cpu_bytes > 0,
/dev/shm/elastic_ep_engram_<hex>), and every rank's buffer constructor unlinks the names once every rank
attached (_engram.open_engram_store), before it returns. So a rank SIGKILLed after its constructor, which
cannot unlink anything, leaves no name; the memory goes with the last process that maps it. The buffers
here get a 2 MiB Engram segment each, so that both ranks' segments exist when rank 1 dies; the parent
process checks that no new entry with one of the packages' prefixes (_common.OUR_SHM_PREFIXES) is in
/dev/shm after the workers ended.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests._dist import run_workers
from tests.elastic_ep._common import no_shm_leftovers

H, K, T = 256, 4, 32
MiB2 = 2 << 20
DEADLINE_S = 60     # device and CPU deadlines: only the peer watch can end the waits this early
DIES_AFTER_S = 1.0  # the doomed rank's pause before it SIGKILLs itself
NOTICE_S = 5.0      # the survivor raises within this of the death


def process_ids(group) -> list:
    """Every rank's pid (collective), for the message's check."""
    import torch.distributed as dist

    pids = [None] * dist.get_world_size(group)
    dist.all_gather_object(pids, os.getpid(), group=group)
    return pids


def die() -> None:
    """The doomed rank: its queued work finished, it pauses ``DIES_AFTER_S`` and SIGKILLs itself."""
    torch.cuda.synchronize()
    time.sleep(DIES_AFTER_S)
    os.kill(os.getpid(), signal.SIGKILL)


def survivor_raises(ep, rank: int, dead: int, pid: int, t0: float, call) -> tuple:
    """``call()`` (operations that wait for the dead rank, then one that raises) must raise CommError naming
    this rank, the dead rank and its pid, less than ``DIES_AFTER_S + NOTICE_S`` after ``t0`` (taken at
    most ``DIES_AFTER_S`` before the death); then the CUDA context must work. Returns ("noticed", seconds
    from ``t0`` to the exception)."""
    try:
        call()
        torch.cuda.synchronize()
        msg = "no error"
    except ep.CommError as e:
        msg = str(e)
    waited = time.monotonic() - t0
    assert f"[rank {rank}]" in msg and f"rank {dead}'s process (pid {pid})" in msg and "died" in msg, msg
    assert waited < DIES_AFTER_S + NOTICE_S, f"the survivor raised {waited:.1f} s after it started waiting"
    total = torch.ones(1024, device="cuda").sum()
    torch.cuda.synchronize()
    assert float(total.item()) == 1024.0  # the context is usable
    return "noticed", waited


def destroy_at_once(buf) -> None:
    t0 = time.monotonic()
    buf.destroy()
    assert time.monotonic() - t0 < NOTICE_S, f"destroy() took {time.monotonic() - t0:.1f} s"


def death_worker(rank, world, rdzv, when):
    from tests.elastic_ep._common import import_elastic_ep, init_ep_group, make_inputs

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, "ipc")
    E = 8 * world
    buf = ep.ElasticBuffer(group, num_cpu_bytes=MiB2, num_max_tokens_per_rank=T, hidden=H, num_topk=K,
                           backend="native", num_cpu_timeout_secs=DEADLINE_S, num_gpu_timeout_secs=DEADLINE_S,
                           explicitly_destroy=True, window="ipc")
    pids = process_ids(group)
    inp = make_inputs(rank, T, H, K, E, "bf16", 7, "cuda")
    if rank == 1:
        if when == "combine":  # dies between a dispatch and the combine its peer waits in
            buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"], num_experts=E)
        die()

    def call():
        recv, _, w, handle, _ = buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"],
                                             num_experts=E, do_cpu_sync=when != "dispatch_nosync")
        if when == "combine":
            buf.combine(recv, handle, topk_weights=w)
        torch.cuda.synchronize()
        buf.barrier()  # raises, if the waits above did not

    res = survivor_raises(ep, 0, 1, pids[1], time.monotonic(), call)
    destroy_at_once(buf)
    return res


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("when", ["dispatch", "dispatch_nosync", "combine"])
@pytest.mark.fault
def test_native_survivor_names_a_dead_rank_at_once(tmp_path, when, record_property):
    with no_shm_leftovers(f"rank 1 killed during {when}"):
        res = run_workers(death_worker, 2, when, tmp_path=tmp_path, timeout=120, expect_dead={1})
    assert res[0][0] == "noticed"
    record_property("detect_s", res[0][1])  # from the start of the wait, at most 1 s before the death
