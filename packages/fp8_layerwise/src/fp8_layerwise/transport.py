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

import collections.abc
import contextlib
import ctypes
import dataclasses
import inspect
import json
import operator
import os
import pathlib
import secrets
import shutil
import time
import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from . import _C
from .errors import ErrorCode, TransportClosed, TransportError

KINDS = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")
CONTROL_BYTES: int = _C.FP8_LAYERWISE_CONTROL_BYTES
MAX_TP: int = _C.FP8_LAYERWISE_MAX_TP_SIZE
MAX_SLOTS: int = _C.FP8_LAYERWISE_MAX_SLOTS
MAX_COPY_STREAMS: int = _C.FP8_LAYERWISE_MAX_COPY_STREAMS
#: Host slots per rank for experts of at least SMALL_EXPERT_BYTES per rank (see default_num_slots).
DEFAULT_SLOTS = 2
#: Host slots per rank for smaller experts.
SMALL_EXPERT_SLOTS = 4
SMALL_EXPERT_BYTES = 16 << 20


def default_num_slots(expert_nbytes: Sequence[int]) -> int:
    """The slot count ``Transport`` uses when none is given, from one rank's bytes per expert.

    Chosen by tools/bench_fp8_layerwise.py with the native writer (BENCHMARKS.md, run 3, one H200):
    DeepSeek-V3 experts at TP1 (44 MB per rank) ran at 94 % of the pinned peak end to end with 2
    slots and 72 % with 4 (a larger slot footprint slows the writer); TP4-sized (11 MB) and
    TP8-sized (5.5 MB) shards ran at 82 % and 63 % with 4 slots against 72 % and 41 % with 2.
    """
    nbytes = _expert_nbytes_arg(expert_nbytes, lo=0)
    return DEFAULT_SLOTS if sum(nbytes) >= SMALL_EXPERT_BYTES else SMALL_EXPERT_SLOTS


BLOCK = 128
_KIND_ALIGN = 4096


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


_U64_MAX = (1 << 64) - 1


def _int_arg(name: str, value: Any, lo: int, hi: Optional[int] = None) -> int:
    """``value`` as a plain int in ``lo..hi`` (an int or an integer type such as numpy.int64; not a
    bool, a float or a string), else ValueError naming the argument."""
    if isinstance(value, bool):
        ok = False
    else:
        try:
            value = operator.index(value)
            ok = True
        except TypeError:
            ok = False
    rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
    _check(ok, f"{name} must be an integer ({rng}), got {value!r} ({type(value).__name__})")
    _check(lo <= value and (hi is None or value <= hi), f"{name} must be in {rng}, got {value}")
    return int(value)


_U64_MAX, _I64_MIN, _I64_MAX, _I32_MAX = 2 ** 64 - 1, -2 ** 63, 2 ** 63 - 1, 2 ** 31 - 1


def _layer_args(epoch: Any, layer_id: Any = 0, expert_count: Any = 1) -> Tuple[int, int, int]:
    """The integer arguments of join / run / wait, checked for type and width only (the native
    protocol checks their meaning: epoch 0, the layer's range, what rank 0 opened), so that a float
    or a string is a ValueError naming the argument instead of the binding's TypeError."""
    return (_int_arg("epoch", epoch, 0, _U64_MAX), _int_arg("layer_id", layer_id, _I64_MIN, _I64_MAX),
            _int_arg("expert_count", expert_count, -_I32_MAX - 1, _I32_MAX))


def _bool_arg(name: str, value: Any) -> bool:
    """``value`` as a bool (a bool or numpy.bool_), else ValueError naming the argument."""
    _check(isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")),
           f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def _expert_nbytes_arg(expert_nbytes: Any, num_experts: int = 1, lo: int = 1) -> List[int]:
    """``expert_nbytes`` as 4 plain ints in ``lo..`` whose product with ``num_experts`` fits an int64
    (a layer buffer's size), else ValueError naming the argument (or the entry) at fault."""
    _check(not isinstance(expert_nbytes, (str, bytes)) and hasattr(expert_nbytes, "__len__")
           and len(expert_nbytes) == 4,
           f"expert_nbytes must be 4 positive sizes {KINDS}, got {expert_nbytes!r}")
    return [_int_arg(f"expert_nbytes[{k}]", n, lo, _I64_MAX // num_experts) for k, n in enumerate(expert_nbytes)]


def _sources_arg(sources: Any) -> List[torch.Tensor]:
    """``sources`` as the list of the 4 whole-layer tensors, else ValueError: anything else (None, a
    string, numpy arrays) failed later with a TypeError or an AttributeError that named no argument."""
    seq = isinstance(sources, collections.abc.Sequence) and not isinstance(sources, (str, bytes))
    _check(seq and len(sources) == 4,
           f"sources must hold 4 tensors {KINDS}, got {len(sources) if seq else type(sources).__name__}")
    for i, t in enumerate(sources):
        _check(isinstance(t, torch.Tensor), f"sources[{i}] ({KINDS[i]}) must be a torch.Tensor, got {type(t).__name__}")
    return list(sources)


def block_fp8_expert_nbytes(hidden: int, intermediate: int, tp_size: int, block: int = BLOCK) -> List[int]:
    """Per-rank bytes of one expert's four kinds for block-FP8 weights (128x128 fp32 scales).

    Arguments:
        hidden: model hidden size H (multiple of ``block``).
        intermediate: MoE intermediate size I; the rank shard I/tp must be a multiple of ``block``.
        tp_size: tensor-parallel size, 1..8.
        block: quantisation block edge.

    Returns:
        ``[w13, w13_scale, w2, w2_scale]`` bytes: ``2*(I/tp)*H``, ``4*2*(I/tp/128)*(H/128)``,
        ``H*(I/tp)``, ``4*(H/128)*(I/tp/128)``.
    """
    tp_size = _int_arg("tp_size", tp_size, 1, MAX_TP)
    hidden, intermediate = _int_arg("hidden", hidden, 1), _int_arg("intermediate", intermediate, 1)
    block = _int_arg("block", block, 1)
    _check(hidden > 0 and hidden % block == 0, f"hidden must be a positive multiple of {block}, got {hidden}")
    _check(intermediate > 0 and intermediate % tp_size == 0,
           f"intermediate {intermediate} must be divisible by tp_size {tp_size}")
    shard = intermediate // tp_size
    _check(shard % block == 0,
           f"block-FP8 shard intermediate/tp = {shard} is not a multiple of {block} (tp_size {tp_size})")
    hb, sb = hidden // block, shard // block
    return [2 * shard * hidden, 4 * 2 * sb * hb, hidden * shard, 4 * hb * sb]


def make_block_fp8_sources(num_experts: int, hidden: int, intermediate: int,
                           generator: Optional[torch.Generator] = None) -> List[torch.Tensor]:
    """Random whole-layer source tensors in the upstream layout (CPU).

    Returns:
        ``[w13 uint8 [E, 2I, H], w13_scale fp32 [E, 2I/128, H/128], w2 uint8 [E, H, I],
        w2_scale fp32 [E, H/128, I/128]]`` (FP8 carried as raw bytes).
    """
    # Sizes that are not 128-multiples gave scales of truncated (even empty) shapes, refused only later
    # by make_shard_writer, and a float or a negative size torch's own errors, naming no argument.
    E = _int_arg("num_experts", num_experts, 1)
    H, I = _int_arg("hidden", hidden, 1), _int_arg("intermediate", intermediate, 1)
    block_fp8_expert_nbytes(H, I, 1)
    _check(E * 2 * I * H <= _I64_MAX, f"num_experts {E} x 2*intermediate {2 * I} x hidden {H} bytes of w13 exceed "
                                      "what a tensor can hold (2**63-1)")
    _check(generator is None or isinstance(generator, torch.Generator),
           f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    g = generator
    w13 = torch.randint(0, 256, (E, 2 * I, H), dtype=torch.uint8, generator=g)
    w13s = torch.rand((E, 2 * I // BLOCK, H // BLOCK), generator=g)
    w2 = torch.randint(0, 256, (E, H, I), dtype=torch.uint8, generator=g)
    w2s = torch.rand((E, H // BLOCK, I // BLOCK), generator=g)
    return [w13, w13s, w2, w2s]


def reference_shard(sources: Sequence[torch.Tensor], tp_size: int, rank: int, expert: int) -> List[torch.Tensor]:
    """Plain-torch rank shard of one expert, as uint8 (the independent reference for tests).

    Arguments:
        sources: the whole-layer tensors, as for :func:`make_shard_writer`.
        tp_size: tensor-parallel size; rank: 0..tp_size-1; expert: 0..E-1.

    Returns:
        ``[w13, w13_scale, w2, w2_scale]`` flat uint8 tensors: what ``rank`` receives for ``expert``.

    w13 keeps rows ``[r*I/tp, (r+1)*I/tp)`` of the gate half and of the up half; w2 keeps columns
    ``[r*I/tp, (r+1)*I/tp)``; the scales follow the same split in 128-blocks.
    """
    # Slicing past the tensors does not fail: a rank >= tp_size, a negative one or a tp_size that
    # does not cut I into 128-blocks gave empty or shifted shards, a silently wrong reference.
    w13, w13s, w2, w2s = _sources_arg(sources)
    _check(w2.dim() == 3, f"sources[2] (w2_weight) must be [E, H, I], got {tuple(w2.shape)}")
    tp_size = _int_arg("tp_size", tp_size, 1, MAX_TP)
    rank = _int_arg("rank", rank, 0, tp_size - 1)
    expert = _int_arg("expert", expert, 0, w2.shape[0] - 1)
    block_fp8_expert_nbytes(w2.shape[1], w2.shape[2], tp_size)
    I = w2.shape[2]
    s, sb = I // tp_size, I // tp_size // BLOCK
    Ib = I // BLOCK
    out13 = torch.cat([w13[expert, r0 + rank * s: r0 + (rank + 1) * s] for r0 in (0, I)])
    out13s = torch.cat([w13s[expert, r0 + rank * sb: r0 + (rank + 1) * sb] for r0 in (0, Ib)])
    out2 = w2[expert, :, rank * s:(rank + 1) * s]
    out2s = w2s[expert, :, rank * sb:(rank + 1) * sb]
    return [t.contiguous().view(-1).view(torch.uint8) for t in (out13, out13s, out2, out2s)]


def default_writer_threads(tp_size: int, cpus: Optional[int] = None) -> int:
    """Writer threads when none are given: 8 per rank it fills (one core copies ~10 GB/s, a PCIe Gen5
    link takes ~55 GB/s per rank), leaving two CPUs per rank for its consumer and the CUDA driver,
    at most 64. More threads per rank than that only make the writer outrun the link in bursts,
    which slows the copy engines' reads of host memory (BENCHMARKS.md, run 10: with one rank on the
    16-CPU H200 machine, 8 threads did as well as 12 and 4 fell behind)."""
    tp_size = _int_arg("tp_size", tp_size, 1, MAX_TP)
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cpus = _int_arg("cpus", cpus, 1)
    return max(1, min(8 * tp_size, cpus - 2 * tp_size, 64))


CACHE_HINTS = ("none", "demote", "writeback", "flush")
DEFAULT_CACHE_HINT = "none"  # BENCHMARKS.md run 11: every hint costs the writer more than the copies gain


def default_cache_hint() -> str:
    """The writer's cache hint when none is given: ``FP8LW_WRITER_HINT`` if set (for measuring every
    hint from one build), else ``DEFAULT_CACHE_HINT``, falling back to ``"none"`` on a CPU without
    the instruction."""
    name = os.environ.get("FP8LW_WRITER_HINT", "") or DEFAULT_CACHE_HINT
    _check(name in CACHE_HINTS, f"FP8LW_WRITER_HINT must be one of {CACHE_HINTS}, got {name!r}")
    return name if _C.cache_hint_supported(name) else "none"


def make_shard_writer(sources: Sequence[torch.Tensor], tp_size: int,
                      threads: Optional[int] = None, cache_hint: Optional[str] = None) -> "_C.ShardWriter":
    """Native writer that cuts each rank's shard out of whole-layer CPU source tensors.

    Arguments:
        sources: ``[w13 [E, 2I, H] (1-byte dtype), w13_scale fp32 [E, 2I/128, H/128],
            w2 [E, H, I], w2_scale fp32 [E, H/128, I/128]]``, contiguous CPU tensors. The writer
            holds references to them (it reads them through raw pointers) and refuses an expert
            outside ``0..E-1`` (a layer with ``expert_count > E`` raises ValueError).
        tp_size: tensor-parallel size.
        threads: memcpy threads per expert (1..64); None: ``default_writer_threads(tp_size)``.
        cache_hint: what the writer does with a slot's cache lines after writing them, so the
            copy engine does not have to snoop them out of a core's private cache: ``"none"``,
            ``"demote"`` (CLDEMOTE to the shared L3), ``"writeback"`` (CLWB) or ``"flush"``
            (CLFLUSHOPT). None: :func:`default_cache_hint`. A hint the CPU lacks raises
            ValueError (x86-64 only; elsewhere only ``"none"``).

    Returns:
        A ``_C.ShardWriter`` to pass to ``Transport.run`` / ``layer.run``: no Python runs per expert.
    """
    sources = _sources_arg(sources)
    tp_size = _int_arg("tp_size", tp_size, 1, MAX_TP)
    for i, t in enumerate(sources):
        _check(t.device.type == "cpu" and t.is_contiguous() and t.dim() == 3,
               f"sources[{i}] ({KINDS[i]}) must be a contiguous 3-D CPU tensor, got {tuple(t.shape)} on {t.device}")
    w13, w13s, w2, w2s = sources
    E, twoI, H = w13.shape
    # The specs below take each expert to be 2*(twoI//2) rows: an odd row count would shift every
    # expert after the first by a row, a silently wrong shard; no expert at all a null data pointer.
    _check(E >= 1 and twoI % 2 == 0,
           f"sources[0] (w13_weight) must be [E >= 1, 2I, H] (gate and up halves), got {tuple(w13.shape)}")
    I = twoI // 2
    _check(tuple(w2.shape) == (E, H, I), f"w2 must be [E, H, I] = {(E, H, I)}, got {tuple(w2.shape)}")
    _check(w13.element_size() == 1 and w2.element_size() == 1, "w13 / w2 must be 1-byte (FP8 or uint8) tensors")
    _check(w13s.dtype == torch.float32 and w2s.dtype == torch.float32, "scales must be float32")
    block_fp8_expert_nbytes(H, I, tp_size)  # validates the 128-multiples
    _check(tuple(w13s.shape) == (E, 2 * I // BLOCK, H // BLOCK), f"w13 scale shape {tuple(w13s.shape)} is wrong")
    _check(tuple(w2s.shape) == (E, H // BLOCK, I // BLOCK), f"w2 scale shape {tuple(w2s.shape)} is wrong")
    s = I // tp_size
    sb, Ib, Hb = s // BLOCK, I // BLOCK, H // BLOCK
    specs = [
        # w13: gate rows then up rows of this rank; each row is H bytes.
        _C.ShardSpec(w13.data_ptr(), 2 * I * H, H, s, H, rank_row_step=s, chunks=2, chunk_row_step=I, num_experts=E),
        _C.ShardSpec(w13s.data_ptr(), 2 * Ib * Hb * 4, Hb * 4, sb, Hb * 4, rank_row_step=sb, chunks=2,
                     chunk_row_step=Ib, num_experts=E),
        # w2: all H rows, this rank's column range.
        _C.ShardSpec(w2.data_ptr(), H * I, I, H, s, rank_col_step=s, num_experts=E),
        _C.ShardSpec(w2s.data_ptr(), Hb * Ib * 4, Ib * 4, Hb, sb * 4, rank_col_step=sb * 4, num_experts=E),
    ]
    threads = default_writer_threads(tp_size) if threads is None else _int_arg("threads", threads, 1, 64)
    if cache_hint is None:
        cache_hint = default_cache_hint()
    _check(cache_hint in CACHE_HINTS, f"cache_hint must be one of {CACHE_HINTS}, got {cache_hint!r}")
    _check(_C.cache_hint_supported(cache_hint), f"cache_hint {cache_hint!r} needs an instruction this CPU lacks")
    # `sources` is kept alive by the writer: the specs above are raw pointers into these tensors.
    return _C.ShardWriter(specs, threads, cache_hint, sources=tuple(sources), tp_size=tp_size)


def _check_same_geometry(rank: int, geometries: Sequence[dict]) -> None:
    """Every rank must pass rank 0's expert_nbytes, num_experts and num_slots: rank 0 writes each
    rank's slots at its own offsets and each consumer copies at its own, so a disagreement would
    deliver wrong bytes silently. Checked on the first exchange, so every rank raises at once
    (ValueError) and nothing has been created yet."""
    want = geometries[0]
    bad = [r for r, g in enumerate(geometries) if g != want]
    if not bad:
        return

    def fmt(g):
        return f"expert_nbytes {g['expert_nbytes']}, num_experts {g['num_experts']}, num_slots {g['num_slots']}"

    if rank in bad:
        head = f"rank {rank} was given {fmt(geometries[rank])} but rank 0 was given {fmt(want)}"
    else:
        head = ("; ".join(f"rank {r} was given {fmt(geometries[r])}" for r in bad)
                + f", but rank 0 was given {fmt(want)}")
    raise ValueError(f"{head}: every rank must pass the same expert_nbytes, num_experts and num_slots")


def _tell_peers_and_raise(err: Exception, rank: Any, tp_size: Any, exchange: Any, group: Any) -> None:
    """Raises ``err`` (a bad constructor argument, or a backend this process cannot use) after
    offering the peers an error record in the first exchange, where they would otherwise wait for
    this rank until the exchange's own timeout. Best effort: with an unusable exchange (itself the bad
    argument, or no process group) the error is raised as it is. A FileExchange is closed afterwards,
    as a Transport closes it once its setup is over, so that its session folder does not stay. A
    FileExchange of another world size than a valid tp_size is not used: its round would wait for
    ranks that are not there (until its timeout) or gather ranks of another group."""
    try:
        fits = not isinstance(exchange, FileExchange) or _int_arg("tp_size", tp_size, 1, MAX_TP) == exchange.world_size
    except ValueError:
        fits = True  # tp_size is the bad argument: the exchange may well be the right one
    if not fits:
        raise err
    try:
        if exchange is None:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                raise err
            exchange = group_exchange(group)
        if callable(exchange):
            exchange({"error": f"rank {rank!r}: {err}"})
    except Exception:  # noqa: BLE001 - the peers then time out as before; this rank's error stands
        pass
    if isinstance(exchange, FileExchange):
        with contextlib.suppress(Exception):
            exchange.close(timeout_s=min(exchange.timeout_s, 2.0))
    raise err


def _check_exchange_group(rank: int, tp_size: int, hello: Sequence[Any]) -> None:
    """The exchange must be an all-gather over exactly this TP group, in TP-rank order: entry r from
    TP rank r. A group spanning more processes (the default group=None is WORLD, e.g. in a TP2 x DP2
    job) or ordered differently (group rank != TP rank) would attach rank r to another rank's
    segments. Every rank sees the same entries, so every rank raises ValueError here, before
    anything is created."""
    def tp_of(h):
        return (h.get("tp_rank"), h.get("tp_size")) if isinstance(h, dict) else (None, None)

    got = [tp_of(h) for h in hello] if isinstance(hello, (list, tuple)) else None
    hint = ("pass group=<a torch.distributed group of exactly this TP group's ranks, in TP-rank order> "
            "(the default group=None is WORLD) or an exchange over them")
    _check(got is not None, f"rank {rank}: the exchange returned {type(hello).__name__}, not a list; {hint}")
    sizes = sorted({s for _, s in got if s is not None})
    _check(all(s == tp_size for s in sizes),
           f"rank {rank}: the exchange's ranks disagree on tp_size (got {sizes}): {hint}")
    _check(len(got) == tp_size,
           f"rank {rank}: the exchange returned {len(got)} entries (from TP ranks {[r for r, _ in got]}) but tp_size "
           f"is {tp_size}: it must gather exactly the tp_size ranks of this TP group; {hint}")
    bad = [(i, r) for i, (r, _) in enumerate(got) if r != i]
    _check(not bad, f"rank {rank}: the exchange's entry {bad[0][0] if bad else 0} came from TP rank "
                    f"{bad[0][1] if bad else 0} (entries from TP ranks {[r for r, _ in got]}): entry r must come from "
                    f"TP rank r (group rank == TP rank); {hint}")
    lacking = [i for i, h in enumerate(hello) if "geometry" not in h or "pid" not in h]
    if lacking:
        i = lacking[0]
        raise ValueError(f"rank {rank}: the exchange's entry {i} lacks what TP rank {i} passed to it (got "
                         f"{hello[i]!r}): the exchange must return every rank's object unchanged")


def _check_writer_signature(writer: Callable) -> None:
    """ValueError when ``writer`` cannot be called as ``writer(expert, slots)``: the call would fail only
    inside run(), at expert 0, and poison every rank (code WRITER) for what is a bad argument."""
    try:
        sig = inspect.signature(writer)
    except (TypeError, ValueError):
        return  # no signature to read (some builtins): the call itself will tell
    try:
        sig.bind(0, [])
    except TypeError as exc:
        raise ValueError(f"writer must be callable as writer(expert, slots), but {writer!r} is not: {exc}") from None


# Mappings that close() could not release because a call of another thread was still inside after the
# deadline (or close() ran inside the writer): unmapping them could crash that call, so they stay
# mapped for the life of the process (their names are unlinked already).
_KEPT_MAPPED: List[Any] = []


def _name_arg(name: Any) -> str:
    _check(isinstance(name, str), f"name must be a shm segment name (str), got {type(name).__name__}")
    return name


def _host_view(ptr: int, nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor aliasing ``nbytes`` at ``ptr`` (shared memory we own a mapping of)."""
    buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8)


class ControlRegion:
    """The shared 8 KiB control region (a POSIX shm segment, 0600, unguessable name)."""

    def __init__(self, seg: "_C.ShmSegment"):
        self._seg = seg

    @classmethod
    def create(cls, tp_size: int, num_slots: int = DEFAULT_SLOTS) -> "ControlRegion":
        """Create and initialise a region for ``tp_size`` ranks and ``num_slots`` host slots."""
        # Checked before the segment exists (the binding's own TypeError named no argument).
        tp_size, num_slots = _int_arg("tp_size", tp_size, 1, MAX_TP), _int_arg("num_slots", num_slots, 2, MAX_SLOTS)
        seg = _C.ShmSegment.create("fp8lw_ctl", CONTROL_BYTES)
        try:
            _C.initialize_fp8_layerwise_control(seg.ptr, seg.nbytes, tp_size, num_slots)
        except BaseException:
            seg.close()
            raise
        return cls(seg)

    @classmethod
    def attach(cls, name: str) -> "ControlRegion":
        """Map an existing region by name (the magic/version/size/tp checks run in Transport)."""
        return cls(_C.ShmSegment.attach(_name_arg(name), CONTROL_BYTES))

    name = property(lambda self: self._seg.name)
    ptr = property(lambda self: self._seg.ptr)
    nbytes = property(lambda self: self._seg.nbytes)

    def unlink(self) -> None:
        self._seg.unlink()

    def close(self) -> None:
        self._seg.close()


class HostSlots:
    """One rank's host slots: ``num_slots`` experts x 4 kinds in one shm segment, kind-major."""

    def __init__(self, seg: "_C.ShmSegment", expert_nbytes: Sequence[int], num_slots: int):
        self._seg = seg
        self.offsets = self.layout(expert_nbytes, num_slots)[0]
        self.expert_nbytes = [int(n) for n in expert_nbytes]
        self.num_slots = int(num_slots)
        self.registered = False

    @staticmethod
    def layout(expert_nbytes: Sequence[int], num_slots: int):
        """Returns (per-kind offsets, total bytes) of the kind-major slot layout.

        Raises:
            ValueError: a bad ``expert_nbytes`` or ``num_slots`` (2..MAX_SLOTS), or slots that would
                take more than 2**63-1 bytes (a size the segment's binding cannot even take).
        """
        expert_nbytes = _expert_nbytes_arg(expert_nbytes)
        num_slots = _int_arg("num_slots", num_slots, 2, MAX_SLOTS)
        offsets, cur = [], 0
        for nb in expert_nbytes:
            cur = (cur + _KIND_ALIGN - 1) // _KIND_ALIGN * _KIND_ALIGN
            offsets.append(cur)
            cur += num_slots * nb
        total = (cur + _KIND_ALIGN - 1) // _KIND_ALIGN * _KIND_ALIGN
        _check(total <= _I64_MAX, f"expert_nbytes {expert_nbytes} with num_slots {num_slots}: the host slots would "
                                  f"take {total} bytes, more than a shared-memory segment can hold (2**63-1)")
        return offsets, total

    @classmethod
    def create(cls, expert_nbytes: Sequence[int], num_slots: int) -> "HostSlots":
        _, total = cls.layout(expert_nbytes, num_slots)
        return cls(_C.ShmSegment.create("fp8lw_slots", total), expert_nbytes, num_slots)

    @classmethod
    def attach(cls, name: str, expert_nbytes: Sequence[int], num_slots: int) -> "HostSlots":
        _, total = cls.layout(expert_nbytes, num_slots)
        return cls(_C.ShmSegment.attach(_name_arg(name), total), expert_nbytes, num_slots)

    name = property(lambda self: self._seg.name)
    nbytes = property(lambda self: self._seg.nbytes)

    def _slot_kind(self, slot: Any, kind: Any) -> Tuple[int, int]:
        # A slot past num_slots is another kind's memory (or past the segment): no error of its own.
        return _int_arg("slot", slot, 0, self.num_slots - 1), _int_arg("kind", kind, 0, len(KINDS) - 1)

    def ptr(self, slot: int, kind: int) -> int:
        slot, kind = self._slot_kind(slot, kind)
        return self._seg.ptr + self.offsets[kind] + slot * self.expert_nbytes[kind]

    def ptrs(self) -> List[int]:
        """Pointers in the seed's ``[slot][kind]`` order."""
        return [self.ptr(s, k) for s in range(self.num_slots) for k in range(4)]

    def view(self, slot: int, kind: int) -> torch.Tensor:
        """A uint8 tensor aliasing one slot of one kind. It holds a reference to the segment, so the
        memory stays mapped while the tensor (or any view of it) lives, even after ``close()``."""
        slot, kind = self._slot_kind(slot, kind)
        off = self.offsets[kind] + slot * self.expert_nbytes[kind]
        return torch.frombuffer(self._seg, dtype=torch.uint8, count=self.expert_nbytes[kind], offset=off)

    def register_cuda(self, device: int) -> None:
        _C.cuda_host_register(self._seg.ptr, self._seg.nbytes, device)
        self.registered = True

    def unlink(self) -> None:
        if self._seg is not None:
            self._seg.unlink()

    def close(self) -> None:
        """Unpin and drop this object's reference to the segment: it is unmapped once no tensor from
        :meth:`view` refers to it any more (at once when there is none)."""
        if self._seg is None:
            return
        if self.registered:
            self.registered = False
            with contextlib.suppress(Exception):
                _C.cuda_host_unregister(self._seg.ptr)
        self._seg = None


def _proc_start_time(pid: int) -> Optional[int]:
    """Start time of a live (not zombie) process, else None (the native liveness check's reading)."""
    try:
        start = _C.process_start_time(int(pid))
    except (TypeError, ValueError, OverflowError):
        return None
    return start or None


def _write_private(path: pathlib.Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, owner-only (0600): the files carry shm names."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _check_seconds(name: str, value: Any) -> None:
    _check(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
           f"{name} must be a positive number of seconds, got {value!r}")


class FileExchange:
    """Explicit all-gather through a private folder (no torch.distributed needed).

    Sessions: rank 0's first call creates a fresh session folder ``<dir>/s.<random nonce>`` (0700)
    and points ``<dir>/session.json`` at it, with its pid and ``/proc`` start time; every other rank
    joins the session it names only if that process is alive and the rank's seat in it is free
    (``join.<rank>``, created ``O_EXCL``). Files that an earlier run left in the same folder are
    never read: a finished run removed its session, and a crashed one's leader is dead or its
    seats are taken. Each call writes ``<session>/<round>.<rank>.json`` (0600, atomically) and waits
    for every rank's file; a rank's file of round k is removed once every rank reached round k+1.
    ``close()`` (also called by :class:`Transport` once its setup is done, or once it failed) ends the
    session: rank 0 waits until every rank that joined closed, then removes the session folder and
    ``session.json`` (also when a rank never came, or the wait ran out). Raises ``TimeoutError`` after
    ``timeout_s`` without the awaited file, naming the rank.
    """

    SESSION_FILE = "session.json"

    def __init__(self, directory: os.PathLike, rank: int, world_size: int, timeout_s: float = 60.0):
        _check(isinstance(directory, (str, os.PathLike)),
               f"directory must be a path (str or os.PathLike), got {type(directory).__name__}")
        world_size = _int_arg("world_size", world_size, 1)
        rank = _int_arg("rank", rank, 0, world_size - 1)
        _check_seconds("timeout_s", timeout_s)
        self.dir = pathlib.Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.rank, self.world_size, self.timeout_s, self.round = rank, world_size, float(timeout_s), 0
        self.session: Optional[pathlib.Path] = None
        self._closed = False

    # ---- session ---------------------------------------------------------------------------
    def _create_session(self) -> pathlib.Path:
        self._remove_dead_sessions()
        nonce = secrets.token_hex(16)
        session = self.dir / f"s.{nonce}"
        session.mkdir(mode=0o700)
        leader = {"nonce": nonce, "pid": os.getpid(), "start": _proc_start_time(os.getpid()),
                  "world_size": self.world_size}
        _write_private(session / "leader.json", json.dumps(leader))
        _write_private(self.dir / self.SESSION_FILE, json.dumps(leader))
        return session

    @staticmethod
    def _leader_alive(leader: dict) -> bool:
        start = _proc_start_time(leader.get("pid", -1))
        return start is not None and start == leader.get("start")

    def _remove_dead_sessions(self) -> None:
        """Best effort: remove session folders whose leader process is gone (a crashed run's)."""
        for d in self.dir.glob("s.*"):
            try:
                leader = json.loads((d / "leader.json").read_text())
            except (OSError, ValueError):
                continue
            if not self._leader_alive(leader):
                shutil.rmtree(d, ignore_errors=True)

    def _join_session(self, deadline: float) -> pathlib.Path:
        why = f"no {self.SESSION_FILE} yet"
        while True:
            try:
                leader = json.loads((self.dir / self.SESSION_FILE).read_text())
            except (OSError, ValueError):
                leader = None
            if leader is not None:
                session = self.dir / f"s.{leader.get('nonce')}"
                if leader.get("world_size") != self.world_size:
                    why = f"its session is for world_size {leader.get('world_size')}, not {self.world_size}"
                elif not self._leader_alive(leader):
                    why = f"the session it names was left by process {leader.get('pid')}, which is gone"
                else:
                    try:
                        os.close(os.open(session / f"join.{self.rank}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                        return session
                    except FileExistsError:
                        why = f"rank {self.rank}'s seat in the session it names is taken (an earlier run's)"
                    except FileNotFoundError:
                        why = "the session it names has ended"
            if time.monotonic() > deadline:
                raise TimeoutError(f"FileExchange in {self.dir}: rank 0 has not started a session for rank "
                                   f"{self.rank} within {self.timeout_s} s ({why})")
            time.sleep(0.002)

    # ---- rounds ----------------------------------------------------------------------------
    def __call__(self, obj: Any) -> List[Any]:
        """One all-gather round.

        Arguments:
            obj: this rank's entry (JSON-serialisable).

        Returns:
            Every rank's entry of this round, in rank order.

        Raises:
            TimeoutError: a rank's entry (or, for a rank other than 0, rank 0's session) did not
                appear within ``timeout_s``.
            RuntimeError: rank 0 closed the session before this rank's round (it left).
        """
        if self._closed:
            raise RuntimeError(f"FileExchange in {self.dir} (rank {self.rank}) is closed (Transport closes the "
                               "FileExchange it was given once its setup is done); create a new one")
        # Serialised first: an object JSON refuses must leave the round count (and the session) as
        # they were, else this rank's next round would be one ahead of its peers', which wait for it.
        text = json.dumps(obj)
        deadline = time.monotonic() + self.timeout_s
        if self.session is None:
            self.session = self._create_session() if self.rank == 0 else self._join_session(deadline)
        self.round += 1
        try:
            _write_private(self.session / f"{self.round}.{self.rank}.json", text)
        except FileNotFoundError:
            if self.session.is_dir():
                raise
            raise RuntimeError(f"FileExchange round {self.round} (rank {self.rank}): its session {self.session} has "
                               "ended: rank 0 closed it (it left the exchange)") from None
        out = []
        for r in range(self.world_size):
            p = self.session / f"{self.round}.{r}.json"
            while True:
                try:
                    out.append(json.loads(p.read_text()))
                    break
                except FileNotFoundError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"FileExchange round {self.round}: rank {r} did not publish {p} "
                                       f"within {self.timeout_s} s")
                time.sleep(0.002)
        # Every rank published this round, so every rank has read the previous one: ours can go.
        if self.round > 1:
            with contextlib.suppress(OSError):
                os.unlink(self.session / f"{self.round - 1}.{self.rank}.json")
        return out

    def close(self, timeout_s: Optional[float] = None) -> None:
        """End the session (idempotent): every rank marks itself done; rank 0 withdraws
        ``session.json`` (no rank joins the session any more), waits (up to ``timeout_s``, default the
        exchange's) until every rank that joined the session marked itself done, then removes the
        session folder, in every case: a rank that never joined is not waited for (a setup that failed
        or was interrupted before every rank arrived), and a joined rank still inside when the wait
        ends cannot complete a round without rank 0 anyway (its next round raises)."""
        if timeout_s is not None:
            _check_seconds("timeout_s", timeout_s)
        if self._closed:
            return
        self._closed = True
        session = self.session
        if session is None:
            return
        with contextlib.suppress(OSError):
            _write_private(session / f"done.{self.rank}", "")
        if self.rank != 0:
            return
        with contextlib.suppress(OSError, ValueError):
            if json.loads((self.dir / self.SESSION_FILE).read_text()).get("nonce") == session.name[2:]:
                os.unlink(self.dir / self.SESSION_FILE)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

        def done():
            # Rank r took its seat (join.r) before it could publish anything in the session.
            return all((session / f"done.{r}").exists() for r in range(1, self.world_size)
                       if (session / f"join.{r}").exists())

        while not done() and time.monotonic() <= deadline:
            time.sleep(0.002)
        # Renamed first, so that a rank taking its seat right now cannot add a file to the folder while
        # it is being removed (which would leave it behind); its join then finds no session.
        gone = session.with_name(f".{session.name}.gone")
        try:
            os.rename(session, gone)
        except OSError:
            gone = session
        shutil.rmtree(gone, ignore_errors=True)

    def __enter__(self) -> "FileExchange":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_group(group: Any) -> None:
    """ValueError unless ``group`` is None or a torch.distributed process group: anything else failed
    only inside torch.distributed, on the first exchange, with an AttributeError."""
    import torch.distributed as dist

    pg = getattr(dist, "ProcessGroup", None)
    _check(group is None or (pg is not None and isinstance(group, pg)),
           f"group must be a torch.distributed ProcessGroup (this TP group) or None, got {type(group).__name__}")


def group_exchange(group=None) -> Callable[[Any], List[Any]]:
    """All-gather through a torch.distributed group (gloo is enough).

    Arguments:
        group: the TP group, its group rank r being TP rank r (None: WORLD).

    Returns:
        ``exchange(obj) -> [obj of group rank 0, obj of group rank 1, ...]``, as ``Transport`` takes it.
    """
    import torch.distributed as dist

    _check_group(group)

    def _exchange(obj):
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    return _exchange


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
        expert_nbytes: per-rank bytes of one expert for the 4 kinds (see block_fp8_expert_nbytes).
        num_slots: host slots per rank, 2..16 (experts in flight); None: ``default_num_slots``.
        backend: "cuda", "cpu" (memcpy into host buffers) or "auto" (cuda when available).
        device: CUDA device index (default: rank % device_count).
        timeout_ms: a wait that sees no progress for this long poisons the transport.
        group: torch.distributed group used to exchange shm names (default WORLD) ... It must hold
            exactly this TP group's ranks, group rank r being TP rank r (checked: ValueError on
            every rank otherwise; in a job with more processes than tp_size, pass the TP group).
        exchange: ... or an explicit all-gather callable (e.g. FileExchange); takes precedence. A
            FileExchange is closed (its files removed) once the setup is done: one per Transport.
        max_inflight: experts in flight per consumer (0 = num_slots; 1 = the seed's design).
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
            writer: a ``_C.ShardWriter`` (see :func:`make_shard_writer`; native, no Python per
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
        for s in self._peer_slots[1:]:
            s.close()
        self._peer_slots = []
        if self._slots is not None:
            self._slots.close()
        if self._control is not None:
            self._control.close()

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
