"""The steps of ``ElasticBuffer``'s constructor before and around its runtime: the arguments checked and
normalised on each rank (``check_options``: the backend, window and device included), then, collectively,
the group's domains and what they call for (``plan_domains``: the GIN request, the buffer's size); the
lazy import of the native runtime (``load_native``: it checks the loaded NCCL when imported), DeepEP's
``NcclCommHandle`` and the finaliser of a buffer that owns its communicator (``release_native``)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from . import _C, _checks, _domains
from ._checks import int_arg
from ._sizing import ALIGNMENT_BYTES, calculate_elastic_buffer_size

__all__ = ["Options", "check_options", "plan_domains", "load_native", "native_available", "NcclCommHandle",
           "release_native"]

_native_cache: Optional[Tuple[Any, Optional[str]]] = None


def load_native() -> Tuple[Any, Optional[str]]:
    """Import ``elastic_ep._native_runtime`` once; returns ``(module or None, reason it is unusable)``."""
    global _native_cache
    if _native_cache is None:
        if not _C.built_with_cuda():
            _native_cache = (None, "elastic_ep._C was built without CUDA (no nvcc at build time)")
        else:
            try:
                from . import _native_runtime  # noqa: WPS433 (lazy: it checks the loaded NCCL at import)
                _native_cache = (_native_runtime, None)
            except Exception as e:  # noqa: BLE001 - any import failure means "not available"
                _native_cache = (None, f"elastic_ep native backend unavailable: {type(e).__name__}: {e}")
    return _native_cache


def native_available() -> bool:
    """True when the native kernels can be used (extension built with CUDA and a GPU present)."""
    return load_native()[0] is not None and torch.cuda.is_available()


@dataclass(frozen=True)
class Options:
    """The constructor's arguments, checked (the others pass through unchanged)."""

    backend: str                        # "native" or "torch"
    window: Optional[str]               # "nccl" or "ipc" with the native backend, else None
    device: torch.device
    num_bytes: Optional[int]            # None: sized from the domains (plan_domains)
    num_cpu_bytes: int
    num_max_tokens_per_rank: int
    hidden: int
    num_topk: int
    num_allocated_qps: int              # as given (0: DeepEP's automatic count)
    num_cpu_timeout_secs: int
    num_gpu_timeout_secs: int


def _choose_backend(backend: str, window: str, pg_backend: str) -> str:
    """``"native"`` or ``"torch"`` for the arguments ``backend`` / ``window`` on a ``pg_backend`` group."""
    ipc = window == "ipc"
    if backend == "auto" and ipc:
        backend = "native"  # the window exists only there: say why if it cannot be had (below)
    if backend == "auto":
        backend = "native" if (pg_backend == "nccl" and native_available()) else "torch"
        if backend == "torch" and pg_backend == "nccl" and torch.cuda.is_available():
            # An NCCL group on a GPU would have used the native kernels: say why it cannot, once, rather
            # than run the (much slower) reference backend silently.
            warnings.warn(f"elastic_ep: backend='auto' falls back to the torch backend: {load_native()[1]}",
                          RuntimeWarning, stacklevel=4)
    if backend == "native":
        native, why = load_native()
        if native is None:
            raise RuntimeError(why)
        if not torch.cuda.is_available():
            raise RuntimeError("the native elastic_ep backend needs a CUDA GPU; none is visible")
        if pg_backend != "nccl" and not ipc:
            raise ValueError(f"group: the native backend needs an NCCL process group (or window='ipc'), got "
                             f"{pg_backend!r}")
    return backend


def check_options(pg_backend: str, num_bytes: Any, num_cpu_bytes: Any, num_max_tokens_per_rank: Any, hidden: Any,
                  num_topk: Any, use_fp8_dispatch: bool, sl_idx: Any, num_allocated_qps: Any,
                  num_cpu_timeout_secs: Any, num_gpu_timeout_secs: Any, backend: str, window: str) -> Options:
    """This rank's check of ``ElasticBuffer``'s arguments on a group of ``pg_backend`` (not collective).

    Raises:
        ValueError: a bad argument (naming it); RuntimeError: the native backend is unavailable.
    """
    num_cpu_bytes = int_arg("num_cpu_bytes", num_cpu_bytes, 0, _checks.INT64_MAX)
    if num_cpu_bytes % ALIGNMENT_BYTES:
        raise ValueError(f"num_cpu_bytes: expected a multiple of {ALIGNMENT_BYTES} (see "
                         f"get_engram_storage_size_hint), got {num_cpu_bytes}")
    if backend not in ("auto", "native", "torch"):
        raise ValueError(f"backend: expected 'auto', 'native' or 'torch', got {backend!r}")
    if window not in ("auto", "nccl", "ipc"):
        raise ValueError(f"window: expected 'auto', 'nccl' or 'ipc', got {window!r}")
    if window == "ipc" and backend == "torch":
        raise ValueError("window='ipc' is the native backend's window; backend='torch' has none")
    num_max_tokens_per_rank = int_arg("num_max_tokens_per_rank", num_max_tokens_per_rank, 0)
    hidden = int_arg("hidden", hidden, 0)
    num_topk = int_arg("num_topk", num_topk, 0)
    if num_topk > _checks.MAX_TOPK:
        raise ValueError(f"num_topk: expected 0..{_checks.MAX_TOPK}, got {num_topk}")
    if hidden % 16 if use_fp8_dispatch else hidden % 8:
        raise ValueError(f"hidden: a row must be a multiple of 16 bytes (hidden % 8 == 0 for bf16, % 16 with "
                         f"use_fp8_dispatch), got {hidden}")
    if num_bytes is not None:
        num_bytes = int_arg("num_bytes", num_bytes, 1, _checks.INT64_MAX, " (the native runtime takes an int64)")
    int_arg("sl_idx", sl_idx, 0)
    num_allocated_qps = int_arg("num_allocated_qps", num_allocated_qps, 0)
    # Whole seconds >= 1: the runtime keeps seconds as an int, where 0 means "no deadline".
    c_int = " (the native runtime takes a C int)"
    num_cpu_timeout_secs = int_arg("num_cpu_timeout_secs", num_cpu_timeout_secs, 1, _checks.INT32_MAX, c_int)
    num_gpu_timeout_secs = int_arg("num_gpu_timeout_secs", num_gpu_timeout_secs, 1, _checks.INT32_MAX, c_int)
    backend = _choose_backend(backend, window, pg_backend)
    on_gpu = pg_backend == "nccl" or backend == "native"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if num_bytes is None and (num_max_tokens_per_rank <= 0 or hidden <= 0):
        raise ValueError("num_bytes=None needs num_max_tokens_per_rank > 0 and hidden > 0 to size the "
                         f"buffer, got num_max_tokens_per_rank={num_max_tokens_per_rank}, hidden={hidden}")
    if num_bytes is not None and num_bytes % ALIGNMENT_BYTES:
        raise ValueError(f"num_bytes: expected a positive multiple of {ALIGNMENT_BYTES} "
                         f"(see get_buffer_size_hint), got {num_bytes}")
    return Options(backend, ("ipc" if window == "ipc" else "nccl") if backend == "native" else None, device,
                   num_bytes, num_cpu_bytes, num_max_tokens_per_rank, hidden, num_topk, num_allocated_qps,
                   num_cpu_timeout_secs, num_gpu_timeout_secs)


def plan_domains(group: dist.ProcessGroup, o: Options, num_scaleup_override: Optional[int], use_fp8_dispatch: bool,
                 allow_hybrid_mode: bool, allow_multiple_reduction: bool,
                 sl_idx: int) -> Tuple[_domains.Domains, int, Optional[Dict[str, Any]], int]:
    """Collective: the group's domains, then what they call for.

    Returns:
        ``(domains, num_allocated_qps, the native runtime's GIN request or None, num_bytes)``.
    """
    domains = _domains.detect(group, allow_hybrid_mode, num_scaleup_override)
    # DeepEP's automatic count (hybrid allowed: 129, or 65 with MT4131 NICs, which a machine without RDMA
    # lacks; direct: 17): the GIN contexts of hybrid mode across nodes, and what get_theoretical_num_qps
    # and the num_qps bound read.
    num_allocated_qps = _domains.num_allocated_qps(allow_hybrid_mode, o.num_allocated_qps)
    gin_request = None
    if o.backend == "native":
        from . import _nccl  # noqa: WPS433 (the native module, loaded by now, imported it)

        # Several NVLink domains need GIN (say what is missing); the override needs none.
        ipc = o.window == "ipc"
        gin = _nccl.railed_gin_type(group) if domains.num_rdma_ranks > 1 and not ipc else None
        gin_request = _domains.native_gin_request(domains, ipc, gin, _nccl.nccl_version(), num_allocated_qps,
                                                  sl_idx, o.num_cpu_bytes)
        if gin_request is not None and not _C.built_with_gin():
            # Before any communicator is made: the runtime would refuse it only after creating two.
            raise RuntimeError("hybrid mode across NVLink domains needs the GIN scale-out transport, which this "
                               "build of elastic_ep leaves out (it has not run on a real network yet): rebuild it "
                               "with the CMake option ELASTIC_EP_GIN=ON (pip install --no-build-isolation "
                               "-Ccmake.define.ELASTIC_EP_GIN=ON packages/elastic_ep)")
    num_bytes = o.num_bytes
    if num_bytes is None:
        num_bytes = calculate_elastic_buffer_size(dist.get_world_size(group), o.num_max_tokens_per_rank, o.hidden,
                                                  o.num_topk, use_fp8_dispatch, allow_hybrid_mode,
                                                  allow_multiple_reduction, domains.num_scaleup_ranks)
    return domains, num_allocated_qps, gin_request, int(num_bytes)


class NcclCommHandle:
    """DeepEP's ``ElasticBuffer.nccl_comm_handle``: ``get()`` is the buffer's ``ncclComm_t`` as an int
    (0 without an NCCL communicator: the torch runtime, or the CUDA-IPC window)."""

    __slots__ = ("_comm",)

    def __init__(self, comm: int) -> None:
        self._comm = comm

    def get(self) -> int:
        return self._comm

    def __repr__(self) -> str:
        return f"NcclCommHandle({self._comm:#x})"


def release_native(runtime: Any, comm: int) -> None:
    """Finaliser of a buffer with its own communicator: the window first, then the communicator."""
    from . import _nccl  # noqa: WPS433 (loaded with the native runtime)

    try:
        runtime.destroy()
    finally:
        _nccl.destroy_nccl_comm(comm)
