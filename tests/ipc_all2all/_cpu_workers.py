"""Worker bodies of the CPU multi-process tests (importable by spawned children)."""
from __future__ import annotations

import torch

from tests._dist import init_gloo


def worker_from_group_reports_every_rank(rank, world, rdzv, bad_rank):
    import ipc_all2all

    init_gloo(rank, world, rdzv)
    dtype = torch.float64 if rank == bad_rank else torch.bfloat16  # one rank passes an invalid dtype
    try:
        ipc_all2all.All2All.from_group(num_tokens=16, hidden_dim=1024, tensor_dtype=dtype)
    except (ipc_all2all.CommError, ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    raise AssertionError("from_group succeeded where it must fail")
