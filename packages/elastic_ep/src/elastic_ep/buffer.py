"""``ElasticBuffer``: DeepEP V2's ``deep_ep.ElasticBuffer`` API for MoE dispatch/combine in one NVLink domain.

A DeepEP user changes only the import: ``ElasticBuffer(group, num_max_tokens_per_rank=..., hidden=...,
num_topk=...)``, then per MoE layer::

    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buf.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=E)
    y = experts(recv_x, recv_topk_idx)             # rows of this rank's experts
    combined_x, combined_w, event = buf.combine(y, handle)

* ``x``: ``[T, H]`` bf16, or ``(x_fp8 [T, H] float8_e4m3fn, sf [T, P])`` with FP32 scales or int32 packs
  of four UE8M0 exponents; ``topk_idx``: ``[T, K]`` int64 (or int32) global expert ids (-1 = masked);
  ``topk_weights``: ``[T, K]`` float32. Expert ``e`` lives on rank ``e // (E / R)``.
* Non-expand output: one row per received token, grouped by source rank; ``recv_topk_idx`` holds local
  expert ids, -1 where the expert lives elsewhere. Expand output (``do_expand=True``): one row per
  (token, local expert) in per-expert segments starting at multiples of ``expert_alignment``.
* Without CPU sync (``do_cpu_sync=False``, e.g. inside a CUDA graph) outputs have the worst-case row
  count and the real counts stay on the GPU (``handle.psum_num_recv_tokens_per_scaleup_rank[-1]``).
* ``combine`` sums, in fp32 and in DeepEP's order, the biases and the rows each token's expert ranks
  send back, and rounds to bf16 once. It does not apply top-k weights; it routes them back.
* ``deterministic=True`` sorts received rows by source token (inside each expert segment in expand
  mode); ``handle.recv_src_metadata`` then describes the sorted rows, as in DeepEP.

The buffer composes its parts: the constructor's checks and domains (``_setup``), the sizes
(``_sizing``), a runtime for dispatch/combine (``_runtime.Runtime``: ``"native"``, ``_native_runtime``'s
C++/CUDA kernels over an NCCL or CUDA-IPC window, or ``"torch"``, ``_torch_runtime``'s
``torch.distributed`` collectives, gloo included; ``backend="auto"`` picks native for NCCL groups when the
kernels are built), each call validated once by ``_checks``; and one object per DeepEP feature over the
same runtime: AGRS (``_agrs``), PP send/recv (``_pp``) and Engram (``_engram``). Its methods are DeepEP's,
each a thin call into one of them.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _agrs, _checks, _collective, _domains, _engram, _env, _pp, _setup, _sizing
from ._checks import int_arg
from ._domains import get_logical_domain_size, get_physical_domain_size
from ._events import EventHandle, EventOverlap
from ._handle import EPHandle
from ._setup import NcclCommHandle, native_available
from ._sizing import ALIGNMENT_BYTES, calculate_elastic_buffer_size, get_elastic_buffer_alignment

__all__ = ["ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap", "NcclCommHandle", "native_available",
           "calculate_elastic_buffer_size", "get_elastic_buffer_alignment", "get_physical_domain_size",
           "get_logical_domain_size"]

_BUFFER_SERIALS = itertools.count(1)


class ElasticBuffer:
    """Expert-parallel dispatch/combine buffer, API-compatible with DeepEP V2's ``ElasticBuffer``.

    Arguments:
        group: the process group of the expert-parallel ranks (NCCL for GPUs; gloo with the torch backend
            or the IPC window).
        num_bytes: buffer bytes; None sizes it from ``num_max_tokens_per_rank``/``hidden``/``num_topk``.
        num_cpu_bytes: bytes of this rank's CPU (Engram) segment, a multiple of 2 MiB (0: none;
            ``get_engram_storage_size_hint`` sizes it); native: pinned shared host memory every GPU of
            the node reads (one node only).
        num_max_tokens_per_rank: most tokens a rank dispatches at once (required when ``num_bytes`` is None).
        hidden, num_topk (0: sized for 32), use_fp8_dispatch: what the buffer is sized for.
        deterministic: sort received rows by source token (see the module docstring).
        allow_hybrid_mode: hybrid mode (scale-out + scale-up, see the README's "Domains and hybrid mode")
            where the group spans several domains or ``ELASTIC_EP_NUM_SCALEUP_RANKS`` splits it.
        allow_multiple_reduction: combine reduces per rank before sending (fewer bytes, rounding once more).
        prefer_overlap_with_compute: as in DeepEP, changes ``get_theoretical_num_sms`` (at least 64 SMs
            when False), the SM count of calls with ``num_sms=0``.
        sl_idx, num_allocated_qps: RDMA settings: in hybrid mode across NVLink domains the GIN traffic
            class and context count of the device communicator; ``num_allocated_qps`` (0: DeepEP's
            automatic 129 with hybrid mode allowed, else 17) also bounds ``num_qps`` as in DeepEP.
        num_cpu_timeout_secs: how long the host waits (counts, barriers) before raising ``TimeoutError``.
        num_gpu_timeout_secs: how long a kernel waits for a peer before recording a timeout.
        explicitly_destroy: require an explicit ``destroy()`` (else the buffer is freed with the object).
        backend: ``"auto"``, ``"native"`` or ``"torch"`` (keyword only; not in DeepEP).
        window: the native backend's window (keyword only; not in DeepEP): ``"nccl"`` (``"auto"``): an
            NCCL symmetric window, on torch's communicator of ``group`` or a new one; ``"ipc"``:
            cudaMalloc'ed memory shared by CUDA IPC over ``group`` (which may then be gloo), for GPUs
            with CUDA peer access or ranks that share a GPU.

    Raises:
        ValueError: bad arguments; RuntimeError: the native backend was requested but is unavailable.
        The constructor is collective and raises on every rank when any rank's arguments are refused:
        that rank its own error, the others one naming it (``ValueError`` or ``RuntimeError`` as well).
    """

    #: The handles' ``buffer_id``: a serial number the constructor sets (>= 1, never reused in the process,
    #: unlike ``id(self)``). 0 only on an object made without the constructor (as the diagnostic tools do).
    _serial = 0
    #: Dispatches made on this buffer; a zero-copy handle's views are those of dispatch ``views_serial``.
    _dispatch_serial = 0

    def __init__(self, group: dist.ProcessGroup, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True,
                 sl_idx: int = 3, num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300,
                 num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False, *,
                 backend: str = "auto", window: str = "auto") -> None:
        if group is None:
            raise ValueError("group: expected a torch.distributed ProcessGroup, got None")
        _checks.refuse_during_capture("ElasticBuffer")
        self.group = group
        self.rank = self.rank_idx = dist.get_rank(group)  # rank_idx: DeepEP's name
        self.num_ranks = dist.get_world_size(group)
        self._serial = next(_BUFFER_SERIALS)
        self.destroyed = False
        self._owned_comm = 0
        self._comm_finalizer = None
        self.nccl_comm, self.comm_source = 0, None
        # Each rank checks its own arguments, then every rank learns the others' outcome before anything
        # collective: a rank whose arguments are refused must not leave its peers in this constructor's
        # collectives, where its next call would complete them or they would wait for the group's timeout.
        err, o = None, None
        try:
            self._settings = _env.Settings.read()
            o = _setup.check_options(dist.get_backend(group), num_bytes, num_cpu_bytes, num_max_tokens_per_rank,
                                     hidden, num_topk, use_fp8_dispatch, sl_idx, num_allocated_qps,
                                     num_cpu_timeout_secs, num_gpu_timeout_secs, backend, window)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            err = e
        _collective.raise_if_any_rank_failed(group, err, "ElasticBuffer: creating the buffer")
        self.backend, self.window, self.device = o.backend, o.window, o.device
        # The domains (collective: every rank's node), then the size they call for.
        try:
            self.domains, self.num_allocated_qps, gin_request, self.num_bytes = _setup.plan_domains(
                group, o, self._settings.num_scaleup_ranks, use_fp8_dispatch, allow_hybrid_mode,
                allow_multiple_reduction, sl_idx)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            err = e
        _collective.raise_if_any_rank_failed(group, err, "ElasticBuffer: the group's domains")
        self.num_cpu_bytes = o.num_cpu_bytes
        self.num_max_tokens_per_rank, self.hidden, self.num_topk = o.num_max_tokens_per_rank, o.hidden, o.num_topk
        self.use_fp8_dispatch, self.deterministic = use_fp8_dispatch, deterministic
        self.allow_hybrid_mode, self.allow_multiple_reduction = allow_hybrid_mode, allow_multiple_reduction
        self.prefer_overlap_with_compute, self.explicitly_destroy = prefer_overlap_with_compute, explicitly_destroy
        self.num_cpu_timeout_secs, self.num_gpu_timeout_secs = o.num_cpu_timeout_secs, o.num_gpu_timeout_secs
        if self._settings.buffer_debug:  # DeepEP's switch for the same report
            print(f"elastic_ep: rank {self.rank}/{self.num_ranks}: buffer of {self.num_bytes} bytes, "
                  f"backend {self.backend}", flush=True)
        self._device_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                            if self.device.type == "cuda" else 132)
        self._max_sms = self._device_sms if self.backend == "native" else None
        self._sms_cache: Dict[Tuple[int, int], int] = {}
        self._routing_cache: Dict[tuple, Tuple[int, int]] = {}
        self._need_cache: Dict[tuple, int] = {}
        self._combine_need_cache: Dict[tuple, int] = {}
        self._open_runtime(gin_request)
        # DeepEP's features over the same runtime and window (Engram opens its host segments: collective).
        rt, b = self.runtime, self.backend
        self._agrs = _agrs.AllGatherSessions(rt, b, group, self.num_bytes, self.device)
        self._pp = _pp.PipelineSendRecv(rt, b, group, self.num_bytes, self.device)
        self._engram = _engram.Engram(rt, b, group, self.num_bytes, self.num_cpu_bytes, self.num_allocated_qps, self.device)
        self.nccl_comm_handle = NcclCommHandle(self.nccl_comm)
        # DeepEP's logical and physical rank indices.
        d = self.domains
        self.num_scaleout_ranks, self.num_scaleup_ranks = d.logical
        self.scaleout_rank_idx, self.scaleup_rank_idx = d.scaleout_rank_idx, d.scaleup_rank_idx
        self.num_rdma_ranks, self.num_nvlink_ranks = d.physical
        dist.barrier(group=group)

    def _open_runtime(self, gin_request: Optional[Dict[str, Any]]) -> None:
        """Collective: ``self.runtime`` of the chosen backend (native: its window and communicator)."""
        if self.backend == "torch":
            from ._torch_runtime import TorchRuntime

            self.runtime = TorchRuntime(self.group, self.allow_multiple_reduction, self.num_cpu_timeout_secs,
                                        self._settings, self._serial, self.domains)
            return
        native = _setup.load_native()[0]
        self.runtime, self.nccl_comm, self._owned_comm, self.comm_source = native.NativeRuntime.create(
            self.group, self.num_bytes, self.allow_multiple_reduction, self.num_cpu_timeout_secs,
            self.num_gpu_timeout_secs, self.explicitly_destroy, self.window, self._settings, self._serial,
            num_scaleup_ranks=self.domains.num_scaleup_ranks if self.domains.hybrid else 0, gin=gin_request)
        if self._owned_comm and not self.explicitly_destroy:
            # Freed with the object, as promised: the runtime's window, then the communicator under it
            # (never at interpreter exit: peers may be gone by then, and the exit releases both).
            self._comm_finalizer = weakref.finalize(self, _setup.release_native, self.runtime, self._owned_comm)
            self._comm_finalizer.atexit = False

    # ------------------------------------------------------------------ sizing
    get_buffer_size_hint = staticmethod(_sizing.get_buffer_size_hint)
    # DeepEP's per-feature hints, each with its feature.
    get_engram_storage_size_hint = staticmethod(_engram.get_engram_storage_size_hint)
    get_pp_buffer_size_hint = staticmethod(_pp.get_pp_buffer_size_hint)
    get_agrs_num_max_session_bytes = staticmethod(_agrs.get_agrs_num_max_session_bytes)
    get_agrs_buffer_size_hint = staticmethod(_agrs.get_agrs_buffer_size_hint)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """SMs that keep the bottleneck link busy for a balanced gate (DeepEP's bandwidth model); what
        ``dispatch`` / ``combine`` use for ``num_sms=0``, leaving the other SMs to overlapped compute.

        The model (``_domains.theoretical_num_sms``): direct mode is bound by NVLink; hybrid mode by the
        slower of the network (a token crosses it once per remote domain) and NVLink (the forwarders'
        fan-out). The count is that need plus 25 %, even, at least 4, at least 64 when
        ``prefer_overlap_with_compute`` is False, at most the device's SMs (all of them at EP 1).
        ``ELASTIC_EP_NUM_SMS`` overrides it.

        Arguments:
            num_experts: all experts (a multiple of the rank count); num_topk: experts per token.
            num_scaleout_topk: hybrid mode: domains a token reaches (a node-limited gate's limit, e.g.
                DeepSeek-V3's 4); 0: the balanced gate's expectation. Must be 0 in direct mode.
            rdma_gbs: scale-out GB/s per GPU; 0: NVLink's on the NVLink-emulated scale-out, else
                ``_domains.NIC_GBS`` (one 400 Gb/s NIC per GPU at 90 %).
            nvlink_gbs: NVLink GB/s per direction; 0: from NVML (active links x speed x 0.9, as DeepEP
                reads ``nvidia-smi``), 450 where NVML cannot tell.
            sm_read_gbs, sm_write_gbs: what one SM reads from HBM / writes to a peer, GB/s.

        Raises:
            ValueError: a bad argument (naming it).
        """
        return _sizing.theoretical_num_sms(self, num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs,
                                           sm_read_gbs, sm_write_gbs)

    def _sms_for(self, num_experts: int, num_topk: int) -> int:
        """The SM count of a call with ``num_sms=0`` (cached per shape)."""
        key = (num_experts, num_topk)
        n = self._sms_cache.get(key)
        if n is None:
            n = self._sms_cache[key] = self.get_theoretical_num_sms(num_experts, min(num_topk, num_experts))
        return n

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """RDMA queue pairs for ``num_sms`` SMs as DeepEP computes them (what a GIN backend opens):
        ``16 * num_sms + 1`` with hybrid mode allowed, else ``min(num_sms, 9)``; at most ``num_allocated_qps``."""
        return _domains.theoretical_num_qps(self.allow_hybrid_mode, int_arg("num_sms", num_sms, 0),
                                            self.num_allocated_qps)

    # ------------------------------------------------------------------ info / lifecycle
    def _check_alive(self) -> None:
        if self.destroyed:
            raise RuntimeError("this ElasticBuffer was destroyed; create a new one")

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The stream the communication kernels run on (None for the torch backend on a CPU group)."""
        self._check_alive()
        return self.runtime.get_comm_stream()

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``: NVLink domains and ranks per domain (``_domains``)."""
        return self.domains.physical

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``: ``(1, R)`` in direct mode; hybrid mode with several
        NVLink domains, or with ``ELASTIC_EP_NUM_SCALEUP_RANKS`` (``_domains``)."""
        return self.domains.logical

    @staticmethod
    def capture() -> EventHandle:
        """An ``EventHandle`` recorded on the current stream (for ``previous_event`` arguments), as DeepEP's."""
        return EventHandle()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """A barrier of all ranks on the GPU (on the comm stream by default; ``with_cpu_sync``: the device
        is synchronised before and after, a full CPU barrier; ``sequential``: DeepEP's flag, accepted)."""
        self._check_alive()
        self.runtime.barrier(use_comm_stream, with_cpu_sync, sequential)

    def destroy(self) -> None:
        """Finishes all work on every rank and releases the buffer (collective). A second call does
        nothing. Unlike DeepEP it does not require ``explicitly_destroy=True``."""
        if self.destroyed:
            return
        self.destroyed = True
        first = None  # every step runs whatever an earlier one raised; the first error is raised after
        try:  # Engram's host segments go before the runtime's window
            for step in (lambda: self._agrs.flush("destroy"), lambda: self._pp.flush("destroy"), self._engram.close,
                         self.runtime.destroy):
                try:
                    step()
                except Exception as e:  # noqa: BLE001 - raised below, after the other steps
                    first = first or e
        finally:
            self._abort_owned_comm()
        if first is not None:
            raise first

    def _abort_owned_comm(self) -> None:
        """Aborts the communicator this buffer made for itself (local, never blocks), once."""
        if self._comm_finalizer is not None:
            self._comm_finalizer.detach()
            self._comm_finalizer = None
        comm, self._owned_comm = self._owned_comm, 0
        if comm:
            from . import _nccl  # noqa: WPS433 (loaded with the native runtime)

            _nccl.destroy_nccl_comm(comm)

    def __enter__(self) -> "ElasticBuffer":
        self._check_alive()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.destroyed:
            self.destroy()

    # ------------------------------------------------------------------ dispatch / combine
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: Union[None, EventHandle, EventOverlap] = None,
                 previous_event_before_epilogue: Union[None, EventHandle, EventOverlap] = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True,
                 do_cpu_sync: Optional[bool] = None, do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False, zero_copy: bool = False):
        """Send every token to the ranks that own its top-k experts.

        Arguments:
            x: ``[T, H]`` bf16, or ``(x [T, H] float8_e4m3fn, sf [T, P] float32 | int32)``.
            topk_idx: ``[T, K]`` int64 (or int32) global expert ids, -1 masked. None in cached mode.
            topk_weights: ``[T, K]`` float32, or None.
            cumulative_local_expert_recv_stats: ``[E / R]`` int32, incremented by the received counts.
            num_experts: total experts E (divisible by the rank count); from ``handle`` in cached mode.
            num_max_tokens_per_rank: the most tokens any rank sends in this call (default: the
                buffer's); a larger value is accepted while the buffer is big enough for it.
            expert_alignment: per-expert row alignment (default 1; from ``handle`` in cached mode).
            num_sms: SMs for the kernels (0: ``get_theoretical_num_sms``, as DeepEP, or
                ``ELASTIC_EP_NUM_SMS``); kept in the handle for ``combine``.
            num_qps: RDMA queue pairs: no effect, but more than ``num_allocated_qps`` raises (as DeepEP).
            previous_event: start only after this event, an ``EventHandle`` (``capture()``) or an
                ``EventOverlap`` (needs ``allocate_on_comm_stream=True``).
            previous_event_before_epilogue: the copy epilogue waits for this event (the same types).
            async_with_compute_stream: return an event instead of making the current stream wait.
            allocate_on_comm_stream: allocate outputs on the communication stream.
            handle: an earlier dispatch's handle: cached mode (same routing, no counting).
            do_handle_copy: keep a copy of ``topk_idx`` in the handle.
            do_cpu_sync: exact-size outputs after the CPU waits for the counts; default: True unless
                cached or capturing a CUDA graph (where True raises ``ValueError``).
            do_expand: one row per (token, local expert), segments aligned to ``expert_alignment``.
            do_zero_padding: zero the alignment gaps (expand mode only).
            use_tma_aligned_col_major_sf: return ``recv_sf`` column-major with rows padded to 4.
            zero_copy: return ``recv_x`` as a view of this buffer's receive area, which the senders
                wrote in place (no copy epilogue for the hidden bytes; ours, not DeepEP's). Non-expanded
                layout only; the buffer needs ``get_buffer_size_hint(..., zero_copy=True)`` bytes. The
                view is valid until the next ``dispatch`` on this buffer (a ``combine`` keeps it) and
                until the buffer is destroyed; ``combine`` or a cached dispatch given the handle after a
                later dispatch raises ``ValueError``. Clone ``recv_x`` to keep it longer. The torch
                reference runtime returns a plain tensor under the same rules.

        Returns:
            ``(recv_x | (recv_x, recv_sf), recv_topk_idx, recv_topk_weights, handle, event)``.

        Raises:
            ValueError: any bad input, before anything is launched, except expert ids outside
                ``[-1, num_experts)``, which only the GPU reads: with a CPU sync the dispatch is refused
                on every rank before any token moves (the buffer stays usable); without one they are
                treated as masked and the next call on this buffer raises, on this rank only (in a
                multi-rank job the peers' next operation then times out and the buffer must be
                recreated on every rank; ``ELASTIC_EP_SKIP_INDEX_CHECK=1``: masked silently).
            CommError: the buffer is unusable (an earlier operation timed out or was interrupted
                between its kernels); destroy it and create a new one.
        """
        self._check_alive()
        a = _checks.dispatch_args(self, x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                                  num_max_tokens_per_rank, expert_alignment, num_sms, num_qps, previous_event,
                                  previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream,
                                  handle, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding,
                                  use_tma_aligned_col_major_sf, zero_copy)
        self._dispatch_serial += 1  # before the call: a dispatch that raised may have written the area too
        recv_x, recv_sf, recv_topk_idx, recv_w, h, event = self.runtime.dispatch(a)
        h.views_serial = self._dispatch_serial if a.zero_copy else 0
        overlap = EventOverlap(event)
        if self.deterministic:
            cached = a.handle is not None

            def sort() -> None:
                # On the current stream, after it waited for the communication: the tensors returned
                # are the sorted ones.
                h.deterministic_sort(a.do_cpu_sync, cached, recv_x, recv_sf, recv_topk_idx, recv_w, None)

            if async_with_compute_stream and event is not None:
                # As DeepEP: the sort runs when the caller waits on the event (the outputs may not be read
                # before that anyway), so the communication still overlaps the caller's compute.
                overlap.register_hook_after_wait(sort)
            else:
                if event is not None:
                    event.current_stream_wait()
                sort()
        return (recv_x, recv_sf) if recv_sf is not None else recv_x, recv_topk_idx, recv_w, h, overlap

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Sequence[Optional[torch.Tensor]]] = None,
                num_sms: int = 0, num_qps: int = 0,
                previous_event: Optional[EventOverlap] = None,
                previous_event_before_epilogue: Optional[EventOverlap] = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """Return each received row to its source token and sum them (the reverse of ``dispatch``).

        Arguments:
            x: ``[N, H]`` bf16 expert outputs in the layout ``dispatch`` returned (``[N_exp, H]`` if expanded).
            handle: the ``EPHandle`` of that dispatch.
            topk_weights: ``[N, K]`` (``[N_exp]`` expanded) float32 to route back, or None.
            bias: None, one ``[T, H]`` bf16 tensor, or a pair (either may be None), added in fp32.
            num_sms (0: the dispatch's), num_qps, previous_event, previous_event_before_epilogue,
            async_with_compute_stream, allocate_on_comm_stream: as ``dispatch``.

        Returns:
            ``(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None, EventOverlap)``.

        Raises:
            ValueError: any bad input, before anything is launched.
        """
        self._check_alive()
        a = _checks.combine_args(self, x, handle, topk_weights, bias, num_sms, num_qps, previous_event,
                                 previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream)
        perm = handle.perm
        if perm is not None:  # deterministic mode: back to the runtime's row order
            # The scatter runs on the current stream. With previous_event the communication stream waits
            # for that event only, so the scatter comes after it and a new event, after the scatter, takes
            # its place (found at EP 2: the comm stream read half-scattered weights).
            if a.previous_event is not None:
                a.previous_event.current_stream_wait()
            raw = torch.empty_like(a.x)
            raw[perm] = a.x
            a.x = raw
            if a.topk_weights is not None:
                raw_w = torch.empty_like(a.topk_weights)
                raw_w[perm] = a.topk_weights
                a.topk_weights = raw_w
            if a.previous_event is not None:
                a.previous_event = self.capture()
        combined_x, combined_w, event = self.runtime.combine(a)
        return combined_x, combined_w, EventOverlap(event)

    # ------------------------------------------------------------------ Engram (_engram)
    def engram_write(self, storage: torch.Tensor, sf: Optional[torch.Tensor] = None) -> None:
        """Installs this rank's shard of the Engram table in its CPU segment (collective, as DeepEP).

        Rank ``r``'s ``storage`` holds global entries ``[r * num_entries, (r + 1) * num_entries)``.

        Arguments:
            storage: ``[num_entries, hidden]`` bf16, or float8_e4m3fn with ``sf``; at most ``num_cpu_bytes``;
                the same shape and dtype on every rank.
            sf: FP8 only: ``[num_entries * R, num_sf_packs]`` float32 or int32 (four UE8M0 exponents)
                scale factors of every global entry, the same on every rank.

        Raises:
            ValueError: bad arguments on any rank, or shards that differ between ranks (every rank raises).
        """
        self._check_alive()
        self._engram.write(storage, sf)

    def engram_fetch(self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False):
        """Gathers table rows by global entry index from whichever rank holds them (local: no peer takes part).

        Arguments:
            indices: ``[T, E]`` int32 global entry indices, each in ``[0, num_entries * R)``.
            num_qps: accepted (no RDMA); more than ``num_allocated_qps`` raises, as DeepEP.
            use_tma_aligned_col_major_sf: FP8: scale factors column-major, rows padded to 4.

        Returns:
            A hook; its call returns ``(data [T, E * hidden], sf [T, E * num_sf_packs] or None)``: token
            ``t``'s entries concatenated along the hidden dimension.

        Raises:
            ValueError: no table, bad ``indices`` (any index outside the table: DeepEP reads those unchecked).
        """
        self._check_alive()
        return self._engram.fetch(indices, num_qps, use_tma_aligned_col_major_sf)

    # ------------------------------------------------------------------ PP send/recv (_pp)
    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Sizes pipeline send/recv (collective; flushes earlier work on every rank, as DeepEP).

        Arguments:
            num_max_tensor_bytes: the largest tensor sent (rounded up to 32).
            num_max_inflight_tensors: tensors sent to one peer and not yet received there; a further
                ``pp_send`` to that peer waits (with the CPU timeout) until the peer received one (native:
                at most ``8192 // num_ranks``).
            DeepEP V2's four regions of ``num_max_inflight_tensors x num_max_tensor_bytes`` must fit
            ``num_bytes`` (``get_pp_buffer_size_hint``).

        Raises:
            ValueError: a bad value, or other values than another rank's, on any rank; a peer refused a
                tensor this rank sent since the last call (another dtype, numel or shape than its
                ``pp_recv``'s): every rank raises, nothing changed.
        """
        self._check_alive()
        self._pp.set_config(num_max_tensor_bytes, num_max_inflight_tensors)

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """Sends ``t`` to rank ``dst_rank_idx`` (any other rank; DeepEP V2 allows the previous and next
        rank only). Tensors sent to one rank arrive in the order sent; ``t`` may be reused on return.

        Arguments:
            t: a contiguous tensor of at most ``num_max_tensor_bytes``; the receiver passes a tensor of
                the same dtype and shape (checked: see Raises).
            dst_rank_idx: the receiving rank.
            num_sms: SMs the native kernel copies with (0: one per 256 KiB, at most 32); the torch
                backend uses none.

        Raises:
            ValueError: not configured, a bad tensor, this rank or no rank as ``dst_rank_idx``; at the next
                ``pp_set_config``, when the receiver refused a tensor of another dtype or shape.
            TimeoutError: (torch backend) ``num_max_inflight_tensors`` sent to that rank stay unreceived
                past the CPU timeout. The native backend waits on the GPU, in stream order: a slot that
                stays taken past ``num_gpu_timeout_secs`` makes the next call raise ``CommTimeoutError``
                naming ``pp_send``, this rank and the peer.
        """
        self._check_alive()
        self._pp.send(t, dst_rank_idx, num_sms)

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """Receives into ``t`` the oldest tensor rank ``src_rank_idx`` sent to this rank and this rank has
        not received yet (``t`` holds it on return, in stream order). Arguments as ``pp_send``.

        Raises:
            ValueError: as ``pp_send``; the sender's tensor has another dtype, numel or shape than ``t``
                (named; ``t`` unchanged, that tensor dropped; native: raised by the next call); TimeoutError
                (torch backend): nothing arrives within
                ``num_cpu_timeout_secs``; native: the next call raises ``CommTimeoutError`` naming
                ``pp_recv``, this rank and the peer when nothing arrived within ``num_gpu_timeout_secs``.
        """
        self._check_alive()
        self._pp.recv(t, src_rank_idx, num_sms)

    # ------------------------------------------------------------------ AGRS (all-gather sessions, _agrs)
    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        """Sizes AGRS sessions (collective; flushes earlier work on every rank, as DeepEP).

        Arguments:
            num_max_session_bytes: most bytes of gathered results per session (``get_agrs_num_max_session_bytes``
                computes it), at most the buffer's ``num_bytes``; rounded up to 32.
            num_max_all_gathers_per_session: most ``all_gather`` calls per session, 1..32.

        Raises:
            ValueError: a bad value, or inside a session, on any rank (every rank raises).
        """
        self._check_alive()
        self._agrs.set_config(num_max_session_bytes, num_max_all_gathers_per_session)

    def create_agrs_session(self) -> None:
        """Starts an AGRS session (local, no communication). Raises ``ValueError`` inside a session."""
        self._check_alive()
        self._agrs.create_session()

    def destroy_agrs_session(self) -> None:
        """Ends the AGRS session: its gathers complete before the region is reused (their results stay
        readable until the next session's gathers overwrite them). Raises ``ValueError`` outside one."""
        self._check_alive()
        self._agrs.destroy_session()

    @contextlib.contextmanager
    def agrs_new_session(self, enabled: bool = True):
        """``create_agrs_session`` on entry and ``destroy_agrs_session`` on exit (also on an exception);
        ``enabled=False``: a no-op, as DeepEP's."""
        if not enabled:
            yield
            return
        self.create_agrs_session()
        try:
            yield
        finally:
            self.destroy_agrs_session()

    def agrs_get_inplace_tensor(self, shapes, dtype: torch.dtype):
        """Views of this rank's part of the next all-gather(s) of this session, for a producer to write in
        place: ``all_gather`` of these tensors (same order, as the next call) copies nothing locally.

        Arguments:
            shapes: one shape, or a sequence of shapes (one per tensor of the next ``all_gather``).
            dtype: any torch dtype.

        Returns:
            One tensor for one shape, a tuple for a sequence (contents undefined until written).

        Raises:
            ValueError: not configured, outside a session, the session's bytes or gathers exhausted, bad shapes.
        """
        self._check_alive()
        return self._agrs.inplace_tensors(shapes, dtype)

    def all_gather(self, t):
        """Gathers a tensor (or several) from every rank into the session region (collective).

        Arguments:
            t: a contiguous tensor of any dtype on the buffer's device, or a non-empty sequence of them;
                every rank passes the same shapes and dtypes in the same order (checked: see Raises).
                Shapes may differ from one call to the next.

        Returns:
            ``(gathered, wait)`` for a tensor, ``(*gathered, wait)`` for a sequence: ``gathered`` is
            ``[R, *t.shape]`` (row ``r`` is rank ``r``'s tensor), a view of the session region to read
            after ``wait()``; ``wait`` must be called inside the same session.

        Raises:
            ValueError: not configured, outside a session, over the session's bytes or gathers, a
                non-contiguous / other-device tensor, or a tensor inside the region that is not this
                rank's part of this gather; on every rank, when the ranks' tensors differ (named; torch: at
                once, nothing moved; native: at each rank's next call, the session to be ended).
        """
        self._check_alive()
        return self._agrs.all_gather(t)
