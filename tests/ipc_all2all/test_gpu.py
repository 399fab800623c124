"""GPU tests of ipc_all2all: one process per visible GPU (any count >= 2, at most 8)."""
from __future__ import annotations

import pytest
import torch

from tests._dist import run_workers
from tests.ipc_all2all import _fault_workers as fw, _workers as w

ALL_DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]


def _world() -> int:
    """One rank per GPU (2..8); with COMMKIT_TEST_SHARE_GPU=1 on one GPU, two ranks share it."""
    return max(2, min(8, torch.cuda.device_count() if torch.cuda.is_available() else 2))


# Every test here also runs with ranks sharing a GPU (see tests/conftest.py): correctness only.
MULTI = pytest.mark.multigpu(2, shared_ok=True)


@pytest.mark.smoke
@MULTI
@pytest.mark.parametrize("reverse_devices,dtypes", [(False, ALL_DTYPES), (True, ["bfloat16"])],
                         ids=["rank=device", "rank!=device"])
def test_matches_torch_nccl_path(tmp_path, reverse_devices, dtypes):
    """Bitwise equality with permute -> all_to_all_single -> permute and all_gather_into_tensor for
    bf16/fp16/fp32/e4m3/e5m2, batch 1-2, head_dim 64/128, even and uneven counts (a rank with 0),
    plus the round trip gather_heads(send_recv_heads(x)) == x, views and copies."""
    res = run_workers(w.worker_matches_nccl, _world(), reverse_devices, dtypes, tmp_path=tmp_path, timeout=200)
    assert all(r == len(dtypes) * 2 * 2 * 3 * 2 for r in res)


@MULTI
@pytest.mark.parametrize("copy_output", [False, True], ids=["view", "copy"])
def test_back_to_back_with_skew(tmp_path, copy_output):
    """1000 round trips on one instance, one rank randomly delayed, every output checked on the GPU."""
    res = run_workers(w.worker_stress, _world(), 1000, copy_output, tmp_path=tmp_path, timeout=150)
    assert res == [1000] * _world()


@MULTI
def test_cuda_graph_replay_with_changing_counts(tmp_path):
    res = run_workers(w.worker_cuda_graph, _world(), tmp_path=tmp_path, timeout=120)
    assert res == [6] * _world()


@MULTI
@pytest.mark.fault
def test_skipped_call_times_out_with_a_clear_error(tmp_path, record_property):
    """A rank skips a call: the others raise CommTimeoutError naming operation, rank and peer within the
    deadline; a call they had queued behind the failed one does not run (CommError, not a second
    timeout); the late rank's own call fails at once; a new instance works."""
    world = _world()
    res = run_workers(fw.worker_timeout, world, tmp_path=tmp_path, timeout=120)
    for rank, r in enumerate(res[:-1]):
        assert r["rank"] == rank and r["peer"] == world - 1, r
        assert "send_recv_heads" in r["op"], r
        assert r["elapsed"] < 1.0 + 10.0, r  # 1 s deadline plus launch and teardown slack
        assert r["queued_s"] < 5.0, r        # abandoned (CommError, checked by the worker), no hang
    late = res[-1]
    assert late["peer"] in range(world - 1) and late["late_s"] < 1.0, late
    record_property("detect_s", max(r["elapsed"] for r in res[:-1]))  # the 1 s deadline included


@MULTI
@pytest.mark.fault
def test_skipped_call_with_different_operation_raises_on_every_rank(tmp_path, record_property):
    """Rank 1 skips one call of several and carries on, so its gather_heads meets the others'
    send_recv_heads: the handshake signature tells them apart and every rank raises (no garbage, no
    wait for the deadline); the calls before the skipped one were right."""
    world = _world()
    res = run_workers(fw.worker_skipped_call, world, tmp_path=tmp_path, timeout=120)
    for rank, r in enumerate(res):
        assert r["rank"] == rank and r["elapsed"] < 15.0, r  # deadline 30 s: not a timeout
        if rank == 1:
            assert "is running send_recv_heads while this rank runs gather_heads" in r["msg"], r
        else:
            assert r["peer"] == 1 and "peer 1 is running gather_heads while this rank runs send_recv_heads" \
                in r["msg"], r
    record_property("detect_s", max(r["elapsed"] for r in res))


@pytest.mark.multigpu(3, shared_ok=True)
@pytest.mark.fault
def test_skipped_call_three_ranks(tmp_path):
    """The two skipped-call cases with 3 ranks, where a rank marked failed by one peer is still awaited
    by another: it posts its entry as abandoned, so nobody waits out a deadline for it (the mismatch
    case has a 30 s deadline and must end in well under it on every rank)."""
    res = run_workers(fw.worker_skipped_call, 3, tmp_path=tmp_path, timeout=120)
    for rank, r in enumerate(res):
        assert r["rank"] == rank and r["elapsed"] < 15.0, r
        if rank != 1:
            assert r["peer"] == 1 and "peer 1 is running gather_heads while this rank runs send_recv_heads" \
                in r["msg"], r
    res = run_workers(fw.worker_timeout, 3, tmp_path=tmp_path, timeout=120)
    for rank, r in enumerate(res[:-1]):
        assert r["rank"] == rank and r["peer"] == 2 and r["elapsed"] < 11.0 and r["queued_s"] < 5.0, r
    assert res[-1]["peer"] in (0, 1) and res[-1]["late_s"] < 1.0, res[-1]


@MULTI
def test_calls_on_two_streams_run_one_after_the_other(tmp_path):
    res = run_workers(w.worker_two_streams, _world(), 60, tmp_path=tmp_path, timeout=120)
    assert res == [60] * _world()


@MULTI
def test_handle_checks_view_lifetime_and_graph_rules(tmp_path):
    res = run_workers(fw.worker_lifetimes_and_checks, _world(), tmp_path=tmp_path, timeout=120)
    assert res == [True] * _world()


@MULTI
def test_view_dropped_inside_a_capture_frees_after_it(tmp_path):
    res = run_workers(fw.worker_release_in_capture, _world(), tmp_path=tmp_path, timeout=120)
    assert res == [True] * _world()


@pytest.mark.smoke
@MULTI
def test_validation_before_launch(tmp_path):
    res = run_workers(w.worker_validation, _world(), tmp_path=tmp_path, timeout=120)
    assert len(res[0]) == 10, res[0]


@MULTI
def test_create_destroy_loop_leaks_nothing(tmp_path):
    res = run_workers(fw.worker_leak, _world(), 30, tmp_path=tmp_path, timeout=150)
    print("device bytes lost over 30 loops per rank:", res)


@pytest.mark.smoke
@MULTI
def test_torch_compile_fullgraph(tmp_path):
    run_workers(w.worker_compile, _world(), tmp_path=tmp_path, timeout=240,
                env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})


@MULTI
def test_fp8_wire_matches_reference(tmp_path):
    """fp8 on the wire (e4m3 + one fp32 scale per head vector): bitwise equal to the exact path applied
    to the plain-torch e4m3 round trip, head_dim 16-256, batch 1-2, even and uneven counts."""
    res = run_workers(w.worker_fp8_wire, _world(), tmp_path=tmp_path, timeout=200)
    assert res == [2 * 4 * 3] * _world()


# Correctness at W = 3 and 4 (more peers than one: rotation of targets, prefix sums over several
# ranks, W-way handshakes). One GPU per rank where there are enough, else with
# COMMKIT_TEST_SHARE_GPU=1 several ranks per GPU (correctness only).
@pytest.mark.multigpu(4, shared_ok=True)
def test_four_ranks_match_torch_path(tmp_path):
    dtypes = ["bfloat16", "float32", "float8_e4m3fn"]  # element sizes 2, 4 and 1
    res = run_workers(w.worker_matches_nccl, 4, False, dtypes, tmp_path=tmp_path, timeout=300)
    assert all(r == len(dtypes) * 2 * 2 * 3 * 2 for r in res), res


@pytest.mark.multigpu(3, shared_ok=True)
def test_three_ranks_back_to_back_and_graphs(tmp_path):
    assert run_workers(w.worker_stress, 3, 200, False, tmp_path=tmp_path, timeout=200) == [200] * 3
    assert run_workers(w.worker_cuda_graph, 3, tmp_path=tmp_path, timeout=150) == [6] * 3


@pytest.mark.multigpu(4, shared_ok=True)
def test_four_ranks_fp8_wire(tmp_path):
    assert run_workers(w.worker_fp8_wire, 4, tmp_path=tmp_path, timeout=200) == [2 * 4 * 3] * 4


@pytest.mark.gpu
@pytest.mark.fault
def test_destroy_racing_calls_in_another_thread(tmp_path):
    """destroy() (which waits for the device without the GIL) while another thread keeps calling: every
    call completes or raises CommError "destroyed", none touches freed memory, the context stays usable.
    Not yet run on a GPU."""
    (ends,) = run_workers(fw.worker_destroy_races_calls, 1, 50, tmp_path=tmp_path, timeout=180)
    assert ends["refused"] == 50, ends
