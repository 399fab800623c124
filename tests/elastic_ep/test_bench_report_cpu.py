"""The reporting half of tools/bench_elastic_ep.py (per-case statistics; tools/_bench_ep_report.py: cross-rank
summary, speed-ups, table, plot) on synthetic per-rank results, so a GPU run cannot be lost after the
measurements."""
import pytest

from tests._tools import load_tool


def _res(b, backend, case, sms, times, kernel=None):
    stats = b._e2e_stats(times)
    remote, total = 50e6, 100e6
    return dict(backend=backend, case=case, num_sms=sms, **stats, comm_kernel_us=kernel and kernel / 2,
                epilogue_us=kernel and kernel / 2, kernel_us=kernel, per_kernel_us={}, bytes_remote=remote,
                bytes_total=total, e2e_gbps_excl_local=remote / stats["e2e_us"] / 1e3,
                e2e_gbps_incl_local=total / stats["e2e_us"] / 1e3,
                kernel_gbps_excl_local=remote / kernel / 1e3 if kernel else None,
                kernel_gbps_incl_local=total / kernel / 1e3 if kernel else None,
                comm_gbps_excl_local=remote / (kernel / 2) / 1e3 if kernel else None)


def test_report_functions(tmp_path):
    b = load_tool("bench_elastic_ep")
    rep = load_tool("_bench_ep_report")
    s = b._e2e_stats([100.0, 110.0, 400.0])
    assert (s["e2e_us"], s["e2e_mean_us"], s["e2e_min_us"]) == (110.0, 610.0 / 3, 100.0)
    ranks = [{"results": [_res(b, "native", "dispatch_bf16", 0, [200.0, 210.0, 900.0], kernel=150.0),
                          _res(b, "native", "dispatch_bf16_cached", 0, [100.0], kernel=90.0),
                          _res(b, "torch_ref", "dispatch_bf16", 0, [400.0, 400.0, 400.0]),
                          _res(b, "torch", "dispatch_bf16", 0, [600.0, 630.0, 660.0]),
                          _res(b, "torch_a2a", "dispatch_bf16", 0, [100.0, 100.0, 100.0])]},
             {"results": [_res(b, "native", "dispatch_bf16", 0, [190.0, 190.0, 190.0], kernel=170.0),
                          _res(b, "native", "dispatch_bf16_cached", 0, [100.0], kernel=90.0),
                          _res(b, "torch_ref", "dispatch_bf16", 0, [400.0, 400.0, 400.0]),
                          _res(b, "torch", "dispatch_bf16", 0, [600.0, 600.0, 600.0]),
                          _res(b, "torch_a2a", "dispatch_bf16", 0, [120.0, 120.0, 120.0])]}]
    table = rep._summarise(ranks, {})
    native = next(t for t in table if t["backend"] == "native")
    # the torch reference path is the target's reference; the cached dispatch is read against its full
    # (uncached) dispatch
    assert native["speedup_vs_ref_e2e"] == pytest.approx(400.0 / 200.0)
    cached = next(t for t in table if t["case"] == "dispatch_bf16_cached")
    assert cached["speedup_vs_ref_e2e"] == pytest.approx(4.0)
    assert native["e2e_us"] == pytest.approx(200.0)  # mean over ranks of the per-rank medians 210 and 190
    assert native["kernel_us"] == pytest.approx(160.0)
    assert native["speedup_vs_torch_e2e"] == pytest.approx(615.0 / 200.0)
    assert native["speedup_vs_a2a_e2e"] == pytest.approx(110.0 / 200.0)
    meta = dict(date="d", gpus=2, gpu_name="synthetic", git="r", torch="t", nccl="n", tokens=4096)
    md = rep._markdown(table, meta)
    assert "| native | dispatch_bf16 | all | 160.0 | 80.0 | 80.0 | 200.0 |" in md
    assert "| 2.00 | 3.08 | 0.55 |" in md
    # The overlapped combine's cases are compared with the plain combine's references.
    ov = rep._summarise([{"results": [_res(b, "native", "combine_bf16_overlap_p49", 0, [100.0], kernel=90.0),
                                    _res(b, "torch", "combine_bf16", 0, [400.0]),
                                    _res(b, "torch_a2a", "combine_bf16", 0, [50.0])]}], {})
    t = next(t for t in ov if t["backend"] == "native")
    assert t["speedup_vs_torch_e2e"] == pytest.approx(4.0) and t["speedup_vs_a2a_e2e"] == pytest.approx(0.5)
    # A backend timed end to end only (the torch paths): GB/s from its median, no kernel figures.
    r = b._e2e_only_result("torch_ref", "dispatch_fp8", [100.0, 200.0, 300.0], 50e6, 100e6)
    assert (r["backend"], r["case"], r["num_sms"], r["e2e_us"]) == ("torch_ref", "dispatch_fp8", 0, 200.0)
    assert r["e2e_gbps_excl_local"] == pytest.approx(250.0) and r["e2e_gbps_incl_local"] == pytest.approx(500.0)
    assert r["kernel_us"] is None and r["kernel_gbps_excl_local"] is None
    # The span of overlapping kernels: per iteration, first start to last end.
    assert b._span_us([(0, 10), (5, 30), (100, 110), (104, 140)], 2) == pytest.approx((30 + 40) / 2)
    assert b._span_us([(0, 10)], 2) is None and b._span_us([], 1) is None
    pytest.importorskip("matplotlib")
    rep._plot(table, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0
