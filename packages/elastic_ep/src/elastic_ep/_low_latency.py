"""Low-latency mode: DeepEP V1's ``low_latency_dispatch`` / ``low_latency_combine`` for decode (1 to a few
hundred tokens per rank): no CPU sync, fixed shapes, capturable in a CUDA graph, send and receive split by
a hook so that two micro-batches overlap.

Layout (DeepEP V1's, what masked grouped GEMMs such as DeepGEMM's ``m_grouped_*_masked`` consume):

* ``recv_x [L, R * M, hidden]`` (L local experts, R ranks, M = ``num_max_dispatch_tokens_per_rank``): the
  rows of local expert ``l`` are packed at the front, ``recv_count[l]`` of them, source rank 0's tokens
  first, then rank 1's, ..., each rank's in token order (DeepEP V1 packs in arrival order; this order is
  deterministic, so outputs are bitwise reproducible). FP8: E4M3 rows and f32 scales per 128 channels,
  the scales in column-major storage ``[L, hidden / 128, R * M]`` viewed as ``[L, R * M, hidden / 128]``
  (UE8M0: the exponent bytes packed 4 per int32, ``[L, R * M, hidden / 512]``).
* ``handle = (src_info [L, R * M] int32, layout_range [L, R] int64, M, hidden, num_experts)``:
  ``src_info`` the row's token index at its source, ``layout_range[l, s] = (first row << 32) | rows`` from
  source ``s``. The handle also carries (attributes, not tuple items) the route of each row back to its
  source lane, the counts, the dispatch's top-k and ``self_pos`` (the row of each of this rank's lanes
  whose expert is its own), which the combine needs.
* A call without receive hook (its ``x`` cannot change between the phases) keeps this rank's own rows out
  of the window: the dispatch's receive casts them from ``x`` into ``recv_x``, the combine's reads them
  from ``x`` at ``self_pos``. With a hook they go through the window like every other row.
* The combine sums, per token, ``topk_weights[t, k] * row(t, k)`` over the lanes in order, in fp32
  (separate multiply and add), rounded to BF16 once; lanes with id ``-1`` add nothing.

Backends (``LowLatencyPart``): ``NativeLowLatency`` (kernels/ll_dispatch.cuh, ll_combine.cuh: messages go
straight into the peers' windows, signals carry per-call sequence numbers kept on the device) and
``TorchLowLatency`` (``_low_latency_torch``: ``all_to_all_single`` collectives, the reference).
"""
from __future__ import annotations

import abc
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

from . import _C
from ._checks import FP8, check_tensor, describe, int_arg
from ._collective import on_every_rank
from ._events import EventHandle, EventOverlap

__all__ = ["LowLatency", "LowLatencyHandle", "LowLatencyPart", "NativeLowLatency", "low_latency_size_hint"]

_KW_ONLY = {"kw_only": True, "slots": True} if sys.version_info >= (3, 10) else {}
MAX_TOPK = int(_C.LL_MAX_TOPK)
MAX_TOKENS = int(_C.LL_MAX_TOKENS)
HIDDEN_ALIGN = int(_C.LL_HIDDEN_ALIGN)
MAX_LOCAL_EXPERTS = int(_C.LL_MAX_LOCAL_EXPERTS)
_TOPK_DTYPES = (torch.int64, torch.int32)
_FUSED_COMBINE_MAX_ROWS = 1024  # (token, lane) pairs up to which a combine without hook is one kernel


def low_latency_size_hint(num_max_dispatch_tokens_per_rank: Any, hidden: Any, num_ranks: Any,
                          num_experts: Any) -> int:
    """Bytes low-latency mode needs (DeepEP V1's ``get_low_latency_rdma_size_hint``): two halves, each
    for a call of any top-k up to 32, 2 MiB-aligned.

    Raises:
        ValueError: a negative size, or ``num_experts`` not a multiple of ``num_ranks``.
    """
    m = int_arg("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1, MAX_TOKENS)
    h = int_arg("hidden", hidden, 1)
    r = int_arg("num_ranks", num_ranks, 1)
    e = int_arg("num_experts", num_experts, 1)
    if e % r:
        raise ValueError(f"num_experts: {e} is not a multiple of num_ranks={r}")
    return int(_C.ll_size_hint(m, h, e))


class LowLatencyHandle(tuple):
    """DeepEP V1's low-latency handle, ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
    num_experts)``, which also carries what the combine needs: ``route`` ([L, R * M] int32, (source rank
    << 8) | top-k lane), ``recv_count``, ``self_pos`` ([M, K] int32: the ``recv_x`` row of each lane of
    this rank's whose expert is its own, -1 for the others; native runtime only, the torch runtime's
    combine does not read it and leaves it -1), ``num_topk`` and the ``owner`` buffer."""

    route: torch.Tensor
    recv_count: torch.Tensor
    self_pos: torch.Tensor
    num_topk: int
    owner: Any

    def __new__(cls, items: Tuple[Any, ...], route: torch.Tensor, recv_count: torch.Tensor, self_pos: torch.Tensor,
                num_topk: int, owner: Any) -> "LowLatencyHandle":
        h = super().__new__(cls, items)
        h.route, h.recv_count, h.self_pos, h.num_topk, h.owner = route, recv_count, self_pos, num_topk, owner
        return h


@dataclass(eq=False, **_KW_ONLY)
class LlDispatchArgs:
    """A validated low-latency dispatch."""

    x: torch.Tensor                     # [T, H] bf16, contiguous
    topk_idx: torch.Tensor              # [T, K] int64
    cumulative_stats: Optional[torch.Tensor]  # [L] int32
    wait_stats: Optional[torch.Tensor]  # [R] int64
    num_tokens: int
    hidden: int
    num_topk: int
    num_experts: int
    num_max_tokens: int
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    half: int                           # buffer_idx
    in_place: bool                      # no receive hook: the native receive may read this rank's rows from x


@dataclass(eq=False, **_KW_ONLY)
class LlDispatchOut:
    """A low-latency dispatch's outputs (allocated by the front, filled by the part)."""

    recv_x: torch.Tensor                # [L, R * M, H] fp8 or bf16
    recv_scales: Optional[torch.Tensor]  # [L, G, R * M] f32 (G = H / 128) or int32 (G = H / 512), or None
    recv_count: torch.Tensor            # [L] int32
    src_info: torch.Tensor              # [L, R * M] int32
    layout_range: torch.Tensor          # [L, R] int64
    route: torch.Tensor                 # [L, R * M] int32
    self_pos: torch.Tensor              # [M, K] int32 (native only: the recv_x row of each own lane, else -1)


@dataclass(eq=False, **_KW_ONLY)
class LlCombineArgs:
    """A validated low-latency combine."""

    x: torch.Tensor                     # [L, R * M, H] bf16 (the zero-copy buffer with zero_copy)
    topk_idx: torch.Tensor              # [T, K] int64
    topk_weights: torch.Tensor          # [T, K] float32
    handle: LowLatencyHandle
    out: torch.Tensor                   # [T, H] bf16
    wait_stats: Optional[torch.Tensor]  # [R] int64
    num_tokens: int
    hidden: int
    num_topk: int
    num_experts: int
    num_max_tokens: int
    half: int
    in_place: bool                      # no receive hook: the native receive may read this rank's rows from x


class LowLatencyPart(abc.ABC):
    """What a backend does for low-latency mode, on validated arguments. ``phases``: 1 send, 2 receive,
    3 both (the hook's split)."""

    @abc.abstractmethod
    def dispatch(self, a: LlDispatchArgs, o: LlDispatchOut, phases: int) -> None:
        """Runs the phases of a dispatch on the current stream; the receive phase fills ``o``."""

    @abc.abstractmethod
    def combine(self, a: LlCombineArgs, phases: int) -> None:
        """Runs the phases of a combine on the current stream; the receive phase fills ``a.out``."""

    @abc.abstractmethod
    def clean(self) -> None:
        """Resets this rank's low-latency counters (the front brackets it with barriers)."""

    @abc.abstractmethod
    def zero_copy_source(self, half: int, shape: Tuple[int, int, int]) -> torch.Tensor:
        """The bf16 tensor of ``shape`` a zero-copy combine on ``half`` reads."""

    @abc.abstractmethod
    def set_mask(self, rank: int, masked: bool) -> None:
        """Shrink mode: (un)masks ``rank`` on this rank."""

    @abc.abstractmethod
    def mask_status(self) -> torch.Tensor:
        """Shrink mode: int32 [R], 1 for each masked rank."""

    @abc.abstractmethod
    def clean_mask(self) -> None:
        """Shrink mode: unmasks every rank."""


class NativeLowLatency(LowLatencyPart):
    """Low-latency mode on the native runtime ``rt`` (one kernel per call, or one per phase with a hook).

    Arguments:
        rt: the ``NativeRuntime``.
        ll_offset, ll_bytes: the low-latency area in the buffer (two halves of ``ll_bytes / 2``).
        shrink: DeepEP V1's ``enable_shrink``.
    """

    def __init__(self, rt: Any, ll_offset: int, ll_bytes: int, shrink: bool) -> None:
        self.rt, self.ll_offset, self.half_bytes, self.shrink = rt, ll_offset, ll_bytes // 2, shrink
        self._dispatch_block = _C.LlDispatchParams()
        self._combine_block = _C.LlCombineParams()

    def _num_sms(self, work: int) -> int:
        return max(1, min(self.rt.num_device_sms, work))

    def _half_offset(self, half: int) -> int:
        return self.ll_offset + half * self.half_bytes

    def dispatch(self, a: LlDispatchArgs, o: LlDispatchOut, phases: int) -> None:
        rt = self.rt
        rt._alive("low_latency_dispatch")
        b = self._dispatch_block
        ue8m0 = a.use_ue8m0
        # One block per token to send, and enough warps to copy what arrives (every rank sends at most
        # T * K rows): DeepEP V1 runs one block per ~3 experts; small grids keep decode latency low.
        work = max(a.num_tokens, -(-a.num_tokens * a.num_topk * rt.num_ranks // 32), 1)
        b.set(x=a.x, topk_idx=a.topk_idx, recv_x=o.recv_x,
              recv_scales=o.recv_scales if a.use_fp8 and not ue8m0 else 0,
              recv_scales_ue8m0=o.recv_scales if ue8m0 else 0, recv_count=o.recv_count, recv_src_info=o.src_info,
              recv_route=o.route, recv_layout_range=o.layout_range, recv_self_pos=o.self_pos,
              cumulative_stats=a.cumulative_stats,
              wait_stats=a.wait_stats, half_offset=self._half_offset(a.half), num_tokens=a.num_tokens,
              num_max_tokens=a.num_max_tokens, hidden=a.hidden, num_experts=a.num_experts, num_topk=a.num_topk,
              use_fp8=int(a.use_fp8), round_scale=int(a.round_scale), use_ue8m0=int(ue8m0), half=a.half,
              phases=phases, shrink=int(self.shrink), num_sms=self._num_sms(work), own_in_place=int(a.in_place))
        rt._rt.ll_dispatch(b, torch.cuda.current_stream(rt.device).cuda_stream)

    def combine(self, a: LlCombineArgs, phases: int) -> None:
        rt = self.rt
        rt._alive("low_latency_combine")
        if phases == 3 and a.num_tokens * a.num_topk > _FUSED_COMBINE_MAX_ROWS:
            # Many rows: the send and the receive as two kernels. In one, the blocks without rows to send
            # poll while the others copy (H100, 256 tokens x top-8: 81 us in one kernel, 29 + 19 in two).
            self.combine(a, 1)
            self.combine(a, 2)
            return
        b = self._combine_block
        h = a.handle
        work = max(a.num_tokens, -(-a.num_tokens * a.num_topk * rt.num_ranks // 32), 1)
        b.set(x=a.x, topk_idx=a.topk_idx, topk_weights=a.topk_weights, recv_count=h.recv_count, src_info=h[0],
              route=h.route, self_pos=h.self_pos if a.in_place else 0, combined_x=a.out, wait_stats=a.wait_stats,
              half_offset=self._half_offset(a.half),
              num_tokens=a.num_tokens, num_max_tokens=a.num_max_tokens, hidden=a.hidden, num_experts=a.num_experts,
              num_topk=a.num_topk, half=a.half, phases=phases, shrink=int(self.shrink), num_sms=self._num_sms(work))
        rt._rt.ll_combine(b, torch.cuda.current_stream(rt.device).cuda_stream)

    def clean(self) -> None:
        rt = self.rt
        rt._alive("clean_low_latency_buffer")
        rt._rt.ll_clean(torch.cuda.current_stream(rt.device).cuda_stream)
        torch.cuda.synchronize(rt.device)

    def zero_copy_source(self, half: int, shape: Tuple[int, int, int]) -> torch.Tensor:
        n = shape[0] * shape[1] * shape[2] * 2
        off = self._half_offset(half)
        return self.rt._buffer_bytes()[off:off + n].view(torch.bfloat16).view(shape)

    def set_mask(self, rank: int, masked: bool) -> None:
        self.rt._rt.ll_set_mask(rank, masked, torch.cuda.current_stream(self.rt.device).cuda_stream)

    def mask_status(self) -> torch.Tensor:
        torch.cuda.synchronize(self.rt.device)
        n = self.rt.num_ranks
        words = torch.as_tensor(_MaskWords(int(self.rt._rt.ll_mask_address), n),
                                device=torch.device("cuda", self.rt.device))
        return words.clone()

    def clean_mask(self) -> None:
        self.rt._rt.ll_clean_mask(torch.cuda.current_stream(self.rt.device).cuda_stream)
        torch.cuda.synchronize(self.rt.device)


class _MaskWords:
    """The shrink mask's device words as an int32 array (``__cuda_array_interface__``, not owned)."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<i4", "data": (ptr, False), "version": 3}


# ---------------------------------------------------------------------------------------------- front
class LowLatency:
    """One buffer's low-latency mode: the checks of every call, the half each call uses, the streams,
    events and hooks (DeepEP V1's semantics), and one call into the backend's part.

    Arguments:
        part: the backend's ``LowLatencyPart``.
        group: the buffer's process group; ``device``: its device (``cpu`` for the torch backend on gloo).
        ll_bytes: the bytes of the low-latency area (its two halves must each hold a call).
        comm_stream: the stream calls without a hook run on (None: the current stream).
    """

    def __init__(self, part: LowLatencyPart, group: dist.ProcessGroup, device: torch.device, ll_bytes: int,
                 comm_stream: Optional["torch.cuda.Stream"]) -> None:
        self.part, self.group, self.device, self.ll_bytes = part, group, device, ll_bytes
        self.num_ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.comm_stream = comm_stream
        self.buffer_idx = 0  # the half the next call uses; flipped by every call, as DeepEP V1's

    # ------------------------------------------------------------------ checks
    def _shape(self, op: str, num_max_tokens: Any, hidden: int, num_experts: Any,
               num_topk: int) -> Tuple[int, int, int]:
        M = int_arg("num_max_dispatch_tokens_per_rank", num_max_tokens, 1, MAX_TOKENS)
        E = int_arg("num_experts", num_experts, 1, int(_C.MAX_EXPERTS))
        R = self.num_ranks
        if E % R or E // R > MAX_LOCAL_EXPERTS:
            raise ValueError(f"num_experts: {E} must be a multiple of the {R} ranks with at most "
                             f"{MAX_LOCAL_EXPERTS} per rank")
        if hidden % HIDDEN_ALIGN or hidden // HIDDEN_ALIGN > 0xFFFF:
            raise ValueError(f"x: hidden={hidden} must be a multiple of {HIDDEN_ALIGN} (the FP8 scale group), at "
                             f"most {0xFFFF * HIDDEN_ALIGN}")
        need = int(_C.ll_half_bytes(M, hidden, E, num_topk))
        if 2 * need > self.ll_bytes:
            raise ValueError(f"{op}: a call of num_max_dispatch_tokens_per_rank={M}, hidden={hidden}, num_experts={E}, "
                             f"top-{num_topk} needs 2 x {need} bytes of low-latency buffer, the buffer has "
                             f"{self.ll_bytes} (size it with get_low_latency_rdma_size_hint({M}, {hidden}, "
                             f"{R}, {E}))")
        return M, E, E // R

    def _topk(self, name: str, t: Any, num_tokens: Optional[int]) -> Tuple[torch.Tensor, int]:
        check_tensor(name, t, _TOPK_DTYPES, 2, self.device, (num_tokens, None))
        K = t.shape[1]
        if not 1 <= K <= MAX_TOPK:
            raise ValueError(f"{name}: top-k {K} outside [1, {MAX_TOPK}]")
        return (t if t.dtype == torch.int64 else t.to(torch.int64)), K

    def _stats(self, name: str, t: Any, n: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
        if t is not None:
            check_tensor(name, t, (dtype,), 1, self.device, (n,))
        return t

    @staticmethod
    def _modes(async_finish: Any, return_recv_hook: Any) -> Tuple[bool, bool]:
        async_finish, hook = bool(async_finish), bool(return_recv_hook)
        if async_finish and hook:
            raise ValueError("async_finish and return_recv_hook: at most one may be set (as DeepEP V1): with the hook "
                             "the kernels run on the current stream and the hook is the receive")
        return async_finish, hook

    # ------------------------------------------------------------------ calls
    def _run(self, launch: Callable[[int], None], async_finish: bool, hook: bool,
             keep: Tuple[Any, ...]) -> Tuple[EventOverlap, Callable[[], None]]:
        """Launches the send phase (with ``hook``: the receive phase is the returned hook, on the stream
        current when it is called), or both phases on the communication stream with DeepEP V1's
        ``async_finish`` semantics; flips the half."""
        if hook:
            launch(1)
            self.buffer_idx ^= 1
            called = []

            def recv_hook() -> None:
                if called:
                    raise RuntimeError("this low-latency receive hook was already called")
                called.append(True)
                launch(2)
            return EventOverlap(None), recv_hook
        stream = self.comm_stream
        if stream is None:
            launch(3)
            self.buffer_idx ^= 1
            return EventOverlap(EventHandle() if self.device.type == "cuda" else None), _no_hook
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            launch(3)
        self.buffer_idx ^= 1
        if async_finish:
            for t in keep:
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    t.record_stream(stream)
            return EventOverlap(EventHandle(stream), keep), _no_hook
        compute.wait_stream(stream)
        return EventOverlap(None), _no_hook

    def dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: Any, num_experts: Any,
                 cumulative_local_expert_recv_stats: Any, dispatch_wait_recv_cost_stats: Any, use_fp8: Any,
                 round_scale: Any, use_ue8m0: Any, async_finish: Any, return_recv_hook: Any) -> Tuple[Any, ...]:
        """DeepEP V1's ``low_latency_dispatch`` (see ``Buffer.low_latency_dispatch``)."""
        check_tensor("x", x, (torch.bfloat16,), 2, self.device)
        T, H = x.shape
        use_fp8, round_scale, use_ue8m0 = bool(use_fp8), bool(round_scale), bool(use_ue8m0)
        if round_scale and not use_fp8:
            raise ValueError("round_scale: rounds FP8 scales; it needs use_fp8=True")
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0: UE8M0 scales are powers of two; it needs round_scale=True (as DeepEP V1)")
        if use_ue8m0 and H % 512:
            raise ValueError(f"use_ue8m0: packs 4 scales per int32, so hidden must be a multiple of 512, got {H}")
        idx, K = self._topk("topk_idx", topk_idx, T)
        M, E, L = self._shape("low_latency_dispatch", num_max_dispatch_tokens_per_rank, H, num_experts, K)
        if T > M:
            raise ValueError(f"x: {T} tokens exceed num_max_dispatch_tokens_per_rank={M}")
        R = self.num_ranks
        stats = self._stats("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, L, torch.int32)
        wait = self._stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, R, torch.int64)
        async_finish, hook = self._modes(async_finish, return_recv_hook)
        a = LlDispatchArgs(x=x, topk_idx=idx, cumulative_stats=stats, wait_stats=wait, num_tokens=T, hidden=H,
                           num_topk=K, num_experts=E, num_max_tokens=M, use_fp8=use_fp8, round_scale=round_scale,
                           use_ue8m0=use_ue8m0, half=self.buffer_idx, in_place=not hook)
        dev = self.device
        RM = R * M
        scales = None
        if use_fp8:
            groups, dtype = (H // 512, torch.int32) if use_ue8m0 else (H // 128, torch.float32)
            scales = torch.empty((L, groups, RM), dtype=dtype, device=dev)
        o = LlDispatchOut(recv_x=torch.empty((L, RM, H), dtype=FP8 if use_fp8 else torch.bfloat16, device=dev),
                          recv_scales=scales, recv_count=torch.empty((L,), dtype=torch.int32, device=dev),
                          src_info=torch.empty((L, RM), dtype=torch.int32, device=dev),
                          layout_range=torch.empty((L, R), dtype=torch.int64, device=dev),
                          route=torch.empty((L, RM), dtype=torch.int32, device=dev),
                          self_pos=torch.empty((M, K), dtype=torch.int32, device=dev))
        keep = (x, idx, o.recv_x, scales, o.recv_count, o.src_info, o.layout_range, o.route, o.self_pos, stats, wait)
        event, recv_hook = self._run(lambda phases: self.part.dispatch(a, o, phases), async_finish, hook, keep)
        handle = LowLatencyHandle((o.src_info, o.layout_range, M, H, E), route=o.route, recv_count=o.recv_count,
                                  self_pos=o.self_pos, num_topk=K, owner=self)
        recv_x = (o.recv_x, scales.transpose(1, 2)) if use_fp8 else o.recv_x
        return recv_x, o.recv_count, handle, event, recv_hook

    def _handle(self, handle: Any) -> LowLatencyHandle:
        if not isinstance(handle, LowLatencyHandle) or handle.owner is not self:
            raise ValueError(f"handle: expected the handle a low_latency_dispatch of this buffer returned, got "
                             f"{describe(handle) if not isinstance(handle, tuple) else type(handle).__name__}")
        return handle

    def next_combine_buffer(self, handle: Any) -> torch.Tensor:
        """The ``[L, R * M, hidden]`` bf16 tensor the next zero-copy combine reads (DeepEP V1's
        ``get_next_low_latency_combine_buffer``)."""
        h = self._handle(handle)
        _, _, M, H, E = h
        return self.part.zero_copy_source(self.buffer_idx, (E // self.num_ranks, self.num_ranks * M, H))

    def combine(self, x: Any, topk_idx: Any, topk_weights: Any, handle: Any, use_logfmt: Any, zero_copy: Any,
                async_finish: Any, return_recv_hook: Any, out: Any,
                combine_wait_recv_cost_stats: Any) -> Tuple[Any, ...]:
        """DeepEP V1's ``low_latency_combine`` (see ``Buffer.low_latency_combine``)."""
        h = self._handle(handle)
        if use_logfmt:
            raise NotImplementedError("use_logfmt=True: DeepEP V1's LogFMT combine format is not available; combine "
                                      "in BF16 (use_logfmt=False)")
        _, _, M, H, E = h
        R = self.num_ranks
        L = E // R
        check_tensor("x", x, (torch.bfloat16,), 3, self.device, (L, R * M, H))
        idx, K = self._topk("topk_idx", topk_idx, None)
        T = idx.shape[0]
        if K != h.num_topk:
            raise ValueError(f"topk_idx: top-k {K}, but the dispatch of this handle had top-k {h.num_topk}")
        if T > M:
            raise ValueError(f"topk_idx: {T} tokens exceed the handle's num_max_dispatch_tokens_per_rank={M}")
        check_tensor("topk_weights", topk_weights, (torch.float32,), 2, self.device, (T, K))
        self._shape("low_latency_combine", M, H, E, K)
        if out is None:
            out = torch.empty((T, H), dtype=torch.bfloat16, device=self.device)
        else:
            check_tensor("out", out, (torch.bfloat16,), 2, self.device, (T, H))
        wait = self._stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, R, torch.int64)
        async_finish, hook = self._modes(async_finish, return_recv_hook)
        src = self.part.zero_copy_source(self.buffer_idx, (L, R * M, H)) if zero_copy else x
        a = LlCombineArgs(x=src, topk_idx=idx, topk_weights=topk_weights, handle=h, out=out, wait_stats=wait,
                          num_tokens=T, hidden=H, num_topk=K, num_experts=E, num_max_tokens=M, half=self.buffer_idx,
                          in_place=not hook)
        keep = (x, idx, topk_weights, h[0], h[1], h.route, h.recv_count, h.self_pos, out, wait)
        event, recv_hook = self._run(lambda phases: self.part.combine(a, phases), async_finish, hook, keep)
        return out, event, recv_hook

    def clean(self, num_max_dispatch_tokens_per_rank: Any, hidden: Any, num_experts: Any) -> None:
        """DeepEP V1's ``clean_low_latency_buffer`` (collective): every rank's counters back to zero
        between two barriers, so the next call starts in step, e.g. after a timeout."""
        h = int_arg("hidden", hidden, 1)
        self._shape("clean_low_latency_buffer", num_max_dispatch_tokens_per_rank, h, num_experts, 1)
        on_every_rank(self.group, "clean_low_latency_buffer", lambda: None)
        self.part.clean()
        on_every_rank(self.group, "clean_low_latency_buffer", lambda: None)
        self.buffer_idx = 0

    def update_mask(self, rank_to_mask: Any, mask: Any) -> None:
        r = int_arg("rank_to_mask", rank_to_mask, 0, self.num_ranks - 1, f" (the group has {self.num_ranks} ranks)")
        self.part.set_mask(r, bool(mask))

    def query_mask(self, mask_status: Any) -> None:
        check_tensor("mask_status", mask_status, (torch.int32,), 1, self.device, (self.num_ranks,))
        mask_status.copy_(self.part.mask_status())

    def clean_mask(self) -> None:
        self.part.clean_mask()


def _no_hook() -> None:
    """The hook of a call made without ``return_recv_hook`` (DeepEP V1 returns a no-op there too)."""
