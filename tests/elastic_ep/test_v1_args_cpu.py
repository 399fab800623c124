"""DeepEP V1's ``Buffer`` / ``Config`` API: signatures, the recommended configs and size hints (numbers
worked out by hand from DeepEP V1's formulas), what is refused (``ValueError`` naming the argument before
anything is sent; ``NotImplementedError`` for what is not available yet), and the buffer's token bound
(``get_max_tokens_per_rank``: a call of that many tokens runs, one more is refused with the bytes it needs,
and a buffer of those bytes runs it). CPU ranks, torch backend over gloo.
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_workers
from tests.elastic_ep._common import import_elastic_ep

ep = import_elastic_ep()

# DeepEP V1's signatures (commit 567632dd, deep_ep/buffer.py and the Config binding): (name, default).
V1_SIGNATURES = {
    "Buffer.__init__": [("group", None), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
                        ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True),
                        ("allow_mnnvl", False), ("explicitly_destroy", False), ("enable_shrink", False),
                        ("comm", None)],
    "Buffer.get_dispatch_layout": [("topk_idx", None), ("num_experts", None), ("previous_event", None),
                                   ("async_finish", False), ("allocate_on_comm_stream", False)],
    "Buffer.dispatch": [("x", None), ("handle", None), ("num_tokens_per_rank", None),
                        ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None),
                        ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
                        ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None), ("previous_event", None),
                        ("async_finish", False), ("allocate_on_comm_stream", False)],
    "Buffer.combine": [("x", None), ("handle", None), ("topk_weights", None), ("bias", None), ("config", None),
                       ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "Buffer.get_local_buffer_tensor": [("dtype", None), ("size", None), ("offset", 0), ("use_rdma_buffer", False)],
    "Buffer.get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", None), ("hidden", None),
                                              ("num_ranks", None), ("num_experts", None)],
    "Config.__init__": [("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6),
                        ("num_max_nvl_chunked_recv_tokens", 256), ("num_max_rdma_chunked_send_tokens", 6),
                        ("num_max_rdma_chunked_recv_tokens", 256)],
}


@pytest.mark.parametrize("name", sorted(V1_SIGNATURES))
def test_signature_is_deepep_v1s(name):
    cls, meth = name.split(".")
    params = [p for p in inspect.signature(getattr(getattr(ep, cls), meth)).parameters.values()
              if p.name != "self" and p.kind == p.POSITIONAL_OR_KEYWORD]
    got = [(p.name, None if p.default is p.empty else p.default) for p in params]
    assert got == V1_SIGNATURES[name]


def test_static_methods_and_class_attributes():
    assert ep.Buffer.num_sms == 20
    for name in ("set_num_sms", "capture", "get_dispatch_config", "get_combine_config", "is_sm90_compiled",
                 "get_low_latency_rdma_size_hint"):
        assert isinstance(inspect.getattr_static(ep.Buffer, name), staticmethod), name
    assert isinstance(ep.Buffer.capture(), ep.EventOverlap)


def test_recommended_configs_are_deepep_v1s():
    c = ep.Buffer.get_dispatch_config(8)
    # (20, 6, 256, 6, 128): the RDMA ring rounded up to a multiple of its chunk, 132
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (20, 6, 256, 6, 132)
    c = ep.Buffer.get_combine_config(2)
    assert (c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (10, 256)
    assert ep.Buffer.get_dispatch_config(16).num_max_nvl_chunked_send_tokens == 36
    assert ep.Buffer.get_combine_config(160).num_max_nvl_chunked_send_tokens == 2
    try:
        ep.Buffer.set_num_sms(24)
        assert ep.Buffer.get_dispatch_config(4).num_sms == 24 and ep.Buffer.num_sms == 24
    finally:
        ep.Buffer.set_num_sms(20)
    with pytest.raises(ValueError, match="new_num_sms"):
        ep.Buffer.set_num_sms(21)
    with pytest.raises(ValueError, match="num_ranks"):
        ep.Buffer.get_dispatch_config(3)
    with pytest.raises(ValueError, match="num_ranks"):
        ep.Buffer.get_combine_config(1)


def test_config_hints_and_checks():
    c = ep.Config(20, 6, 256)
    # 10 channels x 8 ranks: (2 x 1 + 3) int32 heads = 1600 B, plus 20480 slots x (14336 row + 8 source record
    # + 128 x (8 + 4) top-k + 128 x 4 scales = 16392 B) = 335708160 B; 335709760 B rounded up to 128.
    assert c.get_nvl_buffer_size_hint(7168 * 2, 8) == 335709824
    assert c.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    # 16 ranks (2 nodes): 10 channels x 2 RDMA ranks x 18 x 2 int32 = 2880 B, 10 x 2 x 258 x 2 slots x
    # (14336 + 8 + 1536 + 512 + 16 B) = 169330560 B, plus 1 MiB: 170382016 B, rounded up to 128.
    assert c.get_rdma_buffer_size_hint(7168 * 2, 16) == 170382080
    for args, name in [((-2,), "num_sms"), ((20, 6, 6), "num_max_nvl_chunked_send_tokens"),
                       ((20, 0, 256), "num_max_nvl_chunked_send_tokens"),
                       ((20, 6, 256, 8, 8), "num_max_rdma_chunked_send_tokens"), ((20.5,), "num_sms")]:
        with pytest.raises(ValueError, match=name):
            ep.Config(*args)
    with pytest.raises(ValueError, match="num_ranks"):
        c.get_nvl_buffer_size_hint(1024, 12)
    # Two halves of [E * M messages of align16(16 + 2 H) B, 4 KiB-aligned | M x 32 lanes x 2 H B], each
    # rounded up to 2 MiB: 256 * 128 * 14352 = 470286336 (4 KiB-aligned) + 128 * 32 * 14336 = 58720256
    # -> 529006592 -> 253 x 2 MiB = 530579456, twice.
    assert ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) == 2 * 530579456
    with pytest.raises(ValueError, match="num_experts"):
        ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 3, 256)


# Positional arguments each low-latency method needs before it can tell that the mode is off.
_LL_ARGS = {"low_latency_dispatch": 4, "low_latency_combine": 4, "clean_low_latency_buffer": 3,
            "get_next_low_latency_combine_buffer": 1, "low_latency_update_mask_buffer": 1,
            "low_latency_query_mask_buffer": 1}


# ------------------------------------------------------------------------------------------ one rank
def _inputs(T: int, H: int = 128, K: int = 4, E: int = 8):
    g = torch.Generator().manual_seed(T)
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty((0, K),
                                                                                                   dtype=torch.int64)
    return x, topk, torch.rand((T, K), generator=g)


def refusals_worker(rank: int, world: int, rdzv: str) -> int:
    from tests._dist import init_gloo

    group = init_gloo(rank, world, rdzv)
    checks = 0

    def refuses(exc, match, fn, *a, **kw):
        nonlocal checks
        with pytest.raises(exc, match=match):
            fn(*a, **kw)
        checks += 1

    B = ep.Buffer
    refuses(ValueError, "num_rdma_bytes: low-latency mode", B, group, 2 << 20, 0, True)
    refuses(ValueError, "enable_shrink=True.*low_latency_mode=True", B, group, 2 << 20, enable_shrink=True)
    refuses(ValueError, "num_rdma_bytes=1024.*not available yet", B, group, 2 << 20, 1024)
    refuses(ValueError, "num_nvl_bytes", B, group, 0)
    refuses(ValueError, "num_nvl_bytes", B, group, 2.5e6)
    refuses(ValueError, "comm", B, group, 2 << 20, comm=object())
    refuses(ValueError, "group", B, None, 2 << 20)
    # Every V1 argument positionally
    buf = B(group, 2 << 20, 0, False, 12, True, True, True, False, None)
    x, topk, w = _inputs(9)
    n_rank, n_rdma, n_exp, in_rank, ev = buf.get_dispatch_layout(topk, 8)
    assert n_rdma is None and ev.event is None
    layout = dict(num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_exp)
    refuses(ValueError, "num_experts", buf.get_dispatch_layout, topk, 0)
    refuses(ValueError, "topk_idx", buf.get_dispatch_layout, topk.float(), 8)
    refuses(ValueError, "allocate_on_comm_stream", buf.get_dispatch_layout, topk, 8, None, True, True)
    refuses(ValueError, "num_tokens_per_rank, is_token_in_rank", buf.dispatch, x, num_tokens_per_expert=n_exp)
    refuses(ValueError, "topk_idx / topk_weights", buf.dispatch, x, **layout, topk_idx=topk)
    refuses(ValueError, "num_worst_tokens", buf.dispatch, x, **layout, num_worst_tokens=64)
    refuses(ValueError, "num_worst_tokens", buf.dispatch, x, **layout, topk_idx=topk, topk_weights=w,
            num_worst_tokens=4)
    refuses(ValueError, "allocate_on_comm_stream", buf.dispatch, x, **layout, allocate_on_comm_stream=True)
    refuses(ValueError, "config", buf.dispatch, x, **layout, config=(20, 6, 256))
    refuses(ValueError, "is_token_in_rank", buf.dispatch, x, num_tokens_per_rank=n_rank,
            is_token_in_rank=in_rank[:3], num_tokens_per_expert=n_exp)
    refuses(ValueError, "expert_alignment", buf.dispatch, x, **layout, topk_idx=topk, topk_weights=w,
            expert_alignment=0)
    refuses(ValueError, "previous_event", buf.dispatch, x, **layout, previous_event=object())
    recv, ridx, rw, counts, handle, _ = buf.dispatch(x, **layout, topk_idx=topk, topk_weights=w)
    assert len(handle) == 6 and handle[1] is None and handle[2] is None and handle[5] is None
    refuses(ValueError, "must be None in cached mode", buf.dispatch, x, handle, topk_idx=topk, topk_weights=w)
    refuses(ValueError, "handle", buf.dispatch, x, handle=tuple(handle))
    refuses(ValueError, "handle", buf.combine, recv, tuple(handle))
    refuses(ValueError, "x", buf.combine, recv[:2], handle)
    refuses(ValueError, "topk_weights", buf.combine, recv, handle, torch.zeros((recv.shape[0], 33)))
    refuses(ValueError, "bias", buf.combine, recv, handle, bias=torch.zeros((3, 128), dtype=torch.bfloat16))
    refuses(ValueError, "use_rdma_buffer", buf.get_local_buffer_tensor, torch.float32, use_rdma_buffer=True)
    refuses(NotImplementedError, "torch backend", buf.get_local_buffer_tensor, torch.float32)
    for name in ("low_latency_dispatch", "low_latency_combine", "clean_low_latency_buffer",
                 "get_next_low_latency_combine_buffer", "low_latency_update_mask_buffer",
                 "low_latency_query_mask_buffer", "low_latency_clean_mask_buffer"):
        refuses(RuntimeError, "low-latency mode is off", getattr(buf, name), *[None] * _LL_ARGS.get(name, 0))
    refuses(NotImplementedError, "across NVLink domains", buf.internode_dispatch, x)
    other = B(group, 2 << 20)
    refuses(ValueError, "handle", other.dispatch, x, handle=handle)
    other.destroy()
    buf.destroy()
    buf.destroy()  # a second destroy does nothing
    assert buf.runtime is None
    refuses(RuntimeError, "destroyed", buf.dispatch, x, **layout)
    dist.destroy_process_group()
    return checks


def test_refusals_name_the_argument(tmp_path):
    assert run_workers(refusals_worker, 1, tmp_path=tmp_path, timeout=120) == [37]


def capacity_worker(rank: int, world: int, rdzv: str) -> list:
    """``get_max_tokens_per_rank`` tokens run; one more is refused (on every rank: each computes the same
    bound) naming ``num_nvl_bytes`` and the bytes a buffer needs for them, and a buffer of that many bytes
    runs them."""
    import re

    from tests._dist import init_gloo

    group = init_gloo(rank, world, rdzv)
    H, K = 128, 4

    def run(buf, n):
        n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(topk[:n], 8)
        to_each = in_rank.sum(0, dtype=torch.int64)
        dist.all_reduce(to_each, group=group)  # rows each rank receives
        recv = buf.dispatch(x[:n], num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=n_exp, topk_idx=topk[:n], topk_weights=w[:n])[0]
        assert recv.shape[0] == int(to_each[rank])
        return recv.shape[0]

    with ep.Buffer(group, 2 << 20) as buf:
        M = buf.get_max_tokens_per_rank(H, K)
        x, topk, w = _inputs(M + 1, H, K)
        run(buf, M)
        with pytest.raises(ValueError, match=r"num_nvl_bytes: .* hold \d+ tokens per rank") as e:
            run(buf, M + 1)
        need = int(re.search(r"num_nvl_bytes >= (\d+)", str(e.value)).group(1))
    with ep.Buffer(group, need) as big:
        assert big.get_max_tokens_per_rank(H, K) >= M + 1
        rows = run(big, M + 1)
    dist.destroy_process_group()
    return [M, need, rows]


def test_token_capacity_of_num_nvl_bytes(tmp_path):
    got = run_workers(capacity_worker, 2, tmp_path=tmp_path, timeout=120)
    (M, need, _), _ = got
    assert M > 0 and need > 2 << 20 and got[0][:2] == got[1][:2] and sum(g[2] for g in got) > 0


def split_refusal_worker(rank: int, world: int, rdzv: str) -> str:
    """One rank's bad argument makes every rank's constructor raise (none waits in a collective)."""
    from tests._dist import init_gloo

    group = init_gloo(rank, world, rdzv)
    with pytest.raises(ValueError) as e:
        ep.Buffer(group, 0 if rank == 1 else 2 << 20)
    dist.destroy_process_group()
    return str(e.value)


@pytest.mark.fault
def test_one_rank_refused_every_rank_raises(tmp_path):
    msgs = run_workers(split_refusal_worker, 2, tmp_path=tmp_path, timeout=120)
    assert "num_nvl_bytes" in msgs[1] and "rank 1" in msgs[0] and "num_nvl_bytes" in msgs[0]
