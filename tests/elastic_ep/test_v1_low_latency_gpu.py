"""DeepEP V1's low-latency mode on the native backend, bitwise against the same plain-loop reference as the
CPU test (``test_v1_low_latency_cpu``): its suites (BF16 / FP8 / FP8 with rounded scales / UE8M0 dispatch
with each completion mode, every combine form, two micro-batches overlapped with the receive hooks, the
clean, shrink mode, the statistics), plus what only a GPU has, as DeepEP V1's tests/test_low_latency.py
does: dispatch + combine captured in a CUDA graph and replayed with new routing and data (with and without
the receive hooks), and a buffer refused while a capture is running.

* EP 1 on one GPU (NCCL group).
* EP 2 with the ranks sharing one GPU (``COMMKIT_TEST_SHARE_GPU=1``): the CUDA-IPC window over gloo.
"""
import pytest
import torch
import torch.distributed as dist

from tests._dist import run_workers
from tests.elastic_ep.test_v1_low_latency_cpu import (MODES, SUITES, Checks, Ctx, Round, check_combine, check_dispatch,
                                                      expert_outputs, ll_worker, num_tokens)


def assert_no_failures(results: list) -> None:
    failures = [f for res in results for suite in SUITES for f in res[suite][1]]
    assert all(res[suite][0] > 0 for res in results for suite in SUITES), "a suite made no checks"
    assert not failures, f"{len(failures)} failed checks:\n  " + "\n  ".join(failures[:40])


@pytest.mark.smoke
@pytest.mark.gpu
def test_low_latency_native_ep1(tmp_path):
    cfg = dict(device="cuda", backend="native", window="auto")
    assert_no_failures(run_workers(ll_worker, 1, cfg, tmp_path=tmp_path, timeout=300))


@pytest.mark.multigpu(2, shared_ok=True)  # the CUDA-IPC window needs no NCCL: the ranks may share a GPU
def test_low_latency_native_ep2_ipc_window(tmp_path):
    cfg = dict(device="cuda", backend="native", window="ipc")
    assert_no_failures(run_workers(ll_worker, 2, cfg, tmp_path=tmp_path, timeout=300))


# ------------------------------------------------------------------------------------------ CUDA graph
def step(buf, c: Ctx, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, mode: str, hook: bool):
    """One decode step as a framework captures it: dispatch, the experts, combine (each receive run
    through its hook with ``hook``). Returns (the dispatch's outputs, combined_x)."""
    use_fp8, round_scale, ue8m0 = MODES[mode]
    res = buf.low_latency_dispatch(x, idx, c.M, c.E, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=ue8m0,
                                   return_recv_hook=hook)
    if hook:
        res[-1]()
    y = expert_outputs(res[0], res[1], mode, c.scales)
    combined, _, recv_hook = buf.low_latency_combine(y, idx, w, res[2], return_recv_hook=hook)
    if hook:
        recv_hook()
    return res, combined


def graph_worker(rank: int, world: int, rdzv: str) -> list:
    """Captures ``step`` once per (hook, mode) and replays it 3 times, each with another routing and other
    rows copied into the captured inputs; every replay's outputs against the reference (the device-side
    call counters advance with each replay, so the peers' signals stay in step)."""
    from tests.elastic_ep._common import init_ep_group

    group = init_ep_group(rank, world, rdzv)
    device = torch.device("cuda", torch.cuda.current_device())
    c = Ctx(rank, world, group, dict(backend="native", window="auto"), device)
    ck = Checks(rank, "graph")
    buf = c.buffer()
    T = num_tokens(rank, world)
    x = torch.empty((T, c.H), dtype=torch.bfloat16, device=device)
    idx = torch.empty((T, c.K), dtype=torch.int64, device=device)
    w = torch.empty((T, c.K), dtype=torch.float32, device=device)

    def load(r: Round) -> None:  # the captured inputs, overwritten in place
        x.copy_(r.x)
        idx.copy_(r.idx)
        w.copy_(r.w)

    for n, (hook, mode) in enumerate([(False, "bf16"), (False, "fp8"), (True, "fp8_round"), (True, "ue8m0")]):
        warm = Round(c, 700 + 10 * n, mode)
        load(warm)
        ck.where = f"eager {mode} hook={hook}"
        res, combined = step(buf, c, x, idx, w, mode, hook)  # an eager step first, as before any capture
        check_dispatch(ck, warm, res)
        check_combine(ck, warm, combined)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            res, combined = step(buf, c, x, idx, w, mode, hook)
        for i in range(3):
            r = Round(c, 701 + 10 * n + i, mode)
            load(r)
            graph.replay()
            torch.cuda.synchronize()
            ck.where = f"graph {mode} hook={hook} replay {i}"
            check_dispatch(ck, r, res)
            check_combine(ck, r, combined)
        del graph, res, combined
    buf.destroy()
    dist.destroy_process_group()
    return ck.failures


@pytest.mark.gpu
def test_low_latency_cuda_graph_ep1(tmp_path):
    failures = run_workers(graph_worker, 1, tmp_path=tmp_path, timeout=300)[0]
    assert not failures, f"{len(failures)} failed checks:\n  " + "\n  ".join(failures[:40])


def capture_worker(rank: int, world: int, rdzv: str) -> str:
    """Creating a Buffer inside a capture raises (its collectives and allocations cannot be captured);
    one created after the capture works."""
    import elastic_ep as ep

    from tests.elastic_ep._common import init_ep_group

    group = init_ep_group(rank, world, rdzv)
    hint = ep.Buffer.get_low_latency_rdma_size_hint(16, 512, world, 8)
    torch.zeros(1, device="cuda")  # CUDA initialised before the capture
    graph = torch.cuda.CUDAGraph()
    message = ""
    with torch.cuda.graph(graph):
        try:
            ep.Buffer(group, 0, hint, low_latency_mode=True, backend="native")
        except RuntimeError as e:
            message = str(e)
    del graph
    buf = ep.Buffer(group, 0, hint, low_latency_mode=True, backend="native")
    buf.destroy()
    dist.destroy_process_group()
    return message


@pytest.mark.gpu
def test_buffer_refused_during_capture(tmp_path):
    message = run_workers(capture_worker, 1, tmp_path=tmp_path, timeout=120)[0]
    assert "capturing" in message, f"no RuntimeError naming the capture: {message!r}"
