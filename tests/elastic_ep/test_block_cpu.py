"""elastic_ep's model block (``tools/block_elastic_ep.py``, the DeepSeek-V3 MoE layer of
tools/_block_ep_moe_layer.py) on the CPU: the layer's pieces against plain per-token loops, the
layer over gloo (torch runtime) against a single-process computation, the pipelined micro-batches
against the sequential ones, the command line and its refusals.

Decode mode (tools/_block_ep_decode.py): the packed-layout experts and the two combine orders against
plain loops; the decode block on 2 CPU ranks (low-latency and V2 APIs on their torch backends over gloo)
with every bitwise check passing, and its output recomputed here token by token (each expert row alone,
which is bitwise the batched row at these shapes: the block's ``row_invariant`` report checks that
assumption); the default command line (prefill then decode) writing both tables.
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
    # the default mode: the prefill block, then the decode block (both tables: what tools/run.sh prints)
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "block_elastic_ep.py"), "--device", "cpu",
                        "--tokens", "40,9", "--iters", "1", "--warmup", "1", "--decode-tokens", "1,6",
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "No usable CUDA GPU" in p.stdout and "\nblock OK" in p.stdout and "decode block OK" in p.stdout
    assert "| 6 | 3 + 3 | fp8 | low-latency API, torch backend |" in p.stdout
    decode = json.loads((out / "block_elastic_ep_decode.json").read_text())
    assert decode["ok"] and decode["config"]["tokens"] == [1, 6] and decode["config"]["world"] == 2
    assert decode["config"]["iters"] == 1 and decode["config"]["moe"]["hidden"] == 256
    assert decode["command"].startswith("python tools/block_elastic_ep.py --mode decode --device cpu")
    assert [(r["tokens"], r["dispatch"], r["runtime"]) for r in decode["steps"]] == [
        (t, f, r) for t in (1, 6) for f in ("bf16", "fp8") for r in ("ll_torch", "v2")]
    assert "| tokens/rank | micro-batches | dispatch | runtime |" in (out / "block_elastic_ep_decode.md").read_text()
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
    assert (out / "block_elastic_ep_decode.png").stat().st_size > 0


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


# ------------------------------------------------------------------------------------------ decode mode
def _experts(L: int, H: int, I: int, gemm: str, fp8: bool = False, R: int = 2, M: int = 4, seed: int = 11):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn((L, 2 * I, H), generator=g) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn((L, H, I), generator=g) * I ** -0.5).to(torch.bfloat16)
    return dec.Experts(w13, w2, R, L * R, M, R * M * min(8, L), fp8, gemm)


def test_packed_index_points_at_the_valid_rows():
    counts = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    l, j, valid = dec.packed_index(counts, 4, 8, 12)
    want = [(e, r) for e, n in enumerate(counts.tolist()) for r in range(n)]
    assert list(zip(l.tolist(), j.tolist()))[:9] == want
    assert valid.tolist() == [True] * 9 + [False] * 3 and l[9:].tolist() == [0] * 3 and j[9:].tolist() == [0] * 3
    _, _, none = dec.packed_index(torch.zeros(4, dtype=torch.int32), 4, 8, 5)
    assert not none.any()


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("gemm", ["loop", "grouped"])
def test_ll_experts_on_the_packed_layout(fmt, gemm):
    if gemm == "grouped" and not ml.grouped_mm_support(CPU)[0]:
        pytest.skip(ml.grouped_mm_support(CPU)[1])
    L, RM, H, I = 3, 8, 256, 64
    ex = _experts(L, H, I, gemm, fmt == "fp8")
    counts = torch.tensor([3, 0, 5], dtype=torch.int32)
    g = torch.Generator().manual_seed(12)
    x = torch.randn((L, RM, H), generator=g).to(torch.bfloat16)
    if fmt == "fp8":
        q, sf = dec.cast_fp8(x.view(L * RM, H))
        # the low-latency layout: scales stored column-major [L, G, RM], seen as [L, RM, G]
        packed = (q.view(L, RM, H), sf.view(L, RM, H // 128).transpose(1, 2).contiguous().transpose(1, 2))
        rows_of = lambda e, n: ml.dequantize_fp8(packed[0][e, :n], packed[1][e, :n])  # noqa: E731
    else:
        packed = x.clone()
        rows_of = lambda e, n: x[e, :n]  # noqa: E731
    probe = []
    y = dec.ll_experts(ex, packed, counts, poison=True, probe=probe)  # rows past the counts become NaN first
    assert y.shape == (L, RM, H) and y.dtype == torch.bfloat16
    for e, n in enumerate(counts.tolist()):
        # each expert's valid rows as one plain matmul chain: the batched GEMMs give the same bits
        want = ml.expert_ffn(rows_of(e, n), ex.w13[e:e + 1], ex.w2[e:e + 1],
                             ml.Segments([n], torch.tensor([n], dtype=torch.int32)), "loop")
        assert ml.bitwise_equal(y[e, :n], want) and torch.isfinite(y[e, :n].float()).all()
        assert torch.isnan(y[e, n:].float()).all()  # nothing written past the counts
    assert probe[0]["counts"].tolist() == [3, 0, 5] and probe[0]["rows"].shape == (8, H)
    assert ml.bitwise_equal(probe[0]["y"], torch.cat([y[e, :n] for e, n in enumerate(counts.tolist())]))


def test_combine_orders_and_power_of_two_weights():
    g = torch.Generator().manual_seed(13)
    T, K, H = 5, 8, 64
    y = torch.randn((T, K, H), generator=g).to(torch.bfloat16)
    w = torch.rand((T, K), generator=g) * 0.7 + 0.01
    ll, v2 = dec.combine_ll_order(y, w), dec.combine_v2_order(y, w)
    for t in range(T):
        acc_ll = torch.zeros(H)
        acc_v2 = torch.zeros(H)
        for k in range(K):
            prod = y[t, k].float() * w[t, k]  # fp32 product, then fp32 sum, lane by lane
            acc_ll = acc_ll + prod
            acc_v2 = acc_v2 + prod.to(torch.bfloat16).float()
        assert ml.bitwise_equal(ll[t], acc_ll.to(torch.bfloat16)) and ml.bitwise_equal(v2[t], acc_v2.to(torch.bfloat16))
    assert not ml.bitwise_equal(ll, v2)  # where the product is rounded matters with real weights ...
    p2 = dec.pow2_weights(w)
    mant, _ = torch.frexp(p2)
    assert (mant == 0.5).all() and (p2 <= w).all() and (w < 2 * p2).all()
    assert ml.bitwise_equal(dec.combine_ll_order(y, p2), dec.combine_v2_order(y, p2))  # ... not with powers of two


def _token_by_token(moe: ml.MoEConfig, rank: int, T: int, fmt: str, weights=None) -> torch.Tensor:
    """This rank's decode output recomputed here: every (token, lane) row through its expert alone, then
    ``acc + y * w`` in fp32 lane by lane, rounded once."""
    gate, bias = ml.router_weights(moe, CPU)
    x = ml.make_tokens(moe, rank, T, CPU)
    idx, w = ml.route(x, gate, bias, moe)
    if weights is not None:
        w = weights(w)
    rows = ml.dequantize_fp8(*dec.cast_fp8(x)) if fmt == "fp8" else x
    experts = {e: ml.expert_weights(moe, e, CPU) for e in idx.unique().tolist()}
    one = ml.Segments([1], torch.ones(1, dtype=torch.int32))
    out = torch.empty((T, moe.hidden), dtype=torch.bfloat16)
    for t in range(T):
        acc = torch.zeros(moe.hidden)
        for k in range(moe.num_topk):
            w13, w2 = experts[int(idx[t, k])]
            yk = ml.expert_ffn(rows[t:t + 1], w13[None], w2[None], one, "loop")[0]
            acc = acc + yk.float() * w[t, k]
        out[t] = acc.to(torch.bfloat16)
    return out


def test_decode_over_gloo_bitwise(tmp_path):
    moe = ml.MoEConfig(hidden=256, intermediate=128, num_experts=32, seed=3)
    cfg = dec.DecodeConfig(moe=moe, world=2, tokens=(1, 9), device="cpu", iters=1, warmup=0, return_outputs=True)
    cfg.validate()
    assert cfg.max_micro_batch == 5 and cfg.capacity == 2 * 5 * 8
    results = run_workers(dec.run_rank, 2, cfg, tmp_path=tmp_path, timeout=120)
    for rank, res in enumerate(results):
        assert res["native_missing"] and list(res["runtimes"]) == ["ll_torch", "v2"]
        assert res["graph_missing"] == "no GPU"
        assert [(c["tokens"], c["dispatch"]) for c in res["configs"]] == [(t, f) for t in (1, 9) for f in ("bf16", "fp8")]
        for c in res["configs"]:
            T, fmt, ck = c["tokens"], c["dispatch"], c["checks"]
            where = f"rank {rank}, {T} tokens, {fmt}"
            assert c["micro_batches"] == [T - T // 2, T // 2]
            assert ck["ll_reference"] == {"ll_torch": True} and ck["v2_reference"] is True, where
            assert ck["same_rows"] and ck["pow2"] == {"ll_torch": True, "v2": True}, where
            assert ck["nohook"] == {"ll_torch": True} and ck["repeatable"] == {"ll_torch": True, "v2": True}, where
            assert ck["graph"] == {} and ck["row_invariant"] is True, where  # batching changes no bit here
            assert ck["ll_vs_v2"]["error"] <= 1.0, where
            figs = c["runtimes"]
            assert figs["ll_torch"]["eager_ms"] > 0 and figs["ll_torch"]["nohook_ms"] > 0 and figs["v2"]["eager_ms"] > 0
            assert figs["ll_torch"]["graph_ms"] is None and figs["v2"]["nohook_ms"] is None
            outs = {k: _bf16(v) for k, v in res["outputs"][f"{T}/{fmt}"].items()}
            assert outs["ll_torch"].shape == (T, moe.hidden) and torch.isfinite(outs["ll_torch"].float()).all()
            # recomputed here, one row at a time: the block's low-latency output, bit for bit
            assert ml.bitwise_equal(outs["ll_torch"], _token_by_token(moe, rank, T, fmt)), where
            assert ml.bitwise_equal(outs["ll_torch"], outs["ll_reference"])
            assert ml.bitwise_equal(outs["v2"], outs["v2_reference"])
            if T == 9:  # the two orders differ somewhere: the bitwise checks tell them apart
                assert ck["ll_vs_v2"]["differ"] > 0 and not ml.bitwise_equal(outs["ll_torch"], outs["v2_reference"])
    record = dec.summarize(cfg, results)
    assert record["ok"] and record["checks"]["graph"] is None and record["checks"]["ll_reference"] is True
    table = dec.render(record)
    assert "| 9 | 5 + 4 | fp8 | low-latency API, torch backend |" in table and "| 1 | 1 + 0 | bf16 | V2 API" in table
    assert "DIFFERENT" not in table and "(passed)" in table


@pytest.mark.parametrize("argv,match", [
    (["--dispatch", "fp16"], "dispatch"),
    (["--dispatch", "bf16,bf16"], "dispatch"),
    (["--tokens", "4,0"], "tokens"),
    (["--tokens", "x"], "tokens"),
    (["--experts", "36"], "num_experts"),
    (["--iters", "0"], "iters"),
    (["--world", "3"], "world=3"),
    (["--tokens", "20000"], "micro-batch"),
])
def test_decode_bad_arguments_refused(argv, match):
    args = dec.parser().parse_args(["--device", "cpu"] + argv)
    with pytest.raises(ValueError, match=match):
        dec.build_config(args)


def test_decode_command_line_of_mode_all():
    args = block._parser().parse_args(["--device", "cpu", "--tokens", "64", "--experts", "64", "--iters", "2",
                                       "--decode-tokens", "3", "--out", "d"])
    assert args.mode == "all"
    dargs = dec.parser().parse_args(block._decode_argv(args))
    cfg = dec.build_config(dargs)
    assert (cfg.tokens, cfg.moe.num_experts, cfg.iters, cfg.warmup, dargs.out) == ((3,), 64, 2, 1, "d")
    assert block._mode(["--mode=decode", "--tokens", "5"]) == "decode" and block._mode([]) == "all"
