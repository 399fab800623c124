"""GPU checks of ``tools/block_elastic_ep.py`` (elastic_ep's model block: the DeepSeek-V3 MoE layer on elastic_ep).

* EP 1 at a reduced shape (hidden 1024, intermediate 512, 64 experts, top-8 of 8 groups), with the
  grouped GEMM and with a matmul per expert: the native runtime's output is bitwise the torch
  reference runtime's, every repetition is bitwise the first, each rank's output is within the
  stated tolerance of the single-process reference, and the pipelined micro-batches (one computes
  while the other dispatches / combines) are bitwise the sequential ones.
* EP 2: the same checks, one GPU per rank over NCCL, or with ``COMMKIT_TEST_SHARE_GPU=1`` two ranks
  on one GPU (CUDA-IPC window; the torch runtime then runs over gloo through host memory).
* ``torch._grouped_mm`` runs on Hopper and agrees with a matmul per expert.
* The command line at DeepSeek-V3's shape on one GPU (4096 tokens, hidden 7168, 256 experts,
  intermediate 2048): exit status 0, every check passed, the table and JSON written; the default mode
  then runs the decode block at that shape too (its JSON checked).
* Decode mode (tools/_block_ep_decode.py) at the reduced shape, EP 1 and EP 2 (one GPU per rank): the
  native low-latency step (two micro-batches through the hooks, grouped GEMMs on the packed layout) and
  the low-latency API's torch backend bitwise equal to the reference and to each other, V2 native equal
  to the V2-order reference, the same rows and expert outputs in all three, power-of-two weights making
  low-latency and V2 bitwise equal, the CUDA-graph replay of the whole step equal to eager; with a
  matmul per expert (no graph) too.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests._dist import run_workers
from tests._tools import ROOT, load_tool

block = load_tool("block_elastic_ep")
ml = load_tool("_block_ep_moe_layer")
dec = load_tool("_block_ep_decode")

REDUCED = ml.MoEConfig(hidden=1024, intermediate=512, num_experts=64, seed=7)


def _bf16(a) -> torch.Tensor:
    return torch.from_numpy(a).view(torch.bfloat16)


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    diff = (a.view(torch.int16) != b.view(torch.int16)).nonzero()
    if not len(diff):
        return "none"
    t, h = diff[0].tolist()
    return f"{len(diff)} elements differ, first [{t}, {h}]: {float(a[t, h])} vs {float(b[t, h])}"


def _run(tmp_path, world: int, gemm: str = "auto", tokens=(256, 61)):
    cfg = block.BlockConfig(moe=REDUCED, world=world, tokens=tokens, device="cuda", iters=2, warmup=1, gemm=gemm,
                          return_outputs=True)
    cfg.validate()
    results = run_workers(block.run_rank, world, cfg, tmp_path=tmp_path, timeout=300)
    for rank, res in enumerate(results):
        assert list(res["runtimes"]) == ["native", "torch"], res["native_missing"]
        if gemm != "auto":
            assert res["gemm"] == gemm
        for i, T in enumerate(cfg.tokens):
            c, outs = res["configs"][i], res["outputs"][T]
            where = f"rank {rank}, {T} tokens"
            native, reference_runtime = _bf16(outs["native"]), _bf16(outs["torch"])
            assert native.shape == (T, REDUCED.hidden)
            assert torch.isfinite(native.float()).all(), where
            assert ml.bitwise_equal(native, reference_runtime), \
                f"{where}: native vs torch runtime: {_first_difference(native, reference_runtime)}"
            assert c["native_equals_torch"] is True
            assert c["layers"]["native"]["repeatable"] and c["layers"]["torch"]["repeatable"], where
            assert c["reference_error"] <= 1.0, f"{where}: {c['reference_error']:.2f} x the tolerance"
            if T >= 2:
                seq = [_bf16(a) for a in outs["sequential"]]
                ovl = [_bf16(a) for a in outs["overlapped"]]
                assert [s.shape[0] for s in seq] == [T - T // 2, T // 2]
                for j, (a, b) in enumerate(zip(seq, ovl)):
                    assert ml.bitwise_equal(a, b), f"{where}, micro-batch {j}: {_first_difference(a, b)}"
                assert c["overlap"]["runtime"] == "native" and c["overlap"]["bitwise"] and c["overlap"]["repeatable"]
            else:
                assert c["overlap"] is None
            for name in ("native", "torch"):
                fig = c["layers"][name]
                assert all(fig[f"{p}_ms"] > 0 for p in ("layer", "router", "dispatch", "experts", "combine")), fig
    record = block.summarize(cfg, results)
    assert record["ok"], record["checks"]
    assert all(r["speedup"] > 0 for r in record["layer"] if r["runtime"] == "native")
    print(block.render(record))
    return record


@pytest.mark.smoke
@pytest.mark.gpu
def test_block_ep1(tmp_path):
    _run(tmp_path, 1)


@pytest.mark.gpu
def test_block_ep1_matmul_per_expert(tmp_path):
    # one token too: its rows fill one segment of one expert per lane, and there is nothing to pipeline
    _run(tmp_path, 1, gemm="loop", tokens=(130, 1))


@pytest.mark.multigpu(2, shared_ok=True)
def test_block_ep2(tmp_path):
    record = _run(tmp_path, 2)
    shared = torch.cuda.device_count() < 2
    assert record["environment"]["group"] == ("gloo" if shared else "nccl")
    assert ("CUDA-IPC" in record["environment"]["runtimes"]["native"]) == shared


@pytest.mark.gpu
def test_grouped_gemm_on_hopper():
    dev = torch.device("cuda", 0)
    if torch.cuda.get_device_capability(dev) < (9, 0):
        pytest.skip("torch._grouped_mm's BF16 kernels are for sm_90 and newer")
    ok, why = ml.grouped_mm_support(dev)
    assert ok, why
    assert ml.resolve_gemm("auto", dev) == "grouped"
    # segments of 0, 128, 384 and 128 rows, as expand mode aligns them
    g = torch.Generator(device=dev).manual_seed(0)
    sizes = [0, 128, 384, 128]
    x = torch.randn((sum(sizes), 1024), generator=g, device=dev).to(torch.bfloat16)
    w13 = (torch.randn((4, 1024, 1024), generator=g, device=dev) / 32).to(torch.bfloat16)
    w2 = (torch.randn((4, 1024, 512), generator=g, device=dev) / 23).to(torch.bfloat16)
    seg = ml.Segments(sizes, torch.tensor([0, 128, 512, 640], dtype=torch.int32, device=dev))
    grouped = ml.expert_ffn(x, w13, w2, seg, "grouped")
    loop = ml.expert_ffn(x, w13, w2, seg, "loop")
    torch.testing.assert_close(grouped.float(), loop.float(), rtol=2 ** -6, atol=2 ** -6)


@pytest.mark.gpu
def test_command_line_deepseek_shape_ep1(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "block_elastic_ep.py"), "--world", "1",
                        "--iters", "5", "--warmup", "2", "--out", str(out)], capture_output=True, text=True, timeout=480, cwd=tmp_path)
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    record = json.loads((out / "block_elastic_ep.json").read_text())
    cfg, checks = record["config"], record["checks"]
    assert (cfg["moe"]["hidden"], cfg["moe"]["intermediate"], cfg["moe"]["num_experts"], cfg["tokens"]) == \
        (7168, 2048, 256, [4096])
    assert record["ok"] and checks["native_equals_torch"] is True and checks["overlap_bitwise"]
    assert checks["repeatable"] and checks["reference_error"] <= 1.0
    assert [r["runtime"] for r in record["layer"]] == ["native", "torch"]
    if torch.cuda.get_device_capability(0) >= (9, 0):
        assert record["environment"]["gemm"] == "grouped"
    assert (out / "block_elastic_ep.md").read_text().count("| 4096 |") == 3  # two runtimes + the overlap
    assert os.path.getsize(out / "block_elastic_ep.json") > 0
    decode = json.loads((out / "block_elastic_ep_decode.json").read_text())
    assert decode["ok"], decode["checks"]
    assert decode["config"]["moe"]["hidden"] == 7168 and decode["config"]["tokens"] == [1, 32, 128]
    assert decode["checks"]["ll_reference"] is True and decode["checks"]["v2_reference"] is True
    if decode["environment"]["graph_missing"] is None:
        assert decode["checks"]["graph"] is True


def _run_decode(tmp_path, world: int, gemm: str = "auto", tokens=(1, 37, 128)):
    cfg = dec.DecodeConfig(moe=REDUCED, world=world, tokens=tokens, device="cuda", iters=2, warmup=1, gemm=gemm,
                           return_outputs=True)
    cfg.validate()
    results = run_workers(dec.run_rank, world, cfg, tmp_path=tmp_path, timeout=300)
    for rank, res in enumerate(results):
        assert list(res["runtimes"]) == ["ll_native", "ll_torch", "v2"], res["native_missing"]
        graph = res["graph_missing"] is None
        assert graph == (res["gemm"] == "grouped"), res["graph_missing"]
        for c in res["configs"]:
            ck, where = c["checks"], f"rank {rank}, {c['tokens']} tokens, {c['dispatch']}"
            assert ck["ll_reference"] == {"ll_native": True, "ll_torch": True}, where
            assert ck["v2_reference"] is True and ck["same_rows"] is True, where
            assert ck["pow2"] == {"ll_native": True, "ll_torch": True, "v2": True}, where
            assert all(ck["nohook"].values()) and all(ck["repeatable"].values()), where
            assert ck["graph"] == ({"ll_native": True} if graph else {}), where
            assert ck["ll_vs_v2"]["error"] <= 1.0, where
            outs = res["outputs"][f"{c['tokens']}/{c['dispatch']}"]
            native, torch_backend = _bf16(outs["ll_native"]), _bf16(outs["ll_torch"])
            assert ml.bitwise_equal(native, torch_backend), f"{where}: {_first_difference(native, torch_backend)}"
            figs = c["runtimes"]
            assert figs["ll_native"]["eager_ms"] > 0 and figs["v2"]["eager_ms"] > 0
            assert (figs["ll_native"]["graph_ms"] is not None) == graph
    record = dec.summarize(cfg, results)
    assert record["ok"], record["checks"]
    print(dec.render(record))
    return record


@pytest.mark.gpu
def test_decode_ep1(tmp_path):
    _run_decode(tmp_path, 1)


@pytest.mark.gpu
def test_decode_ep1_matmul_per_expert(tmp_path):
    record = _run_decode(tmp_path, 1, gemm="loop", tokens=(1, 20))
    assert record["checks"]["graph"] is None and "host" in record["environment"]["graph_missing"]


@pytest.mark.multigpu(2)
def test_decode_ep2(tmp_path):
    record = _run_decode(tmp_path, 2)
    assert record["environment"]["group"] == "nccl"
