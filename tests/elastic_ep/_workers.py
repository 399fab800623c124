"""The elastic_ep tests' case matrix and the workers that run it: ``run_case`` (one dispatch, a cached
dispatch and a combine checked against the oracle of ``_common`` and, if given, a reference buffer),
``matrix_worker`` (the matrix over buffer options), ``soak_worker`` (random rounds), the hybrid
forwarder-metadata check, ``expect_timeout`` (a stage that must time out naming rank and peer) and
``calls_until_error`` (what a rank raises once a peer sent it a corrupted word).
"""
from __future__ import annotations

import sys
from typing import List

import torch
import torch.distributed as dist

from tests.elastic_ep._common import (assert_same, bytes_of, canonical_dispatch, check, fake_experts, gather_inputs,
                                      import_elastic_ep, init_ep_group, make_inputs, oracle_canonical, oracle_combine,
                                      oracle_dispatch, raise_failures, scaleup_override)


# ------------------------------------------------------------------------------------------ matrix
def case_matrix(kind: str) -> List[dict]:
    """Dispatch/combine cases; options that do not multiply are cycled through the product."""
    import itertools

    dtypes = ["bf16", "fp8", "fp8_ue8m0"]
    cases = []
    for i, (dtype, expand, cpu_sync) in enumerate(itertools.product(dtypes, [False, True], [True, False])):
        cases.append(dict(
            dtype=dtype, expand=expand, cpu_sync=cpu_sync,
            alignment=[1, 128, 4][i % 3] if expand else [1, 128][i % 2],
            zero_padding=expand and i % 2 == 0,
            num_bias=i % 3,
            cached=i % 2 == 1,
            tma_sf=dtype != "bf16" and i % 4 >= 2,
            sf_strided_input=dtype != "bf16" and i % 3 == 1,
            stream_opt=["sync", "async", "prev_event", "alloc_comm"][i % 4] if kind == "gpu" else ["sync", "async"][i % 2],
            handle_copy=i % 5 != 4,
            zero_copy=not expand and i % 3 != 2,
        ))
    return cases


def run_case(buf, ref, group, me: int, R: int, case: dict, shape: dict, seed: int, with_oracle: bool = True) -> None:
    """One dispatch (+ cached dispatch) + combine on ``buf`` checked against the oracle and, if given,
    against the same calls on the reference buffer ``ref`` (bitwise, canonical form)."""
    ep = sys.modules["elastic_ep"]
    dev = buf.device
    H, K, E, M = shape["hidden"], shape["topk"], shape["experts"], shape["max_tokens"]
    tokens = shape["tokens"](me) if callable(shape["tokens"]) else shape["tokens"]
    inp = make_inputs(me, tokens, H, K, E, case["dtype"], seed, dev)
    all_inp = gather_inputs(inp, group) if with_oracle else None
    L = E // R

    def do(b, handle=None):
        x = inp["x"]
        if "sf" in inp:
            sf = inp["sf"]
            if case["sf_strided_input"]:
                sf = sf.t().contiguous().t()  # column-major input scales
            x = (x, sf)
        stats = torch.zeros(L, dtype=torch.int32, device=dev)
        kw = dict(num_experts=E, expert_alignment=case["alignment"], do_expand=case["expand"],
                  do_zero_padding=case["zero_padding"], do_cpu_sync=case["cpu_sync"],
                  use_tma_aligned_col_major_sf=case["tma_sf"], do_handle_copy=case["handle_copy"],
                  cumulative_local_expert_recv_stats=stats, zero_copy=case.get("zero_copy", False))
        if handle is not None:
            kw = dict(handle=handle, do_expand=case["expand"], do_zero_padding=case["zero_padding"],
                      use_tma_aligned_col_major_sf=case["tma_sf"], zero_copy=case.get("zero_copy", False))
        opt = case["stream_opt"]
        if opt == "async":
            kw.update(async_with_compute_stream=True)
        elif opt == "prev_event":
            kw.update(previous_event=b.capture(), allocate_on_comm_stream=True, async_with_compute_stream=True)
        elif opt == "alloc_comm":
            kw.update(allocate_on_comm_stream=True, previous_event_before_epilogue=b.capture())
        out = b.dispatch(x, topk_idx=None if handle is not None else inp["topk_idx"],
                         topk_weights=inp["topk_weights"] if handle is None else inp["topk_weights"], **kw)
        if b.deterministic and kw.get("async_with_compute_stream") and out[4].event is not None:
            check(out[4].hook_after_wait is not None, f"deterministic async dispatch: the sort must run at the wait {case}")
        out[4].current_stream_wait()
        return out, stats

    (recv, ridx, rw, handle, _), stats = do(buf)
    if case["cpu_sync"]:
        n_alloc = handle.num_expanded_tokens if case["expand"] else handle.num_recv_tokens
        check((recv[0] if isinstance(recv, tuple) else recv).shape[0] == n_alloc, f"rows != {n_alloc} {case}")
    else:
        worst = R * M
        check(handle.num_recv_tokens == worst, f"worst case {handle.num_recv_tokens} != {worst} {case}")
        check(handle.num_recv_tokens_per_expert_list == [], f"per-expert list not empty without CPU sync {case}")
    if isinstance(recv, tuple) and case["tma_sf"]:
        n_alloc = recv[1].shape[0]
        check(recv[1].stride() == (1, (n_alloc + 3) // 4 * 4), f"sf strides {recv[1].stride()} {case}")
    canon = canonical_dispatch(recv, ridx, rw, handle, buf.deterministic)
    if case.get("zero_copy"):
        check(handle.views_serial == buf._dispatch_serial, f"zero-copy handle not marked {case}")
        if buf.backend == "native":  # a view of the receive buffer, not a copy
            x0 = recv[0] if isinstance(recv, tuple) else recv
            lo = int(buf.runtime._rt.buffer_ptr)
            check(lo <= x0.data_ptr() and x0.data_ptr() + x0.numel() * x0.element_size() <= lo + buf.num_bytes,
                  f"zero-copy recv_x is not inside the buffer {case}")
    if with_oracle:
        orc = oracle_dispatch(all_inp, me, E, M, case["alignment"])
        assert_same(oracle_canonical(orc, case["expand"], case["alignment"]), canon, f"oracle vs {buf.backend} {case}")
        check(stats.cpu().tolist() == orc["real"], f"stats {stats.cpu().tolist()} != {orc['real']} {case}")
        if case["cpu_sync"]:
            check(handle.num_recv_tokens_per_expert_list == orc["aligned"], f"per-expert list {case}")
    if case["zero_padding"]:
        x0 = recv[0] if isinstance(recv, tuple) else recv
        real = handle.num_unaligned_recv_tokens_per_expert.to(torch.int64).cpu()
        ends = handle.psum_num_recv_tokens_per_expert.to(torch.int64).cpu()
        a = case["alignment"]
        for e in range(L):
            pad_end = int(ends[e] - real[e]) + (int(real[e]) + a - 1) // a * a
            check(bool((x0[int(ends[e]):pad_end].to(torch.float32) == 0).all()), f"expert {e} padding not zero {case}")
    if ref is not None:
        (r_recv, r_idx, r_w, r_handle, _), _ = do(ref)
        assert_same(canonical_dispatch(r_recv, r_idx, r_w, r_handle, ref.deterministic), canon,
                    f"{ref.backend} vs {buf.backend} {case}")
    if case["cached"]:
        (c_recv, c_idx, c_w, c_handle, _), c_stats = do(buf, handle)
        check(c_handle is handle, "cached dispatch returned another handle")
        assert_same(canonical_dispatch(c_recv, c_idx, c_w, handle, buf.deterministic), canon, f"cached {case}")
        check(int(c_stats.abs().sum()) == 0, "cached mode must not touch the stats")

    # combine
    x0 = recv[0] if isinstance(recv, tuple) else recv
    y = fake_experts(x0, handle, me, E, R)
    w2 = rw * 2 if rw is not None else None
    g = torch.Generator().manual_seed(seed * 7 + me)
    biases = [torch.randn((tokens, H), generator=g).to(torch.bfloat16).to(dev) for _ in range(case["num_bias"])]
    bias = None if not biases else (biases[0] if len(biases) == 1 else tuple(biases))
    kw = {}
    if case["stream_opt"] == "async":
        kw = dict(async_with_compute_stream=True)
    elif case["stream_opt"] == "prev_event":
        kw = dict(previous_event=buf.capture(), allocate_on_comm_stream=True, async_with_compute_stream=True)
    cx, cw, ev = buf.combine(y, handle, topk_weights=w2, bias=bias, **kw)
    ev.current_stream_wait()
    check(cx.shape == (tokens, H) and cx.dtype == torch.bfloat16, f"combined shape {tuple(cx.shape)} {case}")
    if case.get("zero_copy"):  # the views outlive the combine
        assert_same(canonical_dispatch(recv, ridx, rw, handle, buf.deterministic), canon,
                    f"zero-copy views after combine {case}")
    if with_oracle:
        exp = oracle_combine(all_inp, me, E, case["expand"], buf.allow_multiple_reduction, biases + [None])
        check(torch.equal(bytes_of(cx.cpu()), bytes_of(exp)), f"combine vs oracle {case}")
        tk = all_inp[me]["topk_idx"]
        expw = torch.where(tk >= 0, all_inp[me]["topk_weights"] * 2, torch.zeros_like(all_inp[me]["topk_weights"]))
        check(cw is not None and torch.equal(bytes_of(cw.cpu()), bytes_of(expw)), f"combined weights vs oracle {case}")
    if ref is not None:
        ry = fake_experts(r_recv[0] if isinstance(r_recv, tuple) else r_recv, r_handle, me, E, R)
        rcx, rcw, rev = ref.combine(ry, r_handle, topk_weights=r_w * 2 if r_w is not None else None, bias=bias)
        rev.current_stream_wait()
        check(torch.equal(bytes_of(rcx.cpu()), bytes_of(cx.cpu())), f"combine {ref.backend} vs {buf.backend} {case}")
        check((rcw is None) == (cw is None), f"combined weights None in one backend only {case}")
        if rcw is not None and cw is not None:
            check(torch.equal(bytes_of(rcw.cpu()), bytes_of(cw.cpu())), f"combined weights {ref.backend} vs {buf.backend} {case}")


def matrix_worker(rank: int, world: int, rdzv: str, cfg: dict):
    """Runs ``case_matrix(cfg['kind'])`` for each buffer option set in ``cfg['buffers']``.

    ``cfg['window'] == 'ipc'``: the native buffer on its CUDA-IPC window, over a gloo group when the
    ranks share a GPU (then only the oracle can check it: the torch backend needs NCCL for GPU tensors).
    ``cfg['compare_torch']``: a torch-backend reference buffer; ``cfg['compare_direct']``: a direct-mode
    buffer of the same backend and window (for ``cfg['num_scaleup_ranks']``, hybrid mode's reference).
    ``cfg['cases']``: the cases (default ``case_matrix(cfg['kind'])``).
    """
    from tests._dist import init_gloo

    ep = import_elastic_ep()
    window = cfg.get("window", "auto")
    group = init_ep_group(rank, world, rdzv, window) if cfg["device"] == "cuda" else init_gloo(rank, world, rdzv)
    shape = dict(cfg["shape"])
    tok = shape["tokens"]
    if isinstance(tok, list):
        shape["tokens"] = tok[rank % len(tok)]
    done = 0
    for bopts in cfg["buffers"]:
        kw = dict(num_max_tokens_per_rank=shape["max_tokens"], hidden=shape["hidden"], num_topk=shape["topk"],
                  use_fp8_dispatch=True, **bopts)
        # Room for the zero-copy cases (bf16 rows: the larger receive area).
        nbytes = max(ep.ElasticBuffer.get_buffer_size_hint(group, shape["max_tokens"], shape["hidden"], shape["topk"],
                                                           False, True, bopts.get("allow_multiple_reduction", True),
                                                           zero_copy=True),
                     ep.ElasticBuffer.get_buffer_size_hint(group, shape["max_tokens"], shape["hidden"], shape["topk"],
                                                           True, True, bopts.get("allow_multiple_reduction", True)))
        # cfg["num_scaleup_ranks"]: the buffer under test in hybrid mode (logical domains of that size);
        # the reference buffer (compare_torch) stays in direct mode.
        with scaleup_override(cfg.get("num_scaleup_ranks")):
            buf = ep.ElasticBuffer(group, nbytes, backend=cfg["backend"], window=window, **kw)
        if cfg.get("num_scaleup_ranks"):
            check(buf.get_logical_domain_size() == (world // cfg["num_scaleup_ranks"], cfg["num_scaleup_ranks"]),
                  f"logical domains {buf.get_logical_domain_size()}")
        if cfg.get("shuffle") and buf.backend == "torch":  # emulate the native kernels' row order
            buf.runtime.shuffle_generator = torch.Generator().manual_seed(1000 + rank)
        ref = None
        if cfg.get("compare_torch"):
            ref = ep.ElasticBuffer(group, nbytes, backend="torch", **kw)
        elif cfg.get("compare_direct"):  # the same backend and window in direct mode
            ref = ep.ElasticBuffer(group, nbytes, backend=cfg["backend"], window=window, **kw)
        for i, case in enumerate(cfg.get("cases") or case_matrix(cfg["kind"])):
            run_case(buf, ref, group, rank, world, case, shape, seed=cfg.get("seed", 0) * 100 + i,
                     with_oracle=cfg.get("oracle", True))
            done += 1
        buf.destroy()
        if ref is not None:
            ref.destroy()
    dist.destroy_process_group()
    raise_failures(rank)
    return done


def soak_worker(rank, world, rdzv, iters, window="auto", seed_epoch=0, num_scaleup_ranks=None):
    """Random cases of the native buffer against the oracle, and also against the torch backend (except
    window="ipc": the ranks may share a GPU, where the group is gloo, which the torch backend cannot use
    for GPU tensors). seed_epoch: start as if that many operations had run (the 32-bit tags of the count
    words wrap at 2^32 operations; the kernels' u64 epoch must carry on across it). num_scaleup_ranks:
    the buffer in hybrid mode (logical domains of that size), checked against a direct-mode buffer of
    the same window as well."""
    import random

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, window)
    shape = dict(hidden=256, topk=4, experts=16, max_tokens=64)
    kw = dict(num_max_tokens_per_rank=64, hidden=256, num_topk=4, use_fp8_dispatch=True)
    with scaleup_override(num_scaleup_ranks):
        buf = ep.ElasticBuffer(group, backend="native", window=window, **kw)
    if num_scaleup_ranks:  # hybrid mode: direct mode on the same window is the reference too
        ref = ep.ElasticBuffer(group, backend="native", window=window, **kw)
    else:
        ref = None if window == "ipc" else ep.ElasticBuffer(group, backend="torch", **kw)
    if seed_epoch:
        buf.runtime._rt.debug_seed_epoch(seed_epoch)
        group.barrier()  # every rank seeded before any kernel of the next operation runs
    rng = random.Random(1234)  # same sequence of cases on every rank
    for it in range(iters):
        tokens = [rng.randint(0, 64) for _ in range(world)]
        expand = rng.random() < 0.5
        case = dict(dtype=rng.choice(["bf16", "fp8"]), expand=expand, cpu_sync=rng.random() < 0.7,
                    alignment=rng.choice([1, 4, 128]), zero_padding=expand and rng.random() < 0.5,
                    num_bias=rng.randint(0, 2), cached=rng.random() < 0.2, tma_sf=False, sf_strided_input=False,
                    stream_opt=rng.choice(["sync", "async"]), handle_copy=True)
        run_case(buf, ref, group, rank, world, case, dict(shape, tokens=tokens[rank]), seed=10_000 + it,
                 with_oracle=True)
    buf.destroy()
    if ref is not None:
        ref.destroy()
    raise_failures(rank)
    return iters


def check_forward_metadata(handle, everyone, rank: int, world: int, U: int, num_experts: int, M: int) -> int:
    """A hybrid dispatch handle's ``token_metadata_at_forward`` / ``channel_linked_list`` against an
    independent derivation from every rank's routing (``everyone``: ``gather_inputs``). The tokens a
    rank relays come from its rail (same scale-up index), in source-domain then token order, when one
    of their experts lives in its domain; the mask names those ranks. Returns the relayed count."""
    meta, linked = handle.token_metadata_at_forward, handle.channel_linked_list
    L, s_me, u_me = num_experts // world, rank // U, rank % U
    want = []
    for s in range(world // U):
        src = s * U + u_me
        for t, row in enumerate(everyone[src]["topk_idx"].tolist()):
            mask = 0
            for e in row:
                if e >= 0 and (e // L) // U == s_me:
                    mask |= 1 << ((e // L) % U)
            if mask:
                want.append((src * M + t, mask))
    got = [(int(a), int(b)) for a, b in meta[:, :2].tolist()]
    assert got == want, f"rank {rank}: relayed {got}, expected {want}"
    for b in range(U):
        rows = [i for i, (_, mask) in enumerate(want) if mask >> b & 1]
        listed = [int(v) for v in linked[b].tolist() if v >= 0]
        assert listed == rows, f"rank {rank}: linked list to scale-up rank {b}: {listed}, expected {rows}"
        assert [int(meta[i, 2 + b]) for i in rows] == list(range(len(rows)))
        others = [i for i in range(len(want)) if i not in rows]
        assert all(int(meta[i, 2 + b]) == -1 for i in others)
    return len(want)


def expect_timeout(buf, stage, call, rank=0, peer=1):
    """A waiting rank's side of a timeout test: `call` must raise TimeoutError naming `stage`, `rank` and
    `peer` (the device record names who waited for whom) within 14 s, and CUDA must stay usable."""
    import time

    t0 = time.monotonic()
    try:
        call()
        torch.cuda.synchronize()
        buf.barrier(with_cpu_sync=True)
    except TimeoutError as e:
        msg = str(e)
        assert time.monotonic() - t0 < 14, "the timeout took too long"
        assert stage in msg.lower(), msg
        assert f"rank {rank}" in msg and f"peer {peer}" in msg, msg
        assert int(torch.arange(10, device="cuda").sum()) == 45
        return "timeout"
    raise AssertionError(f"{stage} without a peer did not time out")


def calls_until_error(ep, buf, inp, num_experts: int) -> str:
    """A dispatch, a combine and a dispatch on ``buf`` (synchronising after each), as a rank runs them when
    a peer sends it a corrupted word: what the first failing call raised ("CommError: ..." or
    "CommTimeoutError: ...") or "no error"."""
    try:
        recv, _, w, handle, _ = buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"],
                                             num_experts=num_experts)
        torch.cuda.synchronize()
        buf.combine(recv, handle, topk_weights=w)
        torch.cuda.synchronize()
        buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], num_experts=num_experts)
    except (ep.CommError, ep.CommTimeoutError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"
