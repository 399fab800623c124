"""elastic_ep's model block (``tools/block_elastic_ep.py``, the DeepSeek-V3 MoE layer of
tools/_block_ep_moe_layer.py) on the CPU: the layer's pieces against plain per-token loops, the
layer over gloo (torch runtime) against a single-process computation, the pipelined micro-batches
against the sequential ones, the command line and its refusals.
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

SMALL = ml.MoEConfig(hidden=256, intermediate=128, num_experts=32)
CPU = torch.device("cpu")


def _bf16(a) -> torch.Tensor:
    return torch.from_numpy(a).view(torch.bfloat16)


# ------------------------------------------------------------------------------------------ pieces
def _select_loop(scores: torch.Tensor, bias: torch.Tensor, cfg: ml.MoEConfig):
    """DeepSeek-V3's grouped selection written per token, from the definition."""
    G, per = cfg.num_groups, cfg.num_experts // cfg.num_groups
    ids, weights = [], []
    for t in range(scores.shape[0]):
        biased = scores[t] + bias  # fp32, as the layer
        group_score = []
        for g in range(G):
            best = sorted(biased[g * per:(g + 1) * per].tolist(), reverse=True)
            group_score.append(float(torch.tensor(best[0], dtype=torch.float32) + torch.tensor(best[1])))
        kept = sorted(range(G), key=lambda g: -group_score[g])[:cfg.num_topk_groups]
        candidates = [e for g in kept for e in range(g * per, (g + 1) * per)]
        chosen = sorted(candidates, key=lambda e: -float(biased[e]))[:cfg.num_topk]
        s = torch.stack([scores[t, e] for e in chosen])
        ids.append(chosen)
        weights.append((s / s.sum() * cfg.routed_scaling_factor).tolist())
    return ids, torch.tensor(weights)


@pytest.mark.parametrize("bias_shift", [0.0, -2.0], ids=["bias", "all_negative"])
def test_select_experts_matches_a_per_token_loop(bias_shift):
    # all_negative: every biased score is below 0, so experts of dropped groups masked with 0 instead of
    # -inf would win; the loop considers the kept groups only.
    g = torch.Generator().manual_seed(1)
    for cfg in (SMALL, ml.MoEConfig(num_experts=256), ml.MoEConfig(num_experts=64, num_topk=6, num_topk_groups=3)):
        scores = torch.rand((40, cfg.num_experts), generator=g)
        bias = (torch.rand((cfg.num_experts,), generator=g) - 0.5) * 0.2 + bias_shift
        idx, w = ml.select_experts(scores, bias, cfg)
        ids, weights = _select_loop(scores, bias, cfg)
        assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == (40, cfg.num_topk)
        assert [sorted(r) for r in idx.tolist()] == [sorted(r) for r in ids]
        # lanes in the same (descending biased score) order, weights from the unbiased scores
        assert idx.tolist() == ids
        torch.testing.assert_close(w, weights, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(w.sum(1), torch.full((40,), cfg.routed_scaling_factor), rtol=1e-5, atol=1e-5)


def test_route_uses_fp32_sigmoid_logits():
    gate, bias = ml.router_weights(SMALL, CPU)
    x = ml.make_tokens(SMALL, 0, 16, CPU)
    idx, w = ml.route(x, gate, bias, SMALL)
    ref_idx, ref_w = ml.select_experts(torch.sigmoid(x.double() @ gate.double().t()).float(), bias, SMALL)
    assert (idx == ref_idx).float().mean() > 0.95  # fp32 vs fp64 logits: at most a rare near tie flips
    assert len({tuple(sorted(r)) for r in idx.tolist()}) > 1  # the router does route


def test_fp8_cast_per_128_columns():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn((5, 384), generator=g) * torch.tensor([1e-3, 1.0, 300.0]).repeat_interleave(128)).to(torch.bfloat16)
    x[3, 128:256] = 0  # an all-zero block stays finite
    q, sf = ml.quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and sf.shape == (5, 3) and sf.dtype == torch.float32
    for t in range(5):
        for b in range(3):
            block = x[t, b * 128:(b + 1) * 128].float()
            amax = max(float(block.abs().max()), 1e-4)
            assert float(sf[t, b]) == pytest.approx(amax / 448.0, rel=1e-6)
            # the largest value uses the top of the e4m3 range
            if float(block.abs().max()) > 0:
                assert float(q[t, b * 128:(b + 1) * 128].float().abs().max()) == pytest.approx(448.0, rel=1 / 16)
    back = ml.dequantize_fp8(q, sf)
    assert back.dtype == torch.bfloat16 and torch.isfinite(back.float()).all()
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 per value (+ 2^-8 for the BF16 result), plus the
    # subnormals near 0
    err = (back.float() - x.float()).abs()
    assert bool((err <= x.float().abs() * (2 ** -4 + 2 ** -8) + sf.repeat_interleave(128, dim=1) * 2 ** -9 + 1e-6).all())


def test_expert_ffn_grouped_and_loop_agree_with_dense_math():
    g = torch.Generator().manual_seed(3)
    L, H, I = 4, 256, 64
    sizes = [128, 0, 256, 128]  # an expert without rows too
    x = torch.randn((sum(sizes), H), generator=g).to(torch.bfloat16)
    w13 = (torch.randn((L, 2 * I, H), generator=g) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn((L, H, I), generator=g) * I ** -0.5).to(torch.bfloat16)
    seg = ml.Segments(sizes, torch.tensor([128, 128, 384, 512], dtype=torch.int32))
    loop = ml.expert_ffn(x, w13, w2, seg, "loop")
    start = 0
    for e, n in enumerate(sizes):
        rows = x[start:start + n].float()
        gu = (rows @ w13[e].float().t()).to(torch.bfloat16).float()
        h = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).to(torch.bfloat16).float()
        want = h @ w2[e].float().t()
        torch.testing.assert_close(loop[start:start + n].float(), want, rtol=2 ** -6, atol=2 ** -6)
        start += n
    if ml.grouped_mm_support(CPU)[0]:
        assert ml.bitwise_equal(ml.expert_ffn(x, w13, w2, seg, "grouped"), loop)
    assert ml.resolve_gemm("loop", CPU) == "loop"
    with pytest.raises(ValueError, match="gemm"):
        ml.resolve_gemm("cutlass", CPU)


def test_reference_error_catches_lane_mistakes():
    gate, bias = ml.router_weights(SMALL, CPU)
    x = ml.make_tokens(SMALL, 0, 32, CPU)
    experts = lambda e: ml.expert_weights(SMALL, e, CPU)  # noqa: E731
    ref, magnitude = ml.reference_forward(x, gate, bias, experts, SMALL)
    assert ml.reference_error(ref, ref, magnitude) == 0.0
    # one expert with another's weights, or every token losing its last lane: far outside the tolerance
    wrong, _ = ml.reference_forward(x, gate, bias, lambda e: experts((e + 1) % 32 if e == 5 else e), SMALL)
    assert ml.reference_error(wrong, ref, magnitude) > 3
    seven, _ = ml.reference_forward(x, gate, bias, experts, ml.MoEConfig(hidden=256, intermediate=128,
                                                                         num_experts=32, num_topk=7))
    assert ml.reference_error(seven, ref, magnitude) > 3


# ------------------------------------------------------------------------------------------ the layer
def test_layer_over_gloo_matches_single_process(tmp_path):
    # 3 ranks (the command line test below runs the default 2), 16 experts each, two token counts
    world = 3
    moe = ml.MoEConfig(hidden=256, intermediate=128, num_experts=48, seed=5)
    cfg = block.BlockConfig(moe=moe, world=world, tokens=(48, 7), device="cpu", iters=1, warmup=1,
                          return_outputs=True)
    cfg.validate()
    results = run_workers(block.run_rank, world, cfg, tmp_path=tmp_path, timeout=120)
    gate, bias = ml.router_weights(moe, CPU)
    experts_of = lambda e: ml.expert_weights(moe, e, CPU)  # noqa: E731
    for rank, res in enumerate(results):
        assert res["native_missing"] and list(res["runtimes"]) == ["torch"]
        for i, T in enumerate(cfg.tokens):
            c, outs = res["configs"][i], res["outputs"][T]
            # this rank's tokens through the single-process layer, computed here
            x = ml.make_tokens(moe, rank, max(cfg.tokens), CPU)[:T]
            ref, magnitude = ml.reference_forward(x, gate, bias, experts_of, moe)
            got = _bf16(outs["torch"])
            assert got.shape == (T, moe.hidden)
            err = ml.reference_error(got, ref, magnitude)
            assert err <= 1.0, f"rank {rank}, {T} tokens: {err:.2f} x the tolerance"
            assert c["reference_error"] == pytest.approx(err)
            # the pipelined micro-batches are the sequential ones, bit for bit, and cover the tokens
            seq = [_bf16(a) for a in outs["sequential"]]
            ovl = [_bf16(a) for a in outs["overlapped"]]
            assert [s.shape[0] for s in seq] == c["overlap"]["micro_batches"] == [T - T // 2, T // 2]
            assert all(ml.bitwise_equal(a, b) for a, b in zip(seq, ovl))
            assert ml.reference_error(torch.cat(seq), ref, magnitude) <= 1.0
            assert c["overlap"]["bitwise"] and c["overlap"]["repeatable"]
            fig = c["layers"]["torch"]
            assert fig["repeatable"] and c["native_equals_torch"] is None
            assert all(fig[f"{p}_ms"] > 0 for p in ("layer", "router", "dispatch", "experts", "combine"))
            parts = sum(fig[f"{p}_ms"] for p in ("router", "dispatch", "experts", "combine"))
            assert parts == pytest.approx(fig["layer_ms"], rel=0.2)  # medians of each: close, not equal
    record = block.summarize(cfg, results)
    assert record["ok"] and record["checks"]["reference_error"] <= 1.0
    assert [(r["tokens"], r["runtime"]) for r in record["layer"]] == [(48, "torch"), (7, "torch")]
    table = block.render(record)
    assert "| 48 | torch reference |" in table and "bitwise equal" in table


def test_command_line_cpu(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "block_elastic_ep.py"), "--device", "cpu",
                        "--tokens", "40,9", "--iters", "1", "--warmup", "1", "--out", str(out)], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "No usable CUDA GPU" in p.stdout and "block OK" in p.stdout
    assert "| 40 | torch reference |" in p.stdout and "| 9 | torch reference | 5 + 4 | - |" in p.stdout
    record = json.loads((out / "block_elastic_ep.json").read_text())
    assert record["ok"] and record["config"]["tokens"] == [40, 9] and record["config"]["world"] == 2
    assert record["checks"]["overlap_bitwise"] and record["checks"]["repeatable"]
    assert record["command"].startswith("python tools/block_elastic_ep.py --device cpu")
    md = (out / "block_elastic_ep.md").read_text()
    assert "| tokens/rank | runtime | layer ms |" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "block_elastic_ep.png").stat().st_size > 0


@pytest.mark.parametrize("argv,match", [
    (["--experts", "36"], "num_experts"),          # not a multiple of the 8 groups
    (["--experts", "32", "--world", "3"], "world=3"),
    (["--experts", "8"], "num_experts"),           # 1 expert per group: no top-2 group score
    (["--hidden", "200"], "hidden"),
    (["--intermediate", "100"], "intermediate"),
    (["--tokens", "64,0"], "tokens"),
    (["--tokens", "6x"], "tokens"),
    (["--iters", "0"], "iters"),
    (["--warmup", "-1"], "warmup"),
    (["--world", "0"], "world"),
    (["--overlap-sms", "-2"], "overlap_sms"),
    (["--timeout", "0"], "timeout"),
    (["--experts", "256", "--hidden", "7168", "--intermediate", "2048"], "experts/hidden/intermediate"),
])
def test_bad_arguments_refused_before_launch(argv, match):
    args = block._parser().parse_args(["--device", "cpu"] + argv)
    with pytest.raises(ValueError, match=match):
        block.build_config(args)


def test_bad_argument_exit_status(capsys):
    with pytest.raises(SystemExit) as e:
        block.main(["--device", "cpu", "--hidden", "200"])
    assert e.value.code == 2 and "hidden" in capsys.readouterr().err


def test_layer_needs_a_deterministic_buffer():
    class FakeBuffer:  # the layer refuses before it touches anything else
        deterministic = False
        device = CPU

    w13, w2 = ml.local_expert_weights(SMALL, 0, 32, CPU)
    gate, bias = ml.router_weights(SMALL, CPU)
    with pytest.raises(ValueError, match="deterministic=True"):
        ml.EPMoELayer(SMALL, gate, bias, w13, w2, FakeBuffer())
