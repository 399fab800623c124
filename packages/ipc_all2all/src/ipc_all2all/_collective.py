"""Collective construction: every rank of a process group builds its instance, the ranks exchange
what happened and their IPC handles, and either every rank gets a ready instance or every rank
raises, naming the rank that failed (no rank is left waiting in a collective the others skipped).

Used by ``All2All.from_group`` and by the constructor when it is given a ``group`` (LTX's form).

Never trust what a peer writes: every exchange travels as fixed-size integer or byte tensors
(:func:`gather_bytes`: the lengths, then the bytes padded to the longest, with a bound on the
length), in an explicit encoding that is decoded defensively (:func:`decode_construction`,
:func:`decode_status`). Nothing a peer sends is unpickled, and a peer's malformed record makes every
rank raise an error naming that rank.
"""
from __future__ import annotations

import struct
import warnings
from typing import List, Optional, Tuple, Union

from . import _C

CommError = _C.CommError

#: The longest record :func:`gather_bytes` takes from a rank unless told otherwise (a construction
#: record is ~120 bytes; an error message is cut at :data:`MESSAGE_BYTES`).
MAX_RECORD_BYTES = 1 << 16
#: The longest error message (UTF-8 bytes) a rank sends its peers; longer ones are cut.
MESSAGE_BYTES = 4096
#: The longest dtype name a construction record carries (its length is one byte).
DTYPE_NAME_BYTES = 255

# The records: one kind byte, then
#   b"O" (construction): slot capacity (uint64, little-endian), the dtype name's length (uint8), the
#        dtype name (ASCII), the IPC handle (the rest, at least one byte);
#   b"O" (status): nothing;
#   b"E" (both): the error message (UTF-8, at most MESSAGE_BYTES bytes).
_OK, _ERROR = b"O", b"E"
_OK_HEAD = struct.Struct("<QB")


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


def _message(text: str) -> bytes:
    """``text`` as UTF-8, cut at :data:`MESSAGE_BYTES` on a character boundary."""
    data = text.encode("utf-8", "replace")
    if len(data) > MESSAGE_BYTES:
        data = data[:MESSAGE_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return data


def local_payload(obj) -> bytes:
    """What a rank that built its instance tells the others: its handle and what must agree (the
    slot capacity and the dtype), as a construction record (see the module's encoding)."""
    handle, dtype = bytes(obj.get_local_ipc_handle()), str(obj.tensor_dtype).encode("ascii")
    if not handle:
        raise ValueError("get_local_ipc_handle() returned no bytes")
    if len(dtype) > DTYPE_NAME_BYTES:
        raise ValueError(f"tensor_dtype's name is longer than {DTYPE_NAME_BYTES} bytes")
    return _OK + _OK_HEAD.pack(int(obj.capacity), len(dtype)) + dtype + handle


def error_payload(err: BaseException) -> bytes:
    """The record of a rank that failed: its exception's type and message (cut at :data:`MESSAGE_BYTES`)."""
    return _ERROR + _message(f"{type(err).__name__}: {err}")


def status_payload(err: Optional[BaseException]) -> bytes:
    """The status record after opening the peers' buffers: ok, or the exception's type and message."""
    return _OK if err is None else error_payload(err)


def _peer_message(data: bytes) -> str:
    # A peer's message is shown, not parsed: bytes that are not UTF-8 are replaced, never fatal.
    return data.decode("utf-8", "replace")


def _not_a_record(record: bytes, kind: str) -> Optional[str]:
    """Why ``record`` is neither an ok (``b"O"``...) nor a well-formed error record, or None."""
    if not record:
        return f"malformed {kind} record (empty)"
    if record[:1] == _ERROR:
        if len(record) > 1 + MESSAGE_BYTES:
            return (f"malformed {kind} record (an error message of {len(record) - 1} bytes, at most "
                    f"{MESSAGE_BYTES})")
        return None
    if record[:1] != _OK:
        return f"malformed {kind} record (kind byte 0x{record[0]:02x})"
    return None


def decode_construction(record: bytes) -> tuple:
    """A peer's construction record: ``("ok", handle, capacity, dtype_name)``, ``("error", message)``,
    or ``("error", "malformed construction record (...)")`` for anything else. Never raises."""
    why = _not_a_record(record, "construction")
    if why is not None:
        return ("error", why)
    if record[:1] == _ERROR:
        return ("error", _peer_message(record[1:]))
    head = 1 + _OK_HEAD.size
    if len(record) < head:
        return ("error", f"malformed construction record ({len(record)} bytes, shorter than its "
                         f"{head}-byte header)")
    capacity, name_len = _OK_HEAD.unpack_from(record, 1)
    if len(record) < head + name_len + 1:
        return ("error", f"malformed construction record ({len(record)} bytes: too short for a dtype name "
                         f"of {name_len} bytes and an IPC handle)")
    try:
        dtype = record[head:head + name_len].decode("ascii")
    except UnicodeDecodeError:
        return ("error", "malformed construction record (the dtype name is not ASCII)")
    if not dtype.isprintable():
        return ("error", "malformed construction record (the dtype name is not printable)")
    return ("ok", record[head + name_len:], capacity, dtype)


def decode_status(record: bytes) -> Tuple[bool, str]:
    """A peer's status record: ``(True, "")``, ``(False, message)``, or ``(False, "malformed status
    record (...)")`` for anything else. Never raises."""
    why = _not_a_record(record, "status")
    if why is not None:
        return False, why
    if record[:1] == _ERROR:
        return False, _peer_message(record[1:])
    if len(record) != 1:
        return False, f"malformed status record ({len(record) - 1} bytes after the ok byte, expected none)"
    return True, ""


def group_device(group) -> str:
    """Where ``group``'s collectives take tensors: the CPU for gloo, else the current CUDA device."""
    import torch.distributed as dist

    return "cpu" if dist.get_backend(group) == "gloo" else "cuda"


def gather_bytes(group, data: Union[bytes, bytearray], *, limit: int = MAX_RECORD_BYTES,
                 what: str = "ipc_all2all", device: Optional[str] = None) -> List[bytes]:
    """Collective: every rank's ``data`` by rank (the same call on every rank of ``group``).

    Two fixed-size all-gathers on the group's device (:func:`group_device`, or ``device``): every
    rank's length (one int64), then every rank's bytes padded to the longest (uint8). Unlike
    ``all_gather_object`` nothing a peer sends is unpickled.

    Raises:
        CommError: on every rank alike, before the bytes travel, when a rank announced a length
            outside ``[0, limit]`` (this rank's own ``data`` included), naming the rank: no rank
            allocates what a peer claims beyond the bound.
    """
    import torch
    import torch.distributed as dist

    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"{what}: gather_bytes takes bytes, got {type(data).__name__}")
    device = device or group_device(group)
    world = dist.get_world_size(group)
    mine = torch.tensor([len(data)], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    lengths = torch.cat(every).cpu().tolist()
    bad = [(r, n) for r, n in enumerate(lengths) if not 0 <= n <= limit]
    if bad:
        raise CommError(f"{what}: " + "; ".join(f"rank {r} announced a record of {n} bytes" for r, n in bad)
                        + f" (the exchange takes 0 to {limit} bytes a rank)")
    width = max(lengths)
    if width == 0:
        return [b""] * world
    padded = torch.zeros(width, dtype=torch.uint8)
    if data:
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    padded = padded.to(device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [bytes(t[:n].cpu().tolist()) for t, n in zip(parts, lengths)]


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
                        device=group_device(group))
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    obj._core.watch_peers([tuple(v + top if v < 0 else v for v in t.tolist()) for t in every], period)


def exchange(obj, err: Optional[BaseException], payload: bytes, group, rank: int, world: int, what: str) -> None:
    """The collective half of a construction.

    Arguments:
        obj: this rank's instance (None if building it failed).
        err: the exception building it raised, or None.
        payload: :func:`local_payload` of ``obj``, or :func:`error_payload` of ``err``.
        group, rank, world: the process group, this rank in it, its size.
        what: the call's name for the messages ("All2All.from_group", ...).

    On return every rank's ``obj`` has opened every peer's buffer. Otherwise every rank raises: the
    failing rank its own exception (or ``ValueError`` when its arguments were wrong), the others
    ``CommError`` naming the rank(s) and their errors (a malformed record counts as its rank's
    error); ``obj`` is released first. Every rank decodes the same records the same way, so every
    rank takes the same branch.
    """
    try:
        gathered = [decode_construction(rec) for rec in gather_bytes(group, payload, what=what)]
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
            status = status_payload(None)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            status = status_payload(e)
        statuses = [decode_status(rec) for rec in gather_bytes(group, status, what=what)]
        bad = [(r, m) for r, (ok, m) in enumerate(statuses) if not ok]
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
