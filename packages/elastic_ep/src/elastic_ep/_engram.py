"""What both runtimes' Engram share: the collective check that every rank installs a shard of the same
shape and dtype, and the gather of the (replicated, device-resident) scale table."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

__all__ = ["check_same_shards", "gather_scales"]


def check_same_shards(group: dist.ProcessGroup, storage: torch.Tensor, sf: Optional[torch.Tensor]) -> None:
    """Collective: raises ``ValueError`` on every rank unless every rank's ``storage`` (and ``sf``) has the
    same shape and dtype."""
    meta = (tuple(storage.shape), str(storage.dtype), None if sf is None else (tuple(sf.shape), str(sf.dtype)))
    metas: List[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(metas, meta, group=group)
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
