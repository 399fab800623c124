"""Lifetime of an instance's shared buffer: the object torch holds for its views, and releases that
wait for the end of a CUDA-graph capture.

Zero-copy outputs are views of one uint8 tensor over the buffer, made through
``__cuda_array_interface__`` (:class:`_CudaBytes`): torch keeps that object alive while any view
lives, and it keeps the native core alive, so the buffer is freed with the last view. Native
releases (cudaFree, a device synchronisation) are not allowed inside a capture: asked for there,
they wait in ``_DEFERRED`` for the first moment outside one (:func:`release_deferred`).
"""
from __future__ import annotations

import threading
import warnings
from typing import Optional

import torch

from . import _C

#: destroy()'s default deadline for each of its waits, also when the operations wait forever (the core's).
DESTROY_TIMEOUT_SECONDS = float(_C.DESTROY_TIMEOUT_SECONDS)


def destroy_timeout(given, instance_timeout: float) -> float:
    """destroy()'s deadline: ``given`` checked, or ``max(DESTROY_TIMEOUT_SECONDS, instance_timeout)``.

    Raises:
        ValueError: ``given`` is not a positive number of seconds below 1e9 (naming timeout_seconds).
    """
    if given is None:
        return max(DESTROY_TIMEOUT_SECONDS, float(instance_timeout))
    from ._shapes import check_timeout_seconds

    seconds = check_timeout_seconds(given)
    if seconds <= 0:
        raise ValueError(f"destroy(): timeout_seconds must be positive (destroy() always has a deadline), got "
                         f"{given!r}")
    return seconds


# Native releases (cudaFree, cudaDeviceSynchronize) asked for while a CUDA graph was being captured,
# where they are not allowed (the capture would fail): run at the first later moment outside a capture.
_DEFERRED: list = []
_DEFERRED_LOCK = threading.Lock()


def _capturing(device: Optional[torch.device] = None) -> bool:
    """True when the current stream of the current device, or of ``device``, is capturing a graph."""
    try:
        if torch.cuda.is_current_stream_capturing():
            return True
        if device is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                return torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001 - CUDA unusable or torch shutting down: nothing is capturing
        return False
    return False


def _release_when_safe(release, device: Optional[torch.device] = None) -> None:
    """Runs ``release`` (a native call that frees device memory) now, or, inside a CUDA-graph capture,
    at the first moment outside one: the next construction, call or ``destroy()`` of any All2All on
    this process, or :func:`release_deferred`."""
    if _capturing(device):
        with _DEFERRED_LOCK:
            _DEFERRED.append((release, device))
        return
    release_deferred()
    release()


def release_deferred() -> int:
    """Frees what was released inside a CUDA-graph capture (a zero-copy view outliving ``destroy()``
    and dropped during a capture; an instance dropped during one). Called by every construction, call
    and ``destroy()``.

    Returns:
        How many deferred releases ran (0 while a capture is still in progress). A release that fails
        is reported as a ``ResourceWarning``, not raised.
    """
    if not _DEFERRED:
        return 0
    with _DEFERRED_LOCK:
        if any(_capturing(dev) for _, dev in _DEFERRED):
            return 0
        pending = list(_DEFERRED)
        _DEFERRED.clear()
    for release, _ in pending:
        try:
            release()
        except Exception as e:  # noqa: BLE001 - a release that fails must not fail an unrelated call
            warnings.warn(f"ipc_all2all: a deferred release failed: {e}", ResourceWarning, stacklevel=2)
    return len(pending)


class _NoOwner:
    """The owner of a :class:`_CudaBytes` while ``destroy()`` decides who frees the buffer: releases nothing."""

    @staticmethod
    def destroy() -> None:
        return None


NO_OWNER = _NoOwner()


class _CudaBytes:
    """Exposes a raw device range to torch through ``__cuda_array_interface__`` (no torch C++).

    ``owner`` is the native core that owns the memory. torch keeps this object alive for as long as any
    tensor made from it (every zero-copy view of the buffer) exists, and this object keeps the owner
    alive, so the memory cannot be freed under a live view. When the last view goes, the owner is
    destroyed (which frees the buffer; a no-op while the All2All is alive and not destroyed, since it
    holds the buffer tensor itself): so ``destroy()`` with views still alive frees the buffer when the
    last of them is dropped, and inside a CUDA-graph capture, after the capture.
    """

    def __init__(self, ptr: int, nbytes: int, owner=None, device: Optional[torch.device] = None):
        self.owner = owner
        self.device = device
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2, "strides": None,
        }

    def __del__(self):
        owner, self.owner = self.owner, None
        if owner is None:
            return
        try:
            _release_when_safe(owner.destroy, self.device)
        except Exception as e:  # noqa: BLE001 - never raise from a finalizer
            warnings.warn(f"ipc_all2all: releasing the shared buffer failed: {e}", ResourceWarning, stacklevel=1)


def _buffer_tensor(keeper: _CudaBytes, device: torch.device) -> torch.Tensor:
    """The uint8 tensor over the whole shared buffer; its storage holds ``keeper`` (see _CudaBytes)."""
    return torch.as_tensor(keeper, device=device)
