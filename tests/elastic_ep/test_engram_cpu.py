"""Engram on the torch runtime over gloo: ``engram_fetch`` equals, bitwise, indexing into the table
that a plain ``torch.distributed`` all-gather of every rank's shard builds: bf16 and FP8 tables (float32
and packed-UE8M0 int32 scales, row-major and TMA-aligned column-major), random indices with the edge
ones (0, the last entry, every rank's first and last), no tokens, a table written again with another
size. The refusals are in ``test_args_engram_cpu.py``.
"""
import pytest
import torch
import torch.distributed as dist

from tests._dist import run_workers
from tests.elastic_ep._common import ops_buffer

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
