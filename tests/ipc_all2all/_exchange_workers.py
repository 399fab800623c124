"""Worker bodies of test_exchange_cpu.py (importable by spawned children): ipc_all2all's byte exchange
(``_collective.gather_bytes``) and the records of the collective construction over gloo, with peers
that send what the protocol allows and peers that do not."""
from __future__ import annotations

import struct

import torch

from tests._dist import init_gloo
from tests.ipc_all2all._cpu_workers import CpuCore, cpu_stand_ins

LARGE = 50_000  # bytes: a record far longer than any the construction sends, under the default bound


def payload(case: str, rank: int) -> bytes:
    """What ``rank`` sends in ``case`` (test_exchange_cpu.py computes the expected list from it too)."""
    if case == "empty":
        return b""
    if case == "every byte value":  # all 256 values, a different rotation on each rank
        return bytes((i + 37 * rank) % 256 for i in range(256))
    if case == "one byte":
        return bytes([(0, 255, 128)[rank % 3]])
    if case == "0, 1, large":  # ranks of different lengths: the padding must not leak into the result
        n = (0, 1, LARGE)[rank % 3]
        return bytes((7 * i + rank) % 256 for i in range(n))
    if case == "large":
        return bytes((i * 131 + rank) % 256 for i in range(LARGE + rank))
    if case == "zeros and 0xff":  # trailing zeros are data, not padding
        return b"\x00" * (rank + 1) if rank % 2 == 0 else b"\xff" * (rank + 1) + b"\x00"
    raise ValueError(case)


CASES = ["empty", "every byte value", "one byte", "0, 1, large", "large", "zeros and 0xff"]


def worker_gather_bytes_round_trip(rank, world, rdzv):
    from ipc_all2all import _collective

    group = init_gloo(rank, world, rdzv)
    out = {}
    for case in CASES:
        got = _collective.gather_bytes(group, payload(case, rank))
        assert all(type(b) is bytes for b in got), [type(b) for b in got]
        out[case] = got
    out["bytearray"] = _collective.gather_bytes(group, bytearray(payload("every byte value", rank)))
    out["default group"] = _collective.gather_bytes(None, payload("one byte", rank))
    return out


def _raw_peer(group, world, announced: int) -> None:
    """A peer that speaks the length half of the protocol by hand, announcing ``announced`` bytes."""
    import torch.distributed as dist

    every = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, torch.tensor([announced], dtype=torch.int64), group=group)


def worker_gather_bytes_bound(rank, world, rdzv):
    """A rank over the bound (its own or a peer's), a negative length and an absurd one: every rank
    raises CommError naming the rank before any bytes travel, and the group stays in step."""
    import ipc_all2all
    from ipc_all2all import _collective

    group = init_gloo(rank, world, rdzv)
    out = {}
    # 1. rank 1 sends one byte more than the bound; at the bound is fine
    try:
        _collective.gather_bytes(group, b"x" * (101 if rank == 1 else 100), limit=100, what="test")
    except ipc_all2all.CommError as e:
        out["over"] = str(e)
    out["at"] = _collective.gather_bytes(group, b"y" * 100, limit=100)
    # 2. rank 2 announces a negative length, then 2**40 bytes, without sending any: the others refuse
    #    before allocating what it claims
    for name, announced in [("negative", -5), ("huge", 1 << 40)]:
        if rank == 2:
            _raw_peer(group, world, announced)
            continue
        try:
            _collective.gather_bytes(group, b"mine", what="test")
        except ipc_all2all.CommError as e:
            out[name] = str(e)
    # 3. still in step: the next exchange delivers every rank's bytes
    out["after"] = _collective.gather_bytes(group, bytes([rank]))
    return out


def _ok_head(capacity: int, name_len: int) -> bytes:
    return b"O" + struct.pack("<QB", capacity, name_len)


#: Records a broken or hostile rank 1 sends in the construction, instead of its own.
MALFORMED = {
    "empty": b"",
    "unknown kind": b"X" + b"\x00" * 20,
    "short header": b"O\x01\x02\x03",
    "dtype past the end": _ok_head(16 * 256 * 2, 200) + b"torch.bfloat16" + b"h",
    "no handle": _ok_head(16 * 256 * 2, 14) + b"torch.bfloat16",
    "dtype not ASCII": _ok_head(16 * 256 * 2, 3) + b"\xff\xfe\xfd" + b"handle",
    "dtype not printable": _ok_head(16 * 256 * 2, 3) + b"a\nb" + b"handle",
    "message too long": b"E" + b"m" * 4097,
    "over the bound": b"E" + b"m" * (1 << 16),
    "message not UTF-8": b"E\xff\xfe boom",  # well-formed: shown with replacement characters
}


def worker_malformed_construction(rank, world, rdzv):
    """Rank 1 sends each of MALFORMED as its construction record (every other rank its real one): every
    rank raises, naming rank 1 and what is wrong, releases the core it built, and a construction after
    it succeeds. Then rank 1 sends each malformed status record after opening the peers' buffers."""
    import ipc_all2all
    from ipc_all2all import _collective

    group = init_gloo(rank, world, rdzv)
    cpu_stand_ins()
    real_local, real_status = _collective.local_payload, _collective.status_payload
    out = {}
    for name, record in MALFORMED.items():
        if rank == 1:
            _collective.local_payload = lambda obj, record=record: record
        before = len(CpuCore.made)
        try:
            ipc_all2all.All2All(rank, world, 16, 256, 8, torch.bfloat16, group=group)
        except (ipc_all2all.CommError, ValueError) as e:
            (core,) = CpuCore.made[before:]
            out[name] = (type(e).__name__, str(e), core.destroyed and not core.opened)
        else:
            raise AssertionError(f"a construction with rank 1's record {name!r} succeeded")
        _collective.local_payload = real_local
    a = ipc_all2all.All2All(rank, world, 16, 256, 8, torch.bfloat16, group=group)
    out["handles"] = a._core.handles
    a.destroy()
    statuses = {"ok byte with a tail": b"O junk", "unknown kind": b"?", "empty": b"",
                "message too long": b"E" + b"m" * 4097, "an error": b"E" + "RuntimeError: no peer é".encode()}
    out["status"] = {}
    for name, record in statuses.items():
        if rank == 1:
            _collective.status_payload = lambda err, record=record: record
        before = len(CpuCore.made)
        try:
            ipc_all2all.All2All(rank, world, 16, 256, 8, torch.bfloat16, group=group)
        except ipc_all2all.CommError as e:
            (core,) = CpuCore.made[before:]
            out["status"][name] = (str(e), core.destroyed)
        else:
            raise AssertionError(f"a construction with rank 1's status {name!r} succeeded")
        _collective.status_payload = real_status
    return out
