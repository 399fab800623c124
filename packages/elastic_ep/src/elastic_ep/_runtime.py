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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, NamedTuple, Optional, Tuple

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ._events import EventHandle
    from ._handle import EPHandle

__all__ = ["DispatchArgs", "CombineArgs", "DispatchResult", "AllGatherArgs", "Runtime"]


@dataclass(eq=False)
class DispatchArgs:
    """A validated dispatch (``_checks.dispatch_args``). Built positionally on the hot path: keep the
    field order."""

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


@dataclass(eq=False)
class CombineArgs:
    """A validated combine (``_checks.combine_args``); ``x`` and ``topk_weights`` are in the runtime's
    row order (a deterministic handle's permutation already undone). Built positionally."""

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


@dataclass(eq=False)
class AllGatherArgs:
    """A validated AGRS all-gather (``_checks_agrs_pp_engram.all_gather_args``): where each tensor's ``[R, ...]`` result
    lies in the session region. Rank ``r``'s part of tensor ``i`` is the ``tensors[i].nbytes`` bytes at
    ``offsets[i] + r * tensors[i].nbytes``."""

    tensors: List[torch.Tensor]                 # contiguous, on the buffer's device, any dtype
    offsets: List[int]                          # byte offsets in the session region, multiples of 32
    inplace: List[bool]                         # the tensor already is this rank's part of its result
    session_idx: int                            # >= 1, the session the gather belongs to
    slot_idx: int                               # the gather's index in its session


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

    # AGRS, PP and Engram: the torch runtime implements them; a runtime that does not keeps these.
    def _not_implemented(self, op: str) -> NotImplementedError:
        return NotImplementedError(f"elastic_ep.ElasticBuffer.{op}: the {self.backend} runtime does not implement it "
                                   "yet; create the buffer with backend='torch' to use it")

    def agrs_set_config(self, num_max_session_bytes: int) -> torch.Tensor:
        """Flushes outstanding work on every rank (collective) and returns this rank's AGRS session
        region, ``num_max_session_bytes`` uint8 (a multiple of 32), which all-gathers write into."""
        raise self._not_implemented("agrs_set_config")

    def all_gather(self, args: AllGatherArgs) -> Tuple[List[torch.Tensor], Callable[[], None]]:
        """Starts the all-gather; returns the ``[R, ...]`` results (views of the session region, final
        once the returned wait function ran) and that function."""
        raise self._not_implemented("all_gather")

    def agrs_end_session(self, session_idx: int) -> None:
        """Ends session ``session_idx``: its gathers are complete on this rank before the region is reused."""
        raise self._not_implemented("destroy_agrs_session")

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Flushes outstanding work on every rank (collective) and sizes PP send/recv."""
        raise self._not_implemented("pp_set_config")

    def pp_send(self, x: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """Sends ``x``'s bytes to ``dst_rank_idx`` (validated: another rank, within the configured size);
        ``x`` may be reused when this returns (in stream order)."""
        raise self._not_implemented("pp_send")

    def pp_recv(self, x: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """Receives the next tensor ``src_rank_idx`` sent to this rank into ``x``."""
        raise self._not_implemented("pp_recv")

    def engram_write(self, storage: torch.Tensor, sf: Optional[torch.Tensor]) -> None:
        """Installs this rank's shard ``[entries, hidden]`` of the Engram table (collective; every rank's
        shard has the same shape and dtype, else every rank raises ``ValueError``)."""
        raise self._not_implemented("engram_write")

    def engram_fetch(self, indices: torch.Tensor,
                     use_tma_aligned_col_major_sf: bool) -> Callable[[], Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Starts gathering the rows of global entries ``indices`` (validated ``int32 [T, E]`` in range);
        the hook returns ``(data [T, E * hidden], sf [T, E * packs] or None)``."""
        raise self._not_implemented("engram_fetch")
