"""DeepEP V2-compatible ``ElasticBuffer``: MoE dispatch/combine inside one NVLink domain.

A DeepEP user changes only the import: ``ElasticBuffer(group, num_max_tokens_per_rank=..., hidden=...,
num_topk=...)``, then per MoE layer::

    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buf.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=E)
    y = experts(recv_x, recv_topk_idx)             # rows of this rank's experts
    combined_x, combined_w, event = buf.combine(y, handle)

Data layout
-----------
* ``x``: ``[T, H]`` bf16, or ``(x_fp8 [T, H] float8_e4m3fn, sf [T, P])`` with FP32 scales or int32
  packs of four UE8M0 exponents; ``topk_idx``: ``[T, K]`` int64 global expert ids (-1 = masked);
  ``topk_weights``: ``[T, K]`` float32. Expert ``e`` lives on rank ``e // (E / R)``.
* Non-expand output: one row per received token, grouped by source rank (rank order);
  ``recv_topk_idx`` holds local expert ids, -1 where the expert lives elsewhere.
* Expand output (``do_expand=True``): one row per (token, local expert), each expert's rows in a
  segment starting at a multiple of ``expert_alignment``; ``recv_topk_idx`` is None and
  ``recv_topk_weights`` is ``[N_exp]``; ``handle.num_recv_tokens_per_expert_list`` has the aligned
  segment sizes. ``do_zero_padding`` zeroes the alignment gaps.
* Without CPU sync (``do_cpu_sync=False``, e.g. inside a CUDA graph) outputs have the worst-case row
  count and the real counts stay on the GPU (``handle.psum_num_recv_tokens_per_scaleup_rank[-1]``).
* ``combine`` sums, in fp32 and in a fixed order, the rows each token's expert ranks send back, adds
  up to two biases and rounds to bf16 once. It does not apply top-k weights; it routes them back.
* ``deterministic=True`` sorts received rows by source token (inside each expert segment in expand
  mode), so the output order never depends on timing; with ``async_with_compute_stream=True`` the
  sort runs (in place) when the caller waits on the returned event, as in DeepEP. As in DeepEP,
  ``handle.recv_src_metadata``
  then describes the sorted rows (non-expand: its rows are sorted too; expand: its columns 2.. point
  at the sorted rows); the backend's own order is kept in ``handle.raw_recv_src_metadata`` and
  ``combine`` undoes the permutation.

Streams and events follow DeepEP: work runs on the communication stream after it waits for the
current stream (or ``previous_event``: an ``EventHandle`` from ``ElasticBuffer.capture()`` or an
``EventOverlap`` a call returned); with ``async_with_compute_stream=True`` an ``EventOverlap`` is
returned and the caller waits on it, otherwise the current stream waits before returning.

Backends: ``"native"`` (the C++/CUDA kernels of ``elastic_ep._low_level``), ``"torch"``
(``torch.distributed`` collectives; works with gloo on the CPU) or ``"auto"`` (native for NCCL
groups when the kernels are built, torch otherwise). Launch one process per GPU (``torchrun`` or
``torch.multiprocessing``), create an NCCL process group with ``device_id`` set, then the buffer.
"""
from __future__ import annotations

import collections.abc
import contextlib
import itertools
import math
import os
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _checks, _sizing
from ._events import EventHandle, EventOverlap, raw_event

__all__ = ["ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap", "native_available",
           "calculate_elastic_buffer_size", "get_elastic_buffer_alignment", "get_physical_domain_size",
           "get_logical_domain_size"]

_FP8 = torch.float8_e4m3fn
_MAX_TOPK = 32


# ---------------------------------------------------------------------------------------------- native
_native_cache: Optional[Tuple[Any, Optional[str]]] = None


def _load_native():
    """Import ``elastic_ep._low_level`` once; returns ``(module or None, reason it is unusable)``."""
    global _native_cache
    if _native_cache is None:
        try:
            from . import _low_level as ll  # noqa: WPS433 (lazy: the extension may be absent)
            built = getattr(ll, "built_with_cuda", None)
            if built is not None and not built():
                _native_cache = (None, "elastic_ep._C was built without CUDA (no nvcc at build time)")
            elif not hasattr(ll, "ElasticBuffer"):
                _native_cache = (None, "elastic_ep._low_level has no ElasticBuffer yet")
            else:
                _native_cache = (ll, None)
        except Exception as e:  # noqa: BLE001 - any import failure means "not available"
            _native_cache = (None, f"elastic_ep native backend unavailable: {type(e).__name__}: {e}")
    return _native_cache


def native_available() -> bool:
    """True when the native kernels can be used (extension built with CUDA and a GPU present)."""
    ll, _ = _load_native()
    return ll is not None and torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------- handle
@dataclass(eq=False)  # identity semantics, as DeepEP's class: hashable, and == never compares tensors
class EPHandle:
    """Everything ``combine`` (and a cached ``dispatch``) needs from an earlier ``dispatch``.

    The fields are DeepEP's, in its constructor order: the routing (``topk_idx [T, K]``, a copy when
    ``do_handle_copy``), the SM count of the dispatch (``num_sms``, which ``combine(num_sms=0)``
    reuses), the received counts (host and device), the source metadata ``recv_src_metadata
    [N, K+2]`` (``[src_rank*max_tokens+token, src_rank*K+master_lane, expanded row per lane or -1]``)
    and the per-token slots in the destination buffers. Then ours: in deterministic mode ``perm``
    (received row ``j`` the user sees is row ``perm[j]`` of the backend's output) and
    ``raw_recv_src_metadata`` (the backend's metadata, in its own row order), while
    ``recv_src_metadata`` describes the user's (sorted) rows as in DeepEP; ``buffer_id`` names the
    buffer that made the handle (a serial number never reused in the process, unlike ``id()``: a
    handle of a destroyed and collected buffer is refused by every later one).
    """

    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: torch.Tensor
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: List[int]
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor
    psum_num_recv_tokens_per_expert: torch.Tensor
    num_unaligned_recv_tokens_per_expert: torch.Tensor
    recv_src_metadata: torch.Tensor
    dst_buffer_slot_idx: torch.Tensor
    token_metadata_at_forward: Optional[torch.Tensor] = None
    channel_linked_list: Optional[torch.Tensor] = None
    perm: Optional[torch.Tensor] = None
    raw_recv_src_metadata: Optional[torch.Tensor] = None
    buffer_id: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens the dispatch routed (``topk_idx.shape[0]``)."""
        return int(self.topk_idx.shape[0])

    @property
    def num_topk(self) -> int:
        """Experts per token (``topk_idx.shape[1]``)."""
        return int(self.topk_idx.shape[1])

    @property
    def backend_recv_src_metadata(self) -> torch.Tensor:
        """The metadata in the backend's row order (what the kernels read)."""
        return self.raw_recv_src_metadata if self.raw_recv_src_metadata is not None else self.recv_src_metadata

    @property
    def num_allocated_tokens(self) -> int:
        """Rows of ``recv_x`` (and of ``combine``'s input): expanded or per-token count."""
        return self.num_expanded_tokens if self.do_expand else self.num_recv_tokens

    def copy(self) -> "EPHandle":
        """A copy of the handle.

        Returns:
            An ``EPHandle`` whose tensors are clones (safe against later in-place changes by the caller).
        """
        def c(v):
            return v.clone() if isinstance(v, torch.Tensor) else (list(v) if isinstance(v, list) else v)
        return replace(self, **{f: c(getattr(self, f)) for f in self.__dataclass_fields__})

    @property
    def cached_recv_src_metadata_before_sort(self) -> Optional[torch.Tensor]:
        """DeepEP's name for the metadata before the deterministic sort (None until a sort ran)."""
        return self.raw_recv_src_metadata

    def deterministic_sort(self, do_cpu_sync: bool, is_cached_dispatch: bool, recv_x: torch.Tensor,
                           recv_sf: Optional[torch.Tensor], recv_topk_idx: Optional[torch.Tensor],
                           recv_topk_weights: Optional[torch.Tensor],
                           channel_linked_list: Optional[torch.Tensor]) -> None:
        """Sorts a dispatch's outputs in place by source token (DeepEP's method, same arguments).

        A deterministic buffer calls this itself (when the caller waits, with
        ``async_with_compute_stream``); it is public because DeepEP's is, e.g. to sort the outputs
        of a non-deterministic buffer. The first sort of a handle fixes its permutation and turns
        ``recv_src_metadata`` into the sorted rows' metadata (the backend's is kept in
        ``raw_recv_src_metadata``, which ``combine`` reads). Outputs of a cached dispatch arrive in
        the backend's order in both modes here, so ``is_cached_dispatch=True`` applies the same
        permutation; a second non-cached call on an already sorted handle does nothing, as the
        outputs it was made with are sorted already.

        Arguments:
            do_cpu_sync: accepted; rows past the real count are found on the device either way.
            is_cached_dispatch: the outputs come from ``dispatch(handle=self)``.
            recv_x, recv_sf, recv_topk_idx, recv_topk_weights: the dispatch's outputs (None skipped).
            channel_linked_list: must be None (hybrid mode, which does not exist here).
        """
        if channel_linked_list is not None:
            raise ValueError("channel_linked_list: expected None (it exists only in hybrid mode, which this "
                             "package does not implement)")
        if self.perm is None:
            # Not sorted yet: recv_src_metadata is still the backend's, whatever the call kind.
            self.perm = ElasticBuffer._deterministic_perm(self)
            self.raw_recv_src_metadata = self.recv_src_metadata
            self.recv_src_metadata = ElasticBuffer._sorted_metadata(self.raw_recv_src_metadata, self.perm,
                                                                    self.do_expand)
        elif not is_cached_dispatch:
            return
        p = self.perm
        for t in (recv_x, recv_sf, recv_topk_idx, recv_topk_weights):
            if t is not None:
                # In place with strides kept, so TMA column-major scales stay so.
                t.copy_(t[p])

    def num_valid_recv_tokens(self) -> torch.Tensor:
        """The real received token count, without a CPU sync.

        Returns:
            A one-element device tensor (the last entry of ``psum_num_recv_tokens_per_scaleup_rank``).
        """
        return self.psum_num_recv_tokens_per_scaleup_rank[-1]


# ---------------------------------------------------------------------------------------------- helpers
def _err(name: str, expected: str, got: Any) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {got}")


# Integer arguments are checked by name here: the native parameter parser refuses what is not an int
# too, but only after the first kernels were queued, which leaves the buffer unusable.
_int_arg = _checks.int_arg
_C_INT = " (the native runtime takes a C int)"


def _itemsize(dtype: Any) -> int:
    if not isinstance(dtype, torch.dtype):
        raise _err("dtype", "a torch.dtype", repr(dtype))
    return dtype.itemsize


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device}, contiguous={t.is_contiguous()})"
    return repr(type(t).__name__) if t is not None else "None"


def _check_tensor(name: str, t: Any, *, dtype=None, ndim=None, shape=None, device=None, contiguous=True) -> None:
    if not isinstance(t, torch.Tensor):
        raise _err(name, "a torch.Tensor", _describe(t))
    _checks.check_dense(name, t)
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            raise _err(name, f"dtype in {[str(d) for d in allowed]}", t.dtype)
    if ndim is not None and t.dim() != ndim:
        raise _err(name, f"a {ndim}-D tensor", f"shape {tuple(t.shape)}")
    if shape is not None:
        got = t.shape
        for i, s in enumerate(shape):
            if s is not None and got[i] != s:
                raise _err(name, f"shape {tuple('*' if v is None else v for v in shape)}", f"shape {tuple(got)}")
    if device is not None and _off_device(t, device):
        raise _err(name, f"a tensor on {device} (the buffer's device)", t.device)
    if contiguous and not t.is_contiguous():
        raise _err(name, "a contiguous tensor", f"strides {t.stride()}")


def _off_device(t: torch.Tensor, device: torch.device) -> bool:
    """True when ``t`` is not on ``device``. On a CUDA buffer this is one integer compare (get_device()
    is the CUDA index, -1 off CUDA; t.device would build a device object on every call), and a tensor
    on another GPU is caught too: the native kernels take raw pointers of the buffer's device."""
    if device.type == "cuda":
        return t.get_device() != device.index
    return t.device != device


def _check_handle_tensors(handle: "EPHandle", names: Sequence[str], device: torch.device,
                          shapes: Optional[dict] = None) -> None:
    """The handle's tensors a call passes to the backend must be on the buffer's device (the handle
    is a plain dataclass: its fields may have been replaced since the dispatch that made it). With
    ``shapes`` (name -> shape) each must also be an int32 tensor of that shape."""
    for name in names:
        t = getattr(handle, name)
        if not isinstance(t, torch.Tensor):
            raise _err(f"handle.{name}", "a torch.Tensor", _describe(t))
        if _off_device(t, device):
            raise _err(f"handle.{name}", f"a tensor on {device} (the buffer's device)", t.device)
        if shapes is not None and (t.dtype != torch.int32 or tuple(t.shape) != shapes[name]):
            raise _err(f"handle.{name}", f"an int32 tensor of shape {shapes[name]} (the handle must come from a "
                       "dispatch of these tokens, top-k and ranks)", f"{t.dtype} of shape {tuple(t.shape)}")


def _check_combine_handle(handle: "EPHandle", T: int, K: int, device: torch.device) -> None:
    """What combine takes from the handle: K in [1, 32] (the backend takes K from ``topk_idx``: 0
    would divide by zero in the kernels, more than 32 breaks their one-warp lane logic), ``topk_idx``
    ``[T, K]`` (T and K are its shape) and ``recv_src_metadata`` ``[N, K + 2]``, all on the buffer's
    device. The dtypes were checked by the dispatch that made the handle; shapes and devices change if
    a field is replaced."""
    if not 0 < K <= _MAX_TOPK:
        raise _err("handle.num_topk", f"1..{_MAX_TOPK}", K)
    _check_handle_tensors(handle, _COMBINE_HANDLE_TENSORS, device)
    meta = handle.recv_src_metadata
    if meta.dim() != 2 or meta.shape[1] != K + 2:
        raise _err("handle.recv_src_metadata", f"shape (*, {K + 2}) (num_topk + 2 columns)",
                   f"shape {tuple(meta.shape)}")


_CACHED_HANDLE_TENSORS = ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                          "num_unaligned_recv_tokens_per_expert", "dst_buffer_slot_idx", "recv_src_metadata")
_COMBINE_HANDLE_TENSORS = ("topk_idx", "psum_num_recv_tokens_per_scaleup_rank", "recv_src_metadata")


def calculate_elastic_buffer_size(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                                  use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                                  allow_multiple_reduction: bool = True, num_nvl_ranks: Optional[int] = None) -> int:
    """Bytes of the symmetric buffer for a configuration (the seed's ``calculate_buffer_size``).

    Arguments:
        num_ranks: ranks in the group.
        num_max_tokens_per_rank: most tokens any rank dispatches at once.
        hidden: hidden size.
        num_topk: experts per token; 0 sizes for the worst case (32).
        use_fp8_dispatch: FP8 rows plus scale packs.
        allow_hybrid_mode, allow_multiple_reduction: as the buffer's options.
        num_nvl_ranks: ranks inside the NVLink domain (default: all of them).

    Returns:
        The 2 MiB-aligned maximum of the dispatch and combine layouts.
    """
    # Only None means "all of them": 0 is a bad count, not the default.
    return _sizing.calculate_buffer_size(num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                         num_ranks=num_ranks,
                                         num_nvl_ranks=num_ranks if num_nvl_ranks is None else num_nvl_ranks,
                                         allow_hybrid_mode=allow_hybrid_mode,
                                         allow_multiple_reduction=allow_multiple_reduction)


def get_elastic_buffer_alignment() -> int:
    """The alignment every buffer size must have.

    Returns:
        2 MiB (``ALIGNMENT_BYTES``), as DeepEP's ``get_elastic_buffer_alignment``.
    """
    return _sizing.ALIGNMENT_BYTES


def get_physical_domain_size(group: dist.ProcessGroup) -> Tuple[int, int]:
    """The physical domain sizes of ``group``, before any buffer exists (DeepEP's module function).

    Arguments:
        group: the expert-parallel process group.

    Returns:
        ``(num_rdma_ranks, num_nvlink_ranks)``: ``(1, R)``; every rank is in one NVLink domain here
        (the only layout this package supports).
    """
    return 1, dist.get_world_size(group)


def get_logical_domain_size(group: dist.ProcessGroup, allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    """The logical domain sizes of ``group`` (DeepEP's module function).

    Arguments:
        group: the expert-parallel process group.
        allow_hybrid_mode: accepted; with one NVLink domain there is no scale-out either way.

    Returns:
        ``(num_scaleout_ranks, num_scaleup_ranks)``: ``(1, R)`` (direct mode).
    """
    return 1, dist.get_world_size(group)


def _torch_nccl_comm(group: dist.ProcessGroup) -> int:
    """torch's own ncclComm_t of ``group`` as an int, or 0 when it cannot be reached."""
    if os.environ.get("EP_REUSE_NCCL_COMM", "1") == "0":
        return 0
    try:
        return int(group._get_backend(torch.device("cuda"))._comm_ptr())
    except Exception:  # noqa: BLE001 - private API: absent or different in this torch
        return 0


def _new_nccl_comm(group: dist.ProcessGroup, ll) -> int:
    """A new communicator over the ranks of ``group`` (unique id from rank 0, exchanged over the group)."""
    rank = dist.get_rank(group)
    uid = ll.get_local_nccl_unique_id() if rank == 0 else None
    ids: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(ids, uid, group=group)
    return int(ll.create_nccl_comm(ids[0], dist.get_world_size(group), rank))


def _release_native(runtime, ll, comm: int) -> None:
    """Finaliser of a buffer with its own communicator: the window first, then the communicator."""
    try:
        runtime.destroy()
    finally:
        ll.destroy_nccl_comm(comm)


_BUFFER_SERIALS = itertools.count(1)


def _raise_if_any_rank_failed(group: dist.ProcessGroup, err: Optional[Exception], what: str,
                              cleanup=None) -> None:
    """Collective: every rank of ``group`` learns whether ``what`` failed on some rank (``err``: this
    rank's exception, or None). If it did, ``cleanup`` runs and every rank raises: a rank that failed
    its own exception, the others one naming each failed rank and its error (a ``ValueError`` when all
    of those are, else a ``RuntimeError``). So no rank goes on while a peer gave up."""
    mine = None if err is None else (f"{type(err).__name__}: {err}", isinstance(err, ValueError))
    statuses: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(statuses, mine, group=group)
    failed = [(r, st) for r, st in enumerate(statuses) if st is not None]
    if not failed:
        return
    if cleanup is not None:
        cleanup()
    if err is not None:
        raise err
    kind = ValueError if all(is_value for _, (_, is_value) in failed) else RuntimeError
    raise kind(f"{what} failed on " + "; ".join(f"rank {r}: {msg}" for r, (msg, _) in failed))


def _all_ok(group: dist.ProcessGroup, ok: bool) -> bool:
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device="cuda")
    dist.all_reduce(flag, group=group)
    return int(flag.item()) == 0


class ElasticBuffer:
    """Expert-parallel dispatch/combine buffer, API-compatible with DeepEP V2's ``ElasticBuffer``.

    Arguments:
        group: the process group of the expert-parallel ranks (NCCL for GPUs; gloo works with the torch backend).
        num_bytes: buffer bytes; None sizes it from ``num_max_tokens_per_rank``/``hidden``/``num_topk``.
        num_cpu_bytes: CPU (Engram) segment bytes; must be 0 (not supported).
        num_max_tokens_per_rank: most tokens a rank dispatches at once (required when ``num_bytes`` is None).
        hidden: hidden size used for sizing.
        num_topk: experts per token used for sizing (0: size for 32).
        use_fp8_dispatch: size for FP8 dispatch.
        deterministic: sort received rows by source token (see the module docstring).
        allow_hybrid_mode: accepted; only direct mode (one NVLink domain) exists.
        allow_multiple_reduction: combine reduces per rank before sending (fewer bytes, rounding once more).
        prefer_overlap_with_compute: accepted and kept; it changes only ``get_theoretical_num_sms``
            (at least 64 SMs when False): with ``num_sms=0`` the native kernels use every SM (what
            the benchmark measured; pass ``num_sms`` to leave SMs to overlapped compute).
        sl_idx, num_allocated_qps: RDMA settings, accepted for compatibility (no RDMA here). They change
            nothing but ``num_allocated_qps`` (0: DeepEP's automatic 129 with hybrid mode allowed, else
            17), which ``get_theoretical_num_qps`` and the ``num_qps`` bound read, as in DeepEP.
        num_cpu_timeout_secs: how long the CPU waits for counts before raising ``TimeoutError``.
        num_gpu_timeout_secs: how long a kernel waits for a peer before recording a timeout.
        explicitly_destroy: require an explicit ``destroy()`` (else the buffer is freed with the object).
        backend: ``"auto"``, ``"native"`` or ``"torch"`` (keyword only; not in DeepEP).
        window: where the native backend's window lives (keyword only; not in DeepEP): ``"nccl"``
            (``"auto"``): an NCCL symmetric window, on torch's communicator of ``group`` or a new
            one; ``"ipc"``: cudaMalloc'ed memory shared by CUDA IPC, handles exchanged over
            ``group`` (which may then be gloo). IPC needs no NCCL symmetric memory, and works with
            ranks that share a GPU; it needs CUDA peer access between the ranks' GPUs.

    Raises:
        ValueError: bad arguments; RuntimeError: the native backend was requested but is unavailable.
        The constructor is collective and raises on every rank when any rank's arguments are refused:
        that rank its own error, the others one naming it (``ValueError`` or ``RuntimeError`` as well).
    """

    #: The handles' ``buffer_id``: a serial number the constructor sets (>= 1, never reused in the process,
    #: unlike ``id(self)``, which a later buffer gets once this one is collected). 0 only on an object
    #: made without the constructor (``object.__new__``, as the diagnostic tools do).
    _serial = 0

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
        self.rank = dist.get_rank(group)
        self.rank_idx = self.rank  # DeepEP's name
        self.num_ranks = dist.get_world_size(group)
        pg_backend = dist.get_backend(group)
        self._serial = next(_BUFFER_SERIALS)
        # Each rank checks its own arguments, then every rank learns the others' outcome before anything
        # collective: a rank whose arguments are refused must not leave its peers in this constructor's
        # collectives, where their next call from that rank would complete them (its peers returning a
        # buffer it does not have) or they would wait until the group's timeout.
        err = None
        try:
            if num_cpu_bytes != 0:
                raise ValueError(f"num_cpu_bytes: expected 0 (the CPU/Engram segment is not supported), got "
                                 f"{num_cpu_bytes}")
            if backend not in ("auto", "native", "torch"):
                raise ValueError(f"backend: expected 'auto', 'native' or 'torch', got {backend!r}")
            if window not in ("auto", "nccl", "ipc"):
                raise ValueError(f"window: expected 'auto', 'nccl' or 'ipc', got {window!r}")
            if window == "ipc" and backend == "torch":
                raise ValueError("window='ipc' is the native backend's window; backend='torch' has none")
            num_max_tokens_per_rank = _int_arg("num_max_tokens_per_rank", num_max_tokens_per_rank, 0)
            hidden = _int_arg("hidden", hidden, 0)
            num_topk = _int_arg("num_topk", num_topk, 0)
            if num_topk > _MAX_TOPK:
                raise ValueError(f"num_topk: expected 0..{_MAX_TOPK}, got {num_topk}")
            if hidden % 16 if use_fp8_dispatch else hidden % 8:
                raise ValueError(f"hidden: a row must be a multiple of 16 bytes (hidden % 8 == 0 for bf16, % 16 with "
                                 f"use_fp8_dispatch), got {hidden}")
            if num_bytes is not None:
                num_bytes = _int_arg("num_bytes", num_bytes, 1, _checks.INT64_MAX,
                                     " (the native runtime takes an int64)")
            sl_idx = _int_arg("sl_idx", sl_idx, 0)
            num_allocated_qps = _int_arg("num_allocated_qps", num_allocated_qps, 0)
            # Whole seconds >= 1: the runtime keeps seconds as an int, where 0 means "no deadline".
            num_cpu_timeout_secs = _int_arg("num_cpu_timeout_secs", num_cpu_timeout_secs, 1, _checks.INT32_MAX, _C_INT)
            num_gpu_timeout_secs = _int_arg("num_gpu_timeout_secs", num_gpu_timeout_secs, 1, _checks.INT32_MAX, _C_INT)
            ipc = window == "ipc"
            if backend == "auto" and ipc:
                backend = "native"  # the window exists only there: say why if it cannot be had (below)
            if backend == "auto":
                backend = "native" if (pg_backend == "nccl" and native_available()) else "torch"
                if backend == "torch" and pg_backend == "nccl" and torch.cuda.is_available():
                    # An NCCL group on a GPU would have used the native kernels: say why it cannot, once,
                    # rather than run the (much slower) reference backend silently.
                    _, why = _load_native()
                    warnings.warn(f"elastic_ep: backend='auto' falls back to the torch backend: {why}", RuntimeWarning,
                                  stacklevel=2)
            if backend == "native":
                ll, why = _load_native()
                if ll is None:
                    raise RuntimeError(why)
                if not torch.cuda.is_available():
                    raise RuntimeError("the native elastic_ep backend needs a CUDA GPU; none is visible")
                if pg_backend != "nccl" and not ipc:
                    raise ValueError(f"group: the native backend needs an NCCL process group (or window='ipc'), got "
                                     f"{pg_backend!r}")
            self.backend = backend
            # The native backend skips the argument checks this class already ran (host time on the
            # critical path); the torch backend is the reference and checks everything itself.
            self._prechecked = {"_validated": True} if backend == "native" else {}
            on_gpu = pg_backend == "nccl" or backend == "native"
            self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
            self.window = ("ipc" if ipc else "nccl") if backend == "native" else None
            self.num_max_tokens_per_rank = num_max_tokens_per_rank
            self.hidden = hidden
            self.num_topk = num_topk
            self.use_fp8_dispatch = use_fp8_dispatch
            self.deterministic = deterministic
            self.allow_hybrid_mode = allow_hybrid_mode
            self.allow_multiple_reduction = allow_multiple_reduction
            self.prefer_overlap_with_compute = prefer_overlap_with_compute
            self.num_cpu_timeout_secs = num_cpu_timeout_secs
            self.num_gpu_timeout_secs = num_gpu_timeout_secs
            self.explicitly_destroy = explicitly_destroy
            self.destroyed = False
            self._owned_comm = None
            self._comm_finalizer = None
            self.nccl_comm = 0

            if num_bytes is None:
                if num_max_tokens_per_rank <= 0 or hidden <= 0:
                    raise ValueError("num_bytes=None needs num_max_tokens_per_rank > 0 and hidden > 0 to size the "
                                     f"buffer, got num_max_tokens_per_rank={num_max_tokens_per_rank}, hidden={hidden}")
                num_bytes = self.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk,
                                                      use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction)
            if num_bytes <= 0 or num_bytes % _sizing.ALIGNMENT_BYTES:
                raise ValueError(f"num_bytes: expected a positive multiple of {_sizing.ALIGNMENT_BYTES} "
                                 f"(see get_buffer_size_hint), got {num_bytes}")
            self.num_bytes = int(num_bytes)
            if os.environ.get("EP_BUFFER_DEBUG"):  # DeepEP's switch for the same report
                print(f"elastic_ep: rank {self.rank}/{self.num_ranks}: buffer of {self.num_bytes} bytes, "
                      f"backend {backend}", flush=True)
            if num_allocated_qps == 0:
                # DeepEP's automatic count (hybrid allowed: 129, or 65 with MT4131 NICs, which a machine
                # without RDMA lacks; direct: 17). Unused without RDMA, but get_theoretical_num_qps and
                # the num_qps bound read it, so they give DeepEP's values.
                num_allocated_qps = 129 if allow_hybrid_mode else 17
            self.num_allocated_qps = num_allocated_qps
            args = (self.rank, self.num_ranks, self.nccl_comm, None, self.num_bytes, 0, allow_hybrid_mode,
                    allow_multiple_reduction, prefer_overlap_with_compute, sl_idx, num_allocated_qps,
                    num_cpu_timeout_secs, num_gpu_timeout_secs, explicitly_destroy)
            self.comm_source = None
            # Read once: an environment lookup costs microseconds on every call otherwise.
            env_sms = os.environ.get("EP_NUM_SMS")
            self._env_num_sms = int(env_sms) if env_sms else 0
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            err = e
        _raise_if_any_rank_failed(group, err, "ElasticBuffer: creating the buffer")
        if backend == "native":
            try:
                self.runtime = self._create_native(ll, group, args)
            except BaseException:
                self._abort_owned_comm()  # a communicator of our own made before the failure
                raise
            if self._owned_comm is not None and not explicitly_destroy:
                # Freed with the object, as promised: the low-level buffer's finaliser releases the
                # window, then this one aborts the communicator under it (never at interpreter exit:
                # peers may be gone by then, and the process exit releases both anyway).
                self._comm_finalizer = weakref.finalize(self, _release_native, self.runtime, ll, self._owned_comm)
                self._comm_finalizer.atexit = False
        else:
            from ._torch_backend import ElasticBuffer as _TorchBuffer
            self.runtime = _TorchBuffer(*args, group=group)
        # DeepEP's logical and physical rank indices (one NVLink domain: 1 scale-out rank, no RDMA).
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = self.get_physical_domain_size()
        dist.barrier(group=group)

    def _create_native(self, ll, group: dist.ProcessGroup, args: tuple):
        """The native low-level buffer on torch's communicator when that works on every rank, else on a
        communicator of its own (unique-id exchange); or on a CUDA-IPC window. Every rank takes the
        same path."""
        if self.window == "ipc":
            rt = ll.ElasticBuffer(args[0], args[1], 0, *args[3:], window="ipc")
            handles: List[Any] = [None] * self.num_ranks
            dist.all_gather_object(handles, rt.get_local_ipc_handle(), group=group)
            err = None
            try:
                rt.sync(handles)  # the caller's barrier follows: nobody writes before all are open
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                err = e
            _raise_if_any_rank_failed(group, err, "window='ipc': opening the peers' windows", cleanup=rt.destroy)
            self.comm_source = "ipc"
            return rt
        dist.barrier(group=group)  # torch creates its communicator lazily; make sure it exists
        comm = _torch_nccl_comm(group)
        err = None
        if _all_ok(group, comm != 0):
            rt = None
            try:
                rt = ll.ElasticBuffer(args[0], args[1], comm, *args[3:])
            except Exception as e:  # noqa: BLE001 - e.g. a non-blocking or non-symmetric communicator
                err = e
            if _all_ok(group, rt is not None):
                self.nccl_comm, self.comm_source = comm, "torch"
                return rt
            if rt is not None:
                rt.destroy()
        comm = _new_nccl_comm(group, ll)
        self.nccl_comm, self._owned_comm = comm, comm
        self.comm_source = "own" if err is None else f"own (torch's communicator failed: {err})"
        return ll.ElasticBuffer(args[0], args[1], comm, *args[3:])

    # ------------------------------------------------------------------ sizing
    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes a buffer needs for this configuration on ``group`` (2 MiB aligned).

        Arguments:
            group: the expert-parallel process group (its size is the rank count).
            num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, allow_hybrid_mode,
            allow_multiple_reduction: as the constructor.

        Returns:
            The seed's ``calculate_buffer_size`` for one NVLink domain holding every rank.
        """
        return calculate_elastic_buffer_size(dist.get_world_size(group), num_max_tokens_per_rank, hidden, num_topk,
                                             use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction)

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: torch.dtype = torch.bfloat16) -> Tuple[int, int]:
        """Bytes an Engram storage would need (DeepEP's hint; Engram itself is not implemented here).

        Each entry is ``hidden`` elements of ``dtype`` rounded up to 32 B; the GPU part receives
        ``num_max_tokens_per_rank`` entries, the CPU part stores ``num_entries``.

        Returns:
            ``(num_gpu_bytes, num_cpu_bytes)``, both 2 MiB-aligned.
        """
        num_entries, hidden = _int_arg("num_entries", num_entries, 0), _int_arg("hidden", hidden, 0)
        num_max_tokens_per_rank = _int_arg("num_max_tokens_per_rank", num_max_tokens_per_rank, 0)
        entry = _sizing.align_up(hidden * _itemsize(dtype), 32)
        return (_sizing.align_up(entry * num_max_tokens_per_rank, _sizing.ALIGNMENT_BYTES),
                _sizing.align_up(entry * num_entries, _sizing.ALIGNMENT_BYTES))

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """Bytes PP send/recv would need (DeepEP's hint; PP itself is not implemented here).

        Four regions (send and receive, towards the previous and the next rank), each
        ``num_max_inflight_tensors`` slots of ``num_max_tensor_bytes`` rounded up to 32 B.

        Returns:
            The size, 2 MiB-aligned.
        """
        num_max_tensor_bytes = _int_arg("num_max_tensor_bytes", num_max_tensor_bytes, 0)
        num_max_inflight_tensors = _int_arg("num_max_inflight_tensors", num_max_inflight_tensors, 0)
        slot = _sizing.align_up(num_max_tensor_bytes, 32)
        return _sizing.align_up(4 * num_max_inflight_tensors * slot, _sizing.ALIGNMENT_BYTES)

    @staticmethod
    def get_agrs_num_max_session_bytes(group: dist.ProcessGroup,
                                       shapes: Union[Tuple[int, ...], Sequence[Tuple[int, ...]]],
                                       dtype: torch.dtype) -> int:
        """Bytes one AGRS session gathering tensors of ``shapes`` would use (DeepEP's hint).

        Arguments:
            group: the process group (each gathered tensor holds one slice per rank).
            shapes: one local shape, or a sequence of shape tuples (several gathers in one session).
            dtype: the element type.

        Returns:
            The sum over the gathers of ``ranks x elements x itemsize``, each rounded up to 32 B.
        """
        def is_seq(v: Any) -> bool:
            return isinstance(v, collections.abc.Sequence) and not isinstance(v, (str, bytes))

        if not is_seq(shapes) or not shapes:
            raise _err("shapes", "a shape or a non-empty sequence of shapes", repr(shapes))
        if not is_seq(shapes[0]):  # one shape (a torch.Size starts with an int too)
            shapes = (shapes,)
        for i, shape in enumerate(shapes):
            if not is_seq(shape):
                raise _err(f"shapes[{i}]", "a shape (a sequence of ints)", repr(shape))
            for d in shape:
                _int_arg(f"shapes[{i}]", d, 0)
        itemsize = _itemsize(dtype)
        R = dist.get_world_size(group)
        return sum(_sizing.align_up(R * math.prod(s) * itemsize, 32) for s in shapes)

    @staticmethod
    def get_agrs_buffer_size_hint(group: dist.ProcessGroup, num_max_session_bytes: int) -> int:
        """Bytes AGRS sessions of ``num_max_session_bytes`` would need (DeepEP's hint).

        Returns:
            ``num_max_session_bytes`` rounded up to 2 MiB.
        """
        return _sizing.align_up(_int_arg("num_max_session_bytes", num_max_session_bytes, 0), _sizing.ALIGNMENT_BYTES)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """SMs that keep NVLink busy for a balanced gate (DeepEP's bandwidth model, scale-up only).

        A token is read once and written to each of the ``k`` ranks it selects (``k`` = the expected
        number of distinct ranks among ``num_topk`` experts of ``num_experts``); per token the SMs read
        ``1/k`` and write ``1`` row, the link carries ``1 - 1/R`` rows. The count is what the link
        bandwidth needs at ``sm_read_gbs`` / ``sm_write_gbs`` per SM, plus 25 %, even, at least 4, at
        least 64 when ``prefer_overlap_with_compute`` is False, at most the device's SMs (all of them
        at EP 1). ``EP_NUM_SMS`` overrides it. Not the native backend's default (``num_sms=0`` uses
        every SM there); pass it as ``num_sms`` to leave SMs to overlapped compute.

        Arguments:
            num_experts: all experts (a multiple of the rank count).
            num_topk: experts per token.
            num_scaleout_topk: must be 0 (no scale-out domain here).
            rdma_gbs: accepted for compatibility (no RDMA).
            nvlink_gbs: NVLink GB/s per direction (0: 450, an H100/H200).
            sm_read_gbs, sm_write_gbs: what one SM reads from HBM / writes to a peer, GB/s.

        Returns:
            The SM count.
        """
        if num_scaleout_topk != 0:
            raise ValueError(f"num_scaleout_topk: expected 0 (one NVLink domain), got {num_scaleout_topk}")
        num_experts, num_topk = _int_arg("num_experts", num_experts), _int_arg("num_topk", num_topk)
        real_arg = _checks.real_arg
        nvlink_gbs, rdma_gbs = real_arg("nvlink_gbs", nvlink_gbs, 0), real_arg("rdma_gbs", rdma_gbs, 0)
        sm_read_gbs = real_arg("sm_read_gbs", sm_read_gbs, 0, lo_inclusive=False)
        sm_write_gbs = real_arg("sm_write_gbs", sm_write_gbs, 0, lo_inclusive=False)
        if self._env_num_sms:
            return self._env_num_sms
        R = self.num_ranks
        if num_experts <= 0 or num_experts % R or not 0 < num_topk <= num_experts:
            raise ValueError(f"num_experts / num_topk: expected a positive multiple of {R} experts and 1.."
                             f"num_experts per token, got {num_experts} / {num_topk}")
        device_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                      if self.device.type == "cuda" else 132)
        if R == 1:
            return device_sms
        nvlink_gbs = nvlink_gbs or 450.0
        # expected distinct ranks hit by num_topk experts drawn without replacement
        k = R * (1 - math.comb(num_experts - num_experts // R, num_topk) / math.comb(num_experts, num_topk))
        traffic = 1 - 1 / R
        need = max(nvlink_gbs / traffic * (1 / k) / sm_read_gbs, nvlink_gbs / traffic * 1.0 / sm_write_gbs)
        n = max(4, math.ceil(need * 1.25))
        n += n % 2
        if not self.prefer_overlap_with_compute:
            n = max(n, 64)
        return min(n, device_sms)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """RDMA queue pairs for ``num_sms`` SMs, as DeepEP computes them (unused: no RDMA here).

        Arguments:
            num_sms: the SM count of the kernels.

        Returns:
            ``16 * num_sms + 1`` when hybrid mode is allowed, else ``min(num_sms, 9)``; at most
            ``num_allocated_qps``.
        """
        num_sms = _int_arg("num_sms", num_sms, 0)
        n = 16 * num_sms + 1 if self.allow_hybrid_mode else min(num_sms, 9)
        return min(n, self.num_allocated_qps)

    def _resolve_qps(self, num_qps: Any) -> int:
        """``num_qps`` has no effect without RDMA, so 0 stays 0 (no estimate on the hot path), but
        DeepEP refuses more than were allocated: the same refusal keeps code that runs here from
        failing there."""
        num_qps = _int_arg("num_qps", num_qps, 0)
        if num_qps > self.num_allocated_qps:
            raise ValueError(f"num_qps: expected at most num_allocated_qps={self.num_allocated_qps}, got {num_qps}")
        return num_qps

    # ------------------------------------------------------------------ Engram / PP / AGRS (not implemented)
    def _not_implemented(self, what: str) -> NotImplementedError:
        return NotImplementedError(
            f"elastic_ep.ElasticBuffer.{what}: not implemented (this package implements DeepEP V2's dispatch and "
            "combine inside one NVLink domain; Engram, PP send/recv and AGRS sessions are not available yet)")

    def engram_write(self, storage: torch.Tensor, sf: Optional[torch.Tensor] = None) -> None:
        """DeepEP's Engram storage write. Raises ``NotImplementedError`` (no Engram here)."""
        raise self._not_implemented("engram_write")

    def engram_fetch(self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False):
        """DeepEP's Engram fetch. Raises ``NotImplementedError`` (no Engram here)."""
        raise self._not_implemented("engram_fetch")

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """DeepEP's PP configuration. Raises ``NotImplementedError`` (no PP send/recv here)."""
        raise self._not_implemented("pp_set_config")

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """DeepEP's PP send. Raises ``NotImplementedError`` (no PP send/recv here)."""
        raise self._not_implemented("pp_send")

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """DeepEP's PP receive. Raises ``NotImplementedError`` (no PP send/recv here)."""
        raise self._not_implemented("pp_recv")

    def create_agrs_session(self) -> None:
        """DeepEP's AGRS session start. Raises ``NotImplementedError`` (no AGRS here)."""
        raise self._not_implemented("create_agrs_session")

    def destroy_agrs_session(self) -> None:
        """DeepEP's AGRS session end. Raises ``NotImplementedError`` (no AGRS here)."""
        raise self._not_implemented("destroy_agrs_session")

    @contextlib.contextmanager
    def agrs_new_session(self, enabled: bool = True):
        """DeepEP's AGRS session context manager. ``enabled=False`` is a no-op there and here; an
        enabled session raises ``NotImplementedError`` (no AGRS here)."""
        if enabled:
            raise self._not_implemented("agrs_new_session")
        yield

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        """DeepEP's AGRS configuration. Raises ``NotImplementedError`` (no AGRS here)."""
        raise self._not_implemented("agrs_set_config")

    def agrs_get_inplace_tensor(self, shapes, dtype: torch.dtype):
        """DeepEP's AGRS in-place tensor. Raises ``NotImplementedError`` (no AGRS here)."""
        raise self._not_implemented("agrs_get_inplace_tensor")

    def all_gather(self, t):
        """DeepEP's AGRS all-gather. Raises ``NotImplementedError`` (no AGRS here)."""
        raise self._not_implemented("all_gather")

    # ------------------------------------------------------------------ info / lifecycle
    def _check_alive(self) -> None:
        if self.destroyed:
            raise RuntimeError("this ElasticBuffer was destroyed; create a new one")

    def get_comm_stream(self):
        """The stream the communication kernels run on.

        Returns:
            A ``torch.cuda.Stream`` (None for the torch backend on a CPU group).
        """
        self._check_alive()
        s = self.runtime.get_comm_stream()
        if isinstance(s, int):
            return torch.cuda.ExternalStream(s)
        return s

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """The physical domain sizes.

        Returns:
            ``(num_rdma_ranks, num_nvlink_ranks)``: ``(1, R)`` for one NVLink domain of ``R`` ranks.
        """
        return tuple(self.runtime.get_physical_domain_size())

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """The logical domain sizes.

        Returns:
            ``(num_scaleout_ranks, num_scaleup_ranks)``: ``(1, R)`` in direct mode.
        """
        return tuple(self.runtime.get_logical_domain_size())

    @staticmethod
    def capture() -> EventHandle:
        """Records an event on the current stream (for ``previous_event`` / ``previous_event_before_epilogue``).

        Returns:
            An ``EventHandle`` (DeepEP's ``capture()`` returns its ``EventHandle`` too).
        """
        return EventHandle()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """A barrier of all ranks on the GPU (on the comm stream by default).

        Arguments:
            use_comm_stream: run on the communication stream (the current stream waits for it).
            with_cpu_sync: synchronise the device before and after (a full CPU barrier).
            sequential: the seed's flag (barrier ordered with earlier work on the stream).
        """
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
        comm, self._owned_comm = self._owned_comm, None
        if comm is not None:
            ll, _ = _load_native()
            ll.destroy_nccl_comm(comm)

    def __enter__(self) -> "ElasticBuffer":
        self._check_alive()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.destroyed:
            self.destroy()

    # ------------------------------------------------------------------ validation helpers
    def _resolve_sms(self, num_sms: int, num_experts: int, num_topk: int) -> int:
        num_sms = _int_arg("num_sms", num_sms, 0)
        if num_sms == 0 and self._env_num_sms:
            return self._env_num_sms  # EP_NUM_SMS, read when the buffer was created
        if self.backend == "native":
            return num_sms  # 0: the native runtime picks (all SMs of the device)
        return num_sms or self.get_theoretical_num_sms(num_experts, min(num_topk, num_experts))

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _check_event_args(self, previous_event, allocate_on_comm_stream: bool,
                          previous_event_before_epilogue=None) -> None:
        for name, e in (("previous_event", previous_event),
                        ("previous_event_before_epilogue", previous_event_before_epilogue)):
            if e is not None:
                self._check_event(name, e)
        if previous_event is not None and not allocate_on_comm_stream:
            raise ValueError("previous_event: requires allocate_on_comm_stream=True (outputs must be allocated "
                             "on the communication stream when waiting for overlapped compute)")

    @staticmethod
    def _check_event(name: str, e: Any) -> None:
        """An event argument must be an ``EventHandle`` (``capture()``) or an ``EventOverlap`` (what a
        call returned): anything else would fail only after the first kernels were queued."""
        if isinstance(e, EventHandle) or (isinstance(e, EventOverlap) and (e.event is None or
                                                                          isinstance(e.event, EventHandle))):
            return
        inner = f" around a {type(e.event).__name__}" if isinstance(e, EventOverlap) else ""
        raise ValueError(f"{name}: expected None, an EventHandle (ElasticBuffer.capture()) or the EventOverlap a "
                         f"dispatch / combine returned, got a {type(e).__name__}{inner}")

    _raw_event = staticmethod(raw_event)

    # ------------------------------------------------------------------ dispatch
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
                 use_tma_aligned_col_major_sf: bool = False):
        """Send every token to the ranks that own its top-k experts.

        Arguments:
            x: ``[T, H]`` bf16, or ``(x [T, H] float8_e4m3fn, sf [T, P] float32 | int32)``.
            topk_idx: ``[T, K]`` int64 global expert ids, -1 masked. None in cached mode (``handle``).
            topk_weights: ``[T, K]`` float32, or None.
            cumulative_local_expert_recv_stats: ``[E / R]`` int32, incremented by the received counts.
            num_experts: total experts E (divisible by the rank count); from ``handle`` in cached mode.
            num_max_tokens_per_rank: the most tokens any rank sends in this call (default: the
                buffer's); a larger value is accepted while the buffer is big enough for it (else
                ``ValueError``).
            expert_alignment: per-expert row alignment (default 1; from ``handle`` in cached mode).
            num_sms: SMs for the kernels (0: every SM with the native backend, ``get_theoretical_num_sms``
                with the torch backend; ``EP_NUM_SMS`` overrides the 0); kept in the handle for ``combine``.
            num_qps: RDMA queue pairs: no effect here, but more than ``num_allocated_qps`` raises
                ``ValueError`` (DeepEP refuses it too).
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

        Returns:
            ``(recv_x | (recv_x, recv_sf), recv_topk_idx, recv_topk_weights, handle, event)``.

        Raises:
            ValueError: any bad input, before anything is launched, except expert ids outside
                ``[-1, num_experts)``, which only the GPU reads: with a CPU sync the notify kernel finds
                them before any token moves, the dispatch is refused on every rank and every rank raises
                (the buffer stays usable); without one they are treated as masked and the next call on
                this buffer raises with their count, on this rank only: in a multi-rank job the peers'
                next operation then times out and the buffer must be recreated on every rank
                (``EP_SKIP_INDEX_CHECK=1``: masked silently, nothing raises).
            CommError: the buffer is unusable (an earlier operation timed out or was interrupted
                between its kernels); destroy it and create a new one.
        """
        self._check_alive()
        R = self.num_ranks
        # ---- data
        sf = None
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ValueError(f"x: expected a tensor or a (x, sf) pair, got a sequence of {len(x)}")
            x, sf = x
        _check_tensor("x", x, dtype=(torch.bfloat16, _FP8), ndim=2, device=self.device)
        T, H = x.shape
        if x.dtype == _FP8 and sf is None:
            raise ValueError("x: FP8 rows need scales: pass x=(x_fp8, sf)")
        if sf is not None:
            if x.dtype != _FP8:
                raise ValueError(f"sf: scales are only meaningful with float8_e4m3fn x, got x of {x.dtype}")
            _check_tensor("sf", sf, dtype=(torch.float32, torch.int32), ndim=2, shape=(T, None),
                          device=self.device, contiguous=False)
            if sf.shape[1] == 0:
                raise ValueError("sf: expected at least one scale pack per token, got shape "
                                 f"{tuple(sf.shape)}")
        if (H * x.element_size()) % 16:
            raise ValueError(f"x: a row must be a multiple of 16 bytes, got hidden={H} x {x.element_size()} B")
        # ---- cached mode
        cached = handle is not None
        if cached:
            if not isinstance(handle, EPHandle):
                raise ValueError(f"handle: expected an EPHandle from dispatch, got {type(handle).__name__}")
            if handle.buffer_id != self._serial:
                raise ValueError("handle: it was produced by another ElasticBuffer")
            if topk_idx is not None and topk_idx is not handle.topk_idx:
                raise ValueError("topk_idx: must be None in cached mode (the handle's routing is reused)")
            if num_experts is not None and num_experts != handle.num_experts:
                raise ValueError(f"num_experts: the cached handle has {handle.num_experts}, got {num_experts}")
            if expert_alignment is not None and expert_alignment != handle.expert_alignment:
                raise ValueError(f"expert_alignment: the cached handle has {handle.expert_alignment}, "
                                 f"got {expert_alignment}")
            if do_expand != handle.do_expand:
                raise ValueError(f"do_expand: the cached handle was made with do_expand={handle.do_expand}")
            if num_max_tokens_per_rank is not None and num_max_tokens_per_rank != handle.num_max_tokens_per_rank:
                raise ValueError("num_max_tokens_per_rank: differs from the cached handle's "
                                 f"{handle.num_max_tokens_per_rank}")
            if T != handle.num_tokens:
                raise ValueError(f"x: the cached handle routed {handle.num_tokens} tokens, x has {T}")
            if do_cpu_sync:
                raise ValueError("do_cpu_sync: cannot be True in cached mode (counts come from the handle)")
            do_cpu_sync = False
            topk_idx = handle.topk_idx
            num_experts = handle.num_experts
            expert_alignment = handle.expert_alignment
            num_max_tokens_per_rank = handle.num_max_tokens_per_rank
        else:
            if topk_idx is None:
                raise ValueError("topk_idx: required unless a cached handle is given")
            if num_experts is None:
                raise ValueError("num_experts: required unless a cached handle is given")
            if expert_alignment is None:
                expert_alignment = 1
            if num_max_tokens_per_rank is None:
                num_max_tokens_per_rank = self.num_max_tokens_per_rank
            if do_cpu_sync is None:
                do_cpu_sync = not self._capturing()
            elif do_cpu_sync and self._capturing():
                raise ValueError("do_cpu_sync: cannot be True while a CUDA graph is being captured (the CPU would "
                                 "wait for counts that no kernel produces until replay); pass False or None")
        _check_tensor("topk_idx", topk_idx, dtype=torch.int64, ndim=2, shape=(T, None), device=self.device)
        K = topk_idx.shape[1]
        if not 0 < K <= _MAX_TOPK:
            raise ValueError(f"topk_idx: expected 1..{_MAX_TOPK} experts per token, got {K}")
        if num_max_tokens_per_rank is None or num_max_tokens_per_rank == 0:
            raise ValueError("num_max_tokens_per_rank: expected a positive int (the buffer was created without "
                             f"one), got {num_max_tokens_per_rank}")
        num_max_tokens_per_rank = _int_arg("num_max_tokens_per_rank", num_max_tokens_per_rank, 1)
        num_experts, expert_alignment = _checks.check_routing(num_experts, expert_alignment, R,
                                                              num_max_tokens_per_rank, K)
        L = num_experts // R
        if T > num_max_tokens_per_rank:
            raise ValueError(f"x: {T} tokens exceed num_max_tokens_per_rank={num_max_tokens_per_rank}")
        if topk_weights is not None:
            _check_tensor("topk_weights", topk_weights, dtype=torch.float32, ndim=2, shape=(T, K), device=self.device)
        if cumulative_local_expert_recv_stats is not None:
            _check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                          dtype=torch.int32, ndim=1, shape=(L,), device=self.device)
        _checks.check_dispatch_modes(do_expand, do_zero_padding, False, None)
        self._check_event_args(previous_event, allocate_on_comm_stream, previous_event_before_epilogue)
        num_sf_packs = sf.shape[1] if sf is not None else 0
        need = _sizing.get_dispatch_buffer_size(num_max_tokens_per_rank, H, num_sf_packs, K, x.element_size(), 1, R, True)
        if need > self.num_bytes:
            raise ValueError(f"buffer too small: this dispatch needs {need} bytes (max_tokens="
                             f"{num_max_tokens_per_rank}, hidden={H}, topk={K}, sf packs={num_sf_packs}), the buffer "
                             f"has {self.num_bytes}; size it with get_buffer_size_hint")
        # Expert ids are checked by the backend: before the launch when the CPU syncs anyway, else on the
        # device (reported by the next call); see _low_level.dispatch.
        if cached:
            # One pass over the handle's tensors (the native backend skips its own checks: _prechecked).
            meta = (handle.num_recv_tokens, K + 2)
            names = _CACHED_HANDLE_TENSORS + (("raw_recv_src_metadata",) if handle.perm is not None else ())
            _check_handle_tensors(handle, names, self.device, dict(
                psum_num_recv_tokens_per_scaleup_rank=(R,), psum_num_recv_tokens_per_expert=(L,),
                num_unaligned_recv_tokens_per_expert=(L,), dst_buffer_slot_idx=(T, K), recv_src_metadata=meta,
                raw_recv_src_metadata=meta))
        num_sms = self._resolve_sms(num_sms, num_experts, K)
        num_qps = self._resolve_qps(num_qps)

        h = handle
        out = self.runtime.dispatch(
            x=x, sf=sf, topk_idx=topk_idx, topk_weights=topk_weights,
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats if not cached else None,
            cached_num_recv_tokens=h.num_recv_tokens if cached else None,
            cached_num_expanded_tokens=h.num_expanded_tokens if cached else None,
            cached_num_recv_tokens_per_expert_list=h.num_recv_tokens_per_expert_list if cached else None,
            cached_psum_num_recv_tokens_per_scaleup_rank=h.psum_num_recv_tokens_per_scaleup_rank if cached else None,
            cached_psum_num_recv_tokens_per_expert=h.psum_num_recv_tokens_per_expert if cached else None,
            cached_num_unaligned_recv_tokens_per_expert=h.num_unaligned_recv_tokens_per_expert if cached else None,
            cached_dst_buffer_slot_idx=h.dst_buffer_slot_idx if cached else None,
            cached_token_metadata_at_forward=h.token_metadata_at_forward if cached else None,
            cached_recv_src_metadata=h.backend_recv_src_metadata if cached else None,
            cached_channel_linked_list=h.channel_linked_list if cached else None,
            num_max_tokens_per_rank=num_max_tokens_per_rank, num_experts=num_experts,
            expert_alignment=expert_alignment, num_sms=num_sms, num_qps=num_qps,
            previous_event=self._raw_event(previous_event),
            previous_event_before_epilogue=self._raw_event(previous_event_before_epilogue),
            async_with_compute_stream=async_with_compute_stream, allocate_on_comm_stream=allocate_on_comm_stream,
            do_handle_copy=do_handle_copy, do_cpu_sync=bool(do_cpu_sync), do_expand=do_expand,
            do_zero_padding=do_zero_padding, use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
            **self._prechecked)
        (recv_x, recv_sf, recv_topk_idx, recv_topk_weights, copied_topk_idx, num_recv_tokens, num_expanded_tokens,
         per_expert_list, psum_rank, psum_expert, unaligned, recv_src_metadata, dst_buffer_slot_idx,
         token_metadata_at_forward, channel_linked_list, event) = out

        if cached:
            new_handle = handle
        else:
            new_handle = EPHandle(
                num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank,
                expert_alignment=expert_alignment, do_expand=do_expand, num_sms=num_sms,
                topk_idx=copied_topk_idx if copied_topk_idx is not None else topk_idx,
                num_recv_tokens=int(num_recv_tokens), num_expanded_tokens=int(num_expanded_tokens),
                num_recv_tokens_per_expert_list=list(per_expert_list),
                psum_num_recv_tokens_per_scaleup_rank=psum_rank, psum_num_recv_tokens_per_expert=psum_expert,
                num_unaligned_recv_tokens_per_expert=unaligned, recv_src_metadata=recv_src_metadata,
                dst_buffer_slot_idx=dst_buffer_slot_idx, token_metadata_at_forward=token_metadata_at_forward,
                channel_linked_list=channel_linked_list, buffer_id=self._serial)
        overlap = EventOverlap(event)
        if self.deterministic:
            def sort() -> None:
                # On the current stream, after it waited for the communication, so the tensors
                # returned are the sorted ones.
                new_handle.deterministic_sort(bool(do_cpu_sync), cached, recv_x, recv_sf, recv_topk_idx,
                                              recv_topk_weights, None)

            if async_with_compute_stream and event is not None:
                # As DeepEP: the sort runs when the caller waits on the event (the outputs may not be
                # read before that anyway), so the communication still overlaps the caller's compute.
                overlap.register_hook_after_wait(sort)
            else:
                if event is not None:
                    event.current_stream_wait()
                sort()
        recv = (recv_x, recv_sf) if sf is not None else recv_x
        return recv, recv_topk_idx, recv_topk_weights, new_handle, overlap

    @staticmethod
    def _sorted_metadata(meta: torch.Tensor, perm: torch.Tensor, do_expand: bool) -> torch.Tensor:
        """``recv_src_metadata`` for the rows the user sees (DeepEP's deterministic metadata).

        Non-expand: user row ``j`` is backend row ``perm[j]``, so the metadata rows are permuted the same
        way. Expand: the metadata has one row per received token, not per output row; its columns 2..
        (the output row of each top-k lane, or -1) are mapped to where those rows moved.
        """
        if not do_expand:
            return meta[perm]
        out = meta.clone()
        lanes = out[:, 2:]
        new_pos = torch.empty_like(perm)
        new_pos[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
        lanes64 = lanes.to(torch.int64)
        sel = (lanes64 >= 0) & (lanes64 < perm.numel())
        lanes[sel] = new_pos[lanes64[sel]].to(lanes.dtype)
        return out

    @staticmethod
    def _deterministic_perm(h: EPHandle) -> torch.Tensor:
        """Row permutation sorting received rows by source token, without a CPU sync.

        Non-expand: rows ordered by ``src_global_idx``; rows past the real count stay at the end.
        Expand: inside each expert segment, rows ordered by source token; padding rows stay at the
        segment's end and rows past the last segment stay where they are.
        """
        meta = h.backend_recv_src_metadata
        dev = meta.device
        n_rows = meta.shape[0]
        n_valid = h.psum_num_recv_tokens_per_scaleup_rank[-1].to(torch.int64)
        tok_valid = torch.arange(n_rows, device=dev) < n_valid
        big = h.num_max_tokens_per_rank * h.psum_num_recv_tokens_per_scaleup_rank.numel() + 1
        src = meta[:, 0].to(torch.int64)
        if not h.do_expand:
            key = torch.where(tok_valid, src, torch.full_like(src, big))
            return torch.sort(key, stable=True).indices
        N_exp = h.num_expanded_tokens
        L = h.num_unaligned_recv_tokens_per_expert.numel()
        real = h.num_unaligned_recv_tokens_per_expert.to(torch.int64)
        starts = h.psum_num_recv_tokens_per_expert.to(torch.int64) - real
        rows = torch.arange(N_exp, device=dev)
        e_of_row = (torch.searchsorted(starts, rows, right=True) - 1).clamp(min=0)
        valid_row = rows < starts[e_of_row] + real[e_of_row]
        src_of_row = torch.zeros(N_exp, dtype=torch.int64, device=dev)
        lanes = meta[:, 2:].to(torch.int64)
        sel = (lanes >= 0) & (lanes < N_exp) & tok_valid.view(-1, 1)
        src_of_row[lanes[sel]] = src.view(-1, 1).expand_as(lanes)[sel]
        # Padding rows and rows past the last segment share the largest key of their segment, so the
        # stable sort leaves them after the valid rows, in place.
        key = e_of_row * (big + 1) + torch.where(valid_row, src_of_row, torch.full_like(src_of_row, big))
        return torch.sort(key, stable=True).indices

    # ------------------------------------------------------------------ combine
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
            bias: None, one ``[T, H]`` bf16 tensor, or a pair (either may be None), added after the sum.
            num_sms, num_qps, previous_event, previous_event_before_epilogue, async_with_compute_stream,
            allocate_on_comm_stream: as ``dispatch``.

        Returns:
            ``(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None, EventOverlap)``.

        Raises:
            ValueError: any bad input, before anything is launched.
        """
        self._check_alive()
        if not isinstance(handle, EPHandle):
            raise ValueError(f"handle: expected the EPHandle returned by dispatch, got {type(handle).__name__}")
        if handle.buffer_id != self._serial:
            raise ValueError("handle: it was produced by another ElasticBuffer")
        n_rows = handle.num_allocated_tokens
        _check_tensor("x", x, dtype=torch.bfloat16, ndim=2, shape=(n_rows, None), device=self.device)
        H = x.shape[1]
        if (H * 2) % 16:
            raise ValueError(f"x: a row must be a multiple of 16 bytes, got hidden={H}")
        if not isinstance(handle.topk_idx, torch.Tensor) or handle.topk_idx.dim() != 2:
            raise _err("handle.topk_idx", "a 2-D tensor [num_tokens, num_topk]",
                       f"{type(handle.topk_idx).__name__} of shape {tuple(getattr(handle.topk_idx, 'shape', ()))}")
        T, K = handle.num_tokens, handle.num_topk
        _check_combine_handle(handle, T, K, self.device)
        if topk_weights is not None:
            shape = (n_rows,) if handle.do_expand else (n_rows, K)
            _check_tensor("topk_weights", topk_weights, dtype=torch.float32, ndim=len(shape), shape=shape,
                          device=self.device)
        if bias is None or isinstance(bias, torch.Tensor):
            biases = [bias, None]
        elif isinstance(bias, (str, bytes)) or not isinstance(bias, collections.abc.Iterable):
            raise ValueError(f"bias: expected None, a tensor or a sequence of at most two, got {type(bias).__name__}")
        else:
            biases = list(bias)
            if len(biases) > 2:
                raise ValueError(f"bias: expected at most two tensors, got {len(biases)}")
            biases += [None] * (2 - len(biases))
        for i, b in enumerate(biases):
            if b is not None:
                _check_tensor(f"bias[{i}]", b, dtype=torch.bfloat16, ndim=2, shape=(T, H), device=self.device)
        self._check_event_args(previous_event, allocate_on_comm_stream, previous_event_before_epilogue)
        need = _sizing.get_combine_buffer_size(handle.num_max_tokens_per_rank, H, K, 1, self.num_ranks, True,
                                               self.allow_multiple_reduction)
        if need > self.num_bytes:
            raise ValueError(f"buffer too small: this combine needs {need} bytes, the buffer has {self.num_bytes}")
        # Checked before the fallback: False or None would pick the handle's silently.
        num_sms = self._resolve_sms(_int_arg("num_sms", num_sms, 0) or handle.num_sms, handle.num_experts, K)
        num_qps = self._resolve_qps(num_qps)
        if handle.perm is not None:  # deterministic mode: back to the backend's row order
            # The scatter runs on the current stream. With previous_event the communication stream
            # waits for that event only, so the scatter has to come after it and a new event, after
            # the scatter, takes its place (found at EP 2: the comm stream read half-scattered weights).
            if previous_event is not None:
                previous_event.current_stream_wait()
            raw = torch.empty_like(x)
            raw[handle.perm] = x
            x = raw
            if topk_weights is not None:
                raw_w = torch.empty_like(topk_weights)
                raw_w[handle.perm] = topk_weights
                topk_weights = raw_w
            if previous_event is not None:
                previous_event = self.capture()
        combined_x, combined_w, event = self.runtime.combine(
            x=x, topk_weights=topk_weights, bias_0=biases[0], bias_1=biases[1],
            src_metadata=handle.backend_recv_src_metadata, combined_topk_idx=handle.topk_idx,
            psum_num_recv_tokens_per_scaleup_rank=handle.psum_num_recv_tokens_per_scaleup_rank,
            token_metadata_at_forward=handle.token_metadata_at_forward,
            channel_linked_list=handle.channel_linked_list, num_experts=handle.num_experts,
            num_max_tokens_per_rank=handle.num_max_tokens_per_rank, num_sms=num_sms, num_qps=num_qps,
            previous_event=self._raw_event(previous_event),
            previous_event_before_epilogue=self._raw_event(previous_event_before_epilogue),
            async_with_compute_stream=async_with_compute_stream, allocate_on_comm_stream=allocate_on_comm_stream,
            use_expanded_layout=handle.do_expand, **self._prechecked)
        return combined_x, combined_w, EventOverlap(event)
