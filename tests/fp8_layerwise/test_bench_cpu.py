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
