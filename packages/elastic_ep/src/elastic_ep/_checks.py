"""Argument checks shared by the two low-level backends (native ``_low_level`` and ``_torch_backend``),
so both reject the same calls with the same messages before anything is launched."""
from __future__ import annotations

import math
import operator
import os
from typing import Any, Mapping, Optional

import torch

# _sizing imports this module too; both only read each other's names at call time, so the cycle is
# harmless, and a module-level import keeps an import statement off every dispatch.
from . import _sizing

INT32_MAX = 2 ** 31 - 1  # the native kernels' and bindings' int parameters
INT64_MAX = 2 ** 63 - 1
# The native kernels' expert limits (csrc/sizing.hpp kMaxExperts, kMaxLocalExperts), kept by the torch
# backend too so that both backends refuse the same calls.
MAX_EXPERTS = 2048
MAX_LOCAL_EXPERTS = 256


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
    """``v`` as a Python int in ``[lo, hi]`` (either bound optional). Integers of any kind pass (numpy,
    torch scalars); bools, floats and strings are refused naming the argument: a C conversion would
    truncate a float, take a bool as 0 / 1 and refuse a larger int only with pybind11's
    "incompatible function arguments", after earlier work may already have run.

    Arguments:
        name: the argument's name, for the message.
        v: the value.
        lo, hi: inclusive bounds, or None.
        why: appended to the message of a value above ``hi`` (where the bound comes from).
    """
    i = as_int(v)
    if isinstance(i, bool) or not isinstance(i, int) or (lo is not None and i < lo):
        what = "an int" if lo is None else "a positive int" if lo == 1 else f"an int >= {lo}"
        raise ValueError(f"{name}: expected {what}, got {v!r}")
    if hi is not None and i > hi:
        raise ValueError(f"{name}: expected at most {hi}{why}, got {i}")
    return i


def real_arg(name: str, v: Any, lo: float, lo_inclusive: bool = True) -> float:
    """``v`` as a finite float ``>= lo`` (``> lo`` unless ``lo_inclusive``); bools, strings and NaN are
    refused naming the argument."""
    if isinstance(v, (bool, str, bytes)):
        raise ValueError(f"{name}: expected a number, got {v!r}")
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name}: expected a number, got {v!r}") from None
    if not math.isfinite(f) or f < lo or (f == lo and not lo_inclusive):
        raise ValueError(f"{name}: expected a finite number {'>=' if lo_inclusive else '>'} {lo}, got {v!r}")
    return f


def check_dense(name: str, t: Any) -> None:
    """Refuses sparse and nested tensors by name: their shape, strides and data pointer raise, or mean
    something else, where the callers' other checks and the kernels read them."""
    if t.layout != torch.strided or t.is_nested:
        kind = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise ValueError(f"{name}: expected a dense (strided) tensor, got {kind}")


def check_routing(num_experts: Any, expert_alignment: Any, num_ranks: int, num_max_tokens_per_rank: int,
                  num_topk: int) -> tuple:
    """``(num_experts, expert_alignment)`` as ints that both backends handle: a positive multiple of the
    rank count within the native kernels' expert limits, and an alignment whose worst-case expanded
    layout fits the int32 per-expert offsets of the handle (the native kernels take it as an int: a
    larger one was truncated there, and wrapped in the torch backend's int32 prefix sums).

    Arguments:
        num_experts, expert_alignment: the dispatch's arguments.
        num_ranks, num_max_tokens_per_rank, num_topk: the call's (already checked) sizes.
    """
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
    worst = _sizing.worst_case_num_expanded_tokens(R, num_max_tokens_per_rank, num_topk, L, a)
    if worst > INT32_MAX:
        raise ValueError(f"expert_alignment: {a} with num_max_tokens_per_rank={num_max_tokens_per_rank}, num_topk="
                         f"{num_topk} and {R} rank(s) gives an expanded worst case of {worst} rows; it must be below "
                         "2**31 (the per-expert offsets are int32)")
    return E, a


def index_check_enabled() -> bool:
    """Expert ids outside ``[-1, E)`` raise unless ``EP_SKIP_INDEX_CHECK=1``: the native backend's
    CPU-synced dispatch is then refused on every rank (the notify kernel counts them, free), the torch
    backend checks with torch ops (one host sync). With the check off they are treated as masked."""
    return os.environ.get("EP_SKIP_INDEX_CHECK", "0") != "1"


def expert_ids_error(num_bad: int, example: int, num_experts: int) -> ValueError:
    """The error for ``num_bad`` entries of ``topk_idx`` outside ``[-1, num_experts)``."""
    return ValueError(f"topk_idx: expert ids must be in [-1, {num_experts}), got {num_bad} outside it "
                      f"(e.g. {example})")


def count_bad_expert_ids(topk_idx, num_experts: int) -> tuple:
    """``(count, an example)`` of the ids outside ``[-1, num_experts)``, with plain torch ops (one host
    sync), for the torch backend; ``(0, 0)`` when there are none."""
    if topk_idx.numel() == 0:
        return 0, 0
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    num_bad = int(bad.sum())
    return (num_bad, int(topk_idx[bad][0])) if num_bad else (0, 0)


# The cached handle's fields a cached dispatch needs, by the low-level dispatch's argument names.
CACHED_HANDLE_FIELDS = ("cached_num_expanded_tokens", "cached_num_recv_tokens_per_expert_list",
                        "cached_psum_num_recv_tokens_per_scaleup_rank", "cached_psum_num_recv_tokens_per_expert",
                        "cached_num_unaligned_recv_tokens_per_expert", "cached_dst_buffer_slot_idx",
                        "cached_recv_src_metadata")


def cached_handle_fields(args: Mapping[str, object]) -> Optional[dict]:
    """``check_dispatch_modes``' ``cached`` argument from a low-level dispatch's arguments (e.g. its
    ``locals()``): the handle's fields in cached mode, None otherwise."""
    if args.get("cached_num_recv_tokens") is None:
        return None
    return {name: args.get(name) for name in CACHED_HANDLE_FIELDS}


def check_dispatch_modes(do_expand: bool, do_zero_padding: bool, do_cpu_sync: bool,
                         cached: Optional[Mapping[str, object]]) -> None:
    """Raise ValueError for an inconsistent combination of dispatch modes.

    Arguments:
        do_expand, do_zero_padding, do_cpu_sync: the dispatch flags.
        cached: in cached mode, the handle's fields by argument name (``None`` values are missing);
            ``None`` when not in cached mode.
    """
    if do_zero_padding and not do_expand:
        raise ValueError("do_zero_padding: only valid with do_expand=True (it zeroes the alignment gaps of the expanded layout)")
    if cached is None:
        return
    missing = [name for name, value in cached.items() if value is None]
    if missing:
        raise ValueError(f"cached dispatch needs the whole handle; missing {', '.join(missing)}")
    if do_cpu_sync:
        raise ValueError("cached dispatch cannot do a CPU sync (do_cpu_sync must be False)")
