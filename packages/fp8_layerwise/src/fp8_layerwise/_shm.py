"""The shared memory of a transport: the control region and each rank's host slots (POSIX shm).

Both are ``_C.ShmSegment`` objects (owner-only, unguessable names); see the layout in
:mod:`fp8_layerwise.transport`. This module also holds the slot-count defaults.
"""
from __future__ import annotations

import ctypes
from typing import Any, List, Sequence, Tuple

import torch

from . import _C
from ._checks import _I64_MAX, CONTROL_BYTES, KINDS, MAX_SLOTS, MAX_TP, _check, _expert_nbytes_arg, _int_arg

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


_KIND_ALIGN = 4096


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
        """Pointers in ``[slot][kind]`` order, as KTransformers' FP8LayerwiseTransport takes them."""
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
        :meth:`view` refers to it any more (at once when there is none).

        Raises:
            The native error of ``cudaHostUnregister`` when unpinning failed; the reference is dropped
            all the same (a second close() does nothing).
        """
        seg, self._seg = self._seg, None
        if seg is None or not self.registered:
            return
        self.registered = False
        _C.cuda_host_unregister(seg.ptr)
