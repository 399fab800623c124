"""What the native runtime launches with: a plan per launch, the kernels' parameter block per plan, and the
overlapped modes' block policy.

A plan is a frozen ``NamedTuple`` of the scalars of one launch whose field names are exactly the
members of the kernels' parameter block (``csrc/kernels/launch.hpp``, bound by name in
``csrc/bindings/params.cpp``), so the block is made from the plan by name,
``_C.DispatchParams(**plan._asdict())``. Before each launch the runtime sets the call's tensor addresses
on the block (``block.set(x=..., ...)``, every pointer member by name) and passes it with the streams:
``_rt.dispatch(block, stream, wait_stream)``.

Blocks are made by a build function of the runtime, memoised by ``plan_cache`` on the arguments it is
given by name: the scalar fields of the call's typed arguments (``ScalarFields``: every int and bool
field of ``DispatchArgs``, read as one tuple, viewed by name inside the build) and the few settings
besides them. The build sees nothing else of the call, so a block is never reused for a call it does not
fit, and a new scalar argument reaches the cache key by being a field of ``DispatchArgs``. Per call this
costs one attribute read per scalar and one keyed lookup (plans built by keyword on every call would
cost microseconds: a Python call with 18 keyword arguments does).

What is not in a plan: the pointer members (``_C.*Params.pointer_fields``, per call), the epilogue's
receive strides (``recv_sf_token_stride`` / ``recv_sf_hidden_stride``, per call: they follow the
received count) and the dispatch's ``host_tag`` (the runtime's).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional, Tuple

from . import _C

__all__ = ["DispatchPlan", "EpiloguePlan", "CombinePlan", "ScalarFields", "plan_cache", "OverlapConfig",
           "overlap_push_blocks"]

_MAX_PLANS = 256  # parameter blocks kept per runtime and kind (the least recently used dropped first)


class DispatchPlan(NamedTuple):
    """A dispatch's notify + push (``_C.DispatchParams``), in its members' order."""

    sf_token_stride: int
    sf_hidden_stride: int
    num_tokens: int
    num_max_tokens_per_rank: int
    hidden_bytes: int
    num_sf_packs: int
    num_experts: int
    num_topk: int
    expert_alignment: int
    cached: bool
    num_sms: int                    # the push's share of the grid when overlapped
    notify_atomic_masks: int        # ELASTIC_EP_TEST_NOTIFY_ATOMICS
    refuse_bad_ids: bool            # CPU sync: bad expert ids refuse the dispatch on every rank
    overlap: bool
    concurrent_notify: bool         # the push beside notify (dispatch_pdl)
    zero_copy: bool
    zero_copy_x_offset: int
    test_drop_scaleout_signals: int  # ELASTIC_EP_TEST_DROP_SCALEOUT_SIGNALS
    test_corrupt: int                # ELASTIC_EP_TEST_CORRUPT


class EpiloguePlan(NamedTuple):
    """A dispatch's copy epilogue (``_C.EpilogueParams``), in its members' order."""

    sf_token_stride: int
    sf_hidden_stride: int
    num_max_tokens_per_rank: int
    hidden_bytes: int
    num_sf_packs: int
    num_experts: int
    num_topk: int
    expert_alignment: int
    do_expand: bool
    cached: bool
    do_zero_padding: bool
    num_sms: int                    # the epilogue's share of the grid when overlapped
    overlap: bool
    zero_copy: bool


class CombinePlan(NamedTuple):
    """A combine's push and reduce (``_C.CombineParams``), in its members' order."""

    num_combined_tokens: int
    num_max_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_topk: int
    use_expanded_layout: bool
    allow_multiple_reduction: bool
    num_sms: int
    overlap_push_blocks: int        # 0: push and reduce as two kernels
    test_corrupt: int               # ELASTIC_EP_TEST_CORRUPT=own_row (4), else 0


def plan_cache(build: Callable[..., Any]) -> Callable[..., Any]:
    """``build`` memoised on its arguments (at most ``_MAX_PLANS`` results, least recently used dropped
    first; ``cache_info()`` / ``cache_clear()`` as ``functools.lru_cache``). ``build`` must make its
    blocks from its arguments only: they are the cache key."""
    return functools.lru_cache(maxsize=_MAX_PLANS)(build)


class ScalarFields:
    """The int and bool fields of a typed-arguments dataclass (``DispatchArgs``), in its field order.

    ``read(args)`` is their values as one tuple (a plan cache key, one attribute read each: compiled from
    the field names as ``namedtuple`` compiles its constructor); ``view(values)`` gives them back by
    name to a plan build, which so cannot read a tensor, an event or anything else not in the key.

    Arguments:
        cls: the dataclass; a field annotated ``int`` or ``bool`` is a scalar.
    """

    __slots__ = ("names", "read", "_view")

    def __init__(self, cls: type) -> None:
        self.names: Tuple[str, ...] = tuple(
            f.name for f in dataclasses.fields(cls) if f.type in ("int", "bool", int, bool))
        self.read: Callable[[Any], tuple] = eval(  # noqa: S307 - names are the dataclass's own identifiers
            f"lambda a: ({''.join(f'a.{n}, ' for n in self.names)})")
        self._view = NamedTuple(f"{cls.__name__}Scalars", [(n, object) for n in self.names])

    def view(self, values: tuple) -> Any:
        """``values`` (a ``read`` result) by field name."""
        return self._view._make(values)


class OverlapConfig:
    """Whether an operation runs overlapped, and how many blocks push (see ``overlap_push_blocks``).

    ``enabled`` and ``push_blocks`` (None: 3/8 of the grid) start from ``ELASTIC_EP_{DISPATCH,COMBINE}_OVERLAP``
    and ``ELASTIC_EP_{DISPATCH,COMBINE}_PUSH_BLOCKS`` when the runtime is created, and may be changed
    afterwards (``runtime.dispatch_overlap.enabled = True``), e.g. to compare both ways in one process.
    """

    __slots__ = ("enabled", "push_blocks")

    def __init__(self, enabled: bool = False, push_blocks: Optional[int] = None) -> None:
        self.enabled = bool(enabled)
        self.push_blocks = push_blocks

    def __repr__(self) -> str:
        return f"OverlapConfig(enabled={self.enabled}, push_blocks={self.push_blocks})"


def overlap_push_blocks(cfg: OverlapConfig, num_ranks: int, num_sms: int, num_max_tokens_per_rank: int) -> int:
    """Push blocks of an overlapped dispatch or combine, or 0 for the sequential kernels.

    Overlapped dispatch: the copy epilogue runs beside the push, on the runtime's second stream and
    the rest of the grid, copying each chunk of 32 slots as its senders' counts arrive. Overlapped
    combine: one kernel, whose first blocks to start push rows back in token-chunk order while the
    others reduce each chunk as it lands. Off by default until measured faster on NVLink.
    """
    if not cfg.enabled or num_sms < 2 or not _C.overlap_fits(num_ranks, num_max_tokens_per_rank):
        return 0
    push = cfg.push_blocks if cfg.push_blocks is not None else num_sms * 3 // 8
    return min(max(push, 1), num_sms - 1)
