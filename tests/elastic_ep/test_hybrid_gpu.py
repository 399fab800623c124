"""Hybrid mode on the native runtime: its kernels (csrc/kernels/hybrid.cuh) over the NVLink-emulated
scale-out transport, with the logical domains of ``ELASTIC_EP_NUM_SCALEUP_RANKS``, on the CUDA-IPC
window (ranks share one GPU where fewer GPUs are lent).

* The mode matrix (bf16 / FP8 with both scale kinds, expand with alignment and zero padding, CPU sync
  on/off, cached, 0/1/2 biases, the four stream options, single and multiple reduction, deterministic)
  at R = 2 (1x2: the override naming every rank, i.e. direct mode; 2x1) and R = 4 (2x2, 4x1): canonical
  outputs bitwise equal to a direct-mode buffer on the same window and to the oracle.
* A soak of 500 random cases at 2x2, each against direct mode and the oracle.
* The forwarders' metadata against an independent derivation from the routing; zero-copy refused.
* A rank whose scale-out signals never arrive: its rail peer's forwarder times out naming the
  dispatch's scale-out stage, the rank and the peer, and CUDA stays usable; a rank of the forwarder's
  domain that waits for the rows it never relays names the forwarder as the peer, and the rows' source.
* ``barrier()`` in hybrid mode waits for every rank, also those a rank never talks to (neither its
  domain nor a rail peer), and the epoch wrap of the count words holds for the relayed ones.
"""
import os
import time

import pytest
import torch

from tests._dist import run_workers
from tests.elastic_ep._workers import case_matrix, expect_timeout, matrix_worker, soak_worker

SMALL = dict(hidden=256, topk=4, experts=16, max_tokens=48, tokens=[40, 0, 48, 17])
BUFFERS = [dict(allow_multiple_reduction=True, deterministic=False),
           dict(allow_multiple_reduction=False, deterministic=True)]


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("world,scaleup", [(2, 2), (2, 1), (4, 2), (4, 1)], ids=["1x2", "2x1", "2x2", "4x1"])
def test_native_hybrid_matrix_matches_direct_and_oracle(tmp_path, world, scaleup):
    cases = [dict(c, zero_copy=False) for c in case_matrix("gpu")]  # hybrid mode refuses zero-copy
    cfg = dict(device="cuda", backend="native", kind="gpu", shape=SMALL, buffers=BUFFERS, seed=20 + world,
               window="ipc", compare_direct=True, num_scaleup_ranks=scaleup, cases=cases)
    assert run_workers(matrix_worker, world, cfg, tmp_path=tmp_path, timeout=300) == [len(BUFFERS) * 12] * world


@pytest.mark.multigpu(2, shared_ok=True)
def test_native_hybrid_soak_500_against_direct_and_oracle(tmp_path):
    assert run_workers(soak_worker, 4, 500, "ipc", 0, 2, tmp_path=tmp_path, timeout=540) == [500] * 4


@pytest.mark.multigpu(2, shared_ok=True)
def test_native_hybrid_epoch_wrap(tmp_path):
    """Across the 32-bit wrap of the count words' tags, the relayed ones (hybrid notify's count_relay)
    included: seeded 6 operations before 2^32."""
    assert run_workers(soak_worker, 4, 12, "ipc", 2**32 - 6, 2, tmp_path=tmp_path, timeout=240) == [12] * 4


def _forward_worker(rank, world, rdzv, cfg):
    from tests.elastic_ep._common import gather_inputs, import_elastic_ep, init_ep_group, make_inputs, scaleup_override
    from tests.elastic_ep._workers import check_forward_metadata

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, "ipc")
    U, H, K, E, M = cfg["scaleup"], 64, 4, 24, 20
    with scaleup_override(U):
        buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend="native",
                               window="ipc")
    inp = make_inputs(rank, [20, 7, 0, 13, 20, 3][rank], H, K, E, "bf16", seed=3, device="cuda")
    everyone = gather_inputs(inp, group)
    relayed = 0
    for cpu_sync in (True, False):
        _, _, _, handle, _ = buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"],
                                          num_experts=E, do_cpu_sync=cpu_sync)
        relayed = check_forward_metadata(handle, everyone, rank, world, U, E, M)
        # A cached dispatch keeps the handle's metadata (the routing is the same).
        meta = handle.token_metadata_at_forward
        buf.dispatch(inp["x"], handle=handle)
        assert handle.token_metadata_at_forward is meta
    with pytest.raises(ValueError, match="zero_copy"):
        buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], num_experts=E, zero_copy=True)
    torch.cuda.synchronize()
    buf.barrier(with_cpu_sync=True)  # still usable: the refusal launched nothing
    buf.destroy()
    return relayed


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.parametrize("world,scaleup", [(4, 2), (6, 3), (6, 2)], ids=["2x2", "2x3", "3x2"])
def test_native_hybrid_forward_metadata(tmp_path, world, scaleup):
    relayed = run_workers(_forward_worker, world, dict(scaleup=scaleup), tmp_path=tmp_path, timeout=180)
    assert sum(relayed) > 0


def _timeout_worker(rank, world, rdzv):
    from tests.elastic_ep._common import import_elastic_ep, init_ep_group, make_inputs, scaleup_override

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, "ipc")
    if rank == 0:  # its pushes raise no scale-out signal: rank 2, its rail peer, never sees its tokens
        os.environ["ELASTIC_EP_TEST_DROP_SCALEOUT_SIGNALS"] = "1"
    with scaleup_override(2):
        buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=64, num_topk=2, backend="native",
                               window="ipc", num_cpu_timeout_secs=3, num_gpu_timeout_secs=3, explicitly_destroy=True)
    inp = make_inputs(rank, 8, 64, 2, 8, "bf16", seed=1, device="cuda")
    call = lambda: buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"],  # noqa: E731
                                num_experts=8)
    if rank != 2:
        got = "other"
        try:
            call()
            torch.cuda.synchronize()
            buf.barrier(with_cpu_sync=True)
        except TimeoutError as e:
            got = str(e)  # rank 3 waits for rank 0's rows, which rank 2 never relays, and times out too
        time.sleep(12)  # keep this rank's window mapped while rank 2 times out
        return got
    return expect_timeout(buf, "dispatch scale-out stage", call, rank=2, peer=0)


@pytest.mark.multigpu(2, shared_ok=True)
@pytest.mark.fault
def test_native_hybrid_scaleout_peer_never_signals_times_out(tmp_path):
    res = run_workers(_timeout_worker, 4, tmp_path=tmp_path, timeout=90)
    assert res[2] == "timeout"
    # Rank 3 (domain 1, rail 1) gets rank 0's rows from rank 2, its domain's rank on rank 0's rail: its
    # timeout names rank 2 as the peer that did not deliver, and rank 0 as the rank whose rows they are.
    assert "dispatch epilogue" in res[3] and "[rank 3, peer 2]" in res[3], res[3]
    assert "rank 0's, which rank 2 (the peer) relays to this domain" in res[3], res[3]


def _barrier_worker(rank, world, rdzv):
    from tests.elastic_ep._common import import_elastic_ep, init_ep_group, scaleup_override

    ep = import_elastic_ep()
    group = init_ep_group(rank, world, rdzv, "ipc")
    with scaleup_override(2):
        buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=64, num_topk=2, backend="native",
                               window="ipc")
    buf.barrier(with_cpu_sync=True)  # every rank's kernels are loaded and its window in use
    group.barrier()
    t0 = time.monotonic()
    if rank == 3:  # neither in rank 0's domain nor its rail peer
        time.sleep(2.0)
    buf.barrier(with_cpu_sync=True)
    waited = time.monotonic() - t0
    buf.destroy()
    return waited


@pytest.mark.multigpu(2, shared_ok=True)
def test_native_hybrid_barrier_waits_for_every_rank(tmp_path):
    """At 2x2 rank 0 hears from ranks 1 (its domain) and 2 (its rail peer) only; its barrier still ends
    after rank 3 arrived 2 s late (the second round inside the domain)."""
    waited = run_workers(_barrier_worker, 4, tmp_path=tmp_path, timeout=120)
    assert min(waited) >= 1.5, f"a rank left the barrier before rank 3 arrived: {waited}"
