"""Multi-process protocol tests on the CPU backend (real processes, real shared memory)."""
import os

import pytest

import fp8_layerwise as F
from tests._dist import run_workers
from tests.fp8_layerwise import _shm
from tests.fp8_layerwise import _fault_workers as FW
from tests.fp8_layerwise import _workers as W
from tests.fp8_layerwise._timing import fast_bound

#: A dead peer is noticed by the liveness check (every FW.LIVENESS_MS), not by the timeout.
PEER_DEATH_BOUND_S = fast_bound(FW.LIVENESS_MS / 1000, FW.DEAD_PEER_TIMEOUT_MS / 1000)


@pytest.mark.parametrize("tp,slots,use_gloo", [(2, (2, 3), True), (4, (4,), False), (8, (2, 8), False)])
def test_delivery_byte_exact(tmp_path, tp, slots, use_gloo):
    counts = (1, 5, 12)
    res = run_workers(W.delivery, tp, str(tmp_path), slots, counts, use_gloo, "cpu", tmp_path=tmp_path, timeout=150)
    for rank, rows in enumerate(res):
        assert len(rows) == len(slots) * len(counts)
        for row in rows:
            assert row["bad"] == [], (rank, row)
            assert row["bytes"] == row["want"], (rank, row)
            assert row["untouched"], (rank, row)  # nothing written past expert_count


def test_delivery_byte_exact_coalesce_wait(tmp_path):
    # coalesce_wait=True: short runs of ready slots wait while a batch is queued, then go as longer runs.
    res = run_workers(W.delivery, 2, str(tmp_path), (4, 8), (1, 6, 12), False, "cpu", (2,), True,
                      tmp_path=tmp_path, timeout=150)
    for rank, rows in enumerate(res):
        assert len(rows) == 2 * 3
        for row in rows:
            assert row["bad"] == [] and row["bytes"] == row["want"] and row["untouched"], (rank, row)


@pytest.mark.parametrize("tp,slots,batch", [(2, (2, 4), True), (4, (3,), True), (2, (2, 4), False)])
def test_delivery_byte_exact_small_kinds(tmp_path, tp, slots, batch):
    # batch_small_kinds=True (the default): the scales (< 64 KiB per expert) go through the consumer's
    # staging copy and one copy per kind with the layer's last batch; False: every kind per expert.
    # Every byte must land either way, and nothing past n.
    res = run_workers(W.delivery, tp, str(tmp_path), slots, (1, 5, 12), False, "cpu", (2,), False, batch,
                      tmp_path=tmp_path, timeout=150)
    for rank, rows in enumerate(res):
        assert len(rows) == len(slots) * 3
        for row in rows:
            assert row["bad"] == [] and row["bytes"] == row["want"] and row["untouched"], (rank, row)
            if batch:  # two of the four kinds (the scales) take one copy per layer, not one per run
                assert row["copies"] <= 2 * row["n"] + 2, (rank, row)


@pytest.mark.fault
def test_sigkill_consumer_detected_fast(tmp_path, record_property):
    res = run_workers(FW.kill_consumer, 3, str(tmp_path), tmp_path=tmp_path, timeout=120, expect_dead={2})
    r0, r1 = res[0], res[1]
    assert r0["type"] == "PeerDied" and r0["code"] == F.ErrorCode.PEER_DEAD and r0["rank"] == 2, r0
    assert r1["type"] == "PeerDied" and r1["rank"] == 2, r1
    assert r0["t_exc"] - r0["t0"] < PEER_DEATH_BOUND_S, r0  # detected by liveness, not by the timeout
    assert r1["t_exc"] - r0["t0"] < PEER_DEATH_BOUND_S, r1
    record_property("detect_s", max(r0["t_exc"], r1["t_exc"]) - r0["t0"])


@pytest.mark.fault
def test_sigkill_producer_detected_fast(tmp_path, record_property):
    res = run_workers(FW.kill_producer, 3, str(tmp_path), tmp_path=tmp_path, timeout=120, expect_dead={0})
    for r in (1, 2):
        assert res[r]["type"] == "PeerDied" and res[r]["rank"] == 0, res[r]
        assert res[r]["dt"] < PEER_DEATH_BOUND_S, res[r]
    record_property("detect_s", max(res[r]["dt"] for r in (1, 2)))


@pytest.mark.fault
def test_rank_never_joins_times_out(tmp_path, record_property):
    res = run_workers(FW.never_joins, 2, str(tmp_path), tmp_path=tmp_path, timeout=120)
    for r in res:
        assert r["type"] == "TransportTimeout" and r["code"] == F.ErrorCode.TIMEOUT and r["is_timeout"], r
    assert 0.7 < res[0]["dt"] < 10, res[0]
    record_property("detect_s", res[0]["dt"])


@pytest.mark.fault
def test_protocol_violations_claims_close_and_reset(tmp_path):
    res = run_workers(W.protocol_and_recovery, 3, str(tmp_path), tmp_path=tmp_path, timeout=150)
    for rank, log in enumerate(res):
        d = {}
        for item in log:
            d.setdefault(item[0], []).append(item[1:])
        # Every rank raises the same original cause, recorded by the rank that saw it.
        assert d["mismatch"][0][0] == ("ProtocolError", 1, 2), (rank, log)
        assert d["producer_on_1"][0][0] == ("ProtocolError", 1, 1), (rank, log)
        if rank == 2:
            assert d["closed"][0][0] is True
        else:
            assert d["closed"][0][0] == ("TransportPoisoned", F.ErrorCode.CLOSED_WHILE_ACTIVE, 2), (rank, log)
    wins = [log_item[1] for log in res for log_item in log if log_item[0] == "claim"]
    owners = {log_item[2] for log in res for log_item in log if log_item[0] == "claim"}
    assert sum(wins) == 1, res  # exactly one concurrent claim wins
    assert len(owners) == 1 and owners == {wins.index(True)}, res  # and everyone sees the winner


def test_ktransformers_design_and_default_same_bytes(tmp_path):
    res = run_workers(W.ktransformers_vs_default, 2, str(tmp_path), "cpu", tmp_path=tmp_path, timeout=120)
    for rows in res:
        ktransformers, default = rows
        assert ktransformers["bad"] == [] and default["bad"] == []
        assert ktransformers["bytes"] == ktransformers["want"] == default["bytes"]
        assert ktransformers["copies"] == 4 * 16 and default["copies"] <= ktransformers["copies"]


@pytest.mark.fault
def test_writer_error_then_reset_across_ranks(tmp_path):
    res = run_workers(W.writer_error_reset, 2, str(tmp_path), "cpu", tmp_path=tmp_path, timeout=120)
    for r in res:
        assert r["first"][:3] == ("TransportPoisoned", F.ErrorCode.WRITER, 0), r
        assert "ValueError: synthetic writer failure" in r["first"][3], r
        assert r["generation"] == 1 and r["exact"] and r["bytes"], r


@pytest.mark.parametrize("case", ["run", "wait", "close_inside_writer"])
@pytest.mark.fault
def test_close_while_another_thread_is_blocked(tmp_path, case):
    # run: a Python writer is still filling the slots when close() runs; wait: a thread waits for a
    # producer that never comes; close_inside_writer: the writer itself closes. The blocked call
    # raises TransportClosed and nothing touches unmapped memory (a crash kills the worker).
    (res,) = run_workers(FW.close_while_blocked, 1, str(tmp_path), case, tmp_path=tmp_path, timeout=90)
    assert not res["thread_alive"], res
    name, msg, is_transport_error = res["exc"]
    call = "wait" if case == "wait" else "run"
    assert name == "TransportClosed" and is_transport_error, res
    assert f"closed while {call}() was blocked" in msg, res
    if case == "wait":
        assert res["run_exc"][0] == "TransportClosed", res  # the producer thread was released too
        assert "closed while run() was blocked" in res["run_exc"][1], res
        assert res["closer_exc"] is None, res
    if case == "run":
        assert res["wrote_after_close"], res  # the writer finished its expert into still-mapped slots
        # close() waited for it: it had not returned while the writer ran, and returned after it.
        assert res["close_returned_during_writer"] is False, res
        assert res["order"] == ["writer_done", "close_returned"], res
    if case == "close_inside_writer":
        assert res["wrote_after_close"], res
        assert any("stays mapped" in w for w in res["warnings"]), res


@pytest.mark.parametrize("field,tp", [("nb", 3), ("num_experts", 2), ("num_slots", 2)])
@pytest.mark.fault
def test_geometry_mismatch_fails_fast_on_every_rank(tmp_path, field, tp, record_property):
    res = run_workers(W.geometry_mismatch, tp, str(tmp_path), field, tmp_path=tmp_path, timeout=120)
    bad = tp - 1
    for rank, r in enumerate(res):
        assert r["type"] == "ValueError" and r["dt"] < 10, (rank, r)
        assert f"rank {bad} was given" in r["msg"] and "but rank 0 was given" in r["msg"], (rank, r)
        assert "every rank must pass the same expert_nbytes, num_experts and num_slots" in r["msg"], (rank, r)
    record_property("detect_s", max(r["dt"] for r in res))


@pytest.mark.fault
def test_join_next_epoch_without_wait_fails_fast(tmp_path, record_property):
    res = run_workers(W.join_without_wait, 2, str(tmp_path), tmp_path=tmp_path, timeout=120)
    for rank, r in enumerate(res):
        assert r["type"] == "ProtocolError" and r["code"] == F.ErrorCode.PROTOCOL and r["rank"] == 1, (rank, r)
        assert "without calling wait(1)" in r["msg"], (rank, r)
        assert r["dt"] < fast_bound(0, 20), (rank, r)  # at once, not at the worker's 20 s timeout
    record_property("detect_s", max(r["dt"] for r in res))


@pytest.mark.fault
def test_reset_reports_dead_rank_fast(tmp_path, record_property):
    res = run_workers(FW.reset_with_dead_rank, 3, str(tmp_path), tmp_path=tmp_path, timeout=120, expect_dead={2})
    for rank in (0, 1):
        r = res[rank]
        assert r["type"] == "PeerDied" and r["base"] and r["code"] == F.ErrorCode.PEER_DEAD and r["rank"] == 2, r
        assert r["dt"] < PEER_DEATH_BOUND_S, r  # the liveness check, not the timeout
    record_property("detect_s", max(res[r]["dt"] for r in (0, 1)))


@pytest.mark.fault
def test_sigkill_while_waiting_for_peers_leaves_no_shm(tmp_path):
    # Rank 0 of 2 is SIGKILLed while it waits in the setup's first exchange for rank 1, which never
    # comes: nothing may be left in /dev/shm (segments are created only once every rank arrived).
    # The child tags the names of the segments it creates (tests/fp8_layerwise/_shm.py), so only
    # this test's names are looked at, whatever else uses /dev/shm meanwhile.
    import signal

    from tests.fp8_layerwise._timing import poll

    xdir = tmp_path / "x"
    p, tag = _shm.spawn_tagged("import fp8_layerwise as F\n"
                               "ex = F.FileExchange(sys.argv[2], 0, 2, timeout_s=60)\n"
                               "F.Transport(0, 2, 8, [4096, 512, 2048, 256], num_slots=2, backend='cpu', exchange=ex)\n",
                               str(xdir))
    try:
        # Rank 0 published round 1 and now waits for rank 1.
        poll(lambda: list(xdir.glob("s.*/1.0.json")) or p.poll() is not None, timeout_s=60,
             what="rank 0 reaching the first exchange")
        assert p.poll() is None, f"rank 0 exited with {p.returncode} before the first exchange"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    left = _shm.linked_with_tag(tag)
    for n in left:  # do not leak them into later tests
        os.unlink(os.path.join(_shm.SHM_DIR, n))
    assert not left, left


def test_child_segment_tagging_works(tmp_path):
    # The check above is only as good as the tagging: a child that does create segments shows them.
    import subprocess

    p, tag = _shm.spawn_tagged("import fp8_layerwise as F\n"
                               "c = F.ControlRegion.create(2)\n"
                               "s = F.HostSlots.create([4096, 512, 2048, 256], 2)\n"
                               "print(c.name, s.name, flush=True)\n"
                               "sys.stdin.read()\n"
                               "c.close()\n"
                               "s.close()\n", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        names = p.stdout.readline().split()
        assert len(names) == 2, names
        assert names[0].startswith(f"/fp8lw_ctl_{tag}_") and names[1].startswith(f"/fp8lw_slots_{tag}_"), names
        assert _shm.linked_with_tag(tag) == sorted(n[1:] for n in names)
    finally:
        p.stdin.close()
        p.wait(30)
    assert p.returncode == 0
    assert _shm.linked_with_tag(tag) == []  # the creator's close unlinked them
