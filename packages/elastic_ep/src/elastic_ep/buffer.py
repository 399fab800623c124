"""``ElasticBuffer``: DeepEP V2's ``deep_ep.ElasticBuffer`` API for MoE dispatch/combine in one NVLink domain.

A DeepEP user changes only the import: ``ElasticBuffer(group, num_max_tokens_per_rank=..., hidden=...,
num_topk=...)``, then per MoE layer::

    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buf.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=E)
    y = experts(recv_x, recv_topk_idx)             # rows of this rank's experts
    combined_x, combined_w, event = buf.combine(y, handle)

* ``x``: ``[T, H]`` bf16, or ``(x_fp8 [T, H] float8_e4m3fn, sf [T, P])`` with FP32 scales or int32 packs
  of four UE8M0 exponents; ``topk_idx``: ``[T, K]`` int64 (or int32) global expert ids (-1 = masked);
  ``topk_weights``: ``[T, K]`` float32. Expert ``e`` lives on rank ``e // (E / R)``.
* Non-expand output: one row per received token, grouped by source rank; ``recv_topk_idx`` holds local
  expert ids, -1 where the expert lives elsewhere. Expand output (``do_expand=True``): one row per
  (token, local expert) in per-expert segments starting at multiples of ``expert_alignment``.
* Without CPU sync (``do_cpu_sync=False``, e.g. inside a CUDA graph) outputs have the worst-case row
  count and the real counts stay on the GPU (``handle.psum_num_recv_tokens_per_scaleup_rank[-1]``).
* ``combine`` sums, in fp32 and in DeepEP's order, the biases and the rows each token's expert ranks
  send back, and rounds to bf16 once. It does not apply top-k weights; it routes them back.
* ``deterministic=True`` sorts received rows by source token (inside each expert segment in expand
  mode); ``handle.recv_src_metadata`` then describes the sorted rows, as in DeepEP.

Each call is validated once (``_checks``) into typed arguments for the buffer's runtime
(``_runtime.Runtime``): ``"native"`` (``_native_runtime``: C++/CUDA kernels over an NCCL or CUDA-IPC
window) or ``"torch"`` (``_torch_runtime``: ``torch.distributed`` collectives, gloo included);
``backend="auto"`` picks native for NCCL groups when the kernels are built. DeepEP's AGRS, PP and Engram
methods come from ``_ops_agrs_pp_engram`` (the torch runtime implements them).
"""
from __future__ import annotations

import itertools
import math
import warnings
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _C, _checks, _domains, _env, _nvml
from . import _ops_agrs_pp_engram as _ops
from ._checks import int_arg
from ._domains import get_logical_domain_size, get_physical_domain_size
from ._events import EventHandle, EventOverlap
from ._handle import EPHandle

__all__ = ["ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap", "NcclCommHandle", "native_available",
           "calculate_elastic_buffer_size", "get_elastic_buffer_alignment", "get_physical_domain_size",
           "get_logical_domain_size"]

ALIGNMENT_BYTES = int(_C.get_elastic_buffer_alignment())
_native_cache: Optional[Tuple[Any, Optional[str]]] = None
_BUFFER_SERIALS = itertools.count(1)


def _load_native() -> Tuple[Any, Optional[str]]:
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
    return _load_native()[0] is not None and torch.cuda.is_available()


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


def calculate_elastic_buffer_size(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                                  use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                                  allow_multiple_reduction: bool = True, num_nvl_ranks: Optional[int] = None, *,
                                  zero_copy: bool = False) -> int:
    """Bytes of the buffer for a configuration (DeepEP V2's ``calculate_buffer_size``, computed by ``_C``).

    Arguments:
        num_ranks: ranks in the group.
        num_max_tokens_per_rank: most tokens any rank dispatches at once.
        hidden: hidden size.
        num_topk: experts per token; 0 sizes for the worst case (32).
        use_fp8_dispatch: FP8 rows plus scale packs (one 4-byte pack per 32 elements).
        allow_hybrid_mode, allow_multiple_reduction: as the buffer's options.
        num_nvl_ranks: ranks inside one NVLink domain (default: all of them).
        zero_copy: also room for ``dispatch(zero_copy=True)`` (its receive area after the records and
            the combine area; ours, not DeepEP's).

    Returns:
        The 2 MiB-aligned maximum of the dispatch and combine layouts (with ``zero_copy``: at least the
        zero-copy layout's size).
    """
    # Only None means "all of them": 0 is a bad count, not the default.
    R, M, H, K, nvl = _checks.c_ints(num_ranks=num_ranks, num_max_tokens_per_rank=num_max_tokens_per_rank,
                                     hidden=hidden, num_topk=num_topk,
                                     num_nvl_ranks=num_ranks if num_nvl_ranks is None else num_nvl_ranks)
    size = int(_C.calculate_elastic_buffer_size(R, M, H, K, bool(use_fp8_dispatch), bool(allow_hybrid_mode),
                                                bool(allow_multiple_reduction), nvl))
    if zero_copy:
        k = K or _checks.MAX_TOPK
        packs = (H + 31) // 32 if use_fp8_dispatch else 0
        size = max(size, _checks.zero_copy_layout(0, R, M, H, 1 if use_fp8_dispatch else 2, packs, k,
                                                  bool(allow_multiple_reduction))[1])
    return size


def get_elastic_buffer_alignment() -> int:
    """The alignment every buffer size has: 2 MiB (``ALIGNMENT_BYTES``), as DeepEP's."""
    return ALIGNMENT_BYTES


def _release_native(runtime: Any, destroy_comm: Any, comm: int) -> None:
    """Finaliser of a buffer with its own communicator: the window first, then the communicator."""
    try:
        runtime.destroy()
    finally:
        destroy_comm(comm)


class ElasticBuffer(_ops.AgrsPpEngramOps):
    """Expert-parallel dispatch/combine buffer, API-compatible with DeepEP V2's ``ElasticBuffer``.

    Arguments:
        group: the process group of the expert-parallel ranks (NCCL for GPUs; gloo with the torch backend
            or the IPC window).
        num_bytes: buffer bytes; None sizes it from ``num_max_tokens_per_rank``/``hidden``/``num_topk``.
        num_cpu_bytes: bytes of this rank's CPU (Engram) segment, a multiple of 2 MiB (0: none;
            ``get_engram_storage_size_hint`` sizes it); native: pinned shared host memory every GPU of
            the node reads (one node only).
        num_max_tokens_per_rank: most tokens a rank dispatches at once (required when ``num_bytes`` is None).
        hidden, num_topk (0: sized for 32), use_fp8_dispatch: what the buffer is sized for.
        deterministic: sort received rows by source token (see the module docstring).
        allow_hybrid_mode: hybrid mode (scale-out + scale-up, see the README's "Domains and hybrid mode")
            where the group spans several domains or ``ELASTIC_EP_NUM_SCALEUP_RANKS`` splits it.
        allow_multiple_reduction: combine reduces per rank before sending (fewer bytes, rounding once more).
        prefer_overlap_with_compute: as in DeepEP, changes ``get_theoretical_num_sms`` (at least 64 SMs
            when False), the SM count of calls with ``num_sms=0``.
        sl_idx, num_allocated_qps: RDMA settings: in hybrid mode across NVLink domains the GIN traffic
            class and context count of the device communicator; ``num_allocated_qps`` (0: DeepEP's
            automatic 129 with hybrid mode allowed, else 17) also bounds ``num_qps`` as in DeepEP.
        num_cpu_timeout_secs: how long the host waits (counts, barriers) before raising ``TimeoutError``.
        num_gpu_timeout_secs: how long a kernel waits for a peer before recording a timeout.
        explicitly_destroy: require an explicit ``destroy()`` (else the buffer is freed with the object).
        backend: ``"auto"``, ``"native"`` or ``"torch"`` (keyword only; not in DeepEP).
        window: the native backend's window (keyword only; not in DeepEP): ``"nccl"`` (``"auto"``): an
            NCCL symmetric window, on torch's communicator of ``group`` or a new one; ``"ipc"``:
            cudaMalloc'ed memory shared by CUDA IPC over ``group`` (which may then be gloo), for GPUs
            with CUDA peer access or ranks that share a GPU.

    Raises:
        ValueError: bad arguments; RuntimeError: the native backend was requested but is unavailable.
        The constructor is collective and raises on every rank when any rank's arguments are refused:
        that rank its own error, the others one naming it (``ValueError`` or ``RuntimeError`` as well).
    """

    #: The handles' ``buffer_id``: a serial number the constructor sets (>= 1, never reused in the process,
    #: unlike ``id(self)``). 0 only on an object made without the constructor (as the diagnostic tools do).
    _serial = 0
    #: Dispatches made on this buffer; a zero-copy handle's views are those of dispatch ``views_serial``.
    _dispatch_serial = 0

    def __init__(self, group: dist.ProcessGroup, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True,
                 sl_idx: int = 3, num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300,
                 num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False, *,
                 backend: str = "auto", window: str = "auto") -> None:
        if group is None:
            raise ValueError("group: expected a torch.distributed ProcessGroup, got None")
        self.group = group
        self.rank = self.rank_idx = dist.get_rank(group)  # rank_idx: DeepEP's name
        self.num_ranks = dist.get_world_size(group)
        pg_backend = dist.get_backend(group)
        self._serial = next(_BUFFER_SERIALS)
        self.destroyed = False
        self._owned_comm = 0
        self._comm_finalizer = None
        self.nccl_comm, self.comm_source = 0, None
        # Each rank checks its own arguments, then every rank learns the others' outcome before anything
        # collective: a rank whose arguments are refused must not leave its peers in this constructor's
        # collectives, where its next call would complete them or they would wait for the group's timeout.
        err, native = None, None
        try:
            self._settings = _env.Settings.read()
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
            ipc = window == "ipc"
            if backend == "auto" and ipc:
                backend = "native"  # the window exists only there: say why if it cannot be had (below)
            if backend == "auto":
                backend = "native" if (pg_backend == "nccl" and native_available()) else "torch"
                if backend == "torch" and pg_backend == "nccl" and torch.cuda.is_available():
                    # An NCCL group on a GPU would have used the native kernels: say why it cannot, once,
                    # rather than run the (much slower) reference backend silently.
                    warnings.warn(f"elastic_ep: backend='auto' falls back to the torch backend: {_load_native()[1]}",
                                  RuntimeWarning, stacklevel=2)
            if backend == "native":
                native, why = _load_native()
                if native is None:
                    raise RuntimeError(why)
                if not torch.cuda.is_available():
                    raise RuntimeError("the native elastic_ep backend needs a CUDA GPU; none is visible")
                if pg_backend != "nccl" and not ipc:
                    raise ValueError(f"group: the native backend needs an NCCL process group (or window='ipc'), got "
                                     f"{pg_backend!r}")
            self.backend = backend
            on_gpu = pg_backend == "nccl" or backend == "native"
            self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
            self.window = ("ipc" if ipc else "nccl") if backend == "native" else None
            if num_bytes is None and (num_max_tokens_per_rank <= 0 or hidden <= 0):
                raise ValueError("num_bytes=None needs num_max_tokens_per_rank > 0 and hidden > 0 to size the "
                                 f"buffer, got num_max_tokens_per_rank={num_max_tokens_per_rank}, hidden={hidden}")
            if num_bytes is not None and num_bytes % ALIGNMENT_BYTES:
                raise ValueError(f"num_bytes: expected a positive multiple of {ALIGNMENT_BYTES} "
                                 f"(see get_buffer_size_hint), got {num_bytes}")
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            err = e
        _checks.raise_if_any_rank_failed(group, err, "ElasticBuffer: creating the buffer")
        # The domains (collective: every rank's node), then the size they call for.
        try:
            self.domains = _domains.detect(group, allow_hybrid_mode, self._settings.num_scaleup_ranks)
            # DeepEP's automatic count (hybrid allowed: 129, or 65 with MT4131 NICs, which a machine without
            # RDMA lacks; direct: 17): the GIN contexts of hybrid mode across nodes, and what
            # get_theoretical_num_qps and the num_qps bound read.
            self.num_allocated_qps = _domains.num_allocated_qps(allow_hybrid_mode, num_allocated_qps)
            gin_request = None
            if backend == "native":
                # Several NVLink domains need GIN (say what is missing); the override needs none.
                gin = native.railed_gin_type(group) if self.domains.num_rdma_ranks > 1 and not ipc else None
                gin_request = _domains.native_gin_request(self.domains, ipc, gin, native.nccl_version(),
                                                          self.num_allocated_qps, sl_idx, num_cpu_bytes)
            if num_bytes is None:
                num_bytes = calculate_elastic_buffer_size(self.num_ranks, num_max_tokens_per_rank, hidden, num_topk,
                                                          use_fp8_dispatch, allow_hybrid_mode,
                                                          allow_multiple_reduction, self.domains.num_scaleup_ranks)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            err = e
        _checks.raise_if_any_rank_failed(group, err, "ElasticBuffer: the group's domains")
        self.num_bytes, self.num_cpu_bytes = int(num_bytes), num_cpu_bytes
        self.num_max_tokens_per_rank, self.hidden, self.num_topk = num_max_tokens_per_rank, hidden, num_topk
        self.use_fp8_dispatch, self.deterministic = use_fp8_dispatch, deterministic
        self.allow_hybrid_mode, self.allow_multiple_reduction = allow_hybrid_mode, allow_multiple_reduction
        self.prefer_overlap_with_compute, self.explicitly_destroy = prefer_overlap_with_compute, explicitly_destroy
        self.num_cpu_timeout_secs, self.num_gpu_timeout_secs = num_cpu_timeout_secs, num_gpu_timeout_secs
        if self._settings.buffer_debug:  # DeepEP's switch for the same report
            print(f"elastic_ep: rank {self.rank}/{self.num_ranks}: buffer of {self.num_bytes} bytes, "
                  f"backend {self.backend}", flush=True)
        self._device_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                            if self.device.type == "cuda" else 132)
        self._max_sms = self._device_sms if self.backend == "native" else None
        self._sms_cache: Dict[Tuple[int, int], int] = {}
        self._routing_cache: Dict[tuple, Tuple[int, int]] = {}
        self._need_cache: Dict[tuple, int] = {}
        self._combine_need_cache: Dict[tuple, int] = {}
        self._pp_max_bytes = 0  # pp_set_config's num_max_tensor_bytes (0: not configured)
        self._engram_shape: Tuple[int, ...] = ()  # (entries per rank, hidden, element size) after engram_write
        # AGRS session state (agrs_set_config / create_agrs_session / all_gather).
        self._agrs_region: Optional[torch.Tensor] = None
        self._agrs_max_gathers = 0
        self._agrs_in_session = False
        self._agrs_offset = self._agrs_slot = self._agrs_session_idx = 0
        if self.backend == "native":
            self.runtime, self.nccl_comm, self._owned_comm, self.comm_source = native.NativeRuntime.create(
                group, self.num_bytes, allow_multiple_reduction, num_cpu_timeout_secs, num_gpu_timeout_secs,
                explicitly_destroy, self.window, self._settings, self._serial,
                num_scaleup_ranks=self.domains.num_scaleup_ranks if self.domains.hybrid else 0, gin=gin_request)
            if self._owned_comm and not explicitly_destroy:
                # Freed with the object, as promised: the runtime's window, then the communicator under it
                # (never at interpreter exit: peers may be gone by then, and the exit releases both).
                self._comm_finalizer = weakref.finalize(self, _release_native, self.runtime, native.destroy_nccl_comm,
                                                        self._owned_comm)
                self._comm_finalizer.atexit = False
            if num_cpu_bytes:
                self.runtime.open_engram(group, num_cpu_bytes)
        else:
            from ._torch_runtime import TorchRuntime
            self.runtime = TorchRuntime(group, allow_multiple_reduction, num_cpu_timeout_secs, self._settings,
                                        self._serial, self.domains)
        self.nccl_comm_handle = NcclCommHandle(self.nccl_comm)
        # DeepEP's logical and physical rank indices.
        d = self.domains
        self.num_scaleout_ranks, self.num_scaleup_ranks = d.logical
        self.scaleout_rank_idx, self.scaleup_rank_idx = d.scaleout_rank_idx, d.scaleup_rank_idx
        self.num_rdma_ranks, self.num_nvlink_ranks = d.physical
        dist.barrier(group=group)

    # ------------------------------------------------------------------ sizing
    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True, *, zero_copy: bool = False) -> int:
        """Bytes a buffer needs for this configuration on ``group`` (2 MiB aligned): DeepEP's
        ``calculate_buffer_size`` (``zero_copy``: with room for ``dispatch(zero_copy=True)`` too).

        Not collective, so it cannot ask the other ranks for their nodes: the scale-up domain is
        ``ELASTIC_EP_NUM_SCALEUP_RANKS`` when set, else the launcher's ranks per node
        (``LOCAL_WORLD_SIZE``, torchrun's) with hybrid mode allowed, else every rank
        (``_domains.local_scaleup_ranks``). A buffer created with ``num_bytes=None`` sizes itself from
        the domains it detects."""
        R = dist.get_world_size(group)
        U = _domains.local_scaleup_ranks(R, bool(allow_hybrid_mode), _env.num_scaleup_ranks(),
                                         _env.local_world_size())
        return calculate_elastic_buffer_size(R, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                             allow_hybrid_mode, allow_multiple_reduction, U, zero_copy=zero_copy)

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: torch.dtype = torch.bfloat16) -> Tuple[int, int]:
        """``(num_gpu_bytes, num_cpu_bytes)`` an Engram storage would need (DeepEP's hint): entries of ``hidden`` elements rounded up to 32 B, ``num_max_tokens_per_rank``
        on the GPU and ``num_entries`` on the CPU, each total 2 MiB-aligned."""
        num_entries, hidden = int_arg("num_entries", num_entries, 0), int_arg("hidden", hidden, 0)
        num_max_tokens_per_rank = int_arg("num_max_tokens_per_rank", num_max_tokens_per_rank, 0)
        entry = _align(hidden * _checks.itemsize(dtype), 32)
        return _align(entry * num_max_tokens_per_rank, ALIGNMENT_BYTES), _align(entry * num_entries, ALIGNMENT_BYTES)

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """Bytes PP send/recv would need (DeepEP's hint): four regions of
        ``num_max_inflight_tensors`` slots of ``num_max_tensor_bytes`` rounded up to 32 B, 2 MiB-aligned."""
        num_max_tensor_bytes = int_arg("num_max_tensor_bytes", num_max_tensor_bytes, 0)
        num_max_inflight_tensors = int_arg("num_max_inflight_tensors", num_max_inflight_tensors, 0)
        return _align(4 * num_max_inflight_tensors * _align(num_max_tensor_bytes, 32), ALIGNMENT_BYTES)

    @staticmethod
    def get_agrs_num_max_session_bytes(group: dist.ProcessGroup,
                                       shapes: Union[Tuple[int, ...], Sequence[Tuple[int, ...]]],
                                       dtype: torch.dtype) -> int:
        """Bytes one AGRS session gathering tensors of ``shapes`` (one shape or a sequence of them) would
        use (DeepEP's hint): the sum of ``ranks x elements x itemsize``, each rounded up to 32 B."""
        if not _checks.is_sequence(shapes) or not shapes:
            raise ValueError(f"shapes: expected a shape or a non-empty sequence of shapes, got {shapes!r}")
        if not _checks.is_sequence(shapes[0]):  # one shape (a torch.Size starts with an int too)
            shapes = (shapes,)
        for i, shape in enumerate(shapes):
            if not _checks.is_sequence(shape):
                raise ValueError(f"shapes[{i}]: expected a shape (a sequence of ints), got {shape!r}")
            for d in shape:
                int_arg(f"shapes[{i}]", d, 0)
        size = _checks.itemsize(dtype)
        R = dist.get_world_size(group)
        return sum(_align(R * math.prod(s) * size, 32) for s in shapes)

    @staticmethod
    def get_agrs_buffer_size_hint(group: dist.ProcessGroup, num_max_session_bytes: int) -> int:
        """``num_max_session_bytes`` rounded up to 2 MiB (DeepEP's AGRS buffer hint)."""
        return _align(int_arg("num_max_session_bytes", num_max_session_bytes, 0), ALIGNMENT_BYTES)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """SMs that keep the bottleneck link busy for a balanced gate (DeepEP's bandwidth model); what
        ``dispatch`` / ``combine`` use for ``num_sms=0``, leaving the other SMs to overlapped compute.

        The model (``_domains.theoretical_num_sms``): direct mode is bound by NVLink; hybrid mode by the
        slower of the network (a token crosses it once per remote domain) and NVLink (the forwarders'
        fan-out). The count is that need plus 25 %, even, at least 4, at least 64 when
        ``prefer_overlap_with_compute`` is False, at most the device's SMs (all of them at EP 1).
        ``ELASTIC_EP_NUM_SMS`` overrides it.

        Arguments:
            num_experts: all experts (a multiple of the rank count); num_topk: experts per token.
            num_scaleout_topk: hybrid mode: domains a token reaches (a node-limited gate's limit, e.g.
                DeepSeek-V3's 4); 0: the balanced gate's expectation. Must be 0 in direct mode.
            rdma_gbs: scale-out GB/s per GPU; 0: NVLink's on the NVLink-emulated scale-out, else
                ``_domains.NIC_GBS`` (one 400 Gb/s NIC per GPU at 90 %).
            nvlink_gbs: NVLink GB/s per direction; 0: from NVML (active links x speed x 0.9, as DeepEP
                reads ``nvidia-smi``), 450 where NVML cannot tell.
            sm_read_gbs, sm_write_gbs: what one SM reads from HBM / writes to a peer, GB/s.

        Raises:
            ValueError: a bad argument (naming it).
        """
        num_experts, num_topk = int_arg("num_experts", num_experts), int_arg("num_topk", num_topk)
        num_scaleout_topk = int_arg("num_scaleout_topk", num_scaleout_topk, 0)
        if num_scaleout_topk and not self.domains.hybrid:
            raise ValueError(f"num_scaleout_topk: expected 0 in direct mode (one scale-out domain), got "
                             f"{num_scaleout_topk}")
        if num_scaleout_topk > self.domains.num_scaleout_ranks:
            raise ValueError(f"num_scaleout_topk: expected at most the {self.domains.num_scaleout_ranks} scale-out "
                             f"domains, got {num_scaleout_topk}")
        nvlink_gbs = _checks.real_arg("nvlink_gbs", nvlink_gbs, 0)
        rdma_gbs = _checks.real_arg("rdma_gbs", rdma_gbs, 0)
        sm_read_gbs = _checks.real_arg("sm_read_gbs", sm_read_gbs, 0, lo_inclusive=False)
        sm_write_gbs = _checks.real_arg("sm_write_gbs", sm_write_gbs, 0, lo_inclusive=False)
        if self._settings.num_sms:
            return self._settings.num_sms
        R = self.num_ranks
        if num_experts <= 0 or num_experts % R or not 0 < num_topk <= num_experts:
            raise ValueError(f"num_experts / num_topk: expected a positive multiple of {R} experts and 1.."
                             f"num_experts per token, got {num_experts} / {num_topk}")
        if R == 1:
            return self._device_sms
        if not nvlink_gbs:
            props = torch.cuda.get_device_properties(self.device) if self.device.type == "cuda" else None
            nvlink_gbs = _nvml.nvlink_gbs(_nvml.pci_bus_id(props))
        if not rdma_gbs:
            rdma_gbs = nvlink_gbs if self.domains.num_rdma_ranks == 1 else _domains.NIC_GBS
        need = _domains.theoretical_num_sms(self.domains, num_experts, num_topk, num_scaleout_topk, rdma_gbs,
                                            nvlink_gbs, sm_read_gbs, sm_write_gbs)
        n = max(4, math.ceil(need * 1.25))
        n += n % 2
        if not self.prefer_overlap_with_compute:
            n = max(n, 64)
        return min(n, self._device_sms)

    def _sms_for(self, num_experts: int, num_topk: int) -> int:
        """The SM count of a call with ``num_sms=0`` (cached per shape)."""
        key = (num_experts, num_topk)
        n = self._sms_cache.get(key)
        if n is None:
            n = self._sms_cache[key] = self.get_theoretical_num_sms(num_experts, min(num_topk, num_experts))
        return n

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """RDMA queue pairs for ``num_sms`` SMs as DeepEP computes them (what a GIN backend opens):
        ``16 * num_sms + 1`` with hybrid mode allowed, else ``min(num_sms, 9)``; at most ``num_allocated_qps``."""
        return _domains.theoretical_num_qps(self.allow_hybrid_mode, int_arg("num_sms", num_sms, 0),
                                            self.num_allocated_qps)

    # ------------------------------------------------------------------ info / lifecycle
    def _check_alive(self) -> None:
        if self.destroyed:
            raise RuntimeError("this ElasticBuffer was destroyed; create a new one")

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The stream the communication kernels run on (None for the torch backend on a CPU group)."""
        self._check_alive()
        return self.runtime.get_comm_stream()

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``: NVLink domains and ranks per domain (``_domains``)."""
        return self.domains.physical

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``: ``(1, R)`` in direct mode; hybrid mode with several
        NVLink domains, or with ``ELASTIC_EP_NUM_SCALEUP_RANKS`` (``_domains``)."""
        return self.domains.logical

    @staticmethod
    def capture() -> EventHandle:
        """An ``EventHandle`` recorded on the current stream (for ``previous_event`` arguments), as DeepEP's."""
        return EventHandle()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """A barrier of all ranks on the GPU (on the comm stream by default; ``with_cpu_sync``: the device
        is synchronised before and after, a full CPU barrier; ``sequential``: DeepEP's flag, accepted)."""
        self._check_alive()
        self.runtime.barrier(use_comm_stream, with_cpu_sync, sequential)

    def destroy(self) -> None:
        """Finishes all work on every rank and releases the buffer (collective). A second call does
        nothing. Unlike DeepEP it does not require ``explicitly_destroy=True``."""
        if self.destroyed:
            return
        self.destroyed = True
        try:
            self.runtime.destroy()
        finally:
            self._abort_owned_comm()

    def _abort_owned_comm(self) -> None:
        """Aborts the communicator this buffer made for itself (local, never blocks), once."""
        if self._comm_finalizer is not None:
            self._comm_finalizer.detach()
            self._comm_finalizer = None
        comm, self._owned_comm = self._owned_comm, 0
        if comm:
            _load_native()[0].destroy_nccl_comm(comm)

    def __enter__(self) -> "ElasticBuffer":
        self._check_alive()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.destroyed:
            self.destroy()

    # ------------------------------------------------------------------ dispatch / combine
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: Union[None, EventHandle, EventOverlap] = None,
                 previous_event_before_epilogue: Union[None, EventHandle, EventOverlap] = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True,
                 do_cpu_sync: Optional[bool] = None, do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False, zero_copy: bool = False):
        """Send every token to the ranks that own its top-k experts.

        Arguments:
            x: ``[T, H]`` bf16, or ``(x [T, H] float8_e4m3fn, sf [T, P] float32 | int32)``.
            topk_idx: ``[T, K]`` int64 (or int32) global expert ids, -1 masked. None in cached mode.
            topk_weights: ``[T, K]`` float32, or None.
            cumulative_local_expert_recv_stats: ``[E / R]`` int32, incremented by the received counts.
            num_experts: total experts E (divisible by the rank count); from ``handle`` in cached mode.
            num_max_tokens_per_rank: the most tokens any rank sends in this call (default: the
                buffer's); a larger value is accepted while the buffer is big enough for it.
            expert_alignment: per-expert row alignment (default 1; from ``handle`` in cached mode).
            num_sms: SMs for the kernels (0: ``get_theoretical_num_sms``, as DeepEP, or
                ``ELASTIC_EP_NUM_SMS``); kept in the handle for ``combine``.
            num_qps: RDMA queue pairs: no effect, but more than ``num_allocated_qps`` raises (as DeepEP).
            previous_event: start only after this event, an ``EventHandle`` (``capture()``) or an
                ``EventOverlap`` (needs ``allocate_on_comm_stream=True``).
            previous_event_before_epilogue: the copy epilogue waits for this event (the same types).
            async_with_compute_stream: return an event instead of making the current stream wait.
            allocate_on_comm_stream: allocate outputs on the communication stream.
            handle: an earlier dispatch's handle: cached mode (same routing, no counting).
            do_handle_copy: keep a copy of ``topk_idx`` in the handle.
            do_cpu_sync: exact-size outputs after the CPU waits for the counts; default: True unless
                cached or capturing a CUDA graph (where True raises ``ValueError``).
            do_expand: one row per (token, local expert), segments aligned to ``expert_alignment``.
            do_zero_padding: zero the alignment gaps (expand mode only).
            use_tma_aligned_col_major_sf: return ``recv_sf`` column-major with rows padded to 4.
            zero_copy: return ``recv_x`` as a view of this buffer's receive area, which the senders
                wrote in place (no copy epilogue for the hidden bytes; ours, not DeepEP's). Non-expanded
                layout only; the buffer needs ``get_buffer_size_hint(..., zero_copy=True)`` bytes. The
                view is valid until the next ``dispatch`` on this buffer (a ``combine`` keeps it) and
                until the buffer is destroyed; ``combine`` or a cached dispatch given the handle after a
                later dispatch raises ``ValueError``. Clone ``recv_x`` to keep it longer. The torch
                reference runtime returns a plain tensor under the same rules.

        Returns:
            ``(recv_x | (recv_x, recv_sf), recv_topk_idx, recv_topk_weights, handle, event)``.

        Raises:
            ValueError: any bad input, before anything is launched, except expert ids outside
                ``[-1, num_experts)``, which only the GPU reads: with a CPU sync the dispatch is refused
                on every rank before any token moves (the buffer stays usable); without one they are
                treated as masked and the next call on this buffer raises, on this rank only (in a
                multi-rank job the peers' next operation then times out and the buffer must be
                recreated on every rank; ``ELASTIC_EP_SKIP_INDEX_CHECK=1``: masked silently).
            CommError: the buffer is unusable (an earlier operation timed out or was interrupted
                between its kernels); destroy it and create a new one.
        """
        self._check_alive()
        a = _checks.dispatch_args(self, x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                                  num_max_tokens_per_rank, expert_alignment, num_sms, num_qps, previous_event,
                                  previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream,
                                  handle, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding,
                                  use_tma_aligned_col_major_sf, zero_copy)
        self._dispatch_serial += 1  # before the call: a dispatch that raised may have written the area too
        recv_x, recv_sf, recv_topk_idx, recv_w, h, event = self.runtime.dispatch(a)
        h.views_serial = self._dispatch_serial if a.zero_copy else 0
        overlap = EventOverlap(event)
        if self.deterministic:
            cached = a.handle is not None

            def sort() -> None:
                # On the current stream, after it waited for the communication: the tensors returned
                # are the sorted ones.
                h.deterministic_sort(a.do_cpu_sync, cached, recv_x, recv_sf, recv_topk_idx, recv_w, None)

            if async_with_compute_stream and event is not None:
                # As DeepEP: the sort runs when the caller waits on the event (the outputs may not be read
                # before that anyway), so the communication still overlaps the caller's compute.
                overlap.register_hook_after_wait(sort)
            else:
                if event is not None:
                    event.current_stream_wait()
                sort()
        return (recv_x, recv_sf) if recv_sf is not None else recv_x, recv_topk_idx, recv_w, h, overlap

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Sequence[Optional[torch.Tensor]]] = None,
                num_sms: int = 0, num_qps: int = 0,
                previous_event: Optional[EventOverlap] = None,
                previous_event_before_epilogue: Optional[EventOverlap] = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """Return each received row to its source token and sum them (the reverse of ``dispatch``).

        Arguments:
            x: ``[N, H]`` bf16 expert outputs in the layout ``dispatch`` returned (``[N_exp, H]`` if expanded).
            handle: the ``EPHandle`` of that dispatch.
            topk_weights: ``[N, K]`` (``[N_exp]`` expanded) float32 to route back, or None.
            bias: None, one ``[T, H]`` bf16 tensor, or a pair (either may be None), added in fp32.
            num_sms (0: the dispatch's), num_qps, previous_event, previous_event_before_epilogue,
            async_with_compute_stream, allocate_on_comm_stream: as ``dispatch``.

        Returns:
            ``(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None, EventOverlap)``.

        Raises:
            ValueError: any bad input, before anything is launched.
        """
        self._check_alive()
        a = _checks.combine_args(self, x, handle, topk_weights, bias, num_sms, num_qps, previous_event,
                                 previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream)
        perm = handle.perm
        if perm is not None:  # deterministic mode: back to the runtime's row order
            # The scatter runs on the current stream. With previous_event the communication stream waits
            # for that event only, so the scatter comes after it and a new event, after the scatter, takes
            # its place (found at EP 2: the comm stream read half-scattered weights).
            if a.previous_event is not None:
                a.previous_event.current_stream_wait()
            raw = torch.empty_like(a.x)
            raw[perm] = a.x
            a.x = raw
            if a.topk_weights is not None:
                raw_w = torch.empty_like(a.topk_weights)
                raw_w[perm] = a.topk_weights
                a.topk_weights = raw_w
            if a.previous_event is not None:
                a.previous_event = self.capture()
        combined_x, combined_w, event = self.runtime.combine(a)
        return combined_x, combined_w, EventOverlap(event)


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a
