"""Unit tests of the one checks module (elastic_ep._checks): tensor checks and their messages, the routing
limits, and the expert-id helpers the runtimes share."""
import pytest
import torch

from tests.elastic_ep._common import native_module_or_skip

native_module_or_skip()
from elastic_ep import _checks  # noqa: E402


def test_check_tensor_names_the_argument_and_what_is_wrong():
    cpu = torch.device("cpu")
    ok = torch.zeros(4, 8, dtype=torch.bfloat16)
    _checks.check_tensor("x", ok, (torch.bfloat16,), 2, cpu, shape=(4, None))
    cases = [
        ("x: expected a torch.Tensor, got 'list'", [1], {}),
        ("x: expected dtype in ['torch.bfloat16'], got torch.float32", ok.float(), {}),
        ("x: expected a 2-D tensor, got shape (32,)", ok.view(-1), {}),
        ("x: expected shape (5, '*'), got shape (4, 8)", ok, dict(shape=(5, None))),
        ("x: expected a tensor on cpu (the buffer's device), got meta", ok.to("meta"), {}),
        ("x: expected a contiguous tensor, got strides (1, 4)", ok.t().contiguous().t(), {}),
    ]
    for msg, t, kw in cases:
        with pytest.raises(ValueError) as info:
            _checks.check_tensor("x", t, (torch.bfloat16,), 2, cpu, **kw)
        assert str(info.value) == msg
    _checks.check_tensor("sf", ok.t().contiguous().t(), (torch.bfloat16,), 2, cpu, contiguous=False)


def test_integers_of_any_kind_and_nothing_else():
    import numpy as np

    assert _checks.int_arg("n", np.int16(3), 0) == 3 and type(_checks.int_arg("n", np.int16(3))) is int
    for bad in (True, 1.0, "1", None):
        with pytest.raises(ValueError, match="n: expected"):
            _checks.int_arg("n", bad, 0)
    with pytest.raises(ValueError, match=r"n: expected at most 7 \(why\), got 8"):
        _checks.int_arg("n", 8, 0, 7, " (why)")
    assert _checks.c_ints(a=1, b=-2) == (1, -2)
    with pytest.raises(ValueError, match=r"b: expected an int in \[-2\*\*31, 2\*\*31\)"):
        _checks.c_ints(a=1, b=2 ** 31)


def test_routing_limits_are_the_kernels():
    assert (_checks.MAX_EXPERTS, _checks.MAX_LOCAL_EXPERTS, _checks.MAX_TOPK) == (2048, 256, 32)
    assert _checks.check_routing(256, 128, 8, 4096, 8) == (256, 128)
    with pytest.raises(ValueError, match="num_experts: expected a positive multiple of the rank count 8, got 100"):
        _checks.check_routing(100, 1, 8, 4096, 8)
    with pytest.raises(ValueError, match="at most 256 experts per rank"):
        _checks.check_routing(512, 1, 1, 16, 8)
    with pytest.raises(ValueError, match="expert_alignment: 2147483648 .* must be below 2\\*\\*31"):
        _checks.check_routing(16, 2 ** 31, 2, 16, 4)
    with pytest.raises(ValueError, match="expert_alignment: 1 .* worst case of 2147483648 rows"):
        _checks.check_routing(2048, 1, 8, 2 ** 23, 32)  # 8 ranks x 2**23 tokens x 32 rows = 2**31


def test_expert_id_count_and_example():
    idx = torch.tensor([[0, 1, -1], [7, 3, 2]], dtype=torch.int64)
    assert _checks.count_bad_expert_ids(idx, 8) == (0, 0)  # -1 (masked) and 0..7 are fine
    bad = idx.clone()
    bad[1, 0], bad[0, 2] = 8, -2
    n, example = _checks.count_bad_expert_ids(bad, 8)
    assert n == 2 and example in (8, -2)
    assert _checks.count_bad_expert_ids(torch.empty((0, 3), dtype=torch.int64), 8) == (0, 0)
    assert _checks.count_bad_expert_ids(bad.int(), 8)[0] == 2  # 32-bit ids too
    with pytest.raises(ValueError, match=r"expert ids must be in \[-1, 8\), got 2 outside it \(e\.g\. 8\)"):
        raise _checks.expert_ids_error(2, 8, 8)


def _agree_worker(rank, world, rdzv):
    from elastic_ep import _collective as collective
    from tests._dist import init_gloo

    group = init_gloo(rank, world, rdzv)
    same = dict(num_bytes=1 << 30, allow_multiple_reduction=1, num_scaleup_ranks=0)
    collective.agree_on_every_rank(group, "ElasticBuffer (native)", same, device="cpu")
    # uint64 values (process ids: a boot-id hash above 2^63) come back as they were sent
    ids = collective.gather_ints(group, [(1 << 64) - 1 - rank, rank], "cpu", unsigned=True)
    assert ids == [[(1 << 64) - 1 - r, r] for r in range(world)], ids
    # bytes of any length and value (an IPC handle, a host name, an error message), never unpickled
    mine = bytes(range(256))[: 3 * rank] + (b"\xff\x00" if rank == 1 else b"")
    got = collective.gather_bytes(group, mine, "cpu")
    assert got == [bytes(range(256))[: 3 * r] + (b"\xff\x00" if r == 1 else b"") for r in range(world)], got
    assert collective.gather_bytes(group, b"", "cpu") == [b""] * world
    odd = dict(same, num_bytes=(1 << 30) + (4096 if rank == 2 else 0))
    try:
        collective.agree_on_every_rank(group, "ElasticBuffer (native)", odd, device="cpu")
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.fault
def test_window_arguments_agreed_on_every_rank(tmp_path):
    # A rank created with another buffer size would be written past by its peers: every rank refuses,
    # naming the argument and each rank's value (one fixed-size int64 all-gather, nothing unpickled).
    from tests._dist import run_workers

    out = run_workers(_agree_worker, 3, tmp_path=tmp_path, timeout=90)
    want = ("ElasticBuffer (native): num_bytes must be the same on every rank (a rank with a larger one would "
            "write past its peers' memory), got rank 0: 1073741824, rank 1: 1073741824, rank 2: 1073745920")
    assert out == [want] * 3
