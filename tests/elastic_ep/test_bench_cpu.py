"""The metric formulas of tools/bench_elastic_ep.py against hand-computed numbers (issue 5, item 9:
"GB/s counted as DeepEP does (received bytes over kernel time), both including and excluding local
traffic")."""
import pytest

from tests._tools import load_tool


def test_token_and_case_bytes():
    b = load_tool("bench_elastic_ep")
    H, K = 7168, 8
    # DeepEP's count_bytes(recv_x, recv_topk_idx, recv_topk_weights) per token:
    # BF16 7168*2 + 8*8 (int64 ids) + 8*4 (fp32 weights) = 14336 + 64 + 32 = 14432
    assert b._token_bytes(H, K, fp8=False) == 14432
    # FP8 7168*1 + 56 fp32 scales (224) + 64 + 32 = 7488
    assert b._token_bytes(H, K, fp8=True) == 7488
    # rank 0 of the EP 2 record (17d5c98): it receives 4082 tokens from rank 1 and 4084 of its own,
    # and sends 4074 to rank 1 (and 4084 to itself)
    sent, recv = [4084, 4074], [4084, 4082]
    row, remote, total = b._case_bytes("dispatch_bf16", H, K, sent, recv, rank=0)
    assert (row, remote, total) == (14432, 4082 * 14432, 8166 * 14432)
    assert (remote, total) == (58911424, 117851712)  # the recorded bytes_remote / bytes_total of that rank
    assert b._case_bytes("dispatch_bf16_cached", H, K, sent, recv, 0) == (row, remote, total)
    assert b._case_bytes("dispatch_fp8_overlap_p49", H, K, sent, recv, 0) == (7488, 4082 * 7488, 8166 * 7488)
    # combine: a row of 7168*2 + 8*4 = 14368 bytes comes back for each (token, rank) this rank sent
    assert b._case_bytes("combine_bf16", H, K, sent, recv, 0) == (14368, 4074 * 14368, 8158 * 14368)
    assert b._case_bytes("combine_bf16", H, K, sent, recv, 0)[1:] == (58535232, 117214144)  # recorded
    # rank 1's view: local is its own index
    assert b._case_bytes("dispatch_bf16", H, K, [4082, 4081], [4074, 4081], 1)[1:] == (4074 * 14432, 8155 * 14432)


def test_bandwidths_hand_computed():
    b = load_tool("bench_elastic_ep")
    # rank 0, BF16 dispatch, EP 2 record: 58911424 B from the peer, 117851712 B in all; notify + push
    # 206.9 us (DeepEP's dispatch_impl), + epilogue 275.0 us, e2e 429.4 us
    bw = b._bandwidths(58911424, 117851712, 429.4, 275.0, 206.9)
    assert bw["comm_gbps_excl_local"] == pytest.approx(284.73, abs=0.01)   # 58911424 / 206.9e-6 / 1e9
    assert bw["comm_gbps_incl_local"] == pytest.approx(569.61, abs=0.01)
    assert bw["kernel_gbps_excl_local"] == pytest.approx(214.22, abs=0.01)
    assert bw["kernel_gbps_incl_local"] == pytest.approx(428.55, abs=0.01)
    assert bw["e2e_gbps_excl_local"] == pytest.approx(137.19, abs=0.01)
    assert bw["e2e_gbps_incl_local"] == pytest.approx(274.46, abs=0.01)
    none = b._bandwidths(1e6, 2e6, 100.0)
    assert none["e2e_gbps_excl_local"] == pytest.approx(10.0) and none["e2e_gbps_incl_local"] == pytest.approx(20.0)
    assert none["kernel_gbps_excl_local"] is None and none["comm_gbps_incl_local"] is None
    r = b._e2e_only_result("torch_ref", "combine_bf16", [100.0, 300.0, 200.0], 50e6, 100e6)
    assert r["comm_gbps_incl_local"] is None and r["e2e_gbps_excl_local"] == pytest.approx(250.0)


def test_kernel_time_is_the_union_of_kernel_intervals():
    b = load_tool("bench_elastic_ep")
    # sequential kernels: the union is the sum of their durations
    assert b._busy_us([(0, 14), (14, 21), (21, 56)], 1) == pytest.approx(56.0)
    # a CPU-synced dispatch: notify, push, then the host waits ~150 us before the epilogue: the span
    # counts the host's gap, the device time does not
    seq = [(0, 14), (14, 26), (176, 215)]
    assert b._span_us(seq, 1) == pytest.approx(215.0)
    assert b._busy_us(seq, 1) == pytest.approx(14 + 12 + 39)
    # overlapped push and epilogue count once; two iterations average
    two = [(0, 4), (4, 33), (10, 56), (1000, 1004), (1004, 1030), (1008, 1050)]
    assert b._busy_us(two, 2) == pytest.approx((56 + 50) / 2)
    assert b._busy_us([], 1) is None


def test_comm_time_counts_a_push_beside_notify_once():
    b = load_tool("bench_elastic_ep")
    # notify 0-16, the push launched beside it 2-17 (waiting for the slots until ~9), epilogue 17-52;
    # a second iteration 100 us later. DeepEP's dispatch_impl time is the union 0-17, not 16 + 15.
    recs = [("dispatch_notify<8>", 0, 16), ("dispatch_impl", 2, 17), ("dispatch_copy_epilogue_impl", 17, 52),
            ("dispatch_notify<8>", 100, 116), ("dispatch_impl", 102, 117),
            ("dispatch_copy_epilogue_impl", 117, 152), ("some_other_kernel", 0, 500)]
    comm, epi, per_kernel, span, busy = b._group_times(recs, 2)
    assert comm == pytest.approx(17.0) and epi == pytest.approx(35.0)
    assert per_kernel == pytest.approx({"dispatch_notify": 16.0, "dispatch_impl": 15.0, "dispatch_copy_epilogue": 35.0})
    assert span == pytest.approx(52.0) and busy == pytest.approx(52.0)
    # sequential kernels: the union is the sum, as before
    seq = [("dispatch_notify", 0, 16), ("dispatch_impl", 16, 24), ("dispatch_copy_epilogue_impl", 30, 65)]
    assert b._group_times(seq, 1)[:2] == pytest.approx((24.0, 35.0))


def test_agrs_pp_table_and_bandwidth():
    p2p = load_tool("_bench_ep_p2p")
    # 16 MiB gathered from 1 peer in 50 us: 16777216 / 50e-6 / 1e9 = 335.54 GB/s
    r = p2p._result("all_gather", "native", 16 << 20, 50.0, 16 << 20, True)
    assert r["gbps"] == pytest.approx(335.54, abs=0.01)
    n = p2p._result("all_gather", "nccl", 16 << 20, 80.0, 16 << 20, True)
    table = p2p.markdown([r, n])
    assert "| all_gather | 16 | 50.0 | 335.5 | 80.0 | 209.7 | yes |" in table
    assert p2p.markdown([]) == ""


def test_hybrid_bench_emulated_on_cpu(tmp_path):
    """``bench_elastic_ep.py --hybrid 2`` (CPU ranks, torch backend): hybrid outputs bitwise direct mode's,
    the table marked emulated, and hybrid dispatch crossing domains once per (token, remote domain): at
    2 x 2 with top-8 of 256 nearly every token reaches the other domain, so about one row per token
    against about two (its remote ranks) in direct mode."""
    import json
    import os
    import subprocess
    import sys

    from tests._tools import ROOT

    out = tmp_path / "out"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_elastic_ep.py"), "--out", str(out), "--hybrid", "2",
                    "--quick", "--tokens", "64", "--world", "4"], check=True, timeout=600)
    data = json.loads((out / "bench_elastic_ep_hybrid.json").read_text())
    assert data["meta"]["emulated"] and data["meta"]["bitwise_equal"] and data["meta"]["layout"] == "2x2"
    rows = {(t["op"], t["mode"].split(" ")[0]): t["scaleout_rows"] for t in data["table"]}
    assert 56 <= rows[("dispatch", "hybrid")] <= 64  # a token crosses at most once (64 tokens)
    assert rows[("dispatch", "direct")] > 1.5 * rows[("dispatch", "hybrid")]
    assert rows[("combine", "hybrid")] == rows[("combine", "direct")]  # partials forwarded unreduced
    assert rows[("combine", "deepep_per_domain_reduction")] == rows[("dispatch", "hybrid")]
    assert "EMULATED" in (out / "bench_elastic_ep_hybrid.md").read_text()


def test_decode_bench_table_and_plot(tmp_path):
    """tools/bench_elastic_ep_decode.py's table (kernel, DeepEP V1's send + recv split, in-graph, graph of
    one call, eager), its
    plot and outputs from rows of the shape its ranks return; without a GPU the command measures nothing
    and succeeds."""
    d = load_tool("bench_elastic_ep_decode")
    rows = [dict(api="ll", op="dispatch", experts=256, tokens=1, kernel_us=13.7, send_us=6.7, recv_us=8.1,
                 in_graph_us=14.2, graph_us=18.0, eager_us=90.4),
            dict(api="ll", op="combine", experts=256, tokens=1, kernel_us=12.5, send_us=7.5, recv_us=6.3,
                 graph_us=18.6, eager_us=80.9),
            dict(api="torch_ref", op="dispatch", experts=256, tokens=1, eager_us=608.2)]
    meta = dict(gpus=1, gpu_name="H100", date="2026-12-06 11:32 UTC", git="abc1234")
    table = d._table(rows, meta)
    assert "| 256 | 1 | ll | dispatch | 13.7 | 6.7 + 8.1 | 14.2 | 18.0 | 90.4 |" in table
    assert "| 256 | 1 | ll | combine | 12.5 | 7.5 + 6.3 | - | 18.6 | 80.9 |" in table
    assert "| 256 | 1 | torch_ref | dispatch | - | - | - | - | 608.2 |" in table
    out = tmp_path / "out"
    paths = d.write_results(str(out), "bench_elastic_ep_decode", dict(meta=meta, rows=rows), table, d._plot(rows))
    assert (out / "bench_elastic_ep_decode.md").read_text().startswith("Decode latency")
    assert any(p.endswith(".json") for p in paths)
    import torch

    if not torch.cuda.is_available():
        import sys

        argv, sys.argv = sys.argv, ["bench_elastic_ep_decode.py", "--out", str(tmp_path / "none")]
        try:
            assert d.main() == 0
        finally:
            sys.argv = argv
