"""What the native runtime launches with: a plan per launch, the kernels' parameter block per plan, and the
overlapped modes' block policy.

A plan is a frozen ``NamedTuple`` of the scalars of one launch whose field names are exactly the
members of the kernels' parameter block (``csrc/kernels/launch.hpp``, bound by name in
``csrc/bindings/params.cpp``), so the block is made from the plan by name,
``_C.DispatchParams(**plan._asdict())``, once per plan (``PlanCache``). Before each launch the runtime
sets the call's tensor addresses on the block (``block.set(x=..., ...)``, every pointer member by name)
and passes it with the streams: ``_rt.dispatch(block, stream, wait_stream)``.

Per call the runtime writes the plan's fields by name into a fresh record (``PlanCache.fields()``,
``__slots__`` of the plan's fields: a misspelt or missing field raises) and asks for its block
(``PlanCache.block``): the record is read in the plan's field order, so nothing depends on the order
the fields are written in. (Constructing the ``NamedTuple`` by keyword on every call would cost
microseconds: a Python call with 18 keyword arguments does.)

What is not in a plan: the pointer members (``_C.*Params.pointer_fields``, per call), the epilogue's
receive strides (``recv_sf_token_stride`` / ``recv_sf_hidden_stride``, per call: they follow the
received count) and the dispatch's ``host_tag`` (the runtime's).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Type

from . import _C

__all__ = ["DispatchPlan", "EpiloguePlan", "CombinePlan", "PlanCache", "OverlapConfig", "overlap_push_blocks"]

_MAX_PLANS = 256  # parameter blocks kept per runtime and kind (shapes seen; cleared when full)


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


class PlanCache:
    """The plans of one launch kind and the parameter block of each plan seen (at most ``_MAX_PLANS``,
    then cleared), made once from the plan's fields by name.

    Arguments:
        plan: the plan type (``DispatchPlan`` ...).
        make: the block's class (``_C.DispatchParams`` ...), called with the plan's fields as keywords.
    """

    __slots__ = ("plan", "fields", "_make", "_read", "_blocks")

    def __init__(self, plan: Type[NamedTuple], make: Callable[..., Any]) -> None:
        self.plan = plan
        #: A fresh record of the plan's fields, to set by name (every one of them).
        self.fields = type(f"{plan.__name__}Fields", (), {"__slots__": plan._fields})
        self._make = make
        # The record's fields as a tuple in the plan's order, compiled from the plan's own field names
        # (as namedtuple compiles its constructor): twice as fast as operator.attrgetter on every call.
        self._read = eval(f"lambda r: ({''.join(f'r.{f}, ' for f in plan._fields)})")  # noqa: S307
        self._blocks: Dict[tuple, Any] = {}

    def block(self, fields: Any) -> Any:
        """The block of the plan ``fields`` holds (the same object for equal plans until the cache is
        cleared). Raises AttributeError naming a field that was not set."""
        key = self._read(fields)
        block = self._blocks.get(key)
        if block is None:
            if len(self._blocks) >= _MAX_PLANS:
                self._blocks.clear()
            plan = self.plan._make(key)
            block = self._blocks[plan] = self._make(**plan._asdict())
        return block

    def plans(self) -> list:
        """The plans whose blocks are kept (tests, diagnostics)."""
        return list(self._blocks)


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
