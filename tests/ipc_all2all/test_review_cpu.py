"""CPU tests of defects found by reviewing ipc_all2all as a user would: inputs that were accepted
and then hung or gave wrong results, fake/real mismatches of the custom ops, resources left to the
garbage collector on error paths, and a destroy() racing a call in another thread (the Python half;
the native half is test_gpu.py::test_destroy_racing_calls_in_another_thread)."""
from __future__ import annotations

import gc
import warnings

import pytest
import torch

import ipc_all2all
from ipc_all2all import _C, _REGISTRY, ops
from ipc_all2all import _shapes as S
from tests.ipc_all2all.test_cpu import _RecordingCore
from tests.ipc_all2all.test_robustness_cpu import _CountingComm, _instance


# ------------------------------------------------------------------ a positive timeout is never "forever"
@pytest.mark.parametrize("seconds", [1e-10, 5e-10, 9.99e-10, 1e-300])
def test_positive_timeout_below_one_nanosecond_is_not_wait_forever(seconds):
    # 0 ns is the kernel's "no deadline": a tiny positive timeout used to truncate to it and hang.
    assert _C.timeout_ns_from_seconds(seconds) == 1
    assert S.check_timeout_seconds(seconds) == seconds


def test_zero_timeout_still_means_wait_forever():
    assert _C.timeout_ns_from_seconds(0.0) == 0
    assert _C.timeout_ns_from_seconds(1e-9) == 1
    assert _C.timeout_ns_from_seconds(2.5) == 2_500_000_000


# ------------------------------------------------------------------ dtypes and layouts refused by name
@pytest.mark.parametrize("name", ["quint8", "qint8", "qint32"])
def test_quantized_dtypes_are_refused(name):
    # Their scale and zero point are not in the bytes that move (and copy_output cannot allocate one).
    dtype = getattr(torch, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantized dtypes
        with pytest.raises(ValueError, match=f"tensor_dtype torch.{name} is a quantized dtype"):
            S.element_size(dtype)
        with pytest.raises(ValueError, match="quantized"):
            ipc_all2all.All2All(0, 2, 10, 4096, 132, dtype)


def test_other_one_two_four_byte_dtypes_stay_accepted():
    for dtype, size in [(torch.uint8, 1), (torch.int16, 2), (torch.uint16, 2), (torch.uint32, 4),
                        (torch.float8_e4m3fn, 1), (torch.float8_e5m2, 1)]:
        assert S.element_size(dtype) == size


@pytest.mark.parametrize("to_sparse", [lambda t: t.to_sparse(), lambda t: t.to_sparse(2)], ids=["coo", "coo-hybrid"])
def test_sparse_input_is_refused_as_not_dense(to_sparse):
    x = to_sparse(torch.zeros(1, 4, 8, 64))
    with pytest.raises(ValueError, match=r"op: x must be a dense \(strided\) tensor, got layout torch.sparse_coo"):
        S.validate_input(x, torch.float32, torch.device("cpu"), "op")


# ------------------------------------------------------------------ constructor argument order
def test_num_sms_beyond_the_grid_limit_is_an_argument_error():
    # Before the device checks: on a machine without a GPU this used to say "needs a CUDA device".
    with pytest.raises(ValueError, match=r"num_sms \(70000\) is out of range.*65535"):
        ipc_all2all.All2All(0, 2, 10, 4096, 70000, torch.bfloat16)
    with pytest.raises(ValueError, match="num_sms must be an int >= world_size"):
        ipc_all2all.All2All(0, 4, 10, 4096, 3, torch.bfloat16)


# ------------------------------------------------------------------ the custom ops keep the fake's promise
@pytest.mark.parametrize("name", ["send_recv_heads", "gather_heads", "allgather"])
def test_raw_op_refuses_sizes_that_do_not_describe_its_output(name):
    """The compiled graph sizes its buffers from the fake (out_tokens, world_size); the real op used to
    ignore both and return whatever the instance produced. Now it refuses before any collective call."""
    comm = _CountingComm([3, 5], 1)
    _REGISTRY[comm.comm_id] = comm
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
        _REGISTRY.pop(comm.comm_id, None)


# ------------------------------------------------------------------ from_group cleans up after a failed exchange
class _StubAll2All(ipc_all2all.All2All):
    """from_group's cls: an instance over a recording core (no GPU)."""

    cores: list = []

    def __init__(self, rank, world_size, num_tokens, hidden_dim, num_sms, tensor_dtype, timeout_seconds=None):
        core = _RecordingCore(4096, torch.zeros(16, dtype=torch.uint8))
        core.ipc_handle = lambda: b"handle"
        _StubAll2All.cores.append(core)
        self.__dict__.update(_core=core, rank=rank, world_size=world_size, capacity=4096, comm_id=-77,
                             device=torch.device("cpu"), _buf=None, _keeper=None, _group=None, _collective=False,
                             _counts=None, _counts_dev=None, _captured_counts={}, _plans={})
        _REGISTRY[self.comm_id] = self


@pytest.mark.parametrize("exc", [RuntimeError("peer 1 died"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_from_group_releases_the_instance_when_the_exchange_fails(monkeypatch, exc):
    import torch.distributed as dist

    def failing_exchange(out, obj, group=None):
        raise exc

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", failing_exchange)
    _StubAll2All.cores = []
    with pytest.raises(type(exc)):
        _StubAll2All.from_group(num_tokens=16, hidden_dim=128, tensor_dtype=torch.bfloat16, num_sms=8)
    (core,) = _StubAll2All.cores
    assert core.destroyed and core.released, "the buffer was left to the garbage collector"
    assert -77 not in _REGISTRY


# ------------------------------------------------------------------ destroy() from another thread mid-call
def test_a_call_survives_destroy_between_its_launch_and_its_output(monkeypatch):
    """destroy() in another thread may run between a call's launch and the view it returns (the GIL
    can switch there). The call used to read self._buf again and fail with a TypeError on None; it
    now keeps its own reference, so the output is made and the buffer is freed after it."""
    a, core = _instance(monkeypatch)
    launch = core.launch

    def launch_then_destroy(*args):
        slot = launch(*args)
        a.destroy()  # what the other thread does at this point
        return slot

    core.launch = launch_then_destroy
    y = a.send_recv_heads(torch.zeros(1, 5, 8, 32, dtype=torch.bfloat16))
    assert y.shape == (1, 8, 4, 32)
    assert core.destroyed and not core.released, "freed under the call's output"
    del y
    gc.collect()
    assert core.released
    core.launch = launch
    with pytest.raises(ipc_all2all.CommError, match="destroyed"):
        a.send_recv_heads(torch.zeros(1, 5, 8, 32, dtype=torch.bfloat16))


# ------------------------------------------------------------------ counts tensors read by captured graphs
def test_a_captured_counts_tensor_outlives_set_rank_tokens(monkeypatch):
    """A graph captured with device counts reads that tensor by address at every replay: replacing it
    with set_rank_tokens(other) must not let it be freed. An eager call keeps no extra reference."""
    import types
    import weakref

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=7))
    cap = 1000 * 256 * 2
    buf = torch.zeros(_C.buffer_layout(cap)["total"], dtype=torch.uint8)
    core = _RecordingCore(cap, buf)
    a = ipc_all2all.All2All.__new__(ipc_all2all.All2All)
    a.__dict__.update(_plans={}, rank=1, world_size=2, tensor_dtype=torch.bfloat16, itemsize=2,
                      device=torch.device("cpu"), capacity=cap, _core=core, _counts=None, _counts_dev=None,
                      _captured_counts={}, _group=None, _collective=False, comm_id=-1, _buf=buf, _keeper=None)
    x = torch.zeros(1, 5, 8, 32, dtype=torch.bfloat16)

    eager = torch.tensor([3, 5], dtype=torch.int32)
    a.set_rank_tokens(eager)
    a.send_recv_heads(x, copy_output=True)
    assert core.launches[-1][10] == eager.data_ptr()
    gone = weakref.ref(eager)
    a.set_rank_tokens(torch.tensor([5, 5], dtype=torch.int32))
    del eager
    assert gone() is None, "an eager call must not keep the counts tensor"

    captured = torch.tensor([2, 4], dtype=torch.int32)
    a.set_rank_tokens(captured)
    core.capture = 9
    a.send_recv_heads(x, copy_output=True)
    core.capture = 0
    kept = weakref.ref(captured)
    a.set_rank_tokens(torch.tensor([1, 1], dtype=torch.int32))
    del captured
    assert kept() is not None, "a replay would read a freed counts tensor"
    assert core.launches[-1][10] == kept().data_ptr()
