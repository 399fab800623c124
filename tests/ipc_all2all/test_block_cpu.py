"""ipc_all2all's model block (``tools/block_ipc_all2all.py``, the Ulysses attention layer) on the CPU:
the fallback says what the GPU run does and runs the layer with the baseline's exchange over gloo,
checked against an all-gather exchange and the unsharded layer; argument refusals; the GPU report
(merge of the ranks, table, JSON, plot, failures) from synthetic rank results. The GPU run itself is
test_block_gpu.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ipc_all2all._ulysses import split_tokens
from tests._tools import ROOT, load_tool

block = load_tool("block_ipc_all2all")


def _run(*args, env=None, timeout=120):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "block_ipc_all2all.py"), *args],
                          capture_output=True, text=True, env=full_env, timeout=timeout)


def test_without_a_gpu_it_explains_and_checks_the_layer(tmp_path):
    """No visible device: the fallback (not --cpu) explains the GPU run, then runs W = 2 over gloo."""
    r = _run("--out", str(tmp_path), env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "no CUDA device is visible, so no GPU run here" in out
    assert "all_to_all_single (NCCL)" in out and "send_recv_heads / gather_heads" in out and "fp8" in out
    assert "all checks passed" in out
    data = json.loads((tmp_path / "block_ipc_all2all.json").read_text())
    assert data["mode"] == "cpu" and data["meta"]["world"] == 2 and not data["failures"]
    (row,) = data["rows"]
    assert row["tokens"] == 1024 and row["counts"] == [512, 512]
    assert row["bitwise_vs_gather"] and row["op_shapes_ok"] and row["rel_diff_vs_unsharded"] <= 1e-4
    md = (tmp_path / "block_ipc_all2all.md").read_text()
    assert "| 1k | 512/512 |" in md and "python tools/block_ipc_all2all.py --out" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "block_ipc_all2all.png").stat().st_size > 1000


def test_cpu_check_uneven_batched_three_ranks(tmp_path):
    """The baseline's exchange with batch 3, uneven counts and W = 3 (the permutes that batch > 1 needs)."""
    r = _run("--cpu", "--world", "3", "--heads", "12", "--head-dim", "32", "--batch", "3", "--uneven",
             "--tokens", "301", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--cpu" in r.stdout
    (row,) = json.loads((tmp_path / "block_ipc_all2all.json").read_text())["rows"]
    assert row["counts"] == split_tokens(301, 3, True) == [51, 100, 150]
    assert row["bitwise_vs_gather"] and row["op_shapes_ok"], row


@pytest.mark.parametrize("args,match", [
    (["--world", "3"], "--heads (32) must be divisible by the world size (3)"),
    (["--world", "9"], "--world must be 2..8"),
    (["--tokens", "8x"], "'8x' is not a token count"),
    (["--tokens", "0"], "must be positive"),
    (["--iters", "0"], "--iters must be >= 1"),
])
def test_bad_arguments(args, match, capsys):
    with pytest.raises(SystemExit) as e:
        block.main(["--cpu", *args])
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_split_and_parse():
    assert split_tokens(10, 3) == [4, 3, 3] and split_tokens(8192, 2) == [4096, 4096]
    assert sum(split_tokens(131072, 8, True)) == 131072 and split_tokens(36, 3, True) == [6, 12, 18]
    assert block.parse_tokens("8k, 16K,1000") == [8192, 16384, 1000]


def _rank_result(scale, bitwise=True):
    rows = []
    for T in (8192, 16384):
        rows.append({"tokens": T, "counts": [T // 2, T // 2], "bitwise": bitwise, "fp8_bitwise": True,
                     "fp8_rel_err": 0.03 * scale,
                     "nccl": {"layer_ms": 2.0 * scale * T / 8192, "comm_ms": 0.8 * scale * T / 8192},
                     "ipc": {"layer_ms": 1.5 * scale * T / 8192, "comm_ms": 0.3 * scale * T / 8192},
                     "ipc_fp8": {"layer_ms": 1.4 * scale * T / 8192, "comm_ms": 0.2 * scale * T / 8192}})
    return {"rows": rows, "shared": False, "device": "NVIDIA H200", "nccl": "2.28.9"}


def test_gpu_report_from_rank_results(tmp_path):
    """The GPU run's report: per size the slowest rank's times, the communication share, speed-ups,
    the checks of every rank; a rank whose output differs fails the run."""
    cfg = dict(cpu=False, tokens=[8192, 16384], fp8=True)
    rows = block._merge([_rank_result(1.0), _rank_result(1.25)], cfg)
    r = rows[0]
    assert r["nccl"]["layer_ms"] == 2.5 and r["ipc"]["layer_ms"] == 1.875
    assert r["speedup"] == pytest.approx(2.5 / 1.875) and r["speedup_fp8"] == pytest.approx(2.5 / 1.75)
    assert r["ipc"]["comm_share"] == pytest.approx(0.2) and r["bitwise"] and r["fp8_rel_err"] == pytest.approx(0.0375)
    meta = dict(mode_text="2 GPUs, one rank each", world=2, heads=32, head_dim=128, batch=1, dtype="bf16",
                device="NVIDIA H200", torch="2.x", nccl="2.28.9", date="today", command="python tools/block_ipc_all2all.py",
                iters=10, warmup=3)
    data = {"mode": "gpu", "rows": rows, "meta": meta}
    assert block._failures(data) == []
    written = block.write_outputs(str(tmp_path), data)
    md = (tmp_path / "block_ipc_all2all.md").read_text()
    assert "| 8k | 4096/4096 | 2.500 (40 %) | 1.875 (20 %) | 1.33x | yes | 1.750 (14 %) | 1.43x | yes | 3.7e-02 |" in md, md
    assert json.loads((tmp_path / "block_ipc_all2all.json").read_text())["rows"][1]["tokens"] == 16384
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert len(written) == 2
    else:
        assert written[2] == str(tmp_path / "block_ipc_all2all.png") and os.path.getsize(written[2]) > 1000
    bad = block._merge([_rank_result(1.0), _rank_result(1.0, bitwise=False)], cfg)
    fails = block._failures({"mode": "gpu", "rows": bad})
    assert fails == ["8k: ipc_all2all's layer output is not bitwise the NCCL path's",
                     "16k: ipc_all2all's layer output is not bitwise the NCCL path's"]
