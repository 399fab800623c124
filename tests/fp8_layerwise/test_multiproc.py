"""Multi-process protocol tests on the CPU backend (real processes, real shared memory)."""
import pytest

import fp8_layerwise as F
from tests._dist import run_workers
from tests.fp8_layerwise import _workers as W


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


def test_sigkill_consumer_detected_fast(tmp_path):
    res = run_workers(W.kill_consumer, 3, str(tmp_path), tmp_path=tmp_path, timeout=120, expect_dead={2})
    r0, r1 = res[0], res[1]
    assert r0["type"] == "PeerDied" and r0["code"] == F.ErrorCode.PEER_DEAD and r0["rank"] == 2, r0
    assert r1["type"] == "PeerDied" and r1["rank"] == 2, r1
    assert r0["t_exc"] - r0["t0"] < 2.0, r0  # detected by liveness, not by the 30 s timeout
    assert r1["t_exc"] - r0["t0"] < 2.0, r1


def test_sigkill_producer_detected_fast(tmp_path):
    res = run_workers(W.kill_producer, 3, str(tmp_path), tmp_path=tmp_path, timeout=120, expect_dead={0})
    for r in (1, 2):
        assert res[r]["type"] == "PeerDied" and res[r]["rank"] == 0, res[r]
        assert res[r]["dt"] < 2.0, res[r]


def test_rank_never_joins_times_out(tmp_path):
    res = run_workers(W.never_joins, 2, str(tmp_path), tmp_path=tmp_path, timeout=120)
    for r in res:
        assert r["type"] == "TransportTimeout" and r["code"] == F.ErrorCode.TIMEOUT and r["is_timeout"], r
    assert 0.7 < res[0]["dt"] < 10, res[0]


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


def test_seed_mode_and_default_same_bytes(tmp_path):
    res = run_workers(W.legacy_vs_default, 2, str(tmp_path), "cpu", tmp_path=tmp_path, timeout=120)
    for rows in res:
        seed, default = rows
        assert seed["bad"] == [] and default["bad"] == []
        assert seed["bytes"] == seed["want"] == default["bytes"]
        assert seed["copies"] == 4 * 16 and default["copies"] <= seed["copies"]


def test_writer_error_then_reset_across_ranks(tmp_path):
    res = run_workers(W.writer_error_reset, 2, str(tmp_path), "cpu", tmp_path=tmp_path, timeout=120)
    for r in res:
        assert r["first"][:3] == ("TransportPoisoned", F.ErrorCode.WRITER, 0), r
        assert "ValueError: synthetic writer failure" in r["first"][3], r
        assert r["generation"] == 1 and r["exact"] and r["bytes"], r
