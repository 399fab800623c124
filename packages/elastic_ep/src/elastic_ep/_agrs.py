"""AGRS, all-gather sessions (DeepEP V2's ``agrs_*`` and ``all_gather``): the session state, its argument
checks, and the two backends' parts.

A session is a bump allocator over the session region: each ``all_gather`` takes the next
``align32(R x nbytes)`` bytes per tensor and one of ``num_max_all_gathers_per_session`` slots; results are
views of the region, valid until a later session reuses it. ``AllGatherSessions`` keeps that state and
validates every call into an ``AllGatherArgs`` for its part (``AgrsPart``):

* ``NativeAgrs`` (kernels/agrs.cuh): the region is the start of every rank's buffer, in the window that
  dispatch and combine use (NCCL LSA pointers or the CUDA-IPC window; no NIC or NCCL GIN, unlike
  DeepEP V2). An ``all_gather`` copies this rank's part of each tensor into every rank's region with the
  copy engines (``cudaMemcpyAsync`` to the peers' window addresses, on the communication stream after it
  waited for the current stream: no SMs taken from compute), then one small kernel counts the gather,
  signals every peer and waits until every peer's copies landed; ``wait()`` makes the current stream
  wait for that. Ending a session counts it, signals every peer and waits for every peer's end, so
  nobody writes the next session's gathers into a region whose owner may still read the previous
  results. Every device wait has the ``num_gpu_timeout_secs`` deadline; an expired one makes the next
  call raise ``CommTimeoutError`` naming the operation, rank and peer. The region aliases the
  dispatch/combine area: a buffer runs one kind of operation at a time, as DeepEP's.
* ``TorchAgrs``: a region of this rank's own, one asynchronous ``all_gather_single`` of bytes per tensor,
  each wait bounded by ``num_cpu_timeout_secs`` (gloo).

Both check that every rank gathers the same tensors (``_peer_calls``: count, dtypes, sizes, shapes and
the gather's place in the session). The torch runtime all-gathers the gathers' records before posting
anything: a difference raises on every rank at once, nothing moved and the session unchanged. The
native one compares them on the GPU after its copies (its signal carries the record's digest): every
rank's next call raises (``all_gather`` and ``destroy_agrs_session`` after queuing their own work, so
that every rank's device steps stay in step whenever its host hears of it); the session's earlier
results are intact, and the error says to end the session.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ._checks import check_dense, describe, int_arg, is_sequence, itemsize, off_device
from ._collective import agree_on_every_rank, gather_ints, group_device, on_every_rank
from ._peer_calls import agrs_difference, agrs_gather_error, agrs_record
from ._sizing import ALIGNMENT_BYTES, align

__all__ = ["AllGatherArgs", "AllGatherSessions", "AgrsPart", "NativeAgrs", "TorchAgrs", "MAX_AGRS_PER_SESSION",
           "agrs_shapes", "get_agrs_num_max_session_bytes", "get_agrs_buffer_size_hint"]

#: Most all-gathers one AGRS session may hold (DeepEP V2's in-flight limit of its workspace).
MAX_AGRS_PER_SESSION = 32
Shapes = Union[Tuple[int, ...], Sequence[Tuple[int, ...]]]
Gathered = Tuple[List[torch.Tensor], Callable[[], None]]


@dataclass(eq=False)
class AllGatherArgs:
    """A validated all-gather: where each tensor's ``[R, ...]`` result lies in the session region. Rank
    ``r``'s part of tensor ``i`` is the ``tensors[i].nbytes`` bytes at ``offsets[i] + r * tensors[i].nbytes``."""

    tensors: List[torch.Tensor]                 # contiguous, on the buffer's device, any dtype
    offsets: List[int]                          # byte offsets in the session region, multiples of 32
    inplace: List[bool]                         # the tensor already is this rank's part of its result
    session_idx: int                            # >= 1, the session the gather belongs to
    slot_idx: int                               # the gather's index in its session
    record: List[int]                           # what every rank must agree on (_peer_calls.agrs_record)


# ---------------------------------------------------------------------------------------------- sizes
def agrs_shapes(shapes: Any) -> Tuple[List[Tuple[int, ...]], bool]:
    """``(shapes as tuples, batched)``: one shape (a tuple / ``torch.Size`` of ints) or a non-empty
    sequence of them; ``batched`` when a sequence of shapes was given."""
    if not is_sequence(shapes) or not shapes:
        raise ValueError(f"shapes: expected a shape or a non-empty sequence of shapes, got {shapes!r}")
    batched = is_sequence(shapes[0])  # a torch.Size starts with an int too
    out = []
    for i, shape in enumerate(shapes if batched else (shapes,)):
        if not is_sequence(shape):
            raise ValueError(f"shapes[{i}]: expected a shape (a sequence of ints), got {shape!r}")
        out.append(tuple(int_arg(f"shapes[{i}]", d, 0) for d in shape))
    return out, batched


def get_agrs_num_max_session_bytes(group: dist.ProcessGroup, shapes: Shapes, dtype: torch.dtype) -> int:
    """Bytes one AGRS session gathering tensors of ``shapes`` (one shape or a sequence of them) would
    use (DeepEP's hint): the sum of ``ranks x elements x itemsize``, each rounded up to 32 B."""
    shapes = agrs_shapes(shapes)[0]
    size = itemsize(dtype)
    R = dist.get_world_size(group)
    return sum(align(R * math.prod(s) * size, 32) for s in shapes)


def get_agrs_buffer_size_hint(group: dist.ProcessGroup, num_max_session_bytes: int) -> int:
    """``num_max_session_bytes`` rounded up to 2 MiB (DeepEP's AGRS buffer hint)."""
    return align(int_arg("num_max_session_bytes", num_max_session_bytes, 0), ALIGNMENT_BYTES)


# ---------------------------------------------------------------------------------------------- backends
class AgrsPart(abc.ABC):
    """What a runtime does for AGRS, on validated arguments."""

    @abc.abstractmethod
    def set_config(self, num_max_session_bytes: int) -> torch.Tensor:
        """Flushes outstanding work on every rank (collective) and returns this rank's session region,
        ``num_max_session_bytes`` uint8 (a multiple of 32), which all-gathers write into."""

    @abc.abstractmethod
    def all_gather(self, a: AllGatherArgs) -> Gathered:
        """Starts the all-gather; returns the ``[R, ...]`` results (views of the session region, final
        once the returned wait function ran) and that function."""

    @abc.abstractmethod
    def end_session(self, session_idx: int) -> None:
        """Ends session ``session_idx``: its gathers are complete on this rank before the region is reused."""

    def flush(self, op: str) -> None:
        """Waits for the gathers still outstanding (before ``op``, e.g. the buffer's destroy)."""

    def take_deferred(self) -> Optional[Exception]:
        """An error the last ``all_gather`` raises only after its work was queued (and the session's
        state moved on with it), or None."""
        return None


class NativeAgrs(AgrsPart):
    """AGRS on the native runtime ``rt`` (its window, communication stream and ``_C.Runtime``)."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self._deferred: Optional[Exception] = None

    def _check(self, op: str) -> Optional[ValueError]:
        """``rt._alive(op)``, but a ValueError (a refused call, e.g. an earlier gather's: the buffer is
        usable) is returned to raise once this call's kernels are queued. Every rank's GPU found the
        refused gather, but each host hears of it when its own call looks: one that raised before
        queuing would leave its peers waiting for this gather or session end on the GPU."""
        try:
            self.rt._alive(op)
        except ValueError as e:
            return e
        return None

    def take_deferred(self) -> Optional[Exception]:
        err, self._deferred = self._deferred, None
        return err

    def set_config(self, num_max_session_bytes: int) -> torch.Tensor:
        """Flushes (every rank's work done, then a barrier); the region is the start of the buffer."""
        rt = self.rt
        rt._alive("agrs_set_config")
        torch.cuda.synchronize(rt.device)
        rt.barrier(True, True)
        return rt._buffer_bytes()[:num_max_session_bytes]

    def all_gather(self, a: AllGatherArgs) -> Gathered:
        """Copy-engine copies into every rank's region and the gather's signals, on the communication
        stream after the current one; ``wait`` joins the current stream to it."""
        rt = self.rt
        deferred = self._check("all_gather")
        region = rt._buffer_bytes()
        rt.comm_stream.wait_stream(torch.cuda.current_stream(rt.device))
        with torch.cuda.stream(rt.comm_stream):
            for t, inplace in zip(a.tensors, a.inplace):
                if not inplace:  # read by the copies queued on the communication stream
                    t.record_stream(rt.comm_stream)
            rt._rt.agrs_all_gather(srcs=[t.data_ptr() for t in a.tensors], nbytes=[t.nbytes for t in a.tensors],
                                   offsets=list(a.offsets), record=a.record, stream=rt._comm_raw)
            done = torch.cuda.Event()
            done.record(rt.comm_stream)
        R = rt.num_ranks
        outs = [region[o:o + R * t.nbytes].view(t.dtype).view(R, *t.shape) for t, o in zip(a.tensors, a.offsets)]

        def wait() -> None:
            torch.cuda.current_stream(rt.device).wait_event(done)

        self._deferred = deferred
        return outs, wait

    def end_session(self, session_idx: int) -> None:
        """The session-end kernel on the communication stream (after the current stream's reads of the
        results), which the current stream then waits for (a CUDA graph capture ends joined)."""
        rt = self.rt
        deferred = self._check("destroy_agrs_session")
        compute = torch.cuda.current_stream(rt.device)
        rt.comm_stream.wait_stream(compute)
        rt._rt.agrs_session_end(stream=rt._comm_raw)
        compute.wait_stream(rt.comm_stream)
        if deferred is not None:
            raise deferred


class TorchAgrs(AgrsPart):
    """AGRS on the torch runtime ``rt`` (its group, device and bounded waits)."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self._region: Optional[torch.Tensor] = None
        self._pending: List[Tuple[object, str]] = []  # (work, what) of the session's gathers

    def set_config(self, num_max_session_bytes: int) -> torch.Tensor:
        """Flushes (a barrier of every rank) and allocates the session region on this rank."""
        self.flush("agrs_set_config")
        self.rt.barrier(True, True)
        self._region = torch.empty(num_max_session_bytes, dtype=torch.uint8, device=self.rt.device)
        return self._region

    def all_gather(self, a: AllGatherArgs) -> Gathered:
        """Every rank's record first (one all-gather, waited: a difference raises on every rank before
        anything is posted), then one ``all_gather_single`` of bytes per tensor into its place in the
        region (asynchronous); the wait function waits for them, each with the ``num_cpu_timeout_secs``
        deadline."""
        rt = self.rt
        me = rt.rank_idx
        for peer, theirs in enumerate(gather_ints(rt.group, a.record, group_device(rt.group), unsigned=True)):
            w = agrs_difference(theirs, a.record) if peer != me else None
            if w is not None:
                raise agrs_gather_error(me, peer, w, theirs[w], a.record[w])
        R, region, outs, works = rt.num_ranks, self._region, [], []
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        for i, (x, off, inplace) in enumerate(zip(a.tensors, a.offsets, a.inplace)):
            n = x.nbytes
            dst = region[off:off + R * n]
            outs.append(dst.view(x.dtype).view(R, *x.shape))
            if n == 0:
                continue
            src = x.reshape(-1).view(torch.uint8)
            if inplace:  # the source is the destination's own part: the collective must not read what it writes
                src = src.clone()
            what = f"all_gather (session {a.session_idx}, gather {a.slot_idx}, tensor {i})"
            works.append((gather(dst, src, group=rt.group, async_op=True), what))
        self._pending.extend(works)

        def wait() -> None:
            for work, what in works:
                rt.wait_work(work, what)

        return outs, wait

    def end_session(self, session_idx: int) -> None:
        """Waits for every gather of the session (the region may be reused after this)."""
        self.flush(f"destroy_agrs_session (session {session_idx})")

    def flush(self, op: str) -> None:
        pending, self._pending = self._pending, []
        for work, what in pending:
            self.rt.wait_work(work, f"{op}: {what}")


# ---------------------------------------------------------------------------------------------- sessions
class AllGatherSessions:
    """One buffer's AGRS: the configuration, the current session, and the checks of every call.

    Arguments:
        runtime, backend: the buffer's runtime and its backend, ``"native"`` or ``"torch"``.
        group: the buffer's process group (configuration errors are agreed on over it).
        num_bytes: the buffer's bytes (the most a session may hold, as DeepEP V2).
        device: the buffer's device.
    """

    def __init__(self, runtime: Any, backend: str, group: dist.ProcessGroup, num_bytes: int,
                 device: torch.device) -> None:
        self.part: AgrsPart = NativeAgrs(runtime) if backend == "native" else TorchAgrs(runtime)
        self.group, self.num_bytes, self.device = group, num_bytes, device
        self.num_ranks, self.rank_idx = runtime.num_ranks, runtime.rank_idx
        self.region: Optional[torch.Tensor] = None  # set by set_config
        self.max_gathers = 0
        self.in_session = False
        self.offset = self.slot = self.session_idx = 0

    # ------------------------------------------------------------------ checks
    def _ready(self, op: str) -> None:
        if self.region is None:
            raise ValueError(f"{op}: AGRS is not configured; call agrs_set_config(num_max_session_bytes, "
                             "num_max_all_gathers_per_session) first")
        if not self.in_session:
            raise ValueError(f"{op}: called outside an AGRS session; use `with buf.agrs_new_session():` or "
                             "create_agrs_session() / destroy_agrs_session()")
        if self.slot >= self.max_gathers:
            raise ValueError(f"{op}: this session already holds num_max_all_gathers_per_session="
                             f"{self.max_gathers} all-gathers; end the session (or configure more)")

    def _budget(self, op: str, end: int) -> None:
        if end > self.region.numel():
            raise ValueError(f"{op}: the session would need {end} bytes, more than num_max_session_bytes="
                             f"{self.region.numel()} (get_agrs_num_max_session_bytes sizes a session); end the "
                             "session or configure more bytes")

    def _config_args(self, num_max_session_bytes: Any, num_max_all_gathers_per_session: Any) -> Tuple[int, int]:
        """``(session bytes rounded up to 32, gathers per session)``."""
        if self.in_session:
            raise ValueError("agrs_set_config: called inside an AGRS session; end it (destroy_agrs_session) first")
        n = int_arg("num_max_session_bytes", num_max_session_bytes, 1, self.num_bytes,
                    " (the buffer's num_bytes, as DeepEP V2)")
        k = int_arg("num_max_all_gathers_per_session", num_max_all_gathers_per_session, 1, MAX_AGRS_PER_SESSION,
                    " (DeepEP V2's in-flight all-gather limit)")
        return align(n, 32), k

    def _gather_args(self, t: Any) -> Tuple[AllGatherArgs, bool, int]:
        """``(AllGatherArgs, batched, the session's byte offset after this gather)`` of ``all_gather(t)``."""
        self._ready("all_gather")
        batched = not isinstance(t, torch.Tensor)
        if batched and (not is_sequence(t) or not t):
            raise ValueError(f"t: expected a tensor or a non-empty sequence of tensors, got {describe(t)}")
        tensors = list(t) if batched else [t]
        base, R, me, offset = self.region.data_ptr(), self.num_ranks, self.rank_idx, self.offset
        offsets, inplace = [], []
        for i, x in enumerate(tensors):
            name = f"t[{i}]" if batched else "t"
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{name}: expected a tensor, got {describe(x)}")
            check_dense(name, x)
            if off_device(x, self.device):
                raise ValueError(f"{name}: expected a tensor on {self.device}, got {describe(x)}")
            if not x.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous tensor, got {describe(x)}")
            nbytes = x.nbytes
            ptr = x.data_ptr()
            mine = nbytes > 0 and base <= ptr < base + self.region.numel()
            if mine and ptr != base + offset + nbytes * me:
                raise ValueError(f"{name}: a tensor inside the AGRS session region must be this rank's part of "
                                 f"this gather (agrs_get_inplace_tensor, in the order of the gathers), at byte "
                                 f"{offset + nbytes * me}, got byte {ptr - base}")
            offsets.append(offset)
            inplace.append(mine)
            offset += align(nbytes * R, 32)
        self._budget("all_gather", offset)
        record = agrs_record(tensors, self.offset)
        return AllGatherArgs(tensors, offsets, inplace, self.session_idx, self.slot, record), batched, offset

    # ------------------------------------------------------------------ operations (ElasticBuffer's)
    def set_config(self, num_max_session_bytes: Any, num_max_all_gathers_per_session: Any) -> None:
        cfg = on_every_rank(self.group, "agrs_set_config", self._config_args, num_max_session_bytes,
                            num_max_all_gathers_per_session)
        # A rank with a smaller session would refuse a gather (or its peers' bytes) that the others run.
        agree_on_every_rank(self.group, "agrs_set_config", {"num_max_session_bytes": cfg[0],
                                                            "num_max_all_gathers_per_session": cfg[1]},
                            group_device(self.group))
        self.region = self.part.set_config(cfg[0])
        self.max_gathers = cfg[1]

    def create_session(self) -> None:
        if self.in_session:
            raise ValueError("create_agrs_session: already inside an AGRS session; end it first")
        self.in_session = True
        self.offset = self.slot = 0
        self.session_idx += 1

    def destroy_session(self) -> None:
        if not self.in_session:
            raise ValueError("destroy_agrs_session: not inside an AGRS session")
        self.in_session = False
        self.part.end_session(self.session_idx)

    def inplace_tensors(self, shapes: Any, dtype: Any) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
        self._ready("agrs_get_inplace_tensor")
        shapes, batched = agrs_shapes(shapes)
        size = itemsize(dtype)
        R, me, offset, parts = self.num_ranks, self.rank_idx, self.offset, []
        for shape in shapes:
            nbytes = math.prod(shape) * size
            parts.append((shape, offset + nbytes * me))
            offset += align(nbytes * R, 32)
        self._budget("agrs_get_inplace_tensor", offset)
        region = self.region
        out = tuple(region[o:o + math.prod(s) * size].view(dtype).view(s) for s, o in parts)
        return out if batched else out[0]

    def all_gather(self, t: Any) -> tuple:
        a, batched, end = self._gather_args(t)
        out, wait = self.part.all_gather(a)
        self.offset, self.slot = end, self.slot + 1
        deferred = self.part.take_deferred()
        if deferred is not None:
            raise deferred
        session = self.session_idx

        def wait_fn() -> None:
            if not self.in_session or session != self.session_idx:
                raise ValueError("all_gather's wait: its AGRS session has ended; wait inside the session")
            wait()

        return (*out, wait_fn) if batched else (out[0], wait_fn)

    def flush(self, op: str) -> None:
        self.part.flush(op)
