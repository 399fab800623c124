"""Opening the Engram host segments (``_engram.open_engram_store``) leaves nothing in /dev/shm when a rank
dies or fails, on CPU ranks over gloo.

The native store (``_C.EngramStore``: POSIX shm pinned with cudaHostRegister) needs a GPU; here a stand-in
with the same calls creates, unlinks and closes real /dev/shm files, so what is left behind is what
``open_engram_store`` left. Every rank must arrive before any creates its (possibly many-GB) segment, and
every exit path after that unlinks this rank's name.
"""
from __future__ import annotations

import os

import pytest

from tests._dist import run_workers

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


class _StandInStore:
    """What open_engram_store calls on a ``_C.EngramStore``, over a real /dev/shm file."""

    prefix = ""
    refuse_on_rank = -1

    def __init__(self, rank: int, num_ranks: int, num_bytes: int) -> None:
        if rank == self.refuse_on_rank:
            raise ValueError("num_cpu_bytes: /dev/shm has no room (stand-in)")
        self.name = f"{self.prefix}_{rank}".encode()
        self._path = "/dev/shm/" + self.name.decode()
        fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, num_bytes)
        os.close(fd)
        self._linked = True

    def attach(self, names) -> None:
        for n in names:
            assert os.path.exists("/dev/shm/" + n.decode()), f"peer segment {n!r} is gone before attach"

    def unlink(self) -> None:
        if self._linked:
            os.unlink(self._path)
            self._linked = False

    def close(self) -> None:
        self.unlink()


def _left(prefix: str):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def store_worker(rank, world, rdzv, prefix, scenario):
    from types import SimpleNamespace

    from elastic_ep import _engram
    from tests._dist import init_gloo

    group = init_gloo(rank, world, rdzv, timeout_s=20)
    _StandInStore.prefix = prefix
    _StandInStore.refuse_on_rank = 1 if scenario == "refused" else -1
    _engram._C = SimpleNamespace(EngramStore=_StandInStore)
    if scenario == "dead" and rank == 1:
        os._exit(0)  # gone before it arrives: the others must not have created anything
    try:
        store = _engram.open_engram_store(group, 1 << 20)
    except (RuntimeError, ValueError) as e:
        return f"raised {type(e).__name__}", _left(f"{prefix}_{rank}")  # this rank's own, as the call left it
    store.close()
    return "opened", _left(f"{prefix}_{rank}")


@pytest.mark.parametrize("scenario", ["ok", pytest.param("refused", marks=pytest.mark.fault),
                                      pytest.param("dead", marks=pytest.mark.fault)])
def test_engram_segments_leave_nothing_behind(tmp_path, scenario):
    prefix = f"elastic_ep_engram_test_{os.getpid()}_{scenario}"
    world = 3
    res = run_workers(store_worker, world, prefix, scenario, tmp_path=tmp_path, timeout=90,
                      expect_dead={1} if scenario == "dead" else None)
    survivors = [r for i, r in enumerate(res) if not (scenario == "dead" and i == 1)]
    want = {"ok": "opened", "refused": "raised ValueError", "dead": "raised RuntimeError"}[scenario]
    # While the call ran every name was unlinked once every rank attached (ok), or never made or
    # removed (a rank refused, a rank gone before the barrier).
    assert all(r[0] == want for r in survivors), res
    assert all(r[1] == [] for r in survivors), res  # each rank's own name: unlinked by the call itself
    assert _left(prefix) == []
