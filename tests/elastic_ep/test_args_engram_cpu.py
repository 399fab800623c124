"""Engram: every bad call raises ``ValueError`` naming the problem, on every rank when it concerns the
collective write, and the buffer stays usable after it: the CPU segment (absent, not 2 MiB-aligned,
negative), bad shards and scale tables, shards that differ between ranks, fetching before a write, bad
or out-of-table indices, ``num_qps`` over ``num_allocated_qps``, a fetch over the buffer; and
``get_engram_storage_size_hint``'s bad arguments. Torch backend over gloo (two spawned ranks).
"""
import pytest
import torch

from tests._dist import init_gloo, run_workers
from tests.elastic_ep._common import import_elastic_ep, refusal_checker

ep = import_elastic_ep()

MiB2 = 2 << 20


@pytest.mark.parametrize("call,name", [
    (lambda: ep.ElasticBuffer.get_engram_storage_size_hint(1.5, 128, 16), "num_entries"),   # returned floats
    (lambda: ep.ElasticBuffer.get_engram_storage_size_hint(10, float("inf"), 16), "hidden"),  # returned nan
    (lambda: ep.ElasticBuffer.get_engram_storage_size_hint(10, 128, -1), "num_max_tokens_per_rank"),
    (lambda: ep.ElasticBuffer.get_engram_storage_size_hint(10, 128, 16, None), "dtype"),    # AttributeError
], ids=["engram-entries", "engram-hidden", "engram-tokens", "engram-dtype"])
def test_engram_size_hint_names_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()


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
