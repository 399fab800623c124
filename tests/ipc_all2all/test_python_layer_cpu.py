"""CPU tests of the ``All2All`` call path over a recording stand-in for the native core (no GPU): the
geometry each launch gets, views into alternating slots and the aliasing refusals, fp8 on the wire,
releases deferred past a CUDA-graph capture, and the tuning setters' checks before the core."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipc_all2all
from ipc_all2all import _C
from tests.ipc_all2all._stand_ins import recording_instance


def test_python_layer_slots_views_and_aliasing(monkeypatch):
    """_run hands the core the planned geometry, returns views into alternating slots, and refuses an
    input that lies in the slot being written -- checked with a recording stand-in for the core."""
    a, core, buf = recording_instance(monkeypatch)
    lay = _C.buffer_layout(core.cap)
    with pytest.raises(ValueError, match="set_rank_tokens"):
        a.send_recv_heads(torch.zeros(1, 5, 8, 32, dtype=torch.bfloat16))
    a.set_rank_tokens([3, 5])
    assert (a.total_tokens, a.prefix_rank_tokens) == (8, [0, 3])
    x = torch.zeros(1, 5, 8, 32, dtype=torch.bfloat16)
    y = a.send_recv_heads(x)
    assert y.shape == (1, 8, 4, 32) and y.data_ptr() - buf.data_ptr() == lay["slots"][0][0]
    op, x_ptr, stream, batch, x_rows, out_rows, cap_rows, chunk, wide, counts, counts_ptr, pack_d = core.launches[-1]
    assert (op, x_ptr, stream, batch, x_rows, out_rows, cap_rows) == (0, x.data_ptr(), 7, 1, 5, -1, -1)
    assert (chunk, wide, counts, counts_ptr, pack_d) == (4 * 32 * 2, 8 * 32 * 2, [3, 5], 0, 0)
    z = a.gather_heads(y)  # the previous view as input: allowed, it lies in the other slot
    assert z.shape == (1, 5, 8, 32) and z.data_ptr() - buf.data_ptr() == lay["slots"][1][0]
    with pytest.raises(ValueError, match="output slot"):
        a.gather_heads(y)  # y's slot is the one this call would write
    assert core.calls == 2, "a refused call must not launch"
    assert core.recorded == [], "a zero-copy call has no copy to order after"
    c = a.allgather(torch.zeros(1, 5, 1, 8, dtype=torch.bfloat16), copy_output=True)
    assert c.shape == (1, 8, 1, 8) and not (buf.data_ptr() <= c.data_ptr() < buf.data_ptr() + buf.numel())
    # The copy reads the slot: the ordering point moves after it (a next call on another stream waits).
    assert core.recorded == [(3, 7, False)]
    counts_dev = torch.tensor([4, 4], dtype=torch.int32)
    a.device = counts_dev.device
    a.set_rank_tokens(counts_dev)
    y = a.send_recv_heads(torch.zeros(1, 6, 8, 32, dtype=torch.bfloat16))
    assert y.shape == (1, 12, 4, 32)
    assert core.launches[-1][5:7] == (12, 6) and core.launches[-1][10] == counts_dev.data_ptr()


def test_python_layer_fp8_wire_plans_records(monkeypatch):
    """fp8_wire: one push launch that packs x's bf16 head vectors into records of D + 16 bytes with the
    record geometry, then an unpack of the output's vectors into a fresh bf16 tensor; bad arguments
    raise before anything launches (recording stand-in for the core, no GPU)."""
    a, core, buf = recording_instance(monkeypatch)
    cap = core.cap
    conv = []
    core.fp8_unpack = lambda *a: conv.append(("unpack",) + a)
    a.set_rank_tokens([3, 5])
    x = torch.zeros(2, 5, 8, 64, dtype=torch.bfloat16)
    y = a.send_recv_heads(x, fp8_wire=True)
    assert y.shape == (2, 8, 4, 64) and y.dtype == torch.bfloat16
    assert not (buf.data_ptr() <= y.data_ptr() < buf.data_ptr() + buf.numel())  # always a fresh tensor
    (unpack,) = conv
    assert unpack[0] == "unpack" and unpack[2] == y.data_ptr() and unpack[3:] == (2 * 8 * 4, 64, 7)
    assert unpack[1] == buf.data_ptr() + _C.buffer_layout(cap)["slots"][0][0]
    rec = 64 + _C.FP8_RECORD_PAD
    op, x_ptr, stream, batch, x_rows, out_rows, cap_rows, chunk, wide, counts, counts_ptr, pack_d = core.launches[-1]
    assert (op, x_ptr, batch, x_rows, chunk, wide, pack_d) == (0, x.data_ptr(), 2, 5, 4 * rec, 8 * rec, 64)
    z = a.gather_heads(y, fp8_wire=True)
    assert z.shape == (2, 5, 8, 64) and z.dtype == torch.bfloat16
    assert core.launches[-1][0] == 1 and core.launches[-1][7:9] == (4 * rec, 8 * rec) and core.launches[-1][11] == 64
    assert conv[-1][1] == buf.data_ptr() + _C.buffer_layout(cap)["slots"][1][0]  # the second call's slot
    # an input lying in the slot being written is refused, as on the exact path
    alias = buf[_C.buffer_layout(cap)["slots"][0][0]:].view(torch.bfloat16)[:8 * 4 * 64].view(1, 8, 4, 64)
    with pytest.raises(ValueError, match="lies in the output slot"):
        a.gather_heads(alias, fp8_wire=True)
    n = core.calls
    for call, match in ((lambda: a.send_recv_heads(torch.zeros(1, 5, 8, 48, dtype=torch.bfloat16), fp8_wire=True),
                         "head_dim"),
                        (lambda: a.gather_heads(torch.zeros(1, 8, 4, 64, dtype=torch.float16), fp8_wire=True),
                         "dtype")):
        with pytest.raises(ValueError, match=match):
            call()
    a.tensor_dtype, a.itemsize = torch.float16, 2
    with pytest.raises(ValueError, match="bfloat16"):
        a.send_recv_heads(torch.zeros(1, 5, 8, 64, dtype=torch.float16), fp8_wire=True)
    with pytest.raises(ValueError, match="fp8_wire applies"):
        a._run(2, torch.zeros(1, 5, 1, 64, dtype=torch.float16), False, True)
    assert core.calls == n and len(conv) == 2, "a refused call must not launch"


def test_release_inside_a_capture_waits_for_its_end(monkeypatch):
    """A release asked for inside a CUDA-graph capture (a view dropped after destroy(), an instance
    dropped) must not run there (cudaFree would fail the capture): it runs at the next safe moment,
    exactly once, and a failing one warns instead of failing an unrelated call."""
    import gc

    L = ipc_all2all._lifetime
    capturing = [True]
    monkeypatch.setattr(L, "_capturing", lambda device=None: capturing[0])
    monkeypatch.setattr(L, "_DEFERRED", [])
    calls = []
    L._release_when_safe(lambda: calls.append("a"))

    class Owner:
        destroyed = 0

        def destroy(self):
            self.destroyed += 1

    owner = Owner()
    keeper = L._CudaBytes(0, 16, owner=owner)
    del keeper
    gc.collect()
    assert calls == [] and owner.destroyed == 0
    assert ipc_all2all.release_deferred() == 0  # still capturing
    capturing[0] = False
    L._release_when_safe(lambda: calls.append("b"))  # runs the backlog first, then itself
    assert calls == ["a", "b"] and owner.destroyed == 1
    assert ipc_all2all.release_deferred() == 0 and L._DEFERRED == []

    def broken():
        raise RuntimeError("cudaFree failed")

    capturing[0] = True
    L._release_when_safe(broken)
    capturing[0] = False
    with pytest.warns(ResourceWarning, match="deferred release failed: cudaFree failed"):
        assert ipc_all2all.release_deferred() == 1
    # outside a capture a view's last reference releases its owner at once
    owner2 = Owner()
    keeper = L._CudaBytes(0, 16, owner=owner2)
    del keeper
    assert owner2.destroyed == 1


# ------------------------------------------------------------------ set_timeout_seconds, set_grid, set_rank_tokens
class _ConfigCore:
    destroyed = False  # a live instance: a destroyed one refuses every call

    def __init__(self):
        self.calls = []

    def set_timeout_seconds(self, s):
        self.calls.append(("timeout", s))

    def set_grid(self, nb, sb):
        self.calls.append(("grid", nb, sb))


class _ConfigInstance(ipc_all2all.All2All):
    def __del__(self):  # over a stand-in core: nothing to release, so no "not destroyed" warning
        pass


def _config_instance(world=4, device=torch.device("cpu")):
    a = _ConfigInstance.__new__(_ConfigInstance)
    a.__dict__.update(_core=_ConfigCore(), world_size=world, device=device, _counts=None, _counts_dev=None, _captured_counts={},
                      _plans={"stale": 1})
    return a


def test_set_timeout_seconds_and_set_grid_check_before_the_core():
    a = _config_instance(world=4)
    for bad in (-1, float("nan"), float("inf"), 1e9, "10", True):
        with pytest.raises(ValueError, match="timeout_seconds"):
            a.set_timeout_seconds(bad)
    for nb, sb, match in [(3, 0, "num_blocks"), (65536, 0, "num_blocks"), (8, 8, "self_blocks"),
                          (8, -1, "self_blocks"), (8.0, 0, "num_blocks")]:
        with pytest.raises(ValueError, match=match):
            a.set_grid(nb, sb)
    assert a._core.calls == [], "a refused value must not reach the core"
    a.set_timeout_seconds(np.int64(3))
    a.set_grid(np.int64(132), 5)
    a.set_grid(4)
    assert a._core.calls == [("timeout", 3.0), ("grid", 132, 5), ("grid", 4, 0)]
    assert all(type(v) in (int, float) for c in a._core.calls for v in c[1:])


def test_constructor_checks_timeout_before_the_device():
    with pytest.raises(ValueError, match="timeout_seconds"):
        ipc_all2all.All2All(0, 2, 10, 4096, 132, torch.bfloat16, timeout_seconds=-1)
    with pytest.raises(ValueError, match="timeout_seconds"):
        ipc_all2all.All2All(0, 2, 10, 4096, 132, torch.bfloat16, timeout_seconds=float("nan"))


def test_set_rank_tokens_tensor_branch():
    a = _config_instance(world=2)
    a.set_rank_tokens([3, 5])
    for bad in (torch.tensor([3, 5]), torch.tensor([3, 5, 0], dtype=torch.int32),
                torch.zeros(4, dtype=torch.int32)[::2], torch.zeros(2, dtype=torch.int32, device="meta")):
        with pytest.raises(ValueError, match="set_rank_tokens"):
            a.set_rank_tokens(bad)
        assert a.rank_tokens == [3, 5] and a._counts_dev is None, "a refused tensor must leave the counts alone"
    t = torch.tensor([4, 4], dtype=torch.int32)
    a._plans = {"stale": 1}
    a.set_rank_tokens(t)
    assert a._counts_dev is t and a.rank_tokens is None and a._plans == {}
