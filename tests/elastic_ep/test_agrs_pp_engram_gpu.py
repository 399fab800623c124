"""AGRS, PP send/recv and Engram on the native runtime, over the CUDA-IPC window (ranks may share one GPU),
checked bitwise against plain references:

* PP: the ring and all-pairs patterns of test_pp_cpu.py (several tensors in flight per peer, random
  sizes and dtypes, the sender overwriting its tensor right after ``pp_send``) at 2 and 4 ranks; a
  CUDA graph of a send and a receive replayed with new data; a receive from a peer that never sends
  times out naming ``pp_recv``, the rank and the peer, with CUDA still usable.
* AGRS: the random sessions of test_agrs_cpu.py (>= 100 gathers of mixed dtypes and shapes, in place
  or not, waited at once or at the session's end) against an all-gather over the test's group, at
  2 and 4 ranks; a CUDA graph of a whole session replayed with new data; a peer that never gathers
  makes ``all_gather`` time out naming the rank and the peer.
* AGRS and PP at sizes from 1 B to 64 MiB (log-uniform, both ends included), mixed dtypes.
* Engram: the fetches of test_engram_cpu.py (bf16 and FP8 tables with float32 / UE8M0 scales, random
  and edge indices, no tokens, column-major scales, a table written again with another size) against
  indexing the table a gloo all-gather of the shards builds, at 2 and 3 ranks, reading every rank's
  pinned host segment.
"""
import time

import pytest
import torch

from tests._dist import run_workers
from tests.elastic_ep import test_agrs_cpu, test_engram_cpu, test_pp_cpu
from tests.elastic_ep._common import import_elastic_ep, init_ep_group
from tests.elastic_ep._workers import expect_timeout

ep = import_elastic_ep()
MiB2 = 2 << 20


def _buffer(rank, world, rdzv, **kw):
    group = init_ep_group(rank, world, rdzv, "ipc")
    return ep.ElasticBuffer(group, num_bytes=MiB2, backend="native", window="ipc", **kw)


# --------------------------------------------------------------------------------------------- PP
@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("pattern", ["ring", "all_pairs"])
def test_pp_native_patterns_bitwise(tmp_path, pattern, world):
    counts = run_workers(test_pp_cpu._worker, world, pattern, "native", tmp_path=tmp_path, timeout=240)
    expect = 25 if pattern == "ring" else 4 * test_pp_cpu.INFLIGHT * (world - 1)
    assert counts == [expect] * world


def _pp_graph_worker(rank, world, rdzv):
    buf = _buffer(rank, world, rdzv)
    buf.pp_set_config(1 << 16, 2)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    x = torch.empty(8192, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        x.fill_(0.0)
        buf.pp_send(x, nxt)  # warm-up outside the graph (the slot counts advance on the device)
        buf.pp_recv(y, prv)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=side):
            buf.pp_send(x, nxt)
            buf.pp_recv(y, prv)
    for it in range(5):
        x.copy_(torch.arange(8192, dtype=torch.float32, device="cuda") + 1000 * rank + it)
        g.replay()
        torch.cuda.synchronize()
        want = torch.arange(8192, dtype=torch.float32) + 1000 * prv + it
        assert torch.equal(y.cpu(), want), f"replay {it}: wrong tensor from rank {prv}"
    buf.barrier(with_cpu_sync=True)
    buf.destroy()
    return 5


@pytest.mark.multigpu(2, shared_ok=True)
def test_pp_native_cuda_graph(tmp_path):
    assert run_workers(_pp_graph_worker, 2, tmp_path=tmp_path, timeout=120) == [5, 5]


def _pp_timeout_worker(rank, world, rdzv):
    buf = _buffer(rank, world, rdzv, num_cpu_timeout_secs=3, num_gpu_timeout_secs=3, explicitly_destroy=True)
    buf.pp_set_config(4096, 2)
    if rank == 0:
        time.sleep(15)  # never sends
        return "idle"
    y = torch.empty(256, device="cuda")
    return expect_timeout(buf, "pp_recv", lambda: (buf.pp_recv(y, 0), torch.cuda.synchronize(), buf.pp_recv(y, 0)),
                           rank=1, peer=0)


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.fault
def test_pp_native_timeout_names_rank_and_peer(tmp_path):
    assert run_workers(_pp_timeout_worker, 2, tmp_path=tmp_path, timeout=60)[1] == "timeout"


# ------------------------------------------------------------------------------------------- AGRS
@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("world", [2, 4])
def test_agrs_native_random_sessions(tmp_path, world):
    res = run_workers(test_agrs_cpu._stress_worker, world, 7 + world, "native", tmp_path=tmp_path, timeout=300)
    assert len(set(res)) == 1
    num_gathers, num_sessions, num_inplace, num_deferred = res[0]
    assert num_gathers >= 100 and num_sessions >= 20 and num_inplace >= 10 and num_deferred >= 10, res[0]


def _agrs_graph_worker(rank, world, rdzv):
    buf = _buffer(rank, world, rdzv)
    buf.agrs_set_config(1 << 20, 4)
    x = torch.empty(4096, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(world, 4096, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())

    def session():
        with buf.agrs_new_session():
            gathered, wait = buf.all_gather(x)
            wait()
            out.copy_(gathered)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        x.fill_(0)
        session()  # warm-up outside the graph
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=side):
            session()
    for it in range(4):
        x.copy_((torch.arange(4096, device="cuda") % 251 + 7 * rank + it).to(torch.bfloat16))
        g.replay()
        torch.cuda.synchronize()
        for r in range(world):
            want = (torch.arange(4096) % 251 + 7 * r + it).to(torch.bfloat16)
            assert torch.equal(out[r].cpu(), want), f"replay {it}: rank {r}'s part differs"
    buf.barrier(with_cpu_sync=True)
    buf.destroy()
    return 4


@pytest.mark.multigpu(2, shared_ok=True)
def test_agrs_native_cuda_graph(tmp_path):
    assert run_workers(_agrs_graph_worker, 2, tmp_path=tmp_path, timeout=120) == [4, 4]


def _agrs_timeout_worker(rank, world, rdzv):
    buf = _buffer(rank, world, rdzv, num_cpu_timeout_secs=3, num_gpu_timeout_secs=3, explicitly_destroy=True)
    buf.agrs_set_config(1 << 16, 2)
    if rank == 1:
        time.sleep(15)  # never gathers
        return "idle"
    x = torch.ones(64, device="cuda")

    def gather():
        buf.create_agrs_session()
        _, wait = buf.all_gather(x)
        wait()
        torch.cuda.synchronize()
        buf.all_gather(x)  # the next call raises the recorded timeout

    return expect_timeout(buf, "all_gather", gather, rank=0, peer=1)


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.fault
def test_agrs_native_timeout_names_rank_and_peer(tmp_path):
    assert run_workers(_agrs_timeout_worker, 2, tmp_path=tmp_path, timeout=60)[0] == "timeout"


# ----------------------------------------------------------------------------------------- Engram
@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("world", [2, 3])
def test_engram_native_matches_indexing_the_gathered_table(tmp_path, world):
    counts = run_workers(test_engram_cpu._worker, world, "native", tmp_path=tmp_path, timeout=240)
    assert counts == [32] * world


# ------------------------------------------------------------------------------- large sizes, 1 B-64 MiB
def _log_uniform_bytes(g: torch.Generator, hi: int) -> int:
    """A size in [1, hi] bytes, uniform in log2 (1 B to 64 MiB in equal measure)."""
    return max(1, min(hi, int(2 ** (float(torch.rand(1, generator=g)) * hi.bit_length()))))


def _large_worker(rank, world, rdzv):
    """AGRS gathers and PP ring steps of random sizes from 1 B to 64 MiB (log-uniform, both ends forced),
    random dtypes, checked bitwise: AGRS against an all-gather of the same bytes over the test's group,
    PP against the sender's bytes (regenerated from the shared seed)."""
    from tests.elastic_ep.test_agrs_cpu import _reference

    top = 64 << 20
    group = init_ep_group(rank, world, rdzv, "ipc")
    # AGRS: R x 64 MiB; PP: DeepEP's 4 x 64 MiB x 2 in flight (and the native R x 2 x 64 MiB slots)
    buf = ep.ElasticBuffer(group, num_bytes=max(world, 4) * 2 * top, backend="native", window="ipc")
    plan = torch.Generator().manual_seed(5)   # sizes and dtypes, the same on every rank
    dtypes = [torch.uint8, torch.bfloat16, torch.float32, torch.int64, torch.float8_e4m3fn]
    buf.agrs_set_config(world * top, 2)
    n = 0
    for i in range(12):
        dt = dtypes[i % len(dtypes)]
        size = 1 if i == 0 else top if i == 1 else _log_uniform_bytes(plan, top)
        numel = max(1, size // dt.itemsize)
        data = torch.Generator().manual_seed(1000 * i + rank)
        x = torch.randint(0, 256, (numel * dt.itemsize,), dtype=torch.uint8, generator=data).view(dt).cuda()
        with buf.agrs_new_session():
            gathered, wait = buf.all_gather(x)
            wait()
            got = gathered.reshape(world, -1).view(torch.uint8).cpu()
        assert torch.equal(got, _reference(x, world, group).cpu()), f"all_gather of {numel * dt.itemsize} B differs"
        n += 1
    buf.pp_set_config(top, 2)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for i in range(12):
        size = 1 if i == 0 else top if i == 1 else _log_uniform_bytes(plan, top)

        def tensor(src: int) -> torch.Tensor:
            return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(77 * i + src))

        buf.pp_send(tensor(rank).cuda(), nxt)
        y = torch.empty(size, dtype=torch.uint8, device="cuda")
        buf.pp_recv(y, prv)
        assert torch.equal(y.cpu(), tensor(prv)), f"pp tensor {i} ({size} B) from rank {prv} differs"
        n += 1
    buf.barrier(with_cpu_sync=True)
    buf.destroy()
    return n


@pytest.mark.multigpu(2, shared_ok=True)
def test_agrs_pp_native_sizes_1B_to_64MiB(tmp_path):
    assert run_workers(_large_worker, 2, tmp_path=tmp_path, timeout=300) == [24, 24]


def _pp_reconfigure_worker(rank, world, rdzv):
    """pp_set_config while a tensor was delivered and not received: refused on every rank (the slots would
    move under it); accepted once it was received."""
    buf = _buffer(rank, world, rdzv)
    buf.pp_set_config(4096, 2)
    x = torch.arange(64, dtype=torch.float32, device="cuda")
    if rank == 0:
        buf.pp_send(x, 1)
    with pytest.raises(ValueError, match="not received" if rank == 1 else "rank 1"):
        buf.pp_set_config(8192, 2)
    if rank == 1:
        y = torch.empty_like(x)
        buf.pp_recv(y, 0)
        assert torch.equal(y, x)
    buf.pp_set_config(8192, 2)
    buf.destroy()
    return "ok"


@pytest.mark.multigpu(2, shared_ok=True)
def test_pp_native_reconfigure_refused_while_in_flight(tmp_path):
    assert run_workers(_pp_reconfigure_worker, 2, tmp_path=tmp_path, timeout=120) == ["ok", "ok"]
