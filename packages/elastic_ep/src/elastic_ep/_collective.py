"""Collective steps every rank takes together, over a torch.distributed group: every rank learns
whether any rank failed (``raise_if_any_rank_failed``, ``on_every_rank``), every rank passes the same
values (``agree_on_every_rank``), and every rank's integers or bytes by rank (``gather_ints``,
``gather_bytes``). Everything travels as fixed-size integer or byte tensors: nothing a peer sends is
unpickled.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

def raise_if_any_rank_failed(group: dist.ProcessGroup, err: Optional[BaseException], what: str,
                             cleanup: Any = None) -> None:
    """Collective: every rank of ``group`` learns whether ``what`` failed on some rank (``err``: this
    rank's exception, or None). If it did, ``cleanup`` runs and every rank raises: a rank that failed
    its own exception, the others one naming each failed rank and its error (a ``ValueError`` when all
    of those are, else a ``RuntimeError``). So no rank goes on while a peer gave up."""
    # b"" (no failure), or b"V" (a ValueError) / b"E" and the message: bytes, never unpickled.
    mine = b""
    if err is not None:
        text = f"{type(err).__name__}: {err}".encode("utf-8", "replace")[:4096]
        mine = (b"V" if isinstance(err, ValueError) else b"E") + text
    failed = [(r, st[1:].decode("utf-8", "replace"), st[:1] == b"V")
              for r, st in enumerate(gather_bytes(group, mine)) if st]
    if not failed:
        return
    if cleanup is not None:
        cleanup()
    if err is not None:
        raise err
    kind = ValueError if all(is_value for _, _, is_value in failed) else RuntimeError
    raise kind(f"{what} failed on " + "; ".join(f"rank {r}: {msg}" for r, msg, _ in failed))


def on_every_rank(group: dist.ProcessGroup, what: str, step: Any, *args: Any) -> Any:
    """Collective: ``step(*args)`` on this rank, then every rank learns whether it raised ``ValueError`` on
    some rank (``raise_if_any_rank_failed``), so a configuration one rank refuses is refused by all.
    Returns ``step``'s value."""
    err, out = None, None
    try:
        out = step(*args)
    except ValueError as e:
        err = e
    raise_if_any_rank_failed(group, err, what)
    return out


def agree_on_every_rank(group: dist.ProcessGroup, what: str, values: Dict[str, int],
                        device: Union[str, torch.device] = "cuda") -> None:
    """Collective: every rank of ``group`` passes the same ``values`` (ints, the same names in the same
    order on every rank), or every rank raises ``ValueError`` naming the first that differs, the ranks
    and their values. One all-gather of a fixed-size int64 record: nothing a peer sends is unpickled.

    Arguments:
        group: the process group; ``device``: where its collectives take tensors ("cuda" for NCCL).
        what: the call, for the message (e.g. "ElasticBuffer(...)").
        values: argument name -> value.
    """
    names = list(values)
    rows = gather_ints(group, [int(values[n]) for n in names], device)
    for i, name in enumerate(names):
        seen = [row[i] for row in rows]
        if len(set(seen)) > 1:
            by_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(seen))
            raise ValueError(f"{what}: {name} must be the same on every rank (a rank with a larger one would "
                             f"write past its peers' memory), got {by_rank}")


def group_device(group: dist.ProcessGroup) -> str:
    """Where ``group``'s collectives take tensors: the CPU for gloo, else the current CUDA device."""
    return "cpu" if dist.get_backend(group) == "gloo" else "cuda"


def gather_bytes(group: dist.ProcessGroup, data: bytes, device: Optional[str] = None) -> List[bytes]:
    """Collective: every rank's ``data`` (any length; the same call on every rank), by rank: the lengths,
    then the bytes padded to the longest, through two fixed-size all-gathers. Unlike
    ``all_gather_object`` nothing a peer sends is unpickled."""
    device = device or group_device(group)
    lengths = [row[0] for row in gather_ints(group, [len(data)], device)]
    width = max(lengths)
    if width == 0:
        return [b""] * len(lengths)
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    mine = mine.to(device)
    every = [torch.empty_like(mine) for _ in lengths]
    dist.all_gather(every, mine, group=group)
    return [bytes(t[:n].cpu().tolist()) for t, n in zip(every, lengths)]


def gather_ints(group: dist.ProcessGroup, values: Sequence[int], device: Union[str, torch.device] = "cuda",
                unsigned: bool = False) -> List[List[int]]:
    """Collective: every rank's ``values`` (the same count on every rank), by rank, through one
    fixed-size int64 all-gather: nothing a peer sends is unpickled. ``unsigned``: the values are
    uint64 (carried through int64 and back)."""
    top = 1 << 64
    wrap = [v - top if unsigned and v >= (1 << 63) else v for v in values]
    mine = torch.tensor(wrap, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [[v + top if unsigned and v < 0 else v for v in t.tolist()] for t in every]


def all_ok(group: dist.ProcessGroup, ok: bool) -> bool:
    """Collective: whether ``ok`` holds on every rank of ``group``."""
    return not any(row[0] for row in gather_ints(group, [0 if ok else 1], group_device(group)))
