"""CPU tests of ipc_all2all's object lifecycle as a user sees it: every method called after
``destroy()`` raises ``CommError`` naming itself and "destroyed" (the token counts, planning and
tuning used to be accepted silently on a destroyed instance: they never reach the native core, or
reach setters of it that do not check), ``with`` on a destroyed instance, what the garbage collector
leaves behind (the registry of the compilable ops, the native core) when an instance is dropped
without ``destroy()``, the collective construction and destroy() of ``from_group`` instances (a
failing rank reaches every rank; a failed exchange releases the instance), and a ``destroy()`` from
another thread in the middle of a call (the native half is
test_gpu.py::test_destroy_racing_calls_in_another_thread). The native core's own refusals (sync,
get_local_ipc_handle, synchronize, launches) are covered on the GPU in test_gpu.py."""
from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

import ipc_all2all
from ipc_all2all import _shapes as S
from ipc_all2all._registry import INSTANCES
from tests.ipc_all2all._stand_ins import RecordingCore, instance_over, synced_instance


@pytest.fixture
def destroyed(monkeypatch):
    """A synced instance over the recording core, with counts set, then destroyed. The core's setters
    accept anything, as the native core's set_timeout_seconds / set_grid do."""
    a, core = synced_instance(monkeypatch)
    core.tuning = []
    core.set_timeout_seconds = lambda s: core.tuning.append(("timeout", s))
    core.set_grid = lambda n, s=0: core.tuning.append(("grid", n, s))
    a.destroy()
    assert core.destroyed and core.released
    return a, core


_X = torch.zeros(1, 5, 8, 32, dtype=torch.bfloat16)
_CALLS = {
    "set_rank_tokens": lambda a: a.set_rank_tokens([4, 4]),
    "set_rank_tokens(tensor)": lambda a: a.set_rank_tokens(torch.tensor([4, 4], dtype=torch.int32)),
    "plan": lambda a: a.plan(S.OP_SEND_RECV_HEADS, (1, 5, 8, 32)),
    "set_timeout_seconds": lambda a: a.set_timeout_seconds(3.0),
    "set_grid": lambda a: a.set_grid(4),
    "send_recv_heads": lambda a: a.send_recv_heads(_X),
    "gather_heads": lambda a: a.gather_heads(torch.zeros(1, 8, 4, 32, dtype=torch.bfloat16)),
    "allgather": lambda a: a.allgather(_X, copy_output=True),
}


@pytest.mark.parametrize("name", sorted(_CALLS))
def test_every_call_after_destroy_raises_destroyed(destroyed, name):
    """set_rank_tokens, plan, set_timeout_seconds and set_grid used to succeed on a destroyed instance
    (replacing its counts, returning a plan, tuning a released core); now each raises like the
    operations do, and changes nothing."""
    a, core = destroyed
    what = name.split("(")[0]
    with pytest.raises(ipc_all2all.CommError, match=f"^{what}: this All2All instance was destroyed$"):
        _CALLS[name](a)
    assert a.rank_tokens == [3, 5], "a refused call changed the token counts"
    assert core.tuning == [] and len(core.launches) == 0, "a refused call reached the core"


def test_with_block_on_a_destroyed_instance_raises(destroyed):
    a, _ = destroyed
    with pytest.raises(ipc_all2all.CommError, match="with All2All: this All2All instance was destroyed"):
        with a:
            pytest.fail("entered the body of a destroyed instance")


def test_with_block_destroys_and_keeps_the_body_exception(monkeypatch):
    """(Already right; kept as a guard.) Leaving a ``with`` block by an exception destroys the instance
    and lets that exception through unchanged; a second destroy() does nothing."""
    a, core = synced_instance(monkeypatch)
    with pytest.raises(KeyError, match="from the body"):
        with a as same:
            assert same is a
            raise KeyError("from the body")
    assert a.destroyed and core.released
    a.destroy()


def test_a_dropped_instance_leaves_no_registry_entry_and_warns(monkeypatch):
    """(Already right; kept as a guard.) Dropped without destroy(), an instance is collected at once
    (nothing else holds it), its comm_id leaves the ops' registry and a ResourceWarning says so; the
    core stays alive only while a zero-copy view does."""
    a, core = synced_instance(monkeypatch)
    a.comm_id = 990001
    INSTANCES[a.comm_id] = a
    y = a.send_recv_heads(_X)
    ref = weakref.ref(a)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del a
        gc.collect()
    assert ref() is None, "the instance was kept alive"
    assert 990001 not in INSTANCES
    assert any(issubclass(w.category, ResourceWarning) and "was not destroyed" in str(w.message) for w in caught)
    assert not core.released and y.sum() == 0  # the view still reads the buffer
    del y
    gc.collect()
    assert core.destroyed and core.released, "the last view did not free the buffer"


# ------------------------------------------------------------------ collective construction and destroy
@pytest.mark.parametrize("group", [None, "a group"], ids=["default-group", "explicit-group"])
def test_destroy_of_a_from_group_instance_is_collective(monkeypatch, group):
    """from_group's instances wait for every rank in destroy(), with the default group (None = WORLD)
    too: the native core waits for every peer's arrival word (with destroy()'s deadline, never through
    the process group); the low-level constructor's do not."""
    for collective in (True, False):
        cap = 4096
        core = RecordingCore(cap, torch.zeros(16, dtype=torch.uint8))
        core.opened = True
        a = instance_over(core, None, _group=group, _collective=collective, comm_id=-2)
        a.destroy()
        assert a._core.destroyed
        assert core.destroys == [(True, 30.0, collective)], core.destroys
        a.destroy()  # idempotent
        assert len(core.destroys) == 1


@pytest.mark.fault
def test_from_group_failure_reaches_every_rank(tmp_path):
    """A failure on one rank during the collective construction raises on every rank (no hang), and
    each message names the failing rank(s)."""
    from tests._dist import run_workers
    from tests.ipc_all2all import _cpu_workers

    res = run_workers(_cpu_workers.worker_from_group_reports_every_rank, 2, 1, tmp_path=tmp_path, timeout=120)
    for rank, (name, msg) in enumerate(res):  # rank 0 fails too, naming rank 1's error (with or without a GPU)
        # the rank whose own argument was wrong keeps ValueError; the others raise CommError
        assert name == ("ValueError" if rank == 1 else "CommError"), (rank, name, msg)
        assert "rank 1: ValueError: tensor_dtype torch.float64" in msg, (name, msg)


# ------------------------------------------------------------------ from_group cleans up after a failed exchange
class _StubAll2All(ipc_all2all.All2All):
    """from_group's cls: an instance over a recording core (no GPU)."""

    cores: list = []

    def __init__(self, rank, world_size, num_tokens, hidden_dim, num_sms, tensor_dtype, timeout_seconds=None):
        core = RecordingCore(4096, torch.zeros(16, dtype=torch.uint8))
        core.ipc_handle = lambda: b"handle"
        _StubAll2All.cores.append(core)
        self.__dict__.update(_core=core, rank=rank, world_size=world_size, capacity=4096, comm_id=-77,
                             device=torch.device("cpu"), _buf=None, _keeper=None, _group=None, _collective=False,
                             _counts=None, _counts_dev=None, _captured_counts={}, _plans={})
        INSTANCES[self.comm_id] = self


@pytest.mark.parametrize("exc", [RuntimeError("peer 1 died"), KeyboardInterrupt()], ids=["error", "interrupt"])
@pytest.mark.fault
def test_from_group_releases_the_instance_when_the_exchange_fails(monkeypatch, exc):
    import torch.distributed as dist

    def failing_exchange(out, t, group=None):
        raise exc

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_gather", failing_exchange)
    _StubAll2All.cores = []
    with pytest.raises(type(exc)):
        _StubAll2All.from_group(num_tokens=16, hidden_dim=128, tensor_dtype=torch.bfloat16, num_sms=8)
    (core,) = _StubAll2All.cores
    assert core.destroyed and core.released, "the buffer was left to the garbage collector"
    assert -77 not in INSTANCES


# ------------------------------------------------------------------ destroy() from another thread mid-call
@pytest.mark.fault
def test_a_call_survives_destroy_between_its_launch_and_its_output(monkeypatch):
    """destroy() in another thread may run between a call's launch and the view it returns (the GIL
    can switch there). The call used to read self._buf again and fail with a TypeError on None; it
    now keeps its own reference, so the output is made and the buffer is freed after it."""
    a, core = synced_instance(monkeypatch)
    launch = core.launch

    def launch_then_destroy(*args):
        slot = launch(*args)
        a.destroy()  # what the other thread does at this point
        return slot

    core.launch = launch_then_destroy
    y = a.send_recv_heads(torch.zeros(1, 5, 8, 32, dtype=torch.bfloat16))
    assert y.shape == (1, 8, 4, 32)
    assert core.destroyed and not core.released, "freed under the call's output"
    del y
    gc.collect()
    assert core.released
    core.launch = launch
    with pytest.raises(ipc_all2all.CommError, match="destroyed"):
        a.send_recv_heads(torch.zeros(1, 5, 8, 32, dtype=torch.bfloat16))
