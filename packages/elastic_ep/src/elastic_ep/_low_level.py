"""Low-level native backend of elastic_ep: a Python mirror of DeepEP V2's C++ ``ElasticBuffer``.

Every public method of :class:`ElasticBuffer` takes the seed's arguments in the seed's order and
returns the seed's tuples, so the DeepEP-compatible layer (``elastic_ep.buffer``) and the pure-torch
backend (``elastic_ep._torch_backend``) are interchangeable. Tensors are allocated and validated here;
the torch-free extension ``elastic_ep._C`` receives raw pointers and stream handles.

Algorithm (direct mode: every rank in one NVLink/LSA domain)
------------------------------------------------------------
The buffer is one NCCL symmetric window ``[workspace | buffer]`` (``ncclMemAlloc`` +
``ncclCommWindowRegister``); peers are reached through LSA pointers (``ncclGetLsaPointer``, resolved
once on the device). Signals in the workspace carry an operation epoch kept on the device, so nothing
is re-zeroed between operations and the whole sequence is CUDA-graph capturable.

dispatch
  1. notify (one block): entry barrier (each rank publishes the epoch it entered; nobody writes into a
     peer before the peer finished reading its previous operation), per-token slots in each destination
     rank's receive area (slot = number of earlier tokens of this rank bound for that destination, so
     receive order is by source rank then source token), per-rank and per-expert counts pushed into
     the peers' workspaces, then the received counts turned into prefix sums, statistics and the
     host-mapped counts of the CPU sync.
  2. push (all SMs): one warp per token writes its record ``[x | sf | topk_idx | weights | src]`` into
     each destination rank's area ``[src_rank][slot]`` over NVLink, then the last block signals the peers.
  3. (CPU sync) the host waits for the counts and allocates exact-size outputs; otherwise worst case.
  4. copy epilogue (all SMs): waits for the peers' signals, copies records into ``recv_x`` / ``recv_sf``
     / ``recv_topk_idx`` / ``recv_topk_weights`` / ``recv_src_metadata``; expand mode writes one row per
     local expert at the expert's aligned segment (order inside a segment is not deterministic;
     ``deterministic=True`` in the high-level API sorts by source token).

combine
  1. push (all SMs): entry barrier, then one warp per received token sends its row (expand mode with
     multiple reduction: the fp32 sum of its local expanded rows, rounded to bf16) and its top-k weights
     into the origin's combine area ``[token][slot]``: slot = sending rank when multiple reduction is on
     and R <= K, else the top-k lane (master lane for a reduced row).
  2. reduce (all SMs): sums the valid slots in slot order in fp32, adds ``bias_0`` then ``bias_1`` and
     rounds to bf16; routes the weights back. Weights are never multiplied.

Launch: one process per GPU, all ranks of one NVLink domain, ``torch.cuda.set_device`` first; every
rank calls every operation in the same order (they are collective).
"""
from __future__ import annotations

import collections.abc
import os
from typing import List, Optional, Sequence, Tuple

import torch

from . import _C, _checks, _sizing
from ._events import EventHandle

__all__ = [
    "ElasticBuffer",
    "EventHandle",
    "topk_idx_t",
    "get_local_nccl_unique_id",
    "create_nccl_comm",
    "destroy_nccl_comm",
    "get_elastic_buffer_alignment",
    "get_physical_domain_size",
    "get_logical_domain_size",
    "nccl_version",
    "check_nccl_version",
    "CommError",
    "CommTimeoutError",
]

#: dtype of top-k expert indices (DeepEP's ``topk_idx_t``).
topk_idx_t = torch.int64

CommError = _C.CommError
CommTimeoutError = _C.CommTimeoutError

_MAX_RANKS = int(_C.MAX_RANKS)
_MAX_TOPK = int(_C.MAX_TOPK)
_SF_PACK_ALIGN = int(_C.NUM_ALIGNED_SF_PACKS)


def _need_cuda(what: str) -> None:
    if not _C.built_with_cuda():
        raise RuntimeError(
            f"elastic_ep.{what} needs the CUDA build of elastic_ep._C (this one was built without nvcc); "
            "reinstall on a machine with the CUDA toolkit, or use backend='torch'"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(f"elastic_ep.{what} needs a CUDA device, and torch sees none")


def _version_str(code: int) -> str:
    return f"{code // 10000}.{(code // 100) % 100}.{code % 100}"


def nccl_version() -> int:
    """Returns the NCCL_VERSION_CODE (e.g. 22809) of the libnccl loaded in this process."""
    _need_cuda("nccl_version")
    return int(_C.nccl_version())


def check_nccl_version() -> None:
    """Raises ImportError when the loaded NCCL is older than the one elastic_ep was compiled against.

    The device API structures (windows, device communicators) change between NCCL releases, so a
    runtime library older than the build headers would read them wrongly.
    """
    if not _C.built_with_cuda():
        return
    built = int(_C.nccl_build_version())
    loaded = int(_C.nccl_version())
    if loaded < built:
        raise ImportError(
            f"elastic_ep was built against NCCL {_version_str(built)} but this process loaded NCCL "
            f"{_version_str(loaded)} (older); rebuild elastic_ep here (pip install --no-build-isolation) or "
            f"install nvidia-nccl-cu13>={_version_str(built)}"
        )


if os.environ.get("EP_SKIP_NCCL_VERSION_CHECK", "0") != "1":
    check_nccl_version()


def get_local_nccl_unique_id() -> bytes:
    """Returns a new NCCL unique id (128 bytes) to broadcast from rank 0 before ``create_nccl_comm``."""
    _need_cuda("get_local_nccl_unique_id")
    return bytes(_C.get_local_nccl_unique_id())


def create_nccl_comm(unique_id: bytes, num_ranks: int, rank: int) -> int:
    """Creates an NCCL communicator on the current CUDA device (collective over ``num_ranks`` processes).

    Arguments:
        unique_id: rank 0's ``get_local_nccl_unique_id()``, the same bytes on every rank.
        num_ranks: number of ranks.
        rank: this process's rank in ``[0, num_ranks)``.

    Returns:
        The ``ncclComm_t`` as an int, to pass to :class:`ElasticBuffer` and ``destroy_nccl_comm``.
    """
    if not isinstance(unique_id, (bytes, bytearray)):
        raise ValueError(f"unique_id must be bytes from get_local_nccl_unique_id(), got {type(unique_id).__name__}")
    num_ranks = _checks.int_arg("num_ranks", num_ranks, 1, _MAX_RANKS)
    rank = _checks.int_arg("rank", rank, 0, num_ranks - 1)
    _need_cuda("create_nccl_comm")
    return int(_C.create_nccl_comm(bytes(unique_id), num_ranks, rank))


def destroy_nccl_comm(nccl_comm: int) -> None:
    """Aborts (frees) a communicator made by ``create_nccl_comm``; never blocks on dead peers."""
    nccl_comm = _comm_arg(nccl_comm)
    _need_cuda("destroy_nccl_comm")
    _C.destroy_nccl_comm(nccl_comm)


def _comm_arg(nccl_comm) -> int:
    """An ``ncclComm_t`` as the int the bindings take (int64): int() would truncate a float into some
    other address."""
    return _checks.int_arg("nccl_comm", nccl_comm, 0, _checks.INT64_MAX)


def get_elastic_buffer_alignment() -> int:
    """Returns the alignment of buffer sizes in bytes (2 MiB)."""
    return int(_C.get_elastic_buffer_alignment())


def get_physical_domain_size(nccl_comm: int) -> Tuple[int, int]:
    """Returns ``(num_rdma_ranks, num_nvl_ranks)`` of a communicator.

    Direct mode supports one NVLink domain, so this is ``(1, num_ranks)``; a communicator that spans
    several NVLink domains is rejected when the buffer is created (``ncclDevCommCreate`` reports the
    LSA team size).
    """
    nccl_comm = _comm_arg(nccl_comm)
    _need_cuda("get_physical_domain_size")
    _, size = _C.nccl_comm_rank_size(nccl_comm)
    return 1, int(size)


def get_logical_domain_size(nccl_comm: int, allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    """Returns ``(num_scaleout_ranks, num_scaleup_ranks)``; ``(1, num_ranks)`` in direct mode."""
    return get_physical_domain_size(nccl_comm)


def _timeout_error(info: dict, what: str) -> Exception:
    """A CommTimeoutError built in Python from a device timeout record (no C++ exception involved)."""
    msg = (f"{info['operation']} timed out: expected {info['expected']}, observed {info['observed']} "
           f"[rank {info['rank']}, peer {info['peer']}] after {info['waited_ms']} ms without progress "
           f"(GPU block {info['channel']}); {what}")
    err = CommTimeoutError(msg)
    for k in ("operation", "rank", "peer", "expected", "observed"):
        setattr(err, k, info[k])
    err.where = "elastic_ep"
    return err


def _stream_wait(dst: torch.cuda.Stream, src) -> None:
    if isinstance(src, EventHandle):
        if src.event is not None:
            dst.wait_event(src.event)
    else:
        dst.wait_stream(src)


_NO_STREAM = -1  # the runtime's "no stream" (0 is a real one: the legacy default stream, torch's default)

# How far a dispatch / combine got when it raised (see ElasticBuffer._abandon): nothing queued on the
# device yet; the first kernels possibly queued without the one that ends the operation; all queued.
_NOTHING_QUEUED, _EPILOGUE_OWED, _ALL_QUEUED = 0, 1, 2


def _current_raw_stream(device: int) -> int:
    """The current stream's ``cudaStream_t`` (what ``torch.cuda.current_stream(device).cuda_stream``
    returns, without building a Stream object: a few microseconds per call on the critical path)."""
    return torch._C._cuda_getCurrentRawStream(device)


class OverlapConfig:
    """Whether an operation runs overlapped, and how many blocks push (see ``_overlap_push_blocks``).

    ``enabled`` and ``push_blocks`` (None: 3/8 of the grid) start from ``ELASTIC_EP_{DISPATCH,COMBINE}_OVERLAP``
    and ``ELASTIC_EP_{DISPATCH,COMBINE}_PUSH_BLOCKS`` when the buffer is created, and may be changed on
    the buffer afterwards (``buf.dispatch_overlap.enabled = True``), e.g. to compare both ways in one
    process.
    """

    __slots__ = ("enabled", "push_blocks")

    def __init__(self, enabled: bool = False, push_blocks: Optional[int] = None) -> None:
        self.enabled = bool(enabled)
        self.push_blocks = push_blocks

    @classmethod
    def from_env(cls, op: str) -> "OverlapConfig":
        blocks = os.environ.get(f"ELASTIC_EP_{op}_PUSH_BLOCKS")
        return cls(os.environ.get(f"ELASTIC_EP_{op}_OVERLAP", "0") == "1", int(blocks) if blocks else None)

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


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else int(t.data_ptr())


def _check_cuda_tensor(name: str, t: torch.Tensor, dtypes, ndim: int, device: int, contiguous: bool = True) -> None:
    """Raises ValueError unless ``t`` is a tensor on CUDA device ``device`` (the buffer's) with the
    given dtypes and dimensions. The kernels take raw pointers, so a tensor on another GPU would be
    read or written through the wrong device's address space."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _checks.check_dense(name, t)
    # One integer compare on the critical path: get_device() is the CUDA index, -1 for any other device.
    if t.get_device() != device:
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor on cuda:{device} (the buffer's device), got device "
                             f"{t.device}")
        raise ValueError(f"{name} is on {t.device}, but this buffer is on cuda:{device}: every tensor of a call "
                         "must be on the buffer's device")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


_FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)


class ElasticBuffer:
    """The native elastic EP buffer; mirrors DeepEP V2's C++ ``ElasticBuffer`` (direct mode).

    Arguments (the seed's, in its order):
        rank_idx: this rank in the communicator.
        num_ranks: number of ranks (all in one NVLink domain).
        nccl_comm: ``ncclComm_t`` as an int (``create_nccl_comm`` or torch's process group).
        cpu_comm: the CPU-memory handles of hybrid/Engram mode; must be None (not supported yet).
        num_buffer_bytes: buffer bytes, a positive multiple of 2 MiB (``calculate_buffer_size``).
        num_cpu_buffer_bytes: must be 0 (CPU segments are not supported yet).
        allow_hybrid_mode: accepted; direct mode is used whatever its value (one NVLink domain).
        allow_multiple_reduction: combine reduces per rank when R <= K (see the module docstring).
        prefer_overlap_with_compute: accepted (only affects hybrid channel counts upstream).
        sl_idx, num_allocated_qps: RDMA settings, accepted and unused (no GIN in direct mode).
        num_cpu_timeout_secs: CPU-side wait limit (dispatch CPU sync).
        num_gpu_timeout_secs: device wait limit without progress; 0 disables it.
        explicitly_destroy: if False, ``destroy()`` runs when the object is garbage-collected.
        window: "nccl" (the seed's NCCL symmetric window) or "ipc": a cudaMalloc'ed window shared by
            CUDA IPC, with no NCCL involved (``nccl_comm`` is ignored). An "ipc" buffer is usable
            after every rank called ``sync(handles)`` with all ranks' ``get_local_ipc_handle()`` (in
            rank order) and then a process-group barrier. It needs CUDA peer access between the
            ranks' GPUs, or ranks that share one GPU (how the multi-rank paths are tested on one GPU).

    ``dispatch_pdl`` (from ``ELASTIC_EP_DISPATCH_PDL``, ``0`` turns it off; may be changed between
    calls): the dispatch push is launched as the notify kernel's programmatic dependent and runs
    beside notify's count exchange instead of after it. The overlapped dispatch never does.
    """

    dispatch_pdl: bool = True

    def __init__(
        self,
        rank_idx: int,
        num_ranks: int,
        nccl_comm: int,
        cpu_comm=None,
        num_buffer_bytes: int = 0,
        num_cpu_buffer_bytes: int = 0,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        window: str = "nccl",
    ) -> None:
        if window not in ("nccl", "ipc"):
            raise ValueError(f"window must be 'nccl' or 'ipc', got {window!r}")
        # Before the device checks, and never int(): that truncated a float (a timeout of 0.5 s became
        # 0, "no deadline") and took a bool as a count; the runtime takes C ints and an int64.
        align = get_elastic_buffer_alignment()
        num_buffer_bytes = _checks.int_arg("num_buffer_bytes", num_buffer_bytes, 1, _checks.INT64_MAX)
        if num_buffer_bytes % align:
            raise ValueError(f"num_buffer_bytes must be a positive multiple of {align} (2 MiB), got {num_buffer_bytes}")
        if num_cpu_buffer_bytes != 0 or cpu_comm is not None:
            raise ValueError("CPU buffer segments (Engram / hybrid) are not supported yet: pass cpu_comm=None, "
                             "num_cpu_buffer_bytes=0")
        num_ranks = _checks.int_arg("num_ranks", num_ranks, 1, _MAX_RANKS)
        rank_idx = _checks.int_arg("rank_idx", rank_idx, 0, num_ranks - 1)
        num_cpu_timeout_secs = _checks.int_arg("num_cpu_timeout_secs", num_cpu_timeout_secs, 1, _checks.INT32_MAX)
        num_gpu_timeout_secs = _checks.int_arg("num_gpu_timeout_secs", num_gpu_timeout_secs, 0, _checks.INT32_MAX)
        if window == "nccl":
            nccl_comm = _comm_arg(nccl_comm)
        _need_cuda("ElasticBuffer")
        self.rank_idx = rank_idx
        self.num_ranks = num_ranks
        self.num_buffer_bytes = num_buffer_bytes
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.num_cpu_timeout_secs = num_cpu_timeout_secs
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        self._destroyed = False
        self._rt = None
        self.device = torch.cuda.current_device()
        self.window = window
        if window == "ipc":
            self._rt = _C.Runtime.create_ipc(self.rank_idx, self.num_ranks, self.num_buffer_bytes,
                                             self.num_cpu_timeout_secs, self.num_gpu_timeout_secs)
        else:
            self._rt = _C.Runtime(self.rank_idx, self.num_ranks, nccl_comm, self.num_buffer_bytes,
                                  self.num_cpu_timeout_secs, self.num_gpu_timeout_secs)
        self.num_device_sms = int(self._rt.num_device_sms)
        # Read once here (environment lookups cost microseconds per call on the critical path).
        self.dispatch_overlap = OverlapConfig.from_env("DISPATCH")
        self.combine_overlap = OverlapConfig.from_env("COMBINE")
        self.dispatch_pdl = os.environ.get("ELASTIC_EP_DISPATCH_PDL", "1") != "0"
        self._refuse_bad_ids = _checks.index_check_enabled()
        self.comm_stream = torch.cuda.Stream(device=self.device)
        self._comm_raw = int(self.comm_stream.cuda_stream)
        # The caller runs a process-group barrier next (the seed does too): no peer may write into this
        # window before every rank finished creating it.

    # ------------------------------------------------------------------------------- CUDA-IPC window
    def get_local_ipc_handle(self) -> bytes:
        """This rank's CUDA IPC handle of its window (``window="ipc"`` only), for the other ranks."""
        if self.window != "ipc":
            raise RuntimeError("get_local_ipc_handle: this buffer's window is NCCL's (window='nccl')")
        if self._destroyed:
            raise RuntimeError("this ElasticBuffer was destroyed")
        return self._rt.ipc_handle()

    def sync(self, ipc_handles: List[bytes]) -> None:
        """Opens every rank's window (``window="ipc"`` only).

        Arguments:
            ipc_handles: ``get_local_ipc_handle()`` of every rank, in rank order.

        Run a process-group barrier afterwards, before the first operation: no rank may write into a
        peer's window before the peer has opened all of them.
        """
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

    # ----------------------------------------------------------------------------------------- life
    def destroy(self) -> None:
        """Waits for all local work, then frees the window, device communicator and host workspace.

        Collective: every rank must call it. Calling it twice raises.
        """
        if self._destroyed:
            raise RuntimeError("ElasticBuffer.destroy() was already called")
        torch.cuda.synchronize(self.device)
        self._destroyed = True
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
        # Device timeouts are raised here, from Python: a C++ exception crossing into Python crashed the
        # process on the GPU machine (see STATUS.md: it was the iostream formatting), so the runtime reports them as data.
        info = self._rt.take_timeout()
        if info is not None:
            raise _timeout_error(info, "the CUDA context is usable but this buffer's signals are out of step: "
                                       "destroy it and create a new one")
        if self._rt.broken:
            raise CommError(f"this elastic buffer is unusable ({self._rt.broken_reason}); destroy it and create "
                            "a new one")
        # Taken even when they are not reported, so that pending_health() is 0 again (the cheap path).
        num_bad, example = self._rt.take_masked_ids()
        if num_bad and self._refuse_bad_ids:  # EP_SKIP_INDEX_CHECK=1: masked silently, as documented
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
                "such ids consistently, the buffer staying usable, or set EP_SKIP_INDEX_CHECK=1 to mask them "
                "silently.")

    def _refused_error(self, num_experts: int) -> ValueError:
        """The ValueError of a CPU-synced dispatch that notify refused on every rank (bad expert ids)."""
        ranks, num_bad, example = self._rt.take_refusal()
        note = (f"rank(s) {ranks} passed top-k expert ids outside [-1, {num_experts}), so every rank refused "
                "this dispatch: nothing was sent and the buffer stays usable")
        if self.rank_idx in ranks:
            if num_bad > 0:
                return ValueError(f"{_checks.expert_ids_error(num_bad, example, num_experts)} ({note})")
            return ValueError(f"topk_idx: expert ids must be in [-1, {num_experts}) ({note})")
        return ValueError(f"dispatch refused: {note}")

    def _cpu_timeout(self, what: str, detail: str, expected: int, observed: int) -> CommTimeoutError:
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
          and a later operation would read stale signals. Unless the runtime already knows (timeouts
          mark it broken themselves), the buffer is marked broken: later calls raise through
          ``_alive()``.
        * any kernel queued: the caller's stream waits for the communication stream, as after a call
          that succeeds. The kernels still read and write tensors that the caller's stream may free
          and reuse, or overwrite, once this raises; they end at the latest at the GPU deadline.
        * always: the caller's stream is current again (``allocate_on_comm_stream`` made the
          communication stream current), so no later work of the caller silently runs there.
        """
        # Each step on its own: a step that fails must neither skip the others nor replace `err`.
        # Inside a CUDA-graph capture nothing ran: the queued kernels exist only in the abandoned graph
        # (which must not be replayed), every epoch and signal is unchanged, so the buffer is fine.
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

    # ---------------------------------------------------------------------------------- properties
    def get_comm_stream(self) -> torch.cuda.Stream:
        """Returns the communication stream every kernel of this buffer runs on."""
        return self.comm_stream

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """Returns ``(num_rdma_ranks, num_nvl_ranks)`` = ``(1, num_ranks)`` in direct mode."""
        return 1, self.num_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """Returns ``(num_scaleout_ranks, num_scaleup_ranks)`` = ``(1, num_ranks)`` in direct mode."""
        return 1, self.num_ranks

    def check_healthy(self) -> None:
        """Raises CommTimeoutError if a device wait of an earlier operation expired (then the buffer
        must be recreated), or CommError if the buffer is unusable."""
        self._alive()

    # --------------------------------------------------------------------------------------- sizing
    @staticmethod
    def get_dispatch_buffer_size(num_max_tokens_per_rank: int, hidden: int, num_sf_packs: int, num_topk: int,
                                 elem_size: int, num_scaleout_ranks: int, num_scaleup_ranks: int,
                                 is_scaleup_nvlink: bool) -> int:
        """Bytes the dispatch needs: the send staging area (none inside NVLink) plus the receive area
        ``[ranks][num_max_tokens_per_rank][token record]``.

        Returns:
            The byte count (not aligned).
        """
        sizes = _sizing.c_ints(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                               num_sf_packs=num_sf_packs, num_topk=num_topk, elem_size=elem_size,
                               num_scaleout_ranks=num_scaleout_ranks, num_scaleup_ranks=num_scaleup_ranks)
        return int(_C.get_dispatch_buffer_size(*sizes, bool(is_scaleup_nvlink)))

    @staticmethod
    def get_combine_buffer_size(num_max_tokens_per_rank: int, hidden: int, num_topk: int, num_scaleout_ranks: int,
                                num_scaleup_ranks: int, is_scaleup_nvlink: bool,
                                allow_multiple_reduction: bool) -> int:
        """Bytes the combine needs: ``[num_max_tokens_per_rank][slots][bf16 row + K weights]`` with
        ``slots = min(R, K)`` under multiple reduction, else ``K``.

        Returns:
            The byte count (not aligned).
        """
        sizes = _sizing.c_ints(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk,
                               num_scaleout_ranks=num_scaleout_ranks, num_scaleup_ranks=num_scaleup_ranks)
        return int(_C.get_combine_buffer_size(*sizes, bool(is_scaleup_nvlink), bool(allow_multiple_reduction)))

    @staticmethod
    def calculate_buffer_size(nccl_comm: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int,
                              use_fp8_dispatch: bool, allow_hybrid_mode: bool,
                              allow_multiple_reduction: bool) -> int:
        """The seed's ``calculate_buffer_size``: the 2 MiB-aligned maximum of the dispatch and combine
        sizes (``num_topk == 0`` sizes for top-32; FP8 sizes one SF pack per 32 elements).

        Arguments:
            nccl_comm: the communicator (gives the domain sizes), or an int rank count when no
                communicator exists yet (CPU tests).
        Returns:
            Buffer bytes, a multiple of 2 MiB.
        """
        num_max_tokens_per_rank, hidden, num_topk = _sizing.c_ints(
            num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk)
        nccl_comm = _comm_arg(nccl_comm)
        if 0 < nccl_comm <= _MAX_RANKS:
            scaleout, scaleup = 1, nccl_comm  # a rank count (no communicator needed)
        else:
            scaleout, scaleup = get_logical_domain_size(nccl_comm, allow_hybrid_mode)
        return int(_C.calculate_buffer_size_for_domain(num_max_tokens_per_rank, hidden, num_topk,
                                                       bool(use_fp8_dispatch), scaleout, scaleup, True,
                                                       bool(allow_multiple_reduction)))

    # ---------------------------------------------------------------------------------- stream control
    def stream_control_prologue(self, previous_event: Optional[EventHandle], allocate_on_comm_stream: bool,
                                async_with_compute_stream: bool) -> torch.cuda.Stream:
        """Makes the communication stream wait for ``previous_event`` (or the compute stream) and, with
        ``allocate_on_comm_stream``, makes it current. Returns the compute stream."""
        compute_stream = torch.cuda.current_stream()
        if previous_event is not None and not allocate_on_comm_stream:
            raise ValueError("previous_event requires allocate_on_comm_stream=True (the tensors of overlapped "
                             "compute must not be reused by allocations on the compute stream)")
        _stream_wait(self.comm_stream, previous_event if previous_event is not None else compute_stream)
        # Last: either this raised above with the caller's stream still current, or it returns the
        # stream that the caller (dispatch / combine, also on their error paths) must make current again.
        if allocate_on_comm_stream:
            torch.cuda.set_stream(self.comm_stream)
        return compute_stream

    def stream_control_before_epilogue(self, previous_event_before_epilogue: Optional[EventHandle]) -> None:
        """Makes the communication stream wait for ``previous_event_before_epilogue`` if given."""
        if previous_event_before_epilogue is not None:
            _stream_wait(self.comm_stream, previous_event_before_epilogue)

    def stream_control_epilogue(self, tensors: Sequence[Optional[torch.Tensor]], compute_stream: torch.cuda.Stream,
                                allocate_on_comm_stream: bool, async_with_compute_stream: bool
                                ) -> Optional[EventHandle]:
        """Either makes the compute stream wait for the communication stream, or (async) returns an event
        and records the tensors on both streams. Restores the compute stream as current."""
        event = None
        if async_with_compute_stream:
            event = EventHandle(self.comm_stream)
            if os.environ.get("EP_AVOID_RECORD_STREAM", "0") == "1":
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

    # ------------------------------------------------------------------------------------- barrier
    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """An NVLink barrier of all ranks (collective), on the communication or the current stream.

        Arguments:
            use_comm_stream: run on the communication stream (ordered after the compute stream, which
                then waits for it).
            with_cpu_sync: synchronise the device before and after (the host returns once every rank
                arrived); also raises device timeouts.
            sequential: accepted for compatibility (the barrier is always one kernel).
        """
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

    # ------------------------------------------------------------------------------------- dispatch
    def dispatch(
        self,
        x: torch.Tensor,
        sf: Optional[torch.Tensor],
        topk_idx: Optional[torch.Tensor],
        topk_weights: Optional[torch.Tensor],
        cumulative_local_expert_recv_stats: Optional[torch.Tensor],
        cached_num_recv_tokens: Optional[int],
        cached_num_expanded_tokens: Optional[int],
        cached_num_recv_tokens_per_expert_list: Optional[List[int]],
        cached_psum_num_recv_tokens_per_scaleup_rank: Optional[torch.Tensor],
        cached_psum_num_recv_tokens_per_expert: Optional[torch.Tensor],
        cached_num_unaligned_recv_tokens_per_expert: Optional[torch.Tensor],
        cached_dst_buffer_slot_idx: Optional[torch.Tensor],
        cached_token_metadata_at_forward: Optional[torch.Tensor],
        cached_recv_src_metadata: Optional[torch.Tensor],
        cached_channel_linked_list: Optional[torch.Tensor],
        num_max_tokens_per_rank: int,
        num_experts: int,
        expert_alignment: int,
        num_sms: int,
        num_qps: int,
        previous_event: Optional[EventHandle],
        previous_event_before_epilogue: Optional[EventHandle],
        async_with_compute_stream: bool,
        allocate_on_comm_stream: bool,
        do_handle_copy: bool,
        do_cpu_sync: bool,
        do_expand: bool,
        do_zero_padding: bool,
        use_tma_aligned_col_major_sf: bool,
        _validated: bool = False,
    ):
        """Sends each token to the ranks owning its top-k experts (the seed's ``dispatch``).

        Arguments:
            x: ``[T, hidden]`` bf16 or float8_e4m3fn, contiguous, ``hidden * elem_size % 16 == 0``.
            sf: FP8 scales ``[T, packs]`` float32 or int32 (packed UE8M0 x4), any strides; None for bf16.
            topk_idx: ``[T, K]`` int64 global expert ids, -1 for masked lanes (cached mode: the handle's).
            topk_weights: ``[T, K]`` float32 or None.
            cumulative_local_expert_recv_stats: ``[L]`` int32, incremented by the real counts, or None.
            cached_*: a previous dispatch's handle fields (cached mode when ``cached_num_recv_tokens`` is
                not None); the routing must be identical.
            num_max_tokens_per_rank: the bound the buffer was sized for; ``T`` must not exceed it.
            num_experts: total experts ``E``, a multiple of the rank count (``L = E / R`` local experts).
            expert_alignment: per-expert row alignment (>= 1).
            num_sms: blocks for the push and copy kernels (0: all SMs).
            num_qps: accepted (no RDMA in direct mode).
            previous_event, previous_event_before_epilogue, async_with_compute_stream,
            allocate_on_comm_stream: stream control with the seed's semantics.
            do_handle_copy: clone ``topk_idx`` into the handle.
            do_cpu_sync: wait on the host for the counts and return exact-size outputs; otherwise
                worst-case sizes (counts stay on the GPU; CUDA-graph capturable).
            do_expand: one output row per (token, local expert) in aligned expert segments.
            do_zero_padding: zero the alignment gaps (expand mode only).
            use_tma_aligned_col_major_sf: return ``recv_sf`` column-major with token stride 1 and
                pack stride ``align(N, 4)``.
            _validated: internal; the front end (``elastic_ep.ElasticBuffer``) already ran every check
                of ``_check_dispatch`` (each costs host time on the critical path of a CPU-synced call).

        Returns:
            The seed's 16-tuple ``(recv_x, recv_sf, recv_topk_idx, recv_topk_weights, copied_topk_idx,
            num_recv_tokens, num_expanded_tokens, num_recv_tokens_per_expert_list,
            psum_num_recv_tokens_per_scaleup_rank, psum_num_recv_tokens_per_expert,
            num_unaligned_recv_tokens_per_expert, recv_src_metadata, dst_buffer_slot_idx,
            token_metadata_at_forward (None), channel_linked_list (None), event)``.
        """
        self._alive()
        R = self.num_ranks
        cached = cached_num_recv_tokens is not None
        if not _validated:
            self._check_dispatch(x, sf, topk_idx, topk_weights, cumulative_local_expert_recv_stats,
                                 cached_num_recv_tokens, cached_num_expanded_tokens,
                                 cached_num_recv_tokens_per_expert_list, cached_psum_num_recv_tokens_per_scaleup_rank,
                                 cached_psum_num_recv_tokens_per_expert, cached_num_unaligned_recv_tokens_per_expert,
                                 cached_dst_buffer_slot_idx, cached_recv_src_metadata, num_max_tokens_per_rank,
                                 num_experts, expert_alignment, do_cpu_sync, do_expand, do_zero_padding)
        T, hidden = x.shape
        hidden_bytes = hidden * x.element_size()
        K = topk_idx.shape[1]
        L = num_experts // R
        # The epilogue's event is used only after notify and the push are queued: check it now.
        if previous_event_before_epilogue is not None and not isinstance(previous_event_before_epilogue,
                                                                         EventHandle):
            raise ValueError("previous_event_before_epilogue: expected None or an EventHandle, got "
                             f"{type(previous_event_before_epilogue).__name__}")
        num_sf_packs = sf.shape[1] if sf is not None else 0
        num_sms = self._num_sms(num_sms)
        # Overlapped dispatch: the push gets `push_sms` blocks, the epilogue (on the runtime's second
        # stream, beside the push) the rest. Not when an event must gate the epilogue, nor with a
        # grid larger than the GPU: the epilogue's blocks wait for the push's, so both kernels must
        # fit on the SMs at once (the overlapped combine is one kernel and orders its blocks itself).
        push_sms = 0
        if previous_event_before_epilogue is None and num_sms <= self.num_device_sms:
            push_sms = _overlap_push_blocks(self.dispatch_overlap, R, num_sms, num_max_tokens_per_rank)
        overlap = push_sms > 0
        epilogue_sms = num_sms - push_sms if overlap else num_sms
        # The default stream setup (no events, outputs on the compute stream) is done by the runtime
        # around its launches; the other modes go through the stream_control_* methods.
        fast_streams = previous_event is None and not allocate_on_comm_stream and not async_with_compute_stream
        compute_raw = _current_raw_stream(self.device)
        # Expert ids outside [-1, E): with a CPU sync, notify counts them and the dispatch is refused on
        # every rank (no output is written, every host raises below, the buffer stays usable); without
        # one, notify masks them and the next call raises (take_masked_ids in _alive). With
        # EP_SKIP_INDEX_CHECK=1 they are only masked.
        refuse_bad_ids = do_cpu_sync and not cached and self._refuse_bad_ids

        dev = x.device

        def allocate_notify_outputs():
            if cached:
                return (cached_psum_num_recv_tokens_per_scaleup_rank, None, cached_num_unaligned_recv_tokens_per_expert,
                        cached_dst_buffer_slot_idx, None)
            # One allocation for the four int32 arrays notify writes (each allocation costs host time
            # on the critical path of a CPU-synced dispatch).
            # (Slices, not torch.split: split costs several times more host time.)
            ints = torch.empty(R + (L + 1) + L + T * K, dtype=torch.int32, device=dev)
            a, b, c = R, R + L + 1, R + 2 * L + 1
            copied = torch.empty_like(topk_idx) if do_handle_copy else None
            return ints[:a], ints[a:b], ints[b:c], ints[c:].view(T, K), copied

        compute_stream = None
        stage = _NOTHING_QUEUED  # how far this call got, for _abandon if anything below raises
        try:
            if not fast_streams:
                # Stream control; every allocation below happens after it (on the comm stream if asked).
                compute_stream = self.stream_control_prologue(previous_event, allocate_on_comm_stream,
                                                              async_with_compute_stream)
            psum_rank, psum_expert_full, unaligned, slot_idx, copied_topk_idx = allocate_notify_outputs()
            psum_expert = cached_psum_num_recv_tokens_per_expert if cached else None

            inputs = dict(x=_ptr(x), sf=_ptr(sf), sf_token_stride=sf.stride(0) if sf is not None else 0,
                          sf_hidden_stride=sf.stride(1) if sf is not None else 0)
            # From here until the epilogue is queued, this rank owes its peers the rest of the operation.
            # (Set before the call: a launch error inside it may come after notify was queued.)
            stage = _EPILOGUE_OWED
            self._rt.dispatch(dict(
                inputs,
                topk_idx=_ptr(topk_idx), topk_weights=_ptr(topk_weights), copied_topk_idx=_ptr(copied_topk_idx),
                cumulative_stats=0 if cached else _ptr(cumulative_local_expert_recv_stats),
                psum_rank=_ptr(psum_rank), psum_expert=_ptr(psum_expert_full), unaligned_expert=_ptr(unaligned),
                slot_idx=_ptr(slot_idx), num_tokens=T, num_max_tokens_per_rank=num_max_tokens_per_rank,
                hidden_bytes=hidden_bytes, num_sf_packs=num_sf_packs, num_experts=num_experts, num_topk=K,
                expert_alignment=expert_alignment, cached=int(cached), num_sms=push_sms if overlap else num_sms,
                refuse_bad_ids=int(refuse_bad_ids), overlap=int(overlap),
                concurrent_notify=int(self.dispatch_pdl and not overlap),
            ), self._comm_raw, compute_raw if fast_streams else _NO_STREAM)

            if cached:
                num_recv_tokens = int(cached_num_recv_tokens)
                num_expanded_tokens = int(cached_num_expanded_tokens)
                num_recv_tokens_per_expert_list = list(cached_num_recv_tokens_per_expert_list)
            elif do_cpu_sync:
                status, num_recv_tokens, num_expanded_tokens, num_recv_tokens_per_expert_list, nr, ne = \
                    self._rt.wait_dispatch_counts(L)
                # The runtime itself marks the buffer broken on a device or CPU timeout (statuses 1, 2).
                if status == 1:
                    self._alive()  # raises the device timeout
                elif status == 2:
                    # Which peer is late is known on the GPU only: this rank's notify publishes the counts
                    # once every peer's arrived, and its own deadline names the peer it waits for.
                    raise self._cpu_timeout("dispatch CPU wait for the token counts",
                                            f"ranks whose counts arrived {nr}/{R}, local experts {ne}/{L} (the "
                                            "notify kernel publishes them only once every peer's counts arrived; "
                                            "a num_gpu_timeout_secs shorter than num_cpu_timeout_secs makes the "
                                            "device deadline report first, naming the peer); destroy this buffer "
                                            "and create a new one", R + L, nr + ne)
                elif status == 3:
                    # Refused on every rank: the push kernel ended the operation without an epilogue, so
                    # nothing is owed and the buffer stays usable.
                    stage = _ALL_QUEUED
                    raise self._refused_error(num_experts)
            else:
                num_recv_tokens = int(_C.worst_case_num_recv_tokens(R, num_max_tokens_per_rank))
                num_expanded_tokens = int(_C.worst_case_num_expanded_tokens(R, num_max_tokens_per_rank, K, L,
                                                                            expert_alignment))
                num_recv_tokens_per_expert_list = []

            n_alloc = num_expanded_tokens if do_expand else num_recv_tokens
            recv_x = torch.empty((n_alloc, hidden), dtype=x.dtype, device=dev)
            recv_sf = None
            sf_ts = sf_hs = 0
            if sf is not None:
                if use_tma_aligned_col_major_sf:
                    sf_ts, sf_hs = 1, (n_alloc + _SF_PACK_ALIGN - 1) // _SF_PACK_ALIGN * _SF_PACK_ALIGN
                else:
                    sf_ts, sf_hs = num_sf_packs, 1
                recv_sf = torch.empty_strided((n_alloc, num_sf_packs), (sf_ts, sf_hs), dtype=sf.dtype, device=dev)
            recv_topk_idx = None if do_expand else torch.empty((n_alloc, K), dtype=topk_idx_t, device=dev)
            recv_topk_weights = None
            if topk_weights is not None:
                recv_topk_weights = torch.empty((n_alloc,) if do_expand else (n_alloc, K), dtype=torch.float32,
                                                device=dev)
            recv_src_metadata = cached_recv_src_metadata if cached else torch.empty((num_recv_tokens, K + 2),
                                                                                     dtype=torch.int32, device=dev)
            if not cached:
                # Expand mode: the exclusive starts (become start + count); otherwise the inclusive sums.
                psum_expert = psum_expert_full[:L] if do_expand else psum_expert_full[1:]
            self.stream_control_before_epilogue(previous_event_before_epilogue)
            self._rt.dispatch_epilogue(dict(
                inputs,  # rows this rank sends to itself are copied from x by the epilogue
                recv_x=_ptr(recv_x), recv_sf=_ptr(recv_sf), recv_sf_token_stride=sf_ts, recv_sf_hidden_stride=sf_hs,
                recv_topk_idx=_ptr(recv_topk_idx), recv_topk_weights=_ptr(recv_topk_weights),
                recv_src_metadata=_ptr(recv_src_metadata), psum_rank=_ptr(psum_rank),
                psum_expert=0 if cached else _ptr(psum_expert_full),
                unaligned_expert=_ptr(unaligned), num_max_tokens_per_rank=num_max_tokens_per_rank,
                hidden_bytes=hidden_bytes, num_sf_packs=num_sf_packs, num_experts=num_experts, num_topk=K,
                expert_alignment=expert_alignment, do_expand=int(do_expand), cached=int(cached),
                do_zero_padding=int(do_zero_padding), num_sms=epilogue_sms, overlap=int(overlap),
            ), self._comm_raw, compute_raw if fast_streams else _NO_STREAM)
            stage = _ALL_QUEUED
            event = None
            if not fast_streams:
                event = self.stream_control_epilogue(
                    [x, sf, topk_idx, topk_weights, recv_x, recv_sf, recv_topk_idx, recv_topk_weights,
                     cumulative_local_expert_recv_stats, copied_topk_idx, psum_rank, psum_expert_full, psum_expert,
                     unaligned, recv_src_metadata, slot_idx],
                    compute_stream, allocate_on_comm_stream, async_with_compute_stream)
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too: re-raised after the clean-up
            self._abandon("dispatch", e, stage, compute_stream, allocate_on_comm_stream)
            raise
        return (recv_x, recv_sf, recv_topk_idx, recv_topk_weights, copied_topk_idx, num_recv_tokens,
                num_expanded_tokens, num_recv_tokens_per_expert_list, psum_rank, psum_expert, unaligned,
                recv_src_metadata, slot_idx, None, None, event)

    def _check_dispatch(self, x, sf, topk_idx, topk_weights, cumulative_local_expert_recv_stats,
                        cached_num_recv_tokens, cached_num_expanded_tokens, cached_num_recv_tokens_per_expert_list,
                        cached_psum_num_recv_tokens_per_scaleup_rank, cached_psum_num_recv_tokens_per_expert,
                        cached_num_unaligned_recv_tokens_per_expert, cached_dst_buffer_slot_idx,
                        cached_recv_src_metadata, num_max_tokens_per_rank, num_experts, expert_alignment,
                        do_cpu_sync, do_expand, do_zero_padding) -> None:
        """Every argument check of ``dispatch``; raises ValueError before anything is launched."""
        R, dev = self.num_ranks, self.device
        cached = cached_num_recv_tokens is not None
        _checks.check_dispatch_modes(do_expand, do_zero_padding, do_cpu_sync, _checks.cached_handle_fields(locals()))
        # The binding's parser refuses what is not an int, but only once notify may be queued.
        num_max_tokens_per_rank = _checks.int_arg("num_max_tokens_per_rank", num_max_tokens_per_rank, 1)
        _check_cuda_tensor("x", x, (torch.bfloat16,) + _FP8_DTYPES, 2, dev)
        T, hidden = x.shape
        hidden_bytes = hidden * x.element_size()
        if hidden_bytes % 16:
            raise ValueError(f"x rows must be a multiple of 16 bytes, got hidden={hidden} x {x.element_size()} B")
        if T > num_max_tokens_per_rank:
            raise ValueError(f"x has {T} tokens, more than num_max_tokens_per_rank={num_max_tokens_per_rank}")
        if topk_idx is None:
            raise ValueError("topk_idx is required (cached mode passes the handle's topk_idx)")
        _check_cuda_tensor("topk_idx", topk_idx, (topk_idx_t,), 2, dev)
        if topk_idx.shape[0] != T:
            raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows, x has {T}")
        K = topk_idx.shape[1]
        if not 1 <= K <= _MAX_TOPK:
            raise ValueError(f"num_topk must be in [1, {_MAX_TOPK}], got {K}")
        num_experts, _ = _checks.check_routing(num_experts, expert_alignment, R, num_max_tokens_per_rank, K)
        L = num_experts // R
        is_fp8 = x.dtype != torch.bfloat16
        num_sf_packs = 0
        if sf is not None:
            if not is_fp8:
                raise ValueError("sf must be None for bf16 x")
            _check_cuda_tensor("sf", sf, (torch.float32, torch.int32), 2, dev, contiguous=False)
            if sf.shape[0] != T:
                raise ValueError(f"sf has {sf.shape[0]} rows, x has {T}")
            num_sf_packs = sf.shape[1]
        elif is_fp8:
            raise ValueError("FP8 x needs its scales: pass sf ([T, packs] float32 or packed int32)")
        if topk_weights is not None:
            _check_cuda_tensor("topk_weights", topk_weights, (torch.float32,), 2, dev)
            if tuple(topk_weights.shape) != (T, K):
                raise ValueError(f"topk_weights must be [{T}, {K}], got {tuple(topk_weights.shape)}")
        if cumulative_local_expert_recv_stats is not None:
            _check_cuda_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                               (torch.int32,), 1, dev)
            if cumulative_local_expert_recv_stats.shape[0] != L:
                raise ValueError(f"cumulative_local_expert_recv_stats must have {L} entries, got "
                                 f"{cumulative_local_expert_recv_stats.shape[0]}")
        need = self.get_dispatch_buffer_size(num_max_tokens_per_rank, hidden, num_sf_packs, K, x.element_size(), 1, R,
                                             True)
        if need > self.num_buffer_bytes:
            raise ValueError(f"buffer too small: this dispatch needs {need} bytes (num_max_tokens_per_rank="
                             f"{num_max_tokens_per_rank}, hidden={hidden}, topk={K}), the buffer has "
                             f"{self.num_buffer_bytes}")
        if cached:
            self._check_cached_handle(T, K, L, cached_psum_num_recv_tokens_per_scaleup_rank,
                                      cached_psum_num_recv_tokens_per_expert,
                                      cached_num_unaligned_recv_tokens_per_expert, cached_dst_buffer_slot_idx,
                                      cached_recv_src_metadata, cached_num_recv_tokens)

    def _check_cached_handle(self, T, K, L, psum_rank, psum_expert, unaligned, slot_idx, meta, num_recv) -> None:
        R = self.num_ranks
        for name, t, shape in (("cached_psum_num_recv_tokens_per_scaleup_rank", psum_rank, (R,)),
                               ("cached_psum_num_recv_tokens_per_expert", psum_expert, (L,)),
                               ("cached_num_unaligned_recv_tokens_per_expert", unaligned, (L,)),
                               ("cached_dst_buffer_slot_idx", slot_idx, (T, K)),
                               ("cached_recv_src_metadata", meta, (int(num_recv), K + 2))):
            _check_cuda_tensor(name, t, (torch.int32,), len(shape), self.device)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} does not match this dispatch: expected shape {shape}, got {tuple(t.shape)} "
                                 "(the handle comes from a dispatch with other tokens, top-k or ranks)")

    def _num_sms(self, num_sms: int) -> int:
        if num_sms < 0 or num_sms > self.num_device_sms:
            raise ValueError(f"num_sms must be in [0, {self.num_device_sms}], got {num_sms}")
        return num_sms if num_sms > 0 else self.num_device_sms

    # -------------------------------------------------------------------------------------- combine
    def combine(
        self,
        x: torch.Tensor,
        topk_weights: Optional[torch.Tensor],
        bias_0: Optional[torch.Tensor],
        bias_1: Optional[torch.Tensor],
        src_metadata: torch.Tensor,
        combined_topk_idx: torch.Tensor,
        psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
        token_metadata_at_forward: Optional[torch.Tensor],
        channel_linked_list: Optional[torch.Tensor],
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_sms: int,
        num_qps: int,
        previous_event: Optional[EventHandle],
        previous_event_before_epilogue: Optional[EventHandle],
        async_with_compute_stream: bool,
        allocate_on_comm_stream: bool,
        use_expanded_layout: bool,
        _validated: bool = False,
    ):
        """Sends expert outputs back to the tokens' origins and reduces them (the seed's ``combine``).

        Arguments:
            x: ``[N, hidden]`` bf16 rows in dispatch receive order, or ``[N_exp, hidden]`` in the expanded
                layout; contiguous, ``hidden % 8 == 0``.
            topk_weights: ``[N, K]`` (or ``[N_exp]`` expanded) float32 to route back, or None.
            bias_0, bias_1: ``[T, hidden]`` bf16 added after the sum, or None.
            src_metadata: the dispatch handle's ``recv_src_metadata`` ``[N, K + 2]`` int32.
            combined_topk_idx: the origin's ``topk_idx`` ``[T, K]`` int64 of that dispatch.
            psum_num_recv_tokens_per_scaleup_rank: the handle's ``[R]`` int32.
            token_metadata_at_forward, channel_linked_list: hybrid only; must be None.
            num_experts, num_max_tokens_per_rank: as in the dispatch.
            num_sms: blocks (0: all SMs); num_qps: accepted, unused.
            previous_event, previous_event_before_epilogue, async_with_compute_stream,
            allocate_on_comm_stream: stream control with the seed's semantics.
            use_expanded_layout: ``x`` is in the expanded (per-expert) layout of an expand dispatch.
            _validated: internal; the front end already ran every check of ``_check_combine``.

        Returns:
            ``(combined_x [T, hidden] bf16, combined_topk_weights [T, K] float32 or None, event or None)``.
        """
        self._alive()
        if not _validated:
            self._check_combine(x, topk_weights, bias_0, bias_1, src_metadata, combined_topk_idx,
                                psum_num_recv_tokens_per_scaleup_rank, token_metadata_at_forward, channel_linked_list,
                                num_experts, num_max_tokens_per_rank, use_expanded_layout)
        hidden = x.shape[1]
        T, K = combined_topk_idx.shape
        num_sms = self._num_sms(num_sms)
        fast_streams = previous_event is None and not allocate_on_comm_stream and not async_with_compute_stream
        compute_stream = None
        stage = _NOTHING_QUEUED  # how far this call got, for _abandon if anything below raises
        try:
            if not fast_streams:
                compute_stream = self.stream_control_prologue(previous_event, allocate_on_comm_stream,
                                                              async_with_compute_stream)
            compute_raw = _current_raw_stream(self.device) if fast_streams else _NO_STREAM
            combined_x = torch.empty((T, hidden), dtype=torch.bfloat16, device=x.device)
            combined_w = (torch.empty((T, K), dtype=torch.float32, device=x.device) if topk_weights is not None
                          else None)
            # previous_event_before_epilogue gates only the reduce: the push overlaps what it marks.
            wait_event = 0
            if previous_event_before_epilogue is not None and previous_event_before_epilogue.event is not None:
                wait_event = int(previous_event_before_epilogue.event.cuda_event)
            overlap_push_blocks = 0 if wait_event else _overlap_push_blocks(self.combine_overlap, self.num_ranks,
                                                                            num_sms, num_max_tokens_per_rank)
            # The push and the reduce (which ends the operation) are queued by this one call; if it
            # raises, the push may be queued without the reduce.
            stage = _EPILOGUE_OWED
            self._rt.combine(dict(
                x=_ptr(x), topk_weights=_ptr(topk_weights), src_metadata=_ptr(src_metadata),
                psum_rank=_ptr(psum_num_recv_tokens_per_scaleup_rank), combined_topk_idx=_ptr(combined_topk_idx),
                combined_x=_ptr(combined_x), combined_topk_weights=_ptr(combined_w), bias0=_ptr(bias_0),
                bias1=_ptr(bias_1), num_combined_tokens=T, num_max_tokens_per_rank=num_max_tokens_per_rank,
                hidden=hidden, num_experts=num_experts, num_topk=K, use_expanded_layout=int(use_expanded_layout),
                allow_multiple_reduction=int(self.allow_multiple_reduction), num_sms=num_sms,
                overlap_push_blocks=overlap_push_blocks,
            ), self._comm_raw, wait_event, compute_raw, compute_raw)
            stage = _ALL_QUEUED
            event = None
            if not fast_streams:
                event = self.stream_control_epilogue(
                    [x, topk_weights, bias_0, bias_1, src_metadata, combined_topk_idx, combined_x, combined_w,
                     psum_num_recv_tokens_per_scaleup_rank], compute_stream, allocate_on_comm_stream,
                    async_with_compute_stream)
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too: re-raised after the clean-up
            self._abandon("combine", e, stage, compute_stream, allocate_on_comm_stream)
            raise
        return combined_x, combined_w, event

    def _check_combine(self, x, topk_weights, bias_0, bias_1, src_metadata, combined_topk_idx,
                       psum_num_recv_tokens_per_scaleup_rank, token_metadata_at_forward, channel_linked_list,
                       num_experts, num_max_tokens_per_rank, use_expanded_layout) -> None:
        """Every argument check of ``combine``; raises ValueError before anything is launched."""
        R, dev = self.num_ranks, self.device
        _check_cuda_tensor("x", x, (torch.bfloat16,), 2, dev)
        N, hidden = x.shape
        if (hidden * 2) % 16:
            raise ValueError(f"combine needs hidden % 8 == 0 (16-byte rows), got hidden={hidden}")
        _check_cuda_tensor("combined_topk_idx", combined_topk_idx, (topk_idx_t,), 2, dev)
        T, K = combined_topk_idx.shape
        # K is the kernels' lane count: 0 would divide by zero, more than 32 breaks their one-warp lane
        # logic (the dispatch that made the handle allowed only [1, 32]).
        if not 1 <= K <= _MAX_TOPK:
            raise ValueError(f"combined_topk_idx must be [T, K] with K (num_topk) in [1, {_MAX_TOPK}], got shape "
                             f"{tuple(combined_topk_idx.shape)}")
        if T > num_max_tokens_per_rank:
            raise ValueError(f"combined_topk_idx has {T} tokens, more than num_max_tokens_per_rank="
                             f"{num_max_tokens_per_rank}")
        _check_cuda_tensor("psum_num_recv_tokens_per_scaleup_rank", psum_num_recv_tokens_per_scaleup_rank,
                           (torch.int32,), 1, dev)
        if psum_num_recv_tokens_per_scaleup_rank.shape[0] != R:
            raise ValueError(f"psum_num_recv_tokens_per_scaleup_rank must have {R} entries")
        _check_cuda_tensor("src_metadata", src_metadata, (torch.int32,), 2, dev)
        if src_metadata.shape[1] != K + 2:
            raise ValueError(f"src_metadata must be [N, K+2={K + 2}], got {tuple(src_metadata.shape)}")
        if not use_expanded_layout and src_metadata.shape[0] != N:
            raise ValueError(f"x has {N} rows but src_metadata has {src_metadata.shape[0]} (non-expanded layout)")
        if num_experts <= 0 or num_experts % R:
            raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of the rank count ({R})")
        if token_metadata_at_forward is not None or channel_linked_list is not None:
            raise ValueError("hybrid-mode metadata given, but this buffer runs in direct mode")
        if topk_weights is not None:
            _check_cuda_tensor("topk_weights", topk_weights, (torch.float32,), 1 if use_expanded_layout else 2, dev)
            want = (N,) if use_expanded_layout else (N, K)
            if tuple(topk_weights.shape) != want:
                raise ValueError(f"topk_weights must be {list(want)}, got {list(topk_weights.shape)}")
        for name, b in (("bias_0", bias_0), ("bias_1", bias_1)):
            if b is not None:
                _check_cuda_tensor(name, b, (torch.bfloat16,), 2, dev)
                if tuple(b.shape) != (T, hidden):
                    raise ValueError(f"{name} must be [{T}, {hidden}], got {list(b.shape)}")
        need = self.get_combine_buffer_size(num_max_tokens_per_rank, hidden, K, 1, R, True,
                                            self.allow_multiple_reduction)
        if need > self.num_buffer_bytes:
            raise ValueError(f"buffer too small: this combine needs {need} bytes, the buffer has {self.num_buffer_bytes}")

