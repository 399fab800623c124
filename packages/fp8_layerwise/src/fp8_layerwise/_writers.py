"""Writers: what fills every rank's host slot with that rank's shard of one expert (rank 0).

:func:`make_shard_writer` builds the native ``_C.ShardWriter`` (memcpy threads, no Python per
expert) over whole-layer CPU source tensors; a plain callable ``writer(expert, slots)`` works too
(``Transport.run`` checks its signature with :func:`_check_writer_signature`).
"""
from __future__ import annotations

import inspect
import os
import warnings
from typing import Callable, Optional, Sequence

import torch

from . import _C
from ._checks import KINDS, MAX_TP, _check, _int_arg, _sources_arg
from .block_fp8 import BLOCK, block_fp8_expert_nbytes


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


#: The environment variable that sets the writer's default cache hint, and its deprecated former name.
_WRITER_HINT_ENV, _OLD_WRITER_HINT_ENV = "FP8_LAYERWISE_WRITER_HINT", "FP8LW_WRITER_HINT"


def default_cache_hint() -> str:
    """The writer's cache hint when none is given: ``FP8_LAYERWISE_WRITER_HINT`` if set (for measuring
    every hint from one build), else ``DEFAULT_CACHE_HINT``, falling back to ``"none"`` on a CPU
    without the instruction. The former name ``FP8LW_WRITER_HINT`` is still read when the new one is
    not set, with a DeprecationWarning."""
    var, name = _WRITER_HINT_ENV, os.environ.get(_WRITER_HINT_ENV, "")
    if not name and os.environ.get(_OLD_WRITER_HINT_ENV, ""):
        var, name = _OLD_WRITER_HINT_ENV, os.environ[_OLD_WRITER_HINT_ENV]
        warnings.warn(f"{_OLD_WRITER_HINT_ENV} is deprecated; set {_WRITER_HINT_ENV} instead", DeprecationWarning,
                      stacklevel=2)
    name = name or DEFAULT_CACHE_HINT
    _check(name in CACHE_HINTS, f"{var} must be one of {CACHE_HINTS}, got {name!r}")
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
