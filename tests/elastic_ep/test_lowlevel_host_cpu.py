"""The host path of the native runtime (``elastic_ep._native_runtime.NativeRuntime``, DeepEP's low level) on
the CPU.

A fake ``_C.Runtime`` stands in for the native one (it records the launches and their parameter blocks
and answers the waits), fake streams stand in for CUDA streams, and CPU tensors for tensors on the
runtime's device. Checked here:
* an exception after the first kernels of a dispatch / combine were queued and before the one that
  ends the operation marks the runtime broken (later calls raise) and is re-raised as it was; the
  already-handled outcomes (refusal, timeouts) are left as the runtime reports them;
* on every error path the caller's stream is current again and, once anything was queued, waits for
  the communication stream;
* the parameter blocks cross as bound types (``_C.DispatchParams`` ...) with the call's sizes and modes,
  one per plan (whose fields are the blocks' scalar members, by name), with every pointer member set
  for the call; int32 ``topk_idx`` is cast once and becomes the handle's copy;
* masked expert ids are reported by the next call, or silent with ELASTIC_EP_SKIP_INDEX_CHECK=1;
* the environment's settings (``_env.Settings``) and the overlapped modes' block policy.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.elastic_ep._common import native_module_or_skip

_C = native_module_or_skip()  # skips only without a built package; a broken extension fails
from elastic_ep import _env  # noqa: E402
from elastic_ep import _low_level as ll  # noqa: E402
from elastic_ep._handle import EPHandle  # noqa: E402
from elastic_ep._runtime import CombineArgs, DispatchArgs  # noqa: E402

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
    """The native runtime's host interface (``_C.Runtime``), recording what the Python layer asks of it."""

    def __init__(self, status=0, masked=(0, 0), geometry=None):
        self.status = status  # what wait_dispatch_counts reports: 0 ok, 1 device / 2 CPU timeout, 3 refused
        self.geometry = geometry  # a pending (peer, word, theirs, mine) of a geometry refusal (status 4)
        self.calls = []
        self.params = []
        self.pointers = []  # per launch: pointer member -> address
        self.streams = []
        self.broken = False
        self.broken_reason = ""
        self.masked = masked
        self.raise_in = {}  # method name -> exception to raise there

    def _call(self, name, params, streams):
        self.calls.append(name)
        self.params.append(params)
        # The call's addresses, read now: the runtime reuses a block for the next call of the same plan.
        self.pointers.append({f: getattr(params, f) for f in type(params).pointer_fields})
        self.streams.append(streams)
        if name in self.raise_in:
            raise self.raise_in[name]

    def pending_health(self):
        return (2 if self.broken else 0) | (4 if self.masked[0] else 0) | (8 if self.geometry else 0)

    def take_geometry_mismatch(self):
        out, self.geometry = self.geometry, None
        return out

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

    def dispatch(self, params, stream, wait_stream=-1):
        assert isinstance(params, _C.DispatchParams)
        self._call("dispatch", params, (stream, wait_stream))

    def wait_dispatch_counts(self, num_local_experts):
        self.calls.append("wait_dispatch_counts")
        if "wait_dispatch_counts" in self.raise_in:
            raise self.raise_in["wait_dispatch_counts"]
        if self.status == 2:
            self.broken, self.broken_reason = True, "a dispatch CPU wait timed out"
        return SimpleNamespace(status=self.status, num_recv_tokens=T, num_expanded_tokens=T,
                               num_recv_tokens_per_expert=[1] * num_local_experts, ranks_ready=1,
                               experts_ready=num_local_experts)

    def take_refusal(self):
        return [0], 1, E + 3

    def dispatch_epilogue(self, params, stream, join_stream=-1):
        assert isinstance(params, _C.EpilogueParams)
        self._call("dispatch_epilogue", params, (stream, join_stream))

    def combine(self, params, stream, wait_event=0, wait_stream=-1, join_stream=-1):
        assert isinstance(params, _C.CombineParams)
        self._call("combine", params, (stream, wait_event, wait_stream, join_stream))


@pytest.fixture
def streams(monkeypatch):
    """Fake compute / comm streams; torch.cuda's current-stream functions follow them."""
    compute, comm = FakeStream("compute"), FakeStream("comm")
    current = [compute]
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__(0, s))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current[0])
    from elastic_ep import _native_runtime

    monkeypatch.setattr(_native_runtime, "_current_raw_stream", lambda device: 1)
    return compute, comm, current


def make_buffer(rt, comm, num_ranks=1, refuse_bad_ids=True, settings=None):
    """A NativeRuntime on the fake runtime (what its constructor sets, without CUDA)."""
    settings = settings or _env.Settings()
    b = object.__new__(ll.NativeRuntime)
    b._destroyed, b._rt, b.num_ranks, b.rank_idx = False, rt, num_ranks, 0
    b.device = -1  # CPU tensors stand in for the runtime's device
    b.num_device_sms, b.comm_stream, b._comm_raw, b.buffer_id = 132, comm, 2, 7
    b._refuse_bad_ids, b.allow_multiple_reduction = refuse_bad_ids, True
    b.num_buffer_bytes, b.num_cpu_timeout_secs, b.explicitly_destroy = 64 * MIB2, 300, True
    b._configure(settings)  # what the constructor reads for the operations
    return b


def dispatch_args(**kw):
    """A validated dispatch of T tokens (what _checks.dispatch_args returns), fields overridden by kw."""
    args = dict(x=torch.zeros(T, H, dtype=torch.bfloat16), sf=None, topk_idx=torch.zeros(T, K, dtype=torch.int64),
                topk_weights=None, cumulative_local_expert_recv_stats=None, handle=None, num_tokens=T, hidden=H,
                num_topk=K, num_experts=E, num_max_tokens_per_rank=T, expert_alignment=1, num_sms=132, num_qps=0,
                previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream=False,
                allocate_on_comm_stream=False, do_handle_copy=True, do_cpu_sync=True, do_expand=False,
                do_zero_padding=False, use_tma_aligned_col_major_sf=False)
    args.update(kw)
    return DispatchArgs(**args)


def dispatch(b, **kw):
    return b.dispatch(dispatch_args(**kw))


def handle(**kw):
    i32 = lambda *s: torch.zeros(s, dtype=torch.int32)  # noqa: E731
    fields = dict(do_expand=False, num_experts=E, expert_alignment=1, num_max_tokens_per_rank=T, num_sms=132,
                  topk_idx=torch.zeros(T, K, dtype=torch.int64), num_recv_tokens=T, num_expanded_tokens=T,
                  num_recv_tokens_per_expert_list=[1] * E, psum_num_recv_tokens_per_scaleup_rank=torch.full(
                      (1,), T, dtype=torch.int32), psum_num_recv_tokens_per_expert=i32(E),
                  num_unaligned_recv_tokens_per_expert=i32(E), recv_src_metadata=i32(T, K + 2),
                  dst_buffer_slot_idx=i32(T, K))
    fields.update(kw)
    return EPHandle(**fields)


def combine(b, h=None, **kw):
    args = dict(x=torch.zeros(T, H, dtype=torch.bfloat16), handle=h if h is not None else handle(), topk_weights=None,
                bias_0=None, bias_1=None, num_sms=132, num_qps=0, previous_event=None,
                previous_event_before_epilogue=None, async_with_compute_stream=False, allocate_on_comm_stream=False)
    args.update(kw)
    return b.combine(CombineArgs(**args))


def fail_allocation(monkeypatch, rows, ndim=2):
    """Allocating an output of `rows` rows (`ndim` dimensions) raises an out-of-memory error: the runtime
    allocates every output as ``new_empty`` of an input (on the runtime's device)."""
    real = torch.Tensor.new_empty

    def new_empty(self, size, *args, **kw):
        if len(size) == ndim and size[0] == rows:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, size, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)


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
@pytest.mark.fault
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
    # notify's outputs: one 1-D int32 allocation, before anything is queued
    fail_allocation(monkeypatch, 1 + (E + 1) + E + T * K, ndim=1)
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


@pytest.mark.fault
def test_dispatch_cpu_timeout_keeps_runtime_reason(streams):
    compute, comm, current = streams
    rt = FakeRuntime(status=2)
    b = make_buffer(rt, comm)
    with pytest.raises(ll.CommTimeoutError, match="token counts"):
        dispatch(b, allocate_on_comm_stream=True)
    assert "mark_broken" not in rt.calls and rt.broken_reason == "a dispatch CPU wait timed out"
    assert current[0] is compute


def test_dispatch_success_restores_stream_and_fills_the_handle(streams):
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    out = dispatch(b, allocate_on_comm_stream=True)
    assert rt.calls == ["dispatch", "wait_dispatch_counts", "dispatch_epilogue"] and not rt.broken
    assert current[0] is compute and compute.waited_for == ["comm"] and out.recv_x.shape == (T, H)
    h = out.handle
    assert isinstance(h, EPHandle) and h.buffer_id == 7 and h.num_recv_tokens == T and h.num_sms == 132
    assert h.num_recv_tokens_per_expert_list == [1] * E and h.recv_src_metadata.shape == (T, K + 2)
    # A cached dispatch takes that handle back and returns it.
    cached = dispatch(b, handle=h, do_cpu_sync=False, cumulative_local_expert_recv_stats=None)
    assert cached.handle is h and rt.calls[-2:] == ["dispatch", "dispatch_epilogue"]
    assert rt.params[-2].cached == 1 and rt.params[-1].cached == 1


def test_parameter_blocks_are_bound_types_kept_per_shape(streams):
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    dispatch(b, do_expand=True, expert_alignment=4, do_zero_padding=True)
    notify, epilogue = rt.params
    assert (notify.num_tokens, notify.num_topk, notify.num_experts, notify.expert_alignment) == (T, K, E, 4)
    assert (notify.hidden_bytes, notify.num_sms, notify.refuse_bad_ids, notify.cached) == (2 * H, 132, 1, 0)
    assert (epilogue.do_expand, epilogue.do_zero_padding, epilogue.expert_alignment) == (1, 1, 4)
    dispatch(b, do_expand=True, expert_alignment=4, do_zero_padding=True)
    assert rt.params[2] is notify and rt.params[3] is epilogue  # the same blocks for the same shape
    dispatch(b, do_cpu_sync=False)
    assert rt.params[4] is not notify and rt.params[4].refuse_bad_ids == 0  # no CPU sync: ids masked, reported later
    combine(b)
    c = rt.params[-1]
    assert (c.num_combined_tokens, c.hidden, c.num_topk, c.allow_multiple_reduction, c.overlap_push_blocks) == \
        (T, H, K, 1, 0)
    # every pointer member set for the call: data pointers, 0 for a tensor that is not given
    assert set(rt.pointers[-1]) == set(_C.CombineParams.pointer_fields)
    assert rt.pointers[-1]["x"] != 0 and rt.pointers[-1]["topk_weights"] == 0


def test_plan_key_is_every_scalar_argument_and_the_build_sees_nothing_else(streams):
    # A block is reused only for a call its build could not tell apart: the build is given the scalar
    # fields of DispatchArgs (a new int / bool field joins the key by being declared) and reads them by name.
    from dataclasses import fields

    from elastic_ep import _native_plans
    from elastic_ep._native_runtime import _DISPATCH_SCALARS

    scalars = {f.name for f in fields(DispatchArgs) if f.type in ("int", "bool")}
    assert set(_DISPATCH_SCALARS.names) == scalars and {"num_tokens", "do_expand", "zero_copy_x_offset"} <= scalars
    a = dispatch_args(expert_alignment=4)
    view = _DISPATCH_SCALARS.view(_DISPATCH_SCALARS.read(a))
    assert view.expert_alignment == 4 and view.num_tokens == T
    with pytest.raises(AttributeError):
        view.x  # noqa: B018 - a tensor is not part of the key, so a build cannot read one
    # Every scalar changes the key, and so the blocks: one new block pair per distinct call.
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    dispatch(b)
    dispatch(b, num_qps=1)                      # no effect on a plan, still its own key
    dispatch(b, num_sms=64)
    dispatch(b, num_sms=64)                     # the same call: the same blocks
    assert rt.params[4] is rt.params[6] and rt.params[5] is rt.params[7]
    assert rt.params[4].num_sms == 64 and rt.params[0].num_sms == 132
    assert b._dispatch_blocks_of.cache_info().currsize == 3
    # The settings read per call are part of the key too; the cache keeps at most _MAX_PLANS.
    b.dispatch_pdl = False
    dispatch(b)
    assert rt.params[-2].concurrent_notify == 0 and rt.params[0].concurrent_notify == 1
    assert b._dispatch_blocks_of.cache_info().maxsize == _native_plans._MAX_PLANS


@pytest.mark.parametrize("plan,block,per_call", [
    ("DispatchPlan", "DispatchParams", {"host_tag"}),
    ("EpiloguePlan", "EpilogueParams", {"recv_sf_token_stride", "recv_sf_hidden_stride"}),
    ("CombinePlan", "CombineParams", {"num_x_rows"}),
])
def test_plans_are_the_parameter_blocks_scalar_members_by_name(plan, block, per_call):
    from elastic_ep import _native_plans

    plan, block = getattr(_native_plans, plan), getattr(_C, block)
    members, pointers = set(block.fields), set(block.pointer_fields)
    assert pointers <= members and not per_call & pointers
    # every member is the plan's, a pointer (set per launch) or one of the few set per call
    assert set(plan._fields) == members - pointers - per_call
    # a block made from a plan by name carries its values
    values = {f: i + 1 for i, f in enumerate(plan._fields)}
    made = block(**plan(**values)._asdict())
    assert {f: getattr(made, f) for f in plan._fields} == values
    assert all(getattr(made, f) == 0 for f in pointers | per_call)  # not given: zero


def test_parameter_blocks_bind_every_member_by_name():
    p = _C.DispatchParams(num_tokens=5, zero_copy_x_offset=2 ** 40)
    assert p.num_tokens == 5 and p.zero_copy_x_offset == 2 ** 40 and p.x == 0
    with pytest.raises(TypeError, match="DispatchParams has no member 'num_token'"):
        _C.DispatchParams(num_token=5)
    with pytest.raises(TypeError):
        _C.DispatchParams(5)  # by name only
    with pytest.raises(OverflowError, match=r"DispatchParams.num_tokens: expected an int in \[-2\*\*31"):
        p.num_tokens = 2 ** 31
    with pytest.raises(TypeError, match="DispatchParams.hidden_bytes: expected an int, got 1.5"):
        p.hidden_bytes = 1.5
    with pytest.raises(OverflowError, match="DispatchParams.host_tag"):
        p.host_tag = -1  # uint32
    t = torch.zeros(3)
    pointers = dict.fromkeys(_C.DispatchParams.pointer_fields, 0)
    p.set(**{**pointers, "x": t, "sf": None, "topk_idx": 4096, "num_sms": 24})
    assert (p.x, p.sf, p.topk_idx, p.num_sms) == (t.data_ptr(), 0, 4096, 24)
    # a launch's pointers: every one by name, so none of an earlier launch survives
    with pytest.raises(TypeError, match="every pointer member must be given.*missing sf, topk_idx"):
        p.set(x=t)
    with pytest.raises(TypeError, match="DispatchParams.x: expected an address"):
        p.set(**{**pointers, "x": 1.5})
    with pytest.raises(TypeError, match="by name only"):
        p.set(1)
    probe = _C.ScaleoutProbeParams(next=1, prev=3, src=2 ** 63, dst=16, bytes=32, round=7)
    assert (probe.next, probe.prev, probe.src, probe.round) == (1, 3, 2 ** 63, 7)
    assert _C.PpParams.pointer_fields == ("x",)


def test_int32_topk_idx_is_cast_once_and_kept_in_the_handle(streams):
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    idx32 = torch.tensor([[0, 5], [7, -1], [2, 3], [-1, -1]], dtype=torch.int32)
    out = dispatch(b, topk_idx=idx32)
    assert out.handle.topk_idx.dtype == torch.int64 and torch.equal(out.handle.topk_idx, idx32.long())
    # the kernels read the cast tensor (the handle's copy); notify copies nothing more
    assert rt.pointers[0]["topk_idx"] == out.handle.topk_idx.data_ptr() and rt.pointers[0]["copied_topk_idx"] == 0
    out64 = dispatch(b, topk_idx=idx32.long())
    # notify copies int64 input
    assert rt.pointers[2]["copied_topk_idx"] == out64.handle.topk_idx.data_ptr() != rt.pointers[2]["topk_idx"]
    # a handle given a 32-bit topk_idx: combine casts it for the kernels
    combine(b, handle(topk_idx=idx32))
    assert rt.calls[-1] == "combine"


def test_dispatch_push_beside_notify_unless_off_or_overlapped(streams):
    # dispatch_pdl (ELASTIC_EP_DISPATCH_PDL at creation) asks the runtime to launch the push as notify's
    # programmatic dependent; the overlapped dispatch, whose epilogue waits for notify's event, never does.
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    assert ll.NativeRuntime.dispatch_pdl is True and b.dispatch_pdl is True  # the default
    dispatch(b)
    assert rt.params[-2].concurrent_notify == 1 and rt.params[-2].overlap == 0
    b.dispatch_pdl = False
    dispatch(b)
    assert rt.params[-2].concurrent_notify == 0
    b.dispatch_pdl = True
    b.dispatch_overlap.enabled = True
    dispatch(b)
    assert rt.params[-2].overlap == 1 and rt.params[-2].concurrent_notify == 0
    assert rt.params[-2].num_sms == 132 * 3 // 8 and rt.params[-1].num_sms == 132 - 132 * 3 // 8


# ------------------------------------------------------------------ combine
def test_combine_launch_error_marks_broken_and_restores_stream(streams):
    compute, comm, current = streams
    rt = FakeRuntime()
    rt.raise_in["combine"] = ll.CommError("cudaStreamWaitEvent failed (simulated)")
    b = make_buffer(rt, comm)
    with pytest.raises(ll.CommError, match="simulated"):
        combine(b, allocate_on_comm_stream=True)
    assert rt.broken and "combine" in rt.broken_reason
    assert current[0] is compute and compute.waited_for[-1] == "comm"


def test_combine_oom_before_launch_leaves_buffer_usable(streams, monkeypatch):
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    fail_allocation(monkeypatch, T)  # combined_x
    with pytest.raises(torch.OutOfMemoryError):
        combine(b, allocate_on_comm_stream=True)
    assert rt.calls == [] and not rt.broken and current[0] is compute and compute.waited_for == []


# ------------------------------------------------------------------ masked expert ids (no CPU sync)
def test_masked_ids_raise_with_multi_rank_advice(streams):
    compute, comm, current = streams
    rt = FakeRuntime(masked=(2, E + 5))
    b = make_buffer(rt, comm, num_ranks=2)
    with pytest.raises(ValueError) as info:
        dispatch(b, num_experts=2 * E)
    msg = str(info.value)
    assert "an earlier dispatch without CPU sync had 2 expert ids outside" in msg and f"e.g. {E + 5}" in msg
    assert "times out after num_gpu_timeout_secs" in msg and "destroyed and recreated on every rank" in msg
    assert "do_cpu_sync=True" in msg and "ELASTIC_EP_SKIP_INDEX_CHECK=1" in msg
    assert rt.calls == []  # refused before launching anything


def test_masked_ids_silent_with_skip_index_check(streams):
    compute, comm, current = streams
    rt = FakeRuntime(masked=(3, -7))
    b = make_buffer(rt, comm, refuse_bad_ids=False)  # ELASTIC_EP_SKIP_INDEX_CHECK=1 when the buffer was made
    dispatch(b)
    assert rt.masked == (0, 0) and rt.pending_health() == 0  # taken, so later calls stay on the cheap path
    assert rt.calls == ["dispatch", "wait_dispatch_counts", "dispatch_epilogue"]


def test_dispatch_failing_inside_a_graph_capture_leaves_buffer_usable(streams, monkeypatch):
    # Captured kernels never ran: epochs and signals are unchanged, so the buffer must stay usable.
    compute, comm, current = streams
    rt = FakeRuntime()
    b = make_buffer(rt, comm)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    fail_allocation(monkeypatch, _C.worst_case_num_recv_tokens(1, T))
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        dispatch(b, do_cpu_sync=False)
    assert "mark_broken" not in rt.calls and not rt.broken
    assert current[0] is compute and compute.waited_for[-1] == "comm"


# ------------------------------------------------------------------ the environment, read in one place
def test_settings_read_every_variable(monkeypatch):
    names = ["EP_BUFFER_DEBUG", "EP_REUSE_NCCL_COMM", "ELASTIC_EP_NUM_SMS", "ELASTIC_EP_SKIP_INDEX_CHECK",
             "ELASTIC_EP_DISPATCH_PDL", "ELASTIC_EP_DISPATCH_OVERLAP", "ELASTIC_EP_DISPATCH_PUSH_BLOCKS",
             "ELASTIC_EP_COMBINE_OVERLAP", "ELASTIC_EP_COMBINE_PUSH_BLOCKS", "ELASTIC_EP_HOST_WAIT_YIELD_US",
             "ELASTIC_EP_TEST_NOTIFY_ATOMICS", "EP_AVOID_RECORD_STREAM", "ELASTIC_EP_SKIP_NCCL_VERSION_CHECK",
             "ELASTIC_EP_TEST_CORRUPT"]
    for n in names:
        monkeypatch.delenv(n, raising=False)
    assert _env.Settings.read() == _env.Settings()  # the defaults
    assert not _env.avoid_record_stream() and not _env.skip_nccl_version_check()
    values = dict(zip(names, ["1", "0", "24", "1", "0", "1", "5", "1", "7", "-3", "1", "1", "1", "source"]))
    for n, v in values.items():
        monkeypatch.setenv(n, v)
    assert _env.Settings.read() == _env.Settings(
        buffer_debug=True, reuse_nccl_comm=False, num_sms=24, skip_index_check=True, dispatch_pdl=False,
        dispatch_overlap=True, dispatch_push_blocks=5, combine_overlap=True, combine_push_blocks=7,
        host_wait_yield_us=0, test_notify_atomics=True, test_corrupt=2)
    assert _env.avoid_record_stream() and _env.skip_nccl_version_check()
    monkeypatch.setenv("EP_BUFFER_DEBUG", "0")
    assert not _env.Settings.read().buffer_debug
    monkeypatch.setenv("ELASTIC_EP_NUM_SMS", "many")
    with pytest.raises(ValueError, match="ELASTIC_EP_NUM_SMS: expected an integer, got 'many'"):
        _env.Settings.read()


def test_old_variable_names_are_not_read(monkeypatch):
    monkeypatch.setenv("EP_NUM_SMS", "24")
    monkeypatch.setenv("EP_SKIP_INDEX_CHECK", "1")
    s = _env.Settings.read()
    assert s.num_sms == 0 and not s.skip_index_check


@pytest.mark.parametrize("op", ["DISPATCH", "COMBINE"])
def test_overlap_policy(monkeypatch, op):
    monkeypatch.delenv(f"ELASTIC_EP_{op}_OVERLAP", raising=False)
    monkeypatch.delenv(f"ELASTIC_EP_{op}_PUSH_BLOCKS", raising=False)

    def cfg():
        s = _env.Settings.read()
        return ll.OverlapConfig(*((s.dispatch_overlap, s.dispatch_push_blocks) if op == "DISPATCH" else
                                  (s.combine_overlap, s.combine_push_blocks)))

    from elastic_ep._native_plans import overlap_push_blocks as pick

    assert not cfg().enabled and cfg().push_blocks is None  # sequential kernels by default
    assert pick(cfg(), 2, 132, 4096) == 0
    monkeypatch.setenv(f"ELASTIC_EP_{op}_OVERLAP", "1")
    assert pick(cfg(), 2, 132, 4096) == 132 * 3 // 8
    assert pick(cfg(), 2, 1, 4096) == 0  # one block cannot both push and receive
    assert pick(cfg(), 2, 2, 4096) == 1
    assert pick(cfg(), 256, 132, 8193) == 0  # counters do not fit: sequential kernels
    monkeypatch.setenv(f"ELASTIC_EP_{op}_PUSH_BLOCKS", "500")
    assert pick(cfg(), 2, 132, 4096) == 131  # at least one receiving block stays
    assert pick(ll.OverlapConfig(True, 0), 2, 132, 4096) == 1
    assert repr(ll.OverlapConfig(True, 7)) == "OverlapConfig(enabled=True, push_blocks=7)"


def test_low_level_needs_cuda_and_a_known_window():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="window must be 'nccl' or 'ipc', got 'shm'"):
        ll.NativeRuntime(0, 1, 0, None, MIB2, window="shm")
    with pytest.raises(RuntimeError, match="CUDA"):
        ll.NativeRuntime(0, 1, 1234, None, MIB2)


# ------------------------------------------------------------------ a dead peer names the operation
class DeadPeerRuntime(FakeRuntime):
    """The peer watch's record of rank 1 (pid 4242) found dead, once ``dead`` is set."""

    dead = False

    def pending_health(self):
        return 1 if self.dead else super().pending_health()

    def take_timeout(self):
        if not self.dead:
            return None
        return SimpleNamespace(operation="elastic_ep peer watch (a peer process died)", peer=1, expected=4242)


@pytest.mark.fault
def test_a_dead_peer_is_named_with_the_operation_that_waited_for_it(streams):
    compute, comm, current = streams
    rt = DeadPeerRuntime()
    b = make_buffer(rt, comm, num_ranks=2)
    dispatch(b)  # launched; its peer dies while the combine below waits for it on the GPU
    combine(b)
    rt.dead = True
    # The next call raises at its entry and names the combine, the last operation launched, not itself.
    with pytest.raises(ll.CommError, match=r"rank 1's process \(pid 4242\) on this host died during this rank's "
                                           r"combine \(the last operation it launched\)"):
        dispatch(b)
    # A wait inside the call itself (a CPU-synced dispatch's counts) names that call.
    rt2 = DeadPeerRuntime()
    b2 = make_buffer(rt2, comm, num_ranks=2)
    b2._last_op = "dispatch"
    rt2.dead = True
    with pytest.raises(ll.CommError, match="died during this rank's dispatch "):
        b2._alive()
    # Nothing launched yet: no operation to name.
    b3 = make_buffer(DeadPeerRuntime(), comm, num_ranks=2)
    b3._rt.dead = True
    with pytest.raises(ll.CommError, match=r"on this host died; the operation waiting"):
        b3._alive("dispatch")
