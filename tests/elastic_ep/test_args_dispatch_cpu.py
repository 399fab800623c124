"""``dispatch``'s inputs at their edges: every bad one raises ValueError naming the argument before
anything launches, and the buffer stays usable after it; repeated expert ids are accepted.

* Tensors (dtype, shape, layout, device, contiguity, FP8 scales), the routing (``num_experts``,
  ``expert_alignment``, ``num_max_tokens_per_rank`` against the buffer's size), events, cached handles
  (another routing, fields replaced since the dispatch that made them).
* Integers refuse floats, strings and bools by name (a float reached the native parser only after the
  first kernels were queued, which left the buffer unusable) and values past the native types (an
  expert alignment of 2**31 wrapped in the int32 offsets, num_experts=2**31 hung the torch backend);
  numpy integers pass.
* Expert ids outside ``[-1, num_experts)`` on one rank only refuse the dispatch on every rank (the torch
  backend sent nothing about them to its peers before), and the next dispatch pairs up and equals the
  oracle. Without a CPU sync (native) the next call reports them.
* A token that names the same expert twice gets one expanded row per lane, in every mode, equal to the
  independent oracle. Without a CPU sync the worst-case output must hold those rows: DeepEP V2's bound
  ``min(num_topk, num_local_experts)`` per token does not, and the epilogue wrote past the output.

The torch backend runs them over gloo on the CPU; the GPU twins run the native kernels.
"""
import pytest

from tests._dist import run_workers


def _group(rank, world, rdzv, backend, window="auto"):
    from tests._dist import init_gloo
    from tests.elastic_ep._common import init_ep_group

    if backend == "torch":
        return init_gloo(rank, world, rdzv)
    return init_ep_group(rank, world, rdzv, window)


def test_event_hook_must_be_callable():
    from tests.elastic_ep._common import import_elastic_ep

    e = import_elastic_ep().EventOverlap()
    with pytest.raises(ValueError, match="hook_after_wait: expected a callable"):
        e.register_hook_after_wait(5)
    e.current_stream_wait()  # nothing was registered


# ------------------------------------------------------------------ refusals
def _refuse_tensors_and_routing(buf, rank, world, dev, bad):
    """Tensors, routing, events and cached handles (H=256, K=4, E=8, M=32); returns ``(x, topk_idx)``."""
    import torch

    from elastic_ep import _C
    from tests.elastic_ep._common import make_inputs

    H, K, E, M = 256, 4, 8, 32
    inp = make_inputs(rank, 16, H, K, E, "bf16", 0, dev)
    x, idx, w = inp["x"], inp["topk_idx"], inp["topk_weights"]
    fp8 = make_inputs(rank, 16, H, K, E, "fp8", 0, dev)
    d = buf.dispatch
    bad("x: expected dtype", lambda: d(x.float(), topk_idx=idx, num_experts=E))
    bad("x: expected a 2-D", lambda: d(x.view(-1), topk_idx=idx, num_experts=E))
    bad("x: expected a contiguous", lambda: d(torch.cat([x, x], 1)[:, ::2], topk_idx=idx, num_experts=E))
    bad("x: a row must be a multiple of 16 bytes", lambda: d(x[:, :4].contiguous(), topk_idx=idx, num_experts=E))
    bad("FP8 rows need scales", lambda: d(fp8["x"], topk_idx=idx, num_experts=E))
    bad("sf: expected shape", lambda: d((fp8["x"], fp8["sf"][:3]), topk_idx=idx, num_experts=E))
    bad("sf: expected dtype", lambda: d((fp8["x"], fp8["sf"].double()), topk_idx=idx, num_experts=E))
    # More scale packs than the geometry words compare whole (the ranks' packs must be compared, not a residue).
    many = torch.ones((16, int(_C.MAX_SF_PACKS) + 1), dtype=torch.float32, device=dev)
    bad(f"sf: expected 1 to {int(_C.MAX_SF_PACKS)} scale packs", lambda: d((fp8["x"], many), topk_idx=idx,
                                                                           num_experts=E))
    bad("topk_idx: expected dtype", lambda: d(x, topk_idx=idx.short(), num_experts=E))  # int64 or int32
    bad("topk_idx: expected shape", lambda: d(x, topk_idx=idx[:5], num_experts=E))
    bad("topk_idx: required", lambda: d(x, num_experts=E))
    bad("expert ids must be in", lambda: d(x, topk_idx=torch.full_like(idx, E), num_experts=E))
    bad("expert ids must be in", lambda: d(x, topk_idx=torch.full_like(idx, -2), num_experts=E))
    bad("num_experts: expected a positive multiple",
        lambda: d(x, topk_idx=idx, num_experts=E + 1 if world > 1 else 0))
    bad("num_experts: required", lambda: d(x, topk_idx=idx))
    bad("topk_weights: expected dtype", lambda: d(x, topk_idx=idx, topk_weights=w.double(), num_experts=E))
    bad("topk_weights: expected shape", lambda: d(x, topk_idx=idx, topk_weights=w[:, :2].contiguous(), num_experts=E))
    bad("cumulative_local_expert_recv_stats: expected shape",
        lambda: d(x, topk_idx=idx, num_experts=E, cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int32)))
    if dev == "cuda":
        bad("x: expected a tensor on cuda", lambda: d(x.cpu(), topk_idx=idx, num_experts=E))
        bad("topk_idx: expected a tensor on cuda", lambda: d(x, topk_idx=idx.cpu(), num_experts=E))
    big = make_inputs(rank, M + 1, H, K, E, "bf16", 0, dev)
    bad("exceed num_max_tokens_per_rank", lambda: d(big["x"], topk_idx=big["topk_idx"], num_experts=E))
    # A per-call num_max_tokens_per_rank above the constructor's is allowed as long as the buffer holds
    # it (as in DeepEP); past that, the size check refuses it.
    bad("buffer too small", lambda: d(x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=M * 100000))
    bad("num_experts: expected a positive multiple", lambda: d(x, topk_idx=idx, num_experts=E + 0.5))
    bad("do_zero_padding: only valid", lambda: d(x, topk_idx=idx, num_experts=E, do_zero_padding=True))
    bad("expert_alignment: expected a positive", lambda: d(x, topk_idx=idx, num_experts=E, expert_alignment=0))
    bad("previous_event: requires allocate_on_comm_stream",
        lambda: d(x, topk_idx=idx, num_experts=E, previous_event=buf.capture()))
    # Widest row the buffer cannot hold: the native buffer rounds its size up (2 MiB at EP1), so a
    # fixed multiple of H may still fit there.
    wide_h = H
    while _C.get_dispatch_buffer_size(M, wide_h, 0, K, 2, 1, world, True) <= buf.num_bytes:
        wide_h *= 2
    wide = make_inputs(rank, 16, wide_h, K, E, "bf16", 0, dev)
    bad("buffer too small", lambda: d(wide["x"], topk_idx=wide["topk_idx"], num_experts=E))
    bad("num_sms: expected an int >= 0", lambda: d(x, topk_idx=idx, num_experts=E, num_sms=-1))

    recv, ridx, rw, h, _ = d(x, topk_idx=idx, topk_weights=w, num_experts=E)
    other = make_inputs(rank, 8, H, K, E, "bf16", 1, dev)
    bad("the cached handle routed", lambda: d(other["x"], handle=h))
    bad("do_expand: the cached handle", lambda: d(x, handle=h, do_expand=True))
    bad("num_experts: the cached handle", lambda: d(x, handle=h, num_experts=2 * E))
    bad("do_cpu_sync: cannot be True in cached mode", lambda: d(x, handle=h, do_cpu_sync=True))
    bad("handle: expected an EPHandle", lambda: d(x, handle=object()))
    # a valid call still works after all the rejected ones
    d(x, topk_idx=idx, num_experts=E)
    if dev == "cuda":
        # Without a CPU sync nothing checks the ids before the launch: notify masks them and the next
        # call reports how many, then the buffer carries on.
        wrong = idx.clone()
        wrong[0, 0], wrong[-1, -1] = E + 5, -7
        d(x, topk_idx=wrong, num_experts=E, do_cpu_sync=False)
        torch.cuda.synchronize()
        bad("an earlier dispatch without CPU sync had 2 expert ids outside", lambda: d(x, topk_idx=idx, num_experts=E))
    d(x, topk_idx=idx, num_experts=E)
    assert buf.get_logical_domain_size() == (1, world) and buf.get_physical_domain_size() == (1, world)
    return x, idx


def _refuse_integers(ep, group, rank, world, backend, dev, bad) -> None:
    """Integers of the wrong kind or past the native types (H=128, K=4, E=2 per rank, M=16); replaced
    fields of a cached handle."""
    import dataclasses
    import warnings

    import numpy as np
    import torch

    from tests.elastic_ep._common import make_inputs

    H, K, M = 128, 4, 16
    E = max(2 * world, K)  # make_inputs draws K distinct experts
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend=backend)
    inp = make_inputs(rank, M, H, K, E, "bf16", 3, dev)
    x, idx, w = inp["x"], inp["topk_idx"], inp["topk_weights"]
    d = buf.dispatch
    bad("num_max_tokens_per_rank: expected a positive int, got 32.0",
        lambda: d(x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=32.0))
    bad("num_sms: expected an int >= 0, got True", lambda: d(x, topk_idx=idx, num_experts=E, num_sms=True))
    bad("expert_alignment: expected a positive int, got True",
        lambda: d(x, topk_idx=idx, num_experts=E, expert_alignment=True))
    bad("num_experts: expected a positive multiple", lambda: d(x, topk_idx=idx, num_experts=True))
    bad("num_qps: expected an int >= 0, got 'a'", lambda: d(x, topk_idx=idx, num_experts=E, num_qps="a"))
    bad("num_experts: expected at most 2048", lambda: d(x, topk_idx=idx, num_experts=2 ** 64))
    bad("num_experts: expected at most 2048", lambda: d(x, topk_idx=idx, num_experts=4096))
    bad("expert_alignment: 2147483648", lambda: d(x, topk_idx=idx, num_experts=E, expert_alignment=2 ** 31))
    bad("expert_alignment: 18446744073709551616",
        lambda: d(x, topk_idx=idx, num_experts=E, expert_alignment=2 ** 64))
    bad("expert_alignment: 1099511627776",
        lambda: d(x, topk_idx=idx, num_experts=E, expert_alignment=2 ** 40, do_expand=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype API
        nested = torch.nested.nested_tensor([x])
    bad("x: expected a dense (strided) tensor, got a nested tensor", lambda: d(nested, topk_idx=idx, num_experts=E))
    _, _, _, h, _ = d(x, topk_idx=idx, topk_weights=w, num_experts=E, num_sms=np.int16(4))
    # a cached handle whose fields were replaced since the dispatch that made it
    short = dataclasses.replace(h, dst_buffer_slot_idx=h.dst_buffer_slot_idx[:-1])
    bad("handle.dst_buffer_slot_idx: expected an int32 tensor of shape", lambda: d(x, handle=short))
    wide = dataclasses.replace(h, num_unaligned_recv_tokens_per_expert=h.num_unaligned_recv_tokens_per_expert.long())
    bad("handle.num_unaligned_recv_tokens_per_expert: expected an int32 tensor", lambda: d(x, handle=wide))
    d(x, handle=h)  # the untouched handle still works
    # more experts per token than experts (repeats) runs: the SM estimate must not refuse it
    many = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=2 * E, backend=backend)
    many.dispatch(x, topk_idx=idx.repeat(1, 2 * E // K), num_experts=E)
    many.destroy()
    buf.destroy()


def refusal_worker(rank, world, rdzv, backend="torch"):
    from tests._dist import init_gloo, init_nccl
    from tests.elastic_ep._common import import_elastic_ep, refusal_checker

    ep = import_elastic_ep()
    dev = "cuda" if backend == "native" else "cpu"
    group = init_nccl(rank, world, rdzv) if dev == "cuda" else init_gloo(rank, world, rdzv)
    seen = []
    bad = refusal_checker(seen)
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=32, hidden=256, num_topk=4, backend=backend)
    x, idx = _refuse_tensors_and_routing(buf, rank, world, dev, bad)
    _refuse_integers(ep, group, rank, world, backend, dev, bad)
    with buf:
        pass
    try:
        buf.dispatch(x, topk_idx=idx, num_experts=8)
    except RuntimeError as e:
        assert "destroyed" in str(e)
    else:
        raise AssertionError("a destroyed buffer accepted a dispatch")
    return len(seen)


def test_dispatch_refuses_bad_inputs_before_launch(tmp_path):
    assert run_workers(refusal_worker, 2, tmp_path=tmp_path, timeout=120) == [44, 44]


@pytest.mark.smoke
@pytest.mark.gpu
def test_dispatch_refuses_bad_inputs_native_ep1(tmp_path):
    """The same checks on the native backend (one GPU, EP=1), then a valid dispatch still works."""
    assert run_workers(refusal_worker, 1, "native", tmp_path=tmp_path, timeout=180) == [47]


# ------------------------------------------------------------------ bad ids on one rank
def one_rank_bad_ids_worker(rank, world, rdzv):
    import torch

    from tests.elastic_ep._common import (assert_same, canonical_dispatch, gather_inputs, import_elastic_ep,
                                          make_inputs, oracle_canonical, oracle_dispatch)

    ep = import_elastic_ep()
    group = _group(rank, world, rdzv, "torch")
    H, K, M, E = 128, 4, 16, 4 * world
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch")
    out = []
    for seed in range(2):  # twice: the refusal leaves the buffer (and the group) in step
        inp = make_inputs(rank, M, H, K, E, "bf16", seed, "cpu")
        idx = inp["topk_idx"].clone()
        if rank == 0:
            idx[3, 1] = E + 3
        try:
            buf.dispatch(inp["x"], topk_idx=idx, num_experts=E)
        except ValueError as e:
            out.append(str(e))
        else:
            out.append(None)
        recv, ridx, rw, h, _ = buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"],
                                            num_experts=E)
        orc = oracle_dispatch(gather_inputs(inp, group), rank, E, M, 1)
        assert_same(oracle_canonical(orc, False, 1), canonical_dispatch(recv, ridx, rw, h, False), "after refusal")
    buf.destroy()
    assert torch.is_tensor(recv)
    return out


@pytest.mark.fault
def test_bad_ids_on_one_rank_refuse_every_rank(tmp_path):
    res = run_workers(one_rank_bad_ids_worker, 2, tmp_path=tmp_path, timeout=120)
    for msg in res[0]:
        assert msg is not None and "expert ids must be in [-1, 8), got 1 outside it (e.g. 11)" in msg, msg
        assert "rank(s) [0]" in msg and "buffer stays usable" in msg, msg
    for msg in res[1]:
        assert msg is not None and msg.startswith("dispatch refused: rank(s) [0] passed top-k expert ids"), msg


# ------------------------------------------------------------------ repeated expert ids
H_REP, K_REP, E_PER_RANK, M_REP = 128, 4, 2, 16  # L = 2 < K: the case where repeated ids overflow DeepEP's bound


def _repeating_inputs(rank, world, seed, dev):
    """Inputs whose top-k lanes repeat experts: drawn with replacement, every third token with all K
    lanes on one expert, some masked lanes. Repeated lanes of a token get equal weights (their rows
    are then indistinguishable, so the canonical form may pair them in any order)."""
    import torch

    from tests.elastic_ep._common import make_inputs

    E, K, M = E_PER_RANK * world, K_REP, M_REP
    # make_inputs draws distinct ids (needs K <= E); only its x is kept, the ids are redrawn below
    inp = make_inputs(rank, M, H_REP, K, max(E, K), "bf16", seed, dev)
    g = torch.Generator().manual_seed(seed * 31 + rank)
    idx = torch.randint(0, E, (M, K), generator=g)
    idx[::3] = idx[::3, :1]  # all K lanes on one expert
    idx[torch.rand((M, K), generator=g) < 0.1] = -1
    w = (idx.clamp(min=0).to(torch.float32) + 1) / 8 + torch.arange(M).view(-1, 1) / 64
    inp["topk_idx"], inp["topk_weights"] = idx.to(dev), w.to(dev)
    return inp


def repeated_ids_worker(rank, world, rdzv, backend, window):
    import torch

    from tests.elastic_ep._common import (FAILURES, assert_same, bytes_of, canonical_dispatch, check,
                                          fake_experts, gather_inputs, import_elastic_ep, oracle_canonical,
                                          oracle_combine, oracle_dispatch, raise_failures)

    ep = import_elastic_ep()
    group = _group(rank, world, rdzv, backend, window)
    kw = dict(window=window) if backend == "native" else {}
    dev = "cuda" if backend == "native" else "cpu"
    E, K = E_PER_RANK * world, K_REP
    cases = 0
    for multi_red in (True, False):
        buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=M_REP, hidden=H_REP, num_topk=K, backend=backend,
                               allow_multiple_reduction=multi_red, **kw)
        for seed, (expand, cpu_sync, align) in enumerate([(True, False, 1), (True, False, 4), (True, True, 4),
                                                          (False, False, 1), (False, True, 1)]):
            inp = _repeating_inputs(rank, world, seed, dev)
            all_inp = gather_inputs(inp, group)
            assert any(len(set(t)) < K for t in all_inp[rank]["topk_idx"].tolist()), "no repeated ids"
            recv, ridx, rw, h, ev = buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"],
                                                 num_experts=E, expert_alignment=align, do_expand=expand,
                                                 do_cpu_sync=cpu_sync)
            what = f"{backend}/{window} expand={expand} cpu_sync={cpu_sync} align={align} multi_red={multi_red}"
            if expand and not cpu_sync:
                # the worst case holds K rows per received token, whatever the repeats
                check(recv.shape[0] == (world * M_REP * K + (align - 1) * E_PER_RANK + align - 1) // align * align,
                      f"worst-case rows {recv.shape[0]} {what}")
            orc = oracle_dispatch(all_inp, rank, E, M_REP, align)
            assert_same(oracle_canonical(orc, expand, align), canonical_dispatch(recv, ridx, rw, h, False), what)
            y = fake_experts(recv, h, rank, E, world)
            cx, _, ev = buf.combine(y, h)
            exp = oracle_combine(all_inp, rank, E, expand, multi_red, [None])
            check(torch.equal(bytes_of(cx.cpu()), bytes_of(exp)), f"combine vs oracle {what}")
            cases += 1
        buf.destroy()
    raise_failures(rank)
    assert not FAILURES
    return cases


def test_repeated_expert_ids_torch_backend(tmp_path):
    assert run_workers(repeated_ids_worker, 2, "torch", "auto", tmp_path=tmp_path, timeout=180) == [10, 10]


@pytest.mark.gpu
def test_repeated_expert_ids_native_ep1(tmp_path):
    assert run_workers(repeated_ids_worker, 1, "native", "auto", tmp_path=tmp_path, timeout=180) == [10]


@pytest.mark.multigpu(2, shared_ok=True)  # the CUDA-IPC window: ranks may share a GPU
def test_repeated_expert_ids_native_ipc_window(tmp_path):
    assert run_workers(repeated_ids_worker, 2, "native", "ipc", tmp_path=tmp_path, timeout=240) == [10, 10]
