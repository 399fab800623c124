"""fp8_layerwise's block (``tools/block_fp8_layerwise.py``) on the CPU: the prefill loop's schedule
with fakes, the timeline check, the routing and the experts' forward pass (``tools/_block_fp8_moe.py``)
against naive references, the report's formulas, argument checks, the loop end to end on the CPU
backend, and the plain command without a GPU (the streaming run, then the tiny prefill loop; what
tools/run.sh runs there) (~15 s each)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import fp8_layerwise as F

from tests._tools import ROOT, load_tool

B = load_tool("block_fp8_layerwise")
P = B.prefill
R = load_tool("_block_fp8_prefill_report")
import _block_fp8_moe as M  # noqa: E402 (tools/ is on sys.path once load_tool ran)


# ---- the schedule -------------------------------------------------------------------------------
class _Fake:
    """stream / submit of run_loop that log what happens; a ticket's compute 'ends' when waited."""

    def __init__(self):
        self.log, self.waited = [], set()

    def stream(self, layer):
        # The buffer of layer L was last read by layer L-2's compute: it must have been waited for;
        # layer L-1's compute must be in flight (submitted, not waited): that is the overlap.
        if layer >= 2:
            assert layer - 2 in self.waited, (layer, self.log)
        if layer >= 1:
            assert ("submit", layer - 1) in self.log and layer - 1 not in self.waited, (layer, self.log)
        self.log.append(("stream", layer))

    def submit(self, layer):
        assert ("stream", layer) in self.log, (layer, self.log)  # computed only once it arrived
        self.log.append(("submit", layer))
        fake = self

        class Ticket:
            def wait(self):
                if layer not in fake.waited:
                    fake.waited.add(layer)
                    fake.log.append(("wait", layer))
                return self

        return Ticket()


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_run_loop_streams_the_next_layer_while_one_computes(n):
    fake = _Fake()
    tickets, first = P.run_loop(n, fake.stream, fake.submit)
    assert len(tickets) == n and fake.waited == set(range(n))
    expected = [("stream", 0)]
    for layer in range(n):
        expected.append(("submit", layer))
        if layer + 1 < n:
            if layer >= 1:
                expected.append(("wait", layer - 1))
            expected.append(("stream", layer + 1))
    expected += [("wait", layer) for layer in range(max(0, n - 2), n)]
    assert fake.log == expected


def _ev(kind, layer, start, end):
    return dict(kind=kind, layer=layer, buffer=layer % 2, start_ms=start, end_ms=end)


def test_check_timeline():
    good = [_ev("transfer", 0, 0, 1), _ev("compute", 0, 1, 3), _ev("transfer", 1, 1, 2.5), _ev("compute", 1, 3, 5),
            _ev("transfer", 2, 3, 4), _ev("compute", 2, 5, 6)]
    assert P.check_timeline(good) == []
    assert P.overlap_ms(good) == pytest.approx(1.5 + 1.0)
    # Layer 2 streamed into buffer 0 while layer 0 still computed on it.
    early = [dict(e) for e in good]
    early[4].update(start_ms=2.5)
    bad = P.check_timeline(early)
    assert len(bad) == 1 and "layer 2 was streamed into buffer 0" in bad[0] and "layer 0's compute" in bad[0], bad
    assert P.check_timeline(early, tolerance_ms=0.6) == []
    # A compute that starts before its layer arrived; a compute on the other buffer; a layer never streamed.
    soon = [dict(e) for e in good]
    soon[3].update(start_ms=2.0)
    assert any("layer 1's compute started" in v for v in P.check_timeline(soon))
    other = [dict(e) for e in good]
    other[5]["buffer"] = 1
    assert any("computed on buffer 1" in v for v in P.check_timeline(other))
    assert any("never streamed" in v for v in P.check_timeline(good[1:]))


# ---- the layer's compute --------------------------------------------------------------------------
def test_balanced_routing():
    T, E, k = 96, 8, 3
    r = M.balanced_routing(T, E, k, seed=5)
    assert r.experts.shape == (T, k) and r.tokens_per_expert == T * k // E
    assert all(len(set(row.tolist())) == k for row in r.experts)          # distinct experts per token
    assert torch.bincount(r.experts.reshape(-1), minlength=E).tolist() == [T * k // E] * E
    assert torch.allclose(r.weights.sum(1), torch.ones(T))
    # Every (token, choice) pair appears once in the experts' rows, at gather_pos, with its weight.
    seen = set()
    for t in range(T):
        for j in range(k):
            e, c = divmod(int(r.gather_pos[t, j]), r.tokens_per_expert)
            assert e == int(r.experts[t, j]) and int(r.token_index[e, c]) == t
            assert float(r.expert_weight[e, c]) == float(r.weights[t, j].to(torch.bfloat16))
            seen.add((e, c))
    assert len(seen) == T * k
    assert torch.equal(M.balanced_routing(T, E, k, seed=5).token_index, r.token_index)
    with pytest.raises(ValueError, match="tokens .* multiple of num_experts"):
        M.balanced_routing(100, 8, 2, seed=0)
    with pytest.raises(ValueError, match="top_k"):
        M.balanced_routing(96, 8, 9, seed=0)


def test_layer_sources_are_finite_fp8_in_the_package_layout():
    E, H, I = 2, 256, 384
    src = M.make_layer_sources(E, H, I, seed=3)
    ref = F.make_block_fp8_sources(E, H, I)
    assert [(t.shape, t.dtype) for t in src] == [(t.shape, t.dtype) for t in ref]
    for w in (src[0], src[2]):
        v = w.view(torch.float8_e4m3fn).float()
        assert torch.isfinite(v).all() and v.abs().max() <= 1.875 and v.abs().max() > 1
    assert all(torch.equal(a, b) for a, b in zip(src, M.make_layer_sources(E, H, I, seed=3)))
    assert not torch.equal(src[0], M.make_layer_sources(E, H, I, seed=4)[0])
    F.make_shard_writer(src, 3)  # the native writer takes them (I/3 = 128)


def test_dequantize_is_the_blockwise_product():
    w13, w13s, _, _ = M.make_layer_sources(2, 256, 128, seed=1)
    want = (w13.view(torch.float8_e4m3fn).float()
            * w13s.to(torch.bfloat16).float().repeat_interleave(128, 1).repeat_interleave(128, 2)).to(torch.bfloat16)
    got = M.dequantize(w13, w13s)
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_moe_forward_matches_a_per_token_reference():
    # One rank's shard (TP 2, rank 1) as the transport delivers it, against a float64 loop over tokens.
    E, H, I, tp, rank, T, k = 4, 256, 256, 2, 1, 32, 2
    src = M.make_layer_sources(E, H, I, seed=11)
    shards = [F.reference_shard(src, tp, rank, e) for e in range(E)]
    buffers = [torch.cat([sh[kind] for sh in shards]) for kind in range(4)]
    s = I // tp
    w13, w13s, w2, w2s = M.shard_views(buffers, E, H, s)
    r = M.balanced_routing(T, E, k, seed=2)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = M.moe_forward(x, r, w13, w13s, w2, w2s)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16
    # Independent reference: the rank's rows/columns cut from the whole layer, dequantised in float64.
    deq = lambda w, sc: (w.view(torch.float8_e4m3fn).double()  # noqa: E731
                         * sc.double().repeat_interleave(128, 0).repeat_interleave(128, 1))
    W13 = [deq(src[0][e], src[1][e]) for e in range(E)]
    W2 = [deq(src[2][e], src[3][e])[:, rank * s:(rank + 1) * s] for e in range(E)]
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(r.experts[t, j])
            gate, up = W13[e][rank * s:(rank + 1) * s], W13[e][I + rank * s:I + (rank + 1) * s]
            xt = x[t].double()
            a = torch.nn.functional.silu(gate @ xt) * (up @ xt)
            want[t] += float(r.weights[t, j]) * (W2[e] @ a)
    err = (out.double() - want).abs().max() / want.abs().max()
    assert err < 0.03, float(err)
    # Bitwise reproducible: the same call gives the same bits.
    assert M.bitwise_equal(out, M.moe_forward(x, r, w13, w13s, w2, w2s))


# ---- the report ---------------------------------------------------------------------------------
def _rank(compute, transfer, loops, exact=True, equal=True, violations=()):
    n = len(compute)
    return dict(rank=0, device=0, backend="cuda", expert_nbytes=[1, 1, 1, 1], warm_exact=[True], end_exact={n - 1: True},
                alone=[dict(layer=i, compute_ms=c, transfer_ms=t, exact=exact, reproducible=True)
                       for i, (c, t) in enumerate(zip(compute, transfer))],
                loops=[dict(loop_ms=ms, fill_ms=1.0, compute_ms=cl, transfer_ms=[1.0] * n, outputs_equal=[equal] * n,
                            overlap_ms=0.0, violations=list(violations), events=[]) for ms, cl in loops])


def test_summary_and_goals_hand_computed():
    # Layers: max(4, 3) + max(2, 5) + max(6, 6) = 15 ms; the median of the loop runs (15.6 ms) is judged.
    res = _rank([4, 2, 6], [3, 5, 6], [(9.0, [4, 2, 6]), (17.0, [4.4, 2.2, 6.6]), (15.0, [4, 2, 6]),
                                       (15.6, [4.2, 2.2, 6.3])])
    res["loops"][0]["warmup"] = True  # never the one judged
    assert R.layer_bound_ms([res]) == [4, 5, 6]
    s = R.summarize_rank(res, 15.0)
    assert s["run"] == 3 and s["loop_ms"] == 15.6 and s["loop_ratio"] == pytest.approx(1.04)
    assert s["slowdown"] == pytest.approx(12.7 / 12 - 1) and s["serial_ms"] == 26
    cfg = dict(tp=1, layers=3, experts=1, tokens=128, top_k=1, hidden=128, intermediate=128)
    lines, table, record, ok = R.report(cfg, [res], ndev=1)
    assert ok and record["goals_judged"] and record["goals_met"] == dict(loop=True, slowdown=False)
    assert record["summary"][0]["loop_goal"] == "met" and record["summary"][0]["slowdown_goal"] == "MISSED"
    assert "| 1 | 2.00 | 5.00 | 5.00 | 2.20 | 1.00 | exact | equal |" in table
    # Two ranks on one GPU: nothing judged; a second rank's slower transfer sets the bound of its layer.
    slow = _rank([4, 2, 6], [3, 9, 6], [(15.0, [4, 2, 6])])
    slow["rank"] = 1
    assert R.layer_bound_ms([res, slow]) == [4, 9, 6]
    _, _, record, ok = R.report(dict(cfg, tp=2), [res, slow], ndev=1)
    assert ok and record["ranks_share_gpus"] and not record["goals_judged"]
    assert record["goals_met"] == dict(loop=None, slowdown=None) and record["summary"][1]["loop_goal"] == "not judged"


@pytest.mark.parametrize("broken", [dict(exact=False), dict(equal=False), dict(violations=["layer 2 was streamed"])])
def test_report_fails_when_a_check_fails(broken):
    res = _rank([4, 2], [3, 5], [(9.0, [4, 2])], **broken)
    lines, _, record, ok = R.report(dict(tp=1, layers=2, experts=1, tokens=128, top_k=1, hidden=128,
                                         intermediate=128), [res], ndev=1)
    assert not ok and not record["ok"]
    text = "\n".join(lines)
    assert ("MISMATCH" in text) or ("DIFFER" in text) or ("VIOLATED" in text), text


@pytest.mark.parametrize("argv,msg", [
    (["--tokens", "65", "--experts", "4"], "--tokens (65) must be a multiple of --experts (4)"),
    (["--top-k", "5", "--experts", "4"], "--top-k (5) must be at most --experts (4)"),
    (["--intermediate", "200"], "--hidden / --intermediate / --tp"),
    (["--tp", "9"], "--tp must be at most 8"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--slots", "1"], "--slots must be in 2.."),
])
def test_bad_arguments_are_refused_before_launch(argv, msg, capsys):
    with pytest.raises(SystemExit) as exc:
        P.main(["--backend", "cpu"] + argv)
    assert exc.value.code == 2
    assert msg in capsys.readouterr().err


# ---- end to end on the CPU backend ---------------------------------------------------------------
def _run_block(args, tmp_path, timeout=240):
    pytest.importorskip("fp8_layerwise._C", reason="needs the built fp8_layerwise package")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "block_fp8_layerwise.py")] + args
                         + ["--out", str(tmp_path)], capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out.stdout


def _check_prefill_record(path, tp, layers):
    data = json.loads(open(path).read())
    assert data["ok"] and data["backend"] == "cpu" and not data["goals_judged"]
    assert len(data["ranks"]) == tp
    for rank in data["ranks"]:
        assert rank["warm_exact"] == [True] * min(2, layers) and all(rank["end_exact"].values())
        assert [a["exact"] for a in rank["alone"]] == [True] * layers
        assert all(a["compute_ms"] > 0 and a["transfer_ms"] > 0 and a["bytes"] > 0 for a in rank["alone"])
        for loop in rank["loops"]:
            assert loop["outputs_equal"] == [True] * layers and loop["violations"] == []
            kinds = sorted((e["kind"], e["layer"]) for e in loop["events"])
            assert kinds == sorted([("compute", i) for i in range(layers)] + [("transfer", i) for i in range(layers)])
    return data


def test_prefill_loop_on_the_cpu_backend(tmp_path):
    stdout = _run_block(["--prefill", "--backend", "cpu", "--layers", "5", "--repeat", "2"], tmp_path)
    assert "prefill OK" in stdout and "timeline double-buffered" in stdout, stdout
    data = _check_prefill_record(tmp_path / "prefill.json", tp=2, layers=5)
    loops = data["ranks"][0]["loops"]
    assert data["config"]["layers"] == 5 and [lp["warmup"] for lp in loops] == [True, False, False]
    assert "| 4 |" in (tmp_path / "prefill.md").read_text()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "prefill.png").stat().st_size > 0


def test_block_without_a_gpu_explains_then_runs_both(tmp_path):
    if not B.no_gpu_reason():
        pytest.skip("a GPU is usable here: the plain block runs the prefill loop (tests/fp8_layerwise/test_block_gpu.py)")
    stdout = _run_block(["--layers", "2", "--experts", "4"], tmp_path)
    assert "no usable GPU here" in stdout and "demo OK" in stdout and "steady state per rank" in stdout, stdout
    assert stdout.index("demo OK") < stdout.index("prefill OK"), stdout
    for name in ("demo.md", "demo.json", "prefill.md", "prefill.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert json.loads((tmp_path / "demo.json").read_text())["args"]["layers"] == 2  # the arguments went to the stream run
    _check_prefill_record(tmp_path / "prefill.json", tp=2, layers=P.CPU_DEFAULTS["layers"])
    assert os.path.exists(tmp_path / "prefill.md")
