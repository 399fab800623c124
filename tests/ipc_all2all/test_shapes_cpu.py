"""CPU tests of ipc_all2all's shape logic (``_shapes``, pure Python) and of the native core's own
checks it mirrors: the buffer layout, the grid plan, dtypes and capacities, token counts, launch
planning, input validation, timeouts and grids."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import ipc_all2all
from ipc_all2all import _C, _shapes as S


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def test_import_and_build_flags():
    assert isinstance(ipc_all2all.built_with_cuda(), bool)
    assert _C.MAX_WORLD_SIZE == S.MAX_WORLD_SIZE == 8
    assert (_C.OP_SEND_RECV_HEADS, _C.OP_GATHER_HEADS, _C.OP_ALLGATHER) == (
        S.OP_SEND_RECV_HEADS, S.OP_GATHER_HEADS, S.OP_ALLGATHER)
    assert issubclass(ipc_all2all.CommTimeoutError, TimeoutError)
    assert issubclass(ipc_all2all.CommError, RuntimeError)


@pytest.mark.parametrize("capacity", [1, 16, 1000, 4096, 12345, 1 << 30])
def test_buffer_layout(capacity):
    lay = _C.buffer_layout(capacity)
    sig_off, sig_bytes = lay["signals"]
    (o0, b0), (o1, b1) = lay["slots"]
    assert sig_off == 0 and sig_bytes == 4096
    assert b0 == b1 >= capacity and b0 % 256 == 0
    assert o0 >= sig_off + sig_bytes and o1 >= o0 + b0  # no overlap, in order
    assert o0 % 256 == 0 and o1 % 256 == 0
    assert lay["total"] >= o1 + b1 and lay["total"] % 4096 == 0


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("blocks", [8, 16, 33, 132, 264])
def test_grid_plan(world, blocks):
    if blocks < world:
        pytest.skip("fewer blocks than ranks is rejected by the constructor")
    total, self_blocks, per_peer = _C.grid_plan(blocks, world, 0)
    assert self_blocks >= 1
    assert total == self_blocks + per_peer * (world - 1)
    assert total <= max(blocks, world)
    if world > 1:
        assert per_peer >= 1 and per_peer >= self_blocks // 2  # NVLink targets get most blocks
    total, self_blocks, per_peer = _C.grid_plan(blocks, world, 3)
    assert self_blocks == (3 if world > 1 else blocks)  # one rank: every block copies locally


# grid_plan's rule (csrc/a2a_types.hpp): self = the hint if > 0, else num_blocks // (2 * W), at least 1;
# per_peer = (num_blocks - self) // (W - 1), at least 1; grid = self + per_peer * (W - 1). One rank:
# every block copies locally. Values worked out by hand from that rule.
GRID_CASES = [
    # (num_blocks, W, hint) -> (grid, self, per_peer)
    ((2, 2, 0), (2, 1, 1)),              # 2 // 4 = 0 -> 1; (2 - 1) // 1 = 1
    ((16, 2, 0), (16, 4, 12)),           # 16 // 4 = 4; 12 // 1 = 12
    ((132, 2, 0), (132, 33, 99)),        # 132 // 4 = 33; 99 // 1 = 99
    ((65535, 2, 0), (65535, 16383, 49152)),
    ((8, 4, 0), (7, 1, 2)),              # 8 // 8 = 1; 7 // 3 = 2; 1 + 2 * 3 = 7 (one block unused)
    ((132, 4, 0), (130, 16, 38)),        # 132 // 8 = 16; 116 // 3 = 38; 16 + 114 = 130
    ((132, 4, 40), (130, 40, 30)),       # hint 40; 92 // 3 = 30; 40 + 90 = 130
    ((8, 8, 0), (8, 1, 1)),              # 8 // 16 = 0 -> 1; 7 // 7 = 1
    ((132, 8, 0), (127, 8, 17)),         # 132 // 16 = 8; 124 // 7 = 17; 8 + 119 = 127
    ((264, 8, 0), (261, 16, 35)),        # 264 // 16 = 16; 248 // 7 = 35; 16 + 245 = 261
    ((16, 8, 15), (22, 15, 1)),          # hint 15; 1 // 7 = 0 -> 1: the grid exceeds num_blocks
    ((132, 1, 0), (132, 132, 0)),        # one rank
    ((132, 1, 3), (132, 132, 0)),        # one rank: the hint is ignored
    ((0, 1, 0), (1, 1, 0)),
]


@pytest.mark.parametrize("args,want", GRID_CASES, ids=[f"blocks{a[0]}-W{a[1]}-hint{a[2]}" for a, _ in GRID_CASES])
def test_grid_plan_values(args, want):
    assert _C.grid_plan(*args) == want


def test_element_size_and_capacity():
    for dt, size in [(torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4), (torch.float8_e4m3fn, 1),
                     (torch.float8_e5m2, 1), (torch.int8, 1), (torch.int32, 4)]:
        assert S.element_size(dt) == size
    for dt in (torch.float64, torch.int64, torch.complex64, torch.bool):
        with pytest.raises(ValueError, match="tensor_dtype"):
            S.element_size(dt)
    with pytest.raises(ValueError, match="torch.dtype"):
        S.element_size("bf16")
    assert S.capacity_bytes(10, 4096, torch.bfloat16) == 10 * 4096 * 2
    with pytest.raises(ValueError, match="num_tokens"):
        S.capacity_bytes(0, 4096, torch.bfloat16)
    with pytest.raises(ValueError, match="hidden_dim"):
        S.capacity_bytes(4, -1, torch.bfloat16)


def test_other_one_two_four_byte_dtypes_stay_accepted():
    for dtype, size in [(torch.uint8, 1), (torch.int16, 2), (torch.uint16, 2), (torch.uint32, 4),
                        (torch.float8_e4m3fn, 1), (torch.float8_e5m2, 1)]:
        assert S.element_size(dtype) == size


def test_world_checks():
    S.check_world(0, 1)
    S.check_world(7, 8)
    for rank, world, match in [(0, 9, "world_size"), (0, 0, "world_size"), (2, 2, "rank"), (-1, 2, "rank")]:
        with pytest.raises(ValueError, match=match):
            S.check_world(rank, world)
    with pytest.raises(ValueError, match="world_size"):
        ipc_all2all.All2All(0, 9, 10, 4096, 132, torch.bfloat16)
    with pytest.raises(ValueError, match="tensor_dtype"):
        ipc_all2all.All2All(0, 2, 10, 4096, 132, torch.float64)
    with pytest.raises(ValueError, match="num_sms"):
        ipc_all2all.All2All(0, 4, 10, 4096, 2, torch.bfloat16)


def test_counts_and_prefix():
    assert S.prefix_sums([128, 96, 128, 64]) == [0, 128, 224, 352]
    assert S.check_counts([3, 0], 2) == [3, 0]
    with pytest.raises(ValueError, match="one entry per rank"):
        S.check_counts([1, 2, 3], 2)
    with pytest.raises(ValueError, match=r"rank_tokens\[1\]"):
        S.check_counts([1, -2], 2)
    with pytest.raises(ValueError, match=r"rank_tokens\[0\]"):
        S.check_counts([1.5, 2], 2)


def _ref_out_shapes(b, counts, H, D, W, rank):
    return (b, sum(counts), H // W, D), (b, counts[rank], H, D)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W", [1, 2, 4, 8])
@pytest.mark.parametrize("b,D", [(1, 128), (2, 64)])
def test_plans_host_mode(dtype, W, b, D):
    it = S.element_size(dtype)
    H = 32
    counts = [0] + [7 * r + 3 for r in range(1, W)] if W > 1 else [5]
    cap = 1 << 30
    for rank in range(W):
        send = S.plan_send_recv_heads((b, counts[rank], H, D), it, W, rank, counts, cap)
        out_send, out_gather = _ref_out_shapes(b, counts, H, D, W, rank)
        assert send.out_shape == out_send and send.out_bytes == b * sum(counts) * H // W * D * it
        assert send.chunk_bytes == H // W * D * it and send.wide_bytes == H * D * it
        assert send.out_rows == -1 and send.cap_rows == -1 and send.x_rows == counts[rank]
        gather = S.plan_gather_heads(out_send, it, W, rank, counts, cap)
        assert gather.out_shape == out_gather
        ag = S.plan_allgather((b, counts[rank], 4, D), it, W, rank, counts, cap)
        assert ag.out_shape == (b, sum(counts), 4, D) and ag.chunk_bytes == ag.wide_bytes == 4 * D * it


def test_plans_device_mode():
    W, L, H, D, it = 4, 100, 32, 128, 2
    send = S.plan_send_recv_heads((2, L, H, D), it, W, 1, None, 1 << 30)
    assert send.out_shape == (2, W * L, H // W, D) and send.out_rows == W * L and send.cap_rows == L
    gather = S.plan_gather_heads(send.out_shape, it, W, 1, None, 1 << 30)
    assert gather.out_shape == (2, L, H, D) and gather.out_rows == L and gather.cap_rows == L
    ag = S.plan_allgather((2, L, 8, D), it, W, 1, None, 1 << 30)
    assert ag.out_shape == (2, W * L, 8, D)
    with pytest.raises(ValueError, match="world_size \\* per-rank capacity"):
        S.plan_gather_heads((2, 401, 8, D), it, W, 1, None, 1 << 30)


def test_plan_errors():
    counts = [10, 12]
    with pytest.raises(ValueError, match="divisible by world_size"):
        S.plan_send_recv_heads((1, 10, 3, 128), 2, 2, 0, counts, 1 << 30)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        S.plan_send_recv_heads((1, 10, 2, 4), 2, 2, 0, counts, 1 << 30)  # 1 head * 4 * 2 B = 8 B
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        S.plan_allgather((1, 10, 1, 3), 4, 2, 0, counts, 1 << 30)
    with pytest.raises(ValueError, match="x has 11 tokens"):
        S.plan_send_recv_heads((1, 11, 32, 128), 2, 2, 0, counts, 1 << 30)
    with pytest.raises(ValueError, match="total of 22"):
        S.plan_gather_heads((1, 21, 16, 128), 2, 2, 0, counts, 1 << 30)
    with pytest.raises(ValueError, match="4 dimensions"):
        S.plan_allgather((10, 4096), 2, 2, 0, counts, 1 << 30)
    # token counts beyond the buffer: 22 tokens * 16 heads * 128 * 2 B > capacity
    need = 22 * 16 * 128 * 2
    S.plan_send_recv_heads((1, 10, 32, 128), 2, 2, 0, counts, need)
    with pytest.raises(ValueError, match="exceed what the instance was built for"):
        S.plan_send_recv_heads((1, 10, 32, 128), 2, 2, 0, counts, need - 1)


def test_gather_heads_checks_every_targets_output_against_the_buffer():
    # gather_heads writes n[p] rows into target p's slot: the rank with few tokens must refuse when a
    # peer's output would not fit, or it would push past that peer's buffer (the peer refuses its own
    # call, and the small rank's kernel writes out of bounds once the epochs line up again).
    counts, H, D, it = [2, 10], 16, 128, 2
    need = 10 * H * D * it
    for rank in range(2):
        S.plan_gather_heads((1, 12, H // 2, D), it, 2, rank, counts, need)
        with pytest.raises(ValueError, match="exceed what the instance was built for"):
            S.plan_gather_heads((1, 12, H // 2, D), it, 2, rank, counts, need - 1)
    # Rank 0's own output (2 tokens) fits a 5-token buffer, which the old check accepted; the kernel's
    # addressing then writes rank 1's 10 rows past rank 1's slot.
    xs = [torch.zeros(1, 12, H // 2, D, dtype=torch.bfloat16) for _ in range(2)]
    p = S.plan_gather_heads((1, 12, H // 2, D), it, 2, 0, counts, need)
    assert p.out_bytes == 2 * H * D * it <= 5 * H * D * it
    with pytest.raises(RuntimeError, match=r"beyond slot .*rank 0 -> 1"):
        _C.simulate(p.op, 2, 1, 12, -1, -1, p.chunk_bytes, p.wide_bytes, counts,
                    [bytes(x.view(torch.uint8).reshape(-1).numpy()) for x in xs], 5 * H * D * it, only_sender=0)


def test_large_hidden_has_no_block_limit():
    # The original kernel hung when one token row needed more threads than a block has; ours
    # flattens (row, 16-byte column) so only the 16-byte multiple matters.
    p = S.plan_allgather((1, 3, 1, 65536), 2, 2, 0, [3, 4], 1 << 30)
    assert p.chunk_bytes == 65536 * 2 and p.chunk_bytes // 16 > _C.THREADS_PER_BLOCK


def test_validate_input():
    cpu = torch.device("cpu")
    x = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)
    S.validate_input(x, torch.bfloat16, cpu, "op")
    with pytest.raises(ValueError, match="must be a torch.Tensor"):
        S.validate_input([1, 2], torch.bfloat16, cpu, "op")
    with pytest.raises(ValueError, match="dtype torch.float16"):
        S.validate_input(x.half(), torch.bfloat16, cpu, "op")
    with pytest.raises(ValueError, match="lives on cuda:0"):
        S.validate_input(x, torch.bfloat16, torch.device("cuda", 0), "op")
    with pytest.raises(ValueError, match="contiguous"):
        S.validate_input(x.transpose(1, 2), torch.bfloat16, cpu, "op")
    with pytest.raises(ValueError, match="4 dimensions"):
        S.validate_input(x.view(4, 8, 64), torch.bfloat16, cpu, "op")
    flat = torch.zeros(4 * 8 * 64 + 8, dtype=torch.bfloat16)
    mis = flat[1:1 + 4 * 8 * 64].view(1, 4, 8, 64)
    with pytest.raises(ValueError, match="16-byte aligned"):
        S.validate_input(mis, torch.bfloat16, cpu, "op")


@pytest.mark.parametrize("to_sparse", [lambda t: t.to_sparse(), lambda t: t.to_sparse(2)], ids=["coo", "coo-hybrid"])
def test_sparse_input_is_refused_as_not_dense(to_sparse):
    x = to_sparse(torch.zeros(1, 4, 8, 64))
    with pytest.raises(ValueError, match=r"op: x must be a dense \(strided\) tensor, got layout torch.sparse_coo"):
        S.validate_input(x, torch.float32, torch.device("cpu"), "op")


def test_ranges_overlap():
    assert S.ranges_overlap(0, 10, 9, 10)
    assert not S.ranges_overlap(0, 10, 10, 10)
    assert not S.ranges_overlap(0, 0, 0, 10)
    assert S.ranges_overlap(5, 1, 0, 10)


def test_op_names():
    for op in range(3):
        for phase in range(4):
            assert S.OP_NAMES[op] in _C.op_name(op * 4 + phase)
        assert "entry" in _C.op_name(op * 4) and "completion" in _C.op_name(op * 4 + 1)
        assert "another call" in _C.op_name(op * 4 + _C.PHASE_MISMATCH)
        assert "abandoned" in _C.op_name(op * 4 + _C.PHASE_BROKEN)


def test_no_gpu_construction_is_clear():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="CUDA device"):
        ipc_all2all.All2All(0, 2, 10, 4096, 132, torch.bfloat16)


def test_numpy_and_torch_integers_are_accepted_like_ints():
    """The original's pybind11 bindings took any integer: numpy / torch integer scalars work, bools
    and floats are still refused."""
    np = pytest.importorskip("numpy")
    S.check_world(np.int64(1), np.int32(2))
    assert S.capacity_bytes(np.int64(4), torch.tensor(8), torch.bfloat16) == 4 * 8 * 2
    counts = S.check_counts([np.int64(3), torch.tensor(0)], 2)
    assert counts == [3, 0] and all(type(c) is int for c in counts)
    for bad in (True, 2.0):
        with pytest.raises(ValueError, match="world_size must be an int"):
            S.check_world(0, bad)
    with pytest.raises(ValueError, match=r"rank_tokens\[0\] must be an int"):
        S.check_counts([1.5, 2], 2)


# ------------------------------------------------------------------ timeouts, grids, counts tensors
def test_timeout_seconds_checks_match_the_core():
    for good, want_ns in [(0, 0), (0.5, 500_000_000), (10, 10_000_000_000), (1e9 - 1, 999_999_999_000_000_000)]:
        assert S.check_timeout_seconds(good) == float(good)
        assert _C.timeout_ns_from_seconds(float(good)) == want_ns
    assert S.check_timeout_seconds(np.float32(2.5)) == 2.5 and S.check_timeout_seconds(np.int64(3)) == 3.0
    for bad in (-1, -1e-9, float("nan"), float("inf"), -float("inf"), 1e9, 1e12):
        with pytest.raises(ValueError, match="timeout_seconds"):
            S.check_timeout_seconds(bad)
        with pytest.raises(ValueError, match="timeout_seconds"):  # the core refuses the same values
            _C.timeout_ns_from_seconds(bad)
    for bad in (True, "5", b"5", None, [1.0], object()):
        with pytest.raises(ValueError, match="timeout_seconds must be a number"):
            S.check_timeout_seconds(bad)


@pytest.mark.parametrize("seconds", [1e-10, 5e-10, 9.99e-10, 1e-300])
def test_positive_timeout_below_one_nanosecond_is_not_wait_forever(seconds):
    # 0 ns is the kernel's "no deadline": a tiny positive timeout used to truncate to it and hang.
    assert _C.timeout_ns_from_seconds(seconds) == 1
    assert S.check_timeout_seconds(seconds) == seconds


def test_zero_timeout_still_means_wait_forever():
    assert _C.timeout_ns_from_seconds(0.0) == 0
    assert _C.timeout_ns_from_seconds(1e-9) == 1
    assert _C.timeout_ns_from_seconds(2.5) == 2_500_000_000


def test_grid_checks_match_the_core():
    for W in (1, 2, 8):
        for nb, sb in [(W, 0), (W, W - 1), (132, 0), (132, 131), (65535, 0), (65535, 65534)]:
            assert S.check_grid(nb, sb, W) == (nb, sb)
            _C.check_grid_args(W, nb, sb)
        for nb, sb, match in [(W - 1, 0, "num_blocks"), (0, 0, "num_blocks"), (65536, 0, "num_blocks"),
                              (132, -1, "self_blocks"), (132, 132, "self_blocks"), (W, W, "self_blocks")]:
            with pytest.raises(ValueError, match=match):
                S.check_grid(nb, sb, W)
            with pytest.raises(ValueError, match=match):
                _C.check_grid_args(W, nb, sb)
    assert S.check_grid(np.int32(132), torch.tensor(3), 4) == (132, 3)
    for nb, sb, match in [(132.0, 0, "num_blocks"), (True, 0, "num_blocks"), ("132", 0, "num_blocks"),
                          (132, 1.5, "self_blocks"), (132, False, "self_blocks"), (132, None, "self_blocks")]:
        with pytest.raises(ValueError, match=match):
            S.check_grid(nb, sb, 2)


def test_counts_tensor_checks():
    W, dev = 4, torch.device("cpu")
    good = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    assert S.check_counts_tensor(good, W, dev) is good
    strided = torch.zeros(2 * W, dtype=torch.int32)[::2]
    assert strided.shape == (W,)
    for t, problem in [(good.long(), "dtype torch.int64"), (good.float(), "dtype torch.float32"),
                       (torch.zeros(W + 1, dtype=torch.int32), f"shape ({W + 1},)"),
                       (good.view(1, W), f"shape (1, {W})"), (torch.zeros((), dtype=torch.int32), "shape ()"),
                       (torch.zeros(W, dtype=torch.int32, device="meta"), "device meta"),
                       (strided, "non-contiguous")]:
        with pytest.raises(ValueError, match=r"set_rank_tokens: a counts tensor must be int32.*" + re.escape(problem)):
            S.check_counts_tensor(t, W, dev)
    with pytest.raises(ValueError, match="device cpu"):  # an instance on a GPU refuses host memory
        S.check_counts_tensor(good, W, torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"dtype torch.int64, shape \(3,\), device meta"):  # every problem named
        S.check_counts_tensor(torch.zeros(3, dtype=torch.int64, device="meta"), W, dev)
    with pytest.raises(ValueError, match="expected a torch.Tensor"):
        S.check_counts_tensor([1, 2, 3, 4], W, dev)
