"""Every argument check of the public API, in one place: ``ElasticBuffer`` validates each call once, here,
into the typed arguments of its runtime (``DispatchArgs`` / ``CombineArgs``), which trusts them.

Bad input raises ``ValueError`` naming the argument before anything is launched. Integer arguments
refuse floats, strings and bools by name (a C conversion would truncate a float and take a bool as
0 / 1); every tensor is checked for type, layout, dtype, shape, device and contiguity.
"""
from __future__ import annotations

import collections.abc
import math
import operator
from typing import Any, List, Optional, Sequence, Tuple

import torch

from . import _C
from ._events import EventHandle, EventOverlap
from ._handle import EPHandle
from ._runtime import CombineArgs, DispatchArgs

INT32_MAX = 2 ** 31 - 1  # the native kernels' and bindings' int parameters
INT64_MAX = 2 ** 63 - 1
MAX_TOPK = int(_C.MAX_TOPK)
MAX_EXPERTS = int(_C.MAX_EXPERTS)
MAX_LOCAL_EXPERTS = int(_C.MAX_LOCAL_EXPERTS)
MAX_SF_PACKS = int(_C.MAX_SF_PACKS)  # what the ranks' geometry words compare whole (kernels/geometry.hpp)
FP8 = torch.float8_e4m3fn
_C_INT = " (the native runtime takes a C int)"
_X_DTYPES = (torch.bfloat16, FP8)
_SF_DTYPES = (torch.float32, torch.int32)
_TOPK_DTYPES = (torch.int64, torch.int32)  # DeepEP builds with a 32-bit topk_idx_t; int64 is the default
_BF16 = (torch.bfloat16,)
_F32 = (torch.float32,)
_I32 = (torch.int32,)
_STRIDED = torch.strided


# ---------------------------------------------------------------------------------------------- scalars
def as_int(v: Any) -> Any:
    """``v`` as a Python int when it is an integer of any kind (numpy, torch scalars), else unchanged
    (bools stay bools, for the caller to refuse)."""
    if isinstance(v, bool):
        return v
    try:
        return operator.index(v)
    except TypeError:
        return v


def int_arg(name: str, v: Any, lo: Optional[int] = None, hi: Optional[int] = None, why: str = "") -> int:
    """``v`` as a Python int in ``[lo, hi]`` (either bound optional); integers of any kind pass,
    bools, floats and strings are refused naming the argument.

    Arguments:
        name: the argument's name, for the message.
        v: the value.
        lo, hi: inclusive bounds, or None.
        why: appended to the message of a value above ``hi`` (where the bound comes from).
    """
    i = v if type(v) is int else as_int(v)
    if isinstance(i, bool) or not isinstance(i, int) or (lo is not None and i < lo):
        what = "an int" if lo is None else "a positive int" if lo == 1 else f"an int >= {lo}"
        raise ValueError(f"{name}: expected {what}, got {v!r}")
    if hi is not None and i > hi:
        raise ValueError(f"{name}: expected at most {hi}{why}, got {i}")
    return i


def c_ints(**sizes: Any) -> Tuple[int, ...]:
    """The arguments (by name, in order) as ints in a C int's range, what the native sizing takes."""
    out = []
    for name, v in sizes.items():
        i = int_arg(name, v)
        if not -INT32_MAX - 1 <= i <= INT32_MAX:
            raise ValueError(f"{name}: expected an int in [-2**31, 2**31) (the native sizing takes a C int), got {i}")
        out.append(i)
    return tuple(out)


def real_arg(name: str, v: Any, lo: float, lo_inclusive: bool = True) -> float:
    """``v`` as a finite float ``>= lo`` (``> lo`` unless ``lo_inclusive``)."""
    if isinstance(v, (bool, str, bytes)):
        raise ValueError(f"{name}: expected a number, got {v!r}")
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name}: expected a number, got {v!r}") from None
    if not math.isfinite(f) or f < lo or (f == lo and not lo_inclusive):
        raise ValueError(f"{name}: expected a finite number {'>=' if lo_inclusive else '>'} {lo}, got {v!r}")
    return f


def itemsize(dtype: Any) -> int:
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: expected a torch.dtype, got {dtype!r}")
    return dtype.itemsize


def is_sequence(v: Any) -> bool:
    return isinstance(v, collections.abc.Sequence) and not isinstance(v, (str, bytes))


# ---------------------------------------------------------------------------------------------- tensors
def describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device}, contiguous={t.is_contiguous()})"
    return repr(type(t).__name__) if t is not None else "None"


def refuse_during_capture(what: str) -> None:
    """Raises ``RuntimeError`` when the current CUDA stream is capturing a graph: creating a buffer runs
    collectives, allocations and device synchronisations, which a capture forbids (it would otherwise fail
    deep inside NCCL or CUDA with an error that does not say why). Checked before anything collective, on
    each rank."""
    if torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what}(...) was called while the current CUDA stream is capturing a graph; creating a "
                           "buffer runs collectives and allocations that a capture cannot hold. Create the buffer "
                           "before capturing (e.g. at start-up, sized for the largest batch) and capture only its "
                           "dispatch / combine calls")


def check_dense(name: str, t: torch.Tensor) -> None:
    """Refuses sparse and nested tensors by name: their shape, strides and data pointer raise, or mean
    something else, where the other checks and the kernels read them."""
    if t.layout != _STRIDED or t.is_nested:
        kind = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise ValueError(f"{name}: expected a dense (strided) tensor, got {kind}")


def off_device(t: torch.Tensor, device: torch.device) -> bool:
    """True when ``t`` is not on ``device``. On a CUDA buffer this is one integer compare
    (``get_device()`` is the CUDA index, -1 off CUDA), which also catches another GPU's tensor: the
    native kernels take raw pointers of the buffer's device."""
    if device.type == "cuda":
        return t.get_device() != device.index
    return t.device != device


def check_tensor(name: str, t: Any, dtypes: Tuple[torch.dtype, ...], ndim: int, device: torch.device,
                 shape: Optional[Sequence[Optional[int]]] = None, contiguous: bool = True) -> None:
    """Raises ValueError naming ``name`` unless ``t`` is a dense tensor of one of ``dtypes``, ``ndim``
    dimensions, ``shape`` (None entries: any), on ``device`` and (``contiguous``) contiguous."""
    # On every dispatch and combine: each tensor attribute is read once.
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {describe(t)}")
    if t.layout != _STRIDED or t.is_nested:
        check_dense(name, t)
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    size = t.shape
    if len(size) != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(size)}")
    if shape is not None:
        for i, s in enumerate(shape):
            if s is not None and size[i] != s:
                raise ValueError(f"{name}: expected shape {tuple('*' if v is None else v for v in shape)}, got shape "
                                 f"{tuple(size)}")
    if off_device(t, device):
        raise ValueError(f"{name}: expected a tensor on {device} (the buffer's device), got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def check_handle_tensors(handle: EPHandle, names: Sequence[str], device: torch.device,
                         shapes: Optional[dict] = None) -> None:
    """The handle's tensors a call uses must be on the buffer's device (the handle is a plain dataclass:
    its fields may have been replaced since the dispatch that made it); with ``shapes`` (name ->
    shape) each must also be an int32 tensor of that shape."""
    for name in names:
        t = getattr(handle, name)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"handle.{name}: expected a torch.Tensor, got {describe(t)}")
        if off_device(t, device):
            raise ValueError(f"handle.{name}: expected a tensor on {device} (the buffer's device), got {t.device}")
        if shapes is not None and (t.dtype != torch.int32 or tuple(t.shape) != shapes[name]):
            raise ValueError(f"handle.{name}: expected an int32 tensor of shape {shapes[name]} (the handle must come "
                             f"from a dispatch of these tokens, top-k and ranks), got {t.dtype} of shape "
                             f"{tuple(t.shape)}")


_CACHED_HANDLE_TENSORS = ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                          "num_unaligned_recv_tokens_per_expert", "dst_buffer_slot_idx", "recv_src_metadata")
_COMBINE_HANDLE_TENSORS = ("topk_idx", "psum_num_recv_tokens_per_scaleup_rank", "recv_src_metadata")


# ---------------------------------------------------------------------------------------------- routing
def check_routing(num_experts: Any, expert_alignment: Any, num_ranks: int, num_max_tokens_per_rank: int,
                  num_topk: int) -> Tuple[int, int]:
    """``(num_experts, expert_alignment)`` as ints both runtimes handle: a positive multiple of the rank
    count within the native kernels' expert limits, and an alignment whose worst-case expanded layout
    fits the int32 per-expert offsets of the handle."""
    R = num_ranks
    E = as_int(num_experts)
    if isinstance(E, bool) or not isinstance(E, int) or E <= 0 or E % R:
        raise ValueError(f"num_experts: expected a positive multiple of the rank count {R}, got {num_experts!r}")
    if E > MAX_EXPERTS:
        raise ValueError(f"num_experts: expected at most {MAX_EXPERTS} (the native kernels' limit), got {E}")
    L = E // R
    if L > MAX_LOCAL_EXPERTS:
        raise ValueError(f"num_experts: expected at most {MAX_LOCAL_EXPERTS} experts per rank (the native kernels' "
                         f"limit), got {E} on {R} ranks ({L} per rank)")
    a = int_arg("expert_alignment", expert_alignment, 1)
    worst = int(_C.worst_case_num_expanded_tokens(R, num_max_tokens_per_rank, num_topk, L, a)) if a <= INT32_MAX else a
    if worst > INT32_MAX:
        raise ValueError(f"expert_alignment: {a} with num_max_tokens_per_rank={num_max_tokens_per_rank}, num_topk="
                         f"{num_topk} and {R} rank(s) gives an expanded worst case of {worst} rows or more; it must be "
                         "below 2**31 (the per-expert offsets are int32)")
    return E, a


def expert_ids_error(num_bad: int, example: int, num_experts: int) -> ValueError:
    """The error for ``num_bad`` entries of ``topk_idx`` outside ``[-1, num_experts)``."""
    return ValueError(f"topk_idx: expert ids must be in [-1, {num_experts}), got {num_bad} outside it "
                      f"(e.g. {example})")


def count_bad_expert_ids(topk_idx: torch.Tensor, num_experts: int) -> Tuple[int, int]:
    """``(count, an example)`` of the ids outside ``[-1, num_experts)`` with torch ops (one host sync);
    ``(0, 0)`` when there are none."""
    if topk_idx.numel() == 0:
        return 0, 0
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    num_bad = int(bad.sum())
    return (num_bad, int(topk_idx[bad][0])) if num_bad else (0, 0)


# ---------------------------------------------------------------------------------------------- events
def check_event(name: str, e: Any) -> None:
    """An event argument must be an ``EventHandle`` (``capture()``) or an ``EventOverlap`` (what a call
    returned): anything else would fail only after the first kernels were queued."""
    if isinstance(e, EventHandle) or (isinstance(e, EventOverlap) and (e.event is None or
                                                                      isinstance(e.event, EventHandle))):
        return
    inner = f" around a {type(e.event).__name__}" if isinstance(e, EventOverlap) else ""
    raise ValueError(f"{name}: expected None, an EventHandle (ElasticBuffer.capture()) or the EventOverlap a "
                     f"dispatch / combine returned, got a {type(e).__name__}{inner}")


def _raw_events(previous_event: Any, previous_event_before_epilogue: Any,
                allocate_on_comm_stream: bool) -> Tuple[Optional[EventHandle], Optional[EventHandle]]:
    """Both event arguments checked, as the ``EventHandle`` behind each (or None)."""
    if previous_event is None and previous_event_before_epilogue is None:
        return None, None
    raw = []
    for name, e in (("previous_event", previous_event),
                    ("previous_event_before_epilogue", previous_event_before_epilogue)):
        if e is not None:
            check_event(name, e)
            e = e.event if isinstance(e, EventOverlap) else e
        raw.append(e)
    if previous_event is not None and not allocate_on_comm_stream:
        raise ValueError("previous_event: requires allocate_on_comm_stream=True (outputs must be allocated "
                         "on the communication stream when waiting for overlapped compute)")
    return raw[0], raw[1]


# ---------------------------------------------------------------------------------------------- calls
def _num_qps(buf: Any, num_qps: Any) -> int:
    """``num_qps`` has no effect without RDMA, but DeepEP refuses more than were allocated: the same
    refusal keeps code that runs here from failing there."""
    n = int_arg("num_qps", num_qps, 0)
    if n > buf.num_allocated_qps:
        raise ValueError(f"num_qps: expected at most num_allocated_qps={buf.num_allocated_qps}, got {n}")
    return n


def _num_sms(buf: Any, num_sms: int, num_experts: int, num_topk: int) -> int:
    """The SM count of a call: ``num_sms``, else ``ELASTIC_EP_NUM_SMS``, else DeepEP's theoretical count."""
    if num_sms == 0:
        num_sms = buf._sms_for(num_experts, num_topk)
    if buf._max_sms is not None and num_sms > buf._max_sms:
        raise ValueError(f"num_sms must be in [0, {buf._max_sms}], got {num_sms}")
    return num_sms


def dispatch_bytes(num_max_tokens_per_rank: int, hidden: int, num_sf_packs: int, num_topk: int, elem_size: int,
                   num_ranks: int) -> int:
    """Bytes a direct-mode dispatch of these sizes needs (``get_dispatch_buffer_size`` on NVLink)."""
    sizes = c_ints(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_sf_packs=num_sf_packs,
                   num_topk=num_topk, elem_size=elem_size, num_scaleup_ranks=num_ranks)
    return int(_C.get_dispatch_buffer_size(*sizes[:5], 1, sizes[5], True))


def combine_bytes(num_max_tokens_per_rank: int, hidden: int, num_topk: int, num_ranks: int,
                  allow_multiple_reduction: bool) -> int:
    """Bytes a direct-mode combine of these sizes needs (``get_combine_buffer_size`` on NVLink)."""
    M, H, K, R = c_ints(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk,
                        num_scaleup_ranks=num_ranks)
    return int(_C.get_combine_buffer_size(M, H, K, 1, R, True, bool(allow_multiple_reduction)))


def dispatch_args(buf: Any, x: Any, topk_idx: Any, topk_weights: Any, stats: Any, num_experts: Any,
                  num_max_tokens_per_rank: Any, expert_alignment: Any, num_sms: Any, num_qps: Any,
                  previous_event: Any, previous_event_before_epilogue: Any, async_with_compute_stream: bool,
                  allocate_on_comm_stream: bool, handle: Any, do_handle_copy: bool, do_cpu_sync: Any,
                  do_expand: bool, do_zero_padding: bool, use_tma_aligned_col_major_sf: bool,
                  zero_copy: bool = False) -> DispatchArgs:
    """Every check of ``ElasticBuffer.dispatch`` (its arguments, in its order); the typed arguments of the
    runtime's dispatch. ``buf`` is the buffer (its device, sizes, serial number and SM policy)."""
    R, dev = buf.num_ranks, buf.device
    # ---- data
    sf = None
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"x: expected a tensor or a (x, sf) pair, got a sequence of {len(x)}")
        x, sf = x
    check_tensor("x", x, _X_DTYPES, 2, dev)
    T, H = x.shape
    if x.dtype == FP8 and sf is None:
        raise ValueError("x: FP8 rows need scales: pass x=(x_fp8, sf)")
    if sf is not None:
        if x.dtype != FP8:
            raise ValueError(f"sf: scales are only meaningful with float8_e4m3fn x, got x of {x.dtype}")
        check_tensor("sf", sf, _SF_DTYPES, 2, dev, shape=(T, None), contiguous=False)
        if not 0 < sf.shape[1] <= MAX_SF_PACKS:
            raise ValueError(f"sf: expected 1 to {MAX_SF_PACKS} scale packs per token, got shape {tuple(sf.shape)}")
    elem = x.element_size()
    if (H * elem) % 16:
        raise ValueError(f"x: a row must be a multiple of 16 bytes, got hidden={H} x {elem} B")
    # ---- cached mode
    cached = handle is not None
    if cached:
        if not isinstance(handle, EPHandle):
            raise ValueError(f"handle: expected an EPHandle from dispatch, got {type(handle).__name__}")
        if handle.buffer_id != buf._serial:
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
        stats = None
    else:
        if topk_idx is None:
            raise ValueError("topk_idx: required unless a cached handle is given")
        if num_experts is None:
            raise ValueError("num_experts: required unless a cached handle is given")
        if expert_alignment is None:
            expert_alignment = 1
        if num_max_tokens_per_rank is None:
            num_max_tokens_per_rank = buf.num_max_tokens_per_rank
        if do_cpu_sync is None:
            do_cpu_sync = not buf._capturing()
        elif do_cpu_sync and buf._capturing():
            raise ValueError("do_cpu_sync: cannot be True while a CUDA graph is being captured (the CPU would "
                             "wait for counts that no kernel produces until replay); pass False or None")
    check_tensor("topk_idx", topk_idx, _TOPK_DTYPES, 2, dev, shape=(T, None))
    K = topk_idx.shape[1]
    if not 0 < K <= MAX_TOPK:
        raise ValueError(f"topk_idx: expected 1..{MAX_TOPK} experts per token, got {K}")
    if num_max_tokens_per_rank is None or num_max_tokens_per_rank == 0:
        raise ValueError("num_max_tokens_per_rank: expected a positive int (the buffer was created without "
                         f"one), got {num_max_tokens_per_rank}")
    M = int_arg("num_max_tokens_per_rank", num_max_tokens_per_rank, 1)
    key = (num_experts, expert_alignment, M, K)
    routing = buf._routing_cache.get(key) if type(num_experts) is int and type(expert_alignment) is int else None
    if routing is None:
        routing = check_routing(num_experts, expert_alignment, R, M, K)
        buf._routing_cache[key] = routing
    E, a = routing
    if T > M:
        raise ValueError(f"x: {T} tokens exceed num_max_tokens_per_rank={M}")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, _F32, 2, dev, shape=(T, K))
    if stats is not None:
        check_tensor("cumulative_local_expert_recv_stats", stats, _I32, 1, dev, shape=(E // R,))
    if do_zero_padding and not do_expand:
        raise ValueError("do_zero_padding: only valid with do_expand=True (it zeroes the alignment gaps of the "
                         "expanded layout)")
    prev, prev_epi = _raw_events(previous_event, previous_event_before_epilogue, allocate_on_comm_stream)
    packs = sf.shape[1] if sf is not None else 0
    key = (M, H, packs, K, elem)
    need = buf._need_cache.get(key)
    if need is None:
        need = buf._need_cache[key] = dispatch_bytes(M, H, packs, K, elem, R)
    if need > buf.num_bytes:
        raise ValueError(f"buffer too small: this dispatch needs {need} bytes (max_tokens={M}, hidden={H}, "
                         f"topk={K}, sf packs={packs}), the buffer has {buf.num_bytes}; size it with "
                         "get_buffer_size_hint")
    zc_off = _zero_copy_offset(buf, zero_copy, do_expand, handle if cached else None, M, H, packs, K, elem) \
        if zero_copy else -1
    if cached:
        check_views_alive(buf, handle, "dispatch")
        L = E // R
        meta = (handle.num_recv_tokens, K + 2)
        names = _CACHED_HANDLE_TENSORS + (("raw_recv_src_metadata",) if handle.perm is not None else ())
        check_handle_tensors(handle, names, dev, dict(
            psum_num_recv_tokens_per_scaleup_rank=(R,), psum_num_recv_tokens_per_expert=(L,),
            num_unaligned_recv_tokens_per_expert=(L,), dst_buffer_slot_idx=(T, K), recv_src_metadata=meta,
            raw_recv_src_metadata=meta))
    sms = _num_sms(buf, int_arg("num_sms", num_sms, 0), E, K)
    qps = _num_qps(buf, num_qps)
    return DispatchArgs(
        x=x, sf=sf, topk_idx=topk_idx, topk_weights=topk_weights, cumulative_local_expert_recv_stats=stats,
        handle=handle if cached else None, num_tokens=T, hidden=H, num_topk=K, num_experts=E,
        num_max_tokens_per_rank=M, expert_alignment=a, num_sms=sms, num_qps=qps, previous_event=prev,
        previous_event_before_epilogue=prev_epi, async_with_compute_stream=bool(async_with_compute_stream),
        allocate_on_comm_stream=bool(allocate_on_comm_stream), do_handle_copy=bool(do_handle_copy),
        do_cpu_sync=bool(do_cpu_sync), do_expand=bool(do_expand), do_zero_padding=bool(do_zero_padding),
        use_tma_aligned_col_major_sf=bool(use_tma_aligned_col_major_sf), zero_copy=bool(zero_copy),
        zero_copy_x_offset=zc_off)


def _zero_copy_offset(buf: Any, zero_copy: Any, do_expand: bool, handle: Optional[EPHandle], M: int, H: int,
                      packs: int, K: int, elem: int) -> int:
    """``dispatch(zero_copy=True)``'s checks; the offset of the zero-copy receive area in the buffer."""
    R = buf.num_ranks
    if type(zero_copy) is not bool:
        raise ValueError(f"zero_copy: expected a bool, got {type(zero_copy).__name__}")
    if do_expand:
        raise ValueError("zero_copy: only the non-expanded layout is returned as views (do_expand=False); the "
                         "expanded rows' places are known only after the counts arrive")
    if handle is not None and handle.direct_base is None:
        raise ValueError("zero_copy: the cached handle comes from a dispatch without zero_copy (it has no "
                         "direct_base); make the first dispatch with zero_copy=True")
    zkey = ("zero_copy", M, H, packs, K, elem)
    zc = buf._need_cache.get(zkey)
    if zc is None:
        zc = buf._need_cache[zkey] = zero_copy_layout(buf.num_bytes, R, M, H, elem, packs, K,
                                                      buf.allow_multiple_reduction)
    zc_off, zc_need = zc
    if zc_off < 0:
        raise ValueError(f"buffer too small for zero_copy: it needs {zc_need} bytes (max_tokens={M}, hidden={H}, "
                         f"topk={K}: the receive area of {R} x {M} rows after the records and the combine area), "
                         f"the buffer has {buf.num_bytes}; size it with get_buffer_size_hint(..., zero_copy=True)")
    return zc_off


def zero_copy_layout(buffer_bytes: int, num_ranks: int, num_max_tokens_per_rank: int, hidden: int, elem_size: int,
                     num_sf_packs: int, num_topk: int, allow_multiple_reduction: bool) -> Tuple[int, int]:
    """``(offset of the zero-copy receive area in the buffer or -1, the buffer size it needs)`` (sizing.hpp)."""
    M, H, P, K, R = c_ints(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_sf_packs=num_sf_packs,
                           num_topk=num_topk, num_ranks=num_ranks)
    off, need = _C.zero_copy_layout(int(buffer_bytes), R, M, H, int(elem_size), P, K, bool(allow_multiple_reduction))
    return int(off), int(need)


def check_views_alive(buf: Any, handle: EPHandle, op: str) -> None:
    """Refuses a handle whose zero-copy ``recv_x`` views a later dispatch on ``buf`` overwrote."""
    if handle.views_serial and handle.views_serial != buf._dispatch_serial:
        later = buf._dispatch_serial - handle.views_serial
        raise ValueError(f"handle: its dispatch returned zero-copy views (zero_copy=True), and {later} later "
                         f"dispatch(es) on this buffer overwrote them, so expert outputs computed from them now are "
                         f"not that dispatch's data; {op} with this handle is refused. Finish each zero-copy "
                         f"dispatch's {op} before the next dispatch, or clone recv_x")


def _biases(bias: Any) -> List[Optional[torch.Tensor]]:
    if bias is None or isinstance(bias, torch.Tensor):
        return [bias, None]
    if isinstance(bias, (str, bytes)) or not isinstance(bias, collections.abc.Iterable):
        raise ValueError(f"bias: expected None, a tensor or a sequence of at most two, got {type(bias).__name__}")
    biases = list(bias)
    if len(biases) > 2:
        raise ValueError(f"bias: expected at most two tensors, got {len(biases)}")
    return biases + [None] * (2 - len(biases))


def combine_args(buf: Any, x: Any, handle: Any, topk_weights: Any, bias: Any, num_sms: Any, num_qps: Any,
                 previous_event: Any, previous_event_before_epilogue: Any, async_with_compute_stream: bool,
                 allocate_on_comm_stream: bool) -> CombineArgs:
    """Every check of ``ElasticBuffer.combine`` (its arguments, in its order); the typed arguments of the
    runtime's combine, ``x`` and ``topk_weights`` still in the user's row order."""
    dev = buf.device
    if not isinstance(handle, EPHandle):
        raise ValueError(f"handle: expected the EPHandle returned by dispatch, got {type(handle).__name__}")
    if handle.buffer_id != buf._serial:
        raise ValueError("handle: it was produced by another ElasticBuffer")
    check_views_alive(buf, handle, "combine")
    n_rows = handle.num_allocated_tokens
    check_tensor("x", x, _BF16, 2, dev, shape=(n_rows, None))
    H = x.shape[1]
    if (H * 2) % 16:
        raise ValueError(f"x: a row must be a multiple of 16 bytes, got hidden={H}")
    ti = handle.topk_idx
    if not isinstance(ti, torch.Tensor) or ti.dim() != 2:
        raise ValueError("handle.topk_idx: expected a 2-D tensor [num_tokens, num_topk], got "
                         f"{type(ti).__name__} of shape {tuple(getattr(ti, 'shape', ()))}")
    T, K = ti.shape
    # K is the kernels' lane count: 0 would divide by zero, more than 32 breaks their one-warp lane logic.
    if not 0 < K <= MAX_TOPK:
        raise ValueError(f"handle.num_topk: expected 1..{MAX_TOPK}, got {K}")
    check_handle_tensors(handle, _COMBINE_HANDLE_TENSORS, dev)
    meta = handle.recv_src_metadata
    if meta.dim() != 2 or meta.shape[1] != K + 2:
        raise ValueError(f"handle.recv_src_metadata: expected shape (*, {K + 2}) (num_topk + 2 columns), got shape "
                         f"{tuple(meta.shape)}")
    if topk_weights is not None:
        shape = (n_rows,) if handle.do_expand else (n_rows, K)
        check_tensor("topk_weights", topk_weights, _F32, len(shape), dev, shape=shape)
    b0, b1 = _biases(bias)
    for i, b in enumerate((b0, b1)):
        if b is not None:
            check_tensor(f"bias[{i}]", b, _BF16, 2, dev, shape=(T, H))
    prev, prev_epi = _raw_events(previous_event, previous_event_before_epilogue, allocate_on_comm_stream)
    key = (handle.num_max_tokens_per_rank, H, K)
    need = buf._combine_need_cache.get(key)
    if need is None:
        need = buf._combine_need_cache[key] = combine_bytes(handle.num_max_tokens_per_rank, H, K, buf.num_ranks,
                                                            buf.allow_multiple_reduction)
    if need > buf.num_bytes:
        raise ValueError(f"buffer too small: this combine needs {need} bytes, the buffer has {buf.num_bytes}")
    # Checked before the fallback: False or None would pick the handle's silently.
    sms = _num_sms(buf, int_arg("num_sms", num_sms, 0) or handle.num_sms, handle.num_experts, K)
    qps = _num_qps(buf, num_qps)
    return CombineArgs(x=x, handle=handle, topk_weights=topk_weights, bias_0=b0, bias_1=b1, num_sms=sms, num_qps=qps,
                       previous_event=prev, previous_event_before_epilogue=prev_epi,
                       async_with_compute_stream=bool(async_with_compute_stream),
                       allocate_on_comm_stream=bool(allocate_on_comm_stream))
