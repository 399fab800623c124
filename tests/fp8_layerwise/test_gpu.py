"""The same delivery on real GPUs (CUDA backend: cudaMemcpyAsync from registered shm)."""
import pytest

import fp8_layerwise as F
from tests._dist import run_workers
from tests.fp8_layerwise import _workers as W

pytestmark = pytest.mark.skipif(not F.built_with_cuda(), reason="built without CUDA")


def _assert_delivery(res):
    for rank, rows in enumerate(res):
        for row in rows:
            assert row["bad"] == [], (rank, row)
            assert row["bytes"] == row["want"], (rank, row)
            assert row["untouched"], (rank, row)


@pytest.mark.smoke
@pytest.mark.gpu
def test_gpu_tp1(tmp_path):
    # Copy streams 1 (KTransformers' design), 2 (the default) and 4: a batch's copies spread over streams.
    res = run_workers(W.delivery, 1, str(tmp_path), (2, 4), (1, 7, 12), False, "cuda", (1, 2, 4),
                      tmp_path=tmp_path, timeout=240)
    _assert_delivery(res)
    assert {(r["slots"], r["streams"]) for r in res[0]} == {(s, c) for s in (2, 4) for c in (1, 2, 4)}
    # coalesce_wait=True delivers the same bytes (its own folder: a second run of workers)
    wait_dir = tmp_path / "coalesce_wait"
    wait_dir.mkdir()
    _assert_delivery(run_workers(W.delivery, 1, str(wait_dir), (4, 8), (1, 12), False, "cuda", (2,), True,
                                 tmp_path=wait_dir, timeout=240))


@pytest.mark.smoke
@pytest.mark.multigpu(2, shared_ok=True)  # no NCCL between ranks: they may share a GPU
def test_gpu_tp2_one_rank_per_gpu(tmp_path):
    _assert_delivery(run_workers(W.delivery, 2, str(tmp_path), (2, 3, 8), (1, 5, 12), True, "cuda",
                                 tmp_path=tmp_path, timeout=240))


@pytest.mark.smoke
@pytest.mark.multigpu(2, shared_ok=True)  # no NCCL between ranks: they may share a GPU
def test_gpu_tp4_two_ranks_per_gpu(tmp_path):
    _assert_delivery(run_workers(W.delivery, 4, str(tmp_path), (4,), (1, 12), False, "cuda",
                                 tmp_path=tmp_path, timeout=240))


@pytest.mark.smoke
@pytest.mark.multigpu(2, shared_ok=True)  # no NCCL between ranks: they may share a GPU
def test_gpu_ktransformers_design_and_default(tmp_path):
    res = run_workers(W.ktransformers_vs_default, 2, str(tmp_path), "cuda", tmp_path=tmp_path, timeout=240)
    for rows in res:
        ktransformers, default = rows
        assert ktransformers["bad"] == [] and default["bad"] == []
        assert ktransformers["bytes"] == ktransformers["want"] == default["bytes"]
        assert ktransformers["copies"] == 4 * 16 and default["copies"] <= ktransformers["copies"]


@pytest.mark.smoke
@pytest.mark.multigpu(2, shared_ok=True)  # no NCCL between ranks: they may share a GPU
@pytest.mark.fault
def test_gpu_python_writer_error_then_reset(tmp_path):
    res = run_workers(W.writer_error_reset, 2, str(tmp_path), "cuda", tmp_path=tmp_path, timeout=240)
    for r in res:
        assert r["first"][:3] == ("TransportPoisoned", F.ErrorCode.WRITER, 0), r
        assert "ValueError: synthetic writer failure" in r["first"][3], r
        assert r["generation"] == 1 and r["exact"] and r["bytes"], r
