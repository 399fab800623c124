"""Arguments a user gets wrong, repeated expert ids, and bad ids on one rank only.

* Integer arguments of the constructor, ``dispatch`` and ``combine`` refuse floats, strings and bools
  by name before anything runs (a float reached the native parser only after the first kernels were
  queued, which left the buffer unusable), and numpy integers pass.
* A token that names the same expert twice gets one expanded row per lane, in every mode, equal to
  the independent oracle. Without a CPU sync the worst-case output must hold those rows: DeepEP V2's
  bound ``min(num_topk, num_local_experts)`` per token does not, and the epilogue wrote past the output.
* Bad expert ids on one rank only refuse the dispatch on every rank (the torch backend sent nothing
  about them to its peers before), and the next dispatch still pairs up and equals the oracle.

The torch backend runs them over gloo on the CPU; the GPU twins run the native kernels.
"""
import pytest

from tests._dist import run_workers

H, K, E_PER_RANK, M = 128, 4, 2, 16  # L = 2 < K: the case where repeated ids overflow DeepEP's bound


def _group(rank, world, rdzv, backend, window):
    from tests._dist import init_gloo
    from tests.elastic_ep._common import init_ep_group

    if backend == "torch":
        return init_gloo(rank, world, rdzv)
    return init_ep_group(rank, world, rdzv, window)


def arguments_worker(rank, world, rdzv):
    import numpy as np

    from tests.elastic_ep._common import import_elastic_ep, make_inputs, refusal_checker

    ep = import_elastic_ep()
    group = _group(rank, world, rdzv, "torch", "auto")
    seen = []
    bad = refusal_checker(seen)
    E = E_PER_RANK * world
    base = dict(num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch")

    def mk(**kw):
        return ep.ElasticBuffer(group, **{**base, **kw})

    bad("num_max_tokens_per_rank: expected an int >= 0, got 32.5", lambda: mk(num_max_tokens_per_rank=32.5))
    bad("num_max_tokens_per_rank: expected an int >= 0, got '32'", lambda: mk(num_max_tokens_per_rank="32"))
    bad("hidden: a row must be a multiple of 16 bytes", lambda: mk(hidden=100))
    bad("hidden: a row must be a multiple of 16 bytes", lambda: mk(hidden=136, use_fp8_dispatch=True))
    bad("num_topk: expected an int >= 0, got 2.5", lambda: mk(num_topk=2.5))
    bad("num_topk: expected an int >= 0, got True", lambda: mk(num_topk=True))
    bad("num_cpu_timeout_secs: expected a positive int, got 0.5", lambda: mk(num_cpu_timeout_secs=0.5))
    bad("num_gpu_timeout_secs: expected a positive int, got 0.5", lambda: mk(num_gpu_timeout_secs=0.5))
    bad("num_cpu_timeout_secs: expected a positive int, got None", lambda: mk(num_cpu_timeout_secs=None))
    bad("num_allocated_qps: expected an int >= 0, got -5", lambda: mk(num_allocated_qps=-5))
    bad("sl_idx: expected an int >= 0, got 'a'", lambda: mk(sl_idx="a"))
    bad("num_bytes: expected a positive int, got 2097152.0", lambda: mk(num_bytes=2.0 ** 21))

    buf = mk(num_max_tokens_per_rank=np.int64(M), num_cpu_timeout_secs=np.int32(60))  # numpy ints pass
    assert buf.num_max_tokens_per_rank == M and type(buf.num_max_tokens_per_rank) is int
    inp = make_inputs(rank, M, H, K, E, "bf16", 3, "cpu")
    x, idx, w = inp["x"], inp["topk_idx"], inp["topk_weights"]
    d = buf.dispatch
    bad("num_max_tokens_per_rank: expected a positive int, got 32.0",
        lambda: d(x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=32.0))
    bad("num_sms: expected an int >= 0, got True", lambda: d(x, topk_idx=idx, num_experts=E, num_sms=True))
    bad("expert_alignment: expected a positive int, got True",
        lambda: d(x, topk_idx=idx, num_experts=E, expert_alignment=True))
    bad("num_experts: expected a positive multiple", lambda: d(x, topk_idx=idx, num_experts=True))
    bad("num_qps: expected an int >= 0, got 'a'", lambda: d(x, topk_idx=idx, num_experts=E, num_qps="a"))
    recv, _, rw, h, _ = d(x, topk_idx=idx, topk_weights=w, num_experts=E, num_sms=np.int16(4))
    import dataclasses

    # a cached handle whose fields were replaced since the dispatch that made it
    short = dataclasses.replace(h, dst_buffer_slot_idx=h.dst_buffer_slot_idx[:-1])
    bad("handle.dst_buffer_slot_idx: expected an int32 tensor of shape", lambda: d(x, handle=short))
    wide = dataclasses.replace(h, num_unaligned_recv_tokens_per_expert=h.num_unaligned_recv_tokens_per_expert.long())
    bad("handle.num_unaligned_recv_tokens_per_expert: expected an int32 tensor", lambda: d(x, handle=wide))
    d(x, handle=h)  # the untouched handle still works
    bad("num_qps: expected an int >= 0, got 1.5", lambda: buf.combine(recv, h, num_qps=1.5))
    bad("num_sms: expected an int >= 0, got 'x'", lambda: buf.combine(recv, h, num_sms="x"))
    # more experts per token than experts (repeats) runs: the SM estimate must not refuse it
    many = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=2 * E, backend="torch")
    many.dispatch(x, topk_idx=idx.repeat(1, 2 * E // K), num_experts=E)
    many.destroy()
    buf.destroy()
    return len(seen)


def test_integer_arguments_are_checked_by_name(tmp_path):
    n = run_workers(arguments_worker, 2, tmp_path=tmp_path, timeout=120)
    assert n == [21, 21], n


def _repeating_inputs(rank, world, seed, dev):
    """Inputs whose top-k lanes repeat experts: drawn with replacement, every third token with all K
    lanes on one expert, some masked lanes. Repeated lanes of a token get equal weights (their rows
    are then indistinguishable, so the canonical form may pair them in any order)."""
    import torch

    from tests.elastic_ep._common import make_inputs

    E = E_PER_RANK * world
    # make_inputs draws distinct ids (needs K <= E); only its x is kept, the ids are redrawn below
    inp = make_inputs(rank, M, H, K, max(E, K), "bf16", seed, dev)
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
    E = E_PER_RANK * world
    cases = 0
    for multi_red in (True, False):
        buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend=backend,
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
                check(recv.shape[0] == (world * M * K + (align - 1) * E_PER_RANK + align - 1) // align * align,
                      f"worst-case rows {recv.shape[0]} {what}")
            orc = oracle_dispatch(all_inp, rank, E, M, align)
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


def one_rank_bad_ids_worker(rank, world, rdzv):
    import torch

    from tests.elastic_ep._common import (assert_same, canonical_dispatch, gather_inputs, import_elastic_ep,
                                          make_inputs, oracle_canonical, oracle_dispatch)

    ep = import_elastic_ep()
    group = _group(rank, world, rdzv, "torch", "auto")
    E = 4 * world
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


def test_bad_ids_on_one_rank_refuse_every_rank(tmp_path):
    res = run_workers(one_rank_bad_ids_worker, 2, tmp_path=tmp_path, timeout=120)
    for msg in res[0]:
        assert msg is not None and "expert ids must be in [-1, 8), got 1 outside it (e.g. 11)" in msg, msg
        assert "rank(s) [0]" in msg and "buffer stays usable" in msg, msg
    for msg in res[1]:
        assert msg is not None and msg.startswith("dispatch refused: rank(s) [0] passed top-k expert ids"), msg


def absent_destroy_worker(rank, world, rdzv):
    import time

    from tests.elastic_ep._common import import_elastic_ep

    ep = import_elastic_ep()
    group = _group(rank, world, rdzv, "torch", "auto")
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch",
                           num_cpu_timeout_secs=2)
    if rank != 0:
        time.sleep(8)  # never reaches destroy()
        return "idle"
    t0 = time.monotonic()
    try:
        buf.destroy()
    except TimeoutError as e:
        return str(e), time.monotonic() - t0
    return "no timeout", time.monotonic() - t0


def test_destroy_with_an_absent_peer_times_out_naming_it(tmp_path):
    """destroy() is collective: on a gloo group a peer that never comes makes it raise TimeoutError
    after num_cpu_timeout_secs, naming the peer, instead of waiting for the process group's timeout."""
    res = run_workers(absent_destroy_worker, 2, tmp_path=tmp_path, timeout=60)
    msg, dt = res[0]
    assert "barrier timed out on rank 0 of 2 after 2 s" in msg and "Rank 1 failed to pass" in msg, msg
    assert dt < 7, dt
    assert res[1] == "idle"
