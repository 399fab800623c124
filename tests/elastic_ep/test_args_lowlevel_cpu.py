"""Bad arguments of the low level (DeepEP's C++ class and functions, ``elastic_ep._low_level``) raise
ValueError naming the argument, before CUDA is touched: what only it takes, the communicator functions'
integers, the IPC handles and its sizing statics (its dispatch and combine take arguments the front end
validated, ``DispatchArgs`` / ``CombineArgs``: see ``test_args_dispatch_cpu.py`` and
``test_args_combine_cpu.py``).

Each case below used to end otherwise: a pybind11 "incompatible function arguments" TypeError from the
native sizing, a float or a bool taken as a rank count (``int()`` made 1.5 one rank), a C int overflow.
"""
from __future__ import annotations

import pytest

from tests.elastic_ep._common import native_module_or_skip

native_module_or_skip()
from elastic_ep import _low_level as ll  # noqa: E402
from tests.elastic_ep.test_lowlevel_host_cpu import FakeRuntime, make_buffer  # noqa: E402

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
    fn = getattr(ll.NativeRuntime, f"get_{layout}_buffer_size")
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
        ll.NativeRuntime.calculate_buffer_size(*args)


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
