"""Model check (CPU) of the signalling protocol of csrc/kernels.cu.

Each rank runs N calls on one stream. Every call is modelled as the kernel's concurrent blocks (one
per target), each taking atomic steps. The call is followed by a read phase of its output, which
stands for the user reading the zero-copy view. The next call reads the previous output as its input
(the round trip). A random scheduler interleaves every enabled step of every rank. Invariants:

* no write-after-read: nobody writes a slot while its owner still has a read of it outstanding;
* completeness: when a call ends, its slot holds epoch-e data from every sender;
* no overshoot: a peer's ready/done never runs more than one call ahead of the receiver;
* progress: the run never deadlocks.

A negative control removes the entry handshake. The same checker must then find a write-after-read,
which shows that it can fail.

The failure part (a skipped call, a late rank) decides whether a rank posts its entry with the
kernel's own rule, ``_C.entry_post_allowed`` (csrc/a2a_types.hpp, called by a2a_kernel), on failure
marks built by ``_C.broken_word``: a change of the kernel's rule changes what these tests see.
"""
from __future__ import annotations

import random
from typing import List, NamedTuple, Optional

import pytest

from ipc_all2all import _C


class Violation(AssertionError):
    pass


def run_model(W: int, calls: int, seed: int, handshake: bool = True) -> int:
    rng = random.Random(seed)
    ready = [[0] * W for _ in range(W)]    # ready[r][s]: written by s into r's signals
    done = [[0] * W for _ in range(W)]
    epoch = [0] * W
    slot_data = [[[0] * W for _ in range(2)] for _ in range(W)]  # slot_data[r][slot][sender] = epoch
    reading = [[0, 0] for _ in range(W)]   # outstanding reads per (rank, slot)
    progs = []

    def rank_program(r):
        for e in range(1, calls + 1):
            s = (e - 1) % 2
            assert epoch[r] == e - 1
            # the input is the previous output (slot s^1): the own-rank block reads it during the call
            blocks = []
            for k in range(W):
                blocks.append(block(r, (r + k) % W, e, s))
            poster = post_ready(r, e)
            active = [poster] + blocks
            while active:
                yield "step"
                g = rng.choice(active)
                try:
                    next(g)
                except StopIteration:
                    active.remove(g)
            # last block: wait for every peer's done
            for src in range(W):
                if src != r:
                    while done[r][src] < e:
                        yield "wait"
                    if done[r][src] > e:
                        raise Violation(f"overshoot: done[{r}][{src}]={done[r][src]} during call {e}")
            for src in range(W):
                if slot_data[r][s][src] != e:
                    raise Violation(f"rank {r} call {e}: slot {s} has sender {src}'s epoch {slot_data[r][s][src]}")
            epoch[r] = e
            # the user reads the zero-copy output for a while (stream order: before the next call)
            reading[r][s] += 1
            for _ in range(rng.randint(0, 6)):
                yield "read"
            reading[r][s] -= 1

    def post_ready(r, e):
        for p in rng.sample(range(W), W):
            if p != r:
                if ready[p][r] != e - 1:
                    raise Violation(f"ready overshoot: rank {r} posts {e} over {ready[p][r]} at {p}")
                ready[p][r] = e
                yield

    def block(r, p, e, s):
        if p != r and handshake:
            while ready[r][p] < e:
                yield
        # every block (not only the own-rank one) reads my input, the previous output in slot s^1,
        # while it copies
        reading[r][s ^ 1] += 1
        yield
        # the write lands in p's slot s
        for _ in range(rng.randint(1, 3)):
            if reading[p][s]:
                raise Violation(f"WAR: rank {r} call {e} writes rank {p} slot {s} while {p} still reads it")
            slot_data[p][s][r] = e
            yield
        reading[r][s ^ 1] -= 1
        if p != r:
            if done[p][r] != e - 1:
                raise Violation(f"done overshoot: rank {r} posts {e} over {done[p][r]} at {p}")
            done[p][r] = e

    progs = [rank_program(r) for r in range(W)]
    alive = list(range(W))
    steps = 0
    stalled = 0
    while alive:
        r = rng.choice(alive)
        try:
            kind = next(progs[r])
            steps += 1
            stalled = stalled + 1 if kind == "wait" else 0
            if stalled > 100000:
                raise Violation("deadlock")
        except StopIteration:
            alive.remove(r)
    assert epoch == [calls] * W
    return steps


@pytest.mark.parametrize("W", [2, 3, 4, 8])
def test_protocol_safe_under_random_interleavings(W):
    for seed in range(60 if W <= 4 else 20):
        run_model(W, calls=12, seed=seed)


def test_negative_control_without_entry_handshake_finds_the_race():
    found = 0
    for seed in range(200):
        try:
            run_model(2, calls=12, seed=seed, handshake=False)
        except Violation as v:
            assert "WAR" in str(v) or "slot" in str(v) or "overshoot" in str(v)
            found += 1
    assert found > 0, "the checker never caught the race it exists to catch"


# ------------------------------------------------------------------------------ failures
# Entry-post rules other than the kernel's, for the negative controls: the rule before 544b7d4 (post
# only while the instance is not marked at all), and the rule of 544b7d4..bb9d675 (post unless marked,
# except by this rank's own mark of this same call: a peer's mark of the call withheld the entry).
def _rule_unmarked_only(broken: int, call: int, rank: int) -> bool:
    return broken == 0


def _rule_own_mark_only(broken: int, call: int, rank: int) -> bool:
    return broken == 0 or broken == _C.broken_word(call, rank)


class FailureRun(NamedTuple):
    record: List[Optional[str]]  # what each rank's record holds (first writer wins)
    expired: List[int]           # the ranks whose wait ran into its deadline, in order
    posted: List[bool]           # whether each rank's block 0 posted its entry
    done: List[List[bool]]       # done[r][p]: p posted done (it pushed its rows) to r


def run_failure_model(W: int, seed: int, *, call: int = 1, skipper: Optional[int] = None,
                      late: Optional[int] = None, premark: Optional[int] = None,
                      rule=_C.entry_post_allowed, stop_on_gave_up: bool = True,
                      deadlines: bool = False) -> FailureRun:
    """Call number ``call`` of every rank, handled as in csrc/kernels.cu.

    Each rank runs block 0's entry post and one push block per peer, interleaved at random, then its
    last block. Every block reads the rank's ``broken`` word when it starts: if set, it moves nothing
    and records the call abandoned (naming ``_C.broken_rank`` of the word). Block 0 posts the entry
    word (call, signature) to every peer iff ``rule(broken, call, rank)``, by default the kernel's
    ``_C.entry_post_allowed``. A push block waits for its target's entry, stopping
    (``stop_on_gave_up``) once its own rank gave up, and compares the words: a mismatch records it and
    marks the own rank (``_C.broken_word(call, rank)``), a deadline records it and marks every rank. A
    block that pushed posts ``done`` unless the rank is marked by then. The last block of a marked rank
    records the call abandoned; otherwise it waits for every peer's ``done`` (stopping once marked).

    Scenarios: ``skipper`` runs a different operation (it skipped the previous call); ``late`` enters
    only once a peer's deadline mark reached it (it was late by more than the deadline); ``premark``:
    every rank finds the mark that rank ``premark`` set in call ``call - 1`` (an earlier failure,
    before the host raised it). Deadlines: when no rank can move, the wait is one a rank would wait
    out to its deadline. With ``deadlines=False`` that raises ``Violation``; with True one waiting
    block, chosen at random, expires (``expired`` lists them)."""
    rng = random.Random(seed)
    sig = ["B" if r == skipper else "A" for r in range(W)]
    ready = [[None] * W for _ in range(W)]    # ready[r][p]: p's entry word in r's signals
    done = [[False] * W for _ in range(W)]    # done[r][p]: p finished pushing to r
    broken = [0 if premark is None else _C.broken_word(call - 1, premark)] * W
    gave_up = [False] * W
    record: List[Optional[str]] = [None] * W
    posted = [False] * W
    expired: List[int] = []
    waiting: dict = {}   # token -> rank of every blocked wait
    fired: set = set()   # tokens whose deadline expired

    def claim(r, what):
        if record[r] is None:
            record[r] = what

    def abandoned(r):
        claim(r, f"abandoned, marked by {_C.broken_rank(broken[r])}")

    def mark(r, peers):
        gave_up[r] = True
        word = _C.broken_word(call, r)
        for p in (range(W) if peers else [r]):
            broken[p] = word

    def wait(r, cond, stop):
        """True once cond(), None when stop() ends it first, False at its deadline."""
        tok = object()
        waiting[tok] = r
        try:
            while True:
                if cond():
                    return True
                if stop():
                    return None
                if tok in fired:
                    return False
                yield "wait"
        finally:
            waiting.pop(tok, None)

    def poster(r):
        yield "step"
        b = broken[r]
        if b:
            abandoned(r)
        if rule(b, call, r):
            posted[r] = True
            for p in rng.sample(range(W), W):
                if p != r:
                    ready[p][r] = (call, sig[r])
                    yield "step"

    def push_block(r, p):
        yield "step"
        if broken[r]:
            abandoned(r)
            return
        ok = yield from wait(r, lambda: ready[r][p] is not None, lambda: stop_on_gave_up and gave_up[r])
        if ok is None:
            return  # stopped: the block that gave up recorded why
        if ok is False:
            claim(r, f"entry timeout on {p}")
            mark(r, peers=True)
            return
        if ready[r][p] != (call, sig[r]):
            claim(r, f"mismatch with {p}")
            mark(r, peers=False)
            return
        yield "step"  # the push
        if broken[r]:
            abandoned(r)
        else:
            done[p][r] = True

    def rank_program(r):
        active = [poster(r)] + [push_block(r, p) for p in range(W) if p != r]
        while active:
            g = rng.choice(active)
            try:
                yield next(g)
            except StopIteration:
                active.remove(g)
        if broken[r]:
            abandoned(r)
            return
        for k in range(1, W):
            src = (r + k) % W
            ok = yield from wait(r, lambda: done[r][src], lambda: broken[r] != 0)
            if not ok:
                if broken[r]:
                    abandoned(r)
                else:
                    claim(r, f"completion timeout on {src}")
                    mark(r, peers=True)
                return

    progs = {r: rank_program(r) for r in range(W) if r != late}
    alive = list(progs)
    stalled = 0
    while alive or (late is not None and late not in progs):
        if late is not None and late not in progs and broken[late] != 0:
            progs[late] = rank_program(late)
            alive.append(late)
        if stalled > 5000:
            if not deadlines:
                raise Violation(f"ranks {sorted(set(waiting.values()))} wait out their deadline (records {record})")
            tok = rng.choice([t for t in waiting if t not in fired])
            fired.add(tok)
            expired.append(waiting[tok])
            stalled = 0
        r = rng.choice(alive)
        try:
            kind = next(progs[r])
            stalled = stalled + 1 if kind == "wait" else 0
        except StopIteration:
            alive.remove(r)
    return FailureRun(record, expired, posted, done)


def _done_with(run: FailureRun, r: int) -> bool:
    """Whether rank r posted done to a peer or a peer to r (rows moved to or from r)."""
    return any(run.done[r]) or any(row[r] for row in run.done)


BIG_CALLS = [1, 2**32 - 1, 2**32, 2**32 + 1, 2**33 + 7]  # call numbers around and past the 32-bit wrap


@pytest.mark.parametrize("W", [2, 3, 4, 8])
def test_skipped_call_every_rank_fails_at_once_with_the_mismatch(W):
    """A skipped call under the kernel's rule: every rank fails the call at once (no deadline), each
    with the mismatch itself, at any call number, including past 2^32 (the mark keeps 32 bits)."""
    for seed in range(300 if W <= 4 else 60):
        skipper = seed % W
        call = BIG_CALLS[seed % len(BIG_CALLS)]
        run = run_failure_model(W, seed, call=call, skipper=skipper)
        assert all(rec is not None and rec.startswith("mismatch") for rec in run.record), (seed, call, run)
        assert all(run.record[r] == f"mismatch with {skipper}" for r in range(W) if r != skipper), (seed, call, run)
        assert run.expired == [] and not _done_with(run, skipper), (seed, call, run)


@pytest.mark.parametrize("W", [2, 3])
def test_previous_rule_can_wait_out_a_deadline_after_a_skipped_call(W):
    """Negative control, the rule before 544b7d4: block 0 did not post the entry once the instance
    was marked failed, even by another block of the same call, so when that block found the mismatch
    before block 0 started a peer waited for the entry until its deadline. The model must find such
    schedules, which shows it can tell the two rules apart."""
    found = 0
    for seed in range(400):
        try:
            run_failure_model(W, seed, skipper=seed % W, rule=_rule_unmarked_only)
        except Violation as v:
            assert "wait out their deadline" in str(v)
            found += 1
    assert found > 0


@pytest.mark.parametrize("W", [2, 3, 4, 8])
def test_late_rank_after_a_peer_deadline_costs_one_deadline(W):
    """A rank late by more than the deadline enters after the first peer's entry deadline expired and
    that peer marked every rank (broken_word(call, peer)). The kernel's rule lets the late rank post
    its entry (the mark is of this same call), so the other ranks stop waiting for it and record the
    call abandoned: one deadline in all, at any W and call number, and no rows move to or from the
    late rank (it moves nothing and posts no done)."""
    for seed in range(40 if W <= 4 else 12):
        late = seed % W
        call = BIG_CALLS[seed % len(BIG_CALLS)]
        run = run_failure_model(W, seed, call=call, late=late, deadlines=True)
        (first,) = run.expired
        assert run.record[first] == f"entry timeout on {late}", (seed, run)
        assert all(run.record[r] == f"abandoned, marked by {first}" for r in range(W) if r != first), (seed, run)
        assert all(run.posted), (seed, run)
        assert not _done_with(run, late), (seed, run)


@pytest.mark.parametrize("W", [3, 4])
def test_late_rank_under_the_own_mark_rule_costs_a_deadline_per_rank(W):
    """Negative control, the rule of 544b7d4..bb9d675: a peer's mark of this same call withheld the
    late rank's entry, so every other rank waited out its own entry deadline on it (W - 1 deadlines).
    The model tells the two rules apart at W >= 3."""
    for seed in range(30):
        late = seed % W
        run = run_failure_model(W, seed, late=late, deadlines=True, rule=_rule_own_mark_only)
        first = run.expired[0]
        others = [r for r in range(W) if r != late]
        assert sorted(run.expired) == others, (seed, run)
        assert run.record[late] == f"abandoned, marked by {first}", (seed, run)
        assert all(run.record[r] == f"entry timeout on {late}" for r in others), (seed, run)
        assert not run.posted[late], (seed, run)


@pytest.mark.parametrize("W", [2, 3, 8])
@pytest.mark.parametrize("call", BIG_CALLS[1:])
def test_a_mark_of_an_earlier_call_stops_every_rank_at_once(W, call):
    """Every rank finds the mark that rank 0 set in the previous call (also across the 32-bit wrap of
    the call number): no rank posts its entry, pushes or waits; every call is recorded abandoned."""
    for seed in range(20):
        run = run_failure_model(W, seed, call=call, premark=0)
        assert run.record == ["abandoned, marked by 0"] * W and run.expired == [], (seed, run)
        assert not any(run.posted) and not any(map(any, run.done)), (seed, run)
