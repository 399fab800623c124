"""tools/bench_fp8_layerwise.py end to end on the CPU backend (scaled-down shapes, ~15 s): the
multi-process harness, the byte checks of the native-writer rows and the report all run in CI, so a
GPU run of the benchmark cannot fail on the harness."""
import json
import os
import subprocess
import sys

import pytest

from tests._tools import ROOT


def test_bench_runs_on_cpu_backend(tmp_path):
    pytest.importorskip("fp8_layerwise._C", reason="needs the built fp8_layerwise package")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_fp8_layerwise.py"), "--out",
                          str(tmp_path), "--backend", "cpu"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    data = json.loads((tmp_path / "bench_fp8_layerwise.json").read_text())
    assert data["meta"]["backend"] == "cpu"
    # (A configuration is left out only where /dev/shm is too small for it.)
    configs = [r["config"] for r in data["results"]]
    assert configs and set(configs) <= {"DSV3 TP1", "DSV3 TP2", "TP4-sized shard", "TP8-sized shard"}, configs
    for res in data["results"]:
        for rank in res["ranks"]:
            for name, mode in rank["modes"].items():
                assert mode["bytes"] > 0 and mode["total_ms"] > 0, (res["config"], name)
                if "prestaged" not in name:
                    assert mode["verified"] is True, (res["config"], name)  # delivered bytes checked
    # Each configuration's default slot count is what the transport would pick for its shard size.
    assert set(data["meta"]["default_slots"]) == {r["config"] for r in data["results"]}
    assert data["targets"]


def test_writer_speed_diag_runs(tmp_path):
    # tools/diag/writer_speed.py on small block-FP8 shapes: every cut and thread count prints a row.
    pytest.importorskip("fp8_layerwise._C", reason="needs the built fp8_layerwise package")
    from fp8_layerwise import _C

    hints = ["none", "flush"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "diag", "writer_speed.py"), "--threads", "1,2",
                          "--seconds", "0.02", "--hidden", "512", "--intermediate", "1024",
                          "--cache-hints", ",".join(hints)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "GB/s" not in line]
    n_hints = sum(_C.cache_hint_supported(h) for h in hints)
    assert len(rows) == 5 * 2 * n_hints, out.stdout  # 5 cuts x 2 thread counts x supported hints
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[4] in hints and float(cells[5]) > 0 and float(cells[7]) > 0, row


def test_mode_summary_hand_computed():
    # The report's formulas (tools/bench_fp8_layerwise.py:_mode_summary) on two synthetic ranks; needs
    # no native build (the tool imports fp8_layerwise only inside its functions).
    from tests._tools import load_tool

    b = load_tool("bench_fp8_layerwise")
    nb = [14680064, 28672, 7340032, 14336]  # 22.06 MB per expert and rank, 10 experts
    bytes_ = 10 * sum(nb)  # 220630400 B
    ranks = [
        {"peak_gbs": 55.0, "expert_nbytes": nb,
         "modes": {"m": dict(bytes=bytes_, h2d_ms=4.4126, total_ms=5.0, writer_ms=4.0, slot_wait_ms=0.5,
                             copies=40, verified=True)}},
        {"peak_gbs": 50.0, "expert_nbytes": nb,
         "modes": {"m": dict(bytes=bytes_, h2d_ms=4.6, total_ms=5.0, writer_ms=4.0, slot_wait_ms=0.5,
                             copies=40, verified=True)}},
    ]
    v = b._mode_summary(ranks, "m")
    # h2d per rank: 220630400 B / 4.4126 ms = 50.000 GB/s; / 4.6 ms = 47.963 GB/s
    assert v["h2d"] == pytest.approx(47.963, abs=1e-3) and v["peak"] == 50.0
    # % of peak per rank, against that rank's own peak: 50.000 / 55 = 90.91 %, 47.963 / 50 = 95.93 %:
    # the worst rank is rank 0 (min h2d / min peak would have said 95.9 %)
    assert v["pct"] == pytest.approx(90.91, abs=0.01)
    # effective: 220630400 B / 5 ms = 44.126 GB/s on both; 44.126 / 55 = 80.23 %
    assert v["eff"] == pytest.approx(44.126, abs=1e-3) and v["eff_pct"] == pytest.approx(80.23, abs=0.01)
    assert v["wait_frac"] == pytest.approx(0.1)
    # total / max(writer, h2d): 5 / 4.4126 = 1.1331 and 5 / 4.6 = 1.0870: the worst rank's
    assert v["overlap"] == pytest.approx(1.1331, abs=1e-4)
    assert v["cpe"] == pytest.approx(4.0) and v["ok"] is True
    ranks[0]["modes"]["m"]["verified"] = ranks[1]["modes"]["m"]["verified"] = None  # prestaged: not checked
    assert b._mode_summary(ranks, "m")["ok"] is None
