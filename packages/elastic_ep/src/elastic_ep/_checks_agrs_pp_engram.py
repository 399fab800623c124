"""Argument checks of ``ElasticBuffer``'s AGRS, PP and Engram methods (``_ops_agrs_pp_engram``): each
returns what the runtime needs, or raises ``ValueError`` naming the argument before anything is sent.
The scalar and tensor helpers are ``_checks``'."""
from __future__ import annotations

import math
from typing import Any, List, Tuple

import torch

from . import _C
from ._checks import INT32_MAX, _num_qps, check_dense, check_tensor, describe, int_arg, is_sequence, itemsize, off_device
from ._runtime import AllGatherArgs

# ---------------------------------------------------------------------------------------------- AGRS
#: Most all-gathers one AGRS session may hold (DeepEP V2's in-flight limit of its workspace).
MAX_AGRS_PER_SESSION = 32


def align32(n: int) -> int:
    return (n + 31) // 32 * 32


def agrs_shapes(shapes: Any) -> Tuple[List[Tuple[int, ...]], bool]:
    """``(shapes as tuples, batched)``: one shape (a tuple / ``torch.Size`` of ints) or a non-empty
    sequence of them; ``batched`` when a sequence of shapes was given."""
    if not is_sequence(shapes) or not shapes:
        raise ValueError(f"shapes: expected a shape or a non-empty sequence of shapes, got {shapes!r}")
    batched = is_sequence(shapes[0])  # a torch.Size starts with an int too
    out = []
    for i, shape in enumerate(shapes if batched else (shapes,)):
        if not is_sequence(shape):
            raise ValueError(f"shapes[{i}]: expected a shape (a sequence of ints), got {shape!r}")
        out.append(tuple(int_arg(f"shapes[{i}]", d, 0) for d in shape))
    return out, batched


def agrs_config_args(buf: Any, num_max_session_bytes: Any, num_max_all_gathers_per_session: Any) -> Tuple[int, int]:
    """``agrs_set_config``'s arguments: ``(session bytes rounded up to 32, gathers per session)``."""
    if buf._agrs_in_session:
        raise ValueError("agrs_set_config: called inside an AGRS session; end it (destroy_agrs_session) first")
    n = int_arg("num_max_session_bytes", num_max_session_bytes, 1, buf.num_bytes,
                " (the buffer's num_bytes, as DeepEP V2)")
    k = int_arg("num_max_all_gathers_per_session", num_max_all_gathers_per_session, 1, MAX_AGRS_PER_SESSION,
                " (DeepEP V2's in-flight all-gather limit)")
    return align32(n), k


def _agrs_ready(buf: Any, op: str) -> None:
    if buf._agrs_region is None:
        raise ValueError(f"{op}: AGRS is not configured; call agrs_set_config(num_max_session_bytes, "
                         "num_max_all_gathers_per_session) first")
    if not buf._agrs_in_session:
        raise ValueError(f"{op}: called outside an AGRS session; use `with buf.agrs_new_session():` or "
                         "create_agrs_session() / destroy_agrs_session()")
    if buf._agrs_slot >= buf._agrs_max_gathers:
        raise ValueError(f"{op}: this session already holds num_max_all_gathers_per_session="
                         f"{buf._agrs_max_gathers} all-gathers; end the session (or configure more)")


def _agrs_budget(buf: Any, op: str, end: int) -> None:
    if end > buf._agrs_region.numel():
        raise ValueError(f"{op}: the session would need {end} bytes, more than num_max_session_bytes="
                         f"{buf._agrs_region.numel()} (get_agrs_num_max_session_bytes sizes a session); end the "
                         "session or configure more bytes")


def agrs_inplace_args(buf: Any, shapes: Any, dtype: Any) -> Tuple[List[Tuple[Tuple[int, ...], int]], bool]:
    """``agrs_get_inplace_tensor``'s arguments: ``([(shape, byte offset of this rank's part)], batched)``."""
    _agrs_ready(buf, "agrs_get_inplace_tensor")
    shapes, batched = agrs_shapes(shapes)
    size = itemsize(dtype)
    R, me, offset, out = buf.num_ranks, buf.rank_idx, buf._agrs_offset, []
    for shape in shapes:
        nbytes = math.prod(shape) * size
        out.append((shape, offset + nbytes * me))
        offset += align32(nbytes * R)
    _agrs_budget(buf, "agrs_get_inplace_tensor", offset)
    return out, batched


def all_gather_args(buf: Any, t: Any) -> Tuple[Any, bool, int]:
    """``all_gather``'s argument (a tensor or a non-empty sequence of them): ``(AllGatherArgs, batched,
    the session's byte offset after this gather)``."""
    _agrs_ready(buf, "all_gather")
    batched = not isinstance(t, torch.Tensor)
    if batched and (not is_sequence(t) or not t):
        raise ValueError(f"t: expected a tensor or a non-empty sequence of tensors, got {describe(t)}")
    tensors = list(t) if batched else [t]
    region = buf._agrs_region
    base, R, me, offset = region.data_ptr(), buf.num_ranks, buf.rank_idx, buf._agrs_offset
    offsets, inplace = [], []
    for i, x in enumerate(tensors):
        name = f"t[{i}]" if batched else "t"
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {describe(x)}")
        check_dense(name, x)
        if off_device(x, buf.device):
            raise ValueError(f"{name}: expected a tensor on {buf.device}, got {describe(x)}")
        if not x.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got {describe(x)}")
        nbytes = x.nbytes
        ptr = x.data_ptr()
        mine = nbytes > 0 and base <= ptr < base + region.numel()
        if mine and ptr != base + offset + nbytes * me:
            raise ValueError(f"{name}: a tensor inside the AGRS session region must be this rank's part of this "
                             f"gather (agrs_get_inplace_tensor, in the order of the gathers), at byte "
                             f"{offset + nbytes * me}, got byte {ptr - base}")
        offsets.append(offset)
        inplace.append(mine)
        offset += align32(nbytes * R)
    _agrs_budget(buf, "all_gather", offset)
    return AllGatherArgs(tensors, offsets, inplace, buf._agrs_session_idx, buf._agrs_slot), batched, offset


# ---------------------------------------------------------------------------------------------- PP
def pp_config_args(buf: Any, num_max_tensor_bytes: Any, num_max_inflight_tensors: Any) -> Tuple[int, int]:
    """``pp_set_config``'s arguments: ``(tensor bytes rounded up to 32, tensors in flight per peer)``;
    DeepEP V2's four regions of ``inflight x bytes`` must fit the buffer's ``num_bytes``."""
    n = int_arg("num_max_tensor_bytes", num_max_tensor_bytes, 1)
    k = int_arg("num_max_inflight_tensors", num_max_inflight_tensors, 1)
    if 4 * n * k > buf.num_bytes:
        raise ValueError(f"num_max_tensor_bytes x num_max_inflight_tensors: 4 x {n} x {k} bytes exceed the buffer's "
                         f"num_bytes={buf.num_bytes} (get_pp_buffer_size_hint sizes a buffer for them)")
    if buf.backend == "native":
        # Any peer may send: the native runtime keeps a row of slots per source rank.
        need = int(_C.pp_buffer_bytes(buf.num_ranks, n, k))
        if need > buf.num_bytes:
            raise ValueError(f"num_max_tensor_bytes x num_max_inflight_tensors: the native runtime's receive slots, "
                             f"{buf.num_ranks} ranks x {k} x {align32(n)} bytes = {need}, exceed the buffer's "
                             f"num_bytes={buf.num_bytes}")
    return align32(n), k


def pp_args(buf: Any, op: str, t: Any, peer_name: str, peer: Any, num_sms: Any) -> int:
    """Checks ``pp_send`` / ``pp_recv``'s arguments; returns the peer's rank index."""
    if not buf._pp_max_bytes:
        raise ValueError(f"{op}: PP is not configured; call pp_set_config(num_max_tensor_bytes, "
                         "num_max_inflight_tensors) first")
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"t: expected a tensor, got {describe(t)}")
    check_dense("t", t)
    if off_device(t, buf.device) or not t.is_contiguous():
        raise ValueError(f"t: expected a contiguous tensor on {buf.device}, got {describe(t)}")
    if t.nbytes > buf._pp_max_bytes:
        raise ValueError(f"t: {t.nbytes} bytes exceed num_max_tensor_bytes={buf._pp_max_bytes} (pp_set_config)")
    peer = int_arg(peer_name, peer, 0, buf.num_ranks - 1, f" (the group has {buf.num_ranks} ranks)")
    if peer == buf.rank_idx:
        raise ValueError(f"{peer_name}: expected another rank than this one ({buf.rank_idx})")
    int_arg("num_sms", num_sms, 0, INT32_MAX)
    return peer


# ---------------------------------------------------------------------------------------------- Engram
def engram_write_args(buf: Any, storage: Any, sf: Any) -> None:
    """Checks ``engram_write``'s arguments (this rank's shard and the replicated scale table)."""
    if not buf.num_cpu_bytes:
        raise ValueError("engram_write: the buffer has no CPU (Engram) segment; create it with num_cpu_bytes > 0 "
                         "(get_engram_storage_size_hint sizes it)")
    check_tensor("storage", storage, (torch.bfloat16, torch.float8_e4m3fn), 2, buf.device)
    if storage.shape[0] < 1 or storage.shape[1] < 1:
        raise ValueError(f"storage: expected [num_entries >= 1, hidden >= 1], got {describe(storage)}")
    if storage.nbytes > buf.num_cpu_bytes:
        raise ValueError(f"storage: {storage.nbytes} bytes exceed num_cpu_bytes={buf.num_cpu_bytes}")
    fp8 = storage.dtype == torch.float8_e4m3fn
    if fp8 != (sf is not None):
        raise ValueError("sf: expected the scale factors with an FP8 (float8_e4m3fn) storage and None with a bf16 one, "
                         f"got {describe(sf)} with {storage.dtype}")
    if sf is not None:
        check_tensor("sf", sf, (torch.float32, torch.int32), 2, buf.device)
        total = storage.shape[0] * buf.num_ranks
        if sf.shape[0] != total or sf.shape[1] < 1:
            raise ValueError(f"sf: expected [num_entries x num_ranks = {total}, num_sf_packs >= 1] (replicated on every "
                             f"rank), got {describe(sf)}")


def engram_fetch_args(buf: Any, indices: Any, num_qps: Any, use_tma_aligned_col_major_sf: Any) -> None:
    """Checks ``engram_fetch``'s arguments; every index must name an entry (``[0, entries x ranks)``)."""
    if not buf._engram_shape:
        raise ValueError("engram_fetch: no Engram table; call engram_write first")
    check_tensor("indices", indices, (torch.int32,), 2, buf.device)
    _num_qps(buf, num_qps)
    if not isinstance(use_tma_aligned_col_major_sf, bool):
        raise ValueError(f"use_tma_aligned_col_major_sf: expected a bool, got {use_tma_aligned_col_major_sf!r}")
    num_entries, hidden, elem = buf._engram_shape
    T, E = indices.shape
    if T * E * hidden * elem > buf.num_bytes:
        raise ValueError(f"indices: {T} x {E} entries of {hidden * elem} bytes exceed the buffer's num_bytes="
                         f"{buf.num_bytes}")
    total = num_entries * buf.num_ranks
    if indices.numel():
        bad = (indices < 0) | (indices >= total)
        num_bad = int(bad.sum())
        if num_bad:
            example = int(indices[bad][0])
            raise ValueError(f"indices: {num_bad} outside [0, {total}) (the table's entries on all ranks), e.g. "
                             f"{example}; DeepEP V2 reads such indices unchecked")
