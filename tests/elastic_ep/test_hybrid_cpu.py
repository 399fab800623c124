"""Hybrid mode (scale-out + scale-up) on the torch runtime over gloo, split into logical domains by
``ELASTIC_EP_NUM_SCALEUP_RANKS``, checked against direct mode on the same routing and the oracle.

* The mode matrix (bf16 / FP8 with both scale kinds, expand with alignment and zero padding, CPU sync
  on/off, cached, 0/1/2 biases, single and multiple reduction, deterministic) at R = 2 (1x2, which is
  direct mode, and 2x1) and R = 4 (2x2 and 4x1): canonical outputs bitwise equal to a direct-mode
  buffer's and to the oracle.
* A soak of 500 dispatch/combine rounds with random routing at 2x2: every output bitwise equal to
  direct mode's in its raw row order; the rows that crossed domains counted against the routing
  (a token crosses once per remote domain its experts live in, not once per rank).
* The forwarders' metadata (``token_metadata_at_forward``, ``channel_linked_list``) against the
  routing of every rank.
* A scale-out peer that never joins: ``TimeoutError`` naming the scale-out stage, the rank and the
  per-rank counts.
* Domains: the buffer's physical/logical sizes and indices, sizing from the hybrid layout, and the
  override refused on every rank when it does not divide the domain or asks for hybrid mode with
  ``allow_hybrid_mode=False``.
"""
import os

import pytest
import torch

from tests._dist import run_workers
from tests.elastic_ep._workers import matrix_worker

SMALL = dict(hidden=256, topk=4, experts=16, max_tokens=48, tokens=[40, 0, 48, 17])
BUFFERS = [dict(allow_multiple_reduction=True, deterministic=False),
           dict(allow_multiple_reduction=False, deterministic=True)]


@pytest.mark.parametrize("world,scaleup", [(2, 2), (2, 1), (4, 2), (4, 1)], ids=["1x2", "2x1", "2x2", "4x1"])
def test_hybrid_matrix_matches_direct_and_oracle(tmp_path, world, scaleup):
    cfg = dict(device="cpu", backend="torch", kind="cpu", shape=dict(SMALL), buffers=BUFFERS, seed=10 + world,
               compare_torch=True, num_scaleup_ranks=scaleup)
    done = run_workers(matrix_worker, world, cfg, tmp_path=tmp_path, timeout=400)
    assert done == [len(BUFFERS) * 12] * world


# ------------------------------------------------------------------------------------------ soak
def _soak_worker(rank, world, rdzv, cfg):
    import torch.distributed as dist

    from tests._dist import init_gloo
    from tests.elastic_ep._common import bytes_of, import_elastic_ep, make_inputs, scaleup_override

    ep = import_elastic_ep()
    group = init_gloo(rank, world, rdzv)
    U, H, K, E, M = cfg["scaleup"], 128, 6, 32, 24
    L = E // world
    kw = dict(num_max_tokens_per_rank=M, hidden=H, num_topk=K, use_fp8_dispatch=True, backend="torch")
    with scaleup_override(U):
        hyb = ep.ElasticBuffer(group, **kw)
    direct = ep.ElasticBuffer(group, **kw)
    assert hyb.get_logical_domain_size() == (world // U, U) and direct.get_logical_domain_size() == (1, world)
    g = torch.Generator().manual_seed(77 + rank)
    crossings = 0
    for it in range(cfg["iterations"]):
        T = int(torch.randint(0, M + 1, (1,), generator=g))
        dtype = ["bf16", "fp8", "fp8_ue8m0"][it % 3]
        inp = make_inputs(rank, T, H, K, E, dtype, seed=it, device="cpu", mask_prob=0.2)
        x = (inp["x"], inp["sf"]) if "sf" in inp else inp["x"]
        opts = dict(num_experts=E, expert_alignment=[1, 4, 16][it % 3], do_expand=it % 2 == 1,
                    do_cpu_sync=it % 5 != 0)
        outs = [b.dispatch(x, topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"], **opts)
                for b in (hyb, direct)]
        (hx, hi, hw, hh, _), (dx, di, dw, dh, _) = outs
        rows = _valid_rows(dh)  # without a CPU sync the rows past the real counts are unwritten
        for a, b, what in ((hx, dx, "recv_x"), (hi, di, "recv_topk_idx"), (hw, dw, "recv_topk_weights")):
            for ta, tb in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                if ta is None or tb is None:
                    assert ta is None and tb is None, f"iteration {it}: {what} None on one side"
                    continue
                assert ta.shape == tb.shape, f"iteration {it}: {what} shape {ta.shape} != direct mode's {tb.shape}"
                assert torch.equal(bytes_of(ta[rows]), bytes_of(tb[rows])), \
                    f"iteration {it}: {what} differs from direct mode"
        n = int(dh.psum_num_recv_tokens_per_scaleup_rank[-1])
        assert torch.equal(hh.recv_src_metadata[:n], dh.recv_src_metadata[:n]), \
            f"iteration {it}: handle.recv_src_metadata differs from direct mode"
        for f in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                  "num_unaligned_recv_tokens_per_expert", "dst_buffer_slot_idx"):
            assert torch.equal(getattr(hh, f), getattr(dh, f)), f"iteration {it}: handle.{f} differs from direct mode"
        # What crossed domains: one row per (token, remote domain holding one of its experts).
        dom = torch.where(inp["topk_idx"] >= 0, inp["topk_idx"] // (L * U), torch.full_like(inp["topk_idx"], -1))
        me_dom = rank // U
        want = sum(len({int(v) for v in row if v >= 0 and v != me_dom}) for row in dom.tolist())
        assert hyb.runtime.hybrid.last_scaleout_rows == want, \
            f"iteration {it}: {hyb.runtime.hybrid.last_scaleout_rows} rows crossed domains, expected {want}"
        crossings += want
        # combine (expert outputs: the received rows in bf16, scaled per rank so sums round)
        y_h = (hx[0] if isinstance(hx, tuple) else hx).to(torch.float32).mul(1 + rank / 8).to(torch.bfloat16)
        bias = torch.randn((T, H), generator=g).to(torch.bfloat16) if it % 4 == 0 else None
        w = hw * 2 if hw is not None else None
        hc = hyb.combine(y_h, hh, topk_weights=w, bias=bias)
        dc = direct.combine(y_h.clone(), dh, topk_weights=w, bias=bias)
        assert torch.equal(bytes_of(hc[0]), bytes_of(dc[0])), f"iteration {it}: combined_x differs from direct mode"
        assert torch.equal(bytes_of(hc[1]), bytes_of(dc[1])), f"iteration {it}: combined weights differ"
    hyb.destroy()
    direct.destroy()
    dist.destroy_process_group()
    return crossings


def _valid_rows(h) -> torch.Tensor:
    """The output rows a dispatch wrote: the received tokens, or each expert segment's real rows."""
    if not h.do_expand:
        return torch.arange(int(h.psum_num_recv_tokens_per_scaleup_rank[-1]))
    ends = h.psum_num_recv_tokens_per_expert.to(torch.int64)
    real = h.num_unaligned_recv_tokens_per_expert.to(torch.int64)
    return torch.cat([torch.arange(int(e - r), int(e)) for e, r in zip(ends, real)])


def test_hybrid_soak_500_random_rounds_bitwise_direct(tmp_path):
    crossed = run_workers(_soak_worker, 4, dict(scaleup=2, iterations=500), tmp_path=tmp_path, timeout=600)
    assert min(crossed) > 1000, crossed  # the soak did move rows across domains


# ------------------------------------------------------------------------------------------ forwarder metadata
def _forward_worker(rank, world, rdzv, cfg):
    import torch.distributed as dist

    from tests._dist import init_gloo
    from tests.elastic_ep._common import gather_inputs, import_elastic_ep, make_inputs, scaleup_override
    from tests.elastic_ep._workers import check_forward_metadata

    ep = import_elastic_ep()
    group = init_gloo(rank, world, rdzv)
    U, H, K, E, M = cfg["scaleup"], 64, 4, 24, 20
    with scaleup_override(U):
        buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch")
    inp = make_inputs(rank, [20, 7, 0, 13, 20, 3][rank], H, K, E, "bf16", seed=3, device="cpu")
    everyone = gather_inputs(inp, group)
    _, _, _, handle, _ = buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"],
                                      num_experts=E)
    relayed = check_forward_metadata(handle, everyone, rank, world, U, E, M)
    linked = handle.channel_linked_list
    # The deterministic sort accepts the handle's own list (DeepEP's argument) and refuses another.
    with pytest.raises(ValueError, match="channel_linked_list"):
        handle.deterministic_sort(True, False, torch.zeros(0, H), None, None, None, linked.clone())
    buf.destroy()
    dist.destroy_process_group()
    return relayed


@pytest.mark.parametrize("world,scaleup", [(4, 2), (6, 3), (6, 2)], ids=["2x2", "2x3", "3x2"])
def test_hybrid_forward_metadata(tmp_path, world, scaleup):
    relayed = run_workers(_forward_worker, world, dict(scaleup=scaleup), tmp_path=tmp_path, timeout=120)
    assert sum(relayed) > 0


# ------------------------------------------------------------------------------------------ timeout
def _timeout_worker(rank, world, rdzv, cfg):
    import time

    from tests._dist import init_gloo
    from tests.elastic_ep._common import import_elastic_ep, make_inputs, scaleup_override

    ep = import_elastic_ep()
    group = init_gloo(rank, world, rdzv)
    with scaleup_override(2):
        buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=64, num_topk=2, backend="torch",
                               num_cpu_timeout_secs=2)
    if rank == world - 1:  # the scale-out peer that never answers
        time.sleep(6)
        return "absent"
    inp = make_inputs(rank, 8, 64, 2, 8, "bf16", seed=1, device="cpu")
    t0 = time.monotonic()
    try:
        buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"], num_experts=8)
    except TimeoutError as e:
        msg = str(e)
        assert "scale-out stage" in msg and f"rank {rank} of {world}" in msg, msg
        assert time.monotonic() - t0 < 5, "the timeout took too long"
        return "timeout"
    raise AssertionError("a dispatch without its scale-out peer did not time out")


@pytest.mark.fault
def test_hybrid_scaleout_peer_never_answers_times_out(tmp_path):
    got = run_workers(_timeout_worker, 4, {}, tmp_path=tmp_path, timeout=60)
    assert got == ["timeout"] * 3 + ["absent"]


# ------------------------------------------------------------------------------------------ domains
def _domains_worker(rank, world, rdzv, cfg):
    import torch.distributed as dist

    from tests._dist import init_gloo
    from tests.elastic_ep._common import import_elastic_ep, scaleup_override

    ep = import_elastic_ep()
    group = init_gloo(rank, world, rdzv)
    M, H, K = 64, 512, 4
    out = {}
    with scaleup_override(2):
        buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch")
        out["module_logical"] = ep.get_logical_domain_size(group)
        out["module_logical_direct"] = None
        try:
            ep.get_logical_domain_size(group, False)
        except ValueError as e:
            out["module_logical_direct"] = str(e)
        out["hint"] = ep.ElasticBuffer.get_buffer_size_hint(group, M, H, K)
    out.update(physical=buf.get_physical_domain_size(), logical=buf.get_logical_domain_size(),
               idx=(buf.scaleout_rank_idx, buf.scaleup_rank_idx), num_bytes=buf.num_bytes,
               module_physical=ep.get_physical_domain_size(group),
               hybrid_size=ep.calculate_elastic_buffer_size(world, M, H, K, num_nvl_ranks=2),
               direct_size=ep.calculate_elastic_buffer_size(world, M, H, K),
               qps=(buf.num_allocated_qps, buf.get_theoretical_num_qps(4)))
    buf.destroy()
    direct = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch")
    out["direct"] = (direct.get_logical_domain_size(), direct.num_bytes)
    direct.destroy()
    errors = []
    for n, hybrid_ok in ((3, True), (2, False), (0, True)):
        with scaleup_override(n):
            try:
                ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch",
                                 allow_hybrid_mode=hybrid_ok)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
    out["errors"] = errors
    dist.destroy_process_group()
    return out


def test_hybrid_domains_sizes_and_refusals(tmp_path):
    outs = run_workers(_domains_worker, 4, {}, tmp_path=tmp_path, timeout=120)
    for rank, o in enumerate(outs):
        assert o["physical"] == (1, 4) and o["module_physical"] == (1, 4)  # one host: one NVLink domain
        assert o["logical"] == (2, 2) and o["module_logical"] == (2, 2)
        assert "allow_hybrid_mode=False" in o["module_logical_direct"]
        assert o["idx"] == (rank // 2, rank % 2)
        # sized from DeepEP's hybrid layout (2 scale-out x 2 scale-up), which differs from direct mode's
        assert o["num_bytes"] == o["hybrid_size"] == o["hint"] and o["hybrid_size"] != o["direct_size"]
        assert o["direct"] == ((1, 4), o["direct_size"])
        assert o["qps"] == (129, 65)
        not_divisor, hybrid_off, zero = o["errors"]
        assert "ELASTIC_EP_NUM_SCALEUP_RANKS=3" in not_divisor and "divisor" in not_divisor
        assert "allow_hybrid_mode=False" in hybrid_off
        assert "ELASTIC_EP_NUM_SCALEUP_RANKS=0" in zero


def test_override_must_be_an_integer(monkeypatch):
    from tests.elastic_ep._common import import_elastic_ep

    import_elastic_ep()
    from elastic_ep import _env

    monkeypatch.setenv("ELASTIC_EP_NUM_SCALEUP_RANKS", "two")
    with pytest.raises(ValueError, match="ELASTIC_EP_NUM_SCALEUP_RANKS"):
        _env.Settings.read()
    assert os.environ["ELASTIC_EP_NUM_SCALEUP_RANKS"] == "two"
