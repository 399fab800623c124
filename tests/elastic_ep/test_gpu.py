"""GPU tests of the native backend: bitwise equality with the torch backend and the plain oracle.

* EP=1 on one GPU and EP=2 (or more) on several: the mode matrix (bf16 / FP8 with FP32 and UE8M0
  scales, expand on/off, alignment 1/4/128, zero padding, cached mode, CPU sync on/off, bias 0/1/2,
  multiple reduction on/off, deterministic, TMA column-major scales, event/stream options), with
  different token counts per rank including 0.
* DeepSeek-V3 shape (hidden 7168, top-8, 256 experts, 4096 tokens), native vs the oracle and the torch
  backend.
* A 1000-iteration soak with random routing and token counts, native vs the oracle and the torch backend.
* CUDA-graph capture of dispatch + combine without CPU sync, replayed on new inputs.
* A timeout: a peer that never dispatches makes the CPU wait raise TimeoutError naming the stage.
* Bad expert ids on one rank in a CPU-synced dispatch: every rank raises ValueError at once and the
  buffer keeps working.
* With two ranks on one GPU (COMMKIT_TEST_SHARE_GPU=1): the matrix, a soak and the timeout at EP 2 on
  the CUDA-IPC window, against the oracle.
* The overlapped modes (ELASTIC_EP_DISPATCH_OVERLAP=1: the copy epilogue runs beside the push and
  copies each chunk of slots as it lands; ELASTIC_EP_COMBINE_OVERLAP=1: one kernel whose first blocks
  push rows back while the others reduce each token chunk as it lands): the same matrices, a soak,
  CUDA graphs, the DeepSeek-V3 shape against the torch backend, one push block against many
  receivers, and a peer that never combines.
"""
import pytest
import torch

from tests._dist import run_workers
from tests.elastic_ep._workers import expect_timeout, matrix_worker, soak_worker

SMALL = dict(hidden=512, topk=8, experts=32, max_tokens=96, tokens=[96, 0, 61, 7])
BUFFERS = [dict(allow_multiple_reduction=True, deterministic=False),
           dict(allow_multiple_reduction=False, deterministic=True)]
# The overlapped dispatch and combine, with the default split of the grid and with a single push
# block (every receiving block then waits on one block's progress through the chunks).
OVERLAP = {"ELASTIC_EP_DISPATCH_OVERLAP": "1", "ELASTIC_EP_COMBINE_OVERLAP": "1"}
OVERLAP_ONE_PUSHER = dict(OVERLAP, ELASTIC_EP_DISPATCH_PUSH_BLOCKS="1", ELASTIC_EP_COMBINE_PUSH_BLOCKS="1")


def _world() -> int:
    return min(torch.cuda.device_count(), 8) if torch.cuda.is_available() else 0


@pytest.mark.smoke
@pytest.mark.gpu
def test_native_ep1_matrix(tmp_path):
    shape = dict(SMALL, tokens=[61])
    cfg = dict(device="cuda", backend="native", kind="gpu", shape=shape, buffers=BUFFERS, compare_torch=True)
    assert run_workers(matrix_worker, 1, cfg, tmp_path=tmp_path, timeout=120) == [2 * 12]


@pytest.mark.gpu
@pytest.mark.parametrize("env", [OVERLAP, OVERLAP_ONE_PUSHER], ids=["split3of8", "onepusher"])
def test_native_ep1_matrix_overlapped(tmp_path, env):
    shape = dict(SMALL, tokens=[61])
    cfg = dict(device="cuda", backend="native", kind="gpu", shape=shape, buffers=BUFFERS, compare_torch=True)
    assert run_workers(matrix_worker, 1, cfg, tmp_path=tmp_path, timeout=120, env=env) == [2 * 12]


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("env", [OVERLAP, OVERLAP_ONE_PUSHER], ids=["split3of8", "onepusher"])
def test_native_matrix_ipc_window_overlapped(tmp_path, env):
    cfg = dict(device="cuda", backend="native", kind="gpu", shape=SMALL, buffers=BUFFERS, compare_torch=False,
               window="ipc")
    assert run_workers(matrix_worker, 2, cfg, tmp_path=tmp_path, timeout=300, env=env) == [2 * 12] * 2


@pytest.mark.multigpu(2, shared_ok=True)  # the CUDA-IPC window needs no NCCL: ranks may share a GPU
def test_native_matrix_ipc_window(tmp_path):
    # The high-level mode matrix at EP 2 (deterministic mode included) on the CUDA-IPC window, checked
    # against the oracle only: with two ranks on one GPU the group is gloo, which the torch backend
    # cannot use for GPU tensors.
    cfg = dict(device="cuda", backend="native", kind="gpu", shape=SMALL, buffers=BUFFERS, compare_torch=False,
               window="ipc")
    assert run_workers(matrix_worker, 2, cfg, tmp_path=tmp_path, timeout=300) == [2 * 12] * 2


def epilogue_event_worker(rank, world, rdzv):
    """previous_event_before_epilogue gates combine's reduce (which reads the bias): a bias written on a
    side stream after a delay, with the event recorded behind the write, must be the one added."""
    from tests._dist import init_nccl
    from tests.elastic_ep._common import bytes_of, import_elastic_ep, make_inputs

    ep = import_elastic_ep()
    group = init_nccl(rank, world, rdzv)
    H, K, E, T = 512, 8, 32, 64
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, backend="native")
    inp = make_inputs(rank, T, H, K, E, "bf16", 5, "cuda")
    recv, _, rw, handle, _ = buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"],
                                          num_experts=E)
    bias = torch.randn((T, H), device="cuda").to(torch.bfloat16)
    want, _, _ = buf.combine(recv, handle, topk_weights=rw, bias=bias)
    torch.cuda.synchronize()
    late = torch.zeros_like(bias)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of ms: the push is long done before the bias lands
        late.copy_(bias)
        gate = buf.capture()
    got, _, ev = buf.combine(recv, handle, topk_weights=rw, bias=late, previous_event_before_epilogue=gate,
                             allocate_on_comm_stream=True)
    ev.current_stream_wait()
    torch.cuda.synchronize()
    assert torch.equal(bytes_of(got), bytes_of(want)), "the reduce ran before previous_event_before_epilogue"
    buf.destroy()
    return True


@pytest.mark.gpu
def test_native_combine_epilogue_event(tmp_path):
    assert run_workers(epilogue_event_worker, 1, tmp_path=tmp_path, timeout=120) == [True]


@pytest.mark.smoke
@pytest.mark.multigpu(2)
def test_native_matrix(tmp_path):
    world = _world()
    cfg = dict(device="cuda", backend="native", kind="gpu", shape=SMALL, buffers=BUFFERS, compare_torch=True)
    assert run_workers(matrix_worker, world, cfg, tmp_path=tmp_path, timeout=120) == [2 * 12] * world


@pytest.mark.multigpu(2)
def test_native_matrix_overlapped(tmp_path):
    world = _world()
    cfg = dict(device="cuda", backend="native", kind="gpu", shape=SMALL, buffers=BUFFERS, compare_torch=True)
    assert run_workers(matrix_worker, world, cfg, tmp_path=tmp_path, timeout=120, env=OVERLAP) == [2 * 12] * world


@pytest.mark.multigpu(2)
@pytest.mark.parametrize("env", [None, OVERLAP], ids=["sequential", "overlapped"])
def test_native_deepseek_shape(tmp_path, env):
    world = _world()
    shape = dict(hidden=7168, topk=8, experts=256, max_tokens=4096, tokens=[4096, 4095, 4000, 1])
    cases = []
    for dtype in ("bf16", "fp8", "fp8_ue8m0"):
        for expand in (False, True):
            cases.append(dict(dtype=dtype, expand=expand, cpu_sync=True, alignment=128 if expand else 1,
                              zero_padding=expand, num_bias=1, cached=expand, tma_sf=dtype == "fp8" and expand,
                              sf_strided_input=False, stream_opt="async", handle_copy=True,
                              zero_copy=not expand and dtype != "fp8_ue8m0"))
    # Checked against the plain oracle (a few seconds of CPU loops per case at this shape) as well as
    # against the torch backend, which shares the package's code and so is no independent reference.
    cfg = dict(device="cuda", backend="native", kind="gpu", shape=shape, cases=cases, oracle=True,
               buffers=[dict(allow_multiple_reduction=True)], compare_torch=True)
    assert run_workers(matrix_worker, world, cfg, tmp_path=tmp_path, timeout=300, env=env) == [len(cases)] * world


def check_step_against_oracle(group, rank, E, M, inp, outs, multiple_reduction, what):
    """One non-expand dispatch (alignment 1) + combine of ``inp`` whose experts returned
    bf16(row * rank_scale(rank)), checked bitwise against the independent oracle (all ranks' inputs,
    plain loops). ``outs``: (recv_x, recv_topk_idx, recv_topk_weights, handle, combined_x, combined_w)."""
    from tests.elastic_ep._common import (assert_same, bytes_of, canonical_dispatch, check, gather_inputs,
                                          oracle_canonical, oracle_combine, oracle_dispatch)

    recv, ridx, rw, handle, cx, cw = outs
    all_inp = gather_inputs(inp, group)
    orc = oracle_dispatch(all_inp, rank, E, M, 1)
    assert_same(oracle_canonical(orc, False, 1), canonical_dispatch(recv, ridx, rw, handle, False),
                f"{what}: dispatch vs oracle")
    exp_cx = oracle_combine(all_inp, rank, E, False, multiple_reduction, [None])
    check(torch.equal(bytes_of(cx.cpu()), bytes_of(exp_cx)), f"{what}: combine vs oracle")
    tk, w = all_inp[rank]["topk_idx"], all_inp[rank]["topk_weights"]
    exp_cw = torch.where(tk >= 0, w, torch.zeros_like(w))
    check(cw is not None and torch.equal(bytes_of(cw.cpu()), bytes_of(exp_cw)), f"{what}: combined weights vs oracle")


def graph_worker(rank, world, rdzv):
    from tests._dist import init_nccl
    from tests.elastic_ep._common import (bytes_of, canonical_dispatch, check, import_elastic_ep, make_inputs,
                                          raise_failures, rank_scale)

    ep = import_elastic_ep()
    group = init_nccl(rank, world, rdzv)
    H, K, E, M = 512, 4, 16, 64
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="native")
    ref = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="torch")
    static = make_inputs(rank, M, H, K, E, "bf16", 0, "cuda")

    def step():
        recv, ridx, rw, handle, ev = buf.dispatch(static["x"], topk_idx=static["topk_idx"],
                                                  topk_weights=static["topk_weights"], num_experts=E,
                                                  do_cpu_sync=False)
        y = (recv.float() * rank_scale(rank)).to(torch.bfloat16)  # the oracle's fake experts
        cx, cw, _ = buf.combine(y, handle, topk_weights=rw)
        return recv, ridx, rw, handle, cx, cw

    step()  # warm-up outside the graph
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    for it in range(3):
        new = make_inputs(rank, M, H, K, E, "bf16", 100 + it, "cuda")
        for k in static:
            static[k].copy_(new[k])
        g.replay()
        torch.cuda.synchronize()
        recv, ridx, rw, handle, cx, cw = outs
        check_step_against_oracle(group, rank, E, M, new, outs, buf.allow_multiple_reduction, f"graph replay {it}")
        # and the torch backend on the same inputs
        r = ref.dispatch(new["x"], topk_idx=new["topk_idx"], topk_weights=new["topk_weights"], num_experts=E)
        got = canonical_dispatch(recv, ridx, rw, handle, False)
        exp = canonical_dispatch(r[0], r[1], r[2], r[3], False)
        for key in ("psum_rank", "src", "x", "local_idx", "weights"):
            a, b = got[key], exp[key]
            check(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f"graph replay {it}: {key}")
        rcx, rcw, _ = ref.combine((r[0].float() * rank_scale(rank)).to(torch.bfloat16), r[3], topk_weights=r[2])
        check(torch.equal(bytes_of(cx.cpu()), bytes_of(rcx.cpu())), f"graph replay {it}: combine")
        check(torch.equal(bytes_of(cw.cpu()), bytes_of(rcw.cpu())), f"graph replay {it}: combined weights")
    del g
    buf.destroy()
    ref.destroy()
    raise_failures(rank)
    return True


@pytest.mark.multigpu(2)
@pytest.mark.parametrize("env", [None, OVERLAP], ids=["sequential", "overlapped"])
def test_native_cuda_graph(tmp_path, env):
    world = _world()
    assert run_workers(graph_worker, world, tmp_path=tmp_path, timeout=90, env=env) == [True] * world


@pytest.mark.gpu
@pytest.mark.parametrize("env", [None, OVERLAP], ids=["sequential", "overlapped"])
def test_native_ep1_cuda_graph(tmp_path, env):
    # One GPU: capture joins the communication stream to torch's capture stream and back inside the
    # native runtime (event record + stream wait), which a graph must accept. The overlapped combine's
    # block tickets and arrival counters live on the device, so replays must reset them themselves.
    assert run_workers(graph_worker, 1, tmp_path=tmp_path, timeout=90, env=env) == [True]


def timeout_worker(rank, world, rdzv, window="auto"):
    import time

    from tests.elastic_ep._common import import_elastic_ep, init_ep_group, make_inputs

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, window)
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=32, hidden=256, num_topk=2, backend="native",
                           num_cpu_timeout_secs=3, num_gpu_timeout_secs=3, explicitly_destroy=True, window=window)
    if rank != 0:
        time.sleep(15)  # never joins the dispatch
        return "idle"
    inp = make_inputs(rank, 32, 256, 2, 8 * world, "bf16", 0, "cuda")
    return expect_timeout(buf, "dispatch",
                          lambda: buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], num_experts=8 * world,
                                               do_cpu_sync=True))


@pytest.mark.multigpu(2)
@pytest.mark.fault
def test_native_timeout(tmp_path):
    world = _world()
    res = run_workers(timeout_worker, world, tmp_path=tmp_path, timeout=60)
    assert res[0] == "timeout"


@pytest.mark.multigpu(2, shared_ok=True)  # the CUDA-IPC window needs no NCCL: ranks may share a GPU
@pytest.mark.parametrize("env", [None, OVERLAP], ids=["sequential", "overlapped"])
@pytest.mark.fault
def test_native_timeout_ipc_window(tmp_path, env):
    res = run_workers(timeout_worker, 2, "ipc", tmp_path=tmp_path, timeout=60, env=env)
    assert res[0] == "timeout"


def late_peer_worker(rank, world, rdzv, window="auto"):
    """Rank 1 reaches the dispatch only after rank 0's notify gave up on it. Rank 1's notify then sees
    everything rank 0 published before it gave up (barrier, counts), but rank 0 pushed nothing: rank 1
    must time out too (naming the dispatch and peer 0), not return rows that were never written."""
    import time

    from tests.elastic_ep._common import import_elastic_ep, init_ep_group, make_inputs

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, window)
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=32, hidden=256, num_topk=2, backend="native",
                           num_cpu_timeout_secs=3, num_gpu_timeout_secs=3, explicitly_destroy=True, window=window)
    inp = make_inputs(rank, 32, 256, 2, 8 * world, "bf16", 0, "cuda")
    if rank != 0:
        time.sleep(6)  # rank 0's notify has timed out by now
    t0 = time.monotonic()
    try:
        buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], num_experts=8 * world, do_cpu_sync=True)
        torch.cuda.synchronize()
        buf.barrier(with_cpu_sync=True)
    except TimeoutError as e:
        msg = str(e)
        assert time.monotonic() - t0 < 14, "the timeout took too long"
        assert "dispatch" in msg.lower() and f"rank {rank}" in msg and f"peer {1 - rank}" in msg, msg
        assert int(torch.arange(10, device="cuda").sum()) == 45
        if rank == 0:
            time.sleep(10)  # keep this rank's window mapped while rank 1 still writes into it
        return "timeout"
    raise AssertionError(f"rank {rank}: a dispatch whose peer had given up returned without an error")


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("env", [None, OVERLAP], ids=["sequential", "overlapped"])
@pytest.mark.fault
def test_native_late_peer_times_out_ipc_window(tmp_path, env):
    res = run_workers(late_peer_worker, 2, "ipc", tmp_path=tmp_path, timeout=90, env=env)
    assert res == ["timeout", "timeout"]


def combine_timeout_worker(rank, world, rdzv, window="auto"):
    """Every rank dispatches; the last rank then never combines. Every other rank's overlapped combine
    must raise a TimeoutError naming the combine, itself and the absent rank, within the deadline, and
    leave CUDA usable. With 3 or more ranks a rank's reduce also waits for rows from present peers
    whose pushes wait for the absent rank: the error must still name the absent one."""
    import time

    from tests.elastic_ep._common import import_elastic_ep, init_ep_group, make_inputs

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, window)
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=64, hidden=256, num_topk=2, backend="native",
                           num_cpu_timeout_secs=3, num_gpu_timeout_secs=3, explicitly_destroy=True, window=window)
    inp = make_inputs(rank, 64, 256, 2, 8 * world, "bf16", 3, "cuda")
    recv, _, rw, handle, _ = buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"],
                                          num_experts=8 * world, do_cpu_sync=True)
    torch.cuda.synchronize()
    if rank == world - 1:
        time.sleep(15)  # never joins the combine
        return "idle"
    return expect_timeout(buf, "combine", lambda: buf.combine(recv, handle, topk_weights=rw), rank=rank,
                          peer=world - 1)


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.fault
def test_native_combine_timeout_ipc_window_overlapped(tmp_path):
    res = run_workers(combine_timeout_worker, 2, "ipc", tmp_path=tmp_path, timeout=60, env=OVERLAP)
    assert res == ["timeout", "idle"]


@pytest.mark.multigpu(3, shared_ok=True)
@pytest.mark.parametrize("env", [None, OVERLAP], ids=["sequential", "overlapped"])
@pytest.mark.fault
def test_native_combine_timeout_ep3_ipc_window(tmp_path, env):
    res = run_workers(combine_timeout_worker, 3, "ipc", tmp_path=tmp_path, timeout=90, env=env)
    assert res == ["timeout", "timeout", "idle"]


def refusal_worker(rank, world, rdzv, window="auto"):
    """Rank 0 passes expert ids outside [-1, E) to a CPU-synced dispatch: every rank must raise
    ValueError at once (rank 0 with the count, the others naming rank 0), count nothing into the
    statistics, and then run a valid dispatch + combine bitwise equal to the oracle on the same buffer."""
    import time

    from tests.elastic_ep._common import import_elastic_ep, init_ep_group, make_inputs, raise_failures
    from tests.elastic_ep._workers import run_case

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, window)
    H, K, T = 256, 4, 48
    E = 8 * world
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, backend="native",
                           num_cpu_timeout_secs=20, num_gpu_timeout_secs=20, explicitly_destroy=True, window=window)
    inp = make_inputs(rank, T, H, K, E, "bf16", 7, "cuda")
    stats = torch.zeros(E // world, dtype=torch.int32, device="cuda")
    idx = inp["topk_idx"].clone()
    if rank == 0:
        idx[3, 1], idx[10, 0] = E + 2, -5
    for attempt in range(2):  # refused twice in a row: the epochs stay in step
        t0 = time.monotonic()
        try:
            buf.dispatch(inp["x"], topk_idx=idx, topk_weights=inp["topk_weights"], num_experts=E,
                         cumulative_local_expert_recv_stats=stats)
        except ValueError as e:
            msg = str(e)
        else:
            raise AssertionError("a dispatch with bad expert ids was not refused")
        assert time.monotonic() - t0 < 8, "the refusal waited for a deadline"
        if rank == 0:
            assert "expert ids must be in [-1," in msg and "got 2 outside" in msg, msg
        else:
            assert msg.startswith("dispatch refused") and "[0]" in msg, msg
        assert int(stats.abs().sum()) == 0, "a refused dispatch counted tokens"
    case = dict(dtype="bf16", expand=False, cpu_sync=True, alignment=1, zero_padding=False, num_bias=1,
                cached=True, tma_sf=False, sf_strided_input=False, stream_opt="sync", handle_copy=False)
    run_case(buf, None, group, rank, world, case, dict(hidden=H, topk=K, experts=E, max_tokens=T, tokens=T - rank),
             seed=5, with_oracle=True)
    buf.destroy()
    raise_failures(rank)
    return "refused"


@pytest.mark.gpu
def test_native_ep1_bad_ids_refused(tmp_path):
    assert run_workers(refusal_worker, 1, tmp_path=tmp_path, timeout=120) == ["refused"]


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("env", [None, OVERLAP], ids=["sequential", "overlapped"])
@pytest.mark.fault
def test_native_bad_ids_refused_ipc_window(tmp_path, env):
    assert run_workers(refusal_worker, 2, "ipc", tmp_path=tmp_path, timeout=120, env=env) == ["refused"] * 2


@pytest.mark.multigpu(2)
@pytest.mark.fault
def test_native_bad_ids_refused(tmp_path):
    world = _world()
    assert run_workers(refusal_worker, world, tmp_path=tmp_path, timeout=120) == ["refused"] * world


def reuse_worker(rank, world, rdzv):
    from tests._dist import init_nccl
    from tests.elastic_ep._common import import_elastic_ep, raise_failures
    from tests.elastic_ep._workers import run_case

    ep = import_elastic_ep()
    group = init_nccl(rank, world, rdzv)
    kw = dict(num_max_tokens_per_rank=64, hidden=256, num_topk=4, use_fp8_dispatch=True)
    buf = ep.ElasticBuffer(group, backend="native", **kw)
    ref = ep.ElasticBuffer(group, backend="torch", **kw)
    case = dict(dtype="bf16", expand=True, cpu_sync=True, alignment=4, zero_padding=True, num_bias=1, cached=True,
                tma_sf=False, sf_strided_input=False, stream_opt="async", handle_copy=True)
    run_case(buf, ref, group, rank, world, case, dict(hidden=256, topk=4, experts=16, max_tokens=64, tokens=50),
             seed=77, with_oracle=True)
    source = buf.comm_source
    buf.destroy()
    ref.destroy()
    raise_failures(rank)
    return source


@pytest.mark.multigpu(2)
def test_native_on_torch_communicator(tmp_path):
    """The default set-up: the native buffer on torch's own NCCL communicator. The buffer falls back to
    a communicator of its own when torch's fails on any rank (comm_source "own" / "own (torch's
    communicator failed: ...)"); that fallback must not pass this test."""
    world = _world()
    res = run_workers(reuse_worker, world, tmp_path=tmp_path, timeout=90, env={"EP_REUSE_NCCL_COMM": "1"})
    print(f"communicator used by the native buffer: {res}")
    assert res == ["torch"] * world, res


@pytest.mark.multigpu(2)
@pytest.mark.slow
def test_native_soak_1000(tmp_path):
    world = _world()
    assert run_workers(soak_worker, world, 1000, tmp_path=tmp_path, timeout=420) == [1000] * world


@pytest.mark.multigpu(2, shared_ok=True)  # the CUDA-IPC window needs no NCCL: ranks may share a GPU
def test_native_soak_ipc_window(tmp_path):
    # 300 random cases (token counts 0..64 per rank, bf16/fp8, expand, alignment, CPU sync on/off,
    # cached, async) at EP 2 on the CUDA-IPC window, each against the oracle.
    assert run_workers(soak_worker, 2, 300, "ipc", tmp_path=tmp_path, timeout=300) == [300] * 2


# EP 4 on the CUDA-IPC window (one GPU per rank where there are four, else ranks sharing GPUs with
# COMMKIT_TEST_SHARE_GPU=1): every rank both sends to and receives from three peers.
@pytest.mark.multigpu(4, shared_ok=True)
@pytest.mark.parametrize("env", [None, OVERLAP], ids=["sequential", "overlapped"])
def test_native_ep4_ipc_window(tmp_path, env):
    cfg = dict(device="cuda", backend="native", kind="gpu", shape=SMALL, buffers=BUFFERS, compare_torch=False,
               window="ipc")  # SMALL's token counts [96, 0, 61, 7]: one per rank
    assert run_workers(matrix_worker, 4, cfg, tmp_path=tmp_path, timeout=300, env=env) == [2 * 12] * 4
    assert run_workers(soak_worker, 4, 100, "ipc", tmp_path=tmp_path, timeout=300, env=env) == [100] * 4


@pytest.mark.gpu
def test_native_ep1_epoch_wrap(tmp_path):
    # Starts 6 operations before the count words' 32-bit tags wrap; each case is several operations.
    assert run_workers(soak_worker, 1, 12, "auto", 2**32 - 6, tmp_path=tmp_path, timeout=120) == [12]


@pytest.mark.multigpu(2, shared_ok=True)
def test_native_epoch_wrap_ipc_window(tmp_path):
    assert run_workers(soak_worker, 2, 12, "ipc", 2**32 - 6, tmp_path=tmp_path, timeout=180) == [12] * 2


@pytest.mark.multigpu(2, shared_ok=True)
def test_native_soak_ipc_window_overlapped(tmp_path):
    assert run_workers(soak_worker, 2, 150, "ipc", tmp_path=tmp_path, timeout=300, env=OVERLAP) == [150] * 2
