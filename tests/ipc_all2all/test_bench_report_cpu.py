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
