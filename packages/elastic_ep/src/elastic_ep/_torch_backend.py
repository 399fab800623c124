"""Pure-torch backend: the low-level ``ElasticBuffer`` interface on ``torch.distributed``.

This module implements the same class interface as the native ``elastic_ep._low_level.ElasticBuffer``
(itself a mirror of DeepEP V2's C++ ``ElasticBuffer``): the constructor, ``dispatch``, ``combine``,
``barrier``, ``destroy``, ``get_comm_stream`` and the domain sizes take the same arguments in the same
order and return the same tuples. It serves two purposes:

* it runs the whole Python API on any process group (gloo on the CPU in CI, NCCL on GPUs without
  the native kernels), and
* it is the independent reference the GPU tests compare the native kernels against.

Algorithm
---------
dispatch
    1. Each token goes once to every rank owning at least one of its top-k experts (expert ``e``
       lives on rank ``e // L``, ``L = num_experts / num_ranks``). Tokens leave in ascending token
       order per destination.
    2. One ``all_to_all_single`` of the per-destination counts, then one of packed byte records
       ``[x | sf | topk_idx (global, int64) | topk_weights | token index]`` (every dtype travels as
       bytes, so FP8 and BF16 work on gloo too).
    3. The receiver keeps the rows grouped by source rank in rank order (the same grouping as the
       native buffer), translates expert ids to local ids (-1 when not local) and, in expand mode,
       scatters one row per (token, local lane) into the expert's segment; segments start at the
       ``expert_alignment``-aligned exclusive prefix sum of the per-expert counts and rows inside
       a segment are in receive order.

combine
    Every received row goes back to its source rank with a *slot*: the sending rank's index when
    ``allow_multiple_reduction`` and ``R <= K``, else the top-k lane (the master lane -- the first
    lane owned by the sender -- for a reduced row). In expand mode with multiple reduction the
    local lanes are first summed in fp32 in lane order and rounded to BF16 once; without it every
    expanded row travels on its own with its lane as slot. The source reduces in DeepEP's order:
    an fp32 accumulator starts at ``bias_0 + bias_1`` (fp32) and adds, lane by lane, the partial
    of the rank whose last lane it is (every row at its own lane without multiple reduction in
    expand mode), then rounds to BF16 once. Weights are not
    multiplied: they are routed back, lane ``k`` taken from the rank that owns expert
    ``topk_idx[t, k]`` (0 for masked lanes).

Differences from the native backend (documented, by design):
    * it always synchronises with the CPU (split sizes are host values), so it cannot be captured in
      a CUDA graph; ``do_cpu_sync=False`` still returns worst-case-sized outputs;
    * it runs on the caller's current stream (after waiting for ``previous_event``); the returned
      event marks the end of that work;
    * the order of rows is deterministic (ascending source token), which is one of the orders the
      native kernels may produce.
"""
from __future__ import annotations

import datetime
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _checks, _sizing
from ._events import EventHandle

__all__ = ["ElasticBuffer", "EventHandle"]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 2-D contiguous tensor viewed as ``[rows, row_bytes]`` uint8."""
    t = t.contiguous()
    row_bytes = t.element_size()
    for d in t.shape[1:]:
        row_bytes *= d
    return t.view(torch.uint8).reshape(t.shape[0], row_bytes)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    return b.contiguous().view(dtype).reshape(b.shape[0], cols)


class ElasticBuffer:
    """Pure-torch implementation of the low-level ``ElasticBuffer`` (see the module docstring).

    Arguments (the seed's order; ``nccl_comm``, ``cpu_comm``, ``sl_idx`` and ``num_allocated_qps`` are
    accepted and ignored):
        rank_idx: this process's rank in ``group``.
        num_ranks: the group size.
        nccl_comm: ignored (the native backend's ``ncclComm_t`` as an int).
        cpu_comm: ignored.
        num_buffer_bytes: the symmetric buffer size the native backend would allocate; dispatch and
            combine check their layout against it exactly as the native backend does.
        num_cpu_buffer_bytes: must be 0 (Engram is out of scope).
        allow_hybrid_mode: accepted; one NVLink domain is always direct mode here.
        allow_multiple_reduction: combine reduces per rank (see the module docstring).
        prefer_overlap_with_compute: accepted, no effect.
        sl_idx, num_allocated_qps: ignored.
        num_cpu_timeout_secs: on CPU (gloo) groups, how long a dispatch/combine waits for its peers before
            raising ``TimeoutError``; on NCCL groups the process group's own timeout applies.
        num_gpu_timeout_secs: kept for API parity.
        explicitly_destroy: when True, ``destroy()`` must be called by the user.
        group: the ``torch.distributed`` process group (keyword only; default: the world group).
    """

    def __init__(self, rank_idx: int, num_ranks: int, nccl_comm: int, cpu_comm, num_buffer_bytes: int,
                 num_cpu_buffer_bytes: int, allow_hybrid_mode: bool, allow_multiple_reduction: bool,
                 prefer_overlap_with_compute: bool, sl_idx: int, num_allocated_qps: int,
                 num_cpu_timeout_secs: int, num_gpu_timeout_secs: int, explicitly_destroy: bool,
                 *, group: Optional[dist.ProcessGroup] = None) -> None:
        align = _sizing.ALIGNMENT_BYTES
        if num_buffer_bytes <= 0 or num_buffer_bytes % align:
            raise ValueError(f"num_buffer_bytes must be a positive multiple of {align}, got {num_buffer_bytes}")
        if num_cpu_buffer_bytes != 0:
            raise ValueError("num_cpu_buffer_bytes must be 0: the CPU segment (Engram) is not supported")
        self.group = group if group is not None else dist.group.WORLD
        if dist.get_rank(self.group) != rank_idx or dist.get_world_size(self.group) != num_ranks:
            raise ValueError(f"rank_idx/num_ranks ({rank_idx}/{num_ranks}) do not match the group "
                             f"({dist.get_rank(self.group)}/{dist.get_world_size(self.group)})")
        self.rank_idx = rank_idx
        self.num_ranks = num_ranks
        self.num_buffer_bytes = num_buffer_bytes
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.num_cpu_timeout_secs = num_cpu_timeout_secs
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        self.explicitly_destroy = explicitly_destroy
        self.destroyed = False
        # Read once, as the native backend does (EP_SKIP_INDEX_CHECK=1: bad ids are masked silently).
        self._check_ids = _checks.index_check_enabled()
        # Test hook: a torch.Generator here makes expand mode place rows inside each expert segment in
        # a random order, as the native kernels' atomics may (exercises the deterministic sort).
        self.shuffle_generator: Optional[torch.Generator] = None
        self._comm_stream = None
        self._device = torch.device("cpu")
        if dist.get_backend(self.group) == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())
            self._comm_stream = torch.cuda.Stream()

    # ------------------------------------------------------------------ lifecycle / info
    def _check_alive(self) -> None:
        if self.destroyed:
            raise RuntimeError("this ElasticBuffer was destroyed; create a new one")

    def destroy(self) -> None:
        """Finish outstanding work on every rank and release the buffer (it cannot be used afterwards)."""
        self._check_alive()
        self.barrier(True, True)
        self.destroyed = True

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The communication stream (a CUDA stream on GPUs, ``None`` on the CPU)."""
        return self._comm_stream

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """``(num_rdma_ranks, num_nvl_ranks)``: one NVLink domain holding every rank."""
        return 1, self.num_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``: always direct mode, ``(1, num_ranks)``."""
        return 1, self.num_ranks

    def barrier(self, use_comm_stream: bool, with_cpu_sync: bool, sequential: bool = True) -> None:
        """Wait until every rank reached this point (and, with ``with_cpu_sync``, finished its GPU work).

        On a gloo group the wait is bounded by ``num_cpu_timeout_secs`` and a rank that never arrives
        makes this raise ``TimeoutError`` naming it (``monitored_barrier``); on NCCL groups the process
        group's own watchdog bounds it.
        """
        self._check_alive()
        if with_cpu_sync and self._device.type == "cuda":
            torch.cuda.synchronize()
        if dist.get_backend(self.group) == "gloo":
            try:
                dist.monitored_barrier(group=self.group,
                                       timeout=datetime.timedelta(seconds=self.num_cpu_timeout_secs))
            except RuntimeError as e:
                raise TimeoutError(f"elastic_ep barrier timed out on rank {self.rank_idx} of {self.num_ranks} after "
                                   f"{self.num_cpu_timeout_secs} s: {e}") from None
        else:
            dist.barrier(group=self.group)
        if with_cpu_sync and self._device.type == "cuda":
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ sizing (static, seed's names)
    get_dispatch_buffer_size = staticmethod(_sizing.get_dispatch_buffer_size)
    get_combine_buffer_size = staticmethod(_sizing.get_combine_buffer_size)

    @staticmethod
    def calculate_buffer_size(nccl_comm, num_max_tokens_per_rank: int, hidden: int, num_topk: int,
                              use_fp8_dispatch: bool, allow_hybrid_mode: bool, allow_multiple_reduction: bool,
                              *, num_ranks: int) -> int:
        """The seed's ``calculate_buffer_size``; the topology comes from ``num_ranks`` (keyword)."""
        return _sizing.calculate_buffer_size(num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                             num_ranks=num_ranks, num_nvl_ranks=num_ranks,
                                             allow_hybrid_mode=allow_hybrid_mode,
                                             allow_multiple_reduction=allow_multiple_reduction)

    # ------------------------------------------------------------------ stream control
    def _prologue(self, previous_event, allocate_on_comm_stream: bool) -> None:
        if previous_event is not None and not allocate_on_comm_stream:
            raise ValueError("previous_event requires allocate_on_comm_stream=True (the seed's rule: the "
                             "overlapped compute was launched first, so outputs must live on the comm stream)")
        if previous_event is not None:
            previous_event.current_stream_wait()

    def _epilogue(self, async_with_compute_stream: bool) -> Optional[EventHandle]:
        return EventHandle() if async_with_compute_stream else None

    def _all_to_all(self, send: torch.Tensor, send_counts: List[int], stage: str,
                    bad_ids: Optional[Tuple[int, int]] = None,
                    num_experts: int = 0) -> Tuple[torch.Tensor, List[int]]:
        """Exchange rows of a uint8 ``[n, B]`` tensor; returns the received rows and per-source counts.

        ``bad_ids``: ``(count, example)`` of this rank's expert ids outside ``[-1, num_experts)``. They
        travel with the counts, so when any rank has some every rank raises the same ``ValueError``
        before the rows move (as the native backend's refusal): nobody is left waiting in the second
        exchange, and the buffer stays usable.

        On CPU groups every wait is bounded by ``num_cpu_timeout_secs``: a rank that never joins makes
        this raise ``TimeoutError`` naming the stage and the rank (the group must then be recreated).
        On NCCL groups the process group's own watchdog bounds the wait.
        """
        dev = self._device
        R = self.num_ranks
        nb, example = bad_ids if bad_ids is not None else (0, 0)
        # [R, 3]: to each destination, (row count, this rank's bad ids, an example of one)
        counts = torch.tensor([[c, nb, example] for c in send_counts], dtype=torch.int64, device=dev)
        recv_counts_t = torch.empty_like(counts)
        self._wait(dist.all_to_all_single(recv_counts_t, counts, group=self.group, async_op=True),
                   f"{stage} (exchanging the per-rank counts)", send_counts)
        got = recv_counts_t.cpu().tolist()
        recv_counts = [int(row[0]) for row in got]
        refused = [r for r in range(R) if got[r][1] > 0]
        if refused:
            note = (f"rank(s) {refused} passed top-k expert ids outside [-1, {num_experts}), so every rank "
                    "refused this dispatch: nothing was sent and the buffer stays usable")
            if nb > 0:
                raise ValueError(f"{_checks.expert_ids_error(nb, example, num_experts)} ({note})")
            raise ValueError(f"dispatch refused: {note}")
        recv = torch.empty((sum(recv_counts), send.shape[1]), dtype=torch.uint8, device=dev)
        self._wait(dist.all_to_all_single(recv, send.contiguous(), recv_counts, list(send_counts), group=self.group,
                                          async_op=True), f"{stage} (exchanging the rows)", recv_counts)
        return recv, recv_counts

    def _wait(self, work, stage: str, counts: List[int]) -> None:
        if self._device.type == "cuda":
            work.wait()
            return
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.num_cpu_timeout_secs))
        except Exception as e:  # noqa: BLE001 - gloo reports an expired wait as RuntimeError
            raise TimeoutError(f"elastic_ep {stage} timed out on rank {self.rank_idx} of {self.num_ranks} after "
                               f"{self.num_cpu_timeout_secs} s (local counts {counts}); a peer did not join. "
                               f"Destroy the process group and the buffer and create new ones. ({e})") from None
        if ok is False:
            raise TimeoutError(f"elastic_ep {stage} timed out on rank {self.rank_idx} of {self.num_ranks} after "
                               f"{self.num_cpu_timeout_secs} s (local counts {counts}); a peer did not join")

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, sf: Optional[torch.Tensor], topk_idx: torch.Tensor,
                 topk_weights: Optional[torch.Tensor],
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor],
                 cached_num_recv_tokens: Optional[int], cached_num_expanded_tokens: Optional[int],
                 cached_num_recv_tokens_per_expert_list: Optional[List[int]],
                 cached_psum_num_recv_tokens_per_scaleup_rank: Optional[torch.Tensor],
                 cached_psum_num_recv_tokens_per_expert: Optional[torch.Tensor],
                 cached_num_unaligned_recv_tokens_per_expert: Optional[torch.Tensor],
                 cached_dst_buffer_slot_idx: Optional[torch.Tensor],
                 cached_token_metadata_at_forward: Optional[torch.Tensor],
                 cached_recv_src_metadata: Optional[torch.Tensor],
                 cached_channel_linked_list: Optional[torch.Tensor],
                 num_max_tokens_per_rank: int, num_experts: int, expert_alignment: int,
                 num_sms: int, num_qps: int,
                 previous_event: Optional[EventHandle], previous_event_before_epilogue: Optional[EventHandle],
                 async_with_compute_stream: bool, allocate_on_comm_stream: bool,
                 do_handle_copy: bool, do_cpu_sync: bool, do_expand: bool, do_zero_padding: bool,
                 use_tma_aligned_col_major_sf: bool) -> tuple:
        """Send each token to the ranks owning its experts (the seed's ``dispatch``).

        Arguments: as the seed's ``ElasticBuffer::dispatch``:
            x: ``[T, H]`` bf16 or float8_e4m3fn rows of this rank.
            sf: ``[T, P]`` float32 or int32 (packed UE8M0x4) scales of FP8 ``x``, any strides; else None.
            topk_idx: ``[T, K]`` int64 global expert ids, -1 for masked lanes.
            topk_weights: ``[T, K]`` float32 or None.
            cumulative_local_expert_recv_stats: ``[L]`` int32, incremented by the real per-expert counts.
            cached_*: the handle of an earlier dispatch (cached mode when ``cached_num_recv_tokens`` is set).
            num_max_tokens_per_rank, num_experts, expert_alignment: routing parameters.
            num_sms, num_qps: accepted (``num_sms`` must be positive), no effect here.
            previous_event, previous_event_before_epilogue, async_with_compute_stream,
            allocate_on_comm_stream: stream control, seed semantics.
            do_handle_copy: return a copy of ``topk_idx`` for the handle.
            do_cpu_sync: exact-size outputs; otherwise worst-case-size outputs.
            do_expand, do_zero_padding, use_tma_aligned_col_major_sf: output layout options.

        Returns:
            The seed's 16-tuple ``(recv_x, recv_sf, recv_topk_idx, recv_topk_weights, copied_topk_idx,
            num_recv_tokens, num_expanded_tokens, num_recv_tokens_per_expert_list,
            psum_num_recv_tokens_per_scaleup_rank, psum_num_recv_tokens_per_expert,
            num_unaligned_recv_tokens_per_expert, recv_src_metadata, dst_buffer_slot_idx,
            token_metadata_at_forward, channel_linked_list, event)``.
        """
        self._check_alive()
        R, me = self.num_ranks, self.rank_idx
        if num_sms <= 0:
            raise ValueError(f"num_sms must be positive, got {num_sms}")
        cached_mode = cached_num_recv_tokens is not None
        _checks.check_dispatch_modes(do_expand, do_zero_padding, do_cpu_sync, _checks.cached_handle_fields(locals()))
        T, H = x.shape
        K = topk_idx.shape[1]
        num_experts, expert_alignment = _checks.check_routing(num_experts, expert_alignment, R,
                                                              num_max_tokens_per_rank, K)
        L = num_experts // R
        if T > num_max_tokens_per_rank:
            raise ValueError(f"x has {T} tokens, more than num_max_tokens_per_rank={num_max_tokens_per_rank}")
        bad_ids = None
        if self._check_ids and not cached_mode and not (topk_idx.is_cuda and torch.cuda.is_current_stream_capturing()):
            bad_ids = _checks.count_bad_expert_ids(topk_idx, num_experts)
        num_sf_packs = sf.shape[1] if sf is not None else 0
        need = _sizing.get_dispatch_buffer_size(num_max_tokens_per_rank, H, num_sf_packs, K, x.element_size(),
                                                1, R, True)
        if need > self.num_buffer_bytes:
            raise ValueError(f"the buffer ({self.num_buffer_bytes} B) is too small for this dispatch ({need} B)")
        self._prologue(previous_event, allocate_on_comm_stream)
        dev = x.device

        # ---- send side: one record per (destination rank, token), ascending token per destination
        # Ids outside [0, E) go nowhere (-1: masked); unless EP_SKIP_INDEX_CHECK=1 they refuse the call below.
        dst_rank = torch.where((topk_idx >= 0) & (topk_idx < num_experts), topk_idx // L,
                               torch.full_like(topk_idx, -1))  # [T, K]
        goes_to = torch.stack([(dst_rank == d).any(dim=1) for d in range(R)], dim=0) if T else \
            torch.zeros((R, 0), dtype=torch.bool, device=dev)  # [R, T]
        token_ids = torch.arange(T, device=dev, dtype=torch.int64)
        parts = [_as_bytes(x)]
        if sf is not None:
            parts.append(_as_bytes(sf.contiguous()))
        parts.append(_as_bytes(topk_idx.to(torch.int64)))
        if topk_weights is not None:
            parts.append(_as_bytes(topk_weights.to(torch.float32)))
        parts.append(_as_bytes(token_ids.view(-1, 1)))
        record = torch.cat(parts, dim=1) if T else torch.empty((0, sum(p.shape[1] for p in parts)),
                                                               dtype=torch.uint8, device=dev)
        order = [token_ids[goes_to[d]] for d in range(R)]
        send_counts = [int(o.numel()) for o in order]
        send = record[torch.cat(order)] if T else record
        # The slot each token takes in each destination's receive buffer (its rank among the tokens
        # this rank sends there); -1 for masked lanes.
        if cached_mode:
            dst_buffer_slot_idx = cached_dst_buffer_slot_idx
        else:
            slot_of = torch.full((R, T), -1, dtype=torch.int32, device=dev)
            for d in range(R):
                slot_of[d, order[d]] = torch.arange(send_counts[d], dtype=torch.int32, device=dev)
            dst_buffer_slot_idx = torch.full((T, K), -1, dtype=torch.int32, device=dev)
            if T:
                valid = dst_rank >= 0
                rows = token_ids.view(-1, 1).expand(T, K)
                dst_buffer_slot_idx[valid] = slot_of[dst_rank[valid], rows[valid]]

        recv, recv_counts = self._all_to_all(send, send_counts, "dispatch", bad_ids, num_experts)
        N = recv.shape[0]

        # ---- unpack
        off = 0
        es = x.element_size()
        recv_rows = _from_bytes(recv[:, off:off + H * es], x.dtype, H); off += H * es
        recv_sf_rows = None
        if sf is not None:
            recv_sf_rows = _from_bytes(recv[:, off:off + num_sf_packs * 4], sf.dtype, num_sf_packs)
            off += num_sf_packs * 4
        recv_gidx = _from_bytes(recv[:, off:off + 8 * K], torch.int64, K); off += 8 * K
        recv_w = None
        if topk_weights is not None:
            recv_w = _from_bytes(recv[:, off:off + 4 * K], torch.float32, K); off += 4 * K
        recv_tok = _from_bytes(recv[:, off:off + 8], torch.int64, 1).view(-1)
        src_rank = torch.repeat_interleave(torch.arange(R, device=dev, dtype=torch.int64),
                                           torch.tensor(recv_counts, device=dev, dtype=torch.int64))

        is_local = (recv_gidx >= me * L) & (recv_gidx < (me + 1) * L)  # [N, K]
        local_idx = torch.where(is_local, recv_gidx - me * L, torch.full_like(recv_gidx, -1))
        real = torch.bincount(local_idx[is_local], minlength=L)[:L] if N else \
            torch.zeros(L, dtype=torch.int64, device=dev)
        aligned = (real + expert_alignment - 1) // expert_alignment * expert_alignment
        starts = torch.cumsum(aligned, 0) - aligned  # exclusive

        # ---- counts and sizes
        psum_rank = torch.cumsum(torch.tensor(recv_counts, dtype=torch.int64, device=dev), 0).to(torch.int32)
        if cached_mode:
            psum_rank = cached_psum_num_recv_tokens_per_scaleup_rank
            psum_expert = cached_psum_num_recv_tokens_per_expert
            unaligned = cached_num_unaligned_recv_tokens_per_expert
            if unaligned is None:
                unaligned = real.to(torch.int32)
            num_recv_tokens = int(cached_num_recv_tokens)
            num_expanded_tokens = int(cached_num_expanded_tokens)
            per_expert_list = list(cached_num_recv_tokens_per_expert_list)
        else:
            unaligned = real.to(torch.int32)
            psum_expert = ((starts + real) if do_expand else torch.cumsum(aligned, 0)).to(torch.int32)
            if do_cpu_sync:
                num_recv_tokens = N
                per_expert_list = [int(v) for v in aligned.cpu().tolist()]
                num_expanded_tokens = sum(per_expert_list)
            else:
                num_recv_tokens = num_max_tokens_per_rank * R
                num_expanded_tokens = _sizing.worst_case_num_expanded_tokens(R, num_max_tokens_per_rank, K, L,
                                                                             expert_alignment)
                per_expert_list = []
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(real.to(cumulative_local_expert_recv_stats.dtype))
        if N > num_recv_tokens:
            raise RuntimeError(f"received {N} tokens but the (cached) handle allows {num_recv_tokens}")

        # ---- expanded positions: (token, lane) pairs grouped by expert, receive order inside a group
        exp_row = torch.full((N, K), -1, dtype=torch.int64, device=dev)
        if cached_mode and do_expand and N:
            # The native kernels take cached expand positions from the handle; so does this backend.
            exp_row = cached_recv_src_metadata[:N, 2:].to(torch.int64)
        elif N:
            pi, pk = torch.nonzero(is_local, as_tuple=True)  # row-major: by token, then lane
            if self.shuffle_generator is not None:
                shuffle = torch.randperm(pi.numel(), generator=self.shuffle_generator).to(dev)
                pi, pk = pi[shuffle], pk[shuffle]
            pe = local_idx[pi, pk]
            perm = torch.sort(pe, stable=True).indices
            pi, pk, pe = pi[perm], pk[perm], pe[perm]
            group_start = torch.cumsum(real, 0) - real
            pos = torch.arange(pi.numel(), device=dev) - group_start[pe]
            exp_row[pi, pk] = starts[pe] + pos

        num_allocated = num_expanded_tokens if do_expand else num_recv_tokens
        if do_expand and N and int(exp_row.max()) >= num_allocated:
            raise RuntimeError("expanded rows exceed the (cached) expanded token count")
        recv_x = torch.empty((num_allocated, H), dtype=x.dtype, device=dev)
        recv_sf = None
        if sf is not None:
            if use_tma_aligned_col_major_sf:
                ld = (num_allocated + 3) // 4 * 4
                recv_sf = torch.empty_strided((num_allocated, num_sf_packs), (1, ld), dtype=sf.dtype, device=dev)
            else:
                recv_sf = torch.empty((num_allocated, num_sf_packs), dtype=sf.dtype, device=dev)
        recv_topk_idx = None
        recv_topk_weights = None
        if do_expand:
            sel = exp_row >= 0
            rows_i = torch.arange(N, device=dev).view(-1, 1).expand(N, K)[sel]
            dst = exp_row[sel]
            recv_x[dst] = recv_rows[rows_i]
            if recv_sf is not None:
                recv_sf[dst] = recv_sf_rows[rows_i]
            if recv_w is not None:
                recv_topk_weights = torch.empty((num_allocated,), dtype=torch.float32, device=dev)
                recv_topk_weights[dst] = recv_w[sel]
            if do_zero_padding:
                seg_end = starts + aligned
                for e in range(L):  # padding rows of each expert segment
                    a0, a1 = int(starts[e] + real[e]), int(seg_end[e])
                    if a1 > a0:
                        recv_x[a0:a1] = 0
                        if recv_sf is not None:
                            recv_sf[a0:a1] = 0
                        if recv_topk_weights is not None:
                            recv_topk_weights[a0:a1] = 0
        else:
            recv_x[:N] = recv_rows
            if recv_sf is not None:
                recv_sf[:N] = recv_sf_rows
            recv_topk_idx = torch.empty((num_allocated, K), dtype=torch.int64, device=dev)
            recv_topk_idx[:N] = local_idx
            if recv_w is not None:
                recv_topk_weights = torch.empty((num_allocated, K), dtype=torch.float32, device=dev)
                recv_topk_weights[:N] = torch.where(is_local, recv_w, torch.zeros_like(recv_w))

        if cached_mode:
            recv_src_metadata = cached_recv_src_metadata
        else:
            recv_src_metadata = torch.empty((num_recv_tokens, K + 2), dtype=torch.int32, device=dev)
            if N:
                master = torch.argmax(is_local.to(torch.int8), dim=1)  # first local lane
                recv_src_metadata[:N, 0] = (src_rank * num_max_tokens_per_rank + recv_tok).to(torch.int32)
                recv_src_metadata[:N, 1] = (src_rank * K + master).to(torch.int32)
                recv_src_metadata[:N, 2:] = exp_row.to(torch.int32) if do_expand else -1

        copied_topk_idx = topk_idx.clone() if (do_handle_copy and not cached_mode) else None
        if previous_event_before_epilogue is not None:
            previous_event_before_epilogue.current_stream_wait()
        event = self._epilogue(async_with_compute_stream)
        return (recv_x, recv_sf, recv_topk_idx, recv_topk_weights, copied_topk_idx,
                num_recv_tokens, num_expanded_tokens, per_expert_list,
                psum_rank, psum_expert, unaligned, recv_src_metadata, dst_buffer_slot_idx,
                None, None, event)

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor],
                bias_0: Optional[torch.Tensor], bias_1: Optional[torch.Tensor],
                src_metadata: torch.Tensor, combined_topk_idx: torch.Tensor,
                psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
                token_metadata_at_forward: Optional[torch.Tensor], channel_linked_list: Optional[torch.Tensor],
                num_experts: int, num_max_tokens_per_rank: int, num_sms: int, num_qps: int,
                previous_event: Optional[EventHandle], previous_event_before_epilogue: Optional[EventHandle],
                async_with_compute_stream: bool, allocate_on_comm_stream: bool,
                use_expanded_layout: bool) -> tuple:
        """Send expert outputs back to their source tokens and reduce them (the seed's ``combine``).

        Arguments: as the seed's ``ElasticBuffer::combine``:
            x: ``[N, H]`` bf16 received rows (``[N_exp, H]`` with ``use_expanded_layout``).
            topk_weights: ``[N, K]`` (``[N_exp]`` expanded) float32 to route back, or None.
            bias_0, bias_1: ``[T, H]`` bf16 added to the result, or None.
            src_metadata: the dispatch handle's ``recv_src_metadata`` ``[N, K+2]`` int32.
            combined_topk_idx: ``[T, K]`` int64, this rank's dispatch ``topk_idx``.
            psum_num_recv_tokens_per_scaleup_rank: ``[R]`` int32 from the dispatch handle.
            token_metadata_at_forward, channel_linked_list: hybrid only (None here).
            num_experts, num_max_tokens_per_rank: as at dispatch.
            num_sms, num_qps: accepted, no effect here.
            previous_event ... allocate_on_comm_stream: stream control, seed semantics.
            use_expanded_layout: ``x`` is the expand-mode output layout.

        Returns:
            ``(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None, event or None)``.
        """
        self._check_alive()
        R, me = self.num_ranks, self.rank_idx
        if x.dtype != torch.bfloat16:
            raise ValueError(f"combine takes bf16 x, got {x.dtype}")
        if num_sms <= 0:
            raise ValueError(f"num_sms must be positive, got {num_sms}")
        T, K = combined_topk_idx.shape
        H = x.shape[1]
        L = num_experts // R
        if T > num_max_tokens_per_rank:
            raise ValueError(f"{T} combined tokens exceed num_max_tokens_per_rank={num_max_tokens_per_rank}")
        need = _sizing.get_combine_buffer_size(num_max_tokens_per_rank, H, K, 1, R, True,
                                               self.allow_multiple_reduction)
        if need > self.num_buffer_bytes:
            raise ValueError(f"the buffer ({self.num_buffer_bytes} B) is too small for this combine ({need} B)")
        self._prologue(previous_event, allocate_on_comm_stream)
        dev = x.device

        psum = psum_num_recv_tokens_per_scaleup_rank.to(torch.int64).cpu().tolist()
        N = int(psum[-1]) if psum else 0
        counts = [psum[0]] + [psum[i] - psum[i - 1] for i in range(1, R)]
        meta = src_metadata[:N].to(torch.int64)
        src_tok = meta[:, 0] % num_max_tokens_per_rank
        master = meta[:, 1] % K
        by_rank_slot = self.allow_multiple_reduction and R <= K

        # Per received token: the row(s) to send back, each with a slot.
        if not use_expanded_layout:
            rows = x[:N]
            slots = torch.full((N,), me, dtype=torch.int64, device=dev) if by_rank_slot else master
            rec_tok = src_tok
            w_vec = topk_weights[:N].to(torch.float32) if topk_weights is not None else None
            rec_counts = counts
        else:
            exp_row = meta[:, 2:]  # [N, K], -1 where not local
            local = exp_row >= 0
            if topk_weights is not None:
                w_all = torch.zeros((N, K), dtype=torch.float32, device=dev)
                w_all[local] = topk_weights[exp_row[local]].to(torch.float32)
            if self.allow_multiple_reduction:
                acc = torch.zeros((N, H), dtype=torch.float32, device=dev)
                for k in range(K):  # lane order
                    sel = local[:, k]
                    if bool(sel.any()):
                        acc[sel] += x[exp_row[sel, k]].to(torch.float32)
                rows = acc.to(torch.bfloat16)
                slots = torch.full((N,), me, dtype=torch.int64, device=dev) if by_rank_slot else master
                rec_tok = src_tok
                w_vec = w_all if topk_weights is not None else None
                rec_counts = counts
            else:
                ti, tk = torch.nonzero(local, as_tuple=True)  # sorted by token then lane: stays in rank blocks
                rows = x[exp_row[ti, tk]]
                slots = tk
                rec_tok = src_tok[ti]
                w_vec = w_all[ti] if topk_weights is not None else None
                per_tok = local.sum(dim=1)
                rec_counts = [int(per_tok[psum[r] - counts[r]:psum[r]].sum()) for r in range(R)]

        parts = [_as_bytes(rows.contiguous()), _as_bytes(torch.stack([rec_tok, slots], 1).to(torch.int64))]
        if w_vec is not None:
            parts.append(_as_bytes(w_vec))
        send = torch.cat(parts, 1)
        recv, recv_counts = self._all_to_all(send, rec_counts, "combine")
        M = recv.shape[0]
        off = 0
        r_rows = _from_bytes(recv[:, :2 * H], torch.bfloat16, H); off = 2 * H
        r_ts = _from_bytes(recv[:, off:off + 16], torch.int64, 2); off += 16
        r_w = _from_bytes(recv[:, off:off + 4 * K], torch.float32, K) if w_vec is not None else None
        sender = torch.repeat_interleave(torch.arange(R, device=dev), torch.tensor(recv_counts, device=dev))

        # DeepEP's summation order (its reference combine): the fp32 accumulator starts from the
        # biases (bias_0 + bias_1 in fp32), then adds one term per top-k lane in lane order: a
        # rank's reduced partial at the LAST lane routed to that rank (every row at its own lane in
        # the per-lane layout), +0.0 at every other lane.
        if bias_0 is not None and bias_1 is not None:
            acc = bias_0.to(torch.float32) + bias_1.to(torch.float32)
        elif bias_0 is not None or bias_1 is not None:
            acc = (bias_0 if bias_0 is not None else bias_1).to(torch.float32).clone()
        else:
            acc = torch.zeros((T, H), dtype=torch.float32, device=dev)
        owner = torch.where((combined_topk_idx >= 0) & (combined_topk_idx < num_experts),
                            combined_topk_idx // L, torch.full_like(combined_topk_idx, -1))  # [T, K]
        if M:
            r_tok, r_slot = r_ts[:, 0], r_ts[:, 1]
            if use_expanded_layout and not self.allow_multiple_reduction:
                r_lane = r_slot
            else:
                take = (owner[r_tok] == sender.view(-1, 1)).to(torch.int8)  # [M, K]
                r_lane = (K - 1) - torch.argmax(take.flip(1), dim=1)
        for k in range(K):
            term = torch.zeros((T, H), dtype=torch.float32, device=dev)
            if M:
                sel = r_lane == k
                if bool(sel.any()):
                    term[r_tok[sel]] = r_rows[sel].to(torch.float32)
            acc += term
        combined_x = acc.to(torch.bfloat16)

        combined_topk_weights = None
        if topk_weights is not None:
            combined_topk_weights = torch.zeros((T, K), dtype=torch.float32, device=dev)
            if M:
                take = owner[r_tok] == sender.view(-1, 1)  # [M, K]
                mi, mk = torch.nonzero(take, as_tuple=True)
                combined_topk_weights[r_tok[mi], mk] = r_w[mi, mk]
        if previous_event_before_epilogue is not None:
            previous_event_before_epilogue.current_stream_wait()
        event = self._epilogue(async_with_compute_stream)
        return combined_x, combined_topk_weights, event
