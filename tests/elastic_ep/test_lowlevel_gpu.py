"""GPU tests of the native runtime (elastic_ep._low_level, DeepEP's low level) against an independent reference.

Every rank all-gathers the inputs of all ranks and recomputes, with plain torch, what it must receive:
rows grouped by source rank then source token, local expert ids, weights, counts, prefix sums and the
combine sums in DeepEP's order (fp32 from the biases, then per top-k lane the partial of the rank whose
last lane it is). Comparisons are bitwise (torch.equal), expand-mode segments after sorting by source
token. The runtime takes typed arguments (``DispatchArgs`` / ``CombineArgs``), built by ``_dispatch`` /
``_combine`` below as ``ElasticBuffer`` would after validating them.

Timing is not measured here: tools/bench_elastic_ep.py times the same DeepSeek-V3 shape (dispatch BF16,
FP8 and cached, combine) with kernel and end-to-end figures.
"""
from __future__ import annotations

import pytest

from tests._dist import init_nccl, run_workers

torch = pytest.importorskip("torch")


def _make_comm(rank, world_size):
    import torch.distributed as dist

    from elastic_ep import _low_level as ll

    obj = [ll.get_local_nccl_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    return ll.create_nccl_comm(obj[0], world_size, rank)


def _new_buffer(rank, world_size, comm, num_bytes, multi, gpu_timeout=20, window="nccl"):
    import torch.distributed as dist

    from elastic_ep import _low_level as ll

    buf = ll.NativeRuntime(rank, world_size, comm, None, num_bytes, 0, True, multi, True, 3, 0, 30, gpu_timeout, True,
                           window=window)
    if window == "ipc":
        handles = [None] * world_size
        dist.all_gather_object(handles, buf.get_local_ipc_handle())
        buf.sync(handles)
    dist.barrier()
    return buf


def _dispatch(buf, x, sf, topk, w, stats, max_tokens, E, align, *, cpu_sync=True, expand=False, zero_pad=False,
              tma_sf=False, handle=None, previous_event=None, async_=False, comm_alloc=False):
    """A dispatch on the native runtime; returns ``(outputs in DeepEP's C++ order, handle)``: (recv_x, recv_sf,
    recv_topk_idx, recv_topk_weights, the handle's topk_idx, num_recv_tokens, num_expanded_tokens, the
    per-expert list, psum per rank, psum per expert, unaligned counts, recv_src_metadata, slots, None,
    None, event)."""
    from elastic_ep._runtime import DispatchArgs

    if handle is not None:
        topk, stats, cpu_sync = handle.topk_idx, None, False
    a = DispatchArgs(x=x, sf=sf, topk_idx=topk, topk_weights=w, cumulative_local_expert_recv_stats=stats,
                     handle=handle, num_tokens=x.shape[0], hidden=x.shape[1], num_topk=topk.shape[1], num_experts=E,
                     num_max_tokens_per_rank=max_tokens, expert_alignment=align, num_sms=buf.num_device_sms,
                     num_qps=0, previous_event=previous_event, previous_event_before_epilogue=None,
                     async_with_compute_stream=async_, allocate_on_comm_stream=comm_alloc, do_handle_copy=True,
                     do_cpu_sync=cpu_sync, do_expand=expand, do_zero_padding=zero_pad,
                     use_tma_aligned_col_major_sf=tma_sf)
    r = buf.dispatch(a)
    h = r.handle
    return (r.recv_x, r.recv_sf, r.recv_topk_idx, r.recv_topk_weights, h.topk_idx, h.num_recv_tokens,
            h.num_expanded_tokens, h.num_recv_tokens_per_expert_list, h.psum_num_recv_tokens_per_scaleup_rank,
            h.psum_num_recv_tokens_per_expert, h.num_unaligned_recv_tokens_per_expert, h.recv_src_metadata,
            h.dst_buffer_slot_idx, None, None, r.event), h


def _combine(buf, y, handle, w=None, b0=None, b1=None):
    from elastic_ep._runtime import CombineArgs

    return buf.combine(CombineArgs(x=y, handle=handle, topk_weights=w, bias_0=b0, bias_1=b1, num_sms=buf.num_device_sms,
                                   num_qps=0, previous_event=None, previous_event_before_epilogue=None,
                                   async_with_compute_stream=False, allocate_on_comm_stream=False))


def _assert(cond, msg=""):
    if not cond:
        raise AssertionError(msg)


def _gather(t):
    import torch.distributed as dist

    if dist.get_backend() == "gloo":  # ranks sharing a GPU (window="ipc"): through host memory
        out = [torch.empty_like(t, device="cpu") for _ in range(dist.get_world_size())]
        dist.all_gather(out, t.contiguous().cpu())
        return [o.to(t.device) for o in out]
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _inputs(rank, T, H, K, E, fp8, ue8m0, seed, mask_frac=0.1):
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    x = torch.randn((T, H), device="cuda", generator=g).to(torch.bfloat16)
    scores = torch.rand((T, E), device="cuda", generator=g)
    topk = scores.topk(K, dim=1).indices.to(torch.int64)
    if T:
        drop = torch.rand((T, K), device="cuda", generator=g) < mask_frac
        topk = torch.where(drop, torch.full_like(topk, -1), topk)
    w = torch.rand((T, K), device="cuda", generator=g)
    sf = None
    if fp8:
        x = (x.float() * 4).to(torch.float8_e4m3fn)
        if ue8m0:
            packs = (H // 32 + 3) // 4
            sf = torch.randint(0, 2**31 - 1, (packs, T), device="cuda", dtype=torch.int32, generator=g).t()
        else:
            packs = H // 128
            sf = torch.rand((packs, T), device="cuda", generator=g).t()  # column-major input on purpose
    return x, sf, topk, w


def _reference(rank, R, T_all, xs, sfs, topks, ws, E, K, max_tokens, align):
    """What `rank` must receive (non-expand order) from the gathered inputs of every rank."""
    L = E // R
    rows, meta, ltopk, lw, sf_rows = [], [], [], [], []
    per_rank = []
    for s in range(R):
        tk = topks[s]
        local = (tk >= rank * L) & (tk < (rank + 1) * L)
        hit = local.any(dim=1)
        idx = hit.nonzero().flatten()
        per_rank.append(idx.numel())
        rows.append(xs[s][idx])
        if sfs is not None:
            sf_rows.append(sfs[s][idx])
        lt = torch.where(local[idx], tk[idx] - rank * L, torch.full_like(tk[idx], -1))
        ltopk.append(lt)
        lw.append(torch.where(local[idx], ws[s][idx], torch.zeros_like(ws[s][idx])))
        master = local[idx].int().argmax(dim=1)
        meta.append(torch.stack([s * max_tokens + idx.int(), (s * K + master).int()], dim=1))
    counts = torch.zeros(L, dtype=torch.int64, device="cuda")
    for s in range(R):
        tk = topks[s]
        v = tk[(tk >= rank * L) & (tk < (rank + 1) * L)] - rank * L
        counts += torch.bincount(v, minlength=L)
    return dict(x=torch.cat(rows), sf=torch.cat(sf_rows) if sfs is not None else None, topk=torch.cat(ltopk),
                w=torch.cat(lw), meta=torch.cat(meta), per_rank=per_rank, counts=counts)


def _check_dispatch(ref, out, rank, R, K, L, align, expand, zero_pad, cpu_sync, max_tokens):
    (recv_x, recv_sf, recv_topk, recv_w, copied, n_recv, n_exp, per_exp_list, psum_rank, psum_exp, unal, meta,
     slot_idx, _, _, ev) = out
    N = sum(ref["per_rank"])
    # Scales and weights come back exactly when they were sent: an output that dropped them must fail
    # here, not skip the comparisons below.
    assert (recv_sf is None) == (ref["sf"] is None), f"recv_sf is {'None' if recv_sf is None else 'set'}"
    assert (recv_w is None) == (ref["w"] is None), f"recv_topk_weights is {'None' if recv_w is None else 'set'}"
    psum_ref = torch.tensor(ref["per_rank"], device="cuda").cumsum(0).int()
    assert torch.equal(psum_rank, psum_ref), (psum_rank, psum_ref)
    assert torch.equal(unal, ref["counts"].int())
    aligned = (ref["counts"] + align - 1) // align * align
    if cpu_sync:
        assert n_recv == N
        assert per_exp_list == aligned.tolist()
        assert n_exp == int(aligned.sum())
    else:
        assert n_recv == R * max_tokens
    assert torch.equal(meta[:N, :2], ref["meta"])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64, device="cuda"), aligned.cumsum(0)[:-1]])
    if not expand:
        assert torch.equal(psum_exp, aligned.cumsum(0).int())
        assert torch.equal(recv_x.view(torch.uint8)[:N], ref["x"])
        assert torch.equal(recv_topk[:N], ref["topk"])
        if ref["w"] is not None:
            assert torch.equal(recv_w[:N], ref["w"])
        if ref["sf"] is not None:
            assert torch.equal(recv_sf[:N], ref["sf"])
        lanes = meta[:N, 2:]
        assert torch.equal(lanes >= 0, ref["topk"] >= 0)
        return
    assert recv_topk is None
    assert torch.equal(psum_exp, (starts + ref["counts"]).int())
    # Expand: every (received token, local lane) appears exactly once in its expert's segment.
    lanes = meta[:N, 2:].long()
    local = ref["topk"]
    assert torch.equal(lanes >= 0, local >= 0)
    for l in range(L):
        sel = (local == l)
        tok, lane = sel.nonzero(as_tuple=True)
        pos = lanes[tok, lane]
        c = int(ref["counts"][l])
        assert pos.numel() == c
        assert torch.equal(torch.sort(pos).values, torch.arange(int(starts[l]), int(starts[l]) + c, device="cuda"))
        assert torch.equal(recv_x.view(torch.uint8)[pos], ref["x"][tok])
        if ref["w"] is not None:
            assert torch.equal(recv_w[pos], ref["w"][tok, lane])
        if ref["sf"] is not None:
            assert torch.equal(recv_sf[pos], ref["sf"][tok])
        if zero_pad:
            a = int(aligned[l])
            gap = torch.arange(int(starts[l]) + c, int(starts[l]) + a, device="cuda")
            if gap.numel():
                assert not recv_x.view(torch.uint8)[gap].any()
                if ref["w"] is not None:
                    assert not recv_w[gap].any()
                if ref["sf"] is not None:
                    assert not recv_sf[gap].any()


def _worker_modes(rank, world_size, rdzv, cases, window="nccl"):
    """Every case on one buffer per reduction mode. window="ipc": the CUDA-IPC window, on a gloo group
    when the ranks share a GPU (NCCL refuses that), so the multi-rank paths run on a one-GPU machine."""
    from tests.elastic_ep._common import init_ep_group

    init_ep_group(rank, world_size, rdzv, window)
    import torch.distributed as dist

    from elastic_ep import _low_level as ll

    comm = _make_comm(rank, world_size) if window == "nccl" else 0
    R = world_size
    results, failures = [], []
    buffers = {}
    for case in cases:
      try:
            T_max, H, K, E, fp8, ue8m0, expand, align, zero_pad, cpu_sync, multi, nbias, stream_mode, seed = case
            L = E // R
            if multi not in buffers:
                nbytes = ll.NativeRuntime.calculate_buffer_size(comm or R, 512, 7168, 8, False, True, multi)
                buffers[multi] = _new_buffer(rank, R, comm, nbytes, multi, window=window)
            buf = buffers[multi]
            T = max(0, T_max - 3 * rank) if rank != 1 else (0 if seed % 3 == 0 else T_max)
            x, sf, topk, w = _inputs(rank, T, H, K, E, fp8, ue8m0, seed)
            stats = torch.zeros(L, dtype=torch.int32, device="cuda")
            xs, topks, ws = _gather_var(x, R), _gather_var(topk, R), _gather_var(w, R)
            xs = [p.view(torch.uint8) for p in xs]  # the reference moves bytes, whatever the dtype
            sfs = _gather_var(sf.contiguous(), R) if sf is not None else None
            ref = _reference(rank, R, None, xs, sfs, topks, ws, E, K, T_max, align)

            kw = {}
            if stream_mode == "async":
                kw.update(async_=True, comm_alloc=True, previous_event=ll.EventHandle())
            out, handle = _dispatch(buf, x, sf, topk, w, stats, T_max, E, align, cpu_sync=cpu_sync, expand=expand,
                                    zero_pad=zero_pad, tma_sf=(seed % 2 == 1), **kw)
            if out[-1] is not None:
                out[-1].current_stream_wait()
            torch.cuda.synchronize()
            # Checks are deferred to the end of the case so every rank keeps issuing the same collectives.
            errs = []

            def soft(fn, what):
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - every check of the case is reported
                    import traceback

                    errs.append(f"{what}: {e!s:.200} {traceback.format_exc(limit=-1)[-300:]}")

            soft(lambda: _check_dispatch(ref, out, rank, R, K, L, align, expand, zero_pad, cpu_sync, T_max), "dispatch")
            soft(lambda: _assert(torch.equal(stats, ref["counts"].int())), "stats")
            soft(lambda: _assert(torch.equal(out[4], topk)), "handle copy")

            # Cached dispatch reproduces the same rows.
            (recv_x, recv_sf, recv_topk, recv_w, copied, n_recv, n_exp, per_exp_list, psum_rank, psum_exp, unal, meta,
             slot_idx, _, _, _) = out
            out2, h2 = _dispatch(buf, x, sf, None, w, None, T_max, E, align, expand=expand, zero_pad=zero_pad,
                                 tma_sf=(seed % 2 == 1), handle=handle)
            soft(lambda: _assert(h2 is handle), "cached dispatch returns its handle")
            torch.cuda.synchronize()
            N = sum(ref["per_rank"])
            n_rows = int(psum_exp[-1]) if expand and L else N
            if expand:
                valid = meta[:N, 2:].long()
                valid = valid[valid >= 0]
                soft(lambda: _assert(torch.equal(out2[0].view(torch.uint8)[valid], recv_x.view(torch.uint8)[valid])),
                     "cached expand")
            else:
                soft(lambda: _assert(torch.equal(out2[0].view(torch.uint8)[:N], recv_x.view(torch.uint8)[:N])),
                     "cached")

            # Combine: each rank sends back y = bf16(recv as float * (rank + 1)) (bf16 input of the combine).
            src = recv_x.float() if not fp8 else recv_x.float()
            y = (src * (rank + 1)).to(torch.bfloat16)
            b = [torch.randn((T, H), device="cuda").to(torch.bfloat16) for _ in range(nbias)]
            b0 = b[0] if nbias > 0 else None
            b1 = b[1] if nbias > 1 else None
            cw = recv_w
            cx, cwt, _ = _combine(buf, y, handle, cw, b0, b1)
            torch.cuda.synchronize()
            # Reference: every rank's y rows for my tokens, gathered, in slot order.
            ref_cx, ref_w = _combine_ref(rank, R, K, L, T, T_max, topk, w, x, fp8, b0, b1, multi, expand)
            # (the message is built only on a mismatch: an empty tensor has no max)
            soft(lambda: _assert(torch.equal(cx.view(torch.int16), ref_cx.view(torch.int16)),
                                 "" if cx.numel() == 0 else
                                 f"max diff {(cx.float() - ref_cx.float()).abs().max().item()}"), "combine x")
            soft(lambda: _assert(torch.equal(cwt, ref_w)), "combine weights")
            if errs:
                raise AssertionError("; ".join(errs))
            results.append(case)
      except Exception as exc:  # noqa: BLE001 - keep going, report every failing case
        import traceback

        failures.append(f"{case}: {type(exc).__name__}: {str(exc)[:300]}\n{traceback.format_exc(limit=3)[-600:]}")
        if isinstance(exc, (ll.CommError, ll.CommTimeoutError)):
            break

    if not failures:
        for b in buffers.values():
            b.destroy()
        if comm:
            ll.destroy_nccl_comm(comm)
    dist.destroy_process_group()
    if failures:
        raise AssertionError(f"rank {rank}: {len(failures)} of {len(cases)} cases failed "
                             f"({len(results)} passed):\n" + "\n".join(failures))
    return len(results)


def _gather_var(t, R):
    """all_gather of tensors whose first dimension differs per rank."""
    import torch.distributed as dist

    if t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    n = torch.tensor([t.shape[0]], device="cuda")
    ns = _gather(n)
    mx = int(max(int(v) for v in ns))
    pad = torch.zeros((mx,) + tuple(t.shape[1:]), dtype=t.dtype, device="cuda")
    pad[: t.shape[0]] = t
    parts = _gather(pad)
    return [p[: int(k)] for p, k in zip(parts, ns)]


def _combine_ref(rank, R, K, L, T, T_max, topk, w, x_mine, fp8, b0, b1, multi, expand):
    """Recomputes combine in DeepEP's order. Every rank r returns y_r = bf16(float(x) * (r + 1)) for my
    tokens it received (with expand and multiple reduction: the fp32 sum of y_r over r's local lanes in
    lane order, rounded to bf16; without multiple reduction in expand mode: y_r at each of r's lanes).
    The fp32 accumulator starts from the biases (bias_0 + bias_1) and adds, lane by lane, rank r's row at
    the last lane routed to r (each lane's own row without multiple reduction in expand mode)."""
    H = x_mine.shape[1]
    x = x_mine.float()
    owner = torch.where(topk >= 0, topk // L, torch.full_like(topk, -1))
    zero = torch.zeros((T, H), dtype=torch.float32, device="cuda")
    if b0 is not None and b1 is not None:
        acc = b0.float() + b1.float()
    elif b0 is not None or b1 is not None:
        acc = (b0 if b0 is not None else b1).float().clone()
    else:
        acc = zero.clone()
    for k in range(K):
        o = owner[:, k]
        last = o >= 0
        for j in range(k + 1, K):
            last &= owner[:, j] != o
        valid = (o >= 0) if (expand and not multi) else last
        term = zero.clone()
        for r in range(R):
            yr = (x * (r + 1)).to(torch.bfloat16).float()
            if expand and multi:
                s = zero.clone()
                for kk in range(K):
                    s = s + torch.where((owner[:, kk] == r)[:, None], yr, zero)
                yr = s.to(torch.bfloat16).float()
            term = torch.where(((o == r) & valid)[:, None], yr, term)
        acc = acc + term
    w_out = torch.where(topk >= 0, w, torch.zeros_like(w))
    return acc.to(torch.bfloat16), w_out


def _cases(R):
    cases = []
    seed = 0
    for fp8, ue8m0 in ((False, False), (True, False), (True, True)):
        for expand in (False, True):
            for align in (1, 128):
                for multi in (True, False):
                    seed += 1
                    zero_pad = expand and (seed % 2 == 0)
                    cpu_sync = seed % 3 != 0
                    nbias = seed % 3
                    stream_mode = "async" if seed % 4 == 0 else "sync"
                    cases.append((256, 1024, 8, 32, fp8, ue8m0, expand, align, zero_pad, cpu_sync, multi, nbias,
                                  stream_mode, seed))
    # DeepSeek-V3-like shape (fewer tokens) and a top-2 shape with more ranks than lanes
    cases.append((512, 7168, 8, 256, False, False, False, 1, False, True, True, 2, "sync", 101))
    cases.append((512, 7168, 8, 256, True, False, True, 128, True, True, True, 0, "sync", 102))
    cases.append((300, 512, 1, 16, False, False, False, 1, False, True, True, 1, "sync", 103))
    cases.append((300, 512, 1, 16, False, False, True, 4, True, False, False, 1, "sync", 104))
    # top-k that does not divide a warp, and the 16- and 32-wide notify instantiations
    cases.append((200, 512, 6, 24, False, False, False, 1, False, True, True, 0, "sync", 105))
    cases.append((130, 256, 12, 48, True, False, True, 4, True, True, True, 1, "sync", 106))
    cases.append((70, 256, 20, 40, False, False, False, 1, False, False, True, 0, "sync", 107))
    # More than one notify block (one per 1024 tokens, the last one partial): block-relative slots
    # made absolute by the push, per-expert counts summed over blocks, cached reuse of those slots
    cases.append((2500, 512, 8, 32, False, False, False, 1, False, True, True, 1, "sync", 108))
    cases.append((2200, 256, 16, 48, True, False, True, 4, True, False, False, 0, "sync", 109))
    return cases


@pytest.mark.smoke
@pytest.mark.gpu
def test_lowlevel_ep1_modes(tmp_path):
    assert run_workers(_worker_modes, 1, _cases(1), tmp_path=tmp_path, timeout=150) == [len(_cases(1))]


@pytest.mark.multigpu(2)
def test_lowlevel_ep2_modes(tmp_path):
    n = torch.cuda.device_count()
    R = 2 if n < 4 else n
    assert run_workers(_worker_modes, R, _cases(R), tmp_path=tmp_path, timeout=200) == [len(_cases(R))] * R


@pytest.mark.gpu
def test_lowlevel_ep1_ipc_window(tmp_path):
    # The CUDA-IPC window (no NCCL) at EP 1: a third of the matrix and the several-notify-block cases.
    cases = _cases(1)[::3] + _cases(1)[-2:]
    assert run_workers(_worker_modes, 1, cases, "ipc", tmp_path=tmp_path, timeout=150) == [len(cases)]


@pytest.mark.multigpu(2, shared_ok=True)  # the CUDA-IPC window needs no NCCL: ranks may share a GPU
def test_lowlevel_ep2_ipc_window(tmp_path):
    # The whole EP 2 matrix on the CUDA-IPC window: one GPU per rank where there are two, else both
    # ranks on one GPU (gloo group), so the multi-rank kernel paths run on a one-GPU machine too.
    cases = _cases(2)
    assert run_workers(_worker_modes, 2, cases, "ipc", tmp_path=tmp_path, timeout=400) == [len(cases)] * 2


@pytest.mark.multigpu(4, shared_ok=True)
def test_lowlevel_ep4_ipc_window(tmp_path):
    # The same matrix at EP 4 (ranks share GPUs where there are fewer than four).
    cases = _cases(4)
    assert run_workers(_worker_modes, 4, cases, "ipc", tmp_path=tmp_path, timeout=400) == [len(cases)] * 4


# The overlapped dispatch and combine (see tests/elastic_ep/test_gpu.py), over the whole low-level
# matrix: 2 push blocks, so most chunks are awaited while the push is still running.
_OVERLAP = {"ELASTIC_EP_DISPATCH_OVERLAP": "1", "ELASTIC_EP_COMBINE_OVERLAP": "1",
            "ELASTIC_EP_DISPATCH_PUSH_BLOCKS": "2", "ELASTIC_EP_COMBINE_PUSH_BLOCKS": "2"}


@pytest.mark.gpu
def test_lowlevel_ep1_modes_overlapped(tmp_path):
    assert run_workers(_worker_modes, 1, _cases(1), tmp_path=tmp_path, timeout=150,
                       env=_OVERLAP) == [len(_cases(1))]


@pytest.mark.multigpu(2, shared_ok=True)
def test_lowlevel_ep2_ipc_window_overlapped(tmp_path):
    cases = _cases(2)
    assert run_workers(_worker_modes, 2, cases, "ipc", tmp_path=tmp_path, timeout=400,
                       env=_OVERLAP) == [len(cases)] * 2


@pytest.mark.multigpu(2)
def test_lowlevel_ep2_modes_overlapped(tmp_path):
    n = torch.cuda.device_count()
    R = 2 if n < 4 else n
    assert run_workers(_worker_modes, R, _cases(R), tmp_path=tmp_path, timeout=200,
                       env=_OVERLAP) == [len(_cases(R))] * R


# The dispatch push launched after notify instead of beside it (ElasticBuffer.dispatch_pdl; the
# default since 2026-12-02 runs it as notify's programmatic dependent): the path the overlapped
# dispatch takes, here with the sequential epilogue, a third of the matrix.
_NO_PDL = {"ELASTIC_EP_DISPATCH_PDL": "0"}


@pytest.mark.gpu
def test_lowlevel_ep1_modes_push_after_notify(tmp_path):
    cases = _cases(1)[::3] + _cases(1)[-2:]
    assert run_workers(_worker_modes, 1, cases, tmp_path=tmp_path, timeout=150, env=_NO_PDL) == [len(cases)]


@pytest.mark.multigpu(2, shared_ok=True)
def test_lowlevel_ep2_ipc_window_push_after_notify(tmp_path):
    cases = _cases(2)[::3] + _cases(2)[-2:]
    assert run_workers(_worker_modes, 2, cases, "ipc", tmp_path=tmp_path, timeout=300,
                       env=_NO_PDL) == [len(cases)] * 2


def _worker_stream_order(rank, world_size, rdzv):
    """Default stream setup (no events): the communication stream must wait for the caller's stream
    before reading the inputs, and the caller's stream must wait for the outputs. Both are forced
    to matter by sleeping on the other stream first; run on torch's default stream (the legacy stream,
    handle 0) and on a side stream."""
    init_nccl(rank, world_size, rdzv)
    import torch.distributed as dist

    comm = _make_comm(rank, world_size)
    T, H, K, E = 256, 1024, 8, 32
    from elastic_ep import _low_level as ll

    buf = _new_buffer(rank, world_size, comm, ll.NativeRuntime.calculate_buffer_size(comm, T, H, K, False, True, True),
                      True)
    side = torch.cuda.Stream()
    checked = 0
    for stream in (torch.cuda.default_stream(), side):
        with torch.cuda.stream(stream):
            for cpu_sync in (True, False):
                x0, _, topk, w = _inputs(rank, T, H, K, E, False, False, 3)
                torch.cuda.synchronize()
                # Inputs finished late on the caller's stream: dispatch must see the final values.
                x = torch.zeros_like(x0)
                torch.cuda._sleep(20_000_000)
                x.copy_(x0)
                out, handle = _dispatch(buf, x, None, topk, w, None, T, E, 1, cpu_sync=cpu_sync)
                recv = out[0].clone()  # on the caller's stream, right away
                N = int(out[8][-1].item())
                _assert(torch.equal(recv[:N], x0[(topk >= 0).any(dim=1)]), "dispatch rows (stream order)")
                # Outputs written late on the comm stream: the caller's stream must wait for them. The
                # experts return bf16(row * (rank + 1)), what _combine_ref recomputes independently.
                y = (recv.float() * (rank + 1)).to(torch.bfloat16)
                with torch.cuda.stream(buf.comm_stream):
                    torch.cuda._sleep(20_000_000)
                comb = _combine(buf, y, handle)
                got = comb[0].clone()
                torch.cuda.synchronize()
                ref, _ = _combine_ref(rank, world_size, K, E // world_size, T, T, topk, w, x0, False, None, None,
                                      True, False)
                _assert(torch.equal(got.view(torch.int16), ref.view(torch.int16)),
                        "combine output read on the caller's stream before it was written (or wrong)")
                checked += 1
    buf.destroy()
    ll.destroy_nccl_comm(comm)
    dist.destroy_process_group()
    return checked


@pytest.mark.gpu
def test_lowlevel_ep1_stream_order(tmp_path):
    assert run_workers(_worker_stream_order, 1, tmp_path=tmp_path, timeout=120) == [4]


def _atomic_mask_cases(R):
    # Above 32 ranks notify builds its per-rank token masks with shared atomics; the variable makes it
    # do so at any rank count. A third of the matrix plus the 6/12/20-wide top-k shapes.
    cases = _cases(R)
    return cases[::3] + cases[-3:]


@pytest.mark.gpu
def test_lowlevel_ep1_modes_notify_atomic_masks(tmp_path):
    cases = _atomic_mask_cases(1)
    assert run_workers(_worker_modes, 1, cases, tmp_path=tmp_path, timeout=150,
                       env={"ELASTIC_EP_TEST_NOTIFY_ATOMICS": "1"}) == [len(cases)]


@pytest.mark.multigpu(2, shared_ok=True)  # the CUDA-IPC window needs no NCCL: ranks may share a GPU
def test_lowlevel_ep2_ipc_window_notify_atomic_masks(tmp_path):
    cases = _atomic_mask_cases(2)
    assert run_workers(_worker_modes, 2, cases, "ipc", tmp_path=tmp_path, timeout=300,
                       env={"ELASTIC_EP_TEST_NOTIFY_ATOMICS": "1"}) == [len(cases)] * 2


@pytest.mark.multigpu(2)
def test_lowlevel_ep2_modes_notify_atomic_masks(tmp_path):
    n = torch.cuda.device_count()
    R = 2 if n < 4 else n
    cases = _atomic_mask_cases(R)
    assert run_workers(_worker_modes, R, cases, tmp_path=tmp_path, timeout=200,
                       env={"ELASTIC_EP_TEST_NOTIFY_ATOMICS": "1"}) == [len(cases)] * R

