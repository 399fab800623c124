"""CPU tests of ipc_all2all's object lifecycle as a user sees it: every method called after
``destroy()`` raises ``CommError`` naming itself and "destroyed" (the token counts, planning and
tuning used to be accepted silently on a destroyed instance: they never reach the native core, or
reach setters of it that do not check), ``with`` on a destroyed instance, and what the garbage
collector leaves behind (the registry of the compilable ops, the native core) when an instance is
dropped without ``destroy()``. The native core's own refusals (sync, get_local_ipc_handle,
synchronize, launches) are covered on the GPU in test_gpu.py."""
from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

import ipc_all2all
from ipc_all2all import _REGISTRY
from ipc_all2all import _shapes as S
from tests.ipc_all2all.test_robustness_cpu import _instance


@pytest.fixture
def destroyed(monkeypatch):
    """A synced instance over the recording core, with counts set, then destroyed. The core's setters
    accept anything, as the native core's set_timeout_seconds / set_grid do."""
    a, core = _instance(monkeypatch)
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
    a, core = _instance(monkeypatch)
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
    a, core = _instance(monkeypatch)
    a.comm_id = 990001
    _REGISTRY[a.comm_id] = a
    y = a.send_recv_heads(_X)
    ref = weakref.ref(a)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del a
        gc.collect()
    assert ref() is None, "the instance was kept alive"
    assert 990001 not in _REGISTRY
    assert any(issubclass(w.category, ResourceWarning) and "was not destroyed" in str(w.message) for w in caught)
    assert not core.released and y.sum() == 0  # the view still reads the buffer
    del y
    gc.collect()
    assert core.destroyed and core.released, "the last view did not free the buffer"
