"""Collective construction: every rank of a process group builds its instance, the ranks exchange
what happened and their IPC handles, and either every rank gets a ready instance or every rank
raises, naming the rank that failed (no rank is left waiting in a collective the others skipped).

Used by ``All2All.from_group`` and by the constructor when it is given a ``group`` (LTX's form).
"""
from __future__ import annotations

import warnings
from typing import List, Optional, Tuple

from . import _C

CommError = _C.CommError


def group_rank_and_size(group, what: str) -> Tuple[int, int]:
    """This process's rank in ``group`` and the group's size.

    Raises ``ValueError`` (before any collective call) when torch.distributed is not initialised, when
    ``group`` is not a process group, or when this process is not a member of it.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{what}: group needs torch.distributed to be initialised "
                         "(torch.distributed.init_process_group) first")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{what}: group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(f"{what}: this process is not a member of group")
    return rank, world


def discard(obj) -> None:
    """Releases an instance that a failed collective construction will not hand out (not collective:
    no rank got it)."""
    core = getattr(obj, "_core", None) if obj is not None else None
    if core is None or core.destroyed:
        return
    if hasattr(obj, "comm_id"):  # registered (a build that failed half-way may not have got that far)
        obj._unregister()
    try:
        core.destroy()
    except Exception as e:  # noqa: BLE001 - the failure being raised is the one that matters
        warnings.warn(f"ipc_all2all: releasing a failed collective construction failed: {e}", ResourceWarning,
                      stacklevel=3)


def local_payload(obj) -> tuple:
    """What a rank that built its instance tells the others: its handle and what must agree."""
    return ("ok", obj.get_local_ipc_handle(), obj.capacity, str(obj.tensor_dtype))


def error_payload(err: BaseException) -> tuple:
    return ("error", f"{type(err).__name__}: {err}")


def watch_peers(obj, group, world: int) -> None:
    """Collective: every rank's process id (one all-gather of four uint64 as int64: nothing a peer sends
    is unpickled), then ``obj``'s peer watch, which ends this rank's waits at once when a peer's process
    on this host dies (every ``IPC_ALL2ALL_PEER_WATCH_MS`` ms, default 200; 0 turns it off)."""
    import os

    import torch
    import torch.distributed as dist

    period = int(os.environ.get("IPC_ALL2ALL_PEER_WATCH_MS", "200") or 0)
    if period <= 0:
        return
    top = 1 << 64
    mine = torch.tensor([v - top if v >= top // 2 else v for v in _C.this_process()], dtype=torch.int64,
                        device="cpu" if dist.get_backend(group) == "gloo" else "cuda")
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    obj._core.watch_peers([tuple(v + top if v < 0 else v for v in t.tolist()) for t in every], period)


def exchange(obj, err: Optional[BaseException], payload: tuple, group, rank: int, world: int, what: str) -> None:
    """The collective half of a construction.

    Arguments:
        obj: this rank's instance (None if building it failed).
        err: the exception building it raised, or None.
        payload: :func:`local_payload` of ``obj``, or :func:`error_payload` of ``err``.
        group, rank, world: the process group, this rank in it, its size.
        what: the call's name for the messages ("All2All.from_group", ...).

    On return every rank's ``obj`` has opened every peer's buffer. Otherwise every rank raises: the
    failing rank its own exception (or ``ValueError`` when its arguments were wrong), the others
    ``CommError`` naming the rank(s) and their errors; ``obj`` is released first.
    """
    import torch.distributed as dist

    try:
        gathered: List = [None] * world
        dist.all_gather_object(gathered, payload, group=group)
        bad = [(r, p[1]) for r, p in enumerate(gathered) if p[0] != "ok"]
        if bad:
            discard(obj)
            if err is not None and all(r == rank for r, _ in bad):
                raise err
            msg = f"{what} failed on " + "; ".join(f"rank {r}: {m}" for r, m in bad)
            if isinstance(err, ValueError):  # this rank's own arguments were wrong too: keep the type
                raise ValueError(msg) from err
            raise CommError(msg) from err
        # Peers address each other's slots by this rank's layout: every rank must size alike.
        shapes = {(p[2], p[3]) for p in gathered}
        if len(shapes) != 1:
            discard(obj)
            raise ValueError(f"{what}: every rank must pass the same num_tokens * hidden_dim and tensor_dtype; got "
                             + "; ".join(f"rank {r}: {p[2]} bytes {p[3]}" for r, p in enumerate(gathered)))
        try:
            obj.sync([p[1] for p in gathered])
            status = ("ok", "")
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            status = error_payload(e)
        statuses: List = [None] * world
        dist.all_gather_object(statuses, status, group=group)
        bad = [(r, s[1]) for r, s in enumerate(statuses) if s[0] != "ok"]
        if bad:
            discard(obj)
            raise CommError(f"{what}: opening the peers' buffers failed on "
                            + "; ".join(f"rank {r}: {m}" for r, m in bad))
        watch_peers(obj, group, world)
    except BaseException:
        # The exchange itself failed (a peer died, the group timed out, an interrupt): the buffer and
        # the peers' mappings must not wait for the garbage collector.
        discard(obj)
        raise
