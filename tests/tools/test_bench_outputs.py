"""Every benchmark script writes its table (.md), JSON and PNG plot into the folder it is given,
also when that folder is a relative path and the process changes directory afterwards (the GPU
runner used to lose its results that way). Each script's write_outputs() runs here on a small
synthetic result; no GPU and no native build are needed."""
import json
import os

import pytest

from tests._tools import load_tool

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check(paths, out, name, must_contain):
    assert [os.path.basename(p) for p in paths] == [f"{name}.json", f"{name}.md", f"{name}.png"], paths
    for p in paths:
        assert os.path.isabs(p) and os.path.dirname(p) == str(out) and os.path.getsize(p) > 0, p
    with open(paths[2], "rb") as f:
        assert f.read(8) == PNG_MAGIC
    with open(paths[1]) as f:
        md = f.read()
    for needle in must_contain:
        assert needle in md, (needle, md)
    with open(paths[0]) as f:
        return json.load(f)


def _relative_out(tmp_path, monkeypatch):
    """``out/x`` relative to a working directory the test then leaves."""
    monkeypatch.chdir(tmp_path)
    return "out/x", tmp_path / "out" / "x"


def test_elastic_ep_outputs(tmp_path, monkeypatch):
    b = load_tool("_bench_ep_report")
    row = dict(backend="native", case="dispatch_bf16", num_sms=0, kernel_us=30.0, comm_kernel_us=20.0,
               epilogue_us=10.0, e2e_us=50.0, comm_gbps_excl_local=300.0, comm_gbps_incl_local=400.0,
               kernel_gbps_excl_local=200.0, kernel_gbps_incl_local=250.0, e2e_gbps_excl_local=120.0,
               speedup_vs_ref_e2e=2.0, speedup_vs_torch_e2e=3.0, speedup_vs_a2a_e2e=1.5, span_us=31.0,
               per_kernel_us={"dispatch_push": 20.0}, per_kernel_us_by_rank=[{"dispatch_push": 20.0}])
    meta = dict(date="2025-01-01 00:00 UTC", gpus=2, gpu_name="synthetic", git="abc1234", torch="t", nccl="n",
                tokens=4096)
    rel, out = _relative_out(tmp_path, monkeypatch)
    paths = b.write_outputs(rel, meta, [row], [{"results": []}])
    data = _check(paths, out, "bench_elastic_ep", ["| native | dispatch_bf16 | all | 30.0 | 20.0 | 10.0 | 50.0 |"])
    assert data["meta"] == meta and data["table"] == [row] and data["per_rank"] == [{"results": []}]


def _ipc_row(b, world, total, ours_rt, nccl_rt):
    row = {"world": world, "total_tokens": total, "bytes_per_rank": total // world * 32 * 128 * 2,
           "bitwise_equal": True}
    for mode in ("eager", "graph"):
        for name, us in (("ours_send", ours_rt / 2), ("ours_gather", ours_rt / 2), ("ours_rt", ours_rt),
                         ("nccl_send", nccl_rt / 2), ("nccl_gather", nccl_rt / 2), ("nccl_rt", nccl_rt)):
            row[f"{name}_{mode}_us"] = us
    return b._derive(row)


def test_ipc_all2all_outputs(tmp_path, monkeypatch):
    b = load_tool("bench_ipc_all2all")
    rows = [_ipc_row(b, 2, 4096, 60.0, 166.0), _ipc_row(b, 2, 32768, 400.0, 851.0)]
    sweep = [dict(world=2, total_tokens=32768, num_blocks=132, self_blocks=0, grid=[132, 66, 66], send_us=200.0,
                  bytes_per_rank=rows[1]["bytes_per_rank"])]
    meta = {"date": "2025-01-01T00:00:00+00:00", "gpus": 2, "gpu": "synthetic", "torch": "t", "nccl": "n",
            "git_rev": "abc1234", "command": "bench_ipc_all2all.py --out x"}
    data = {"meta": meta, "rows": rows, "grid_sweep": sweep, "errors": {"4": "synthetic failure"},
            "targets": b._targets(rows)}
    rel, out = _relative_out(tmp_path, monkeypatch)
    paths = b.write_outputs(rel, data)
    got = _check(paths, out, "bench_ipc_all2all",
                 ["| 2 | 4096 | 16 | eager | 30.0 | 30.0 | 60.0 | 83.0 | 83.0 | 166.0 | 0.36 |", "## Grid sweep",
                  "W=4: synthetic failure", "git abc1234"])
    assert got["rows"] == json.loads(json.dumps(rows)) and got["errors"] == {"4": "synthetic failure"}


def test_fp8_layerwise_outputs(tmp_path, monkeypatch):
    b = load_tool("bench_fp8_layerwise")
    modes = {"ktransformers": dict(bytes=10, total_ms=1.0), "slots4": dict(bytes=10, total_ms=0.5)}
    results = [dict(config="DSV3 TP1", tp=1, shard_tp=1, expert_mb_per_rank=44.05, ranks=[{"modes": modes}])]
    summary = {("DSV3 TP1", "ktransformers"): dict(peak=50.0, h2d=20.0, eff=18.0, ok=True),
               ("DSV3 TP1", "slots4"): dict(peak=50.0, h2d=45.0, eff=44.0, ok=True)}
    table = "| config | mode |\n|---|---|\n| DSV3 TP1 | ktransformers |\n| DSV3 TP1 | slots4 |"
    meta = dict(date="2025-01-01 00:00:00 UTC", backend="cuda", git_rev="abc1234")
    rel, out = _relative_out(tmp_path, monkeypatch)
    paths = b.write_outputs(rel, meta, results, table, ["DSV3 TP1: MET"], summary)
    data = _check(paths, out, "bench_fp8_layerwise", ["| DSV3 TP1 | slots4 |", "- DSV3 TP1: MET", "git_rev abc1234"])
    assert data["summary"] == [dict(config="DSV3 TP1", mode="ktransformers", **summary[("DSV3 TP1", "ktransformers")]),
                               dict(config="DSV3 TP1", mode="slots4", **summary[("DSV3 TP1", "slots4")])]
    assert data["results"] == results and data["targets"] == ["DSV3 TP1: MET"]


def test_a_failing_plot_keeps_table_and_json(tmp_path):
    u = load_tool("_results")
    (tmp_path / "r.png").write_bytes(PNG_MAGIC)  # an earlier run's plot must not pass for this one's

    def broken(path):
        raise RuntimeError("no display")

    paths = u.write_results(str(tmp_path), "r", {"a": 1}, "| a |", broken)
    assert [os.path.basename(p) for p in paths] == ["r.json", "r.md"]
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1} and (tmp_path / "r.md").read_text() == "| a |\n"


def test_ipc_all2all_on_fewer_than_two_gpus_says_so_in_the_folder(tmp_path):
    # The bench preset runs every benchmark on any machine; with one GPU (or none) ipc_all2all has
    # nothing to measure, and says so in its table and JSON instead of failing the run.
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs here: the benchmark would measure")
    import subprocess
    import sys

    from tests._tools import ROOT

    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_ipc_all2all.py"), "--out", "o"],
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((tmp_path / "o" / "bench_ipc_all2all.json").read_text())
    assert "needs at least 2 GPUs" in data["skipped"]
    assert "needs at least 2 GPUs" in (tmp_path / "o" / "bench_ipc_all2all.md").read_text()
