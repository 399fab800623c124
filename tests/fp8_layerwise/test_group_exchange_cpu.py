"""``group_exchange``: objects travel between the ranks of a torch.distributed group as JSON in a
fixed-size byte record (one all-gather), never pickled; what does not fit is refused by name."""
import pytest

from tests._dist import run_workers


def _worker(rank, world, rdzv):
    import torch.distributed as dist

    import fp8_layerwise as F
    from tests._dist import init_gloo

    init_gloo(rank, world, rdzv)
    ex = F.group_exchange()
    got = ex({"rank": rank, "name": f"/fp8lw_{rank}", "nbytes": [1, 2, 2**40], "pid": None})
    assert got == [{"rank": r, "name": f"/fp8lw_{r}", "nbytes": [1, 2, 2**40], "pid": None} for r in range(world)], got
    with pytest.raises(ValueError, match="takes .* bytes as JSON, the record holds"):
        ex({"blob": "x" * F.exchange.GROUP_RECORD_BYTES})  # refused before any collective
    with pytest.raises(TypeError):
        ex({"obj": object()})  # not JSON: nothing that needs pickling travels
    dist.barrier()
    return "ok"


def test_group_exchange_round_trip_and_limits(tmp_path):
    assert run_workers(_worker, 3, tmp_path=tmp_path, timeout=90) == ["ok"] * 3
