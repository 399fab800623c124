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
"""
from __future__ import annotations

import random

import pytest


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


# ------------------------------------------------------------------------------ a skipped call
def run_failure_model(W: int, skipper: int, seed: int, post_after_own_failure: bool,
                      stop_on_gave_up: bool = True) -> list:
    """One call in which rank ``skipper`` runs a different operation (it skipped the previous one),
    handled as in csrc/kernels.cu: block 0 of each rank posts its entry word; each (rank, target)
    block waits for the target's entry, stopping (``stop_on_gave_up``) once its own rank gave up, then
    compares signatures: a mismatch marks its own rank failed and claims the rank's record. The last
    block records the call abandoned if the rank failed. A wait that can never end stands for a
    deadline the rank would wait out. ``post_after_own_failure=False`` is the kernel as it is: block 0
    posts only if the instance was not marked failed when it started, which includes a mismatch found
    by another block of the same call that started first; True posts unless the mark predates the
    call. Returns each rank's record."""
    rng = random.Random(seed)
    sig = ["B" if r == skipper else "A" for r in range(W)]
    ready = [[None] * W for _ in range(W)]   # ready[r][p]: p's entry word in r's signals
    gave_up = [False] * W
    record = [None] * W

    def poster(r):
        yield
        if post_after_own_failure or not gave_up[r]:  # s_live, read when block 0 starts
            for p in rng.sample(range(W), W):
                if p != r:
                    ready[p][r] = sig[r]
                    yield

    def block(r, p):
        while ready[r][p] is None:
            if stop_on_gave_up and gave_up[r]:
                return  # stopped: records nothing
            yield "wait"
        if ready[r][p] != sig[r]:
            gave_up[r] = True
            if record[r] is None:
                record[r] = f"mismatch with {p}"
        yield

    def rank_program(r):
        active = [poster(r)] + [block(r, p) for p in range(W) if p != r]
        while active:
            g = rng.choice(active)
            try:
                yield next(g)
            except StopIteration:
                active.remove(g)
        if gave_up[r] and record[r] is None:
            record[r] = "abandoned"

    progs = [rank_program(r) for r in range(W)]
    alive = list(range(W))
    stalled = 0
    while alive:
        r = rng.choice(alive)
        try:
            kind = next(progs[r])
            stalled = stalled + 1 if kind == "wait" else 0
            if stalled > 20000:
                raise Violation(f"ranks {alive} wait out their deadline (records {record})")
        except StopIteration:
            alive.remove(r)
    return record


@pytest.mark.parametrize("W", [2, 3, 4, 8])
def test_entry_posted_despite_a_failure_of_the_same_call_never_waits_out_a_deadline(W):
    """The kernel's rule (since 544b7d4): a rank posts its entry unless it was marked failed before
    the call. Then every rank fails the call at once, each with the mismatch itself."""
    for seed in range(300 if W <= 4 else 60):
        skipper = seed % W
        record = run_failure_model(W, skipper, seed, post_after_own_failure=True)
        assert all(rec is not None and rec.startswith("mismatch") for rec in record), (seed, record)
        assert all(record[r] == f"mismatch with {skipper}" for r in range(W) if r != skipper), (seed, record)


@pytest.mark.parametrize("W", [2, 3])
def test_previous_rule_can_wait_out_a_deadline_after_a_skipped_call(W):
    """Negative control, the rule before 544b7d4: block 0 did not post the entry once the instance
    was marked failed, even by another block of the same call, so when that block found the mismatch
    before block 0 started a peer waited for the entry until its deadline. The model must find such
    schedules, which shows it can tell the two rules apart."""
    found = 0
    for seed in range(400):
        try:
            run_failure_model(W, seed % W, seed, post_after_own_failure=False)
        except Violation as v:
            assert "wait out their deadline" in str(v)
            found += 1
    assert found > 0
