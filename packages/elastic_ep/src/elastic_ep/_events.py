"""Events of the elastic_ep API, shared by both backends: ``EventHandle`` (a point on a CUDA stream,
DeepEP's ``_C.EventHandle``) and ``EventOverlap`` (DeepEP's wrapper for overlapping communication
with computation).

Every API that takes an event (``previous_event``, ``previous_event_before_epilogue``) accepts either
an ``EventHandle`` (what ``ElasticBuffer.capture()`` returns) or an ``EventOverlap`` (what ``dispatch``
and ``combine`` return). ``EventOverlap`` also carries the hook that DeepEP V2 runs after the wait
(``register_hook_after_wait``), with the same call forms: ``current_stream_wait(release_handle)``,
``wait()``, and ``with event(release_handle=True): ...``.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

__all__ = ["EventHandle", "EventOverlap", "raw_event"]


class EventHandle:
    """A CUDA event recorded on a stream, which other streams can wait for.

    Arguments:
        stream: the stream to record on; None: the current stream. Where CUDA is not initialised (the
            torch backend on a CPU group) nothing is recorded and waiting on the handle does nothing.
    """

    def __init__(self, stream: Optional["torch.cuda.Stream"] = None) -> None:
        self.event: Optional[torch.cuda.Event] = None
        #: Tensors kept alive until the event is waited on (outputs allocated on another stream).
        self.tensors_to_record: List[torch.Tensor] = []
        if stream is not None or (torch.cuda.is_available() and torch.cuda.is_initialized()):
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """Makes the current stream wait for the event (a no-op when nothing was recorded)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """A handle on communication work, for overlapping it with computation (DeepEP's ``EventOverlap``).

    Arguments:
        event: the ``EventHandle`` (None: nothing to wait for).
        extra_tensors: tensors kept alive as long as this object.

    ``with event: ...`` runs the body, then makes the current stream wait for the event;
    ``with event(release_handle=True): ...`` also drops the event (and the tensors it keeps) after.
    """

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Optional[Callable[[], Any]] = None
        self._release_on_exit = False

    def current_stream_wait(self, release_handle: bool = False) -> Any:
        """Makes the current stream wait for the event, then runs the registered hook once.

        Without an event (the torch backend on a CPU group records none) the wait is a no-op where
        DeepEP asserts, so code written for GPUs runs unchanged on the CPU.

        Arguments:
            release_handle: drop the event afterwards (it may keep output tensors alive).

        Returns:
            What the hook returned, or None without a hook.
        """
        if self.event is not None:
            self.event.current_stream_wait()
        result = None
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            result = hook()
        if release_handle:
            self.event = None
        return result

    def wait(self) -> Any:
        """``current_stream_wait()``; returns the hook's result."""
        return self.current_stream_wait()

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """Registers a hook, run (on the current stream) by the next ``current_stream_wait``.

        Arguments:
            hook_after_wait: a callable without arguments (DeepEP's parameter name, so keyword calls
                port unchanged); at most one may be registered at a time.
        """
        if self.hook_after_wait is not None:
            raise RuntimeError("EventOverlap: a hook is already registered")
        if not callable(hook_after_wait):  # else the wait, far from here, fails calling it
            raise ValueError(f"hook_after_wait: expected a callable without arguments, got {hook_after_wait!r}")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """Sets whether leaving the next ``with`` block releases the event; returns ``self``."""
        self._release_on_exit = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        release, self._release_on_exit = self._release_on_exit, False
        self.current_stream_wait(release_handle=release)


def raw_event(e: Any) -> Optional[EventHandle]:
    """The ``EventHandle`` behind an event argument (an ``EventHandle``, an ``EventOverlap`` or None)."""
    return e.event if isinstance(e, EventOverlap) else e
