"""The native runtime's window and its life: creation over a process group, the CUDA-IPC handle exchange,
health, stream control, the barrier and teardown (``NativeWindow``). The operations over it are
``NativeRuntime``'s (``_native_runtime.py``).

The window ``[workspace | buffer]`` is an NCCL symmetric window (``ncclMemAlloc`` +
``ncclCommWindowRegister``; peers' addresses from the device communicator) or, with ``window="ipc"``,
``cudaMalloc`` memory whose CUDA IPC handles the ranks exchange (``csrc/host/window.hpp``). Signals in
the workspace carry an operation epoch kept on the device, so nothing is re-zeroed between operations.

Health: a device wait that expires leaves a record the next call raises as ``CommTimeoutError``
(naming the operation, rank and peer); an operation abandoned half way marks the runtime unusable
(``_abandon``); expert ids a dispatch without CPU sync masked are reported by the next call.
"""
from __future__ import annotations

import collections.abc
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _C, _env
from ._checks import c_ints, expert_ids_error
from ._collective import (agree_on_every_rank, all_ok, gather_bytes, gather_ints, group_device,
                          raise_if_any_rank_failed)
from ._events import EventHandle
from ._geometry import geometry_error
from ._peer_calls import REPORT_FIRST, native_report_error
from ._nccl import (comm_arg, destroy_nccl_comm, get_logical_domain_size, need_cuda, new_nccl_comm,
                    torch_nccl_comm)
from ._runtime import Runtime

__all__ = ["NativeWindow", "CommError", "CommTimeoutError"]

CommError = _C.CommError
CommTimeoutError = _C.CommTimeoutError
# How far a dispatch / combine got when it raised (see NativeWindow._abandon): nothing queued on the
# device yet; the first kernels possibly queued without the one that ends the operation; all queued.
NOTHING_QUEUED, EPILOGUE_OWED, ALL_QUEUED = 0, 1, 2


def _timeout_error(info: Any, what: str) -> Exception:
    """A CommTimeoutError built in Python from a device timeout record (``_C.TimeoutInfo``)."""
    err = CommTimeoutError(f"{info.operation} timed out: expected {info.expected}, observed {info.observed} "
                           f"[rank {info.rank}, peer {info.peer}] after {info.waited_ms} ms without progress "
                           f"(GPU block {info.channel}); {what}")
    err.operation, err.rank, err.peer, err.expected, err.observed = (info.operation, info.rank, info.peer,
                                                                    info.expected, info.observed)
    err.where = "elastic_ep"
    return err


def stream_wait(dst: torch.cuda.Stream, src: Any) -> None:
    """``dst`` waits for ``src``: an ``EventHandle`` (its event, if any) or a stream."""
    if isinstance(src, EventHandle):
        if src.event is not None:
            dst.wait_event(src.event)
    else:
        dst.wait_stream(src)


class _DeviceMemory:
    """Device bytes torch can wrap without owning them (``__cuda_array_interface__``, version 2)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2,
                                         "strides": None}


# What notify / the epilogue report besides geometry words (csrc/kernels/sizing.hpp kProtocol*).
_PROTOCOL_ERRORS = {
    4: "rank {peer} sent a count of {theirs} tokens, more than num_max_tokens_per_rank={mine} (a corrupted count word)",
    5: "a record in rank {peer}'s area names source token {theirs}, outside that rank's range (a corrupted record)",
    6: "records from rank {peer} put more rows into local expert {theirs} than the {mine} its count said (a "
       "corrupted record or count)",
    7: "a record rank {peer} staged for this rank to relay (hybrid mode) routes a lane to {theirs}, outside "
       "[0, {mine}) (a corrupted expert id or slot); it was relayed nowhere and the other ranks of this domain "
       "were not told that rank's rows are complete",
    # Low-latency mode (csrc/kernels/sizing.hpp kProtocolLl*; 8 and 9 are the geometry words, ll_geometry_error).
    10: "rank {peer} sent a low-latency count of {theirs} tokens, outside [0, num_max_dispatch_tokens_per_rank="
        "{mine}] (a corrupted count word)",
    11: "a low-latency message or handle row from rank {peer} names a token, lane or rank out of range ({theirs}, "
        "bound {mine}; a corrupted message, or a handle changed after low_latency_dispatch returned it)",
    12: "rank {peer}'s low-latency signal is from call {theirs}, this rank is at call {mine}: the ranks' low-latency "
        "calls are out of step (every rank must make the same low-latency calls, each hook called once)",
    13: "a combine slot of this rank's own row holds row index {theirs}, outside x's {mine} rows (the window was "
        "written where only this rank writes: a corrupted slot; or a caller of the raw _C runtime left "
        "CombineParams.num_x_rows unset)",
    14: "rank {peer} sent a count of {theirs} rows for one of this rank's experts, outside [0, num_topk x "
        "num_max_tokens_per_rank={mine}] (a corrupted count word)",
}
# The reports whose first value is a signed int32 a peer wrote (a source token, expert id or slot, count,
# token or lane, row index): the kernels may store its 32 bits (sizing.hpp HostWorkspaceLayout::geometry).
_SIGNED_THEIRS = frozenset((5, 7, 10, 11, 13, 14))


def _int32(v: int) -> int:
    """A report value read as the int32 its low 32 bits hold (whether stored zero- or sign-extended)."""
    return (int(v) + (1 << 31)) % (1 << 32) - (1 << 31)


def protocol_error_text(what: int, peer: int, theirs: int, mine: int) -> str:
    """What a protocol report (``_PROTOCOL_ERRORS``' code ``what``) says, its values as their fields are:
    a signed one negative where the peer wrote a negative value."""
    return _PROTOCOL_ERRORS[what].format(peer=peer, theirs=_int32(theirs) if what in _SIGNED_THEIRS else theirs,
                                         mine=mine)


def ll_geometry_error(word: int, peer: int, theirs: int, mine: int) -> str:
    """What differs between two ranks' low-latency calls (csrc/kernels/ll_sizing.hpp ll_geometry_word)."""
    if word == 8:
        names = ("num_max_dispatch_tokens_per_rank", "num_topk", "use_fp8")
        a, b = (theirs >> 16, (theirs >> 8) & 0xFF, theirs & 1), (mine >> 16, (mine >> 8) & 0xFF, mine & 1)
    else:
        names = ("num_experts", "hidden")
        a, b = (theirs >> 16, (theirs & 0xFFFF) * 128), (mine >> 16, (mine & 0xFFFF) * 128)
    diffs = [f"{n}: rank {peer} passed {x}, this rank {y}" for n, x, y in zip(names, a, b) if x != y]
    return ("the ranks made a low-latency call with different arguments (" + "; ".join(diffs) + "); nothing was "
            "copied from that rank. Every rank must pass the same num_max_dispatch_tokens_per_rank, hidden, "
            "num_experts, top-k and use_fp8")


class NativeWindow(Runtime):
    """The native runtime's window and life; its constructor takes DeepEP V2's C++ ``ElasticBuffer``
    arguments, in order.

    Arguments:
        rank_idx, num_ranks: this rank and the rank count.
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
            (``_domains.gin_requirements``); the scale-out transport is then NCCL GIN (NCCL window only,
            and a build with ``ELASTIC_EP_GIN=ON``), else the NVLink emulation.

    Raises:
        ValueError: a bad argument (the window's kind, sizes, ranks).
        RuntimeError: no CUDA build or device; CommError: the window could not be made.
    """

    backend = "native"
    #: Hybrid mode: ranks per logical scale-out domain (the constructor's); 0: direct mode.
    num_scaleup_ranks: int = 0
    #: Hybrid mode's scale-out transport: "gin", "nvlink-emulated", or None in direct mode.
    scaleout_transport: Optional[str] = None
    _last_op: Optional[str] = None  # the last operation launched (named when a peer dies)

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
        opts.test_fail_release = settings.test_fail_release
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
        self._refuse_bad_ids = not settings.skip_index_check
        self._buffer_u8: Optional[torch.Tensor] = None
        self.comm_stream = torch.cuda.Stream(device=self.device)
        self._comm_raw = int(self.comm_stream.cuda_stream)
        self._configure(settings)
        # The caller runs a process-group barrier next (DeepEP's does too): no peer may write into this
        # window before every rank finished creating it.

    def _configure(self, settings: _env.Settings) -> None:
        """The settings of the operations a subclass runs over the window (read at creation)."""

    @classmethod
    def create(cls, group: dist.ProcessGroup, num_buffer_bytes: int, allow_multiple_reduction: bool,
               num_cpu_timeout_secs: int, num_gpu_timeout_secs: int, explicitly_destroy: bool, window: str,
               settings: _env.Settings, buffer_id: int, num_scaleup_ranks: int = 0,
               gin: Optional[Dict[str, Any]] = None) -> Tuple["NativeWindow", int, int, str]:
        """A runtime over ``group`` (collective; every rank takes the same path): on a CUDA-IPC window
        (handles exchanged over ``group``), or on torch's NCCL communicator when that works on every rank
        (``EP_REUSE_NCCL_COMM`` not 0), else on a communicator of its own (unique-id exchange).
        ``num_scaleup_ranks`` and ``gin``: the constructor's (hybrid mode).

        Returns:
            ``(runtime, nccl_comm or 0, the communicator the caller must abort when done or 0, how the
            communicator was found)``.
        """
        kw = dict(num_buffer_bytes=num_buffer_bytes, allow_multiple_reduction=allow_multiple_reduction,
                  num_cpu_timeout_secs=num_cpu_timeout_secs, num_gpu_timeout_secs=num_gpu_timeout_secs,
                  explicitly_destroy=explicitly_destroy, settings=settings, buffer_id=buffer_id,
                  num_scaleup_ranks=num_scaleup_ranks, gin=gin)
        # Before any memory is registered: every rank's window must have the layout its peers write into.
        device = group_device(group)
        agree_on_every_rank(group, "ElasticBuffer (native)", dict(
            num_bytes=num_buffer_bytes, allow_multiple_reduction=int(allow_multiple_reduction),
            num_scaleup_ranks=num_scaleup_ranks, gin=int(gin is not None), window=int(window == "ipc")),
            device=device)
        rt, comm, own, how = cls._create(group, window, kw, settings)
        # Every rank's process id, then the watch that ends this rank's waits when a peer on this host
        # dies (collective, like the creation; the ids are fixed-size integers).
        if settings.peer_watch_ms > 0:
            ids = gather_ints(group, list(_C.this_process()), device, unsigned=True)
            rt._rt.watch_peers([tuple(i) for i in ids], settings.peer_watch_ms)
        return rt, comm, own, how

    @classmethod
    def _create(cls, group: dist.ProcessGroup, window: str, kw: Dict[str, Any],
                settings: _env.Settings) -> Tuple["NativeWindow", int, int, str]:
        """``create``'s runtime on the window it picks (see there)."""
        rank, R = dist.get_rank(group), dist.get_world_size(group)
        if window == "ipc":
            rt = cls(rank, R, 0, window="ipc", **kw)
            handles = gather_bytes(group, bytes(rt.get_local_ipc_handle()))
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
        Collective: every rank must call it. Calling it twice raises.

        Raises:
            RuntimeError: called a second time.
            CommError: a release failed, or the device did not finish this rank's operations within the
                teardown deadline (its waits were then ended; the window is kept until the process exits).
        """
        if self._destroyed:
            raise RuntimeError("ElasticBuffer.destroy() was already called")
        # No torch.cuda.synchronize here: the runtime's destroy() waits for the device with a deadline
        # (a kernel that waits without one, num_gpu_timeout_secs=0, would hold an unbounded one forever).
        self._destroyed = True
        self._buffer_u8 = None  # zero-copy views of the window dangle from here (documented)
        if self._rt is not None:
            self._rt.destroy()

    def __del__(self) -> None:
        try:
            if not self.explicitly_destroy and not self._destroyed and self._rt is not None:
                self._destroyed = True
                self._rt.destroy()
        except Exception:  # noqa: BLE001 - nothing may escape a finaliser
            pass

    def _alive(self, op: Optional[str] = None) -> None:
        """Raises what the runtime reported since the last call (a dead peer, a device timeout, a
        refusal, masked ids); ``op``: the operation about to launch, named if a peer dies later."""
        # The peer watch only ends the waits: the operation that waited is the last one launched (a
        # later call raises at its entry, a CPU-synced dispatch from inside its own wait).
        waiting = self._last_op
        if op is not None:
            self._last_op = op
        if self._destroyed:
            raise RuntimeError("this ElasticBuffer was destroyed")
        if self._rt.pending_health() == 0:  # one native call in the common case
            return
        # Device timeouts are raised here, from Python, as data the runtime reports (a C++ exception
        # crossing into Python once crashed the process on a GPU host).
        info = self._rt.take_timeout()
        if info is not None and info.operation.startswith("elastic_ep peer watch"):
            during = f" during this rank's {waiting} (the last operation it launched)" if waiting else ""
            raise CommError(f"elastic_ep [rank {self.rank_idx}]: rank {info.peer}'s process (pid {info.expected}) on "
                            f"this host died{during}; the operation waiting for it was ended at once. The CUDA "
                            "context is usable; destroy this buffer and create a new one with the ranks that are "
                            "left")
        if info is not None:
            raise _timeout_error(info, "the CUDA context is usable but this buffer's signals are out of step: "
                                       "destroy it and create a new one")
        if self._rt.broken:
            raise CommError(f"this elastic buffer is unusable ({self._rt.broken_reason}); destroy it and create "
                            "a new one")
        # Taken even when they are not reported, so that pending_health() is 0 again (the cheap path).
        num_bad, example = self._rt.take_masked_ids()
        geometry = self._geometry_error()  # a dispatch without CPU sync (or cached) refused since the last call
        if num_bad and self._refuse_bad_ids:  # ELASTIC_EP_SKIP_INDEX_CHECK=1: masked silently, as documented
            raise ValueError(self._masked_ids_message(num_bad, example))
        if geometry is not None:
            raise geometry

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

    def _geometry_error(self) -> Optional[Exception]:
        """The error of a dispatch refused for a peer's word, or None when none is pending: a ValueError
        when the peer's geometry differed (every rank refused it; no row moved; the buffer stays
        usable), a CommError (the buffer marked unusable) for a corrupted count or record word."""
        found = self._rt.take_geometry_mismatch()
        if found is None:
            return None
        peer, word, theirs, mine = found
        if word >= REPORT_FIRST:  # PP / AGRS (_peer_calls): a refused transfer or gather, or a corrupted word
            err = native_report_error(self.rank_idx, peer, word, theirs, mine)
            if not isinstance(err, ValueError):
                self._rt.mark_broken(str(err))
            return err
        if word in (8, 9):
            msg = (f"low-latency call [rank {self.rank_idx}]: {ll_geometry_error(word, peer, theirs, mine)}. This "
                   "buffer is unusable: destroy it on every rank and create a new one")
            self._rt.mark_broken(msg)
            return CommError(msg)
        if word in _PROTOCOL_ERRORS:
            what = protocol_error_text(word, peer, theirs, mine)
            op = {13: "combine", 14: "dispatch"}.get(word, "low-latency call" if word >= 10 else "dispatch")
            msg = (f"{op} [rank {self.rank_idx}]: protocol error: {what}; nothing was written where it "
                   "points. This buffer is unusable: destroy it on every rank and create a new one")
            self._rt.mark_broken(msg)
            return CommError(msg)
        return geometry_error("dispatch", self.rank_idx, peer, word, theirs, mine)

    def _cpu_timeout(self, what: str, detail: str, expected: int, observed: int) -> Exception:
        err = CommTimeoutError(f"elastic_ep {what} timed out after {self.num_cpu_timeout_secs} s "
                               f"[rank {self.rank_idx}]: {detail}")
        err.operation, err.rank, err.peer = f"elastic_ep {what}", self.rank_idx, -1
        err.expected, err.observed = expected, observed
        return err

    def _abandon(self, op: str, err: BaseException, stage: int, compute_stream: Optional[torch.cuda.Stream],
                 allocate_on_comm_stream: bool) -> None:
        """Clean-up of a dispatch / combine that raises ``err`` (which the caller re-raises).

        * ``stage == EPILOGUE_OWED``: the first kernels may be queued without the one that ends the
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
            if stage == EPILOGUE_OWED and not capturing and not self._rt.broken:
                self._rt.mark_broken(
                    f"elastic_ep {op} stopped after its first kernels were queued, by {type(err).__name__}: {err}; "
                    "this rank's signals are out of step with its peers' (their next operation times out "
                    "waiting for it), so every rank must recreate the buffer")
        except Exception:  # noqa: BLE001 - see above
            pass
        try:
            if stage != NOTHING_QUEUED:
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
        stream_wait(self.comm_stream, previous_event if previous_event is not None else compute_stream)
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
        self._alive("barrier")
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
