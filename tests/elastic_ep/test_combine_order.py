"""combine gives DeepEP V2's bits: bitwise equality with DeepEP's summation order (``_deepep_order``).

For each seed: random routing (distinct experts, some masked lanes), a dispatch (expanded or not), the
combine input that DeepEP's own test builds from the handle (non-expanded: each rank's lane-ordered
fp32 partial; expanded: one row per local lane), 0, 1 or 2 biases, then ``combine`` compared bitwise
with ``combine_reference`` on every rank, for single and multiple reduction. The data have a wide
exponent range, so that a different summation order (biases last, partials by first lane, ...) changes
hundreds of elements per case (the order of the previous release failed every case with a bias).

* CPU (CI): the torch backend over gloo, DeepSeek-V3's hidden size / top-8 / 256 experts at 2 and 4
  ranks (partials in per-rank slots; with 4 ranks up to 4 partials per token, so the order matters
  without a bias too), and 4 ranks with top-2 (partials in master-lane slots), 20 seeds each.
* GPU: the native backend at EP 1 at the full DeepSeek-V3 shape (4096 tokens), and at EP 2 on the
  CUDA-IPC window (ranks may share one GPU), 20 seeds each; the overlapped combine too.
"""
import pytest

from tests._dist import run_workers

DSV3 = dict(hidden=7168, topk=8, experts=256)
SEEDS = 20


def order_worker(rank: int, world: int, rdzv: str, cfg: dict):
    import torch
    import torch.distributed as dist

    from tests._dist import init_gloo
    from tests.elastic_ep import _deepep_order as dref
    from tests.elastic_ep._common import check, import_elastic_ep, init_ep_group, make_inputs, raise_failures

    ep = import_elastic_ep()
    dev = cfg["device"]
    window = cfg.get("window", "auto")
    group = init_gloo(rank, world, rdzv) if dev == "cpu" else init_ep_group(rank, world, rdzv, window)
    H, K, E, M = cfg["hidden"], cfg["topk"], cfg["experts"], cfg["max_tokens"]
    tokens = cfg["tokens"][rank % len(cfg["tokens"])]
    done = 0
    for multi_red in (True, False):
        buf = ep.ElasticBuffer(group, backend=cfg["backend"], window=window, num_max_tokens_per_rank=M,
                               hidden=H, num_topk=K, allow_multiple_reduction=multi_red)
        for seed in range(cfg["seed0"], cfg["seed0"] + SEEDS):
            expand, num_bias = seed % 2 == 1, seed % 3
            inp = make_inputs(rank, tokens, H, K, E, "bf16", seed, dev, mask_prob=0.15)
            recv, recv_topk_idx, _, handle, ev = buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"],
                                                  num_experts=E, expert_alignment=128 if expand else 1,
                                                  do_expand=expand, do_cpu_sync=True)
            ev.current_stream_wait()
            x = dref.combine_inputs(handle, recv_topk_idx, handle.num_recv_tokens, H, recv.shape[0] if expand else None, seed, dev)
            bias = dref.biases(tokens, H, num_bias, rank, seed, dev)
            bias_arg = None if num_bias == 0 else (bias[0] if num_bias == 1 else tuple(bias))
            cx, _, cev = buf.combine(x, handle, bias=bias_arg)
            cev.current_stream_wait()
            gidx = rank * M + torch.arange(tokens, device=dev)
            y = dref.expert_outputs(gidx, inp["topk_idx"] >= 0, H, seed)
            exp = dref.combine_reference(y, inp["topk_idx"], world, E, bias_arg,
                                         reduce_in_local=not (expand and not multi_red))
            bad = (cx.view(torch.int16) != exp.view(torch.int16)).sum().item()
            check(bad == 0, f"rank {rank} seed {seed} expand={expand} bias={num_bias} multi_red={multi_red}: "
                            f"{bad} of {exp.numel()} elements differ from DeepEP's order")
            done += 1
        buf.destroy()
    dist.destroy_process_group()
    raise_failures(rank)
    return done


def _cfg(**kw):
    cfg = dict(DSV3, seed0=0)
    cfg.update(kw)
    return cfg


@pytest.mark.parametrize("world,topk", [(2, 8), (4, 8), (4, 2)],
                         ids=["ep2_top8_rank_slots", "ep4_top8_rank_slots", "ep4_top2_lane_slots"])
def test_combine_matches_deepep_order_torch_backend(tmp_path, world, topk):
    cfg = _cfg(device="cpu", backend="torch", topk=topk, max_tokens=48, tokens=[48, 0, 31, 17][:world])
    assert run_workers(order_worker, world, cfg, tmp_path=tmp_path, timeout=600) == [2 * SEEDS] * world


@pytest.mark.gpu
@pytest.mark.parametrize("env", [{}, {"ELASTIC_EP_COMBINE_OVERLAP": "1"}], ids=["two_kernels", "overlapped"])
def test_combine_matches_deepep_order_native_ep1(tmp_path, env):
    cfg = _cfg(device="cuda", backend="native", max_tokens=4096, tokens=[4096], seed0=100)
    assert run_workers(order_worker, 1, cfg, tmp_path=tmp_path, timeout=300, env=env) == [2 * SEEDS]


@pytest.mark.multigpu(2, shared_ok=True)
def test_combine_matches_deepep_order_native_ipc_window(tmp_path):
    cfg = _cfg(device="cuda", backend="native", window="ipc", max_tokens=1024, tokens=[1024, 777], seed0=200)
    assert run_workers(order_worker, 2, cfg, tmp_path=tmp_path, timeout=300) == [2 * SEEDS] * 2
