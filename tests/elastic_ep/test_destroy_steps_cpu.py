"""ElasticBuffer.destroy() runs every release step whatever an earlier one raised, then raises the
first error (torch backend over gloo, no GPU).

Before, the first step that raised (an AGRS or PP flush, the Engram segments' close) ended destroy():
the runtime's window and the buffer's own communicator were left to the garbage collector, while the
caller saw only that first error. The native runtime's own releases (CUDA / NCCL results, which its
destroy() now raises after releasing the rest) are in test_destroy_release_gpu.py.
"""
from __future__ import annotations

import pytest

from tests._dist import run_workers
from tests.elastic_ep._common import native_module_or_skip

pytestmark = pytest.mark.fault  # a release that fails during destroy()

native_module_or_skip()


def destroy_steps_worker(rank, world, rdzv, failing):
    from tests._dist import init_gloo
    from tests.elastic_ep._common import import_elastic_ep

    ep = import_elastic_ep()
    group = init_gloo(rank, world, rdzv, timeout_s=30)
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=16, hidden=128, num_topk=4, backend="torch",
                           num_cpu_timeout_secs=20)
    ran = []

    def recorded(name, real, fail):
        def step(*args):
            ran.append(name)
            if fail:
                raise RuntimeError(f"{name} failed")
            return real(*args)
        return step

    for owner, attr, name in ((buf._agrs, "flush", "agrs"), (buf._pp, "flush", "pp"),
                              (buf._engram, "close", "engram"), (buf.runtime, "destroy", "runtime"),
                              (buf, "_abort_owned_comm", "comm")):
        setattr(owner, attr, recorded(name, getattr(owner, attr), name in failing))
    try:
        buf.destroy()
        err = None
    except RuntimeError as e:
        err = str(e)
    return ran, err, buf.destroyed


@pytest.mark.parametrize("failing", [("agrs",), ("engram",), ("pp", "runtime")])
def test_destroy_runs_every_step_and_raises_the_first_error(tmp_path, failing):
    ran, err, destroyed = run_workers(destroy_steps_worker, 1, failing, tmp_path=tmp_path, timeout=120)[0]
    assert ran == ["agrs", "pp", "engram", "runtime", "comm"], ran
    assert err == f"{failing[0]} failed", err
    assert destroyed
