"""The native runtime: elastic_ep's C++/CUDA kernels (``elastic_ep._C``), the Python mirror of DeepEP V2's
C++ ``ElasticBuffer`` (every rank in one NVLink domain: direct mode, and hybrid mode over logical domains).

The window ``[workspace | buffer]`` is an NCCL symmetric window (``ncclMemAlloc`` +
``ncclCommWindowRegister``; peers' addresses from the device communicator) or, with ``window="ipc"``,
``cudaMalloc`` memory whose CUDA IPC handles the ranks exchange. Signals in the workspace carry an
operation epoch kept on the device, so nothing is re-zeroed between operations and every operation
is CUDA-graph capturable.

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

The runtime takes validated arguments (``DispatchArgs`` / ``CombineArgs``, see ``_checks``); per shape it
keeps the kernels' parameter blocks (``_C.DispatchParams`` ...) and passes each call's tensors as
pointers. Launch one process per GPU; every rank calls every operation in the same order.
"""
from __future__ import annotations

import collections.abc
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _C, _env
from ._checks import c_ints, expert_ids_error, raise_if_any_rank_failed
from ._events import EventHandle
from ._handle import EPHandle
from ._native_agrs_pp import NativeAgrsPp
from ._native_engram import NativeEngram
from ._nccl import (all_ok, check_nccl_version, comm_arg, create_nccl_comm, destroy_nccl_comm,  # noqa: F401
                    get_local_nccl_unique_id, get_logical_domain_size, get_physical_domain_size, nccl_version,
                    need_cuda, new_nccl_comm, railed_gin_type, torch_nccl_comm)  # noqa: F401 (buffer.py)
from ._runtime import CombineArgs, DispatchArgs, DispatchResult, Runtime
from ._torch_hybrid import forward_metadata

__all__ = ["NativeRuntime", "OverlapConfig", "topk_idx_t", "get_local_nccl_unique_id", "create_nccl_comm",
           "destroy_nccl_comm", "get_elastic_buffer_alignment", "get_physical_domain_size", "get_logical_domain_size",
           "nccl_version", "check_nccl_version", "CommError", "CommTimeoutError"]

#: dtype of top-k expert indices (DeepEP's ``topk_idx_t``); int32 is accepted too (cast once per call).
topk_idx_t = torch.int64
CommError = _C.CommError
CommTimeoutError = _C.CommTimeoutError
_SF_PACK_ALIGN = int(_C.NUM_ALIGNED_SF_PACKS)
_NO_STREAM = -1  # the runtime's "no stream" (0 is a real one: the legacy default stream, torch's default)
# How far a dispatch / combine got when it raised (see NativeRuntime._abandon): nothing queued on the
# device yet; the first kernels possibly queued without the one that ends the operation; all queued.
_NOTHING_QUEUED, _EPILOGUE_OWED, _ALL_QUEUED = 0, 1, 2
_MAX_PLANS = 256  # parameter blocks kept per runtime and kind (shapes seen; cleared when full)


def get_elastic_buffer_alignment() -> int:
    """The alignment of buffer sizes in bytes (2 MiB)."""
    return int(_C.get_elastic_buffer_alignment())


# ---------------------------------------------------------------------------------------------- helpers
def _timeout_error(info: Any, what: str) -> Exception:
    """A CommTimeoutError built in Python from a device timeout record (``_C.TimeoutInfo``)."""
    err = CommTimeoutError(f"{info.operation} timed out: expected {info.expected}, observed {info.observed} "
                           f"[rank {info.rank}, peer {info.peer}] after {info.waited_ms} ms without progress "
                           f"(GPU block {info.channel}); {what}")
    err.operation, err.rank, err.peer, err.expected, err.observed = (info.operation, info.rank, info.peer,
                                                                    info.expected, info.observed)
    err.where = "elastic_ep"
    return err


def _stream_wait(dst: torch.cuda.Stream, src: Any) -> None:
    if isinstance(src, EventHandle):
        if src.event is not None:
            dst.wait_event(src.event)
    else:
        dst.wait_stream(src)


def _current_raw_stream(device: int) -> int:
    """The current stream's ``cudaStream_t`` (without building a Stream object: a few microseconds)."""
    return torch._C._cuda_getCurrentRawStream(device)


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


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


class _DeviceMemory:
    """Device bytes torch can wrap without owning them (``__cuda_array_interface__``, version 2)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2,
                                         "strides": None}


class OverlapConfig:
    """Whether an operation runs overlapped, and how many blocks push (see ``_overlap_push_blocks``).

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


def _overlap_push_blocks(cfg: OverlapConfig, num_ranks: int, num_sms: int, num_max_tokens_per_rank: int) -> int:
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


# ---------------------------------------------------------------------------------------------- runtime
class NativeRuntime(NativeAgrsPp, NativeEngram, Runtime):
    """The native runtime; its constructor takes DeepEP V2's C++ ``ElasticBuffer`` arguments, in order.

    Arguments:
        rank_idx, num_ranks: this rank and the rank count (all in one NVLink domain).
        nccl_comm: ``ncclComm_t`` as an int (``create_nccl_comm`` or torch's); ignored with ``window="ipc"``.
        cpu_comm, num_cpu_buffer_bytes, allow_hybrid_mode, prefer_overlap_with_compute, sl_idx,
        num_allocated_qps: DeepEP's; no effect here (no CPU segment or RDMA; hybrid mode follows the
            buffer's domains, ``num_scaleup_ranks``).
        num_buffer_bytes: buffer bytes, a positive multiple of 2 MiB.
        allow_multiple_reduction: combine reduces per rank when R <= K.
        num_cpu_timeout_secs: the host's waits (dispatch CPU sync); num_gpu_timeout_secs: device waits
            without progress (0: none).
        explicitly_destroy: if False, ``destroy()`` runs when the object is garbage-collected.
        window: "nccl" (an NCCL symmetric window) or "ipc" (usable after every rank called ``sync`` with
            every rank's ``get_local_ipc_handle()``, then a process-group barrier).
        settings: the environment's settings (``_env.Settings``; default: read now).
        buffer_id: the serial number the handles of this runtime carry (``ElasticBuffer``'s).
        num_scaleup_ranks: hybrid mode's ranks per logical scale-out domain (a proper divisor of
            ``num_ranks``; 0: direct mode). Fixed for the runtime's life.
        gin: hybrid mode across NVLink domains: the GIN device-communicator request
            (``_domains.gin_requirements``); the scale-out transport is then NCCL GIN (NCCL window only),
            else the NVLink emulation.

    ``dispatch_pdl`` (``ELASTIC_EP_DISPATCH_PDL``; may be changed between calls): the dispatch push is
    launched as notify's programmatic dependent and runs beside notify's count exchange.
    """

    backend = "native"
    dispatch_pdl: bool = True
    #: Hybrid mode: ranks per logical scale-out domain (the constructor's); 0: direct mode.
    num_scaleup_ranks: int = 0
    #: Hybrid mode's scale-out transport: "gin", "nvlink-emulated", or None in direct mode.
    scaleout_transport: Optional[str] = None
    _drop_scaleout_signals: int = 0  # ELASTIC_EP_TEST_DROP_SCALEOUT_SIGNALS (tests)

    def __init__(self, rank_idx: int, num_ranks: int, nccl_comm: int, cpu_comm: Any = None,
                 num_buffer_bytes: int = 0, num_cpu_buffer_bytes: int = 0, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False, *, window: str = "nccl",
                 settings: Optional[_env.Settings] = None, buffer_id: int = 0, num_scaleup_ranks: int = 0,
                 gin: Optional[Dict[str, Any]] = None) -> None:
        if window not in ("nccl", "ipc"):
            raise ValueError(f"window must be 'nccl' or 'ipc', got {window!r}")
        self._destroyed = False
        self._rt = None
        need_cuda("ElasticBuffer")
        settings = settings if settings is not None else _env.Settings.read()
        self.rank_idx, self.num_ranks, self.num_buffer_bytes = rank_idx, num_ranks, num_buffer_bytes
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.num_cpu_timeout_secs, self.num_gpu_timeout_secs = num_cpu_timeout_secs, num_gpu_timeout_secs
        self.buffer_id = buffer_id
        self.device = torch.cuda.current_device()
        self.window = window
        opts = _C.RuntimeOptions()
        opts.host_wait_yield_us, opts.debug = settings.host_wait_yield_us, settings.buffer_debug
        opts.num_scaleup_ranks = num_scaleup_ranks
        if gin is not None:
            opts.set_gin(contexts=gin["ginContextCount"], signals=gin["ginSignalCount"],
                         queue_depth=gin["ginQueueDepth"], traffic_class=gin["ginTrafficClass"],
                         connection=gin["ginConnectionType"], exclusive=gin["ginExclusiveContexts"])
        if window == "ipc":
            self._rt = _C.Runtime.create_ipc(rank_idx, num_ranks, num_buffer_bytes, num_cpu_timeout_secs,
                                             num_gpu_timeout_secs, opts)
        else:
            self._rt = _C.Runtime(rank_idx, num_ranks, comm_arg(nccl_comm), num_buffer_bytes, num_cpu_timeout_secs,
                                  num_gpu_timeout_secs, opts)
        self.num_device_sms = int(self._rt.num_device_sms)
        self.num_scaleup_ranks = int(self._rt.num_scaleup_ranks)
        self.scaleout_transport = "gin" if gin is not None else ("nvlink-emulated" if self.num_scaleup_ranks else None)
        self.dispatch_overlap = OverlapConfig(settings.dispatch_overlap, settings.dispatch_push_blocks)
        self.combine_overlap = OverlapConfig(settings.combine_overlap, settings.combine_push_blocks)
        self.dispatch_pdl = settings.dispatch_pdl
        self._refuse_bad_ids = not settings.skip_index_check
        self._notify_atomics = int(settings.test_notify_atomics)
        self._drop_scaleout_signals = int(settings.test_drop_scaleout_signals)
        self._plans: dict = {}
        self._buffer_u8: Optional[torch.Tensor] = None
        self._pp_slot_bytes = self._pp_inflight = 0  # pp_set_config
        self.comm_stream = torch.cuda.Stream(device=self.device)
        self._comm_raw = int(self.comm_stream.cuda_stream)
        # The caller runs a process-group barrier next (DeepEP's does too): no peer may write into this
        # window before every rank finished creating it.

    @classmethod
    def create(cls, group: dist.ProcessGroup, num_buffer_bytes: int, allow_multiple_reduction: bool,
               num_cpu_timeout_secs: int, num_gpu_timeout_secs: int, explicitly_destroy: bool, window: str,
               settings: _env.Settings, buffer_id: int, num_scaleup_ranks: int = 0,
               gin: Optional[Dict[str, Any]] = None) -> Tuple["NativeRuntime", int, int, str]:
        """A runtime over ``group`` (collective; every rank takes the same path): on a CUDA-IPC window
        (handles exchanged over ``group``), or on torch's NCCL communicator when that works on every rank
        (``EP_REUSE_NCCL_COMM`` not 0), else on a communicator of its own (unique-id exchange).
        ``num_scaleup_ranks`` and ``gin``: the constructor's (hybrid mode).

        Returns:
            ``(runtime, nccl_comm or 0, the communicator the caller must abort when done or 0, how the
            communicator was found)``.
        """
        rank, R = dist.get_rank(group), dist.get_world_size(group)
        kw = dict(num_buffer_bytes=num_buffer_bytes, allow_multiple_reduction=allow_multiple_reduction,
                  num_cpu_timeout_secs=num_cpu_timeout_secs, num_gpu_timeout_secs=num_gpu_timeout_secs,
                  explicitly_destroy=explicitly_destroy, settings=settings, buffer_id=buffer_id,
                  num_scaleup_ranks=num_scaleup_ranks, gin=gin)
        if window == "ipc":
            rt = cls(rank, R, 0, window="ipc", **kw)
            handles: List[Any] = [None] * R
            dist.all_gather_object(handles, rt.get_local_ipc_handle(), group=group)
            err = None
            try:
                rt.sync(handles)  # the caller's barrier follows: nobody writes before all are open
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                err = e
            raise_if_any_rank_failed(group, err, "window='ipc': opening the peers' windows", cleanup=rt.destroy)
            return rt, 0, 0, "ipc"
        dist.barrier(group=group)  # torch creates its communicator lazily; make sure it exists
        comm = torch_nccl_comm(group) if settings.reuse_nccl_comm else 0
        err = None
        if all_ok(group, comm != 0):
            rt = None
            try:
                rt = cls(rank, R, comm, **kw)
            except Exception as e:  # noqa: BLE001 - e.g. a non-blocking or non-symmetric communicator
                err = e
            if all_ok(group, rt is not None):
                return rt, comm, 0, "torch"
            if rt is not None:
                rt.destroy()
        comm = new_nccl_comm(group)
        try:
            rt = cls(rank, R, comm, **kw)
        except BaseException:
            destroy_nccl_comm(comm)
            raise
        return rt, comm, comm, "own" if err is None else f"own (torch's communicator failed: {err})"

    # ------------------------------------------------------------------ CUDA-IPC window
    def get_local_ipc_handle(self) -> bytes:
        """This rank's CUDA IPC handle of its window (``window="ipc"`` only), for the other ranks."""
        if self.window != "ipc":
            raise RuntimeError("get_local_ipc_handle: this buffer's window is NCCL's (window='nccl')")
        if self._destroyed:
            raise RuntimeError("this ElasticBuffer was destroyed")
        return self._rt.ipc_handle()

    def sync(self, ipc_handles: List[bytes]) -> None:
        """Opens every rank's window (``window="ipc"`` only); ``ipc_handles``: ``get_local_ipc_handle()``
        of every rank, in rank order. Run a process-group barrier afterwards, before the first operation."""
        if self.window != "ipc":
            raise RuntimeError("sync: this buffer's window is NCCL's (window='nccl'); nothing to open")
        if self._destroyed:
            raise RuntimeError("this ElasticBuffer was destroyed")
        if isinstance(ipc_handles, (bytes, bytearray, str)) or not isinstance(ipc_handles, collections.abc.Iterable):
            raise ValueError(f"ipc_handles: expected a list of {self.num_ranks} bytes objects (one per rank, in rank "
                             f"order), got {type(ipc_handles).__name__}")
        handles = list(ipc_handles)
        if len(handles) != self.num_ranks or not all(isinstance(h, bytes) for h in handles):
            raise ValueError(f"ipc_handles: expected {self.num_ranks} bytes objects (one per rank, in rank order), "
                             f"got {[type(h).__name__ for h in handles]}")
        self._rt.open_ipc_peers(handles)

    # ------------------------------------------------------------------ life and health
    def destroy(self) -> None:
        """Waits for all local work, then frees the window, device communicator and host workspace.
        Collective: every rank must call it. Calling it twice raises."""
        if self._destroyed:
            raise RuntimeError("ElasticBuffer.destroy() was already called")
        torch.cuda.synchronize(self.device)
        self._destroyed = True
        self._buffer_u8 = None  # zero-copy views of the window dangle from here (documented)
        self._close_engram()
        if self._rt is not None:
            self._rt.destroy()

    def __del__(self) -> None:
        try:
            if not self.explicitly_destroy and not self._destroyed and self._rt is not None:
                self._destroyed = True
                self._rt.destroy()
        except Exception:  # noqa: BLE001 - nothing may escape a finaliser
            pass

    def _alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this ElasticBuffer was destroyed")
        if self._rt.pending_health() == 0:  # one native call in the common case
            return
        # Device timeouts are raised here, from Python, as data the runtime reports (a C++ exception
        # crossing into Python once crashed the process on the GPU machine).
        info = self._rt.take_timeout()
        if info is not None:
            raise _timeout_error(info, "the CUDA context is usable but this buffer's signals are out of step: "
                                       "destroy it and create a new one")
        if self._rt.broken:
            raise CommError(f"this elastic buffer is unusable ({self._rt.broken_reason}); destroy it and create "
                            "a new one")
        # Taken even when they are not reported, so that pending_health() is 0 again (the cheap path).
        num_bad, example = self._rt.take_masked_ids()
        if num_bad and self._refuse_bad_ids:  # ELASTIC_EP_SKIP_INDEX_CHECK=1: masked silently, as documented
            raise ValueError(self._masked_ids_message(num_bad, example))

    def _masked_ids_message(self, num_bad: int, example: int) -> str:
        msg = (f"topk_idx: an earlier dispatch without CPU sync had {num_bad} expert ids outside [-1, num_experts) "
               f"(e.g. {example}); notify treated them as masked (-1) and this call was refused before launching "
               "anything.")
        if self.num_ranks == 1:
            return msg + " The buffer is still usable; the routing is wrong."
        return (msg + f" This is a multi-rank job ({self.num_ranks} ranks) and only this rank knows: the other "
                "ranks' next operation on this buffer waits for this rank on the GPU and times out after "
                "num_gpu_timeout_secs unless this rank joins it, and the buffer must then be destroyed and "
                "recreated on every rank. Dispatch with do_cpu_sync=True (the default) to have every rank refuse "
                "such ids consistently, the buffer staying usable, or set ELASTIC_EP_SKIP_INDEX_CHECK=1 to mask "
                "them silently.")

    def _refused_error(self, num_experts: int) -> ValueError:
        """The ValueError of a CPU-synced dispatch that notify refused on every rank (bad expert ids)."""
        ranks, num_bad, example = self._rt.take_refusal()
        note = (f"rank(s) {ranks} passed top-k expert ids outside [-1, {num_experts}), so every rank refused "
                "this dispatch: nothing was sent and the buffer stays usable")
        if self.rank_idx in ranks:
            if num_bad > 0:
                return ValueError(f"{expert_ids_error(num_bad, example, num_experts)} ({note})")
            return ValueError(f"topk_idx: expert ids must be in [-1, {num_experts}) ({note})")
        return ValueError(f"dispatch refused: {note}")

    def _cpu_timeout(self, what: str, detail: str, expected: int, observed: int) -> Exception:
        err = CommTimeoutError(f"elastic_ep {what} timed out after {self.num_cpu_timeout_secs} s "
                               f"[rank {self.rank_idx}]: {detail}")
        err.operation, err.rank, err.peer = f"elastic_ep {what}", self.rank_idx, -1
        err.expected, err.observed = expected, observed
        return err

    def _abandon(self, op: str, err: BaseException, stage: int, compute_stream: Optional[torch.cuda.Stream],
                 allocate_on_comm_stream: bool) -> None:
        """Clean-up of a dispatch / combine that raises ``err`` (which the caller re-raises).

        * ``stage == _EPILOGUE_OWED``: the first kernels may be queued without the one that ends the
          operation (the copy epilogue, the reduce): this rank's device epoch stays behind its peers',
          so unless the runtime already knows (timeouts mark it broken themselves) the buffer is marked
          broken and later calls raise through ``_alive()``;
        * any kernel queued: the caller's stream waits for the communication stream, as after a call
          that succeeds (the kernels end at the latest at the GPU deadline);
        * always: the caller's stream is current again.
        """
        # Each step on its own: a step that fails must neither skip the others nor replace `err`.
        # Inside a CUDA-graph capture nothing ran (the queued kernels exist only in the abandoned graph,
        # which must not be replayed): every epoch and signal is unchanged, so the buffer is fine.
        try:
            capturing = torch.cuda.is_current_stream_capturing()
        except Exception:  # noqa: BLE001 - see above
            capturing = False
        try:
            if stage == _EPILOGUE_OWED and not capturing and not self._rt.broken:
                self._rt.mark_broken(
                    f"elastic_ep {op} stopped after its first kernels were queued, by {type(err).__name__}: {err}; "
                    "this rank's signals are out of step with its peers' (their next operation times out "
                    "waiting for it), so every rank must recreate the buffer")
        except Exception:  # noqa: BLE001 - see above
            pass
        try:
            if stage != _NOTHING_QUEUED:
                waiter = compute_stream if compute_stream is not None else torch.cuda.current_stream(self.device)
                waiter.wait_stream(self.comm_stream)
        except Exception:  # noqa: BLE001 - see above
            pass
        if allocate_on_comm_stream and compute_stream is not None:
            torch.cuda.set_stream(compute_stream)

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The communication stream every kernel of this runtime runs on."""
        return self.comm_stream

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """``(num_rdma_ranks, num_nvl_ranks)`` = ``(1, num_ranks)`` in direct mode."""
        return 1, self.num_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)`` = ``(1, num_ranks)`` in direct mode."""
        return 1, self.num_ranks

    def check_healthy(self) -> None:
        """Raises CommTimeoutError if a device wait of an earlier operation expired, or CommError if the
        runtime is unusable."""
        self._alive()

    # ------------------------------------------------------------------ sizing (DeepEP's C++ statics)
    @staticmethod
    def get_dispatch_buffer_size(num_max_tokens_per_rank: int, hidden: int, num_sf_packs: int, num_topk: int,
                                 elem_size: int, num_scaleout_ranks: int, num_scaleup_ranks: int,
                                 is_scaleup_nvlink: bool) -> int:
        """DeepEP's ``get_dispatch_buffer_size`` (bytes, not aligned), computed by ``_C``."""
        sizes = c_ints(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_sf_packs=num_sf_packs,
                       num_topk=num_topk, elem_size=elem_size, num_scaleout_ranks=num_scaleout_ranks,
                       num_scaleup_ranks=num_scaleup_ranks)
        return int(_C.get_dispatch_buffer_size(*sizes, bool(is_scaleup_nvlink)))

    @staticmethod
    def get_combine_buffer_size(num_max_tokens_per_rank: int, hidden: int, num_topk: int, num_scaleout_ranks: int,
                                num_scaleup_ranks: int, is_scaleup_nvlink: bool, allow_multiple_reduction: bool) -> int:
        """DeepEP's ``get_combine_buffer_size`` (bytes, not aligned), computed by ``_C``."""
        sizes = c_ints(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk,
                       num_scaleout_ranks=num_scaleout_ranks, num_scaleup_ranks=num_scaleup_ranks)
        return int(_C.get_combine_buffer_size(*sizes, bool(is_scaleup_nvlink), bool(allow_multiple_reduction)))

    @staticmethod
    def calculate_buffer_size(nccl_comm: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int,
                              use_fp8_dispatch: bool, allow_hybrid_mode: bool, allow_multiple_reduction: bool) -> int:
        """DeepEP's ``calculate_buffer_size``: 2 MiB-aligned; ``nccl_comm`` gives the domain, or is a rank
        count (at most ``_C.MAX_RANKS``) when no communicator exists yet."""
        M, H, K = c_ints(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk)
        nccl_comm = comm_arg(nccl_comm)
        if 0 < nccl_comm <= int(_C.MAX_RANKS):
            scaleout, scaleup = 1, nccl_comm
        else:
            scaleout, scaleup = get_logical_domain_size(nccl_comm, allow_hybrid_mode)
        return int(_C.calculate_buffer_size_for_domain(M, H, K, bool(use_fp8_dispatch), scaleout, scaleup, True,
                                                       bool(allow_multiple_reduction)))

    # ------------------------------------------------------------------ stream control
    def stream_control_prologue(self, previous_event: Optional[EventHandle],
                                allocate_on_comm_stream: bool) -> torch.cuda.Stream:
        """Makes the communication stream wait for ``previous_event`` (or the compute stream) and, with
        ``allocate_on_comm_stream``, makes it current. Returns the compute stream."""
        compute_stream = torch.cuda.current_stream()
        _stream_wait(self.comm_stream, previous_event if previous_event is not None else compute_stream)
        # Last: the caller (also on its error paths) makes the returned stream current again.
        if allocate_on_comm_stream:
            torch.cuda.set_stream(self.comm_stream)
        return compute_stream

    def stream_control_epilogue(self, tensors: Sequence[Optional[torch.Tensor]], compute_stream: torch.cuda.Stream,
                                allocate_on_comm_stream: bool, async_with_compute_stream: bool
                                ) -> Optional[EventHandle]:
        """Either makes the compute stream wait for the communication stream, or (async) returns an event
        and records the tensors on both streams. Restores the compute stream as current."""
        event = None
        if async_with_compute_stream:
            event = EventHandle(self.comm_stream)
            if _env.avoid_record_stream():
                event.tensors_to_record = [t for t in tensors if t is not None]
            else:
                for t in tensors:
                    if t is not None:
                        t.record_stream(compute_stream)
                        t.record_stream(self.comm_stream)
        else:
            compute_stream.wait_stream(self.comm_stream)
        if allocate_on_comm_stream:
            torch.cuda.set_stream(compute_stream)
        return event

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """An NVLink barrier of all ranks (collective), on the communication or the current stream;
        ``with_cpu_sync`` synchronises the device before and after (and raises device timeouts)."""
        self._alive()
        compute_stream = torch.cuda.current_stream()
        stream = self.comm_stream if use_comm_stream else compute_stream
        if use_comm_stream:
            self.comm_stream.wait_stream(compute_stream)
        if with_cpu_sync:
            torch.cuda.synchronize(self.device)
        self._rt.barrier(int(stream.cuda_stream))
        if with_cpu_sync:
            torch.cuda.synchronize(self.device)
            self._alive()
        if use_comm_stream:
            compute_stream.wait_stream(self.comm_stream)

    def _buffer_bytes(self) -> torch.Tensor:
        """The buffer (after the workspace) as a uint8 tensor that does not own it: zero-copy outputs are
        slices of it, valid while the window lives (``destroy`` frees it)."""
        t = self._buffer_u8
        if t is None:
            t = self._buffer_u8 = torch.as_tensor(_DeviceMemory(int(self._rt.buffer_ptr), self.num_buffer_bytes),
                                                  device=torch.device("cuda", self.device))
        return t

    # ------------------------------------------------------------------ parameter blocks
    def _plan(self, key: tuple, make: Any) -> Any:
        p = self._plans.get(key)
        if p is None:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            p = self._plans[key] = make(*key[1:])
        return p

    def _notify_params(self, T: int, M: int, hidden_bytes: int, packs: int, sf_ts: int, sf_hs: int, E: int, K: int,
                       A: int, cached: bool, num_sms: int, refuse: bool, overlap: bool, concurrent: bool,
                       zero_copy_x_offset: int) -> Any:
        p = _C.DispatchParams()
        p.num_tokens, p.num_max_tokens_per_rank, p.hidden_bytes, p.num_sf_packs = T, M, hidden_bytes, packs
        p.sf_token_stride, p.sf_hidden_stride, p.num_experts, p.num_topk, p.expert_alignment = sf_ts, sf_hs, E, K, A
        p.cached, p.num_sms, p.refuse_bad_ids, p.overlap = int(cached), num_sms, int(refuse), int(overlap)
        p.concurrent_notify, p.notify_atomic_masks = int(concurrent), self._notify_atomics
        p.zero_copy, p.zero_copy_x_offset = int(zero_copy_x_offset >= 0), max(zero_copy_x_offset, 0)
        p.test_drop_scaleout_signals = self._drop_scaleout_signals
        return p

    def _epilogue_params(self, M: int, hidden_bytes: int, packs: int, sf_ts: int, sf_hs: int, E: int, K: int, A: int,
                         do_expand: bool, cached: bool, zero_padding: bool, num_sms: int, overlap: bool,
                         zero_copy: bool) -> Any:
        p = _C.EpilogueParams()
        p.num_max_tokens_per_rank, p.hidden_bytes, p.num_sf_packs = M, hidden_bytes, packs
        p.sf_token_stride, p.sf_hidden_stride, p.num_experts, p.num_topk, p.expert_alignment = sf_ts, sf_hs, E, K, A
        p.do_expand, p.cached, p.do_zero_padding, p.num_sms, p.overlap = (int(do_expand), int(cached),
                                                                          int(zero_padding), num_sms, int(overlap))
        p.zero_copy = int(zero_copy)
        return p

    def _combine_params(self, T: int, M: int, hidden: int, E: int, K: int, expanded: bool, multi: bool, num_sms: int,
                        push_blocks: int) -> Any:
        p = _C.CombineParams()
        p.num_combined_tokens, p.num_max_tokens_per_rank, p.hidden, p.num_experts, p.num_topk = T, M, hidden, E, K
        p.use_expanded_layout, p.allow_multiple_reduction = int(expanded), int(multi)
        p.num_sms, p.overlap_push_blocks = num_sms, push_blocks
        return p

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, a: DispatchArgs) -> DispatchResult:
        """Sends each token to the ranks owning its top-k experts (cached mode: ``a.handle``'s routing).

        Returns:
            The outputs and the handle (a new ``EPHandle``, or ``a.handle`` in cached mode).
        """
        self._alive()
        R, h = self.num_ranks, a.handle
        cached = h is not None
        x, sf, w = a.x, a.sf, a.topk_weights
        T, K, E, M, A, num_sms = a.num_tokens, a.num_topk, a.num_experts, a.num_max_tokens_per_rank, \
            a.expert_alignment, a.num_sms
        L = E // R
        hidden_bytes = a.hidden * x.element_size()
        packs = sf.shape[1] if sf is not None else 0
        sf_ts, sf_hs = sf.stride() if sf is not None else (0, 0)
        # Overlapped dispatch: the push gets `push_sms` blocks, the epilogue (on the runtime's second
        # stream, beside the push) the rest. Not when an event must gate the epilogue, nor with a grid
        # larger than the GPU: the epilogue's blocks wait for the push's, so both must fit at once.
        hybrid = self.num_scaleup_ranks > 0
        if hybrid and a.zero_copy:
            raise ValueError("zero_copy: not available in hybrid mode (the forwarders write records, not the "
                             "dense receive area); call dispatch with zero_copy=False")
        push_sms = 0
        if a.previous_event_before_epilogue is None and num_sms <= self.num_device_sms and not hybrid:
            push_sms = _overlap_push_blocks(self.dispatch_overlap, R, num_sms, M)
        overlap = push_sms > 0
        epilogue_sms = num_sms - push_sms if overlap else num_sms
        # The default stream set-up (no events, outputs on the compute stream) is done by the runtime
        # around its launches; the other modes go through the stream_control_* methods.
        fast = a.previous_event is None and not a.allocate_on_comm_stream and not a.async_with_compute_stream
        # Expert ids outside [-1, E): with a CPU sync notify counts them and the dispatch is refused on
        # every rank (nothing is written, every host raises, the buffer stays usable); without one,
        # notify masks them and the next call raises (_alive). ELASTIC_EP_SKIP_INDEX_CHECK=1: masked.
        refuse = a.do_cpu_sync and not cached and self._refuse_bad_ids
        dev = x.device
        compute_stream = None
        stage = _NOTHING_QUEUED  # how far this call got, for _abandon if anything below raises
        try:
            if not fast:
                # Stream control; every allocation below happens after it (on the comm stream if asked).
                compute_stream = self.stream_control_prologue(a.previous_event, a.allocate_on_comm_stream)
            compute_raw = _current_raw_stream(self.device) if fast else _NO_STREAM
            topk_idx = a.topk_idx
            if topk_idx.dtype is not torch.int64:
                # DeepEP's 32-bit topk_idx_t: the kernels read int64. One cast, on the stream whose work
                # the kernels are ordered after; it is also the handle's copy.
                topk_idx = topk_idx.to(torch.int64)
            zero_copy = a.zero_copy
            if cached:
                psum_rank, psum_expert_full = h.psum_num_recv_tokens_per_scaleup_rank, None
                unaligned, slot_idx, copied = h.num_unaligned_recv_tokens_per_expert, h.dst_buffer_slot_idx, None
                direct_base = h.direct_base if zero_copy else None
            else:
                # One allocation for the int32 arrays notify writes (one split_with_sizes costs less host
                # time than several slices); zero-copy: direct_base too.
                zc_rows = R if zero_copy else 0
                psum_rank, psum_expert_full, unaligned, slot_idx, direct_base = torch.empty(
                    R + (L + 1) + L + T * K + zc_rows, dtype=torch.int32, device=dev).split_with_sizes(
                        (R, L + 1, L, T * K, zc_rows))
                slot_idx = slot_idx.view(T, K)
                direct_base = direct_base if zero_copy else None
                copied = torch.empty_like(topk_idx) if a.do_handle_copy and topk_idx is a.topk_idx else None
            # Hybrid mode: [S * M, 2] (source token, mask of this domain's destinations), by source domain
            # and token, written by this rank's push (own domain) and forward kernel (the others).
            forward_dense = torch.zeros((R * M // self.num_scaleup_ranks, 2), dtype=torch.int32, device=dev) \
                if hybrid and not cached else None
            concurrent = self.dispatch_pdl and not overlap and not hybrid
            params = self._plan(("d", T, M, hidden_bytes, packs, sf_ts, sf_hs, E, K, A, cached,
                                 push_sms if overlap else num_sms, refuse, overlap, concurrent,
                                 a.zero_copy_x_offset if zero_copy else -1), self._notify_params)
            # From here until the epilogue is queued, this rank owes its peers the rest of the operation
            # (set before the call: a launch error inside it may come after notify was queued).
            stage = _EPILOGUE_OWED
            self._rt.dispatch(params, x.data_ptr(), _ptr(sf), topk_idx.data_ptr(), _ptr(w), _ptr(copied),
                              0 if cached else _ptr(a.cumulative_local_expert_recv_stats), psum_rank.data_ptr(),
                              _ptr(psum_expert_full), unaligned.data_ptr(), slot_idx.data_ptr(), self._comm_raw,
                              compute_raw, _ptr(direct_base), _ptr(forward_dense))
            if cached:
                num_recv, num_expanded, per_expert = h.num_recv_tokens, h.num_expanded_tokens, \
                    h.num_recv_tokens_per_expert_list
            elif a.do_cpu_sync:
                c = self._rt.wait_dispatch_counts(L)
                status = c.status
                if status == 1:  # the runtime marked itself broken (statuses 1, 2)
                    self._alive()  # raises the device timeout
                elif status == 2:
                    # Which peer is late is known on the GPU only: notify publishes the counts once every
                    # peer's arrived, and its own deadline names the peer it waits for.
                    raise self._cpu_timeout(
                        "dispatch CPU wait for the token counts",
                        f"ranks whose counts arrived {c.ranks_ready}/{R}, local experts {c.experts_ready}/{L} (the "
                        "notify kernel publishes them only once every peer's counts arrived; a num_gpu_timeout_secs "
                        "shorter than num_cpu_timeout_secs makes the device deadline report first, naming the peer); "
                        "destroy this buffer and create a new one", R + L, c.ranks_ready + c.experts_ready)
                elif status == 3:
                    # Refused on every rank: the push ended the operation without an epilogue, so nothing
                    # is owed and the buffer stays usable.
                    stage = _ALL_QUEUED
                    raise self._refused_error(E)
                num_recv, num_expanded, per_expert = c.num_recv_tokens, c.num_expanded_tokens, \
                    c.num_recv_tokens_per_expert
            else:
                num_recv = R * M
                num_expanded = int(_C.worst_case_num_expanded_tokens(R, M, K, L, A))
                per_expert = []
            n = num_expanded if a.do_expand else num_recv
            if zero_copy:  # the rows the push wrote in place: receive order, dense
                off = a.zero_copy_x_offset
                recv_x = self._buffer_bytes()[off:off + n * hidden_bytes].view(x.dtype).view(n, a.hidden)
            else:
                recv_x = torch.empty((n, a.hidden), dtype=x.dtype, device=dev)
            recv_sf = None
            rsf_ts = rsf_hs = 0
            if sf is not None:
                if a.use_tma_aligned_col_major_sf:
                    rsf_ts, rsf_hs = 1, (n + _SF_PACK_ALIGN - 1) // _SF_PACK_ALIGN * _SF_PACK_ALIGN
                else:
                    rsf_ts, rsf_hs = packs, 1
                recv_sf = torch.empty_strided((n, packs), (rsf_ts, rsf_hs), dtype=sf.dtype, device=dev)
            recv_topk_idx = None if a.do_expand else torch.empty((n, K), dtype=torch.int64, device=dev)
            recv_w = None
            if w is not None:
                recv_w = torch.empty((n,) if a.do_expand else (n, K), dtype=torch.float32, device=dev)
            # Cached: expanded rows go where the handle's metadata points (sorted rows after a
            # deterministic sort, as in DeepEP); nothing is written to it.
            meta = h.recv_src_metadata if cached else torch.empty((num_recv, K + 2), dtype=torch.int32, device=dev)
            # Expand mode: the exclusive starts (become start + count); otherwise the inclusive sums.
            psum_expert = h.psum_num_recv_tokens_per_expert if cached else \
                (psum_expert_full[:L] if a.do_expand else psum_expert_full[1:])
            if a.previous_event_before_epilogue is not None:
                _stream_wait(self.comm_stream, a.previous_event_before_epilogue)
            params = self._plan(("e", M, hidden_bytes, packs, sf_ts, sf_hs, E, K, A, a.do_expand, cached,
                                 a.do_zero_padding, epilogue_sms, overlap, zero_copy), self._epilogue_params)
            # Rows this rank sends to itself are copied from x by the epilogue.
            self._rt.dispatch_epilogue(params, x.data_ptr(), _ptr(sf), recv_x.data_ptr(), _ptr(recv_sf), rsf_ts,
                                       rsf_hs, _ptr(recv_topk_idx), _ptr(recv_w), meta.data_ptr(),
                                       psum_rank.data_ptr(), 0 if cached else psum_expert_full.data_ptr(),
                                       unaligned.data_ptr(), self._comm_raw, compute_raw, _ptr(forward_dense))
            stage = _ALL_QUEUED
            event = None
            if not fast:
                event = self.stream_control_epilogue(
                    # (A zero-copy recv_x is the window's memory, not the caching allocator's.)
                    [x, sf, topk_idx, w, None if zero_copy else recv_x, recv_sf, recv_topk_idx, recv_w,
                     a.cumulative_local_expert_recv_stats,
                     copied, psum_rank, psum_expert_full, psum_expert, unaligned, meta, slot_idx],
                    compute_stream, a.allocate_on_comm_stream, a.async_with_compute_stream)
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too: re-raised after the clean-up
            self._abandon("dispatch", e, stage, compute_stream, a.allocate_on_comm_stream)
            raise
        if not cached:
            forward = (None, None)
            if forward_dense is not None and not torch.cuda.is_current_stream_capturing():
                forward = _forward_metadata_of(forward_dense, self.num_scaleup_ranks, self.comm_stream)
            h = EPHandle(a.do_expand, E, A, M, num_sms, copied if copied is not None else topk_idx, num_recv,
                         num_expanded, per_expert, psum_rank, psum_expert, unaligned, meta, slot_idx, *forward,
                         buffer_id=self.buffer_id, direct_base=direct_base)
        return DispatchResult(recv_x, recv_sf, recv_topk_idx, recv_w, h, event)

    # ------------------------------------------------------------------ combine
    def combine(self, a: CombineArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[EventHandle]]:
        """Sends expert outputs back to the tokens' origins and reduces them (see the module docstring).

        Returns:
            ``(combined_x [T, hidden] bf16, combined_topk_weights [T, K] float32 or None, event or None)``.
        """
        self._alive()
        h, x, w = a.handle, a.x, a.topk_weights
        hidden = x.shape[1]
        T, K = h.topk_idx.shape
        M = h.num_max_tokens_per_rank
        fast = a.previous_event is None and not a.allocate_on_comm_stream and not a.async_with_compute_stream
        compute_stream = None
        stage = _NOTHING_QUEUED  # how far this call got, for _abandon if anything below raises
        try:
            if not fast:
                compute_stream = self.stream_control_prologue(a.previous_event, a.allocate_on_comm_stream)
            compute_raw = _current_raw_stream(self.device) if fast else _NO_STREAM
            topk_idx = h.topk_idx
            if topk_idx.dtype is not torch.int64:  # a handle given a 32-bit topk_idx: the kernels read int64
                topk_idx = topk_idx.to(torch.int64)
            combined_x = torch.empty((T, hidden), dtype=torch.bfloat16, device=x.device)
            combined_w = torch.empty((T, K), dtype=torch.float32, device=x.device) if w is not None else None
            # previous_event_before_epilogue gates only the reduce: the push overlaps what it marks.
            wait_event = 0
            pe = a.previous_event_before_epilogue
            if pe is not None and pe.event is not None:
                wait_event = int(pe.event.cuda_event)
            push_blocks = 0 if wait_event or self.num_scaleup_ranks else \
                _overlap_push_blocks(self.combine_overlap, self.num_ranks, a.num_sms, M)
            params = self._plan(("c", T, M, hidden, h.num_experts, K, h.do_expand, self.allow_multiple_reduction,
                                 a.num_sms, push_blocks), self._combine_params)
            meta, psum = h.backend_recv_src_metadata, h.psum_num_recv_tokens_per_scaleup_rank
            # The push and the reduce (which ends the operation) are queued by this one call; if it
            # raises, the push may be queued without the reduce.
            stage = _EPILOGUE_OWED
            self._rt.combine(params, x.data_ptr(), _ptr(w), meta.data_ptr(), psum.data_ptr(), topk_idx.data_ptr(),
                             combined_x.data_ptr(), _ptr(combined_w), _ptr(a.bias_0), _ptr(a.bias_1), self._comm_raw,
                             wait_event, compute_raw, compute_raw)
            stage = _ALL_QUEUED
            event = None
            if not fast:
                event = self.stream_control_epilogue(
                    [x, w, a.bias_0, a.bias_1, meta, topk_idx, combined_x, combined_w, psum], compute_stream,
                    a.allocate_on_comm_stream, a.async_with_compute_stream)
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too: re-raised after the clean-up
            self._abandon("combine", e, stage, compute_stream, a.allocate_on_comm_stream)
            raise
        return combined_x, combined_w, event
