"""The reporting half of tools/bench_ipc_all2all.py (bandwidths, table, targets, plot) on synthetic
rows, so the first GPU run of the benchmark cannot be lost to a bug after the measurements."""
import json

import pytest

from tests._tools import load_tool


def _row(world, total, ours_rt, nccl_rt, graph=True):
    n = total // world
    row = {"world": world, "total_tokens": total, "bytes_per_rank": n * 32 * 128 * 2, "bitwise_equal": True}
    for mode in ("eager", "graph"):
        for name, us in (("ours_send", ours_rt / 2), ("ours_gather", ours_rt / 2), ("ours_rt", ours_rt),
                         ("nccl_send", nccl_rt / 2), ("nccl_gather", nccl_rt / 2), ("nccl_rt", nccl_rt)):
            row[f"{name}_{mode}_us"] = us if (graph or mode == "eager") else None
    return row


def test_report_functions(tmp_path):
    b = load_tool("bench_ipc_all2all")
    rows = [b._derive(_row(2, 4096, 60.0, 166.0)), b._derive(_row(2, 131072, 2000.0, 3133.0, graph=False)),
            b._derive(_row(4, 32768, 300.0, 500.0))]
    # 2 ranks, 128k tokens: one rank's 65536 tokens x 8 KiB (512 MiB) sent in 1000 us; busbw = algbw / 2
    r = rows[1]
    assert r["bytes_per_rank"] == 65536 * 8192
    assert r["ours_send_eager_algbw"] == pytest.approx(r["bytes_per_rank"] / 1000e-6 / 1e9)
    assert r["ours_send_eager_busbw"] == pytest.approx(r["ours_send_eager_algbw"] / 2)
    assert r["ours_rt_eager_algbw"] == pytest.approx(2 * r["bytes_per_rank"] / 2000e-6 / 1e9)
    table = b._table(rows)
    assert table.count("\n") == 1 + 2 * len(rows)
    assert "| 2 | 4096 | 16 | eager | 30.0 | 30.0 | 60.0 | 83.0 | 83.0 | 166.0 | 0.36 |" in table
    assert "n/a" in table  # the missing graph timings of the second row
    targets = b._targets(rows)
    assert any("4096 tokens eager" in t and "MET" in t and "ours/ref 0.36" in t for t in targets), targets
    assert any("131072 tokens eager" in t and "MISSED" in t for t in targets), targets
    assert any("send busbw 268" in t and "MISSED" in t for t in targets), targets  # >= 64 MiB per rank
    assert not any(t.startswith("W=4") for t in targets)
    # the fp8-on-the-wire table appears when its timings exist (busbw on the bf16 bytes it stands for)
    f8 = _row(2, 4096, 60.0, 166.0)
    for mode in ("eager", "graph"):
        f8.update({f"ours_fp8_send_{mode}_us": 20.0, f"ours_fp8_gather_{mode}_us": 20.0,
                   f"ours_fp8_rt_{mode}_us": 45.0})
    f8 = b._derive(f8)
    t8 = b._table([f8])
    assert "| 2 | 4096 | eager | 20.0 | 20.0 | 45.0 | 60.0 | 0.75 |" in t8, t8
    assert f8["ours_fp8_send_eager_busbw"] == pytest.approx(f8["bytes_per_rank"] / 20e-6 / 1e9 / 2)
    data = {"meta": {"gpu": "synthetic"}, "rows": rows}
    (tmp_path / "bench_ipc_all2all.json").write_text(json.dumps(data))
    pytest.importorskip("matplotlib")
    path = b._plot(data, tmp_path)
    assert path is not None and path.exists() and path.stat().st_size > 0


def test_sizes_and_bandwidths_hand_computed():
    b = load_tool("bench_ipc_all2all")
    # "MiB per rank" of the sizes at W = 2: total/2 tokens x 32 heads x 128 x 2 bytes (bf16)
    mib = {t: b._bytes_per_rank(t, 2) / 2**20 for t in (4096, 8192, 16384, 32768, 65536, 131072)}
    assert mib == {4096: 16, 8192: 32, 16384: 64, 32768: 128, 65536: 256, 131072: 512}
    assert b._bytes_per_rank(4096, 4) == 1024 * 8192 and b._bytes_per_rank(4096, 8) == 4 * 2**20
    # nccl-tests alltoall: algbw = bytes per rank / time (GB = 1e9 B), busbw = algbw * (W-1)/W.
    # 16 MiB = 16777216 B in 33.5 us: 500.81 GB/s algbw; W = 2 -> 250.40, W = 4 -> 375.61, W = 8 -> 438.21
    alg, bus = b._bandwidths(16777216, 33.5, 2)
    assert alg == pytest.approx(500.812, abs=1e-3) and bus == pytest.approx(250.406, abs=1e-3)
    assert b._bandwidths(16777216, 33.5, 4)[1] == pytest.approx(375.609, abs=1e-3)
    assert b._bandwidths(16777216, 33.5, 8)[1] == pytest.approx(438.211, abs=1e-3)
    # the recorded 64 MiB point (2 x H200, 103.8 us eager): 67108864 B / 103.8 us / 2 = 323.26 GB/s
    assert b._bandwidths(64 * 2**20, 103.8, 2)[1] == pytest.approx(323.26, abs=0.01)
    # a round trip is two all-to-alls: twice the bytes over its time
    row = b._derive({"world": 2, "total_tokens": 4096, "bytes_per_rank": 16777216, "ours_rt_eager_us": 67.0,
                     "ours_send_eager_us": 33.5})
    assert row["ours_rt_eager_algbw"] == pytest.approx(500.812, abs=1e-3)
    assert row["ours_send_eager_busbw"] == pytest.approx(250.406, abs=1e-3)
    # the grid sweep's bus bandwidth is the same formula
    assert b._sweep_busbw({"world": 2, "total_tokens": 4096, "send_us": 33.5}) == pytest.approx(250.406, abs=1e-3)
