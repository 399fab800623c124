"""CPU tests of the custom ops (``ipc_all2all.ops``): dynamo captures a block over them whole, compiled
code makes every collective call in program order on every rank (the order token), and the real op
keeps the promise of its fake implementation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ipc_all2all
from ipc_all2all import _shapes as S, ops
from ipc_all2all._registry import INSTANCES
from tests.ipc_all2all._stand_ins import CountingComm


class _FakeComm:
    """Stands in for a synced All2All on the CPU: W ranks that all hold the same x."""

    def __init__(self, W, n):
        self.world_size, self.rank, self._counts, self.comm_id = W, 0, [n] * W, 10**6 + W
        self.order_token = ipc_all2all.ops.order_token("cpu")

    @property
    def rank_tokens(self):
        return list(self._counts)

    def send_recv_heads(self, x, copy_output=False, fp8_wire=False):
        hpr = x.shape[2] // self.world_size
        return torch.cat([x[:, :, :hpr]] * self.world_size, dim=1)

    def gather_heads(self, y, copy_output=False, fp8_wire=False):
        n = self._counts[0]
        return torch.cat([y[:, r * n:(r + 1) * n] for r in range(self.world_size)], dim=2)

    def allgather(self, x, copy_output=False):
        return torch.cat([x] * self.world_size, dim=1)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_custom_ops_trace_under_fullgraph_compile(backend):
    """The ops' fake implementations and the wrappers' shape logic let dynamo capture a whole
    attention block without a graph break (the GPU suite runs the real thing)."""
    comm = _FakeComm(2, 8)
    INSTANCES[comm.comm_id] = comm

    def block(q, k, v, a):
        qh, kh, vh = ops.send_recv_heads(q, comm), ops.send_recv_heads(k, comm), ops.send_recv_heads(v, comm)
        o = F.scaled_dot_product_attention(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2))
        return ops.gather_heads(o.transpose(1, 2).contiguous(), comm), ops.allgather(a, comm)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 4, 16, generator=g) for _ in range(3))
    a = torch.randn(1, 8, 2, 16, generator=g)
    want = block(q, k, v, a)
    assert want[0].shape == (1, 8, 4, 16) and want[1].shape == (1, 16, 2, 16)
    # the fp8-on-the-wire flag is part of the ops' schema (a constant for dynamo)
    assert "bool fp8_wire=False" in str(torch.ops.ipc_all2all.send_recv_heads.default._schema)
    assert "bool fp8_wire=False" in str(torch.ops.ipc_all2all.gather_heads.default._schema)
    torch._dynamo.reset()
    got = torch.compile(block, fullgraph=True, backend=backend)(q, k, v, a)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])


# ------------------------------------------------------------------ torch.compile keeps every call
_H, _D = 4, 16
_EXPECTED_CALLS = ["send_recv_heads", "allgather", "send_recv_heads", "send_recv_heads", "gather_heads"]


def _attention_block(x, comm, proj):
    q = ops.send_recv_heads(x, comm)
    ops.allgather(x, comm)  # nothing reads it: still a collective the peers wait for
    k = ops.send_recv_heads(x, comm)
    v = ops.send_recv_heads(x, comm)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    o = ops.gather_heads(o.transpose(1, 2).contiguous(), comm)  # [1, 0, H, D] on the empty rank
    return proj(o.flatten(2))


@pytest.mark.parametrize("backend,grad", [("inductor", False), ("inductor", True), ("aot_eager", False)],
                         ids=["inductor", "inductor-grad", "aot_eager"])
def test_compiled_block_makes_the_same_collective_calls_on_a_zero_token_rank(backend, grad):
    """Rank 0 holds no tokens, so its gather_heads output is [1, 0, H, D] and an allgather's output is
    unused on both ranks: compiled with fullgraph=True, both ranks must still make every call, in
    program order (inductor used to delete the empty rank's gather_heads, and the ranks then paired
    mismatched calls)."""
    proj = torch.nn.Linear(_H * _D, _H * _D)
    logs = []
    for rank in (0, 1):
        comm = CountingComm([0, 8], rank)
        INSTANCES[comm.comm_id] = comm
        try:
            torch._dynamo.reset()
            fn = torch.compile(_attention_block, backend=backend, fullgraph=True)
            x = torch.randn(1, comm.rank_tokens[rank], _H, _D)
            with torch.set_grad_enabled(grad):
                out = fn(x, comm, proj)
                out = fn(x, comm, proj)  # the cached graph too
            assert out.shape == (1, comm.rank_tokens[rank], _H * _D)
        finally:
            INSTANCES.pop(comm.comm_id, None)
        logs.append(comm.log)
    assert logs[0] == logs[1] == _EXPECTED_CALLS * 2, logs


def test_ops_declare_the_order_token_mutated():
    for name in ("send_recv_heads", "gather_heads", "allgather"):
        schema = getattr(torch.ops.ipc_all2all, name).default._schema
        assert schema.is_mutable and "Tensor(a1!) token" in str(schema), schema
    # one token per device, shared by every instance there (so calls of different instances keep
    # their order too)
    assert ops.order_token("cpu") is ops.order_token(torch.device("cpu"))
    assert ops.order_token("cpu").numel() == 1


# ------------------------------------------------------------------ the custom ops keep the fake's promise
@pytest.mark.parametrize("name", ["send_recv_heads", "gather_heads", "allgather"])
def test_raw_op_refuses_sizes_that_do_not_describe_its_output(name):
    """The compiled graph sizes its buffers from the fake (out_tokens, world_size); the real op used to
    ignore both and return whatever the instance produced. Now it refuses before any collective call."""
    comm = CountingComm([3, 5], 1)
    INSTANCES[comm.comm_id] = comm
    try:
        x = torch.randn(1, 8 if name == "gather_heads" else 5, 4 if name != "gather_heads" else 2, 16)
        good = {"send_recv_heads": 8, "gather_heads": 5, "allgather": 8}[name]
        op = getattr(torch.ops.ipc_all2all, name)
        tok = ops.order_token("cpu")
        for out_tokens, world in [(good + 1, 2), (good, 4), (0, 2)]:
            with pytest.raises(ValueError, match=f"ops.{name}: out_tokens={out_tokens}, world_size={world} do not match"):
                op(x, tok, comm.comm_id, out_tokens, world)
        assert comm.log == [], "a refused op must not make the collective call"
        out = op(x, tok, comm.comm_id, good, 2)
        assert comm.log == [name]
        fake_shape = ops._fake_shape({"send_recv_heads": S.OP_SEND_RECV_HEADS, "gather_heads": S.OP_GATHER_HEADS,
                                      "allgather": S.OP_ALLGATHER}[name], x, good, 2)
        assert tuple(out.shape) == fake_shape
    finally:
        INSTANCES.pop(comm.comm_id, None)
