"""Every bad input raises a clear Python exception before anything launches (torch backend, gloo)."""
import pytest

from tests._dist import run_workers


def validation_worker(rank, world, rdzv, backend="torch"):
    import torch

    from tests._dist import init_gloo, init_nccl
    from tests.elastic_ep._common import import_elastic_ep, make_inputs, refusal_checker

    ep = import_elastic_ep()
    dev = "cuda" if backend == "native" else "cpu"
    group = init_nccl(rank, world, rdzv) if dev == "cuda" else init_gloo(rank, world, rdzv)
    H, K, E, M = 256, 4, 8, 32
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend=backend)
    inp = make_inputs(rank, 16, H, K, E, "bf16", 0, dev)
    x, idx, w = inp["x"], inp["topk_idx"], inp["topk_weights"]
    fp8 = make_inputs(rank, 16, H, K, E, "fp8", 0, dev)
    seen = []
    bad = refusal_checker(seen)

    d = buf.dispatch
    bad("x: expected dtype", lambda: d(x.float(), topk_idx=idx, num_experts=E))
    bad("x: expected a 2-D", lambda: d(x.view(-1), topk_idx=idx, num_experts=E))
    bad("x: expected a contiguous", lambda: d(torch.cat([x, x], 1)[:, ::2], topk_idx=idx, num_experts=E))
    bad("x: a row must be a multiple of 16 bytes", lambda: d(x[:, :4].contiguous(), topk_idx=idx, num_experts=E))
    bad("FP8 rows need scales", lambda: d(fp8["x"], topk_idx=idx, num_experts=E))
    bad("sf: expected shape", lambda: d((fp8["x"], fp8["sf"][:3]), topk_idx=idx, num_experts=E))
    bad("sf: expected dtype", lambda: d((fp8["x"], fp8["sf"].double()), topk_idx=idx, num_experts=E))
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
    from elastic_ep import _C

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
    c = buf.combine
    bad("x: expected dtype", lambda: c(recv.float(), h))
    bad("x: expected shape", lambda: c(recv[:-1], h))
    bad("topk_weights: expected shape", lambda: c(recv, h, topk_weights=rw[:, :1].contiguous()))
    bad("bias[0]: expected shape", lambda: c(recv, h, bias=torch.zeros(3, H, dtype=torch.bfloat16)))
    bad("bias: expected at most two", lambda: c(recv, h, bias=(None, None, None)))
    bad("handle: expected the EPHandle", lambda: c(recv, None))
    buf2 = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend=backend)
    bad("produced by another ElasticBuffer", lambda: buf2.combine(recv, h))

    # constructor arguments
    bad("num_cpu_bytes", lambda: ep.ElasticBuffer(group, num_cpu_bytes=1000, num_max_tokens_per_rank=M, hidden=H))
    bad("num_bytes=None needs", lambda: ep.ElasticBuffer(group))
    bad("num_bytes: expected a positive multiple", lambda: ep.ElasticBuffer(group, num_bytes=1000, backend="torch"))
    bad("backend:", lambda: ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, backend="cuda"))
    bad("num_topk: expected", lambda: ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=33))
    bad("window: expected 'auto', 'nccl' or 'ipc'",
        lambda: ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, window="shm"))
    bad("window='ipc' is the native backend's",
        lambda: ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, backend="torch", window="ipc"))
    if not torch.cuda.is_available():
        # window='ipc' asks for the native backend: where it cannot run, the reason is raised rather
        # than the torch backend silently used without the window.
        try:
            ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, window="ipc")
        except RuntimeError as e:
            assert "CUDA" in str(e) or "native" in str(e), e
            seen.append("window='ipc' without CUDA")
        else:
            raise AssertionError("window='ipc' without a GPU did not raise")

    # a valid call still works after all the rejected ones, then the lifecycle
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
    buf2.destroy()
    with buf:
        pass
    try:
        buf.dispatch(x, topk_idx=idx, num_experts=E)
    except RuntimeError as e:
        assert "destroyed" in str(e)
    else:
        raise AssertionError("a destroyed buffer accepted a dispatch")
    if dev == "cuda":
        # C++ exceptions crossing into Python in a process with a live CUDA context and NCCL
        # communicator: each must arrive as this package's Python exception, the process survives,
        # and the device stays usable afterwards.
        from elastic_ep import _C

        for _ in range(3):
            try:
                _C.destroy_nccl_comm(0)
            except ValueError as e:
                assert "null" in str(e), e
            else:
                raise AssertionError("destroy_nccl_comm(0) did not raise")
        small = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="native")
        native_rt = small.runtime._rt
        small.destroy()
        for _ in range(3):
            try:
                native_rt.check_healthy()
            except _C.CommError as e:
                assert "destroyed" in str(e) and getattr(e, "where", "").startswith("runtime.cpp:"), (e, e.where)
            else:
                raise AssertionError("check_healthy() after destroy did not raise")
        assert torch.cuda.is_available() and (torch.ones(4, device="cuda") * 2).sum().item() == 8.0
        seen.append("C++ exceptions")
    if backend == "torch" and not ep.native_available():
        try:
            ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, backend="native")
        except (RuntimeError, ValueError) as e:
            seen.append(f"native: {e}")
        else:
            raise AssertionError("backend='native' without the native module did not raise")
    return len(seen)


def test_bad_inputs_raise_before_launch(tmp_path):
    n = run_workers(validation_worker, 2, tmp_path=tmp_path, timeout=120)
    assert n[0] == n[1] and n[0] >= 40


@pytest.mark.smoke
@pytest.mark.gpu
def test_bad_inputs_native_ep1(tmp_path):
    """The same checks on the native backend (one GPU, EP=1), then a valid dispatch still works."""
    n = run_workers(validation_worker, 1, "native", tmp_path=tmp_path, timeout=180)
    assert n[0] >= 40


def cpu_timeout_worker(rank, world, rdzv):
    import time

    from tests._dist import init_gloo
    from tests.elastic_ep._common import import_elastic_ep, make_inputs

    ep = import_elastic_ep()
    group = init_gloo(rank, world, rdzv)
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=16, hidden=256, num_topk=2, backend="torch",
                           num_cpu_timeout_secs=2)
    if rank != 0:
        time.sleep(8)  # never joins the dispatch
        return "idle"
    inp = make_inputs(rank, 16, 256, 2, 8, "bf16", 0, "cpu")
    t0 = time.monotonic()
    try:
        buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], num_experts=8)
    except TimeoutError as e:
        waited = time.monotonic() - t0
        assert waited < 7, f"took {waited:.1f} s"
        return str(e)
    return "no timeout"


def test_cpu_timeout_names_stage_and_rank(tmp_path):
    """A peer that never joins: the torch backend raises TimeoutError after num_cpu_timeout_secs."""
    res = run_workers(cpu_timeout_worker, 2, tmp_path=tmp_path, timeout=60)
    assert "dispatch" in res[0] and "rank 0" in res[0] and "timed out" in res[0], res[0]
    assert res[1] == "idle"
