"""DeepEP V1's low-latency methods of ``Buffer`` (``low_latency_mode=True``), over ``_low_latency``.

``Buffer`` derives from ``LowLatencyAPI``, which holds this feature's public methods with DeepEP V1's
names, arguments, defaults and return tuples; the algorithm, the layouts and the backends are in
``_low_latency`` (front and native part) and ``_low_latency_torch`` (the reference).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import torch

from ._events import EventOverlap
from ._low_latency import LowLatency, low_latency_size_hint

__all__ = ["LowLatencyAPI"]

_NOT_ON = ("low-latency mode is off for this Buffer: create it with low_latency_mode=True and num_rdma_bytes from "
           "Buffer.get_low_latency_rdma_size_hint(...)")
_NO_SHRINK = "the rank mask is shrink mode's: create the Buffer with low_latency_mode=True and enable_shrink=True"


class LowLatencyAPI:
    """DeepEP V1's low-latency API (a base of ``Buffer``; ``self._ll`` is the buffer's ``LowLatency``, None
    when ``low_latency_mode`` is off)."""

    _ll: Optional[LowLatency]
    enable_shrink: bool

    def _low_latency(self, shrink: bool = False) -> LowLatency:
        if self._ll is None:
            raise RuntimeError(_NOT_ON if getattr(self, "runtime", None) is not None
                               else "this Buffer was destroyed; create a new one")
        if shrink and not self.enable_shrink:
            raise RuntimeError(_NO_SHRINK)
        return self._ll

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes ``num_rdma_bytes`` should have for low-latency calls of this shape (DeepEP V1's).

        Arguments:
            num_max_dispatch_tokens_per_rank: the most tokens a rank dispatches in one call (same on every rank).
            hidden: the hidden size; num_ranks: ranks in the group; num_experts: experts in all.

        Returns:
            Two halves (two calls in flight), each holding the receive areas of a call of any top-k up to
            32, sized with BF16 rows, 2 MiB-aligned.

        Raises:
            ValueError: a size out of range, or ``num_experts`` not a multiple of ``num_ranks``.
        """
        return low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Resets the low-latency counters on every rank (collective; DeepEP V1's). Not needed between normal
        and low-latency calls (the signals live apart from the data). It puts the ranks' call counts back
        in step when they drifted without an error (e.g. a receive hook that was never called); after a
        timeout or a protocol error the buffer is unusable and must be destroyed and recreated on every rank.

        Raises:
            ValueError: a shape that does not fit the buffer; RuntimeError: low-latency mode is off.
        """
        self._low_latency().clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor, Tuple, EventOverlap, Callable]:
        """Sends each token to the ranks of its top-k experts, into the per-expert layout masked grouped GEMMs
        take (DeepEP V1's; no CPU sync, fixed shapes, CUDA-graph capturable).

        Arguments:
            x: ``[num_tokens, hidden]`` bf16, ``num_tokens <= num_max_dispatch_tokens_per_rank``, hidden a
                multiple of 128.
            topk_idx: ``[num_tokens, num_topk]`` int64 (int32 accepted) global expert ids, -1 for none; top-k <= 32.
            num_max_dispatch_tokens_per_rank: the same on every rank; num_experts: a multiple of the ranks.
            cumulative_local_expert_recv_stats: optional ``[num_local_experts]`` int32, += rows received.
            dispatch_wait_recv_cost_stats: optional ``[num_ranks]`` int64, += ns waited for each source rank
                (DeepEP V1 counts clock cycles).
            use_fp8: cast to E4M3 with one f32 scale per 128 channels; round_scale: scales rounded up to powers
                of two; use_ue8m0: the scales as exponent bytes, 4 per int32 (needs round_scale, hidden % 512 == 0).
            async_finish: run on the communication stream and return an event instead of making the current
                stream wait; return_recv_hook: run only the send now, on the current stream, and return the
                receive as a hook (at most one of the two).

        Returns:
            ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` ``[L, R * M, hidden]`` (FP8: a tuple with
            the scales ``[L, R * M, hidden / 128]`` f32, column-major; UE8M0: ``[L, R * M, hidden / 512]``
            int32), each local expert's ``recv_count[l]`` rows first, by source rank, each rank's in token
            order; ``handle = (src_info, layout_range, M, hidden, num_experts)``; ``hook`` a no-op without
            ``return_recv_hook``. At most two results may be held at a time (two halves), as DeepEP V1.

        Raises:
            ValueError: a bad argument, before anything runs; RuntimeError: low-latency mode is off;
            CommTimeoutError / CommError at the next call after a device deadline or a peer's bad word.
        """
        return self._low_latency().dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                            cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                            use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None) -> \
            Tuple[torch.Tensor, EventOverlap, Callable]:
        """Sends the expert outputs back and sums each token's lanes with its weights (DeepEP V1's).

        Arguments:
            x: ``[L, R * M, hidden]`` bf16 expert outputs in ``low_latency_dispatch``'s layout.
            topk_idx, topk_weights: ``[num_tokens, num_topk]`` the dispatch's ids (-1: none) and f32 weights.
            handle: what ``low_latency_dispatch`` returned.
            use_logfmt: must be False (DeepEP V1's LogFMT format is not offered).
            zero_copy: read the outputs from ``get_next_low_latency_combine_buffer(handle)`` instead of ``x``.
            async_finish, return_recv_hook: as ``low_latency_dispatch``.
            out: optional ``[num_tokens, hidden]`` bf16 written in place and returned.
            combine_wait_recv_cost_stats: optional ``[num_ranks]`` int64, += ns waited for each rank.

        Returns:
            ``(combined_x, event, hook)``: ``combined_x[t] = sum_k topk_weights[t, k] * row(t, k)`` over the
            lanes in order in fp32, rounded to bf16 once.

        Raises:
            ValueError: a bad argument or a handle of another buffer; NotImplementedError: ``use_logfmt``.
        """
        return self._low_latency().combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                           return_recv_hook, out, combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle: Any) -> torch.Tensor:
        """The ``[L, R * M, hidden]`` bf16 buffer the next ``low_latency_combine(..., zero_copy=True)`` reads
        (DeepEP V1's): write the expert outputs there to skip a copy.

        Raises:
            ValueError: a handle of another buffer; RuntimeError: low-latency mode is off.
        """
        return self._low_latency().next_combine_buffer(handle)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Shrink mode: masks (``mask=True``) or unmasks a rank on this rank: its tokens are neither sent
        nor waited for (DeepEP V1's). A rank that misses the deadline in shrink mode is masked by itself.

        Raises:
            ValueError: a rank outside the group; RuntimeError: shrink mode is off.
        """
        self._low_latency(shrink=True).update_mask(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Shrink mode: writes the mask (1 = masked) into ``mask_status``, ``[num_ranks]`` int32 (DeepEP V1's).

        Raises:
            ValueError: a bad ``mask_status``; RuntimeError: shrink mode is off.
        """
        self._low_latency(shrink=True).query_mask(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Shrink mode: unmasks every rank on this rank (DeepEP V1's).

        Raises:
            RuntimeError: shrink mode is off.
        """
        self._low_latency(shrink=True).clean_mask()
