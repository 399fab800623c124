"""High-level, memory-owning API of the layerwise FP8 expert-weight transport.

Algorithm
---------
Rank 0 (the producer) streams one MoE layer's expert weights from CPU memory to every
tensor-parallel rank. For each expert ``e`` it waits until slot ``e % num_slots`` is free (every
rank acknowledged the slot's previous contents), runs the writer that fills *every rank's* slot
with that rank's shard of the four buffer kinds, and publishes the slot (sequence, epoch, expert).
Each rank's consumer thread copies published slots into its layer buffers at
``expert * expert_nbytes[kind]`` (CUDA: ``cudaMemcpyAsync`` on its own stream from registered
shared memory; CPU backend: ``memcpy``) with up to ``num_slots`` experts in flight, merging
consecutive slots into one copy per kind, and acknowledges each slot when its copy finished.

Data layout
-----------
* Control region: one 8 KiB POSIX shm segment (owner-only, unguessable name) holding the POD
  control block (see ``csrc/control.hpp``). Created by rank 0, attached by the others.
* Host slots: one shm segment per rank, laid out kind-major so that consecutive slots of one kind
  are contiguous (that is what lets the consumer coalesce them)::

      [kind 0: slot 0 | slot 1 | ... ][pad to 4 KiB][kind 1: slot 0 | ...] ...

  Each rank pins its own segment with ``cudaHostRegister`` (CUDA backend); rank 0 maps every
  rank's segment so its writer fills them directly.
* Segment names: nothing is created before a first exchange shows that every rank arrived (and
  agrees on expert_nbytes, num_experts and num_slots), and each name is unlinked as soon as every
  process that opens it has mapped it: rank 0's slots (and, at TP 1, the control region) at once,
  another rank's slots when rank 0 mapped them, the control region at the "mapped" barrier. A setup
  that fails with an exception unlinks the name of every segment its rank created or mapped. So an
  exception anywhere, or a SIGKILL before the segments exist or after that barrier, leaves nothing
  in /dev/shm. What can remain: a SIGKILL inside the setup window between creating the segments
  and the peers mapping them (one name exchange among ranks that all arrived already:
  milliseconds) can leave that rank's control region (rank 0) or slots (other ranks), unless a
  surviving rank that mapped it unlinks it when its own setup then fails.
* Layer buffers: one flat ``uint8`` tensor per kind of ``num_experts * expert_nbytes[kind]``
  bytes, on the rank's GPU (CUDA) or in host memory (CPU backend).

How to launch
-------------
Every rank constructs a :class:`Transport` collectively (names are exchanged through a
torch.distributed group -- gloo is enough -- or through an explicit ``exchange`` callable such as
:class:`FileExchange`), then per layer::

    with transport.layer(epoch, layer_id, n) as layer:   # join on enter, wait on exit
        if transport.rank == 0:
            layer.run(writer)                             # ShardWriter (native) or callable
    stats = layer.stats

Epochs start at 1 and strictly increase. Any failure poisons all ranks (see :mod:`.errors`);
``transport.reset()`` (collective) recovers without restarting the processes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any, Callable, List, Optional, Sequence

import torch

from . import _C
from ._checks import (_U64_MAX, KINDS, MAX_COPY_STREAMS, MAX_SLOTS, MAX_TP, _bool_arg, _check, _expert_nbytes_arg,
                      _int_arg, _layer_args)
from ._shm import ControlRegion, HostSlots, default_num_slots
from ._writers import _check_writer_signature
from .errors import ErrorCode, TransportClosed, TransportError
from .exchange import (FileExchange, _check_exchange_group, _check_group, _check_same_geometry, _tell_peers_and_raise,
                       group_exchange)

# Mappings that close() could not release because a call of another thread was still inside after the
# deadline (or close() ran inside the writer): unmapping them could crash that call, so they stay
# mapped for the life of the process (their names are unlinked already).
_KEPT_MAPPED: List[Any] = []


@dataclasses.dataclass
class LayerStats:
    """What ``wait`` reports for one layer on one rank (times in ms, ``bytes`` this rank copied)."""

    epoch: int
    layer_id: int
    expert_count: int
    rank: int
    writer_ms: float
    slot_wait_ms: float
    h2d_ms: float
    total_ms: float
    bytes: int
    copies: int
    poisoned: bool
    error_code: int
    error_rank: int
    error_message: str
    error_peer: int = -1  #: the rank the recorded error is blamed on (-1: none / not poisoned)


class Layer:
    """Handle returned by ``Transport.layer``; ``stats`` is filled when the ``with`` block exits."""

    def __init__(self, transport: "Transport", epoch: int, layer_id: int, expert_count: int):
        self.transport, self.epoch, self.layer_id, self.expert_count = transport, epoch, layer_id, expert_count
        self.stats: Optional[LayerStats] = None

    def run(self, writer) -> None:
        """Rank 0 only: produce this layer with ``writer`` (see :meth:`Transport.run`)."""
        self.transport.run(self.epoch, self.layer_id, self.expert_count, writer)


class Transport:
    """One rank's end of the transport; owns its shm, pinned slots and layer buffers.

    Arguments:
        rank: this rank, 0..tp_size-1 (rank 0 produces).
        tp_size: number of ranks, 1..8.
        num_experts: experts per layer (size of the layer buffers).
        expert_nbytes: per-rank bytes of one expert for the 4 kinds (see :func:`~fp8_layerwise.block_fp8_expert_nbytes`).
        num_slots: host slots per rank, 2..16 (experts in flight); None: ``default_num_slots``.
        backend: "cuda", "cpu" (memcpy into host buffers) or "auto" (cuda when available).
        device: CUDA device index (default: rank % device_count).
        timeout_ms: a wait that sees no progress for this long poisons the transport.
        group: torch.distributed group used to exchange shm names (default WORLD) ... It must hold
            exactly this TP group's ranks, group rank r being TP rank r (checked: ValueError on
            every rank otherwise; in a job with more processes than tp_size, pass the TP group).
        exchange: ... or an explicit all-gather callable (e.g. FileExchange); takes precedence. A
            FileExchange is closed (its files removed) once the setup is done: one per Transport.
        max_inflight: experts in flight per consumer (0 = num_slots; 1 = one at a time, as in
            KTransformers' FP8LayerwiseTransport).
        coalesce: merge copies of consecutive slots.
        liveness_ms: how often a waiter checks that the processes it waits on are alive.
        copy_streams: CUDA streams each consumer spreads a batch's copies over, 1..4. A second
            stream overlaps each copy's fixed cost with another copy: +2-3 points of the pinned peak
            for TP8-sized shards on one H200, neutral for larger experts (BENCHMARKS.md, run 4).
        coalesce_wait: while a batch is queued on the copy engine, a short run of ready slots waits
            for the next ones (fewer, larger copies). Pays when the slots fill faster than the link
            (prestaged data, a fast writer: +2-3 points for small shards); with a writer slower than
            the link it cost 3-8 points end to end (BENCHMARKS.md, run 5), hence off by default.
        batch_small_kinds: kinds of at most 64 KiB per expert (the FP32 block scales) are copied for
            the whole layer at once, with its last batch, from a page-locked staging copy the consumer
            takes out of each slot, instead of one copy per expert: 2 copies per expert instead of 4.
            The layer's data is complete when ``wait()`` returns either way. On by default: +2 to +6
            points of the pinned peak for TP4/TP8-sized shards (transport alone), neutral with the
            writer in the loop (BENCHMARKS.md, run 9).

    Raises:
        ValueError: a bad argument (type or range, naming it), before anything is exchanged or
            created; also on every rank when one rank's ``expert_nbytes``, ``num_experts`` or
            ``num_slots`` differ from rank 0's, or the exchange is not exactly the TP group in
            TP-rank order.
    """

    def __init__(self, rank: int, tp_size: int, num_experts: int, expert_nbytes: Sequence[int], *,
                 num_slots: Optional[int] = None, backend: str = "auto", device: Optional[int] = None,
                 timeout_ms: int = 60000, group=None, exchange: Optional[Callable[[Any], List[Any]]] = None,
                 max_inflight: int = 0, coalesce: bool = True, liveness_ms: int = 20, copy_streams: int = 2,
                 coalesce_wait: bool = False, batch_small_kinds: bool = True):
        # Every argument is checked here, before anything is created: a bad one raises ValueError
        # naming it (not a TypeError from the native constructor after the segments exist). The
        # construction is collective, so the rank also tells its peers through the first exchange
        # (an error record and nothing else): they raise at once instead of waiting in that exchange
        # until its own timeout (30 min for a default torch.distributed group).
        try:
            checked = self._init_checked(rank, tp_size, num_experts, expert_nbytes, num_slots, backend, device,
                                         timeout_ms, group, exchange, max_inflight, coalesce, liveness_ms,
                                         copy_streams, coalesce_wait, batch_small_kinds)
        except (ValueError, TransportError) as err:  # TransportError: backend="cuda" unusable here
            _tell_peers_and_raise(err, rank, tp_size, exchange, group)
        self._finish_init(*checked)  # collective from here: its errors are everyone's (see _setup)

    def _init_checked(self, rank, tp_size, num_experts, expert_nbytes, num_slots, backend, device, timeout_ms,
                      group, exchange, max_inflight, coalesce, liveness_ms, copy_streams, coalesce_wait,
                      batch_small_kinds):
        tp_size = _int_arg("tp_size", tp_size, 1, MAX_TP)
        rank = _int_arg("rank", rank, 0, tp_size - 1)
        # Before the exchange is used: a FileExchange of another world size would wait in its first
        # round for ranks that are not there until its own timeout (60 s by default).
        _check(not isinstance(exchange, FileExchange) or exchange.world_size == tp_size,
               f"exchange is a FileExchange of world_size {getattr(exchange, 'world_size', None)} but tp_size is "
               f"{tp_size}: it must gather exactly the tp_size ranks of this TP group")
        num_experts = _int_arg("num_experts", num_experts, 1, (1 << 31) - 1)
        expert_nbytes = _expert_nbytes_arg(expert_nbytes, num_experts)
        if num_slots is None:
            num_slots = default_num_slots(expert_nbytes)
        num_slots = _int_arg("num_slots", num_slots, 2, MAX_SLOTS)
        HostSlots.layout(expert_nbytes, num_slots)  # slots too large for a segment: refused before anything exists
        timeout_ms = _int_arg("timeout_ms", timeout_ms, 1, _U64_MAX)
        liveness_ms = _int_arg("liveness_ms", liveness_ms, 1, _U64_MAX)
        max_inflight = _int_arg("max_inflight", max_inflight, 0, num_slots)
        copy_streams = _int_arg("copy_streams", copy_streams, 1, MAX_COPY_STREAMS)
        coalesce = _bool_arg("coalesce", coalesce)
        coalesce_wait = _bool_arg("coalesce_wait", coalesce_wait)
        batch_small_kinds = _bool_arg("batch_small_kinds", batch_small_kinds)
        _check(exchange is None or callable(exchange), f"exchange must be a callable all-gather, got {exchange!r}")
        if exchange is None:
            _check_group(group)
        _check(isinstance(backend, str) and backend in ("cuda", "cpu", "auto"),
               f"backend must be 'cuda', 'cpu' or 'auto', got {backend!r}")
        if device is not None:
            device = _int_arg("device", device, 0)
        if backend == "auto":
            backend = "cuda" if (_C.built_with_cuda() and torch.cuda.is_available()) else "cpu"
        if backend == "cuda":
            if not _C.built_with_cuda():
                raise TransportError("fp8_layerwise was built without CUDA; use backend='cpu'")
            if not torch.cuda.is_available():
                raise TransportError("backend='cuda' needs a CUDA device, none is visible; use backend='cpu'")
            ndev = torch.cuda.device_count()
            device = rank % ndev if device is None else device
            _check(device < ndev, f"device must be in 0..{ndev - 1} (visible CUDA devices), got {device}")
        return (rank, tp_size, num_experts, expert_nbytes, num_slots, backend, device, timeout_ms, group, exchange,
                max_inflight, coalesce, liveness_ms, copy_streams, coalesce_wait, batch_small_kinds)

    def _finish_init(self, rank, tp_size, num_experts, expert_nbytes, num_slots, backend, device, timeout_ms, group,
                     exchange, max_inflight, coalesce, liveness_ms, copy_streams, coalesce_wait, batch_small_kinds):
        # Plain ints: they travel through the exchange (JSON for FileExchange), numpy ints do not.
        self.rank, self.tp_size, self.num_experts = rank, tp_size, num_experts
        self.expert_nbytes = expert_nbytes
        self.num_slots, self.backend, self.device = num_slots, backend, device
        self._exchange = exchange if exchange is not None else group_exchange(group)
        self._control: Optional[ControlRegion] = None
        self._slots: Optional[HostSlots] = None
        self._peer_slots: List[HostSlots] = []
        self._native = None
        self._closed = False
        try:
            self._setup(timeout_ms, max_inflight, coalesce, liveness_ms, copy_streams, coalesce_wait,
                        batch_small_kinds)
        except BaseException:
            # The setup is collective: once it failed here, no rank can finish it, so the names of the
            # segments this rank mapped can go (a creator's close() unlinks its own; the control
            # region's attachers unlink it here), whatever the ranks still alive are waiting for.
            if self._control is not None:
                self._control.unlink()
            with contextlib.suppress(TransportError):  # the setup's own error is the one raised
                self._release()
            if isinstance(self._exchange, FileExchange):
                with contextlib.suppress(Exception):
                    self._exchange.close(timeout_s=min(self._exchange.timeout_s, 2.0))
            raise
        if isinstance(self._exchange, FileExchange):
            self._exchange.close()  # every rank passed the last round: its files can go

    def _setup(self, timeout_ms, max_inflight, coalesce, liveness_ms, copy_streams, coalesce_wait,
               batch_small_kinds):
        # First exchange, before anything exists: a rank killed while it waits for the others leaves
        # no segment, and a rank whose geometry differs from rank 0's fails on every rank at once.
        geometry = {"expert_nbytes": self.expert_nbytes, "num_experts": self.num_experts,
                    "num_slots": self.num_slots}
        hello = self._exchange({"pid": os.getpid(), "tp_rank": self.rank, "tp_size": self.tp_size,
                                "geometry": geometry})
        errors = [(i, h["error"]) for i, h in enumerate(hello or []) if isinstance(h, dict) and "error" in h]
        _check(not errors, f"rank {self.rank}: the Transport could not be built: "
                           + "; ".join(f"entry {i} refused its arguments: {e}" for i, e in errors))
        _check_exchange_group(self.rank, self.tp_size, hello)
        _check_same_geometry(self.rank, [h["geometry"] for h in hello])
        self.peer_pids = [h["pid"] for h in hello]

        # Each later step is this rank's local work, then an exchange that its peers are already in.
        # A rank whose step failed still takes part in that exchange, with an error record instead of
        # its payload, so every rank raises at once (naming it) rather than waiting for it until the
        # exchange's own timeout (30 min for a default torch.distributed group): a full /dev/shm, an
        # unpinnable segment or a GPU out of memory on one rank must not hang the others.
        def create():
            # Each name goes as soon as every process that opens it has mapped it (see the module doc).
            if self.rank == 0:
                self._control = ControlRegion.create(self.tp_size, self.num_slots)
                if self.tp_size == 1:
                    self._control.unlink()
            self._slots = HostSlots.create(self.expert_nbytes, self.num_slots)
            if self.rank == 0:
                self._slots.unlink()  # only rank 0 maps its own slots

        info = self._setup_step("creating its shared memory", create,
                                lambda: {"control": self._control.name if self._control else None,
                                         "slots": self._slots.name})
        all_ptrs: List[int] = []

        def attach():
            if self.rank != 0:
                self._control = ControlRegion.attach(info[0]["control"])
            else:
                self._peer_slots = [self._slots]
                for r in range(1, self.tp_size):
                    self._peer_slots.append(HostSlots.attach(info[r]["slots"], self.expert_nbytes, self.num_slots))
                    self._peer_slots[-1].unlink()  # rank 0 is the only other process that maps rank r's slots
                all_ptrs.extend(self._peer_slots[r].ptr(s, k)
                                for s in range(self.num_slots) for r in range(self.tp_size) for k in range(4))
            if self.backend == "cuda":
                torch.cuda.set_device(self.device)
                self._slots.register_cuda(self.device)
                dev = torch.device("cuda", self.device)
            else:
                dev = torch.device("cpu")
            #: The layer buffers: one flat uint8 tensor per kind, expert e at [e*nbytes, (e+1)*nbytes).
            self.buffers = [torch.empty(self.num_experts * nb, dtype=torch.uint8, device=dev)
                            for nb in self.expert_nbytes]

        # Everyone has mapped everything after this exchange: then the remaining names can go.
        self._setup_step("mapping its peers' shared memory", attach, lambda: "mapped")

        def start():
            self._slots.unlink()
            if self.rank == 0:
                self._control.unlink()
            self._native = _C.FP8LayerwiseTransport(
                self._control.ptr, self._control.nbytes, self.rank, self.tp_size,
                self.device if self.backend == "cuda" else -1, self._slots.ptrs(),
                [b.data_ptr() for b in self.buffers], all_ptrs, self.expert_nbytes, self.num_experts,
                timeout_ms, backend=self.backend, max_inflight=max_inflight, coalesce=coalesce,
                liveness_ms=liveness_ms, copy_streams=copy_streams, coalesce_wait=coalesce_wait,
                batch_small_kinds=bool(batch_small_kinds))
            if self.rank == 0:
                self._views = [[[self._peer_slots[r].view(s, k) for k in range(4)] for r in range(self.tp_size)]
                               for s in range(self.num_slots)]

        # A second barrier so no rank starts a layer before every consumer is attached.
        self._setup_step("starting its transport", start, lambda: "ready")

    def _setup_step(self, what: str, local: Callable[[], None], payload: Callable[[], Any]) -> List[Any]:
        """One step of the collective setup: ``local()``, then an exchange of ``payload()``. When
        ``local()`` raises, the exchange carries an error record instead and the exception propagates;
        when a peer's entry is an error record, raises TransportError naming that rank and its error.

        Arguments:
            what: the step, for the peers' message ("creating its shared memory").
            local: this rank's work of the step.
            payload: what this rank contributes to the step's exchange once ``local()`` succeeded.

        Returns:
            The exchange's entries (one per rank, in TP-rank order).
        """
        try:
            local()
        except Exception as exc:
            # Best effort: an exchange that fails here leaves the peers to its own timeout, as before.
            # Not for KeyboardInterrupt / SystemExit: they leave at once, even if a peer never comes.
            with contextlib.suppress(Exception):
                self._exchange({"error": f"{type(exc).__name__}: {exc}", "step": what})
            raise
        got = self._exchange(payload())
        failed = [(r, e) for r, e in enumerate(got or []) if isinstance(e, dict) and "error" in e]
        if failed:
            raise TransportError(f"rank {self.rank}: the Transport setup failed on "
                                 + "; ".join(f"rank {r} while {e.get('step', what)}: {e['error']}" for r, e in failed))
        return got

    # ---- protocol ------------------------------------------------------------------------------
    @property
    def native(self) -> "_C.FP8LayerwiseTransport":
        if self._native is None or self._closed:
            raise TransportClosed(f"transport on rank {self.rank} is closed")
        return self._native

    def join(self, epoch: int, layer_id: int, expert_count: int) -> None:
        """Join a layer (every rank, same arguments; GIL released, Ctrl-C honoured).

        Arguments:
            epoch: >= 1, above this rank's previous epoch; every rank joins every epoch rank 0 opens.
            layer_id: >= 0, the same on every rank (checked against rank 0's).
            expert_count: experts of this layer, 1..num_experts (checked against rank 0's).

        Raises:
            ValueError: an argument out of range (nothing is poisoned).
            ProtocolError: a reused or skipped epoch, a join without ``wait()`` of the previous one,
                or a layer that differs from rank 0's (the region is poisoned: every rank raises).
        """
        self.native.join(*_layer_args(epoch, layer_id, expert_count))

    def run(self, epoch: int, layer_id: int, expert_count: int, writer) -> None:
        """Rank 0: produce the joined layer.

        Arguments:
            writer: a ``_C.ShardWriter`` (see :func:`~fp8_layerwise.make_shard_writer`; native, no Python per
                expert) or a callable ``writer(expert, slots)`` where ``slots[rank][kind]`` is a
                uint8 CPU tensor aliasing that rank's host slot, to be filled completely (it keeps
                the slot memory mapped while it lives). A writer's exception poisons the region
                (code WRITER); KeyboardInterrupt and SystemExit are then re-raised as they are.

        Raises:
            ProtocolError: on a rank other than 0, for a layer other than the joined one, or a
                second run() of the same layer.
        """
        epoch, layer_id, expert_count = _layer_args(epoch, layer_id, expert_count)
        if isinstance(writer, _C.ShardWriter):
            self.native.run(epoch, layer_id, expert_count, writer)
            return
        _check(callable(writer), "writer must be a ShardWriter or a callable(expert, slots)")
        _check_writer_signature(writer)
        views = self._views if self.rank == 0 else None

        def _raw(expert, *ptrs):
            writer(expert, views[expert % self.num_slots])

        self.native.run(epoch, layer_id, expert_count, _raw)

    def wait(self, epoch: int) -> LayerStats:
        """Block (GIL released, Ctrl-C honoured) until this rank's copies of ``epoch`` landed.

        On rank 0 the producer may be started in another thread before or after this call (a
        ``run()`` that never comes expires the wait, naming it).

        Arguments:
            epoch: the epoch this rank joined last; once per epoch.

        Returns:
            The layer's :class:`LayerStats` on this rank (``bytes`` is what this rank copied).

        Raises:
            TransportPoisoned: any rank's failure during the layer (its subclasses name the kind).
            TransportError: a ``reset()`` on another thread of this rank abandoned the layer.
        """
        return LayerStats(**self.native.wait(_layer_args(epoch)[0]))

    @contextlib.contextmanager
    def layer(self, epoch: int, layer_id: int, expert_count: int, sync_stream: bool = True):
        """``with t.layer(epoch, layer_id, n) as layer:`` joins on enter and waits on exit.

        Arguments:
            epoch, layer_id, expert_count: as for :meth:`join`.
            sync_stream: CUDA backend: synchronise the current torch stream first (see below).

        Returns:
            A context manager yielding a :class:`Layer` (``layer.run(writer)`` on rank 0), whose
            ``stats`` holds the :class:`LayerStats` once the block exited without an exception.

        With the CUDA backend and ``sync_stream`` (default) it first synchronises the current torch
        stream, because the consumer's copies run on their own stream and would otherwise race
        with kernels still reading the previous layer out of the same buffers. After the block,
        the delivered bytes are visible to any stream (the consumer waited for its events).
        An exception inside the block poisons the transport (code USER) so the other ranks fail
        fast instead of timing out, then propagates.
        """
        sync_stream = _bool_arg("sync_stream", sync_stream)  # a truthy "no" would silently mean True
        if sync_stream and self.backend == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.join(epoch, layer_id, expert_count)
        handle = Layer(self, epoch, layer_id, expert_count)
        try:
            yield handle
        except BaseException as exc:
            # Best effort: another thread may have closed the transport meanwhile (TransportClosed);
            # the block's own exception is the one to propagate.
            with contextlib.suppress(TransportError):
                if self._native is not None and not self._closed and not self._native.poisoned:
                    self._native.poison(int(ErrorCode.USER), f"rank {self.rank}: {type(exc).__name__}: {exc}")
            raise
        handle.stats = self.wait(epoch)

    def poison(self, code: int, message: str) -> bool:
        """Claim the poison record, so that every rank's current or next call raises this cause.

        Arguments:
            code: a positive :class:`ErrorCode` (e.g. ``ErrorCode.USER``).
            message: the cause (at most 255 UTF-8 bytes are kept).

        Returns:
            True iff this call won the claim (exactly one of concurrent claims wins).

        Raises:
            ValueError: ``code`` is not an :class:`ErrorCode` above NONE, or ``message`` not a str
                (``int(code)`` took 2.5 for TIMEOUT and "5" for WRITER; nothing is claimed then).
        """
        code = _int_arg("code", code, 1, int(max(ErrorCode)))
        _check(isinstance(message, str), f"message must be a str, got {type(message).__name__}")
        return self.native.poison(code, message)

    @property
    def poisoned(self) -> bool:
        return self.native.poisoned

    def reset(self) -> int:
        """Collective recovery after a poison: every rank calls it. Returns the new generation.

        Raises:
            PeerDied: a rank died or closed (it can never take part), within ``liveness_ms``.
            TransportTimeout: the other ranks did not take part within ``timeout_ms`` (the message
                names them); the region stays poisoned.
        """
        return self.native.reset()

    def expert_view(self, kind: int, expert: int) -> torch.Tensor:
        """This rank's delivered bytes of one expert of one kind.

        Arguments:
            kind: 0..3, the index in :data:`KINDS` (w13, w13 scale, w2, w2 scale).
            expert: 0..num_experts-1.

        Returns:
            A flat uint8 view of ``buffers[kind]`` (``expert_nbytes[kind]`` bytes; on the rank's GPU
            with the CUDA backend). Out-of-range indices raise ValueError (a slice past the buffer
            would be a silently empty or wrong view).
        """
        kind = _int_arg("kind", kind, 0, len(KINDS) - 1)
        expert = _int_arg("expert", expert, 0, self.num_experts - 1)
        nb = self.expert_nbytes[kind]
        return self.buffers[kind][expert * nb:(expert + 1) * nb]

    # ---- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the consumer and free everything; idempotent. Poisons if a layer is still active.

        Safe while other threads are inside ``join`` / ``run`` / ``wait`` / ``reset``: they raise
        :class:`TransportClosed`, and the memory is unmapped only after they left (a writer that
        runs in ``run`` finishes its expert first). If one is still inside after
        ``min(timeout_ms, 60 s)`` -- or ``close()`` is called from inside the writer -- the shared
        memory stays mapped for the life of the process (with a warning) rather than crash it.

        Raises:
            TransportError: a release failed: unpinning a region (``cudaHostUnregister``), or the copy
                backend's (its streams' synchronisation, their and their events' destruction,
                ``cudaFreeHost`` of its staging memory). Every region was released all the same, and
                the transport is closed. Tests name steps to report as failed with
                ``FP8_LAYERWISE_TEST_FAIL_RELEASE`` (e.g. ``free(staging)`` of the CPU backend).
        """
        if self._closed:
            return
        self._closed = True
        self._release()

    def _release(self) -> None:
        drained = self._native.close() if self._native is not None else True
        if not drained:
            warnings.warn(f"fp8_layerwise: rank {self.rank} closed its transport while a call was still inside it; "
                          "its shared memory stays mapped until the process exits", RuntimeWarning, stacklevel=3)
            _KEPT_MAPPED.append((self._control, self._slots, self._peer_slots, getattr(self, "_views", None)))
            self._views, self._peer_slots, self._slots, self._control = None, [], None, None
            return
        self._views = None
        # Every region is released whatever an earlier one raised; the first error is raised after.
        teardown = self._native.teardown_error() if self._native is not None else ""
        first = RuntimeError(f"the copy backend's release: {teardown}") if teardown else None
        regions = [*self._peer_slots[1:], self._slots, self._control]
        self._peer_slots = []
        for region in regions:
            try:
                if region is not None:
                    region.close()
            except Exception as e:  # noqa: BLE001 - raised below, after the other regions
                first = first or e
        if first is not None:
            raise TransportError(f"fp8_layerwise: rank {self.rank}'s close() released every region, but "
                                 f"one release failed: {first}") from first

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()
