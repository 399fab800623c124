"""The torch runtime: ``elastic_ep``'s dispatch, combine and barrier on ``torch.distributed`` collectives.

It runs on any process group (gloo on the CPU in CI, NCCL on GPUs without the native kernels) and is
the independent reference the GPU tests compare the native runtime against. AGRS, PP and Engram have
their torch parts in their feature modules (``_agrs``, ``_pp``, ``_engram``), over this runtime's group,
device, ``barrier`` and ``wait_work``.

dispatch
    1. Each token goes once to every rank owning at least one of its top-k experts (expert ``e``
       lives on rank ``e // L``, ``L = num_experts / num_ranks``). Tokens leave in ascending token
       order per destination.
    2. One ``all_to_all_single`` of the per-destination counts, each with the sender's count of expert
       ids outside ``[-1, E)`` and its geometry words (the native runtime's, ``_geometry``): every rank
       refuses the call when any rank has bad ids or another geometry (``ValueError`` naming the lowest
       such rank, the argument and both values; no row moves). A cached dispatch sends the serial number
       of its handle's dispatch too (``_geometry.handle_word``; 0: none), refused alike when the ranks'
       differ. Then
       one of packed byte records ``[x | sf | topk_idx (int64) | topk_weights (zeros when None) |
       token index]`` (every dtype travels as bytes, so FP8 and BF16 work on gloo too).
    3. The receiver keeps the rows grouped by source rank in rank order (the native runtime's
       grouping), translates expert ids to local ids (-1 when not local) and, in expand mode, scatters
       one row per (token, local lane) into the expert's segment; segments start at the
       ``expert_alignment``-aligned exclusive prefix sum of the per-expert counts and rows inside a
       segment are in receive order. A cached expand dispatch places them where the handle's
       ``recv_src_metadata`` points.

combine
    Every received row goes back to its source rank with a *slot*: the sending rank's index when
    ``allow_multiple_reduction`` and ``R <= K``, else the top-k lane (the master lane -- the first
    lane owned by the sender -- for a reduced row). In expand mode with multiple reduction the
    local lanes are first summed in fp32 in lane order and rounded to BF16 once; without it every
    expanded row travels on its own with its lane as slot. The source reduces in DeepEP's order:
    an fp32 accumulator starts at ``bias_0 + bias_1`` (fp32) and adds, lane by lane, the partial
    of the rank whose last lane it is (every row at its own lane without multiple reduction in
    expand mode), then rounds to BF16 once. Weights are not multiplied: they are routed back, lane
    ``k`` taken from the rank that owns expert ``topk_idx[t, k]`` (0 for masked lanes, and from a rank
    that passed none). The counts' exchange carries combine's geometry (the bytes per row of ``x``, the
    handle's ``num_max_tokens_per_rank``, ``num_experts`` and top-k) and the serial number of the handle's
    dispatch, refused as dispatch's: handles of two dispatches of the same shapes (two micro-batches)
    would return rows by another routing than the one they came by. Every rank passing the same older
    handle is fine (a cached handle).

hybrid mode
    With more than one logical scale-out domain (``_domains``) the two exchanges above run as the
    two-hop routing of ``_hybrid`` (over rail peers, then inside the scale-up domain); it delivers
    the same rows in the same order, so everything else here is unchanged and the outputs are bitwise
    direct mode's. The handle also carries the forwarders' metadata.

Differences from the native runtime (by design): it always synchronises with the CPU (split sizes are
host values), so it cannot be captured in a CUDA graph (``do_cpu_sync=False`` still returns worst-case
outputs); it runs on the caller's current stream (after waiting for ``previous_event``), the returned
event marking the end of that work; its row order is ascending source token, one of the orders the
native kernels may produce.
"""
from __future__ import annotations

import collections
import datetime
from typing import Any, Deque, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _C, _checks
from ._env import Settings
from ._events import EventHandle
from ._domains import Domains
from ._handle import EPHandle
from ._hybrid import HybridExchange, as_bytes as _as_bytes, from_bytes as _from_bytes
from ._geometry import GEOMETRY_WORDS, combine_geometry, dispatch_geometry, geometry_error, handle_word
from ._runtime import CombineArgs, DispatchArgs, DispatchResult, Runtime

__all__ = ["TorchRuntime"]

_WORDS = GEOMETRY_WORDS + 1  # a call's geometry words and its handle word (_geometry.HANDLE_WORD)


class TorchRuntime(Runtime):
    """The torch runtime (see the module docstring).

    Arguments:
        group: the ``torch.distributed`` process group.
        allow_multiple_reduction: combine reduces per rank (see the module docstring).
        num_cpu_timeout_secs: on CPU (gloo) groups, how long a dispatch / combine / barrier waits for its
            peers before raising ``TimeoutError``; on NCCL groups the process group's own timeout applies.
        settings: the environment's settings (``ELASTIC_EP_SKIP_INDEX_CHECK``).
        buffer_id: the serial number the handles of this runtime carry.
    """

    backend = "torch"

    def __init__(self, group: dist.ProcessGroup, allow_multiple_reduction: bool, num_cpu_timeout_secs: int,
                 settings: Settings, buffer_id: int = 0, domains: Optional[Domains] = None) -> None:
        self.group = group
        self.rank_idx = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.allow_multiple_reduction = allow_multiple_reduction
        self.num_cpu_timeout_secs = num_cpu_timeout_secs
        self.buffer_id = buffer_id
        # Dispatches entered, the same count on every rank (each enters every dispatch): a handle's
        # dispatch_id, which combine and cached dispatches compare across ranks.
        self._num_dispatches = 0
        self.destroyed = False
        self._check_ids = not settings.skip_index_check  # bad ids refuse the dispatch unless skipped
        # Test hook: a torch.Generator here makes expand mode place rows inside each expert segment in
        # a random order, as the native kernels' atomics may (exercises the deterministic sort).
        self.shuffle_generator: Optional[torch.Generator] = None
        self._gloo = dist.get_backend(group) == "gloo"
        # The last collectives' Work objects. A process-group worker thread drops its reference to a
        # finished collective after wait() returned; when that reference is the last, it frees the
        # collective's tensors and takes the GIL to free their Python objects, which aborts a process
        # that is exiting at that moment ("terminate called without an active exception": torch's race
        # at interpreter shutdown, seen with gloo when a buffer keeps its group alive past
        # destroy_process_group). Holding the Work here makes this thread free them instead. CPU groups
        # only (the hold keeps a call's send buffers until the next calls'; they are small there).
        self._recent_works: Deque[Any] = collections.deque(maxlen=4)
        self._comm_stream = None
        self.device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self._comm_stream = torch.cuda.Stream()
        # Hybrid mode (more than one scale-out domain): the two-hop exchange of _hybrid.
        self.hybrid = HybridExchange(domains, self._all_to_all) if domains is not None and domains.hybrid else None

    # ------------------------------------------------------------------ lifecycle / info
    def destroy(self) -> None:
        """Finishes outstanding work on every rank (collective)."""
        self.barrier(True, True)
        self.destroyed = True

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The communication stream (a CUDA stream on GPUs, ``None`` on the CPU)."""
        return self._comm_stream

    def barrier(self, use_comm_stream: bool, with_cpu_sync: bool, sequential: bool = True) -> None:
        """Waits until every rank reached this point (and, with ``with_cpu_sync``, finished its GPU work).

        On a gloo group the wait is bounded by ``num_cpu_timeout_secs`` and a rank that never arrives
        makes this raise ``TimeoutError`` naming it (``monitored_barrier``); on NCCL groups the process
        group's own watchdog bounds it.
        """
        if with_cpu_sync and self.device.type == "cuda":
            torch.cuda.synchronize()
        if self._gloo:
            try:
                dist.monitored_barrier(group=self.group,
                                       timeout=datetime.timedelta(seconds=self.num_cpu_timeout_secs))
            except RuntimeError as e:
                raise TimeoutError(f"elastic_ep barrier timed out on rank {self.rank_idx} of {self.num_ranks} after "
                                   f"{self.num_cpu_timeout_secs} s: {e}") from None
        else:
            dist.barrier(group=self.group)
        if with_cpu_sync and self.device.type == "cuda":
            torch.cuda.synchronize()

    def wait_work(self, work, what: str) -> None:
        """Waits for an asynchronous collective with the ``num_cpu_timeout_secs`` deadline (gloo); on
        NCCL groups the current stream waits for it (the process group's watchdog bounds it)."""
        if not self._gloo:
            work.wait()
            return
        self._recent_works.append(work)  # see __init__
        try:
            work.wait(datetime.timedelta(seconds=self.num_cpu_timeout_secs))
        except RuntimeError as e:
            raise TimeoutError(f"elastic_ep {what} did not complete on rank {self.rank_idx} of {self.num_ranks} "
                               f"within {self.num_cpu_timeout_secs} s: {e}") from None

    # ------------------------------------------------------------------ exchange
    def _all_to_all(self, send: torch.Tensor, send_counts: List[int], stage: str,
                    bad_ids: Optional[Tuple[int, int]] = None, num_experts: int = 0,
                    geometry: Optional[Tuple[int, ...]] = None) -> Tuple[torch.Tensor, List[int]]:
        """Exchange rows of a uint8 ``[n, B]`` tensor; returns the received rows and per-source counts.

        ``bad_ids``: ``(count, example)`` of this rank's expert ids outside ``[-1, num_experts)``;
        ``geometry``: this call's geometry words (``dispatch_geometry`` / ``combine_geometry``) and its
        handle word (``handle_word``); None: not compared, as every rank's call of ``stage`` passes. Both
        travel with the counts, so when any rank has bad ids or other words every rank raises a
        ``ValueError`` before the rows move
        (as the native backend's refusal): nobody is left waiting in the second exchange, and the buffer
        stays usable.

        On CPU groups every wait is bounded by ``num_cpu_timeout_secs``: a rank that never joins makes
        this raise ``TimeoutError`` naming the stage and the rank (the group must then be recreated).
        On NCCL groups the process group's own watchdog bounds the wait.
        """
        dev = self.device
        R = self.num_ranks
        nb, example = bad_ids if bad_ids is not None else (0, 0)
        words = list(geometry) if geometry is not None else [0] * _WORDS
        # [R, 3 + W]: to each destination, (row count, this rank's bad ids, an example of one, its words)
        counts = torch.tensor([[c, nb, example, *words] for c in send_counts], dtype=torch.int64, device=dev)
        recv_counts_t = torch.empty_like(counts)
        self._wait(dist.all_to_all_single(recv_counts_t, counts, group=self.group, async_op=True),
                   f"{stage} (exchanging the per-rank counts)", send_counts)
        got = recv_counts_t.cpu().tolist()
        if geometry is not None:
            # The lowest rank whose words differ, and its first differing word (the native's choice);
            # every rank sees every rank's words, so all refuse alike.
            for r, row in enumerate(got):
                if row[3:] != words:
                    w = next(i for i in range(_WORDS) if row[3 + i] != words[i])
                    raise geometry_error(stage.split(" ", 1)[0], self.rank_idx, r, w, row[3 + w], words[w])
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
        if self.device.type == "cuda":
            work.wait()
            return
        self._recent_works.append(work)  # see __init__
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
    def _send_records(self, a: DispatchArgs, topk_idx: torch.Tensor,
                      L: int) -> Tuple[torch.Tensor, List[int], torch.Tensor, torch.Tensor]:
        """Dispatch's send side: one record per (destination rank, token), ascending token per destination.

        Returns:
            ``(records [n, B] uint8 grouped by destination, count per destination, the token of each
            record, dst_buffer_slot_idx [T, K])``: the slot each token takes in each destination's receive
            buffer (its rank among the tokens this rank sends there), -1 for masked lanes (cached: the
            handle's).
        """
        R, T, K = self.num_ranks, a.num_tokens, a.num_topk
        x, sf, topk_weights, dev = a.x, a.sf, a.topk_weights, a.x.device
        # Ids outside [0, E) go nowhere (-1: masked); unless ELASTIC_EP_SKIP_INDEX_CHECK=1 they refuse the
        # call (dispatch's first exchange).
        dst_rank = torch.where((topk_idx >= 0) & (topk_idx < a.num_experts), topk_idx // L,
                               torch.full_like(topk_idx, -1))  # [T, K]
        goes_to = torch.stack([(dst_rank == d).any(dim=1) for d in range(R)], dim=0) if T else \
            torch.zeros((R, 0), dtype=torch.bool, device=dev)  # [R, T]
        token_ids = torch.arange(T, device=dev, dtype=torch.int64)
        parts = [_as_bytes(x)]
        if sf is not None:
            parts.append(_as_bytes(sf.contiguous()))
        parts.append(_as_bytes(topk_idx.to(torch.int64)))
        # Weights travel as zeros when this rank has none: a record's bytes then depend on the geometry
        # words only, which every rank compares, and a peer that passed some receives these as zeros.
        parts.append(_as_bytes(topk_weights.to(torch.float32) if topk_weights is not None else
                               torch.zeros((T, K), dtype=torch.float32, device=dev)))
        parts.append(_as_bytes(token_ids.view(-1, 1)))
        record = torch.cat(parts, dim=1) if T else torch.empty((0, sum(p.shape[1] for p in parts)),
                                                               dtype=torch.uint8, device=dev)
        order = [token_ids[goes_to[d]] for d in range(R)]
        send_counts = [int(o.numel()) for o in order]
        sent_tokens = torch.cat(order) if T else token_ids
        send = record[sent_tokens] if T else record
        if a.handle is not None:
            return send, send_counts, sent_tokens, a.handle.dst_buffer_slot_idx
        slot_of = torch.full((R, T), -1, dtype=torch.int32, device=dev)
        for d in range(R):
            slot_of[d, order[d]] = torch.arange(send_counts[d], dtype=torch.int32, device=dev)
        dst_buffer_slot_idx = torch.full((T, K), -1, dtype=torch.int32, device=dev)
        if T:
            valid = dst_rank >= 0
            rows = token_ids.view(-1, 1).expand(T, K)
            dst_buffer_slot_idx[valid] = slot_of[dst_rank[valid], rows[valid]]
        return send, send_counts, sent_tokens, dst_buffer_slot_idx

    def dispatch(self, a: DispatchArgs) -> DispatchResult:
        """Sends each token to the ranks owning its experts (see the module docstring)."""
        R, me = self.num_ranks, self.rank_idx
        h = a.handle
        cached_mode = h is not None
        self._num_dispatches += 1
        x, sf, topk_weights = a.x, a.sf, a.topk_weights
        topk_idx = a.topk_idx.to(torch.int64)  # DeepEP's 32-bit topk_idx_t too
        T, H, K = a.num_tokens, a.hidden, a.num_topk
        num_experts, expert_alignment = a.num_experts, a.expert_alignment
        num_max_tokens_per_rank = a.num_max_tokens_per_rank
        do_expand, do_cpu_sync = a.do_expand, a.do_cpu_sync
        cumulative_local_expert_recv_stats = a.cumulative_local_expert_recv_stats
        L = num_experts // R
        num_sf_packs = sf.shape[1] if sf is not None else 0
        bad_ids = None
        if self._check_ids and not cached_mode and not (topk_idx.is_cuda and torch.cuda.is_current_stream_capturing()):
            bad_ids = _checks.count_bad_expert_ids(topk_idx, num_experts)
        if a.previous_event is not None:
            a.previous_event.current_stream_wait()
        dev = x.device

        send, send_counts, sent_tokens, dst_buffer_slot_idx = self._send_records(a, topk_idx, L)
        forward = (None, None)
        geometry = (*dispatch_geometry(a), handle_word(h))
        if self.hybrid is not None:
            recv, recv_counts, forward = self.hybrid.dispatch(send, send_counts, sent_tokens, T, num_max_tokens_per_rank,
                                                              bad_ids, num_experts, geometry)
        else:
            recv, recv_counts = self._all_to_all(send, send_counts, "dispatch", bad_ids, num_experts, geometry)
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
        recv_w = _from_bytes(recv[:, off:off + 4 * K], torch.float32, K) if topk_weights is not None else None
        off += 4 * K
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
            num_recv_tokens, num_expanded_tokens = h.num_recv_tokens, h.num_expanded_tokens
        else:
            unaligned = real.to(torch.int32)
            psum_expert = ((starts + real) if do_expand else torch.cumsum(aligned, 0)).to(torch.int32)
            if do_cpu_sync:
                num_recv_tokens = N
                per_expert_list = [int(v) for v in aligned.cpu().tolist()]
                num_expanded_tokens = sum(per_expert_list)
            else:
                num_recv_tokens = num_max_tokens_per_rank * R
                num_expanded_tokens = int(_C.worst_case_num_expanded_tokens(R, num_max_tokens_per_rank, K, L,
                                                                            expert_alignment))
                per_expert_list = []
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(real.to(cumulative_local_expert_recv_stats.dtype))
        if N > num_recv_tokens:
            raise RuntimeError(f"received {N} tokens but the (cached) handle allows {num_recv_tokens}")

        # ---- expanded positions: (token, lane) pairs grouped by expert, receive order inside a group
        exp_row = torch.full((N, K), -1, dtype=torch.int64, device=dev)
        if cached_mode and do_expand and N:
            # As the native kernels: where the handle's metadata points (the sorted rows after a
            # deterministic sort, as in DeepEP).
            exp_row = h.recv_src_metadata[:N, 2:].to(torch.int64)
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
        recv_x, recv_sf, recv_topk_idx, recv_topk_weights = _place_received(
            a, num_allocated, recv_rows, recv_sf_rows, recv_w, local_idx, exp_row, starts, aligned, real)

        new_handle = h
        if not cached_mode:
            recv_src_metadata = torch.empty((num_recv_tokens, K + 2), dtype=torch.int32, device=dev)
            if N:
                master = torch.argmax(is_local.to(torch.int8), dim=1)  # first local lane
                recv_src_metadata[:N, 0] = (src_rank * num_max_tokens_per_rank + recv_tok).to(torch.int32)
                recv_src_metadata[:N, 1] = (src_rank * K + master).to(torch.int32)
                recv_src_metadata[:N, 2:] = exp_row.to(torch.int32) if do_expand else -1
            new_handle = EPHandle(do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, a.num_sms,
                                  a.topk_idx.clone() if a.do_handle_copy else a.topk_idx, num_recv_tokens,
                                  num_expanded_tokens, per_expert_list, psum_rank, psum_expert, unaligned,
                                  recv_src_metadata, dst_buffer_slot_idx, *forward, buffer_id=self.buffer_id,
                                  # No window here: zero-copy outputs are plain tensors; the field only marks
                                  # the handle as zero-copy for cached dispatches (as the native one's).
                                  direct_base=torch.zeros(R, dtype=torch.int32, device=dev) if a.zero_copy else None,
                                  dispatch_id=self._num_dispatches)
        if a.previous_event_before_epilogue is not None:
            a.previous_event_before_epilogue.current_stream_wait()
        event = EventHandle() if a.async_with_compute_stream else None
        return DispatchResult(recv_x, recv_sf, recv_topk_idx, recv_topk_weights, new_handle, event)

    # ------------------------------------------------------------------ combine
    def combine(self, a: CombineArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[EventHandle]]:
        """Sends expert outputs back to their source tokens and reduces them (see the module docstring)."""
        R, me = self.num_ranks, self.rank_idx
        h = a.handle
        x, topk_weights, bias_0, bias_1 = a.x, a.topk_weights, a.bias_0, a.bias_1
        combined_topk_idx = h.topk_idx.to(torch.int64)
        psum_num_recv_tokens_per_scaleup_rank = h.psum_num_recv_tokens_per_scaleup_rank
        src_metadata = h.backend_recv_src_metadata
        num_experts, num_max_tokens_per_rank = h.num_experts, h.num_max_tokens_per_rank
        use_expanded_layout = h.do_expand
        previous_event_before_epilogue = a.previous_event_before_epilogue
        async_with_compute_stream = a.async_with_compute_stream
        T, K = combined_topk_idx.shape
        H = x.shape[1]
        L = num_experts // R
        if a.previous_event is not None:
            a.previous_event.current_stream_wait()
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

        # Weights as zeros when this rank has none (see dispatch's records).
        parts = [_as_bytes(rows.contiguous()), _as_bytes(torch.stack([rec_tok, slots], 1).to(torch.int64)),
                 _as_bytes(w_vec if w_vec is not None else torch.zeros((rows.shape[0], K), dtype=torch.float32,
                                                                       device=dev))]
        send = torch.cat(parts, 1)
        geometry = (*combine_geometry(a), handle_word(h))
        if self.hybrid is not None:
            recv, recv_counts = self.hybrid.combine(send, rec_counts, geometry)
        else:
            recv, recv_counts = self._all_to_all(send, rec_counts, "combine", None, 0, geometry)
        M = recv.shape[0]
        off = 0
        r_rows = _from_bytes(recv[:, :2 * H], torch.bfloat16, H); off = 2 * H
        r_ts = _from_bytes(recv[:, off:off + 16], torch.int64, 2); off += 16
        r_w = _from_bytes(recv[:, off:off + 4 * K], torch.float32, K) if topk_weights is not None else None
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
        event = EventHandle() if async_with_compute_stream else None
        return combined_x, combined_topk_weights, event


def _place_received(a: DispatchArgs, num_allocated: int, rows: torch.Tensor, sf_rows: Optional[torch.Tensor],
                    w: Optional[torch.Tensor], local_idx: torch.Tensor, exp_row: torch.Tensor, starts: torch.Tensor,
                    aligned: torch.Tensor, real: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor],
                                                                         Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Dispatch's outputs ``(recv_x, recv_sf, recv_topk_idx, recv_topk_weights)`` of ``num_allocated`` rows
    from the ``N`` received rows: in receive order, or (expand mode) each (row, local lane) at
    ``exp_row``, the alignment gaps zeroed with ``do_zero_padding`` (segments at ``starts``, ``real`` rows
    of ``aligned``)."""
    N, K = local_idx.shape
    H, dev, sf = a.hidden, rows.device, a.sf
    recv_x = torch.empty((num_allocated, H), dtype=a.x.dtype, device=dev)
    recv_sf = None
    if sf is not None:
        num_sf_packs = sf.shape[1]
        if a.use_tma_aligned_col_major_sf:
            ld = (num_allocated + 3) // 4 * 4
            recv_sf = torch.empty_strided((num_allocated, num_sf_packs), (1, ld), dtype=sf.dtype, device=dev)
        else:
            recv_sf = torch.empty((num_allocated, num_sf_packs), dtype=sf.dtype, device=dev)
    recv_topk_idx = None
    recv_topk_weights = None
    if a.do_expand:
        sel = exp_row >= 0
        rows_i = torch.arange(N, device=dev).view(-1, 1).expand(N, K)[sel]
        dst = exp_row[sel]
        recv_x[dst] = rows[rows_i]
        if recv_sf is not None:
            recv_sf[dst] = sf_rows[rows_i]
        if w is not None:
            recv_topk_weights = torch.empty((num_allocated,), dtype=torch.float32, device=dev)
            recv_topk_weights[dst] = w[sel]
        if a.do_zero_padding:
            seg_end = starts + aligned
            for e in range(real.numel()):  # padding rows of each expert segment
                a0, a1 = int(starts[e] + real[e]), int(seg_end[e])
                if a1 > a0:
                    recv_x[a0:a1] = 0
                    if recv_sf is not None:
                        recv_sf[a0:a1] = 0
                    if recv_topk_weights is not None:
                        recv_topk_weights[a0:a1] = 0
    else:
        recv_x[:N] = rows
        if recv_sf is not None:
            recv_sf[:N] = sf_rows
        recv_topk_idx = torch.empty((num_allocated, K), dtype=torch.int64, device=dev)
        recv_topk_idx[:N] = local_idx
        if w is not None:
            recv_topk_weights = torch.empty((num_allocated, K), dtype=torch.float32, device=dev)
            recv_topk_weights[:N] = torch.where(local_idx >= 0, w, torch.zeros_like(w))
    return recv_x, recv_sf, recv_topk_idx, recv_topk_weights
