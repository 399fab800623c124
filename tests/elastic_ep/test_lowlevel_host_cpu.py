"""The host path of the native low-level buffer (elastic_ep._low_level.ElasticBuffer) on the CPU.

A fake runtime stands in for the native one (it records the launches and answers the waits), fake
streams stand in for CUDA streams, and CPU tensors stand in for tensors on the buffer's device (the
fake buffer's device index is -1, what ``Tensor.get_device()`` returns for them). Checked here:
* an exception after the first kernels of a dispatch / combine were queued and before the one that
  ends the operation marks the buffer broken (later calls raise) and is re-raised as it was; the
  already-handled outcomes (refusal, timeouts) are left as the runtime reports them;
* on every error path the caller's stream is current again and, once anything was queued, waits for
  the communication stream;
* device checks: a tensor on another device is refused, naming the argument and both devices;
* combine checks the top-k width; masked expert ids are silent with EP_SKIP_INDEX_CHECK=1.
"""
from __future__ import annotations

import pytest
import torch

from tests.elastic_ep._common import native_module_or_skip

native_module_or_skip()  # skips only without a built package; a broken extension fails
from elastic_ep import _low_level as ll  # noqa: E402

T, H, K, E = 4, 128, 2, 8
MIB2 = 2 << 20


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.waited_for = []

    def wait_stream(self, other):
        self.waited_for.append(other.name)

    def wait_event(self, event):
        self.waited_for.append("event")

    def __repr__(self):
        return self.name


class FakeRuntime:
    """The native runtime's host interface, recording what the Python layer asks of it."""

    def __init__(self, status=0, masked=(0, 0)):
        self.status = status  # what wait_dispatch_counts reports: 0 ok, 1 device / 2 CPU timeout, 3 refused
        self.calls = []
        self.broken = False
        self.broken_reason = ""
        self.masked = masked
        self.raise_in = {}  # method name -> exception to raise there

    def _call(self, name):
        self.calls.append(name)
        if name in self.raise_in:
            raise self.raise_in[name]

    def pending_health(self):
        return (2 if self.broken else 0) | (4 if self.masked[0] else 0)

    def mark_broken(self, reason):
        self.calls.append("mark_broken")
        if not self.broken:
            self.broken_reason = reason
        self.broken = True

    def take_timeout(self):
        return None

    def take_masked_ids(self):
        out, self.masked = self.masked, (0, 0)
        return out

    def dispatch(self, params, stream, wait_stream):
        self._call("dispatch")
        self.dispatch_params = params

    def wait_dispatch_counts(self, num_local_experts):
        self._call("wait_dispatch_counts")
        if self.status == 2:
            self.broken, self.broken_reason = True, "a dispatch CPU wait timed out"
        return self.status, T, T, [1] * num_local_experts, 1, num_local_experts

    def take_refusal(self):
        return [0], 1, E + 3

    def dispatch_epilogue(self, params, stream, join_stream):
        self._call("dispatch_epilogue")

    def combine(self, params, stream, wait_event, wait_stream, join_stream):
        self._call("combine")


@pytest.fixture
def streams(monkeypatch):
    """Fake compute / comm streams; torch.cuda's current-stream functions follow them."""
    compute, comm = FakeStream("compute"), FakeStream("comm")
    current = [compute]
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__(0, s))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current[0])
    monkeypatch.setattr(ll, "_current_raw_stream", lambda device: 1)
    return compute, comm, current


def make_buffer(rt, comm, num_ranks=1, refuse_bad_ids=True):
    b = object.__new__(ll.ElasticBuffer)
    b._destroyed, b._rt, b.num_ranks, b.rank_idx = False, rt, num_ranks, 0
    b.device = -1  # CPU tensors stand in for the buffer's device (get_device() is -1 for them)
    b.num_device_sms, b.comm_stream, b._comm_raw = 132, comm, 2
    b.dispatch_overlap, b.combine_overlap = ll.OverlapConfig(), ll.OverlapConfig()
    b._refuse_bad_ids, b.allow_multiple_reduction = refuse_bad_ids, True
    b.num_buffer_bytes, b.num_cpu_timeout_secs, b.explicitly_destroy = 64 * MIB2, 300, True
    return b


def dispatch(b, **kw):
    args = dict(x=torch.zeros(T, H, dtype=torch.bfloat16), sf=None, topk_idx=torch.zeros(T, K, dtype=torch.int64),
                topk_weights=None, cumulative_local_expert_recv_stats=None, cached_num_recv_tokens=None,
                cached_num_expanded_tokens=None, cached_num_recv_tokens_per_expert_list=None,
                cached_psum_num_recv_tokens_per_scaleup_rank=None, cached_psum_num_recv_tokens_per_expert=None,
                cached_num_unaligned_recv_tokens_per_expert=None, cached_dst_buffer_slot_idx=None,
                cached_token_metadata_at_forward=None, cached_recv_src_metadata=None, cached_channel_linked_list=None,
                num_max_tokens_per_rank=T, num_experts=E, expert_alignment=1, num_sms=0, num_qps=0,
                previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream=False,
                allocate_on_comm_stream=False, do_handle_copy=True, do_cpu_sync=True, do_expand=False,
                do_zero_padding=False, use_tma_aligned_col_major_sf=False, _validated=True)
    args.update(kw)
    return b.dispatch(**args)


def combine_args(**kw):
    args = dict(x=torch.zeros(T, H, dtype=torch.bfloat16), topk_weights=None, bias_0=None, bias_1=None,
                src_metadata=torch.zeros(T, K + 2, dtype=torch.int32),
                combined_topk_idx=torch.zeros(T, K, dtype=torch.int64),
                psum_num_recv_tokens_per_scaleup_rank=torch.full((1,), T, dtype=torch.int32),
                token_metadata_at_forward=None, channel_linked_list=None, num_experts=E, num_max_tokens_per_rank=T,
                num_sms=0, num_qps=0, previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream=False, allocate_on_comm_stream=False, use_expanded_layout=False,
                _validated=True)
    args.update(kw)
    return args


def fail_allocation(monkeypatch, rows):
    """torch.empty raises an out-of-memory error for tensors of `rows` rows (the outputs of a call)."""
    real = torch.empty

    def empty(*shape, **kw):
        size = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        if len(size) == 2 and size[0] == rows:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*shape, **kw)

    monkeypatch.setattr(torch, "empty", empty)


# ------------------------------------------------------------------ dispatch: the push -> epilogue window
@pytest.mark.parametrize("comm_alloc", [False, True])
def test_dispatch_oom_after_push_marks_broken_and_restores_stream(streams, monkeypatch, comm_alloc):
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    fail_allocation(monkeypatch, T)  # recv_x: after notify + push were queued
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        dispatch(b, allocate_on_comm_stream=comm_alloc)
    assert rt.calls == ["dispatch", "wait_dispatch_counts", "mark_broken"]
    assert rt.broken and "dispatch" in rt.broken_reason and "OutOfMemoryError" in rt.broken_reason
    assert "every rank must recreate the buffer" in rt.broken_reason
    assert current[0] is compute and compute.waited_for[-1] == "comm"
    monkeypatch.undo()
    with pytest.raises(ll.CommError, match="destroy it and create a new one"):
        b._alive()  # every later call refuses


@pytest.mark.parametrize("cpu_sync", [True, False])
def test_dispatch_keyboard_interrupt_in_window_marks_broken(streams, cpu_sync):
    compute, comm, current = streams
    rt = FakeRuntime()
    # A signal is delivered when the host returns to Python: right after the wait, or (no CPU sync)
    # right after the launch of notify + push.
    rt.raise_in["wait_dispatch_counts" if cpu_sync else "dispatch_epilogue"] = KeyboardInterrupt()
    b = make_buffer(rt, comm)
    with pytest.raises(KeyboardInterrupt):
        dispatch(b, do_cpu_sync=cpu_sync, allocate_on_comm_stream=True)
    assert rt.broken and "KeyboardInterrupt" in rt.broken_reason
    assert current[0] is compute and compute.waited_for[-1] == "comm"


def test_dispatch_launch_error_marks_broken(streams):
    compute, comm, current = streams
    rt = FakeRuntime()
    rt.raise_in["dispatch"] = ll.CommError("cudaGetLastError() failed (simulated)")
    b = make_buffer(rt, comm)
    with pytest.raises(ll.CommError, match="simulated"):
        dispatch(b, allocate_on_comm_stream=True)
    assert rt.broken and current[0] is compute


def test_dispatch_error_before_any_launch_leaves_buffer_usable(streams, monkeypatch):
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    real = torch.empty

    def empty(*shape, **kw):  # notify's outputs: one 1-D int32 allocation, before anything is queued
        if shape and shape[0] == 1 + (E + 1) + E + T * K:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*shape, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(torch.OutOfMemoryError):
        dispatch(b, allocate_on_comm_stream=True)
    assert rt.calls == [] and not rt.broken
    # Nothing was queued: the caller's stream is current again and has nothing to wait for.
    assert current[0] is compute and compute.waited_for == []


def test_dispatch_refused_keeps_buffer_usable_and_restores_stream(streams):
    compute, comm, current = streams
    rt = FakeRuntime(status=3)
    b = make_buffer(rt, comm)
    with pytest.raises(ValueError, match=r"expert ids must be in \[-1, 8\)"):
        dispatch(b, allocate_on_comm_stream=True)
    assert "mark_broken" not in rt.calls and not rt.broken
    assert current[0] is compute and compute.waited_for[-1] == "comm"
    b._alive()  # still usable


def test_dispatch_cpu_timeout_keeps_runtime_reason(streams):
    compute, comm, current = streams
    rt = FakeRuntime(status=2)
    b = make_buffer(rt, comm)
    with pytest.raises(ll.CommTimeoutError, match="token counts"):
        dispatch(b, allocate_on_comm_stream=True)
    assert "mark_broken" not in rt.calls and rt.broken_reason == "a dispatch CPU wait timed out"
    assert current[0] is compute


def test_dispatch_success_restores_stream(streams):
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    out = dispatch(b, allocate_on_comm_stream=True)
    assert rt.calls == ["dispatch", "wait_dispatch_counts", "dispatch_epilogue"] and not rt.broken
    assert current[0] is compute and compute.waited_for == ["comm"] and out[0].shape == (T, H)


def test_dispatch_push_beside_notify_unless_off_or_overlapped(streams):
    # dispatch_pdl (ELASTIC_EP_DISPATCH_PDL at creation) asks the runtime to launch the push as notify's
    # programmatic dependent; the overlapped dispatch, whose epilogue waits for notify's event, never does.
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    assert ll.ElasticBuffer.dispatch_pdl is True and b.dispatch_pdl is True  # the class default
    dispatch(b)
    assert rt.dispatch_params["concurrent_notify"] == 1 and rt.dispatch_params["overlap"] == 0
    b.dispatch_pdl = False
    dispatch(b)
    assert rt.dispatch_params["concurrent_notify"] == 0
    b.dispatch_pdl = True
    b.dispatch_overlap.enabled = True
    dispatch(b)
    assert rt.dispatch_params["overlap"] == 1 and rt.dispatch_params["concurrent_notify"] == 0


def test_previous_event_without_comm_allocation_leaves_stream_alone(streams):
    compute, comm, current = streams
    b = make_buffer(FakeRuntime(), comm)
    with pytest.raises(ValueError, match="previous_event requires allocate_on_comm_stream=True"):
        dispatch(b, previous_event=object())
    assert current[0] is compute and comm.waited_for == []


# ------------------------------------------------------------------ combine
def test_combine_launch_error_marks_broken_and_restores_stream(streams):
    compute, comm, current = streams
    rt = FakeRuntime()
    rt.raise_in["combine"] = ll.CommError("cudaStreamWaitEvent failed (simulated)")
    b = make_buffer(rt, comm)
    with pytest.raises(ll.CommError, match="simulated"):
        b.combine(**combine_args(allocate_on_comm_stream=True))
    assert rt.broken and "combine" in rt.broken_reason
    assert current[0] is compute and compute.waited_for[-1] == "comm"


def test_combine_oom_before_launch_leaves_buffer_usable(streams, monkeypatch):
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    fail_allocation(monkeypatch, T)  # combined_x
    with pytest.raises(torch.OutOfMemoryError):
        b.combine(**combine_args(allocate_on_comm_stream=True))
    assert rt.calls == [] and not rt.broken and current[0] is compute and compute.waited_for == []


@pytest.mark.parametrize("k", [0, ll._MAX_TOPK + 1])
def test_combine_checks_topk_width(streams, k):
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    kw = combine_args(combined_topk_idx=torch.zeros(T, k, dtype=torch.int64),
                      src_metadata=torch.zeros(T, k + 2, dtype=torch.int32), _validated=False)
    with pytest.raises(ValueError, match=r"combined_topk_idx must be \[T, K\] with K \(num_topk\) in \[1, 32\]"):
        b.combine(**kw)
    assert rt.calls == []


def test_combine_checks_weights_shape(streams):
    compute, comm, current = streams
    b = make_buffer(FakeRuntime(), comm)
    with pytest.raises(ValueError, match=r"topk_weights must be \[4, 2\]"):
        b.combine(**combine_args(topk_weights=torch.zeros(T, K + 1), _validated=False))
    with pytest.raises(ValueError, match="topk_weights must have dtype"):
        b.combine(**combine_args(topk_weights=torch.zeros(T, K, dtype=torch.float64), _validated=False))
    with pytest.raises(ValueError, match="combined_topk_idx must have dtype"):
        b.combine(**combine_args(combined_topk_idx=torch.zeros(T, K, dtype=torch.int32), _validated=False))


# ------------------------------------------------------------------ devices
class OtherGpuTensor(torch.Tensor):
    """A CPU tensor that reports itself as living on cuda:1 (there is no GPU here)."""

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", 1)

    def get_device(self):
        return 1


def on_other_gpu(t):
    return torch.Tensor._make_subclass(OtherGpuTensor, t)


def test_low_level_checks_device_of_every_tensor(streams):
    compute, comm, current = streams
    b = make_buffer(FakeRuntime(), comm)
    b.device = 0  # the buffer lives on cuda:0
    with pytest.raises(ValueError, match=r"x must be a CUDA tensor on cuda:0 \(the buffer's device\), got device cpu"):
        dispatch(b, _validated=False)
    x = on_other_gpu(torch.zeros(T, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x is on cuda:1, but this buffer is on cuda:0"):
        dispatch(b, x=x, _validated=False)
    with pytest.raises(ValueError, match="x is on cuda:1, but this buffer is on cuda:0"):
        b.combine(**combine_args(x=x, _validated=False))
    # Each argument is named: the first one on the wrong device is reported.
    b.device = -1
    for name, t in (("topk_idx", torch.zeros(T, K, dtype=torch.int64)),
                    ("topk_weights", torch.zeros(T, K)),
                    ("cumulative_local_expert_recv_stats", torch.zeros(E, dtype=torch.int32))):
        with pytest.raises(ValueError, match=f"{name} is on cuda:1"):
            dispatch(b, **{name: on_other_gpu(t)}, _validated=False)
    for name, t in (("combined_topk_idx", torch.zeros(T, K, dtype=torch.int64)),
                    ("psum_num_recv_tokens_per_scaleup_rank", torch.full((1,), T, dtype=torch.int32)),
                    ("src_metadata", torch.zeros(T, K + 2, dtype=torch.int32)),
                    ("topk_weights", torch.zeros(T, K)),
                    ("bias_0", torch.zeros(T, H, dtype=torch.bfloat16)),
                    ("bias_1", torch.zeros(T, H, dtype=torch.bfloat16))):
        with pytest.raises(ValueError, match=f"{name} is on cuda:1"):
            b.combine(**combine_args(**{name: on_other_gpu(t)}, _validated=False))
    assert current[0] is compute


def test_front_end_device_check_names_both_devices():
    from elastic_ep.buffer import _check_tensor

    cuda0 = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"x: expected a tensor on cuda:0 \(the buffer's device\), got cpu"):
        _check_tensor("x", torch.zeros(2, 2), device=cuda0)
    with pytest.raises(ValueError, match=r"sf: expected a tensor on cuda:0 \(the buffer's device\), got cuda:1"):
        _check_tensor("sf", on_other_gpu(torch.zeros(2, 2)), device=cuda0)
    with pytest.raises(ValueError, match=r"x: expected a tensor on cpu \(the buffer's device\), got meta"):
        _check_tensor("x", torch.zeros(2, 2, device="meta"), device=torch.device("cpu"))
    _check_tensor("x", torch.zeros(2, 2), device=torch.device("cpu"))


# ------------------------------------------------------------------ masked expert ids (no CPU sync)
def test_masked_ids_raise_with_multi_rank_advice(streams):
    compute, comm, current = streams
    rt = FakeRuntime(masked=(2, E + 5))
    b = make_buffer(rt, comm, num_ranks=2)
    with pytest.raises(ValueError) as info:
        dispatch(b)
    msg = str(info.value)
    assert "an earlier dispatch without CPU sync had 2 expert ids outside" in msg and f"e.g. {E + 5}" in msg
    assert "times out after num_gpu_timeout_secs" in msg and "destroyed and recreated on every rank" in msg
    assert "do_cpu_sync=True" in msg
    assert rt.calls == []  # refused before launching anything
    dispatch(b)  # reported once


def test_masked_ids_silent_with_skip_index_check(streams):
    compute, comm, current = streams
    rt = FakeRuntime(masked=(3, -7))
    b = make_buffer(rt, comm, refuse_bad_ids=False)  # EP_SKIP_INDEX_CHECK=1 when the buffer was made
    dispatch(b)
    assert rt.masked == (0, 0) and rt.pending_health() == 0  # taken, so later calls stay on the cheap path
    assert rt.calls == ["dispatch", "wait_dispatch_counts", "dispatch_epilogue"]


def test_dispatch_failing_inside_a_graph_capture_leaves_buffer_usable(streams, monkeypatch):
    # Captured kernels never ran: epochs and signals are unchanged, so the buffer must stay usable.
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    fail_allocation(monkeypatch, ll._C.worst_case_num_recv_tokens(1, T))
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        dispatch(b, do_cpu_sync=False)
    assert "mark_broken" not in rt.calls and not rt.broken
    assert current[0] is compute and compute.waited_for[-1] == "comm"


@pytest.mark.parametrize("event", [object(), "comm"])
def test_dispatch_checks_the_epilogue_event_before_launching(streams, event):
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    with pytest.raises(ValueError, match="previous_event_before_epilogue: expected None or an EventHandle"):
        dispatch(b, previous_event_before_epilogue=comm if event == "comm" else event, _validated=False)
    assert rt.calls == [] and not rt.broken and current[0] is compute
