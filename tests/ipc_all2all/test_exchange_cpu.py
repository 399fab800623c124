"""CPU tests of what the ranks of a collective construction send each other: never trust what a peer
writes. The exchange (``_collective.gather_bytes``) is two fixed-size tensor all-gathers, the lengths
then the bytes, with a bound on the length; the records (construction: status byte, slot capacity,
dtype name, IPC handle; status: status byte and message) have an explicit encoding, decoded
defensively. Nothing a peer sends is unpickled, and a malformed record makes every rank raise an
error naming the rank that sent it."""
from __future__ import annotations

import random
import struct
import types

import pytest
import torch

from ipc_all2all import _collective as C
from tests.ipc_all2all import _exchange_workers as X

WORLD = 3
CAP = 16 * 256 * 2  # the slot of All2All(rank, W, 16, 256, 8, torch.bfloat16)


# ------------------------------------------------------------------ gather_bytes over gloo
def test_gather_bytes_round_trips_every_byte_value_and_length(tmp_path):
    from tests._dist import run_workers

    res = run_workers(X.worker_gather_bytes_round_trip, WORLD, tmp_path=tmp_path, timeout=120)
    for rank, got in enumerate(res):
        for case in X.CASES:
            assert got[case] == [X.payload(case, r) for r in range(WORLD)], (rank, case)
        assert got["bytearray"] == [X.payload("every byte value", r) for r in range(WORLD)], rank
        assert got["default group"] == [X.payload("one byte", r) for r in range(WORLD)], rank
    # the cases cover every byte value and the lengths 0, 1 and large, on one rank and across ranks
    assert set(b"".join(X.payload("every byte value", r) for r in range(WORLD))) == set(range(256))
    assert [len(X.payload("0, 1, large", r)) for r in range(WORLD)] == [0, 1, X.LARGE]


@pytest.mark.fault
def test_gather_bytes_refuses_a_length_over_the_bound_on_every_rank(tmp_path):
    from tests._dist import run_workers

    res = run_workers(X.worker_gather_bytes_bound, WORLD, tmp_path=tmp_path, timeout=120)
    for rank, out in enumerate(res):
        assert out["over"] == "test: rank 1 announced a record of 101 bytes (the exchange takes 0 to 100 " \
                              "bytes a rank)", (rank, out)
        assert out["at"] == [b"y" * 100] * WORLD, rank
        if rank != 2:
            assert out["negative"].startswith("test: rank 2 announced a record of -5 bytes"), out
            assert out["huge"].startswith(f"test: rank 2 announced a record of {1 << 40} bytes"), out
            assert f"0 to {C.MAX_RECORD_BYTES} bytes" in out["huge"], out
        assert out["after"] == [bytes([r]) for r in range(WORLD)], rank


def test_gather_bytes_takes_only_bytes():
    with pytest.raises(TypeError, match="gather_bytes takes bytes, got str"):
        C.gather_bytes(None, "text")  # before any collective call


# ------------------------------------------------------------------ the records, in one process
def _obj(handle=b"\x00handle\xff", capacity=CAP, dtype=torch.bfloat16):
    return types.SimpleNamespace(get_local_ipc_handle=lambda: handle, capacity=capacity, tensor_dtype=dtype)


@pytest.mark.parametrize("handle", [bytes(range(256)), b"\x00", b"\x00" * 96], ids=["every byte", "one", "96 zeros"])
def test_construction_record_round_trips(handle):
    rec = C.local_payload(_obj(handle=handle))
    assert rec[:1] == b"O"
    assert C.decode_construction(rec) == ("ok", handle, CAP, "torch.bfloat16")
    big = (1 << 64) - 1  # the capacity travels as uint64
    assert C.decode_construction(C.local_payload(_obj(handle=handle, capacity=big)))[2] == big


def test_construction_record_refuses_what_it_cannot_encode():
    with pytest.raises(ValueError, match="returned no bytes"):
        C.local_payload(_obj(handle=b""))
    with pytest.raises(struct.error):
        C.local_payload(_obj(capacity=1 << 64))
    with pytest.raises(ValueError, match="longer than 255 bytes"):
        C.local_payload(_obj(dtype="d" * 256))


def test_error_and_status_records_round_trip():
    err = RuntimeError("peer 2: cudaIpcOpenMemHandle failed — invalid argument")
    want = "RuntimeError: peer 2: cudaIpcOpenMemHandle failed — invalid argument"
    assert C.decode_construction(C.error_payload(err)) == ("error", want)
    assert C.decode_status(C.status_payload(err)) == (False, want)
    assert C.decode_status(C.status_payload(None)) == (True, "")
    assert C.decode_construction(C.error_payload(ValueError(""))) == ("error", "ValueError: ")


def test_a_long_message_is_cut_on_a_character_boundary():
    rec = C.error_payload(ValueError("é" * 5000))  # 2 bytes a character: the bound falls inside none or one
    assert len(rec) <= 1 + C.MESSAGE_BYTES
    text = rec[1:].decode("utf-8")  # strict: no half character left at the end
    assert text.startswith("ValueError: ééé") and set(text[len("ValueError: "):]) == {"é"}
    assert C.decode_construction(rec) == ("error", text)


_MALFORMED_CONSTRUCTION = [
    (b"", "malformed construction record (empty)"),
    (b"X", "malformed construction record (kind byte 0x58)"),
    (b"\x80" * 40, "malformed construction record (kind byte 0x80)"),
    (b"O\x01", "malformed construction record (2 bytes, shorter than its 10-byte header)"),
    (X._ok_head(CAP, 200) + b"torch", "too short for a dtype name of 200 bytes and an IPC handle"),
    (X._ok_head(CAP, 14) + b"torch.bfloat16", "too short for a dtype name of 14 bytes and an IPC handle"),
    (X._ok_head(CAP, 2) + b"\xc3\xa9handle", "malformed construction record (the dtype name is not ASCII)"),
    (X._ok_head(CAP, 2) + b"\x00\x07handle", "malformed construction record (the dtype name is not printable)"),
    (b"E" + b"m" * (C.MESSAGE_BYTES + 1), f"an error message of {C.MESSAGE_BYTES + 1} bytes, at most "
                                          f"{C.MESSAGE_BYTES}"),
]


@pytest.mark.parametrize("record,why", _MALFORMED_CONSTRUCTION, ids=[w[:40] for _, w in _MALFORMED_CONSTRUCTION])
@pytest.mark.fault
def test_a_malformed_construction_record_says_what_is_wrong(record, why):
    kind, msg = C.decode_construction(record)
    assert kind == "error" and why in msg and msg.startswith("malformed construction record ("), msg


@pytest.mark.parametrize("record,why", [
    (b"", "malformed status record (empty)"),
    (b"O junk", "malformed status record (5 bytes after the ok byte, expected none)"),
    (b"\x00", "malformed status record (kind byte 0x00)"),
    (b"E" + b"m" * (C.MESSAGE_BYTES + 1), "malformed status record (an error message of"),
], ids=["empty", "ok with a tail", "zero byte", "message too long"])
@pytest.mark.fault
def test_a_malformed_status_record_says_what_is_wrong(record, why):
    ok, msg = C.decode_status(record)
    assert not ok and msg.startswith(why), msg


@pytest.mark.fault
def test_a_peer_message_that_is_not_utf8_is_shown_not_fatal():
    assert C.decode_construction(b"E\xff boom") == ("error", "\ufffd boom")
    assert C.decode_status(b"E\xc3") == (False, "\ufffd")


@pytest.mark.fault
def test_decoding_never_raises_on_arbitrary_bytes():
    rng = random.Random(36)
    for i in range(3000):
        n = rng.choice([0, 1, 2, 9, 10, 11, 12, 30, 120, C.MESSAGE_BYTES + 2])
        body = bytes(rng.randrange(256) for _ in range(n))
        if body and i % 3:  # mostly records with a known kind byte, so the decoders go past it
            body = rng.choice([b"O", b"E"]) + body[1:]
        got = C.decode_construction(body)
        assert got[0] in ("ok", "error") and isinstance(got[1], (bytes, str)), (body, got)
        if got[0] == "ok":
            assert isinstance(got[2], int) and got[3].isprintable() and got[1], (body, got)
        ok, msg = C.decode_status(body)
        assert isinstance(ok, bool) and isinstance(msg, str), (body, ok, msg)


# ------------------------------------------------------------------ malformed records in a construction over gloo
@pytest.mark.fault
def test_a_malformed_record_fails_the_construction_on_every_rank_naming_the_rank(tmp_path):
    """Rank 1 of 3 sends each of _exchange_workers.MALFORMED instead of its construction record, then
    malformed status records: every rank raises an error naming rank 1 and what is wrong, releases its
    core, and the next construction over the same group works."""
    from tests._dist import run_workers

    res = run_workers(X.worker_malformed_construction, WORLD, tmp_path=tmp_path, timeout=180)
    what = "All2All(group=...)"
    want = {
        "empty": "malformed construction record (empty)",
        "unknown kind": "malformed construction record (kind byte 0x58)",
        "short header": "malformed construction record (4 bytes, shorter than its 10-byte header)",
        "dtype past the end": "too short for a dtype name of 200 bytes and an IPC handle",
        "no handle": "too short for a dtype name of 14 bytes and an IPC handle",
        "dtype not ASCII": "malformed construction record (the dtype name is not ASCII)",
        "dtype not printable": "malformed construction record (the dtype name is not printable)",
        "message too long": f"an error message of 4097 bytes, at most {C.MESSAGE_BYTES}",
        "message not UTF-8": "\ufffd\ufffd boom",
    }
    for rank, out in enumerate(res):
        for name, fragment in want.items():
            kind, msg, released = out[name]
            assert kind == "CommError" and msg.startswith(f"{what} failed on rank 1: "), (rank, name, msg)
            assert fragment in msg and "rank 0" not in msg and "rank 2" not in msg, (rank, name, msg)
            assert released, (rank, name)
        kind, msg, released = out["over the bound"]
        assert kind == "CommError" and released, (rank, msg)
        assert msg == f"{what}: rank 1 announced a record of {1 + (1 << 16)} bytes (the exchange takes 0 to " \
                      f"{C.MAX_RECORD_BYTES} bytes a rank)", (rank, msg)
        assert out["handles"] == [f"handle of rank {r}".encode() for r in range(WORLD)], rank
        status = out["status"]
        prefix = f"{what}: opening the peers' buffers failed on rank 1: "
        assert status["ok byte with a tail"] == (prefix + "malformed status record (5 bytes after the ok byte, "
                                                 "expected none)", True), (rank, status)
        assert status["unknown kind"] == (prefix + "malformed status record (kind byte 0x3f)", True), status
        assert status["empty"] == (prefix + "malformed status record (empty)", True), status
        assert status["message too long"][0].startswith(prefix + "malformed status record (an error message"), status
        assert status["an error"] == (prefix + "RuntimeError: no peer é", True), status
