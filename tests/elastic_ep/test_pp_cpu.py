"""PP send/recv on the torch runtime over gloo: every received tensor equals, bitwise, what its sender
sent (the receiver regenerates it from the same seed), in ring and all-pairs patterns with several
tensors in flight per peer, random sizes and dtypes, the sender overwriting its tensor right after
``pp_send``. The refusals, and a receive from a peer that never sends timing out, are in
``test_args_pp_cpu.py``.
"""
import pytest
import torch

from tests._dist import run_workers
from tests.elastic_ep._common import ops_buffer

MiB2 = 2 << 20
MAX_BYTES = 4096
INFLIGHT = 3
DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int64, torch.uint8, torch.float16]


def _tensor(src: int, dst: int, i: int) -> torch.Tensor:
    """The ``i``-th tensor ``src`` sends to ``dst``: random bytes (NaN patterns included) of a random
    dtype and shape, 0 to ``MAX_BYTES`` bytes; both ends compute it."""
    g = torch.Generator().manual_seed(1_000_000 * src + 1000 * dst + i)
    dtype = DTYPES[int(torch.randint(0, len(DTYPES), (1,), generator=g))]
    numel = int(torch.randint(0, MAX_BYTES // dtype.itemsize + 1, (1,), generator=g))
    if i % 7 == 0:
        numel = MAX_BYTES // dtype.itemsize  # the largest size allowed
    cols = 8 if numel % 8 == 0 else 1
    b = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return b.view(dtype).view(numel // cols, cols)


def _send(buf, dst: int, i: int) -> None:
    x = _tensor(buf.rank_idx, dst, i).to(buf.device)
    buf.pp_send(x, dst)
    x.view(torch.uint8).fill_(0xA5)  # reusable once pp_send returns


def _recv(buf, src: int, i: int) -> None:
    want = _tensor(src, buf.rank_idx, i)
    got = torch.empty_like(want, device=buf.device)
    buf.pp_recv(got, src)
    assert torch.equal(got.view(torch.uint8).cpu(), want.view(torch.uint8)), f"tensor {i} from {src} differs"


def _worker(rank, world, rdzv, pattern, backend="torch"):
    """The patterns on the torch runtime over gloo, or (backend="native") on the native runtime's CUDA-IPC
    window (test_agrs_pp_engram_gpu.py)."""
    _, buf = ops_buffer(rank, world, rdzv, backend, num_bytes=MiB2)
    buf.pp_set_config(MAX_BYTES, INFLIGHT)
    n = 0
    if pattern == "ring":
        # to the next rank, from the previous one, INFLIGHT tensors in flight (the credits recycle)
        nxt, prv, N = (rank + 1) % world, (rank - 1) % world, 20
        for i in range(N):
            _send(buf, nxt, i)
            if i >= INFLIGHT - 1:
                _recv(buf, prv, i - INFLIGHT + 1)
                n += 1
        for i in range(N - INFLIGHT + 1, N):
            _recv(buf, prv, i)
            n += 1
        # and the other way round, one at a time
        for i in range(5):
            _send(buf, prv, 100 + i)
            _recv(buf, nxt, 100 + i)
            n += 1
    else:
        # every pair: INFLIGHT tensors to every peer, then everything received, in rounds
        for r in range(4):
            for p in range(world):
                if p != rank:
                    for j in range(INFLIGHT):
                        _send(buf, p, r * INFLIGHT + j)
            for p in reversed(range(world)):
                if p != rank:
                    for j in range(INFLIGHT):
                        _recv(buf, p, r * INFLIGHT + j)
                        n += 1
    buf.destroy()
    return n


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("pattern", ["ring", "all_pairs"])
def test_pp_patterns_bitwise(tmp_path, pattern, world):
    counts = run_workers(_worker, world, pattern, tmp_path=tmp_path, timeout=180)
    expect = 25 if pattern == "ring" else 4 * INFLIGHT * (world - 1)
    assert counts == [expect] * world
