"""Engram on the torch runtime over gloo: ``engram_fetch`` equals, bitwise, indexing into the table
that a plain ``torch.distributed`` all-gather of every rank's shard builds: bf16 and FP8 tables (float32
and packed-UE8M0 int32 scales, row-major and TMA-aligned column-major), random indices with the edge
ones (0, the last entry, every rank's first and last), no tokens, a table written again with another
size; every refusal is a ``ValueError``, on every rank when it concerns the collective write.
"""
import pytest
import torch
import torch.distributed as dist

from tests._dist import init_gloo, run_workers
from tests.elastic_ep._common import import_elastic_ep, ops_buffer, refusal_checker

ep = import_elastic_ep()

MiB2 = 2 << 20


def _bits(shape, dtype, g):
    """Random bytes as ``dtype`` (NaN bit patterns included: the copies must not touch them)."""
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def _all_shards(shard: torch.Tensor, world: int, group) -> torch.Tensor:
    """The independent reference table: every rank's shard, in rank order."""
    src = shard.reshape(-1).view(torch.uint8)
    out = torch.empty(world * src.numel(), dtype=torch.uint8)
    dist.all_gather_into_tensor(out, src, group=group)
    return out.view(shard.dtype).view(world * shard.shape[0], shard.shape[1])


def _indices(T, E, N, world, g):
    total = N * world
    idx = torch.randint(0, total, (T, E), generator=g, dtype=torch.int32)
    edges = [0, total - 1] + [r * N for r in range(world)] + [r * N + N - 1 for r in range(world)]
    flat = idx.view(-1)
    k = min(len(edges), flat.numel())
    flat[:k] = torch.tensor(edges[:k], dtype=torch.int32)
    return idx


def _check_fetch(buf, table, sf_table, idx, tma: bool):
    T, E = idx.shape
    hook = buf.engram_fetch(idx.to(buf.device), 0, tma)
    assert callable(hook)
    data, sf = hook()
    H = table.shape[1]
    assert data.shape == (T, E * H) and data.dtype == table.dtype
    want = table[idx.long().view(-1)].reshape(T, E * H)
    assert torch.equal(data.view(torch.uint8).cpu(), want.view(torch.uint8)), "engram data differs"
    if sf_table is None:
        assert sf is None
        return
    P = sf_table.shape[1]
    assert sf.shape == (T, E * P) and sf.dtype == sf_table.dtype
    if tma:
        assert sf.stride() == (1, (T + 3) // 4 * 4)
    else:
        assert sf.is_contiguous()
    want_sf = sf_table[idx.long().view(-1)].reshape(T, E * P)
    assert torch.equal(sf.contiguous().view(torch.int32).cpu(), want_sf.view(torch.int32)), "engram scales differ"


def _worker(rank, world, rdzv, backend="torch"):
    """The fetch checks on the torch runtime over gloo, or (backend="native") on the native runtime's
    CUDA-IPC window and host segments (test_agrs_pp_engram_gpu.py); the reference table always over gloo."""
    group, buf = ops_buffer(rank, world, rdzv, backend, num_bytes=MiB2, num_cpu_bytes=MiB2)
    ref_group = group if backend == "torch" else dist.new_group(backend="gloo")
    assert buf.num_cpu_bytes == MiB2
    g = torch.Generator().manual_seed(10 + rank)      # this rank's shard
    shared = torch.Generator().manual_seed(99)        # the same on every rank: indices, scale tables
    n = 0
    # bf16, then FP8 with float32 and int32 scales, then bf16 again with another size
    for N, H, dtype, sf_dtype in ((37, 64, torch.bfloat16, None), (29, 128, torch.float8_e4m3fn, torch.float32),
                                  (16, 256, torch.float8_e4m3fn, torch.int32), (5, 8, torch.bfloat16, None)):
        shard = _bits((N, H), dtype, g)
        sf_table = None if sf_dtype is None else _bits((N * world, H // 64), sf_dtype, shared)
        kept = shard.clone()
        shard = shard.to(buf.device)
        buf.engram_write(shard, None if sf_table is None else sf_table.to(buf.device))
        shard.view(torch.uint8).fill_(0)  # the buffer keeps its own copy
        table = _all_shards(kept, world, ref_group)
        for T, E in ((50, 6), (7, 1), (0, 3), (1, 24)):
            for tma in (False, True):
                _check_fetch(buf, table, sf_table, _indices(T, E, N, world, shared) if T else
                             torch.zeros((0, E), dtype=torch.int32), tma)
                n += 1
    buf.destroy()
    return n


@pytest.mark.parametrize("world", [2, 3])
def test_engram_fetch_matches_indexing_the_gathered_table(tmp_path, world):
    counts = run_workers(_worker, world, tmp_path=tmp_path, timeout=180)
    assert counts == [32] * world


def _refusal_worker(rank, world, rdzv):
    group = init_gloo(rank, world, rdzv)
    seen = []
    bad = refusal_checker(seen)
    bad("num_cpu_bytes: expected a multiple", lambda: ep.ElasticBuffer(group, num_bytes=MiB2, num_cpu_bytes=1000,
                                                                       backend="torch"))
    bad("num_cpu_bytes: expected an int", lambda: ep.ElasticBuffer(group, num_bytes=MiB2, num_cpu_bytes=-MiB2,
                                                                   backend="torch"))
    plain = ep.ElasticBuffer(group, num_bytes=MiB2, backend="torch")
    bad("no CPU (Engram) segment", lambda: plain.engram_write(torch.zeros(4, 8, dtype=torch.bfloat16)))
    buf = ep.ElasticBuffer(group, num_bytes=MiB2, num_cpu_bytes=MiB2, backend="torch")
    idx = torch.zeros((2, 3), dtype=torch.int32)
    bad("call engram_write first", lambda: buf.engram_fetch(idx))
    w = buf.engram_write
    bad("storage: expected dtype", lambda: w(torch.zeros(4, 8)))
    bad("storage: expected a 2-D", lambda: w(torch.zeros(8, dtype=torch.bfloat16)))
    bad("storage: expected a contiguous", lambda: w(torch.zeros(8, 4, dtype=torch.bfloat16).t()))
    bad("storage: expected [num_entries >= 1", lambda: w(torch.zeros(0, 8, dtype=torch.bfloat16)))
    bad("exceed num_cpu_bytes", lambda: w(torch.zeros(1, MiB2 // 2 + 1, dtype=torch.bfloat16)))
    fp8 = torch.zeros(4, 64, dtype=torch.float8_e4m3fn)
    bad("sf: expected the scale factors", lambda: w(fp8))
    bad("sf: expected the scale factors", lambda: w(torch.zeros(4, 8, dtype=torch.bfloat16), torch.ones(4 * world, 1)))
    bad("sf: expected [num_entries x num_ranks", lambda: w(fp8, torch.ones(4, 1)))     # the local rows only
    bad("sf: expected dtype", lambda: w(fp8, torch.ones(4 * world, 1, dtype=torch.float16)))
    # shards of different sizes on the ranks: every rank refuses
    bad("the same shapes and dtypes on every rank", lambda: w(torch.zeros(4 + rank, 8, dtype=torch.bfloat16)))
    bad("call engram_write first", lambda: buf.engram_fetch(idx))  # the refused write installed nothing
    N = 4
    w(torch.arange(N * 8, dtype=torch.bfloat16).view(N, 8) + 100 * rank)
    f = buf.engram_fetch
    bad("indices: expected dtype", lambda: f(idx.long()))
    bad("indices: expected a 2-D", lambda: f(idx.view(-1)))
    bad("indices: expected a contiguous", lambda: f(idx.t()))
    bad("outside [0,", lambda: f(torch.tensor([[0, -1]], dtype=torch.int32)))               # no masking
    bad("outside [0,", lambda: f(torch.tensor([[N * world]], dtype=torch.int32)))
    bad("num_qps", lambda: f(idx, num_qps=buf.num_allocated_qps + 1))
    bad("use_tma_aligned_col_major_sf", lambda: f(idx, 0, 1))
    bad("exceed the buffer's num_bytes", lambda: f(torch.zeros((MiB2 // 16 + 1, 1), dtype=torch.int32)))
    # usable after the refusals: entry N * r + j is rank r's row j
    data, sf = f(torch.tensor([[N * (world - 1) + 1, 0]], dtype=torch.int32))()
    want = torch.cat([torch.arange(8, 16, dtype=torch.bfloat16) + 100 * (world - 1), torch.arange(8, dtype=torch.bfloat16)])
    assert sf is None and torch.equal(data, want.view(1, 16))
    buf.destroy()
    plain.destroy()
    return len(seen)


def test_engram_refusals(tmp_path):
    counts = run_workers(_refusal_worker, 2, tmp_path=tmp_path, timeout=120)
    assert counts == [23, 23]
