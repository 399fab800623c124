"""The NVLink-emulated scale-out transport (csrc/scaleout/nvlink_emulated.cuh) on the native runtime's
CUDA-IPC window (ranks may share one GPU), through its probe kernel (kernels/scaleout_probe.cuh).

* Rings over the rail peers of logical 2x2 and 4x1 layouts (rank r puts to the rank with the same
  scale-up index in the next scale-out domain): several rounds of random bytes with put_signal, each
  rank's destination checked bitwise against what its previous rail peer wrote, the monotonic signals
  counting the rounds.
* A rail peer that never puts: the wait times out naming the probe, the rank and the peer, and CUDA
  stays usable.
"""
import time

import pytest
import torch

from tests._dist import run_workers
from tests.elastic_ep._common import import_elastic_ep, init_ep_group
from tests.elastic_ep._workers import expect_timeout

ep = import_elastic_ep()
from elastic_ep import _C  # noqa: E402

MiB2 = 2 << 20
NBYTES = 256 << 10  # per put
SRC, DST = 0, 1 << 20  # offsets in the buffer


def _probe(buf, nxt, prv, nbytes, rnd):
    ws = int(_C.workspace_bytes())
    params = _C.ScaleoutProbeParams(next=nxt, prev=prv, src=ws + SRC, dst=ws + DST, bytes=nbytes, round=rnd)
    buf.runtime._rt.scaleout_probe(params, torch.cuda.current_stream().cuda_stream)


def _ring_worker(rank, world, rdzv, scaleup):
    group = init_ep_group(rank, world, rdzv, "ipc")
    buf = ep.ElasticBuffer(group, num_bytes=MiB2, backend="native", window="ipc")
    S = world // scaleup
    s, u = rank // scaleup, rank % scaleup
    nxt, prv = ((s + 1) % S) * scaleup + u, ((s - 1) % S) * scaleup + u
    region = buf.runtime._buffer_bytes()
    for rnd in range(1, 5):
        g = torch.Generator().manual_seed(100 * rnd + rank)
        mine = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=g)
        region[SRC:SRC + NBYTES].copy_(mine.cuda())
        torch.cuda.synchronize()
        buf.barrier(with_cpu_sync=True)  # every source written before any put of this round
        _probe(buf, nxt, prv, NBYTES, rnd)
        torch.cuda.synchronize()
        buf.runtime.check_healthy()
        want = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(100 * rnd + prv))
        assert torch.equal(region[DST:DST + NBYTES].cpu(), want), f"rank {rank} round {rnd}: wrong bytes from {prv}"
        buf.barrier(with_cpu_sync=True)  # every destination read before the next round overwrites it
    buf.destroy()
    return rnd


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("world,scaleup", [(2, 1), (4, 2), (4, 1)], ids=["2x1", "2x2", "4x1"])
def test_nvlink_emulated_scaleout_ring(tmp_path, world, scaleup):
    assert run_workers(_ring_worker, world, scaleup, tmp_path=tmp_path, timeout=180) == [4] * world


def _timeout_worker(rank, world, rdzv):
    group = init_ep_group(rank, world, rdzv, "ipc")
    buf = ep.ElasticBuffer(group, num_bytes=MiB2, backend="native", window="ipc", num_cpu_timeout_secs=3,
                           num_gpu_timeout_secs=3, explicitly_destroy=True)
    if rank == 0:
        time.sleep(15)  # never puts
        return "idle"
    return expect_timeout(buf, "scale-out probe", lambda: (_probe(buf, 0, 0, 4096, 1), torch.cuda.synchronize(),
                                                           buf.runtime.check_healthy()), rank=1, peer=0)


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.fault
def test_nvlink_emulated_scaleout_peer_never_puts(tmp_path):
    assert run_workers(_timeout_worker, 2, tmp_path=tmp_path, timeout=60)[1] == "timeout"
