"""The full Python API on the torch backend with gloo (CPU, CI), checked against the plain oracle.

Every dispatch/combine mode (bf16 / FP8 with FP32 or UE8M0 scales, expand with alignment and zero
padding, CPU sync or worst-case outputs, cached mode, 0/1/2 biases, single and multiple reduction,
deterministic ordering, TMA column-major scales, strided input scales) on 2, 3 and 4 ranks with
different token counts per rank, including a rank with 0 tokens. Expanded rows are placed in a
random order inside each expert segment (as the native kernels' atomics may), so the canonical
comparison and the deterministic sort are exercised on the CPU too.
"""
import pytest

from tests._dist import run_workers
from tests.elastic_ep._workers import matrix_worker

SMALL = dict(hidden=256, topk=4, experts=16, max_tokens=48, tokens=[40, 0, 48, 17])
BUFFERS = [dict(allow_multiple_reduction=True, deterministic=False),
           dict(allow_multiple_reduction=False, deterministic=True)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_matrix_torch_backend_gloo(tmp_path, world):
    shape = dict(SMALL)
    if world == 3:
        shape.update(topk=2, experts=12)  # R > K: combine slots by master lane
    cfg = dict(device="cpu", backend="torch", kind="cpu", shape=shape, buffers=BUFFERS, seed=world, shuffle=True)
    done = run_workers(matrix_worker, world, cfg, tmp_path=tmp_path, timeout=300)
    assert done == [len(BUFFERS) * 12] * world


def _one_row_worker(rank, world, rdzv):
    import torch
    import torch.distributed as dist

    from tests._dist import init_gloo
    from tests.elastic_ep._common import bytes_of, import_elastic_ep

    ep = import_elastic_ep()
    group = init_gloo(rank, world, rdzv)
    H, E = 128, 4
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=2, hidden=H, num_topk=1, use_fp8_dispatch=True,
                           backend="torch")
    # Rank 0 sends one FP8 token (record 128 + 4 bytes: the top-k ids sit at a 4 mod 8 offset) to rank 1's
    # expert; rank 1 sends none (an empty FP8 input).
    T = 1 if rank == 0 else 0
    x = (torch.arange(T * H, dtype=torch.float32).reshape(T, H) / 64).to(torch.float8_e4m3fn)
    sf = torch.full((T, 1), 0.5 + rank)
    topk = torch.full((T, 1), 3, dtype=torch.int64)
    (rx, rsf), ridx, rw, h, _ = buf.dispatch((x, sf), topk_idx=topk, topk_weights=torch.ones(T, 1), num_experts=E)
    if rank == 1:
        want = (torch.arange(H, dtype=torch.float32).reshape(1, H) / 64).to(torch.float8_e4m3fn)
        assert torch.equal(bytes_of(rx), bytes_of(want)) and torch.equal(rsf, torch.full((1, 1), 0.5))
        assert ridx.tolist() == [[1]] and rw.tolist() == [[1.0]]
    else:
        assert rx.shape == (0, H)
    y = rx.to(torch.float32).to(torch.bfloat16)
    cx, _, _ = buf.combine(y, h)
    if rank == 0:
        assert torch.equal(bytes_of(cx), bytes_of(x.to(torch.float32).to(torch.bfloat16)))
    buf.destroy()
    dist.destroy_process_group()
    return rx.shape[0]


def test_one_received_row_and_no_tokens_fp8(tmp_path):
    """One received row whose fields lie at offsets that are not multiples of their size, and an FP8
    dispatch without tokens (both raised from a tensor view before)."""
    assert run_workers(_one_row_worker, 2, tmp_path=tmp_path, timeout=120) == [0, 1]
