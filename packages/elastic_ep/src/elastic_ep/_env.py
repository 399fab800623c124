"""Every environment variable elastic_ep reads, in one place (the C++ runtime reads none).

The package's own settings are ``ELASTIC_EP_*``; DeepEP V2's own names are kept where DeepEP's users set
them (``EP_BUFFER_DEBUG``, ``EP_REUSE_NCCL_COMM``, ``EP_AVOID_RECORD_STREAM``). ``Settings.read()`` runs
when a buffer is created; ``avoid_record_stream()`` per asynchronous call, as DeepEP reads it;
``skip_nccl_version_check()`` when the native runtime is imported.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

__all__ = ["Settings", "avoid_record_stream", "skip_nccl_version_check", "num_scaleup_ranks", "local_world_size"]


def _is(name: str, value: str) -> bool:
    return os.environ.get(name, "") == value


def _int(name: str, default: Optional[int]) -> Optional[int]:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None


@dataclass
class Settings:
    """What the environment asks of a buffer, read when it is created (see the package README)."""

    #: EP_BUFFER_DEBUG (DeepEP's): print the set-up of each buffer and the native runtime's trace.
    buffer_debug: bool = False
    #: EP_REUSE_NCCL_COMM=0 (DeepEP's): make a communicator instead of using torch's.
    reuse_nccl_comm: bool = True
    #: ELASTIC_EP_NUM_SMS: the SM count of calls with num_sms=0 (0: the theoretical count).
    num_sms: int = 0
    #: ELASTIC_EP_SKIP_INDEX_CHECK=1: expert ids outside [-1, E) are masked silently.
    skip_index_check: bool = False
    #: ELASTIC_EP_DISPATCH_PDL=0: the dispatch push starts after notify instead of beside it.
    dispatch_pdl: bool = True
    #: ELASTIC_EP_DISPATCH_OVERLAP / _PUSH_BLOCKS: the overlapped dispatch (push blocks; None: 3/8).
    dispatch_overlap: bool = False
    dispatch_push_blocks: Optional[int] = None
    #: ELASTIC_EP_COMBINE_OVERLAP / _PUSH_BLOCKS: the overlapped combine.
    combine_overlap: bool = False
    combine_push_blocks: Optional[int] = None
    #: ELASTIC_EP_HOST_WAIT_YIELD_US: how long a CPU-synced dispatch's host wait yields before it sleeps.
    host_wait_yield_us: int = 20000
    #: ELASTIC_EP_TEST_NOTIFY_ATOMICS=1: notify's shared-atomics path (the one above 32 ranks), for tests.
    test_notify_atomics: bool = False
    test_drop_scaleout_signals: bool = False
    #: ELASTIC_EP_PEER_WATCH_MS: how often the runtime checks that the peers' processes on this host
    #: still run (a dead one ends this rank's waits at once); 0 turns the watch off.
    peer_watch_ms: int = 200
    #: ELASTIC_EP_TEST_CORRUPT=count|source|route|own_row|expert_count: this rank's dispatch sends a peer a
    #: corrupted count word or corrupted record source ids, or (hybrid mode) stages records for its rail
    #: peers with routes out of range, or its combine leaves row indices past x in its own slots, or it
    #: sends a peer's expert a corrupted row count (fault-injection tests; 0 off, 1 count, 2 source,
    #: 3 route, 4 own_row, 5 expert_count).
    test_corrupt: int = 0
    #: ELASTIC_EP_TEST_FAIL_RELEASE=step[,step]: destroy() reports these release steps as failed (they
    #: still run), e.g. cudaIpcCloseMemHandle(peers), cudaFree(window), ncclMemFree; "*": all (tests).
    test_fail_release: str = ""
    #: ELASTIC_EP_NUM_SCALEUP_RANKS=N: logical scale-up domains of N ranks (hybrid mode inside one node).
    num_scaleup_ranks: Optional[int] = None

    @classmethod
    def read(cls) -> "Settings":
        """The settings from the environment now.

        Raises:
            ValueError: a variable that must be an integer is not one (naming it).
        """
        debug = os.environ.get("EP_BUFFER_DEBUG", "")
        return cls(
            buffer_debug=debug not in ("", "0"),
            reuse_nccl_comm=not _is("EP_REUSE_NCCL_COMM", "0"),
            num_sms=_int("ELASTIC_EP_NUM_SMS", 0),
            skip_index_check=_is("ELASTIC_EP_SKIP_INDEX_CHECK", "1"),
            dispatch_pdl=not _is("ELASTIC_EP_DISPATCH_PDL", "0"),
            dispatch_overlap=_is("ELASTIC_EP_DISPATCH_OVERLAP", "1"),
            dispatch_push_blocks=_int("ELASTIC_EP_DISPATCH_PUSH_BLOCKS", None),
            combine_overlap=_is("ELASTIC_EP_COMBINE_OVERLAP", "1"),
            combine_push_blocks=_int("ELASTIC_EP_COMBINE_PUSH_BLOCKS", None),
            host_wait_yield_us=max(0, _int("ELASTIC_EP_HOST_WAIT_YIELD_US", 20000)),
            test_notify_atomics=_is("ELASTIC_EP_TEST_NOTIFY_ATOMICS", "1"),
            test_drop_scaleout_signals=_is("ELASTIC_EP_TEST_DROP_SCALEOUT_SIGNALS", "1"),
            peer_watch_ms=max(0, _int("ELASTIC_EP_PEER_WATCH_MS", 200)),
            test_corrupt={"count": 1, "source": 2, "route": 3, "own_row": 4, "expert_count": 5}.get(
                os.environ.get("ELASTIC_EP_TEST_CORRUPT", ""), 0),
            test_fail_release=os.environ.get("ELASTIC_EP_TEST_FAIL_RELEASE", ""),
            num_scaleup_ranks=num_scaleup_ranks(),
        )


def avoid_record_stream() -> bool:
    """EP_AVOID_RECORD_STREAM=1 (DeepEP's, read per call): with ``async_with_compute_stream`` the
    outputs are kept alive by the returned event instead of ``record_stream``."""
    return _is("EP_AVOID_RECORD_STREAM", "1")


def skip_nccl_version_check() -> bool:
    """ELASTIC_EP_SKIP_NCCL_VERSION_CHECK=1: no import-time check of the loaded NCCL's version."""
    return _is("ELASTIC_EP_SKIP_NCCL_VERSION_CHECK", "1")


def num_scaleup_ranks() -> Optional[int]:
    """ELASTIC_EP_NUM_SCALEUP_RANKS (read per call): the logical scale-up domain size, or None."""
    return _int("ELASTIC_EP_NUM_SCALEUP_RANKS", None)


def local_world_size() -> Optional[int]:
    """LOCAL_WORLD_SIZE (torchrun's ranks per node), or None when unset or not a positive integer."""
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        return None
    return n if n > 0 else None
