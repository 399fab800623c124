"""How the host reads the failure record its kernels and its peer watch write (Core::check's reader,
csrc/failure_record.cpp), on forged records in host memory: no GPU.

A record is read only when its flag says complete (1) and two copies of its fields, with the flag
re-read after them, agree: a record still being written (flag 2), or one whose fields change under
the reader (the peer watch's plain stores racing a kernel's report), is never reported half-written
or mixed. A complete record whose fields this rank's kernels could not have written (another rank, a
peer outside the world, an unknown operation) is reported as unreadable instead of naming that rank
or operation.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest

from ipc_all2all import _C

pytestmark = pytest.mark.fault  # forged, torn and half-written failure records

SEND = _C.OP_SEND_RECV_HEADS
# commkit::TimeoutRecord: flag, op (u32), rank, peer (i32), expected, observed (i64), waited_ns (u64), channel (u32)
_FIELDS = {"flag": (0, "<I"), "op": (4, "<I"), "rank": (8, "<i"), "peer": (12, "<i"), "expected": (16, "<q"),
           "observed": (24, "<q"), "waited_ns": (32, "<Q"), "channel": (40, "<I")}


class Record:
    """A 64-byte, 64-byte aligned record in host memory, written field by field as a writer would."""

    def __init__(self):
        self._mem = np.zeros(192, dtype=np.uint8)
        self.ptr = (self._mem.ctypes.data + 63) // 64 * 64
        self._view = self._mem[self.ptr - self._mem.ctypes.data:][:64]

    def set(self, **fields):
        for name, value in fields.items():
            off, fmt = _FIELDS[name]
            self._view[off:off + struct.calcsize(fmt)] = np.frombuffer(struct.pack(fmt, value), dtype=np.uint8)

    def read(self, world=2, rank=0, tries=1000, between=None):
        return _C.read_failure_record(self.ptr, world, rank, tries, between)


def _entry_timeout(rec, peer=1, expected=7):
    rec.set(op=SEND * 4 + _C.PHASE_ENTRY, rank=0, peer=peer, expected=expected, observed=6, waited_ns=10**9, channel=3)


def test_a_clear_record_and_destroys_abort_read_as_nothing():
    rec = Record()
    assert rec.read()[0] == "clear"
    rec.set(flag=_C.RECORD_FLAG_HOST_ABORT)
    assert rec.read()[0] == "clear"


def test_a_record_still_being_written_is_never_read():
    """flag 2: a kernel claimed the record and is storing its fields; some are there, some not."""
    rec = Record()
    rec.set(flag=2, op=SEND * 4 + _C.PHASE_ENTRY, rank=0)  # peer, expected, ... not yet written
    state, *_ = rec.read()
    assert state == "pending"
    rec.set(peer=1, expected=7, observed=6, flag=1)  # the writer's last store: flag = 1
    state, op, rank, peer, expected, observed, why = rec.read()
    assert (state, op, rank, peer, expected, observed, why) == ("ready", SEND * 4 + _C.PHASE_ENTRY, 0, 1, 7, 6, "")


def test_fields_that_change_under_the_reader_are_read_again_until_stable():
    """The peer watch stores its fields after checking flag == 0 while a kernel that claimed the record
    meanwhile stores its own and sets flag = 1: the reader's two copies differ until the last store
    landed, and it reports the record as it finally stands, not a mix of the two copies."""
    rec = Record()
    _entry_timeout(rec)
    rec.set(flag=1)
    late = iter([dict(peer=1, expected=8), dict(observed=9), dict(waited_ns=5)])
    calls = []

    def writer_still_storing():
        calls.append(1)
        rec.set(**next(late, {}))

    state, op, rank, peer, expected, observed, why = rec.read(between=writer_still_storing)
    assert state == "ready" and (peer, expected, observed) == (1, 8, 9), (state, peer, expected, observed)
    assert len(calls) == 4  # three reads spoiled by a store, the fourth stable


def test_a_record_that_never_settles_is_left_for_later():
    rec = Record()
    _entry_timeout(rec)
    rec.set(flag=1)
    n = iter(range(10**6))
    state, *_ = rec.read(tries=50, between=lambda: rec.set(expected=next(n)))
    assert state == "pending"


@pytest.mark.parametrize("forged, why", [
    (dict(rank=1), "names rank 1 as the rank that waited"),
    (dict(peer=7), "peer 7 is not a rank"),
    (dict(peer=0), "peer 0 is not a rank"),            # this rank itself
    (dict(peer=-1), "peer -1 is not a rank"),           # a timeout always names the peer it waited for
    (dict(op=3 * 4 + 1), "unknown operation code 13"),  # kPeerWatch's kind with a phase: no writer makes it
    (dict(op=9 * 4), "unknown operation code 36"),
])
def test_a_complete_record_no_writer_of_this_rank_makes_is_refused(forged, why):
    """Before, the host raised whatever the record said: a forged peer 7 became 'waiting for peer 7'."""
    rec = Record()
    _entry_timeout(rec)
    rec.set(flag=1, **forged)
    state, *_, got = rec.read(world=2, rank=0)
    assert state == "malformed" and why in got, (state, got)


def test_an_abandoned_call_may_name_this_rank_or_no_rank_but_nothing_outside_the_world():
    """kPhaseBroken names the rank whose failure mark it found (a word peers write): this rank, a peer,
    or -1 for a mark that carried none; a mark naming rank 5 of 2 is a corrupted word."""
    rec = Record()
    rec.set(op=SEND * 4 + _C.PHASE_BROKEN, rank=0, expected=4, observed=1, flag=1)
    for peer in (0, 1, -1):
        rec.set(peer=peer)
        assert rec.read()[0] == "ready", peer
    rec.set(peer=5)
    assert rec.read()[0] == "malformed"


def test_an_unknown_flag_value_is_refused():
    rec = Record()
    _entry_timeout(rec)
    rec.set(flag=0xdead)
    state, *_, why = rec.read()
    assert state == "malformed" and "flag word is 57005" in why


def test_a_peer_watch_record_names_a_peer():
    rec = Record()
    rec.set(op=_C.OP_PEER_WATCH * 4, rank=0, peer=1, expected=4242, flag=1)
    assert rec.read()[0] == "ready"
    rec.set(peer=0)
    assert rec.read()[0] == "malformed"


def test_clearing_keeps_the_record_claimed_until_every_field_is_zero():
    """Core::check clears a record it read, so that a call queued behind the failed one can report too.
    The flag goes to 0 only after every other field is zero: a kernel that claims the record at once
    (flag 0 -> 2) never has its fields overwritten by the clear's zeros. Before, the clear was one
    struct assignment, whose stores the compiler may order with the flag's first."""
    rec = Record()
    _entry_timeout(rec)
    rec.set(flag=1)
    seen = []

    def after_store():
        raw = bytes(rec._view)
        seen.append((struct.unpack_from("<I", raw, 0)[0], raw[4:44]))

    _C.clear_failure_record(rec.ptr, after_store)
    zero = struct.pack("<IiiqqQI", 0, 0, -1, 0, 0, 0, 0)
    flags = [flag for flag, _ in seen]
    assert flags[-1] == 0 and all(f == 1 for f in flags[:-1]), flags
    assert seen[-2][1] == zero, "the flag was cleared before every field was"
    assert rec.read()[0] == "clear"
    _entry_timeout(rec, peer=1, expected=9)  # the next writer's complete record reads as its own
    rec.set(flag=1)
    assert rec.read()[:5] == ("ready", SEND * 4 + _C.PHASE_ENTRY, 0, 1, 9)
