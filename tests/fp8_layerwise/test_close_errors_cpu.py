"""A host slot region whose cudaHostUnregister fails makes close() raise, after every region was released
(no GPU: the native unpin is replaced by one that fails, as a CUDA error would make it).

Before, HostSlots.close() swallowed every exception of cudaHostUnregister, and Transport.close() reported
success with the slots still pinned.
"""
from __future__ import annotations

import pytest

import fp8_layerwise as F
from fp8_layerwise import _shm

NB = [4096, 512, 2048, 256]


def _failing_unpin(monkeypatch, unpinned):
    def unpin(ptr):
        unpinned.append(ptr)
        raise RuntimeError("cudaHostUnregister failed: invalid argument")

    monkeypatch.setattr(_shm._C, "cuda_host_unregister", unpin)


@pytest.mark.fault
def test_host_slots_close_raises_a_failed_unpin_and_drops_the_segment(monkeypatch):
    unpinned = []
    _failing_unpin(monkeypatch, unpinned)
    slots = _shm.HostSlots.create(NB, 2)
    slots.registered = True  # as register_cuda leaves it
    with pytest.raises(RuntimeError, match="cudaHostUnregister failed"):
        slots.close()
    assert len(unpinned) == 1 and slots._seg is None and not slots.registered
    slots.close()  # once is enough
    assert len(unpinned) == 1


@pytest.mark.fault
def test_transport_close_releases_every_region_then_raises(monkeypatch):
    unpinned = []
    t = F.Transport(0, 1, 4, NB, num_slots=2, backend="cpu", exchange=lambda o: [o])
    slots, control = t._slots, t._control
    slots.registered = True
    closed = []
    real_close = control.close
    monkeypatch.setattr(control, "close", lambda: (closed.append("control"), real_close()))
    _failing_unpin(monkeypatch, unpinned)
    with pytest.raises(F.TransportError, match="rank 0's close\\(\\) released every region.*cudaHostUnregister failed"):
        t.close()
    assert t.closed and len(unpinned) == 1 and slots._seg is None
    assert closed == ["control"], "the control region was left mapped after the slots' failure"
    t.close()  # idempotent: nothing raised twice


@pytest.mark.fault
def test_a_failed_release_of_the_copy_backend_is_raised_by_close(monkeypatch):
    """The consumer's copy backend frees its staging memory (CUDA: cudaFreeHost, and its streams and
    events) when close() stops it. Before, every such result was dropped; now close() raises naming the
    step, after releasing the regions. FP8_LAYERWISE_TEST_FAIL_RELEASE reports the CPU backend's
    free(staging) as failed, as a CUDA error would make cudaFreeHost."""
    monkeypatch.setenv("FP8_LAYERWISE_TEST_FAIL_RELEASE", "free(staging)")
    t = F.Transport(0, 1, 4, NB, num_slots=2, backend="cpu", exchange=lambda o: [o])  # small kinds: staged
    slots, control, closed = t._slots, t._control, []
    real_close = control.close
    monkeypatch.setattr(control, "close", lambda: (closed.append("control"), real_close()))
    with pytest.raises(F.TransportError, match="copy backend's release: free\\(staging\\) failed"):
        t.close()
    assert t.closed and slots._seg is None and closed == ["control"]


def test_close_without_a_failure_raises_nothing(monkeypatch):
    monkeypatch.delenv("FP8_LAYERWISE_TEST_FAIL_RELEASE", raising=False)
    t = F.Transport(0, 1, 4, NB, num_slots=2, backend="cpu", exchange=lambda o: [o])
    t.close()
    assert t.closed and t._native.teardown_error() == ""
