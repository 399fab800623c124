"""PP send/recv: every bad call raises ``ValueError`` naming the problem, and the buffer stays usable
after it: not configured, bad sizes (over the buffer), this rank or no rank as the peer, a tensor over
the configured size, non-contiguous or not a tensor, a bad ``num_sms``; a receive from a peer that never
sends times out naming the operation, the rank and the peer; and ``get_pp_buffer_size_hint``'s bad
arguments. Torch backend over gloo (two spawned ranks).
"""
import pytest
import torch

from tests._dist import init_gloo, run_workers
from tests.elastic_ep._common import import_elastic_ep, refusal_checker

ep = import_elastic_ep()

MiB2 = 2 << 20


@pytest.mark.parametrize("call,name", [
    (lambda: ep.ElasticBuffer.get_pp_buffer_size_hint(None, 2), "num_max_tensor_bytes"),
    (lambda: ep.ElasticBuffer.get_pp_buffer_size_hint(100, 1.5), "num_max_inflight_tensors"),
], ids=["pp-bytes", "pp-inflight"])
def test_pp_size_hint_names_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def _refusal_worker(rank, world, rdzv):
    group = init_gloo(rank, world, rdzv)
    buf = ep.ElasticBuffer(group, num_bytes=MiB2, backend="torch", num_cpu_timeout_secs=2)
    seen = []
    bad = refusal_checker(seen)
    x = torch.zeros(16)
    bad("pp_set_config", lambda: buf.pp_send(x, 1 - rank))
    bad("pp_set_config", lambda: buf.pp_recv(x, 1 - rank))
    bad("num_max_tensor_bytes", lambda: buf.pp_set_config(0, 2))
    bad("num_max_tensor_bytes", lambda: buf.pp_set_config(1.5, 2))
    bad("num_max_inflight_tensors", lambda: buf.pp_set_config(64, 0))
    bad("exceed the buffer", lambda: buf.pp_set_config(MiB2 // 8 + 1, 2))  # 4 x bytes x inflight > num_bytes
    buf.pp_set_config(100, 2)  # 100 -> 128 bytes
    bad("another rank", lambda: buf.pp_send(x, rank))
    bad("src_rank_idx", lambda: buf.pp_recv(x, rank))
    bad("dst_rank_idx", lambda: buf.pp_send(x, world))
    bad("dst_rank_idx", lambda: buf.pp_send(x, -1))
    bad("dst_rank_idx", lambda: buf.pp_send(x, 1.0))
    bad("exceed num_max_tensor_bytes=128", lambda: buf.pp_send(torch.zeros(33), 1 - rank))
    bad("contiguous", lambda: buf.pp_send(torch.zeros(4, 4)[:, 0], 1 - rank))
    bad("expected a tensor", lambda: buf.pp_recv([0.0], 1 - rank))
    bad("num_sms", lambda: buf.pp_send(x, 1 - rank, num_sms=-1))
    # usable after the refusals; 128 bytes, the configured limit, pass
    y = torch.arange(32, dtype=torch.float32) + rank
    buf.pp_send(y, 1 - rank, num_sms=4)
    z = torch.empty(32)
    buf.pp_recv(z, 1 - rank)
    assert torch.equal(z, torch.arange(32, dtype=torch.float32) + 1 - rank)
    buf.barrier()
    # a peer that never sends: rank 1's receive times out naming the op, the rank and the peer
    if rank == 1:
        with pytest.raises(TimeoutError, match=r"pp_recv from peer 0 .*rank 1 of 2"):
            buf.pp_recv(z, 0)
    return len(seen)


@pytest.mark.fault
def test_pp_refusals_and_timeout(tmp_path):
    counts = run_workers(_refusal_worker, 2, tmp_path=tmp_path, timeout=120)
    assert counts == [15, 15]
