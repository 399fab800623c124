"""The prefill loop on GPUs (``python tools/block_fp8_layerwise.py``, fp8_layerwise's model block): the
CUDA backend streams each layer into one of two GPU layer buffers while the previous layer's expert
GEMMs run. Every rank's delivered bytes must equal the reference shard, every layer's output in the
loop must have the bits of the same layer computed alone, the timeline must keep the double-buffering
rules, and the report must carry every figure. Performance goals are reported, not asserted, except
that the loop must overlap."""
import json
import os
import subprocess
import sys

import pytest

import fp8_layerwise as F
from tests._tools import ROOT

pytestmark = pytest.mark.skipif(not F.built_with_cuda(), reason="built without CUDA")

# ~4 MB per layer and rank, a few ms per layer: the schedule and the checks, not the speed.
SMALL = ["--layers", "4", "--experts", "4", "--hidden", "1024", "--intermediate", "512", "--tokens", "2048",
         "--top-k", "2", "--repeat", "2"]


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _run(args, tmp_path, timeout=400):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "block_fp8_layerwise.py")] + args
                         + ["--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))
    print(out.stdout)  # the table and the goals, in the test's log
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-6000:]
    assert "prefill OK" in out.stdout, out.stdout[-4000:]
    return out.stdout, json.loads((tmp_path / "prefill.json").read_text())


def _check(data, tp, layers, repeat):
    ndev = _gpus()
    assert data["ok"] and data["backend"] == "cuda" and data["config"]["tp"] == tp and data["gpus"] == ndev
    assert data["ranks_share_gpus"] == (tp > ndev) and data["goals_judged"] == (tp <= ndev)
    assert [r["rank"] for r in data["ranks"]] == list(range(tp))
    for r, rank in enumerate(data["ranks"]):
        assert rank["device"] == r % ndev and rank["backend"] == "cuda"
        # Weights: byte-exact after the warm-up, after each layer streamed alone, and after the loops.
        assert rank["warm_exact"] == [True] * min(2, layers) and all(rank["end_exact"].values())
        assert len(rank["end_exact"]) == min(2, layers)
        assert [a["exact"] for a in rank["alone"]] == [True] * layers
        want = data["layer_bytes_per_rank"]
        for a in rank["alone"]:
            assert a["bytes"] == want and a["h2d_ms"] > 0 and a["transfer_ms"] > 0, a
            assert a["reproducible"] and len(a["compute_runs_ms"]) == repeat and min(a["compute_runs_ms"]) > 0, a
        assert [lp["warmup"] for lp in rank["loops"]] == [True] + [False] * repeat
        for loop in rank["loops"]:
            # The outputs of the loop have the bits of the layers computed alone, on the verified bytes.
            assert loop["outputs_equal"] == [True] * layers and loop["violations"] == [], loop["violations"]
            assert len(loop["compute_ms"]) == layers and min(loop["compute_ms"]) > 0
            assert len(loop["transfer_ms"]) == layers and loop["loop_ms"] > 0 and loop["fill_ms"] > 0
            ev = {(e["kind"], e["layer"]): e for e in loop["events"]}
            assert len(ev) == 2 * layers
            for layer in range(layers):
                t, c = ev[("transfer", layer)], ev[("compute", layer)]
                assert t["buffer"] == c["buffer"] == layer % 2
                assert c["end_ms"] > c["start_ms"] and t["end_ms"] > t["start_ms"]
                if layer >= 2:  # streamed only once the compute that last read its buffer had finished
                    # (the GPU's event times are mapped onto the host clock, to within microseconds)
                    prev = ev[("compute", layer - 2)]
                    assert t["start_ms"] >= prev["end_ms"] - 0.05, (layer, t, prev)
    for s in data["summary"]:
        assert s["bytes_exact"] and s["outputs_equal"] and s["timeline_ok"] and s["reproducible"]
        assert s["loop_goal"] in (("met", "MISSED") if data["goals_judged"] else ("not judged",))
        assert s["slowdown_goal"] in (("met", "MISSED") if data["goals_judged"] else ("not judged",))
        assert s["bound_ms"] > 0 and s["loop_ratio"] > 0


@pytest.mark.smoke
@pytest.mark.gpu
def test_prefill_loop_tp1(tmp_path):
    stdout, data = _run(["--prefill", "--tp", "1"] + SMALL, tmp_path)
    _check(data, tp=1, layers=4, repeat=2)
    assert "goals: loop <= 1.05x" in stdout and "one per GPU" in stdout
    assert (tmp_path / "prefill.md").read_text().count("| exact | equal |") == 4


@pytest.mark.smoke
@pytest.mark.multigpu(2, shared_ok=True)  # no NCCL between the ranks: they may share a GPU (correctness only)
def test_prefill_loop_tp2(tmp_path):
    stdout, data = _run(["--prefill", "--tp", "2", "--layers", "5"] + SMALL[2:], tmp_path)
    _check(data, tp=2, layers=5, repeat=2)
    if _gpus() < 2:
        assert "ranks share GPUs" in stdout and "not judged" in stdout


@pytest.mark.gpu
def test_prefill_loop_slots_and_one_layer(tmp_path):
    # A single layer (no double buffering to do) and 4 host slots per rank.
    _, data = _run(["--prefill", "--tp", "1", "--slots", "4", "--layers", "1", "--experts", "2", "--hidden", "512",
                    "--intermediate", "256", "--tokens", "512", "--top-k", "1", "--repeat", "1"], tmp_path)
    _check(data, tp=1, layers=1, repeat=1)


@pytest.mark.gpu
def test_plain_block_runs_the_prefill_loop_at_its_defaults(tmp_path):
    # What `python tools/block_fp8_layerwise.py` (tools/gpu.sh's blocks step) does on a GPU machine: DeepSeek-V3's expert shapes, one rank
    # per GPU. The loop must overlap: at least half of the smaller of compute and transfer hidden.
    stdout, data = _run([], tmp_path, timeout=500)
    assert stdout.startswith("fp8_layerwise prefill loop: backend=cuda"), stdout[:300]
    cfg = data["config"]
    assert (cfg["hidden"], cfg["intermediate"], cfg["layers"]) == (7168, 2048, 12)
    assert cfg["tp"] == max(t for t in range(1, min(_gpus(), 8) + 1) if 2048 % (128 * t) == 0)  # 1, 2, 4 or 8
    _check(data, tp=cfg["tp"], layers=12, repeat=3)
    for s in data["summary"]:
        hidden = min(s["compute_alone_ms"], s["transfer_alone_ms"])
        assert s["loop_ms"] + s["fill_ms"] < s["serial_ms"] - 0.5 * hidden, s
        assert s["overlap_ms"] > 0.5 * hidden, s
    assert (tmp_path / "prefill.png").exists() or "no plot" in stdout
