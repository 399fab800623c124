"""The live :class:`~ipc_all2all.All2All` instances by ``comm_id``.

The custom ops (:mod:`ipc_all2all.ops`) take the instance as an integer (a tensor cannot carry it)
and find it here; :class:`~ipc_all2all.All2All` registers itself on construction and leaves on
``destroy()``. Both import this module, neither the other.
"""
from __future__ import annotations

import itertools
import threading
import weakref

# Weak: the op path looks instances up by id, but only the user's reference keeps one alive.
INSTANCES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_LOCK = threading.Lock()
_IDS = itertools.count(1)


def register(instance) -> int:
    """Registers ``instance`` under a new id.

    Arguments:
        instance: an :class:`~ipc_all2all.All2All` (held weakly).

    Returns:
        Its ``comm_id``, unique in this process.
    """
    comm_id = next(_IDS)
    with _LOCK:
        INSTANCES[comm_id] = instance
    return comm_id


def unregister(comm_id: int) -> None:
    """Removes ``comm_id`` (no error when it is not registered)."""
    with _LOCK:
        INSTANCES.pop(comm_id, None)


def lookup(comm_id: int):
    """The live instance registered under ``comm_id``.

    Raises:
        ValueError: no live instance has that id (destroyed, or never built).
    """
    try:
        return INSTANCES[comm_id]
    except KeyError:
        raise ValueError(f"no live ipc_all2all.All2All with comm_id {comm_id} (destroyed?)") from None
