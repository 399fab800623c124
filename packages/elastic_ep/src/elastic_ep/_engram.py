"""Engram (DeepEP V2's ``engram_write`` / ``engram_fetch``): a table sharded over the ranks' CPU segments,
its argument checks, and the two backends' parts.

``Engram`` validates every call (a write collectively: every rank raises when any rank's arguments are
refused) and makes one call into its part (``EngramPart``):

* ``NativeEngram``: every rank's shard in host memory that every GPU of the node reads directly
  (``_C.EngramStore``: POSIX shared memory, owner-only and unguessable, pinned with ``cudaHostRegister``;
  opened collectively when the buffer is created), so a fetch reads any rank's rows over PCIe with no peer
  taking part and no NIC (DeepEP V2 reaches the shards with RDMA gets through NCCL GIN). ``engram_write``
  copies this rank's shard into its segment (device to host, on the current stream) and synchronises
  every rank; ``engram_fetch`` launches one kernel (one warp per token entry) that copies the named rows
  into a new ``[T, E * hidden]`` tensor on the current stream. Single node: the segments are the node's
  memory.
* ``TorchEngram``: every rank's shard, gathered once by ``engram_write`` into memory of this rank, so a
  fetch is a local ``index_select``, one-sided as DeepEP's RDMA gets.

Both gather the scales (a table every rank holds) on the device (``gather_scales``).
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

from . import _C
from ._checks import _num_qps, check_tensor, describe, int_arg, itemsize
from ._collective import gather_bytes, on_every_rank, raise_if_any_rank_failed
from ._sizing import ALIGNMENT_BYTES, align

__all__ = ["Engram", "EngramPart", "NativeEngram", "TorchEngram", "check_same_shards", "gather_scales",
           "open_engram_store", "get_engram_storage_size_hint"]

Hook = Callable[[], Tuple[torch.Tensor, Optional[torch.Tensor]]]


def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                 dtype: torch.dtype = torch.bfloat16) -> Tuple[int, int]:
    """``(num_gpu_bytes, num_cpu_bytes)`` an Engram storage would need (DeepEP's hint): entries of ``hidden`` elements rounded up to 32 B, ``num_max_tokens_per_rank``
    on the GPU and ``num_entries`` on the CPU, each total 2 MiB-aligned."""
    num_entries, hidden = int_arg("num_entries", num_entries, 0), int_arg("hidden", hidden, 0)
    num_max_tokens_per_rank = int_arg("num_max_tokens_per_rank", num_max_tokens_per_rank, 0)
    entry = align(hidden * itemsize(dtype), 32)
    return align(entry * num_max_tokens_per_rank, ALIGNMENT_BYTES), align(entry * num_entries, ALIGNMENT_BYTES)


def check_same_shards(group: dist.ProcessGroup, storage: torch.Tensor, sf: Optional[torch.Tensor]) -> None:
    """Collective: raises ``ValueError`` on every rank unless every rank's ``storage`` (and ``sf``) has the
    same shape and dtype."""
    meta = (tuple(storage.shape), str(storage.dtype), None if sf is None else (tuple(sf.shape), str(sf.dtype)))
    metas = [m.decode() for m in gather_bytes(group, repr(meta).encode())]
    if any(m != metas[0] for m in metas):
        raise ValueError("storage / sf: expected the same shapes and dtypes on every rank, got "
                         + "; ".join(f"rank {r}: {m}" for r, m in enumerate(metas)))


def gather_scales(sf_table: Optional[torch.Tensor], flat: torch.Tensor, T: int, E: int,
                  use_tma_aligned_col_major_sf: bool) -> Optional[torch.Tensor]:
    """``[T, E * packs]`` scales of the entries ``flat`` (int64 ``[T * E]``), row-major or TMA-aligned
    column-major (rows padded to 4); None without a scale table."""
    if sf_table is None:
        return None
    rows = sf_table.index_select(0, flat).view(T, E * sf_table.shape[1])
    if not use_tma_aligned_col_major_sf:
        return rows
    sf = torch.empty_strided(rows.shape, (1, (T + 3) // 4 * 4), dtype=rows.dtype, device=rows.device)
    sf.copy_(rows)
    return sf


def _hook(data: torch.Tensor, sf: Optional[torch.Tensor]) -> Hook:
    def hook() -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        return data, sf

    return hook


def open_engram_store(group: dist.ProcessGroup, num_cpu_bytes: int) -> "_C.EngramStore":
    """Collective: this rank's segment, attached to every peer's (names exchanged over ``group``), each
    name unlinked once every rank attached.

    Every rank arrives (a barrier) before any creates its segment, which may be many GB: a rank that
    died or gave up before that leaves no segment anywhere, and no name waits in /dev/shm for a peer that
    never comes. From its creation on, every exit path of this call unlinks this rank's name and a
    failure closes the segment.

    Raises:
        RuntimeError / ValueError: a rank could not create or attach (every rank raises, naming it), or
            the group's collectives failed (a peer gone).
    """
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    dist.barrier(group=group)
    store, err = None, None
    try:
        store = _C.EngramStore(rank=rank, num_ranks=R, num_bytes=num_cpu_bytes)
    except Exception as e:  # noqa: BLE001 - e.g. /dev/shm too small: every rank raises below
        err = e
    try:
        raise_if_any_rank_failed(group, err, "num_cpu_bytes: creating the Engram host segment")
        names = gather_bytes(group, bytes(store.name))
        err = None
        try:
            store.attach(names=names)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            err = e
        raise_if_any_rank_failed(group, err, "num_cpu_bytes: attaching the peers' Engram segments")
    except BaseException:
        if store is not None:
            store.close()  # unlinks a name still linked, unmaps
        raise
    finally:
        if store is not None:
            store.unlink()
    return store


# ---------------------------------------------------------------------------------------------- backends
class EngramPart(abc.ABC):
    """What a runtime does for Engram, on validated arguments."""

    @abc.abstractmethod
    def write(self, storage: torch.Tensor, sf: Optional[torch.Tensor]) -> None:
        """Installs this rank's shard ``[entries, hidden]`` of the table (collective; every rank's shard has
        the same shape and dtype, else every rank raises ``ValueError``)."""

    @abc.abstractmethod
    def fetch(self, indices: torch.Tensor, use_tma_aligned_col_major_sf: bool) -> Hook:
        """Starts gathering the rows of global entries ``indices`` (validated ``int32 [T, E]`` in range);
        the hook returns ``(data [T, E * hidden], sf [T, E * packs] or None)``."""

    def close(self) -> None:
        """Releases what the part holds (before the runtime's window goes)."""


class NativeEngram(EngramPart):
    """Engram on the native runtime ``rt``: the node's host segments (``num_cpu_bytes`` each, opened here,
    collectively over ``group``, when positive)."""

    def __init__(self, rt: Any, group: dist.ProcessGroup, num_cpu_bytes: int) -> None:
        self.rt, self.group = rt, group
        self._store: Optional["_C.EngramStore"] = open_engram_store(group, num_cpu_bytes) if num_cpu_bytes else None
        self._rows = self._row_bytes = self._hidden = 0
        self._dtype: Optional[torch.dtype] = None
        self._sf: Optional[torch.Tensor] = None

    def write(self, storage: torch.Tensor, sf: Optional[torch.Tensor]) -> None:
        """Collective: the shard into this rank's segment, then every rank's copy done before any fetch."""
        rt = self.rt
        rt._alive("engram_write")
        self._rows = 0
        check_same_shards(self.group, storage, sf)
        row_bytes = storage.shape[1] * storage.element_size()
        if row_bytes % 16:
            raise ValueError(f"storage: the native backend copies 16-byte words; a row of {row_bytes} bytes is not a "
                             "multiple of 16 (hidden % 8 == 0 for bf16, % 16 for FP8)")
        src = storage.contiguous()
        self._store.write(src=src.data_ptr(), nbytes=src.nbytes, stream=torch.cuda.current_stream(rt.device).cuda_stream)
        self._sf = None if sf is None else sf.clone()
        rt.barrier(True, True)  # synchronises the device (the copy) before and after the barrier
        self._rows, self._row_bytes, self._dtype, self._hidden = storage.shape[0], row_bytes, storage.dtype, \
            storage.shape[1]

    def fetch(self, indices: torch.Tensor, use_tma_aligned_col_major_sf: bool) -> Hook:
        """One fetch kernel on the current stream; the hook returns its outputs."""
        rt = self.rt
        rt._alive("engram_fetch")
        T, E = indices.shape
        data = torch.empty((T, E * self._hidden), dtype=self._dtype, device=indices.device)
        idx = indices.contiguous()
        self._store.fetch(indices=idx.data_ptr(), num_indices=T * E, entries_per_rank=self._rows,
                          row_bytes=self._row_bytes, out=data.data_ptr(),
                          stream=torch.cuda.current_stream(rt.device).cuda_stream)
        return _hook(data, gather_scales(self._sf, idx.reshape(-1).long(), T, E, use_tma_aligned_col_major_sf))

    def close(self) -> None:
        """Closes the segments once the device finished every fetch reading them."""
        if self._store is not None:
            torch.cuda.synchronize(self.rt.device)
            self._store.close()
            self._store = None


class TorchEngram(EngramPart):
    """Engram on the torch runtime ``rt`` (its group, device and bounded waits)."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self._table: Optional[torch.Tensor] = None  # every rank's shard, [entries x R, hidden]
        self._sf: Optional[torch.Tensor] = None

    def write(self, storage: torch.Tensor, sf: Optional[torch.Tensor]) -> None:
        rt = self.rt
        self._table = self._sf = None
        check_same_shards(rt.group, storage, sf)
        src = storage.reshape(-1).view(torch.uint8)
        table = torch.empty(rt.num_ranks * src.numel(), dtype=torch.uint8, device=rt.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        rt.wait_work(gather(table, src, group=rt.group, async_op=True), "engram_write")
        self._table = table.view(storage.dtype).view(rt.num_ranks * storage.shape[0], storage.shape[1])
        self._sf = None if sf is None else sf.clone()
        rt.barrier(True, True)

    def fetch(self, indices: torch.Tensor, use_tma_aligned_col_major_sf: bool) -> Hook:
        T, E = indices.shape
        flat = indices.reshape(-1).long()
        data = self._table.index_select(0, flat).view(T, E * self._table.shape[1])
        return _hook(data, gather_scales(self._sf, flat, T, E, use_tma_aligned_col_major_sf))


# ---------------------------------------------------------------------------------------------- front
class Engram:
    """One buffer's Engram: the table's shape once written, and the checks of every call.

    Arguments:
        runtime, backend: the buffer's runtime and its backend, ``"native"`` or ``"torch"``.
        group: the buffer's process group.
        num_bytes: the buffer's bytes (what one fetch's output may take, as DeepEP V2).
        num_cpu_bytes: this rank's CPU segment (0: no Engram); the native part opens it (collective).
        num_allocated_qps: the bound of ``engram_fetch``'s ``num_qps``, as DeepEP V2.
        device: the buffer's device.
    """

    def __init__(self, runtime: Any, backend: str, group: dist.ProcessGroup, num_bytes: int, num_cpu_bytes: int,
                 num_allocated_qps: int, device: torch.device) -> None:
        self.part: EngramPart = NativeEngram(runtime, group, num_cpu_bytes) if backend == "native" else \
            TorchEngram(runtime)
        self.group, self.num_bytes, self.num_cpu_bytes, self.device = group, num_bytes, num_cpu_bytes, device
        self.num_allocated_qps, self.num_ranks = num_allocated_qps, runtime.num_ranks
        self.shape: Tuple[int, ...] = ()  # (entries per rank, hidden, element size) after engram_write

    def _write_args(self, storage: Any, sf: Any) -> None:
        """Checks this rank's shard and the replicated scale table."""
        if not self.num_cpu_bytes:
            raise ValueError("engram_write: the buffer has no CPU (Engram) segment; create it with num_cpu_bytes > 0 "
                             "(get_engram_storage_size_hint sizes it)")
        check_tensor("storage", storage, (torch.bfloat16, torch.float8_e4m3fn), 2, self.device)
        if storage.shape[0] < 1 or storage.shape[1] < 1:
            raise ValueError(f"storage: expected [num_entries >= 1, hidden >= 1], got {describe(storage)}")
        if storage.nbytes > self.num_cpu_bytes:
            raise ValueError(f"storage: {storage.nbytes} bytes exceed num_cpu_bytes={self.num_cpu_bytes}")
        fp8 = storage.dtype == torch.float8_e4m3fn
        if fp8 != (sf is not None):
            raise ValueError("sf: expected the scale factors with an FP8 (float8_e4m3fn) storage and None with a bf16 "
                             f"one, got {describe(sf)} with {storage.dtype}")
        if sf is not None:
            check_tensor("sf", sf, (torch.float32, torch.int32), 2, self.device)
            total = storage.shape[0] * self.num_ranks
            if sf.shape[0] != total or sf.shape[1] < 1:
                raise ValueError(f"sf: expected [num_entries x num_ranks = {total}, num_sf_packs >= 1] (replicated on "
                                 f"every rank), got {describe(sf)}")

    def _fetch_args(self, indices: Any, num_qps: Any, use_tma_aligned_col_major_sf: Any) -> None:
        """Checks ``engram_fetch``'s arguments; every index must name an entry (``[0, entries x ranks)``)."""
        if not self.shape:
            raise ValueError("engram_fetch: no Engram table; call engram_write first")
        check_tensor("indices", indices, (torch.int32,), 2, self.device)
        _num_qps(self, num_qps)
        if not isinstance(use_tma_aligned_col_major_sf, bool):
            raise ValueError(f"use_tma_aligned_col_major_sf: expected a bool, got {use_tma_aligned_col_major_sf!r}")
        num_entries, hidden, elem = self.shape
        T, E = indices.shape
        if T * E * hidden * elem > self.num_bytes:
            raise ValueError(f"indices: {T} x {E} entries of {hidden * elem} bytes exceed the buffer's num_bytes="
                             f"{self.num_bytes}")
        total = num_entries * self.num_ranks
        if indices.numel():
            bad = (indices < 0) | (indices >= total)
            num_bad = int(bad.sum())
            if num_bad:
                example = int(indices[bad][0])
                raise ValueError(f"indices: {num_bad} outside [0, {total}) (the table's entries on all ranks), e.g. "
                                 f"{example}; DeepEP V2 reads such indices unchecked")

    def write(self, storage: Any, sf: Any) -> None:
        on_every_rank(self.group, "engram_write", self._write_args, storage, sf)
        self.shape = ()
        self.part.write(storage, sf)
        self.shape = (storage.shape[0], storage.shape[1], storage.element_size())

    def fetch(self, indices: Any, num_qps: Any, use_tma_aligned_col_major_sf: Any) -> Hook:
        self._fetch_args(indices, num_qps, use_tma_aligned_col_major_sf)
        return self.part.fetch(indices, use_tma_aligned_col_major_sf)

    def close(self) -> None:
        self.part.close()
