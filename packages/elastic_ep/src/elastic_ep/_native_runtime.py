"""The native runtime: elastic_ep's C++/CUDA kernels (``elastic_ep._C``), the Python mirror of DeepEP V2's
C++ ``ElasticBuffer`` (direct mode, and hybrid mode over logical domains). ``NativeRuntime`` runs
dispatch and combine over the window of ``NativeWindow`` (``_native_window.py``: creation, health,
stream control, teardown).

dispatch
  1. notify (up to 32 blocks): entry barrier, per-token slots in each destination rank's receive area
     (receive order: by source rank, then source token), counts pushed into the peers' workspaces,
     then prefix sums, statistics and the host-mapped counts of the CPU sync;
  2. push (beside notify, or after it): each token's record ``[x | sf | topk_idx | weights | src]``
     into each destination rank's area ``[src_rank][slot]``;
  3. (CPU sync) the host waits for the counts and allocates exact-size outputs; otherwise worst case;
  4. copy epilogue: records into ``recv_x`` / ``recv_sf`` / ``recv_topk_idx`` / ``recv_topk_weights`` /
     ``recv_src_metadata``; expand mode writes one row per local expert in the expert's aligned segment.
combine
  1. push: each received row (expand mode with multiple reduction: the fp32 sum of its local rows) back
     into the origin's combine area ``[token][slot]``;
  2. reduce: DeepEP's order in fp32 (the biases, then the partials lane by lane), one rounding to bf16;
     the weights are routed back, never multiplied.
hybrid mode (``num_scaleup_ranks``, set by the buffer from its logical domains; csrc/kernels/hybrid.cuh)
  the pushes reach other domains only through rail peers, whose forward kernels (before the epilogue,
  after the combine push) relay into direct mode's receive areas; no overlap, no zero-copy, no push
  beside notify. The forwarders' record becomes the handle's ``token_metadata_at_forward`` /
  ``channel_linked_list`` (``_forward_metadata_of``).

The runtime takes validated arguments (``DispatchArgs`` / ``CombineArgs``, see ``_checks``). Each launch
has a plan (``_native_plans``: the scalars, by the parameter block's member names) whose block is made
once per plan; the call's tensors go onto the block by name before the launch. Launch one process per GPU;
every rank calls every operation in the same order.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from . import _C, _env
from ._events import EventHandle
from ._handle import EPHandle
from ._hybrid import forward_metadata
from ._native_plans import (CombinePlan, DispatchPlan, EpiloguePlan, OverlapConfig, ScalarFields, overlap_push_blocks,
                            plan_cache)
from ._native_window import (ALL_QUEUED, EPILOGUE_OWED, NOTHING_QUEUED, CommError, CommTimeoutError,  # noqa: F401
                             NativeWindow, stream_wait)
from ._nccl import (check_nccl_version, create_nccl_comm, destroy_nccl_comm, get_local_nccl_unique_id,  # noqa: F401
                    get_logical_domain_size, get_physical_domain_size, nccl_version)
from ._runtime import CombineArgs, DispatchArgs, DispatchResult

__all__ = ["NativeRuntime", "OverlapConfig", "topk_idx_t", "get_local_nccl_unique_id", "create_nccl_comm",
           "destroy_nccl_comm", "get_elastic_buffer_alignment", "get_physical_domain_size", "get_logical_domain_size",
           "nccl_version", "check_nccl_version", "CommError", "CommTimeoutError"]

#: dtype of top-k expert indices (DeepEP's ``topk_idx_t``); int32 is accepted too (cast once per call).
topk_idx_t = torch.int64
_SF_PACK_ALIGN = int(_C.NUM_ALIGNED_SF_PACKS)
_NO_STREAM = -1  # the runtime's "no stream" (0 is a real one: the legacy default stream, torch's default)
_DISPATCH_SCALARS = ScalarFields(DispatchArgs)  # the dispatch plans' key (see _native_plans)


def get_elastic_buffer_alignment() -> int:
    """The alignment of buffer sizes in bytes (2 MiB)."""
    return int(_C.get_elastic_buffer_alignment())


# The current stream's ``cudaStream_t`` of a device (without building a Stream object: a few microseconds).
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _forward_metadata_of(forward_dense: torch.Tensor, num_scaleup_ranks: int,
                         stream: torch.cuda.Stream) -> Tuple[torch.Tensor, torch.Tensor]:
    """A hybrid dispatch's ``(token_metadata_at_forward, channel_linked_list)`` from the kernels' dense
    ``[S * M, 2]`` record (rows with an empty mask relayed nothing), in the torch runtime's layout.
    Compacting it synchronises ``stream`` once (the row count); the current stream then waits for it."""
    with torch.cuda.stream(stream):
        valid = forward_dense[:, 1] != 0
        rows = forward_dense[valid]
        forward = forward_metadata(rows[:, 0], rows[:, 1], num_scaleup_ranks)
    torch.cuda.current_stream().wait_stream(stream)
    return forward


class _Sent:
    """What notify writes (cached: the handle's), and the routing the kernels read (set by name)."""

    __slots__ = ("topk_idx",       # int64 (an int32 input cast once: the handle's copy then)
                 "copied",         # notify's copy of an int64 topk_idx (do_handle_copy), or None
                 "psum_rank", "psum_expert", "unaligned", "slot_idx",  # psum_expert: [L + 1], None when cached
                 "direct_base",    # zero-copy, else None
                 "forward_dense")  # hybrid mode and not cached, else None


class _Received:
    """The epilogue's outputs and the counts they were sized by (set by name)."""

    __slots__ = ("x", "sf", "topk_idx", "topk_weights", "src_metadata",
                 "psum_expert",    # expand mode: the exclusive starts, else the inclusive sums
                 "num_recv", "num_expanded", "per_expert")


class NativeRuntime(NativeWindow):
    """dispatch and combine on the native kernels, over ``NativeWindow``'s window (constructor: DeepEP
    V2's C++ ``ElasticBuffer`` arguments, see ``NativeWindow``).

    ``dispatch_pdl`` (``ELASTIC_EP_DISPATCH_PDL``; may be changed between calls): the dispatch push is
    launched as notify's programmatic dependent and runs beside notify's count exchange.
    ``dispatch_overlap`` / ``combine_overlap`` (``OverlapConfig``): the overlapped modes.
    """

    dispatch_pdl: bool = True
    _drop_scaleout_signals: int = 0  # ELASTIC_EP_TEST_DROP_SCALEOUT_SIGNALS (tests)
    _test_corrupt: int = 0           # ELASTIC_EP_TEST_CORRUPT (tests)

    def _configure(self, settings: _env.Settings) -> None:
        self.dispatch_overlap = OverlapConfig(settings.dispatch_overlap, settings.dispatch_push_blocks)
        self.combine_overlap = OverlapConfig(settings.combine_overlap, settings.combine_push_blocks)
        self.dispatch_pdl = settings.dispatch_pdl
        self._notify_atomics = int(settings.test_notify_atomics)
        self._drop_scaleout_signals = int(settings.test_drop_scaleout_signals)
        self._test_corrupt = int(settings.test_corrupt)
        self._dispatch_blocks_of = plan_cache(self._make_dispatch_blocks)
        self._combine_block_of = plan_cache(self._make_combine_block)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, a: DispatchArgs) -> DispatchResult:
        """Sends each token to the ranks owning its top-k experts (cached mode: ``a.handle``'s routing).

        Returns:
            The outputs and the handle (a new ``EPHandle``, or ``a.handle`` in cached mode).

        Raises:
            ValueError: zero-copy in hybrid mode; expert ids outside ``[-1, E)`` refused on every rank
                (CPU sync) or masked by an earlier call.
            CommTimeoutError / CommError: a device or CPU wait expired, or the runtime is unusable.
        """
        self._alive("dispatch")
        if self.num_scaleup_ranks and a.zero_copy:
            raise ValueError("zero_copy: not available in hybrid mode (the forwarders write records, not the "
                             "dense receive area); call dispatch with zero_copy=False")
        notify, epilogue = self._dispatch_blocks(a)
        fast = a.previous_event is None and not a.allocate_on_comm_stream and not a.async_with_compute_stream
        compute_stream = None
        stage = NOTHING_QUEUED  # how far this call got, for _abandon if anything below raises
        try:
            compute_stream, compute_raw = self._enter_streams(a, fast)
            sent = self._notify_outputs(a)
            # From here until the epilogue is queued, this rank owes its peers the rest of the operation
            # (set before the call: a launch error inside it may come after notify was queued).
            stage = EPILOGUE_OWED
            self._launch_notify(notify, a, sent, compute_raw)
            counts = self._counts(a)
            if counts is None:
                # Refused on every rank: the push ended the operation without an epilogue, so nothing
                # is owed and the buffer stays usable.
                stage = ALL_QUEUED
                raise self._geometry_error() or self._refused_error(a.num_experts)
            recv = self._receive_outputs(a, sent, counts)
            self._launch_epilogue(epilogue, a, sent, recv, compute_raw)
            stage = ALL_QUEUED
            event = None
            if not fast:
                event = self.stream_control_epilogue(
                    # (A zero-copy recv_x is the window's memory, not the caching allocator's.)
                    [a.x, a.sf, sent.topk_idx, a.topk_weights, None if a.zero_copy else recv.x, recv.sf,
                     recv.topk_idx, recv.topk_weights, a.cumulative_local_expert_recv_stats, sent.copied,
                     sent.psum_rank, sent.psum_expert, recv.psum_expert, sent.unaligned, recv.src_metadata,
                     sent.slot_idx],
                    compute_stream, a.allocate_on_comm_stream, a.async_with_compute_stream)
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too: re-raised after the clean-up
            self._abandon("dispatch", e, stage, compute_stream, a.allocate_on_comm_stream)
            raise
        h = a.handle if a.handle is not None else self._new_handle(a, sent, recv)
        return DispatchResult(recv.x, recv.sf, recv.topk_idx, recv.topk_weights, h, event)

    def _enter_streams(self, a: Any, fast: bool) -> Tuple[Optional[torch.cuda.Stream], int]:
        """``(compute stream to restore or None, raw compute stream for the launches or _NO_STREAM)``.

        ``fast`` (no events, outputs on the compute stream): the runtime orders its launches after the
        compute stream itself; otherwise the stream control switches streams here, before any output
        is allocated (on the comm stream if asked)."""
        if fast:
            return None, _current_raw_stream(self.device)
        return self.stream_control_prologue(a.previous_event, a.allocate_on_comm_stream), _NO_STREAM

    def _dispatch_blocks(self, a: DispatchArgs) -> Tuple[Any, Any]:
        """The parameter blocks of the call's notify + push and epilogue (pointers not set yet)."""
        sf, ov = a.sf, self.dispatch_overlap
        return self._dispatch_blocks_of(
            _DISPATCH_SCALARS.read(a), cached=a.handle is not None, element_size=a.x.element_size(),
            sf_layout=(sf.shape[1], *sf.stride()) if sf is not None else (0, 0, 0),
            epilogue_gated=a.previous_event_before_epilogue is not None, pdl=self.dispatch_pdl,
            overlap=ov.enabled, push_blocks=ov.push_blocks)

    def _make_dispatch_blocks(self, scalars: tuple, *, cached: bool, element_size: int,
                              sf_layout: Tuple[int, int, int], epilogue_gated: bool, pdl: bool, overlap: bool,
                              push_blocks: Optional[int]) -> Tuple[Any, Any]:
        """``_dispatch_blocks``' blocks, made from its arguments only (``plan_cache``): ``scalars`` are the
        call's ``DispatchArgs`` scalar fields, the rest what the plans need besides them. The runtime's
        own sizes (ranks, domains, device SMs, test switches) are fixed at its creation."""
        a = _DISPATCH_SCALARS.view(scalars)
        num_sms = a.num_sms
        # Overlapped dispatch: the push gets `push_sms` blocks, the epilogue (on the runtime's second
        # stream, beside the push) the rest. Not when an event must gate the epilogue, nor with a grid
        # larger than the GPU: the epilogue's blocks wait for the push's, so both must fit at once.
        push_sms = 0
        if overlap and not epilogue_gated and num_sms <= self.num_device_sms and not self.num_scaleup_ranks:
            push_sms = overlap_push_blocks(OverlapConfig(overlap, push_blocks), self.num_ranks, num_sms,
                                           a.num_max_tokens_per_rank)
        overlapped = push_sms > 0
        packs, sf_token_stride, sf_hidden_stride = sf_layout
        shape = dict(sf_token_stride=sf_token_stride, sf_hidden_stride=sf_hidden_stride,
                     num_max_tokens_per_rank=a.num_max_tokens_per_rank, hidden_bytes=a.hidden * element_size,
                     num_sf_packs=packs, num_experts=a.num_experts, num_topk=a.num_topk,
                     expert_alignment=a.expert_alignment, cached=cached)
        notify = DispatchPlan(
            **shape, num_tokens=a.num_tokens, num_sms=push_sms if overlapped else num_sms,
            notify_atomic_masks=self._notify_atomics,
            # Expert ids outside [-1, E): with a CPU sync notify counts them and the dispatch is refused
            # on every rank (nothing is written, every host raises, the buffer stays usable); without
            # one, notify masks them and the next call raises (_alive). ELASTIC_EP_SKIP_INDEX_CHECK=1: masked.
            refuse_bad_ids=a.do_cpu_sync and not cached and self._refuse_bad_ids,
            overlap=overlapped, concurrent_notify=pdl and not overlapped and not self.num_scaleup_ranks,
            zero_copy=a.zero_copy, zero_copy_x_offset=a.zero_copy_x_offset if a.zero_copy else 0,
            test_drop_scaleout_signals=self._drop_scaleout_signals, test_corrupt=self._test_corrupt)
        epilogue = EpiloguePlan(**shape, do_expand=a.do_expand, do_zero_padding=a.do_zero_padding,
                                num_sms=num_sms - push_sms, overlap=overlapped, zero_copy=a.zero_copy)
        return _C.DispatchParams(**notify._asdict()), _C.EpilogueParams(**epilogue._asdict())

    def _notify_outputs(self, a: DispatchArgs) -> _Sent:
        """What notify writes, allocated (cached mode: the handle's); nothing is queued yet."""
        h, R = a.handle, self.num_ranks
        L = a.num_experts // R
        topk_idx = a.topk_idx
        if topk_idx.dtype is not torch.int64:
            # DeepEP's 32-bit topk_idx_t: the kernels read int64. One cast, on the stream whose work
            # the kernels are ordered after; it is also the handle's copy.
            topk_idx = topk_idx.to(torch.int64)
        sent = _Sent()
        sent.topk_idx = topk_idx
        if h is not None:
            sent.copied = None
            sent.psum_rank = h.psum_num_recv_tokens_per_scaleup_rank
            sent.psum_expert = None
            sent.unaligned = h.num_unaligned_recv_tokens_per_expert
            sent.slot_idx = h.dst_buffer_slot_idx
            sent.direct_base = h.direct_base if a.zero_copy else None
            sent.forward_dense = None
            return sent
        # One allocation for the int32 arrays notify writes (one split_with_sizes costs less host time
        # than several slices); zero-copy: direct_base too. Outputs are allocated as new_empty of an
        # input on the runtime's device: torch parses no device argument then (~1 us per tensor).
        T, K = a.num_tokens, a.num_topk
        sizes = (R, L + 1, L, T * K, R) if a.zero_copy else (R, L + 1, L, T * K)
        parts = a.x.new_empty((sum(sizes),), dtype=torch.int32).split_with_sizes(sizes)
        sent.copied = torch.empty_like(topk_idx) if a.do_handle_copy and topk_idx is a.topk_idx else None
        sent.psum_rank = parts[0]
        sent.psum_expert = parts[1]
        sent.unaligned = parts[2]
        sent.slot_idx = parts[3].view(T, K)
        sent.direct_base = parts[4] if a.zero_copy else None
        # Hybrid mode: [S * M, 2] (source token, mask of this domain's destinations), by source domain
        # and token, written by this rank's push (own domain) and forward kernel (the others).
        sent.forward_dense = None
        if self.num_scaleup_ranks:
            sent.forward_dense = parts[0].new_zeros((R * a.num_max_tokens_per_rank // self.num_scaleup_ranks, 2))
        return sent

    def _launch_notify(self, params: Any, a: DispatchArgs, sent: _Sent, compute_raw: int) -> None:
        # Every pointer member by name: a tensor (its data_ptr) or None (0).
        params.set(x=a.x, sf=a.sf, topk_idx=sent.topk_idx, topk_weights=a.topk_weights, copied_topk_idx=sent.copied,
                   cumulative_stats=None if a.handle is not None else a.cumulative_local_expert_recv_stats,
                   psum_rank=sent.psum_rank, psum_expert=sent.psum_expert, unaligned_expert=sent.unaligned,
                   slot_idx=sent.slot_idx, direct_base=sent.direct_base, forward_dense=sent.forward_dense)
        self._rt.dispatch(params, self._comm_raw, compute_raw)

    def _counts(self, a: DispatchArgs) -> Optional[Tuple[int, int, list]]:
        """``(received rows, expanded rows, aligned rows per local expert)``: the handle's (cached), the
        CPU sync's, or the worst case (no list); None when notify refused the dispatch on every rank."""
        h, R, M = a.handle, self.num_ranks, a.num_max_tokens_per_rank
        if h is not None:
            return h.num_recv_tokens, h.num_expanded_tokens, h.num_recv_tokens_per_expert_list
        L = a.num_experts // R
        if not a.do_cpu_sync:
            return R * M, int(_C.worst_case_num_expanded_tokens(R, M, a.num_topk, L, a.expert_alignment)), []
        c = self._rt.wait_dispatch_counts(L)
        if c.status == 1:  # the runtime marked itself broken (statuses 1, 2)
            self._alive()  # raises the device timeout
        elif c.status == 2:
            # Which peer is late is known on the GPU only: notify publishes the counts once every peer's
            # arrived, and its own deadline names the peer it waits for.
            raise self._cpu_timeout(
                "dispatch CPU wait for the token counts",
                f"ranks whose counts arrived {c.ranks_ready}/{R}, local experts {c.experts_ready}/{L} (the notify "
                "kernel publishes them only once every peer's counts arrived; a num_gpu_timeout_secs shorter than "
                "num_cpu_timeout_secs makes the device deadline report first, naming the peer); destroy this "
                "buffer and create a new one", R + L, c.ranks_ready + c.experts_ready)
        elif c.status in (3, 4):  # refused on every rank: bad expert ids, or a rank's other geometry
            return None
        return c.num_recv_tokens, c.num_expanded_tokens, c.num_recv_tokens_per_expert

    def _receive_outputs(self, a: DispatchArgs, sent: _Sent, counts: Tuple[int, int, list]) -> _Received:
        """The epilogue's outputs, sized by the counts (a zero-copy recv_x: a view of the receive area)."""
        h, x, sf, K = a.handle, a.x, a.sf, a.num_topk
        num_recv, num_expanded, per_expert = counts
        n = num_expanded if a.do_expand else num_recv
        recv = _Received()
        if a.zero_copy:  # the rows the push wrote in place: receive order, dense
            off, row = a.zero_copy_x_offset, a.hidden * x.element_size()
            recv.x = self._buffer_bytes()[off:off + n * row].view(x.dtype).view(n, a.hidden)
        else:
            recv.x = x.new_empty((n, a.hidden))
        recv.sf = None
        if sf is not None:
            packs = sf.shape[1]
            strides = (1, (n + _SF_PACK_ALIGN - 1) // _SF_PACK_ALIGN * _SF_PACK_ALIGN) \
                if a.use_tma_aligned_col_major_sf else (packs, 1)
            recv.sf = sf.new_empty_strided((n, packs), strides)
        recv.topk_idx = None if a.do_expand else sent.topk_idx.new_empty((n, K))
        recv.topk_weights = None
        if a.topk_weights is not None:
            recv.topk_weights = a.topk_weights.new_empty((n,) if a.do_expand else (n, K))
        # Cached: expanded rows go where the handle's metadata points (sorted rows after a
        # deterministic sort, as in DeepEP); nothing is written to it.
        recv.src_metadata = h.recv_src_metadata if h is not None else sent.psum_rank.new_empty((num_recv, K + 2))
        # Expand mode: the exclusive starts (become start + count); otherwise the inclusive sums.
        recv.psum_expert = h.psum_num_recv_tokens_per_expert if h is not None else \
            (sent.psum_expert[:-1] if a.do_expand else sent.psum_expert[1:])
        recv.num_recv = num_recv
        recv.num_expanded = num_expanded
        recv.per_expert = per_expert
        return recv

    def _launch_epilogue(self, params: Any, a: DispatchArgs, sent: _Sent, recv: _Received, compute_raw: int) -> None:
        if a.previous_event_before_epilogue is not None:
            stream_wait(self.comm_stream, a.previous_event_before_epilogue)
        # Rows this rank sends to itself are copied from x by the epilogue.
        rsf_ts, rsf_hs = recv.sf.stride() if recv.sf is not None else (0, 0)
        params.set(x=a.x, sf=a.sf, recv_x=recv.x, recv_sf=recv.sf, recv_sf_token_stride=rsf_ts,
                   recv_sf_hidden_stride=rsf_hs, recv_topk_idx=recv.topk_idx, recv_topk_weights=recv.topk_weights,
                   recv_src_metadata=recv.src_metadata, psum_rank=sent.psum_rank, psum_expert=sent.psum_expert,
                   unaligned_expert=sent.unaligned, forward_dense=sent.forward_dense)
        self._rt.dispatch_epilogue(params, self._comm_raw, compute_raw)

    def _new_handle(self, a: DispatchArgs, sent: _Sent, recv: _Received) -> EPHandle:
        forward = (None, None)
        if sent.forward_dense is not None and not torch.cuda.is_current_stream_capturing():
            forward = _forward_metadata_of(sent.forward_dense, self.num_scaleup_ranks, self.comm_stream)
        # DeepEP's fields in its constructor order, then ours (by name: the constructor's keywords cost more)
        h = EPHandle(a.do_expand, a.num_experts, a.expert_alignment, a.num_max_tokens_per_rank, a.num_sms,
                     sent.copied if sent.copied is not None else sent.topk_idx, recv.num_recv, recv.num_expanded,
                     recv.per_expert, sent.psum_rank, recv.psum_expert, sent.unaligned, recv.src_metadata,
                     sent.slot_idx, *forward)
        h.buffer_id = self.buffer_id
        h.direct_base = sent.direct_base
        return h

    # ------------------------------------------------------------------ combine
    def combine(self, a: CombineArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[EventHandle]]:
        """Sends expert outputs back to the tokens' origins and reduces them (see the module docstring).

        Returns:
            ``(combined_x [T, hidden] bf16, combined_topk_weights [T, K] float32 or None, event or None)``.

        Raises:
            CommTimeoutError / CommError: an earlier device wait expired, or the runtime is unusable.
        """
        self._alive("combine")
        h, x, w = a.handle, a.x, a.topk_weights
        T, K = h.topk_idx.shape
        fast = a.previous_event is None and not a.allocate_on_comm_stream and not a.async_with_compute_stream
        compute_stream = None
        stage = NOTHING_QUEUED  # how far this call got, for _abandon if anything below raises
        try:
            compute_stream, compute_raw = self._enter_streams(a, fast)
            topk_idx = h.topk_idx
            if topk_idx.dtype is not torch.int64:  # a handle given a 32-bit topk_idx: the kernels read int64
                topk_idx = topk_idx.to(torch.int64)
            combined_x = x.new_empty((T, x.shape[1]))  # bf16, as x (new_empty: see _notify_outputs)
            combined_w = w.new_empty((T, K)) if w is not None else None
            # previous_event_before_epilogue gates only the reduce: the push overlaps what it marks.
            pe = a.previous_event_before_epilogue
            wait_event = int(pe.event.cuda_event) if pe is not None and pe.event is not None else 0
            params = self._combine_block(a, T, K, wait_event)
            meta, psum = h.backend_recv_src_metadata, h.psum_num_recv_tokens_per_scaleup_rank
            params.set(x=x, topk_weights=w, src_metadata=meta, psum_rank=psum, combined_topk_idx=topk_idx,
                       combined_x=combined_x, combined_topk_weights=combined_w, bias0=a.bias_0, bias1=a.bias_1,
                       num_x_rows=x.shape[0])
            # The push and the reduce (which ends the operation) are queued by this one call; if it
            # raises, the push may be queued without the reduce.
            stage = EPILOGUE_OWED
            self._rt.combine(params, self._comm_raw, wait_event, compute_raw, compute_raw)
            stage = ALL_QUEUED
            event = None
            if not fast:
                event = self.stream_control_epilogue(
                    [x, w, a.bias_0, a.bias_1, meta, topk_idx, combined_x, combined_w, psum], compute_stream,
                    a.allocate_on_comm_stream, a.async_with_compute_stream)
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too: re-raised after the clean-up
            self._abandon("combine", e, stage, compute_stream, a.allocate_on_comm_stream)
            raise
        return combined_x, combined_w, event

    def _combine_block(self, a: CombineArgs, T: int, K: int, wait_event: int) -> Any:
        """The parameter block of the call's combine (pointers not set yet)."""
        h, ov = a.handle, self.combine_overlap
        return self._combine_block_of(
            num_combined_tokens=T, num_max_tokens_per_rank=h.num_max_tokens_per_rank, hidden=a.x.shape[1],
            num_experts=h.num_experts, num_topk=K, use_expanded_layout=h.do_expand, num_sms=a.num_sms,
            reduce_gated=bool(wait_event), overlap=ov.enabled, push_blocks=ov.push_blocks)

    def _make_combine_block(self, *, reduce_gated: bool, overlap: bool, push_blocks: Optional[int],
                            **shape: Any) -> Any:
        """``_combine_block``'s block, made from its arguments only (``plan_cache``); ``shape`` are the
        plan's fields given per call."""
        push = 0
        # One overlapped kernel unless an event gates the reduce (two kernels then) or in hybrid mode.
        if overlap and not reduce_gated and not self.num_scaleup_ranks:
            push = overlap_push_blocks(OverlapConfig(overlap, push_blocks), self.num_ranks, shape["num_sms"],
                                       shape["num_max_tokens_per_rank"])
        plan = CombinePlan(**shape, allow_multiple_reduction=self.allow_multiple_reduction, overlap_push_blocks=push,
                           test_corrupt=self._test_corrupt if self._test_corrupt == 4 else 0)
        return _C.CombineParams(**plan._asdict())
