"""Bad arguments to ipc_all2all's public API raise ValueError naming the argument, before any CUDA work.

Each case below used to end otherwise: a pybind11 "incompatible constructor arguments" TypeError (a
slot capacity past int64), an OverflowError or a RuntimeError without the argument's name, an
AttributeError / IndexError / KeyError from inside the package, or a silently wrong value (a dict's
keys taken as token counts, a numpy bool as a 1 s timeout, a float shape truncated by ``plan``).
The calls run on the CPU: argument checks that precede the device checks directly, the rest on an
instance whose native core is the recording stand-in of _stand_ins.py.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import ipc_all2all
from ipc_all2all import _C, _shapes, ops
from ipc_all2all._registry import INSTANCES
from tests.ipc_all2all._stand_ins import recording_instance


BF16 = torch.bfloat16


@pytest.fixture
def a2a(monkeypatch):
    """A synced W = 2 instance of rank 1 on the CPU, with a recording core (no GPU)."""
    a, core, _ = recording_instance(monkeypatch, comm_id=987650, order_token=ops.order_token("cpu"))
    core.set_timeout_seconds = lambda s: setattr(core, "timeout", s)
    INSTANCES[a.comm_id] = a
    yield a
    INSTANCES.pop(a.comm_id, None)


# ------------------------------------------------------------------ slot capacity
@pytest.mark.parametrize("num_tokens,hidden_dim,dtype", [
    (2 ** 62, 2, BF16),             # 2^64 bytes: past int64, the core's binding refused it by type only
    (2 ** 40, 2 ** 40, torch.float32),
    (2 ** 62 + 1, 1, torch.int8),   # fits int64, but two slots of it do not fit one allocation
], ids=["2^64", "2^82", "2^62+1"])
def test_capacity_past_one_allocation_is_refused_before_the_device(num_tokens, hidden_dim, dtype):
    with pytest.raises(ValueError, match=r"num_tokens \* hidden_dim \* element size"):
        ipc_all2all.All2All(0, 1, num_tokens, hidden_dim, 8, dtype)
    with pytest.raises(ValueError, match=r"num_tokens \* hidden_dim \* element size"):
        _shapes.capacity_bytes(num_tokens, hidden_dim, dtype)


@pytest.mark.parametrize("capacity", [0, -1, 2 ** 62 + 1, 2 ** 63 - 1])
def test_native_core_refuses_a_capacity_before_touching_cuda(capacity):
    # The core's own check (csrc/core.cpp), which the Python layer calls too: it runs before cudaGetDevice.
    with pytest.raises(ValueError, match="buffer capacity"):
        _C.check_capacity_bytes(capacity)
    with pytest.raises(ValueError, match="buffer capacity"):
        _C.Core(0, 1, capacity, 8, 1.0)


def test_largest_capacity_still_accepted():
    assert _shapes.capacity_bytes(2 ** 61, 1, torch.int8) == 2 ** 61
    _C.check_capacity_bytes(2 ** 62 - 2 ** 20)


# ------------------------------------------------------------------ dtypes and the grid
@pytest.mark.parametrize("name", ["quint8", "qint8", "qint32"])
def test_quantized_dtypes_are_refused(name):
    # Their scale and zero point are not in the bytes that move (and copy_output cannot allocate one).
    dtype = getattr(torch, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantized dtypes
        with pytest.raises(ValueError, match=f"tensor_dtype torch.{name} is a quantized dtype"):
            _shapes.element_size(dtype)
        with pytest.raises(ValueError, match="quantized"):
            ipc_all2all.All2All(0, 2, 10, 4096, 132, dtype)


def test_num_sms_beyond_the_grid_limit_is_an_argument_error():
    # Before the device checks: on a machine without a GPU this used to say "needs a CUDA device".
    with pytest.raises(ValueError, match=r"num_sms \(70000\) is out of range.*65535"):
        ipc_all2all.All2All(0, 2, 10, 4096, 70000, torch.bfloat16)
    with pytest.raises(ValueError, match="num_sms must be an int >= world_size"):
        ipc_all2all.All2All(0, 4, 10, 4096, 3, torch.bfloat16)


# ------------------------------------------------------------------ timeouts
_BAD_TIMEOUTS = [10 ** 400, np.bool_(True), torch.tensor(True), torch.empty((), device="meta")]
_TIMEOUT_IDS = ["10^400", "numpy-bool", "torch-bool", "meta-tensor"]


@pytest.mark.parametrize("seconds", _BAD_TIMEOUTS, ids=_TIMEOUT_IDS)
def test_bad_timeout_is_a_value_error(a2a, seconds):
    with pytest.raises(ValueError, match="timeout_seconds must be a number of seconds"):
        a2a.set_timeout_seconds(seconds)
    with pytest.raises(ValueError, match="timeout_seconds must be a number of seconds"):
        ipc_all2all.All2All(0, 1, 64, 256, 8, BF16, timeout_seconds=seconds)


def test_from_group_checks_the_timeout_before_the_device(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_gather", lambda out, t, group=None: out[0].copy_(t))  # a world of one
    with pytest.raises(ValueError, match="timeout_seconds must be finite"):
        ipc_all2all.All2All.from_group(None, num_tokens=64, hidden_dim=256, tensor_dtype=BF16, timeout_seconds=-1)


# ------------------------------------------------------------------ set_rank_tokens, sync
@pytest.mark.parametrize("counts", [None, 5, {0: 3, 1: 5}, {3, 5}, b"\x03\x05"],
                         ids=["None", "int", "dict", "set", "bytes"])
def test_set_rank_tokens_needs_a_sequence_in_rank_order(a2a, counts):
    with pytest.raises(ValueError, match="rank_tokens must be a list of 2 ints"):
        a2a.set_rank_tokens(counts)
    assert a2a.rank_tokens is None  # nothing was set


def test_set_rank_tokens_still_takes_tuples_and_numpy(a2a):
    a2a.set_rank_tokens((3, 5))
    a2a.set_rank_tokens(np.array([3, 5]))
    assert a2a.rank_tokens == [3, 5]


@pytest.mark.parametrize("handles", [None, 5, b"\x00" * 96, "handles"], ids=["None", "int", "bytes", "str"])
def test_sync_needs_a_list_of_handles(a2a, handles):
    with pytest.raises(ValueError, match="all_gathered_handles must be a list"):
        a2a.sync(handles)


# ------------------------------------------------------------------ plan
@pytest.mark.parametrize("op,shape,itemsize,match", [
    (3, (1, 5, 8, 32), None, "op must be one of"),
    (True, (1, 5, 8, 32), None, "op must be one of"),  # not gather_heads
    (None, (1, 5, 8, 32), None, "op must be one of"),
    (0, None, None, "shape must be a sequence"),
    (0, (1, 5.5, 8, 32), None, "shape must be 4 non-negative ints"),  # was truncated to 5
    (0, (1, 5.0, 8, 32), None, "shape must be 4 non-negative ints"),
    (0, ("1", 5, 8, 32), None, "shape must be 4 non-negative ints"),  # was parsed
    (0, (-1, 5, 8, 32), None, "shape must be 4 non-negative ints"),   # gave negative output bytes
    (0, (1, 5, 8, 32), 0, "itemsize must be one of"),
    (0, (1, 5, 8, 32), 3, "itemsize must be one of"),
    (0, (1, 5, 8, 32), 1.5, "itemsize must be one of"),
    (0, (1, 5, 8, 32), True, "itemsize must be one of"),
])
def test_plan_refuses_what_is_not_a_launch(a2a, op, shape, itemsize, match):
    a2a.set_rank_tokens([3, 5])
    a2a.plan(0, (1, 5, 8, 32))  # cached: a bad call must not find this plan by equality (5.0 == 5, True == 1)
    with pytest.raises(ValueError, match=match):
        a2a.plan(op, shape, itemsize)


# ------------------------------------------------------------------ inputs
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_input_is_refused_by_name(a2a):
    a2a.set_rank_tokens([3, 5])
    x = torch.nested.nested_tensor([torch.zeros(5, 8, 32, dtype=BF16)])
    for call in (a2a.send_recv_heads, a2a.allgather):
        with pytest.raises(ValueError, match="x must be a dense"):
            call(x)
    assert a2a._core.calls == 0


# ------------------------------------------------------------------ compilable ops
@pytest.mark.parametrize("comm", [None, 7, "a2a"], ids=["None", "int", "str"])
@pytest.mark.parametrize("op", ["send_recv_heads", "gather_heads", "allgather"])
def test_ops_need_an_instance(a2a, op, comm):
    a2a.set_rank_tokens([3, 5])
    with pytest.raises(ValueError, match=f"ipc_all2all.ops.{op}: comm must be an ipc_all2all.All2All"):
        getattr(ops, op)(torch.zeros(1, 5, 8, 32, dtype=BF16), comm)


@pytest.mark.parametrize("x,match", [(None, "x must be a torch.Tensor"), (torch.zeros(4, dtype=BF16), "4 dimensions"),
                                     (np.zeros((1, 5, 8, 32)), "x must be a torch.Tensor")],
                         ids=["None", "1-d", "numpy"])
@pytest.mark.parametrize("op", ["send_recv_heads", "gather_heads", "allgather"])
def test_ops_check_x_before_reading_its_shape(a2a, op, x, match):
    # Device counts: the wrapper derives the output length from x.shape[1] before the op runs.
    a2a.set_rank_tokens(torch.tensor([3, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=match):
        getattr(ops, op)(x, a2a)


@pytest.mark.parametrize("shape,out_tokens,world_size,match", [
    ((1, 5, 8, 32), 8, 0, "world_size must be >= 1"),     # was a ZeroDivisionError in send_recv_heads
    ((1, 5, 8, 32), 8, -1, "world_size must be >= 1"),
    ((1, 5, 8, 32), -1, 2, "out_tokens >= 0"),            # was torch's negative-dimension error
    ((5, 8, 32), 8, 2, "x must have 4 dimensions"),       # was "not enough values to unpack"
], ids=["world0", "world-1", "out-1", "3-d"])
@pytest.mark.parametrize("op", ["send_recv_heads", "gather_heads", "allgather"])
def test_fake_implementations_name_bad_raw_op_arguments(op, shape, out_tokens, world_size, match):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(shape, dtype=BF16)
        token = torch.empty(1, dtype=torch.int32)
        with pytest.raises(ValueError, match=match):
            getattr(torch.ops.ipc_all2all, op)(x, token, 1, out_tokens, world_size)
