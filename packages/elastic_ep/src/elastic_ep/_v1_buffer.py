"""``Buffer``: DeepEP V1's ``deep_ep.Buffer`` (normal mode inside one NVLink domain) over ``ElasticBuffer``.

Frameworks written for DeepEP V1 (SGLang's DeepEP dispatcher, vLLM's ``deepep_high_throughput`` backend,
Megatron's flex dispatcher) port with ``import elastic_ep as deep_ep``::

    buf = deep_ep.Buffer(group, num_nvl_bytes)
    n_rank, n_rdma, n_expert, in_rank, ev = buf.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, per_expert, handle, ev = buf.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)
    combined_x, _, ev = buf.combine(experts(recv_x, recv_idx), handle)

Each call is one ``ElasticBuffer`` dispatch or combine (no kernels of its own) plus torch ops for what DeepEP
V1 returns beside them (``_v1_routing``). Same arguments, defaults and return tuples as DeepEP V1 (commit
567632dd); received rows grouped by source rank in rank order, by token inside a rank; ``recv_topk_idx``
with local expert ids and -1 elsewhere (weight 0 there). DeepEP V1's buffer streams any number of tokens
through fixed queues; this one holds a whole call: ``num_nvl_bytes`` bounds the tokens per rank of a call
(``get_max_tokens_per_rank``), and a call over it raises ``ValueError`` with the bytes it needs.
Low-latency mode (``low_latency_mode=True``, ``num_rdma_bytes`` from ``get_low_latency_rdma_size_hint``) and
shrink mode are ``_v1_low_latency`` / ``_low_latency``; their bytes follow normal mode's in the same window.
Not available (raises saying so): normal mode across NVLink domains (RDMA).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _C, _checks, _collective
from ._checks import check_tensor, int_arg, refuse_during_capture
from ._domains import get_physical_domain_size
from ._events import EventHandle, EventOverlap
from ._sizing import ALIGNMENT_BYTES, align, calculate_elastic_buffer_size
from ._v1_config import COMBINE_CONFIGS, DISPATCH_CONFIGS, Config, recommended_config
from ._v1_routing import (Deferred, DispatchHandle, aligned_counts, decode_weights, dispatch_layout, encode_weights,
                          fit_rows, global_expert_counts, marker_lanes_fit, mask_rows_past, max_tokens_fit, output,
                          rank_prefix_matrix, rank_routing, ranked_routing)
from ._low_latency import LowLatency, NativeLowLatency
from ._low_latency_torch import TorchLowLatency
from ._v1_low_latency import LowLatencyAPI
from .buffer import ElasticBuffer

__all__ = ["Buffer"]

_X_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
_TOPK_DTYPES = (torch.int64, torch.int32)
_INTERNODE = ("DeepEP V1's normal mode across NVLink domains (RDMA, num_rdma_bytes > 0) is not available yet in "
              "elastic_ep; keep the group inside one NVLink domain with num_rdma_bytes=0, or use ElasticBuffer "
              "(its hybrid mode spans domains)")

Event = Union[None, EventOverlap, EventHandle]


def _not_available(name: str, why: str) -> Callable[..., Any]:
    """A method of DeepEP V1 that this package does not offer yet: it raises ``NotImplementedError`` saying
    what is missing and what to use instead."""
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name}: {why}")

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"DeepEP V1's ``{name}``: not available yet (raises ``NotImplementedError``)."
    return method


class Buffer(LowLatencyAPI):
    """DeepEP V1's expert-parallel buffer (normal and low-latency mode), on this package's ``ElasticBuffer``.

    Arguments:
        group: the expert-parallel process group, inside one NVLink domain (NCCL; gloo for the torch
            backend on the CPU, or with ``window="ipc"``).
        num_nvl_bytes: buffer bytes (rounded up to 2 MiB): they bound the tokens per rank of one call
            (``get_max_tokens_per_rank``); DeepEP V1's ``Config.get_nvl_buffer_size_hint`` gives a few
            thousand tokens of a DeepSeek-V3 row on 8 ranks.
        num_rdma_bytes: low-latency mode's bytes (``get_low_latency_rdma_size_hint``); 0 without it (RDMA
            across nodes is not available).
        low_latency_mode: enables ``low_latency_dispatch`` / ``low_latency_combine`` (``num_rdma_bytes`` > 0;
            ``num_nvl_bytes`` may then be 0 if normal mode is not used).
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl: DeepEP V1's RDMA and low-latency
            settings: accepted, no effect inside one NVLink domain.
        explicitly_destroy: as DeepEP V1; ``destroy()`` is allowed either way.
        enable_shrink: DeepEP V1's shrink mode (low-latency mode only): a mask of ranks that low-latency
            calls skip; a rank that misses the deadline is masked instead of failing the call.
        comm: DeepEP V1's mpi4py alternative to ``group``: not supported (pass a ProcessGroup).
        backend, window, num_gpu_timeout_secs: keyword only, not in DeepEP V1: ``ElasticBuffer``'s backend,
            window and device deadline (shrink mode masks a rank that misses it).

    Attributes:
        num_sms: (class) SMs of the default configs, DeepEP V1's 20; ``set_num_sms`` changes it.
        rank, group_size, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy,
        enable_shrink: as DeepEP V1. runtime: the ``ElasticBuffer`` (None after ``destroy``).

    Raises:
        ValueError: a bad argument, a group across NVLink domains or ``num_rdma_bytes > 0``, raised on every
            rank when any rank's arguments are refused; RuntimeError: called while the current stream captures a
            CUDA graph (create the buffer before capturing).
    """

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm: Any = None, *,
                 backend: str = "auto", window: str = "auto", num_gpu_timeout_secs: int = 100) -> None:
        if group is None:
            raise ValueError("group: expected a torch.distributed ProcessGroup" +
                             (" (an mpi4py comm is not supported)" if comm is not None else ", got None"))
        refuse_during_capture("Buffer")
        err = None
        try:
            if comm is not None:
                raise ValueError("comm: an mpi4py communicator is not supported; pass group only")
            num_nvl_bytes = int_arg("num_nvl_bytes", num_nvl_bytes, 0)
            num_rdma_bytes = int_arg("num_rdma_bytes", num_rdma_bytes, 0)
            low_latency_mode, enable_shrink = bool(low_latency_mode), bool(enable_shrink)
            if enable_shrink and not low_latency_mode:
                raise ValueError("enable_shrink=True: shrink mode masks ranks in low-latency calls; it needs "
                                 "low_latency_mode=True")
            if low_latency_mode and num_rdma_bytes == 0:
                raise ValueError("num_rdma_bytes: low-latency mode keeps its buffer there, got 0 (size it with "
                                 "Buffer.get_low_latency_rdma_size_hint(...))")
            if not low_latency_mode and num_rdma_bytes:
                raise ValueError(f"num_rdma_bytes={num_rdma_bytes}: {_INTERNODE}")
            if num_nvl_bytes == 0 and not low_latency_mode:
                raise ValueError("num_nvl_bytes: normal mode needs a buffer, got 0")
            int_arg("num_qps_per_rank", num_qps_per_rank, 0)
        except ValueError as e:
            err = e
        _collective.raise_if_any_rank_failed(group, err, "Buffer: creating the buffer")
        if get_physical_domain_size(group)[0] > 1:  # collective: every rank learns the same
            raise ValueError(f"group: it spans several NVLink domains (nodes). {_INTERNODE}")
        self.rank, self.group_size, self.group = dist.get_rank(group), dist.get_world_size(group), group
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.enable_shrink = low_latency_mode, enable_shrink
        self.explicitly_destroy = bool(explicitly_destroy)
        # One window: normal mode's bytes, then low-latency mode's (apart, so neither waits for the other).
        nvl, rdma = align(num_nvl_bytes, ALIGNMENT_BYTES), align(num_rdma_bytes, ALIGNMENT_BYTES)
        self.runtime: Optional[ElasticBuffer] = ElasticBuffer(
            group, num_bytes=max(nvl + rdma, ALIGNMENT_BYTES), allow_hybrid_mode=False,
            explicitly_destroy=self.explicitly_destroy, backend=backend, window=window,
            num_gpu_timeout_secs=num_gpu_timeout_secs)
        _collective.agree_on_every_rank(group, "Buffer(...)", {
            "num_nvl_bytes": nvl, "num_rdma_bytes": rdma, "low_latency_mode": int(low_latency_mode),
            "enable_shrink": int(enable_shrink)}, _collective.group_device(group))
        self._ll: Optional[LowLatency] = None
        if low_latency_mode:
            rt = self.runtime.runtime
            native = self.runtime.backend == "native"
            part = NativeLowLatency(rt, nvl, rdma, enable_shrink) if native else TorchLowLatency(rt, enable_shrink)
            device = torch.device("cuda", rt.device) if native else rt.device
            self._ll = LowLatency(part, group, device, rdma, rt.get_comm_stream())
        self._fit_cache: dict = {}

    # ------------------------------------------------------------------ lifecycle and info
    def _buf(self) -> ElasticBuffer:
        if self.runtime is None:
            raise RuntimeError("this Buffer was destroyed; create a new one")
        return self.runtime

    def destroy(self) -> None:
        """Releases the buffer on every rank (collective), as DeepEP V1's; allowed whatever
        ``explicitly_destroy`` is, and a second call does nothing."""
        if self.runtime is not None:
            rt, self.runtime, self._ll = self.runtime, None, None
            rt.destroy()

    def __enter__(self) -> "Buffer":
        self._buf()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.destroy()

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the kernels were built (for sm_90a), as DeepEP V1's; without them the torch backend runs."""
        return bool(_C.built_with_cuda())

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets ``Buffer.num_sms``, the SMs of the default configs, as DeepEP V1's.

        Arguments:
            new_num_sms: the SM count, a non-negative even int (DeepEP V1 runs two SMs per channel).

        Raises:
            ValueError: not a non-negative even int.
        """
        n = int_arg("new_num_sms", new_num_sms, 0)
        if n % 2:
            raise ValueError(f"new_num_sms: the SM count must be even, got {n}")
        Buffer.num_sms = n

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream, for ``previous_event`` (DeepEP V1's).

        Returns:
            An ``EventOverlap`` around an ``EventHandle`` recorded on the current stream (none on a CPU group).
        """
        return EventOverlap(EventHandle())

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The communication stream (DeepEP V1's).

        Returns:
            The CUDA stream the kernels run on; None for the torch backend on a CPU group.
        """
        return self._buf().get_comm_stream()

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """This rank's buffer memory as a tensor of ``dtype`` (DeepEP V1's; native backend only).

        Arguments:
            dtype: the element type.
            size: the shape of the slice to return (default: every whole element from ``offset``).
            offset: where the tensor starts, in bytes (as DeepEP V1's pointer arithmetic).
            use_rdma_buffer: must be False (there is no RDMA buffer).

        Returns:
            A tensor viewing the buffer (valid until ``destroy``; it does not own the memory).

        Raises:
            ValueError: ``use_rdma_buffer``, a bad offset or a size past the buffer; NotImplementedError:
                the torch backend, which keeps no buffer memory.
        """
        buf = self._buf()
        if use_rdma_buffer:
            raise ValueError(f"use_rdma_buffer: there is no RDMA buffer. {_INTERNODE}")
        if buf.backend != "native":
            raise NotImplementedError("get_local_buffer_tensor: the torch backend keeps no buffer memory")
        raw = buf.runtime._buffer_bytes()
        off = int_arg("offset", offset, 0, raw.numel())
        elem = _checks.itemsize(dtype)
        t = raw[off:off + (raw.numel() - off) // elem * elem].view(dtype)
        if size is None:
            return t
        shape = torch.Size(size)
        if shape.numel() > t.numel():
            raise ValueError(f"size: {tuple(shape)} needs {shape.numel()} elements, the buffer holds {t.numel()} "
                             f"from offset {off}")
        return t[:shape.numel()].view(shape)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP V1's recommended dispatch ``Config`` for ``num_ranks``.

        Arguments:
            num_ranks: ranks in the group.

        Returns:
            DeepEP V1's table entry, with ``Buffer.num_sms`` SMs.

        Raises:
            ValueError: a rank count DeepEP V1 has no entry for (2, 4, 8, 16, ... 160).
        """
        return recommended_config(DISPATCH_CONFIGS, num_ranks, Buffer.num_sms, "dispatch")

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP V1's recommended combine ``Config`` for ``num_ranks``: its combine table's entry, with the
        arguments, ``Buffer.num_sms`` and the ``ValueError`` of ``get_dispatch_config``."""
        return recommended_config(COMBINE_CONFIGS, num_ranks, Buffer.num_sms, "combine")

    def _num_sms(self, config: Optional[Config], table: dict) -> int:
        """The SMs of a call: ``config``'s, else the recommended config's (``Buffer.num_sms`` for rank counts
        DeepEP V1 has no entry for, e.g. 1)."""
        if config is None:
            return Buffer.num_sms if self.group_size not in table else recommended_config(
                table, self.group_size, Buffer.num_sms, "").num_sms
        if not isinstance(config, Config):
            raise ValueError(f"config: expected an elastic_ep.Config or None, got {type(config).__name__}")
        return config.num_sms

    def get_max_tokens_per_rank(self, hidden: int, num_topk: int, use_fp8: bool = False,
                                num_scales: Optional[int] = None) -> int:
        """The most tokens one rank may dispatch in a call with this buffer (ours, not DeepEP V1's).

        Arguments:
            hidden: the row length.
            num_topk: experts per token; 0 for a dispatch without top-k (one lane per rank).
            use_fp8: float8_e4m3fn rows with ``num_scales`` scales per token (default ``hidden // 128``).

        Returns:
            The count (equal on every rank): the largest whose dispatch and combine fit ``num_nvl_bytes``,
            counting the marker lanes a top-k dispatch carries (a lower bound where the experts leave them
            out, see ``_v1_routing.ranked_routing``).
        """
        H, K, R = int_arg("hidden", hidden, 1), int_arg("num_topk", num_topk, 0), self.group_size
        packs = (H // 128 if num_scales is None else int_arg("num_scales", num_scales, 1)) if use_fp8 else 0
        lanes = R if K == 0 else K + (R if marker_lanes_fit(K, R) else 0)
        return self._fit(H, packs, lanes, 1 if use_fp8 else 2)

    def _fit(self, H: int, packs: int, K: int, elem: int) -> int:
        key = (H, packs, K, elem)
        m = self._fit_cache.get(key)
        if m is None:
            buf = self._buf()
            m = self._fit_cache[key] = max_tokens_fit(align(self.num_nvl_bytes, ALIGNMENT_BYTES), self.group_size, H, packs, K, elem,
                                                      buf.allow_multiple_reduction)
        return m

    # ------------------------------------------------------------------ events
    def _event_args(self, previous_event: Event, async_finish: bool, allocate_on_comm_stream: bool) -> dict:
        """``ElasticBuffer``'s event arguments for DeepEP V1's: ``async_finish`` is its
        ``async_with_compute_stream``; a ``previous_event`` without ``allocate_on_comm_stream`` (which DeepEP
        V1 lets the communication stream wait for) is waited for by the current stream here, before the
        call, which orders the same work."""
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError("allocate_on_comm_stream: needs previous_event and async_finish=True (as DeepEP V1)")
        if previous_event is not None:
            _checks.check_event("previous_event", previous_event)
            # Either way the current stream waits: it then makes what this layer adds (routing, weight
            # pieces), and the communication stream waits for an event recorded after that (_after_inputs).
            previous_event.current_stream_wait()
            if not allocate_on_comm_stream:
                previous_event = None
        return dict(previous_event=previous_event, async_with_compute_stream=bool(async_finish),
                    allocate_on_comm_stream=bool(allocate_on_comm_stream))

    def _after_inputs(self, ev: dict) -> dict:
        """``ev`` for the ``ElasticBuffer`` call, its ``previous_event`` (if any) recorded now on the current
        stream, which waited for the caller's and made the inputs this layer adds."""
        return dict(ev, previous_event=self.capture()) if ev["previous_event"] is not None else ev

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Event = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """DeepEP V1's layout of a routing: what ``dispatch`` takes beside the tokens.

        Arguments:
            topk_idx: ``[num_tokens, num_topk]`` int64 (or int32) global expert ids, -1 for none.
            num_experts: all experts, a positive multiple of the rank count (expert ``e`` lives on rank
                ``e // (num_experts / num_ranks)``).
            previous_event, async_finish, allocate_on_comm_stream: as DeepEP V1 (it runs on the current
                stream after ``previous_event``; the event returned with ``async_finish`` is already met).

        Returns:
            ``(num_tokens_per_rank [R] int32, None (DeepEP V1's RDMA counts; one NVLink domain),
            num_tokens_per_expert [E] int32 ((token, lane) pairs per expert), is_token_in_rank [T, R] bool,
            event)``.

        Raises:
            ValueError: a bad argument (naming it).
        """
        buf = self._buf()
        check_tensor("topk_idx", topk_idx, _TOPK_DTYPES, 2, buf.device)
        E, _ = _checks.check_routing(num_experts, 1, self.group_size, 1, max(1, topk_idx.shape[1]))
        self._event_args(previous_event, async_finish, allocate_on_comm_stream)
        if previous_event is not None:  # the layout is computed on the current stream
            previous_event.current_stream_wait()
        per_rank, per_expert, in_rank = dispatch_layout(topk_idx, E, self.group_size)
        return per_rank, None, per_expert, in_rank, EventOverlap(EventHandle() if async_finish else None)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Event = None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Sends each token to the ranks of its experts (DeepEP V1's normal dispatch).

        Arguments:
            x: ``[T, H]`` bf16, or ``(x [T, H] float8_e4m3fn, scales [T, S] float32 or int32)`` (any strides).
            handle: a handle of an earlier dispatch of this buffer: cached mode (same routing; no top-k).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: ``get_dispatch_layout``'s outputs
                (required unless cached). With ``topk_idx`` the routing follows ``topk_idx`` (these must be
                its layout, not checked: it would wait for the GPU); without it, ``is_token_in_rank``.
            num_tokens_per_rdma_rank: DeepEP V1's RDMA counts, ignored inside one NVLink domain (as V1).
            topk_idx, topk_weights: ``[T, K]`` int64 (or int32) expert ids and float32 weights, both or neither.
            expert_alignment: the per-expert counts are rounded up to it.
            num_worst_tokens: > 0: no CPU sync (CUDA-graph capturable), outputs of exactly this many rows,
                ``recv_topk_idx`` -1 past the received ones, an empty count list. Needs top-k; every rank
                passes the same value, with at most ``num_worst_tokens // R`` tokens each.
            config: ``Config`` (its ``num_sms``); None: ``get_dispatch_config``'s.
            previous_event, async_finish, allocate_on_comm_stream: as DeepEP V1 (``allocate_on_comm_stream``
                needs both others).

        Returns:
            ``(recv_x or (recv_x, recv_scales), recv_topk_idx, recv_topk_weights,
            num_recv_tokens_per_expert_list, handle, event)``; cached mode: ``(recv_x, None, None, None, None,
            event)``. Rows by source rank, then source token; ``recv_topk_idx`` local ids (topk_idx's
            dtype), -1 for experts elsewhere, where ``recv_topk_weights`` is 0; the per-expert list counts
            the local experts' (token, lane) pairs, each rounded up to ``expert_alignment``.

        Raises:
            ValueError: a bad argument (naming it), or a call over the buffer's token capacity (naming
                ``num_nvl_bytes`` and the bytes it needs), before anything is sent.
        """
        buf = self._buf()
        ev = self._event_args(previous_event, async_finish, allocate_on_comm_stream)
        num_sms = self._num_sms(config, DISPATCH_CONFIGS)
        if handle is not None:
            return self._cached_dispatch(buf, x, handle, topk_idx, topk_weights, num_sms, ev)
        missing = [n for n, v in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                                  ("num_tokens_per_expert", num_tokens_per_expert)) if v is None]
        if missing:
            raise ValueError(f"{', '.join(missing)}: required unless a handle is given (get_dispatch_layout's outputs)")
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError("topk_idx / topk_weights: pass both or neither (as DeepEP V1)")
        x0, sf = self._split_x(x, buf)
        T, R = x0.shape[0], self.group_size
        check_tensor("num_tokens_per_rank", num_tokens_per_rank, (torch.int32,), 1, buf.device, shape=(R,))
        check_tensor("is_token_in_rank", is_token_in_rank, (torch.bool,), 2, buf.device, shape=(T, R))
        check_tensor("num_tokens_per_expert", num_tokens_per_expert, (torch.int32,), 1, buf.device)
        E, alignment = _checks.check_routing(num_tokens_per_expert.shape[0], expert_alignment, R, 1, 1)
        nwt = int_arg("num_worst_tokens", num_worst_tokens, 0)
        if nwt and topk_idx is None:
            raise ValueError("num_worst_tokens: needs topk_idx and topk_weights (as DeepEP V1)")
        routing, weights, eb_experts, ranked = self._routing(buf, topk_idx, topk_weights, is_token_in_rank, E, T)
        M = self._tokens_per_rank(x0, sf, routing.shape[1], nwt)
        try:
            recv, recv_idx, recv_w, h, event = buf.dispatch(
                x, topk_idx=routing, topk_weights=weights, num_experts=eb_experts, num_max_tokens_per_rank=M,
                expert_alignment=alignment if topk_idx is not None else 1, num_sms=num_sms, do_cpu_sync=nwt == 0,
                **self._after_inputs(ev))
        except ValueError as e:
            if not ranked or "expert ids" not in str(e):
                raise
            raise ValueError(f"topk_idx: expert ids outside [-1, {E}) ({e}: ids and expert count of the underlying "
                             f"ElasticBuffer call, which adds one marker expert per rank)") from None
        rows = nwt or h.num_recv_tokens
        deferred = Deferred()
        recv = self._fit_recv(recv, rows, deferred)
        if topk_idx is None:
            per_expert = aligned_counts(global_expert_counts(num_tokens_per_expert, self.group).view(R, -1)[self.rank]
                                        .tolist(), alignment)
            recv_idx = recv_w = None
        else:  # the caller's lanes and experts (the markers, if any, come after them)
            K, L = topk_idx.shape[1], E // R
            per_expert = [] if nwt else list(h.num_recv_tokens_per_expert_list)[:L]
            valid = h.psum_num_recv_tokens_per_scaleup_rank[-1] if nwt else None  # -1 past the received rows
            recv_idx = output(recv_idx[:, :K], rows, topk_idx.dtype, deferred, valid)
            recv_w = output(recv_w[:, :K], rows, torch.float32, deferred)
        new_handle = self._handle(h, M, rows, is_token_in_rank, topk_idx is not None, deferred)
        deferred.schedule(event, async_finish)
        return recv, recv_idx, recv_w, per_expert, new_handle, event

    @staticmethod
    def _routing(buf: ElasticBuffer, topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                 is_token_in_rank: torch.Tensor, E: int, T: int):
        """``(ids, weights, experts, ranked)`` of the ``ElasticBuffer`` dispatch: without top-k one lane per
        rank (``rank_routing``); with it the caller's lanes plus a marker lane per rank where the kernels'
        limits allow (``ranked_routing``: combine adds the ranks in rank order), else the caller's."""
        R = is_token_in_rank.shape[1]
        if topk_idx is None:
            return rank_routing(is_token_in_rank), None, R, False
        check_tensor("topk_idx", topk_idx, _TOPK_DTYPES, 2, buf.device, shape=(T, None))
        check_tensor("topk_weights", topk_weights, (torch.float32,), 2, buf.device, shape=(T, topk_idx.shape[1]))
        ranked = ranked_routing(topk_idx, topk_weights, E, R)
        return ranked + (True,) if ranked is not None else (topk_idx, topk_weights, E, False)

    def _cached_dispatch(self, buf: ElasticBuffer, x: Any, handle: Any, topk_idx: Any, topk_weights: Any,
                         num_sms: int, ev: dict):
        """Cached mode: ``handle``'s routing again for new rows (DeepEP V1 returns only ``recv_x``)."""
        self._check_handle(handle, buf)
        if topk_idx is not None or topk_weights is not None:
            raise ValueError("topk_idx / topk_weights: must be None in cached mode (as DeepEP V1)")
        recv, _, _, _, event = buf.dispatch(x, handle=handle.ep_handle, num_sms=num_sms, **self._after_inputs(ev))
        deferred = Deferred()
        recv = self._fit_recv(recv, handle.num_rows, deferred)
        deferred.schedule(event, ev["async_with_compute_stream"])
        return recv, None, None, None, None, event

    @staticmethod
    def _check_handle(handle: Any, buf: ElasticBuffer) -> None:
        if not isinstance(handle, DispatchHandle) or handle.buffer_serial != buf._serial:
            raise ValueError(f"handle: expected a handle returned by this Buffer's dispatch, got "
                             f"{type(handle).__name__}")

    @staticmethod
    def _split_x(x: Any, buf: ElasticBuffer) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(rows, scales or None)`` of ``x`` (checked in full by ``ElasticBuffer.dispatch``)."""
        sf = None
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ValueError(f"x: expected a tensor or an (x, scales) pair, got a sequence of {len(x)}")
            x, sf = x
        check_tensor("x", x, _X_DTYPES, 2, buf.device)
        if sf is not None:
            check_tensor("x[1] (scales)", sf, (torch.float32, torch.int32), 2, buf.device, contiguous=False)
        return x, sf

    def _tokens_per_rank(self, x: torch.Tensor, sf: Optional[torch.Tensor], K: int, nwt: int) -> int:
        """The ``num_max_tokens_per_rank`` of the ``ElasticBuffer`` call, equal on every rank: the most the
        buffer holds for this shape, or ``num_worst_tokens // R`` (the worst case fits its outputs)."""
        T, H = x.shape
        packs = sf.shape[1] if sf is not None else 0
        fit = self._fit(H, packs, K, x.element_size())
        if nwt:
            M = nwt // self.group_size
            if M < max(T, 1) or M > fit:
                raise ValueError(f"num_worst_tokens: {nwt} on {self.group_size} ranks allows {M} tokens per rank; "
                                 f"x has {T} and the buffer holds {fit} (every rank must pass the same "
                                 f"num_worst_tokens, at least num_ranks x its tokens)")
            return M
        if T > fit:
            fp8 = x.dtype == torch.float8_e4m3fn
            need = calculate_elastic_buffer_size(self.group_size, T, H, K, fp8, False)
            raise ValueError(f"num_nvl_bytes: {self.num_nvl_bytes} bytes hold {fit} tokens per rank for this call "
                             f"(hidden={H}, {x.dtype}, {K} routing lanes), x has {T}; create the Buffer with "
                             f"num_nvl_bytes >= {need} (elastic_ep.calculate_elastic_buffer_size("
                             f"{self.group_size}, {T}, {H}, {K}, use_fp8_dispatch={fp8}))")
        return max(fit, 1)

    @staticmethod
    def _fit_recv(recv: Any, rows: int, deferred: Deferred) -> Any:
        if isinstance(recv, tuple):
            return fit_rows(recv[0], rows, deferred), fit_rows(recv[1], rows, deferred)
        return fit_rows(recv, rows, deferred)

    def _handle(self, h: Any, M: int, rows: int, is_token_in_rank: torch.Tensor, has_topk: bool,
                deferred: Deferred) -> DispatchHandle:
        """DeepEP V1's handle of a dispatch (``_v1_routing.DispatchHandle``), its tensors from ``h``."""
        R, me, dev = self.group_size, self.rank, is_token_in_rank.device
        psum, meta = h.psum_num_recv_tokens_per_scaleup_rank, h.recv_src_metadata
        prefix = deferred.tensor((R, R), torch.int32, dev, lambda: rank_prefix_matrix(psum, me, R))

        def src_idx() -> torch.Tensor:
            idx = (meta[:rows, 0] % M).to(torch.int32)
            if idx.shape[0] < rows:
                idx = torch.cat([idx, idx.new_full((rows - idx.shape[0],), -1)])
            return mask_rows_past(idx, psum[-1], -1)

        recv_src_idx = deferred.tensor((rows,), torch.int32, dev, src_idx)
        return DispatchHandle(prefix, recv_src_idx, is_token_in_rank, h, rows, self._buf()._serial, has_topk)

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None, previous_event: Event = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Returns each received row to its token and sums them, without weights (DeepEP V1's combine).

        Arguments:
            x: ``[num_rows, H]`` bf16 expert outputs in the dispatch's row order.
            handle: the dispatch's handle.
            topk_weights: ``[num_rows, K]`` float32 (any K up to 32), or None: DeepEP V1's rule, each token's
                weights are the fp32 sum, in rank order, of the rows every rank it reached returns.
            bias: None, a ``[T, H]`` bf16 tensor or a pair of them, added in fp32 before the rows.
            config: ``Config`` (its ``num_sms``); None: ``get_combine_config``'s.
            previous_event, async_finish, allocate_on_comm_stream: as DeepEP V1.

        Returns:
            ``(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None, event)``. The sum is
            DeepEP V1's: fp32, the biases, then the ranks' rows in rank order, one rounding (where the
            dispatch's marker lanes did not fit, ``_v1_routing.ranked_routing``, the ranks come in
            ``ElasticBuffer``'s order: each at its last top-k lane).

        Raises:
            ValueError: a bad argument (naming it), before anything is sent.
        """
        buf = self._buf()
        self._check_handle(handle, buf)
        ev = self._event_args(previous_event, async_finish, allocate_on_comm_stream)
        num_sms = self._num_sms(config, COMBINE_CONFIGS)
        h = handle.ep_handle
        check_tensor("x", x, (torch.bfloat16,), 2, buf.device, shape=(handle.num_rows, None))
        rows = h.num_allocated_tokens  # what ElasticBuffer's layout holds: the received rows or its worst case
        pieces = []
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, (torch.float32,), 2, buf.device, shape=(handle.num_rows, None))
            if not 0 < topk_weights.shape[1] <= _checks.MAX_TOPK:
                raise ValueError(f"topk_weights: expected 1..{_checks.MAX_TOPK} columns, got {topk_weights.shape[1]}")
            payload = encode_weights(topk_weights, self.rank, self.group_size, rows)
            # In column blocks no wider than x's rows, whose combine the buffer holds by construction.
            width = x.shape[1]
            pieces = [payload[:, c:c + width].contiguous() for c in range(0, payload.shape[1], width)]
        # The pieces are written on this stream: a communication stream that waits for previous_event only
        # must also wait for them.
        pieces_ev = self._after_inputs(ev)
        combined_x, _, event = buf.combine(x[:rows], h, bias=bias, num_sms=num_sms, **ev)
        if not pieces:
            return combined_x, None, event
        parts = []
        for piece in pieces:
            part, _, event = buf.combine(piece, h, num_sms=num_sms, **pieces_ev)
            parts.append(part)
        event.extra_tensors = tuple(pieces)  # alive while the caller holds the event (async_finish)
        deferred = Deferred()
        K = topk_weights.shape[1]
        combined_w = deferred.tensor((parts[0].shape[0], K), torch.float32, parts[0].device,
                                     lambda: decode_weights(torch.cat(parts, dim=1), self.group_size, K))
        deferred.schedule(event, async_finish)
        return combined_x, combined_w, event

    # ------------------------------------------------------------------ not available yet
    internode_dispatch = _not_available("internode_dispatch", _INTERNODE)
    internode_combine = _not_available("internode_combine", _INTERNODE)
