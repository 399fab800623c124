"""Bad arguments of a buffer's construction and sizing raise ValueError naming the argument, before
anything runs: the ``ElasticBuffer`` constructor (integer sizes and timeouts, backend, window, CPU
segment), ``calculate_elastic_buffer_size``, ``get_theoretical_num_sms`` and ``get_theoretical_num_qps``.
(The per-feature size hints are checked in ``test_args_agrs_cpu.py``, ``test_args_pp_cpu.py`` and
``test_args_engram_cpu.py``; DeepEP's low-level sizing statics in ``test_args_lowlevel_cpu.py``.)

Each case below used to end otherwise: a float size returned as a float (or NaN), a float reaching the
native parser only after the first kernels were queued, a TypeError / ZeroDivisionError without the
argument's name. Integers of any kind (numpy, torch scalars) pass. The constructor runs on the torch
backend over gloo (two spawned ranks); its GPU twin on the native backend (one GPU, EP=1) also checks
that C++ exceptions arrive as this package's Python exceptions with the CUDA context still usable.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_workers
from tests.elastic_ep._common import native_module_or_skip

native_module_or_skip()
from elastic_ep import _domains, _env, calculate_elastic_buffer_size  # noqa: E402
from elastic_ep.buffer import ElasticBuffer  # noqa: E402


# ------------------------------------------------------------------ sizing (no group needed)
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


# ------------------------------------------------------------------ the constructor (spawned ranks)
H, K, M = 128, 4, 16


def _refuse_integers(ep, group, bad) -> None:
    """Integer arguments refuse floats, strings, bools and values past the native runtime's C types."""
    base = dict(num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch")

    def mk(**kw):
        return ep.ElasticBuffer(group, **{**base, **kw})

    bad("num_max_tokens_per_rank: expected an int >= 0, got 32.5", lambda: mk(num_max_tokens_per_rank=32.5))
    bad("num_max_tokens_per_rank: expected an int >= 0, got '32'", lambda: mk(num_max_tokens_per_rank="32"))
    bad("hidden: a row must be a multiple of 16 bytes", lambda: mk(hidden=100))
    bad("hidden: a row must be a multiple of 16 bytes", lambda: mk(hidden=136, use_fp8_dispatch=True))
    bad("num_topk: expected an int >= 0, got 2.5", lambda: mk(num_topk=2.5))
    bad("num_topk: expected an int >= 0, got True", lambda: mk(num_topk=True))
    bad("num_cpu_timeout_secs: expected a positive int, got 0.5", lambda: mk(num_cpu_timeout_secs=0.5))
    bad("num_gpu_timeout_secs: expected a positive int, got 0.5", lambda: mk(num_gpu_timeout_secs=0.5))
    bad("num_cpu_timeout_secs: expected a positive int, got None", lambda: mk(num_cpu_timeout_secs=None))
    bad("num_allocated_qps: expected an int >= 0, got -5", lambda: mk(num_allocated_qps=-5))
    bad("sl_idx: expected an int >= 0, got 'a'", lambda: mk(sl_idx="a"))
    bad("num_bytes: expected a positive int, got 2097152.0", lambda: mk(num_bytes=2.0 ** 21))
    bad("num_cpu_timeout_secs: expected at most 2147483647", lambda: mk(num_cpu_timeout_secs=2 ** 31))
    bad("num_gpu_timeout_secs: expected at most 2147483647", lambda: mk(num_gpu_timeout_secs=2 ** 63))
    bad("num_bytes: expected at most 9223372036854775807",
        lambda: ep.ElasticBuffer(group, num_bytes=2 ** 63, backend="torch"))
    bad("num_max_tokens_per_rank: expected an int in [-2**31, 2**31)", lambda: mk(num_max_tokens_per_rank=2 ** 31))
    buf = mk(num_max_tokens_per_rank=np.int64(M), num_cpu_timeout_secs=np.int32(60))  # numpy ints pass
    assert buf.num_max_tokens_per_rank == M and type(buf.num_max_tokens_per_rank) is int
    buf.destroy()


def _refuse_options(ep, group, bad, seen, backend) -> None:
    """The CPU segment, the size, the backend and the window."""
    bad("num_cpu_bytes", lambda: ep.ElasticBuffer(group, num_cpu_bytes=1000, num_max_tokens_per_rank=M, hidden=H))
    bad("num_bytes=None needs", lambda: ep.ElasticBuffer(group))
    bad("num_bytes: expected a positive multiple", lambda: ep.ElasticBuffer(group, num_bytes=1000, backend="torch"))
    bad("backend:", lambda: ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, backend="cuda"))
    bad("num_topk: expected", lambda: ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=33))
    bad("window: expected 'auto', 'nccl' or 'ipc'",
        lambda: ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, window="shm"))
    bad("window='ipc' is the native backend's",
        lambda: ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, backend="torch", window="ipc"))
    if not torch.cuda.is_available():
        # window='ipc' asks for the native backend: where it cannot run, the reason is raised rather
        # than the torch backend silently used without the window.
        try:
            ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, window="ipc")
        except RuntimeError as e:
            assert "CUDA" in str(e) or "native" in str(e), e
            seen.append("window='ipc' without CUDA")
        else:
            raise AssertionError("window='ipc' without a GPU did not raise")
    if backend == "torch" and not ep.native_available():
        try:
            ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, backend="native")
        except (RuntimeError, ValueError) as e:
            seen.append(f"native: {e}")
        else:
            raise AssertionError("backend='native' without the native module did not raise")


def _cpp_exceptions(ep, group, seen) -> None:
    """C++ exceptions crossing into Python in a process with a live CUDA context and NCCL communicator:
    each arrives as this package's Python exception, the process survives, and the device stays usable."""
    from elastic_ep import _C

    for _ in range(3):
        try:
            _C.destroy_nccl_comm(0)
        except ValueError as e:
            assert "null" in str(e), e
        else:
            raise AssertionError("destroy_nccl_comm(0) did not raise")
    small = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="native")
    native_rt = small.runtime._rt
    small.destroy()
    for _ in range(3):
        try:
            native_rt.check_healthy()
        except _C.CommError as e:
            assert "destroyed" in str(e) and getattr(e, "where", "").startswith("health.cpp:"), (e, e.where)
        else:
            raise AssertionError("check_healthy() after destroy did not raise")
    assert torch.cuda.is_available() and (torch.ones(4, device="cuda") * 2).sum().item() == 8.0
    seen.append("C++ exceptions")


def constructor_worker(rank, world, rdzv, backend="torch"):
    from tests._dist import init_gloo, init_nccl
    from tests.elastic_ep._common import import_elastic_ep, refusal_checker

    ep = import_elastic_ep()
    group = init_nccl(rank, world, rdzv) if backend == "native" else init_gloo(rank, world, rdzv)
    seen = []
    bad = refusal_checker(seen)
    _refuse_integers(ep, group, bad)
    _refuse_options(ep, group, bad, seen, backend)
    if backend == "native":
        _cpp_exceptions(ep, group, seen)
    return len(seen)


def test_constructor_names_bad_arguments(tmp_path):
    n = run_workers(constructor_worker, 2, tmp_path=tmp_path, timeout=120)
    assert n[0] == n[1] and n[0] >= 23, n  # + window='ipc' without CUDA, native without its module


@pytest.mark.smoke
@pytest.mark.gpu
def test_constructor_names_bad_arguments_native_ep1(tmp_path):
    """The same refusals on an NCCL group with a GPU (EP=1), then C++ exceptions after a native buffer's destroy."""
    n = run_workers(constructor_worker, 1, "native", tmp_path=tmp_path, timeout=180)
    assert n[0] >= 24, n
