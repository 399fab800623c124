"""The one interface between ``ElasticBuffer`` and a backend, with its typed arguments.

``ElasticBuffer`` (buffer.py) validates a call once (``_checks``) into a ``DispatchArgs`` /
``CombineArgs`` and hands it to its ``Runtime``; the runtimes trust that input. Two implement it:

* ``NativeRuntime`` (``_native_runtime.py``): the C++/CUDA kernels over an NCCL symmetric window or a
  CUDA-IPC window;
* ``TorchRuntime`` (``_torch_runtime.py``): ``torch.distributed`` collectives on any process group, the
  reference the native kernels are tested against.

A dispatch returns a ``DispatchResult`` whose ``handle`` is the ``EPHandle`` (a cached dispatch gets the
handle it was given); a cached dispatch and a combine take that one object back (``args.handle``).
"""
from __future__ import annotations

import abc
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Optional, Tuple

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ._events import EventHandle
    from ._handle import EPHandle

__all__ = ["DispatchArgs", "CombineArgs", "DispatchResult", "Runtime"]

# The typed arguments are built by keyword (``_checks``); keyword-only where dataclasses allow it.
_KW_ONLY = {"kw_only": True, "slots": True} if sys.version_info >= (3, 10) else {}


@dataclass(eq=False, **_KW_ONLY)
class DispatchArgs:
    """A validated dispatch (``_checks.dispatch_args``), built by keyword."""

    x: torch.Tensor                             # [T, H] bf16 or float8_e4m3fn, contiguous
    sf: Optional[torch.Tensor]                  # [T, P] float32 / int32 scales of FP8 x (any strides), else None
    topk_idx: torch.Tensor                      # [T, K] int64 or int32 global expert ids (cached: the handle's)
    topk_weights: Optional[torch.Tensor]        # [T, K] float32
    cumulative_local_expert_recv_stats: Optional[torch.Tensor]  # [L] int32; None in cached mode
    handle: Optional["EPHandle"]                # cached mode: the routing of an earlier dispatch
    num_tokens: int                             # T
    hidden: int                                 # H
    num_topk: int                               # K, in [1, 32]
    num_experts: int                            # E, a multiple of the rank count
    num_max_tokens_per_rank: int                # >= T; the buffer holds it
    expert_alignment: int                       # >= 1; the expanded worst case fits int32
    num_sms: int                                # > 0, resolved (never 0)
    num_qps: int                                # accepted, no effect (no RDMA)
    previous_event: Optional["EventHandle"]
    previous_event_before_epilogue: Optional["EventHandle"]
    async_with_compute_stream: bool
    allocate_on_comm_stream: bool               # True whenever previous_event is given
    do_handle_copy: bool
    do_cpu_sync: bool                           # False in cached mode and during a graph capture
    do_expand: bool
    do_zero_padding: bool                       # only with do_expand
    use_tma_aligned_col_major_sf: bool
    zero_copy: bool = False                     # recv_x as a view of the receive buffer (non-expanded)
    zero_copy_x_offset: int = -1                # its offset in the buffer (zero_copy_layout), else -1


@dataclass(eq=False, **_KW_ONLY)
class CombineArgs:
    """A validated combine (``_checks.combine_args``), built by keyword; ``x`` and ``topk_weights`` are
    in the runtime's row order (a deterministic handle's permutation already undone)."""

    x: torch.Tensor                             # [N, H] bf16 ([N_exp, H] when handle.do_expand)
    handle: "EPHandle"
    topk_weights: Optional[torch.Tensor]        # [N, K] ([N_exp]) float32
    bias_0: Optional[torch.Tensor]              # [T, H] bf16
    bias_1: Optional[torch.Tensor]
    num_sms: int                                # > 0, resolved
    num_qps: int
    previous_event: Optional["EventHandle"]
    previous_event_before_epilogue: Optional["EventHandle"]
    async_with_compute_stream: bool
    allocate_on_comm_stream: bool


class DispatchResult(NamedTuple):
    """What a runtime's dispatch returns."""

    recv_x: torch.Tensor
    recv_sf: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]       # None in expand mode
    recv_topk_weights: Optional[torch.Tensor]
    handle: "EPHandle"                          # a new handle, or the cached one
    event: Optional["EventHandle"]              # with async_with_compute_stream (None where nothing records)


class Runtime(abc.ABC):
    """A backend of ``ElasticBuffer``: the operations, on validated arguments."""

    #: "native" or "torch".
    backend: str = ""
    rank_idx: int
    num_ranks: int

    @abc.abstractmethod
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        """Sends each token to the ranks owning its experts (cached mode: ``args.handle``'s routing)."""

    @abc.abstractmethod
    def combine(self, args: CombineArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional["EventHandle"]]:
        """Returns ``(combined_x [T, H] bf16, combined_topk_weights [T, K] or None, event or None)``."""

    @abc.abstractmethod
    def barrier(self, use_comm_stream: bool, with_cpu_sync: bool, sequential: bool = True) -> None:
        """A barrier of every rank."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Releases the runtime (collective)."""

    @abc.abstractmethod
    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The stream the operations run on (None where there is none: a CPU group)."""
