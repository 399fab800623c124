"""AGRS (all-gather sessions): every bad call raises ``ValueError`` naming the problem, and the buffer
stays usable after it: not configured, outside or inside a session, the session's bytes or gathers
exhausted, bad tensors, shapes and dtypes, an in-place tensor gathered out of order, a wait after its
session ended; and the size hints' bad arguments (``get_agrs_num_max_session_bytes``,
``get_agrs_buffer_size_hint``). Torch backend over gloo (two spawned ranks).
"""
import pytest
import torch

from tests._dist import init_gloo, run_workers
from tests.elastic_ep._common import import_elastic_ep, refusal_checker

ep = import_elastic_ep()

MiB2 = 2 << 20


@pytest.mark.parametrize("call,name", [
    (lambda: ep.ElasticBuffer.get_agrs_buffer_size_hint(None, 1.5), "num_max_session_bytes"),
    (lambda: ep.ElasticBuffer.get_agrs_num_max_session_bytes(None, (), torch.bfloat16), "shapes"),  # IndexError
    (lambda: ep.ElasticBuffer.get_agrs_num_max_session_bytes(None, None, torch.bfloat16), "shapes"),
    (lambda: ep.ElasticBuffer.get_agrs_num_max_session_bytes(None, (2, 1.5), torch.bfloat16), r"shapes\[0\]"),
    (lambda: ep.ElasticBuffer.get_agrs_num_max_session_bytes(None, [(2, 3), 5], torch.bfloat16), r"shapes\[1\]"),
    (lambda: ep.ElasticBuffer.get_agrs_num_max_session_bytes(None, (2, 3), None), "dtype"),
], ids=["agrs-hint", "agrs-empty", "agrs-None", "agrs-float-dim", "agrs-mixed", "agrs-dtype"])
def test_agrs_size_hints_name_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def _refusal_worker(rank, world, rdzv):
    group = init_gloo(rank, world, rdzv)
    buf = ep.ElasticBuffer(group, num_bytes=MiB2, backend="torch")
    seen = []
    bad = refusal_checker(seen)
    x = torch.arange(10, dtype=torch.float32)
    bad("agrs_set_config", lambda: buf.all_gather(x))             # not configured
    bad("agrs_set_config", lambda: buf.agrs_get_inplace_tensor((2,), torch.int32))
    bad("num_max_session_bytes", lambda: buf.agrs_set_config(0, 4))
    bad("num_max_session_bytes", lambda: buf.agrs_set_config(MiB2 + 1, 4))   # over the buffer
    bad("num_max_session_bytes", lambda: buf.agrs_set_config(1.5, 4))
    bad("num_max_all_gathers_per_session", lambda: buf.agrs_set_config(1024, 0))
    bad("num_max_all_gathers_per_session", lambda: buf.agrs_set_config(1024, 33))  # DeepEP's limit: 32
    buf.agrs_set_config(1000, 3)  # rounded up to 1024 bytes
    bad("outside an AGRS session", lambda: buf.all_gather(x))
    bad("outside an AGRS session", lambda: buf.agrs_get_inplace_tensor((2,), torch.int32))
    bad("not inside an AGRS session", buf.destroy_agrs_session)
    with buf.agrs_new_session():
        bad("already inside", buf.create_agrs_session)
        bad("inside an AGRS session", lambda: buf.agrs_set_config(1024, 3))
        bad("non-empty sequence", lambda: buf.all_gather([]))
        bad("expected a tensor", lambda: buf.all_gather("x"))
        bad("t[1]: expected a tensor", lambda: buf.all_gather([x, None]))
        bad("contiguous", lambda: buf.all_gather(torch.zeros(4, 4)[:, 1]))
        bad("num_max_session_bytes", lambda: buf.all_gather(torch.zeros(1024 // world + 1, dtype=torch.uint8)))
        bad("num_max_session_bytes", lambda: buf.agrs_get_inplace_tensor([(200,), (200,)], torch.int32))
        bad("shapes", lambda: buf.agrs_get_inplace_tensor((2, 1.5), torch.int32))
        bad("dtype", lambda: buf.agrs_get_inplace_tensor((2,), "float"))
        # an in-place tensor gathered out of order: it is not this rank's part of that gather
        v = buf.agrs_get_inplace_tensor((4,), torch.float32)
        g0, w0 = buf.all_gather(torch.ones(3))          # takes the bytes the in-place tensor pointed at
        bad("this rank's part", lambda: buf.all_gather(v))
        w0()
        assert torch.equal(g0, torch.ones(world, 3))
        g1, g2, w1 = buf.all_gather([x, torch.full((2, 2), rank, dtype=torch.int64)])
        w1()
        assert torch.equal(g1, x.expand(world, 10)) and torch.equal(g2[:, 0, 0], torch.arange(world))
        g3, w3 = buf.all_gather(torch.tensor(rank, dtype=torch.int8))  # a 0-dim tensor: [R]
        w3()
        assert torch.equal(g3, torch.arange(world, dtype=torch.int8))
        bad("num_max_all_gathers_per_session", lambda: buf.all_gather(x))  # the 3 gathers are used
        bad("num_max_all_gathers_per_session", lambda: buf.agrs_get_inplace_tensor((1,), torch.int8))
    bad("session has ended", w1)
    # usable after every refusal: a session with an in-place gather
    with buf.agrs_new_session(enabled=True):
        v = buf.agrs_get_inplace_tensor(torch.Size([5]), torch.bfloat16)
        assert isinstance(v, torch.Tensor)
        v.fill_(rank + 1)
        g, w = buf.all_gather(v)
        w()
        assert torch.equal(g, torch.arange(1, world + 1, dtype=torch.bfloat16).view(world, 1).expand(world, 5))
    with buf.agrs_new_session(enabled=False):  # a no-op, as DeepEP's
        bad("outside an AGRS session", lambda: buf.all_gather(x))
    buf.destroy()
    return len(seen)


def test_agrs_refusals(tmp_path):
    counts = run_workers(_refusal_worker, 2, tmp_path=tmp_path, timeout=120)
    assert counts[0] == counts[1] == 25
