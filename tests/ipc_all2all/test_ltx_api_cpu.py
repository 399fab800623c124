"""ipc_all2all.All2All as a drop-in for LTX's Python ``All2All`` (LTX-2's ``ltx_kernels.All2All``), on
the CPU: the signatures against a table of LTX's, the collective constructor over a gloo group, the
``copy_out`` / ``copy_output`` flag and its refusals, ``buffer_size`` and ``runtime``, the custom ops
under fake and meta tensors (uneven shards), and the methods under ``torch.compile(fullgraph=True)``
dispatching to those ops. The native core is a CPU stand-in (tests/ipc_all2all/_cpu_workers.py); the
GPU suite (test_gpu.py, test_ltx_api_gpu) moves real data.
"""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import ipc_all2all
from ipc_all2all import _shapes as S, ops
from ipc_all2all._registry import INSTANCES
from tests.ipc_all2all import _cpu_workers

BF16 = torch.bfloat16
_CUDA_AVAILABLE = torch.cuda.is_available  # the real one: the stand-ins pretend there is a device
P, KW = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
NO = inspect.Parameter.empty

# LTX's public Python class as its model code calls it: (name, kind, default) after self. The copy flag is
# keyword-only there and positional in LTX's C++ class (``send_recv_heads(x, copy_output)``): ours takes both.
LTX_SIGNATURES = {
    "__init__": [("rank", P, NO), ("world_size", P, NO), ("seqlen", P, NO), ("hidden_dim", P, NO),
                 ("num_sms", P, NO), ("tensor_dtype", P, NO), ("group", P, None), ("timeout_seconds", P, None)],
    "send_recv_heads": [("x", P, NO), ("copy_out", P, False)],
    "gather_heads": [("x", P, NO), ("copy_out", P, False)],
    "allgather": [("x", P, NO), ("copy_out", P, False)],
    "set_rank_tokens": [("rank_num_tokens", P, NO)],
    "set_timeout_seconds": [("seconds", P, NO)],
    "destroy": [],
}
# The methods of LTX's native class, which its Python class keeps as ``runtime``: (name, positional arity).
LTX_RUNTIME = {"get_local_ipc_handle": 0, "sync": 1, "set_rank_tokens": 1, "set_timeout_seconds": 1,
               "send_recv_heads": 2, "gather_heads": 2, "allgather": 2, "destroy": 0}


def _params(fn):
    return [(p.name, p.kind, p.default) for p in list(inspect.signature(fn).parameters.values())[1:]]


@pytest.mark.parametrize("name", sorted(LTX_SIGNATURES))
def test_signature_accepts_every_ltx_call(name):
    """LTX's parameters come first, with LTX's names, kinds and defaults; what this package adds is
    keyword-only with a default, so no call written for LTX's class binds differently here."""
    ours = _params(getattr(ipc_all2all.All2All, name))
    ltx = LTX_SIGNATURES[name]
    assert ours[:len(ltx)] == ltx, f"{name}: ours {ours[:len(ltx)]} != LTX's {ltx}"
    for pname, kind, default in ours[len(ltx):]:
        assert kind == KW and default is not NO, f"{name}: extra parameter {pname} must be keyword-only with a default"


def test_runtime_has_ltx_native_methods():
    from ipc_all2all._ltx import Runtime

    for name, arity in LTX_RUNTIME.items():
        params = _params(getattr(Runtime, name))
        assert len(params) == arity and all(k == P for _, k, _ in params), (name, params)


# ------------------------------------------------------------------ an instance built by the real constructor
@pytest.fixture
def stand_ins():
    undo = _cpu_workers.cpu_stand_ins()
    yield
    undo()


def _synced(cls=ipc_all2all.All2All, rank=1, world=2, seqlen=64, counts=(3, 5), **kw):
    a = cls(rank, world, seqlen, 8 * 32, 16, BF16, **kw)
    a.sync([f"handle of rank {r}".encode() for r in range(world)])
    a.device = torch.device("cpu")  # the stand-in buffer lives on the host
    a.set_rank_tokens(list(counts))
    return a


def test_ltx_attributes_and_runtime(stand_ins):
    a = _synced()
    try:
        assert (a.rank, a.world_size, a.seqlen, a.num_tokens, a.hidden_dim, a.num_sms, a.tensor_dtype) == \
            (1, 2, 64, 64, 256, 16, BF16)
        assert a.buffer_size == 64 * 256 * 2 == a.capacity  # LTX: seqlen * hidden_dim * itemsize
        assert a._core.args == (1, 2, 64 * 256 * 2, 16, ipc_all2all.DEFAULT_TIMEOUT_SECONDS)
        assert not a.collective and a.group is None
        rt = a.runtime
        assert rt.get_local_ipc_handle() == b"handle of rank 1"
        rt.set_rank_tokens([4, 4])
        assert a.rank_tokens == [4, 4]
        rt.set_timeout_seconds(2.5)
        assert a._core.timeout == 2.5
        x = torch.zeros(1, 4, 8, 32, dtype=BF16)
        lo, hi = a._core.buffer_ptr, a._core.buffer_ptr + a._core.buffer_bytes
        view = rt.send_recv_heads(x, False)   # LTX's native order: (x, copy_out)
        fresh = rt.gather_heads(torch.zeros(1, 8, 4, 32, dtype=BF16), True)
        assert view.shape == (1, 8, 4, 32) and lo <= view.data_ptr() < hi
        assert fresh.shape == (1, 4, 8, 32) and not lo <= fresh.data_ptr() < hi
        assert rt.allgather(torch.zeros(1, 4, 1, 8, dtype=BF16), True).shape == (1, 8, 1, 8)
        assert [args[0] for args in a._core.launches] == [S.OP_SEND_RECV_HEADS, S.OP_GATHER_HEADS, S.OP_ALLGATHER]
        rt.destroy()
        assert a.destroyed
    finally:
        a.destroy()


@pytest.mark.parametrize("spelling", ["copy_out", "copy_output"])
def test_copy_flag_both_spellings(stand_ins, spelling):
    a = _synced()
    try:
        lo, hi = a._core.buffer_ptr, a._core.buffer_ptr + a._core.buffer_bytes
        x = torch.zeros(1, 5, 8, 32, dtype=BF16)
        y = a.send_recv_heads(x, **{spelling: False})
        assert lo <= y.data_ptr() < hi, "copy off: a view into the shared buffer"
        z = a.gather_heads(y, **{spelling: True})
        assert not lo <= z.data_ptr() < hi, "copy on: a fresh tensor"
        assert a.allgather(torch.zeros(1, 5, 1, 8, dtype=BF16), **{spelling: True}).data_ptr() not in range(lo, hi)
        assert a._core.calls == 3
    finally:
        a.destroy()


def test_copy_flag_positional_as_ltx_cpp_calls_it(stand_ins):
    """LTX's C++ class takes the flag second, positionally: ``send_recv_heads(x, True)`` (and the same for
    ``gather_heads`` and ``allgather``) copies, ``(x, False)`` returns a view, as the keyword forms do."""
    a = _synced()
    try:
        lo, hi = a._core.buffer_ptr, a._core.buffer_ptr + a._core.buffer_bytes
        x = torch.zeros(1, 5, 8, 32, dtype=BF16)
        view = a.send_recv_heads(x, False)
        assert lo <= view.data_ptr() < hi, "send_recv_heads(x, False): a view into the shared buffer"
        fresh = a.send_recv_heads(x, True)
        assert not lo <= fresh.data_ptr() < hi, "send_recv_heads(x, True): a fresh tensor"
        assert torch.equal(fresh, view)
        assert not lo <= a.gather_heads(fresh, True).data_ptr() < hi
        assert lo <= a.gather_heads(fresh, False).data_ptr() < hi
        t = torch.zeros(1, 5, 1, 8, dtype=BF16)
        assert not lo <= a.allgather(t, True).data_ptr() < hi
        assert lo <= a.allgather(t, False).data_ptr() < hi
        with pytest.raises(ValueError, match="send_recv_heads: pass copy_out .* or copy_output, not both"):
            a.send_recv_heads(x, True, copy_output=True)
        with pytest.raises(ValueError, match="allgather: copy_out must be a bool, got int"):
            a.allgather(t, 1)
        with pytest.raises(TypeError):
            a.gather_heads(fresh, True, False)  # the C++ form has no third positional argument
    finally:
        a.destroy()


def test_copy_flag_refusals(stand_ins):
    a = _synced()
    try:
        x = torch.zeros(1, 5, 8, 32, dtype=BF16)
        for call in (a.send_recv_heads, a.gather_heads, a.allgather):
            name = call.__name__
            with pytest.raises(ValueError, match=f"{name}: pass copy_out .* or copy_output, not both"):
                call(x, copy_out=True, copy_output=True)
            with pytest.raises(ValueError, match=f"{name}: pass copy_out"):
                call(x, copy_out=True, copy_output=False)
            with pytest.raises(ValueError, match=f"{name}: copy_out must be a bool, got int"):
                call(x, copy_out=1)
            with pytest.raises(ValueError, match=f"{name}: copy_output must be a bool, got str"):
                call(x, copy_output="yes")
            with pytest.raises(TypeError):
                call(x, False, False)  # the flag is the only positional argument after x (LTX's C++ form)
        assert a._core.calls == 0, "a refused call must not launch"
    finally:
        a.destroy()


def test_group_refusals_before_any_collective(stand_ins):
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("this process has a default process group")
    with pytest.raises(ValueError, match=r"group needs torch.distributed to be initialised"):
        ipc_all2all.All2All(0, 2, 64, 256, 16, BF16, group=object())
    # a number where the group goes is ipc_all2all 0.1.0's positional timeout_seconds
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = ipc_all2all.All2All(0, 2, 64, 256, 16, BF16, 4.0)
    try:
        assert a._core.args[4] == 4.0 and not a.collective
        assert any(issubclass(w.category, DeprecationWarning) and "seventh argument" in str(w.message)
                   for w in caught)
    finally:
        a.destroy()
    with pytest.raises(ValueError, match="group must be a torch.distributed.ProcessGroup"):
        ipc_all2all.All2All(0, 2, 64, 256, 16, BF16, 4.0, timeout_seconds=3)
    b = ipc_all2all.All2All(0, 2, 64, 256, None, BF16)  # num_sms None: the device's SM count
    assert b.num_sms == 132
    b.destroy()


@pytest.mark.fault
def test_ltx_constructor_with_a_group_is_collective(tmp_path):
    """Two gloo processes, each with the CPU stand-in core (tests/ipc_all2all/_cpu_workers.py)."""
    from tests._dist import run_workers

    res = run_workers(_cpu_workers.worker_ltx_constructor_with_group, 2, tmp_path=tmp_path, timeout=120)
    for rank, r in enumerate(res):
        assert r["handles"] == [b"handle of rank 0", b"handle of rank 1"], r
        assert r["core_args"] == (rank, 2, 16 * 256 * 2, 8, 3.0), r
        assert r["watched"] == (2, True, 200), r  # every rank's process id went to the peer watch
        assert r["collective"] and r["group_is"] and r["buffer_size"] == 16 * 256 * 2, r
        # destroy() is collective: the core waits for every peer's arrival, within destroy()'s deadline
        assert r["runtime"] == "Runtime" and r["destroy_args"] == [(True, 30.0, True)], r
        name, msg = r["mismatch"]
        # rank 1's own arguments were wrong: its ValueError; rank 0 learns of it and raises CommError
        assert name == ("ValueError" if rank == 1 else "CommError"), r
        assert "rank=0, world_size=2 do not match the group (this process is rank 1 of 2)" in msg, r
        if rank == 0:
            assert msg.startswith("All2All(group=...) failed on rank 1: ValueError"), msg
        assert "every rank must pass the same num_tokens * hidden_dim and tensor_dtype" in r["sizes"], r
        assert r["sizes_released"], r
        timeout, collective, warned = r["legacy"]
        assert timeout == 2.5 and not collective and any("seventh argument" in w for w in warned), r


# ------------------------------------------------------------------ the custom ops under fake and meta tensors
@pytest.mark.parametrize("counts,rank", [([3, 5], 1), ([0, 8], 0), ([7, 2, 0, 5], 2)], ids=["3+5", "0+8", "W4"])
def test_ops_fake_and_meta_shapes_uneven(counts, rank):
    """The fakes return what the real ops return for uneven shards (the wrappers pass the token count
    that the instance's counts give), under FakeTensorMode and on the meta device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    W, H, D, b = len(counts), 8, 32, 2
    T, n, hpr = sum(counts), counts[rank], H // W
    cases = [(torch.ops.ipc_all2all.send_recv_heads, (b, n, H, D), T, (b, T, hpr, D)),
             (torch.ops.ipc_all2all.gather_heads, (b, T, hpr, D), n, (b, n, H, D)),
             (torch.ops.ipc_all2all.allgather, (b, n, 2, D), T, (b, T, 2, D))]
    for op, shape, out_tokens, want in cases:
        meta = op(torch.empty(shape, dtype=BF16, device="meta"), torch.empty(1, dtype=torch.int32, device="meta"),
                  12345, out_tokens, W)
        assert meta.shape == want and meta.device.type == "meta" and meta.dtype == BF16
        with FakeTensorMode():
            fake = op(torch.empty(shape, dtype=BF16), torch.empty(1, dtype=torch.int32), 12345, out_tokens, W)
        assert tuple(fake.shape) == want
    with pytest.raises(ValueError, match="world_size must be >= 1 and out_tokens >= 0"):
        torch.ops.ipc_all2all.send_recv_heads(torch.empty(1, 3, 8, 32, device="meta"),
                                              torch.empty(1, device="meta"), 1, -1, 2)


# ------------------------------------------------------------------ the methods under torch.compile
def _peer(tag, shape):
    """A peer's tensor in the simulated world (a fixed function of the peer and the shape)."""
    g = torch.Generator().manual_seed(1000 * tag + sum(shape))
    return torch.randn(shape, generator=g).to(BF16)


class _SimWorld(ipc_all2all.All2All):
    """Rank ``rank`` of a world whose peers' tensors are :func:`_peer`'s: the eager path (``_run``)
    computes what the collective would deliver, from plain slicing; every call is logged."""

    def _run(self, op, x, copy_output, fp8_wire=False):
        self.log.append(S.OP_NAMES[op])
        W, r, counts = self.world_size, self.rank, self._counts
        b, _, h, d = x.shape
        if op == S.OP_GATHER_HEADS:
            p0, n = sum(counts[:r]), counts[r]
            ys = [x if g == r else _peer(100 + g, tuple(x.shape)) for g in range(W)]
            return torch.cat([y[:, p0:p0 + n] for y in ys], dim=2)
        xs = [x if s == r else _peer(s, (b, counts[s], h, d)) for s in range(W)]
        if op == S.OP_ALLGATHER:
            return torch.cat(xs, dim=1)
        hpr = h // W
        return torch.cat([t[:, :, r * hpr:(r + 1) * hpr] for t in xs], dim=1)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("counts,rank", [([3, 5], 1), ([0, 8], 0), ([6, 6], 0)], ids=["3+5", "0+8", "even"])
def test_methods_compile_fullgraph_to_the_custom_ops(stand_ins, monkeypatch, backend, counts, rank):
    """An LTX-style attention block written with the methods (``a2a.send_recv_heads(q)``, ...) compiles
    with fullgraph=True; the graph holds the package's custom ops, one per call, none dropped (also the
    gather of a rank with no tokens, whose output nothing reads); compiled results equal eager ones."""
    import torch.nn.functional as F

    a = _synced(_SimWorld, rank=rank, counts=counts)
    a.log = []
    monkeypatch.setattr(torch.cuda, "is_available", _CUDA_AVAILABLE)  # built: the compiler must see the truth
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.registry.lookup_backend(backend)(gm, example_inputs)

    def block(q, k, v, t):
        qh, kh = a.send_recv_heads(q), a.send_recv_heads(k, copy_out=True)
        vh = a.send_recv_heads(v, copy_output=False)
        o = F.scaled_dot_product_attention(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2))
        return a.gather_heads(o.transpose(1, 2).contiguous()), a.allgather(t, copy_out=True)

    try:
        n = counts[rank]
        g = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(1, n, 8, 32, generator=g).to(BF16) for _ in range(3))
        t = torch.randn(1, n, 2, 16, generator=g).to(BF16)
        want = block(q, k, v, t)
        assert a.log == ["send_recv_heads"] * 3 + ["gather_heads", "allgather"]
        assert want[0].shape == (1, n, 8, 32) and want[1].shape == (1, sum(counts), 2, 16)
        torch._dynamo.reset()
        a.log = []
        got = torch.compile(block, fullgraph=True, backend=recording)(q, k, v, t)
        assert a.log == ["send_recv_heads"] * 3 + ["gather_heads", "allgather"], a.log
        (gm,) = graphs
        code = gm.code
        assert code.count("ipc_all2all.send_recv_heads") == 3, code
        assert code.count("ipc_all2all.gather_heads") == 1 and code.count("ipc_all2all.allgather") == 1, code
        torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
        assert torch.equal(got[1], want[1])
        # the communication alone is exact under compile
        torch._dynamo.reset()
        a.log = []
        f = torch.compile(lambda x: a.gather_heads(a.send_recv_heads(x) * 1), fullgraph=True, backend=backend)
        eager = a.gather_heads(a.send_recv_heads(q) * 1)
        assert torch.equal(f(q), eager) and len(a.log) == 4
    finally:
        torch._dynamo.reset()
        a.destroy()


def test_ops_pass_opcheck(stand_ins, monkeypatch):
    """torch.library.opcheck: schema (the declared token mutation), fake tensor and dispatch checks of the
    three ops, with uneven shards."""
    a = _synced(_SimWorld, rank=1, counts=[3, 5])
    a.log = []
    monkeypatch.setattr(torch.cuda, "is_available", _CUDA_AVAILABLE)
    try:
        x = torch.randn(1, 5, 8, 32).to(BF16)
        torch.library.opcheck(torch.ops.ipc_all2all.send_recv_heads.default, (x, a.order_token, a.comm_id, 8, 2))
        y = torch.randn(1, 8, 4, 32).to(BF16)
        torch.library.opcheck(torch.ops.ipc_all2all.gather_heads.default, (y, a.order_token, a.comm_id, 5, 2))
        t = torch.randn(1, 5, 2, 16).to(BF16)
        torch.library.opcheck(torch.ops.ipc_all2all.allgather.default, (t, a.order_token, a.comm_id, 8, 2))
        assert a.comm_id in INSTANCES and ops.order_token("cpu") is a.order_token
    finally:
        a.destroy()
