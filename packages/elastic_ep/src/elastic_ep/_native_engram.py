"""The native runtime's Engram: every rank's table shard in host memory that every GPU of the node reads
directly (``_C.EngramStore``: POSIX shared memory, owner-only and unguessable, pinned with
``cudaHostRegister``), so a fetch reads any rank's rows over PCIe with no peer taking part and no NIC
(DeepEP V2 reaches the shards with RDMA gets through NCCL GIN).

``engram_write`` copies this rank's shard into its segment (device to host, on the current stream) and
synchronises every rank; ``engram_fetch`` launches one kernel (one warp per token entry) that copies
the named rows into a new ``[T, E * hidden]`` tensor on the current stream; the scales (a table every
rank holds) are gathered on the device. Single node: the segments are the node's memory.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from . import _C
from ._checks import raise_if_any_rank_failed
from ._engram import check_same_shards, gather_scales

__all__ = ["NativeEngram", "open_engram_store"]


def open_engram_store(group: dist.ProcessGroup, num_cpu_bytes: int) -> "_C.EngramStore":
    """Collective: this rank's segment, attached to every peer's (names exchanged over ``group``), each
    name unlinked once every rank attached (so no exit path leaves one behind)."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    store, err = None, None
    try:
        store = _C.EngramStore(rank, R, num_cpu_bytes)
    except Exception as e:  # noqa: BLE001 - e.g. /dev/shm too small: every rank raises below
        err = e
    raise_if_any_rank_failed(group, err, "num_cpu_bytes: creating the Engram host segment")
    try:
        names = [None] * R
        dist.all_gather_object(names, store.name, group=group)
        err = None
        try:
            store.attach(names)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            err = e
        raise_if_any_rank_failed(group, err, "num_cpu_bytes: attaching the peers' Engram segments", cleanup=store.close)
    finally:
        store.unlink()
    return store


class NativeEngram:
    """Engram methods of ``NativeRuntime`` (mixed in; ``_engram_store`` is set when ``num_cpu_bytes > 0``)."""

    _engram_store: Optional["_C.EngramStore"] = None

    def open_engram(self, group: dist.ProcessGroup, num_cpu_bytes: int) -> None:
        """Collective: the segments of ``num_cpu_bytes`` (the buffer's constructor calls it)."""
        self.group = group
        self._engram_store = open_engram_store(group, num_cpu_bytes)

    def _close_engram(self) -> None:
        if self._engram_store is not None:
            self._engram_store.close()
            self._engram_store = None

    def engram_write(self, storage: torch.Tensor, sf: Optional[torch.Tensor]) -> None:
        """Collective: the shard into this rank's segment, then every rank's copy done before any fetch."""
        self._alive()
        self._engram_rows = 0
        check_same_shards(self.group, storage, sf)
        row_bytes = storage.shape[1] * storage.element_size()
        if row_bytes % 16:
            raise ValueError(f"storage: the native backend copies 16-byte words; a row of {row_bytes} bytes is not a "
                             "multiple of 16 (hidden % 8 == 0 for bf16, % 16 for FP8)")
        src = storage.contiguous()
        self._engram_store.write(src.data_ptr(), src.nbytes, torch.cuda.current_stream(self.device).cuda_stream)
        self._engram_sf = None if sf is None else sf.clone()
        self.barrier(True, True)  # synchronises the device (the copy) before and after the barrier
        self._engram_rows, self._engram_row_bytes, self._engram_dtype = storage.shape[0], row_bytes, storage.dtype
        self._engram_hidden = storage.shape[1]

    def engram_fetch(self, indices: torch.Tensor,
                     use_tma_aligned_col_major_sf: bool) -> Callable[[], Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """One fetch kernel on the current stream; the hook returns its outputs."""
        self._alive()
        T, E = indices.shape
        data = torch.empty((T, E * self._engram_hidden), dtype=self._engram_dtype, device=indices.device)
        idx = indices.contiguous()
        self._engram_store.fetch(idx.data_ptr(), T * E, self._engram_rows, self._engram_row_bytes, data.data_ptr(),
                                 torch.cuda.current_stream(self.device).cuda_stream)
        sf = gather_scales(self._engram_sf, idx.reshape(-1).long(), T, E, use_tma_aligned_col_major_sf)

        def hook() -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
            return data, sf

        return hook
