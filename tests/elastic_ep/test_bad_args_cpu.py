"""Bad arguments to elastic_ep's public API raise ValueError naming the argument, before anything runs.

Each case below used to end otherwise: a float size returned as a float (or NaN) by the size hints,
a pybind11 "incompatible function arguments" TypeError from the native sizing, an expert alignment of
2**31 wrapped in the int32 per-expert offsets, num_experts=2**31 hanging the torch backend (2**64: an
OverflowError), a nested tensor failing inside torch, or a TypeError / ZeroDivisionError without the
argument's name.

The front end runs on the torch backend over gloo (one spawned rank). The low level (DeepEP's C++ class
and functions, ``elastic_ep._low_level``) keeps the checks of what only it takes: the communicator
functions' integers, the IPC handles and its sizing statics; its dispatch and combine take arguments the
front end validated (``DispatchArgs`` / ``CombineArgs``).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_workers
from tests.elastic_ep._common import native_module_or_skip

native_module_or_skip()
from elastic_ep import EventOverlap, _domains, _env, calculate_elastic_buffer_size  # noqa: E402
from elastic_ep import _low_level as ll  # noqa: E402
from elastic_ep.buffer import ElasticBuffer  # noqa: E402
from tests.elastic_ep.test_lowlevel_host_cpu import FakeRuntime, make_buffer  # noqa: E402

MIB2 = 2 << 20


# ------------------------------------------------------------------ sizing (public and low level)
@pytest.mark.parametrize("kw,name", [
    (dict(num_ranks=1.5), "num_ranks"),                        # returned 2097152.0
    (dict(num_ranks=None), "num_ranks"),                       # TypeError: '<=' not supported
    (dict(num_max_tokens_per_rank=True), "num_max_tokens_per_rank"),
    (dict(num_max_tokens_per_rank=float("inf")), "num_max_tokens_per_rank"),  # returned nan
    (dict(num_max_tokens_per_rank=2 ** 31), "num_max_tokens_per_rank"),       # the native sizing's int
    (dict(hidden=np.float32(256.0)), "hidden"),
    (dict(hidden=torch.tensor(256.5)), "hidden"),              # returned a tensor
    (dict(num_topk=1.5), "num_topk"),
    (dict(num_nvl_ranks=0), "num_nvl_ranks"),                  # silently meant "all ranks"
])
def test_calculate_elastic_buffer_size_refuses_non_int_sizes(kw, name):
    args = dict(num_ranks=2, num_max_tokens_per_rank=64, hidden=256, num_topk=4)
    args.update(kw)
    with pytest.raises(ValueError, match=name):
        calculate_elastic_buffer_size(**args)


def test_calculate_elastic_buffer_size_still_takes_integers_of_any_kind():
    want = calculate_elastic_buffer_size(2, 64, 256, 4)
    assert calculate_elastic_buffer_size(np.int64(2), torch.tensor(64), np.int32(256), 4, num_nvl_ranks=None) == want


_DISPATCH_SIZE_ARGS = dict(num_max_tokens_per_rank=4, hidden=128, num_sf_packs=0, num_topk=4, elem_size=2,
                          num_scaleout_ranks=1, num_scaleup_ranks=2, is_scaleup_nvlink=True)
_COMBINE_SIZE_ARGS = dict(num_max_tokens_per_rank=4, hidden=128, num_topk=4, num_scaleout_ranks=1,
                          num_scaleup_ranks=2, is_scaleup_nvlink=True, allow_multiple_reduction=True)


@pytest.mark.parametrize("layout", ["dispatch", "combine"])
@pytest.mark.parametrize("name,value", [
    ("num_max_tokens_per_rank", 4.0),   # pybind11 TypeError
    ("num_max_tokens_per_rank", True),  # taken as 1
    ("hidden", 2 ** 31),                # the native sizing's C int
    ("hidden", None),
    ("num_topk", 1.5),
    ("num_scaleup_ranks", "2"),
])
def test_layout_sizes_refuse_what_is_not_a_c_int(layout, name, value):
    base = _DISPATCH_SIZE_ARGS if layout == "dispatch" else _COMBINE_SIZE_ARGS
    fn = getattr(ll.ElasticBuffer, f"get_{layout}_buffer_size")
    fn(**base)
    with pytest.raises(ValueError, match=name):
        fn(**{**base, name: value})


@pytest.mark.parametrize("args,name", [
    ((2, 1.5, 256, 4, False, True, True), "num_max_tokens_per_rank"),  # TypeError from pybind11
    ((2, 64, 2 ** 31, 4, False, True, True), "hidden"),
    ((2, 64, 256, None, False, True, True), "num_topk"),
    ((1.5, 64, 256, 4, False, True, True), "nccl_comm"),               # int() made it 1 rank
    ((True, 64, 256, 4, False, True, True), "nccl_comm"),
])
def test_low_level_calculate_buffer_size_refuses_non_ints(args, name):
    with pytest.raises(ValueError, match=name):
        ll.ElasticBuffer.calculate_buffer_size(*args)


# ------------------------------------------------------------------ the low level's own inputs (before CUDA)
@pytest.mark.parametrize("call,name", [
    (lambda: ll.create_nccl_comm(b"\0" * 128, 2.5, 0), "num_ranks"),
    (lambda: ll.create_nccl_comm(b"\0" * 128, 2, 1.0), "rank"),
    (lambda: ll.create_nccl_comm(b"\0" * 128, 2, 2), "rank"),
    (lambda: ll.destroy_nccl_comm(1.5), "nccl_comm"),
    (lambda: ll.get_physical_domain_size(None), "nccl_comm"),
], ids=["ranks-2.5", "rank-1.0", "rank-2-of-2", "destroy-1.5", "domain-None"])
def test_low_level_communicator_functions_check_integers_before_cuda(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("handles", [None, 5, b"\0" * 64], ids=["None", "int", "bytes"])
def test_low_level_sync_needs_a_list_of_handles(handles):
    b = make_buffer(FakeRuntime(), None)
    b.window = "ipc"
    with pytest.raises(ValueError, match="ipc_handles: expected a list"):
        b.sync(handles)


# ------------------------------------------------------------------ size hints and events (no group needed)
def _fake_front_end(num_ranks=2):
    b = object.__new__(ElasticBuffer)
    b.num_ranks, b._settings, b.device, b._device_sms = num_ranks, _env.Settings(), torch.device("cpu"), 132
    b.prefer_overlap_with_compute, b.allow_hybrid_mode, b.num_allocated_qps = True, True, 129
    b.domains = _domains.Domains(num_ranks, 0, 1, num_ranks, 1, num_ranks)
    return b


@pytest.mark.parametrize("kw,name", [
    (dict(num_experts=None), "num_experts"),             # TypeError: '<=' not supported
    (dict(num_topk=1.5), "num_topk"),                    # TypeError inside math.comb
    (dict(sm_read_gbs=0), "sm_read_gbs"),                # ZeroDivisionError
    (dict(sm_write_gbs=-50), "sm_write_gbs"),
    (dict(nvlink_gbs=float("nan")), "nvlink_gbs"),       # "cannot convert float NaN to integer"
    (dict(nvlink_gbs="450"), "nvlink_gbs"),
])
def test_theoretical_num_sms_names_bad_arguments(kw, name):
    args = dict(num_experts=16, num_topk=4)
    args.update(kw)
    with pytest.raises(ValueError, match=name):
        _fake_front_end().get_theoretical_num_sms(**args)


@pytest.mark.parametrize("num_sms", [1.5, -1, True, None], ids=["1.5", "-1", "True", "None"])
def test_theoretical_num_qps_needs_an_sm_count(num_sms):
    with pytest.raises(ValueError, match="num_sms"):
        _fake_front_end().get_theoretical_num_qps(num_sms)


@pytest.mark.parametrize("call,name", [
    (lambda: ElasticBuffer.get_engram_storage_size_hint(1.5, 128, 16), "num_entries"),   # returned floats
    (lambda: ElasticBuffer.get_engram_storage_size_hint(10, float("inf"), 16), "hidden"),  # returned nan
    (lambda: ElasticBuffer.get_engram_storage_size_hint(10, 128, -1), "num_max_tokens_per_rank"),
    (lambda: ElasticBuffer.get_engram_storage_size_hint(10, 128, 16, None), "dtype"),    # AttributeError
    (lambda: ElasticBuffer.get_pp_buffer_size_hint(None, 2), "num_max_tensor_bytes"),
    (lambda: ElasticBuffer.get_pp_buffer_size_hint(100, 1.5), "num_max_inflight_tensors"),
    (lambda: ElasticBuffer.get_agrs_buffer_size_hint(None, 1.5), "num_max_session_bytes"),
    (lambda: ElasticBuffer.get_agrs_num_max_session_bytes(None, (), torch.bfloat16), "shapes"),  # IndexError
    (lambda: ElasticBuffer.get_agrs_num_max_session_bytes(None, None, torch.bfloat16), "shapes"),
    (lambda: ElasticBuffer.get_agrs_num_max_session_bytes(None, (2, 1.5), torch.bfloat16), r"shapes\[0\]"),
    (lambda: ElasticBuffer.get_agrs_num_max_session_bytes(None, [(2, 3), 5], torch.bfloat16), r"shapes\[1\]"),
    (lambda: ElasticBuffer.get_agrs_num_max_session_bytes(None, (2, 3), None), "dtype"),
], ids=["engram-entries", "engram-hidden", "engram-tokens", "engram-dtype", "pp-bytes", "pp-inflight",
        "agrs-hint", "agrs-empty", "agrs-None", "agrs-float-dim", "agrs-mixed", "agrs-dtype"])
def test_size_hints_name_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_event_hook_must_be_callable():
    e = EventOverlap()
    with pytest.raises(ValueError, match="hook_after_wait: expected a callable"):
        e.register_hook_after_wait(5)
    e.current_stream_wait()  # nothing was registered


# ------------------------------------------------------------------ the front end (torch backend, gloo)
def bad_args_worker(rank, world, rdzv):
    import warnings

    import torch

    from tests._dist import init_gloo
    from tests.elastic_ep._common import import_elastic_ep, make_inputs

    ep = import_elastic_ep()
    group = init_gloo(rank, world, rdzv)
    H, K, E, M = 128, 4, 8, 16
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch")
    inp = make_inputs(rank, M, H, K, E, "bf16", 0, "cpu")
    x, idx, w = inp["x"], inp["topk_idx"], inp["topk_weights"]
    recv, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    base = dict(num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype API
        nested = torch.nested.nested_tensor([x])
    cases = {
        "ctor-cpu-timeout-2^31": lambda: ep.ElasticBuffer(group, **base, num_cpu_timeout_secs=2 ** 31),
        "ctor-gpu-timeout-2^63": lambda: ep.ElasticBuffer(group, **base, num_gpu_timeout_secs=2 ** 63),
        "ctor-num-bytes-2^63": lambda: ep.ElasticBuffer(group, num_bytes=2 ** 63, backend="torch"),
        "ctor-tokens-2^31": lambda: ep.ElasticBuffer(group, **{**base, "num_max_tokens_per_rank": 2 ** 31}),
        "dispatch-experts-2^64": lambda: buf.dispatch(x, topk_idx=idx, num_experts=2 ** 64),
        "dispatch-experts-4096": lambda: buf.dispatch(x, topk_idx=idx, num_experts=4096),
        "dispatch-align-2^31": lambda: buf.dispatch(x, topk_idx=idx, num_experts=E, expert_alignment=2 ** 31),
        "dispatch-align-2^64": lambda: buf.dispatch(x, topk_idx=idx, num_experts=E, expert_alignment=2 ** 64),
        "dispatch-expand-align-2^40": lambda: buf.dispatch(x, topk_idx=idx, num_experts=E, expert_alignment=2 ** 40,
                                                           do_expand=True),
        "dispatch-nested-x": lambda: buf.dispatch(nested, topk_idx=idx, num_experts=E),
        "combine-num-sms-None": lambda: buf.combine(recv, handle, num_sms=None),
        "combine-num-sms-False": lambda: buf.combine(recv, handle, num_sms=False),
        "combine-bias-int": lambda: buf.combine(recv, handle, bias=3),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = ("no exception", "")
        except Exception as e:  # noqa: BLE001 - reported to the parent, which asserts on type and message
            out[name] = (type(e).__name__, str(e))
    buf.destroy()
    return out


FRONT_END_CASES = {
    "ctor-cpu-timeout-2^31": "num_cpu_timeout_secs: expected at most 2147483647",
    "ctor-gpu-timeout-2^63": "num_gpu_timeout_secs: expected at most 2147483647",
    "ctor-num-bytes-2^63": "num_bytes: expected at most 9223372036854775807",
    "ctor-tokens-2^31": "num_max_tokens_per_rank: expected an int in [-2**31, 2**31)",
    "dispatch-experts-2^64": "num_experts: expected at most 2048",
    "dispatch-experts-4096": "num_experts: expected at most 2048",
    "dispatch-align-2^31": "expert_alignment: 2147483648",
    "dispatch-align-2^64": "expert_alignment: 18446744073709551616",
    "dispatch-expand-align-2^40": "expert_alignment: 1099511627776",
    "dispatch-nested-x": "x: expected a dense (strided) tensor, got a nested tensor",
    "combine-num-sms-None": "num_sms: expected an int >= 0, got None",
    "combine-num-sms-False": "num_sms: expected an int >= 0, got False",
    "combine-bias-int": "bias: expected None, a tensor or a sequence",
}


@pytest.fixture(scope="module")
def front_end_results(tmp_path_factory):
    return run_workers(bad_args_worker, 1, tmp_path=tmp_path_factory.mktemp("bad_args"), timeout=120)[0]


@pytest.mark.parametrize("case", sorted(FRONT_END_CASES))
def test_front_end_names_bad_arguments(front_end_results, case):
    kind, msg = front_end_results[case]
    assert kind == "ValueError" and FRONT_END_CASES[case] in msg, (kind, msg)
