"""Wall-clock bounds and "the other thread is inside the call now" handshakes, without fixed sleeps.

Bounds: a test that checks that something is detected *fast* (by the liveness check, the interrupt
hook, at once) rather than by the timeout bounds the time by :func:`fast_bound`: what the mechanism
needs plus :data:`CI_SLACK_S` of scheduling delay (a loaded 2-core CI machine), and asserts that the
bound stays well below the failure mode's time, so that a detection by the timeout still fails it.

Handshake: :class:`InsideCall` tells another thread when the main thread is blocked inside a given
native call of the transport. A call blocked in join / run / wait / reset runs the Python signal
handlers every 50 ms (or every ``liveness_ms`` if shorter; README, "Ctrl-C"), in the main thread,
with the frame of the Python function that made the native call. Between bytecodes, CPython runs
handlers only at a function's entry (its ``def`` line), at backward jumps (loops) and after a call
returned. So on a line without a loop, a handler that sees that frame at the line of the native
call runs inside the call, or after it returned: the tests use the probe only where the call cannot
return before the step the probe lets happen (a close(), a run()).
"""
from __future__ import annotations

import linecache
import signal
import threading
import time
from typing import Callable, Optional

#: Scheduling delay a loaded 2-core CI machine may add to an operation that takes milliseconds.
CI_SLACK_S = 3.0
#: How often a blocked call runs the interrupt hook at most (csrc/transport.hpp kInterruptCheckMs).
INTERRUPT_CHECK_S = 0.05


def fast_bound(expected_s: float, failure_s: float) -> float:
    """Upper bound for something that takes ``expected_s`` when it works and ``failure_s`` (e.g. the
    timeout) when it does not: ``expected_s + CI_SLACK_S``, which must stay below half of
    ``failure_s`` (else the test could not tell the two apart: configure a longer timeout)."""
    bound = expected_s + CI_SLACK_S
    assert bound <= failure_s / 2, f"bound {bound} s cannot tell success from the {failure_s} s failure mode"
    return bound


def poll(cond: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition") -> None:
    """Wait until ``cond()`` is true (checked every 2 ms), else AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s} s"
        time.sleep(0.002)


class InsideCall:
    """``with InsideCall(F.Transport.wait, "native.wait(") as probe:`` (in the main thread) arms the
    probe; ``probe.wait()`` (in any other thread) returns once the main thread was seen blocked in
    the native call made on the source line of ``func`` containing ``marker``.

    Uses SIGURG (ignored by default, so a stray one after the block does no harm); the previous
    handler is restored on exit, after every signal the probe sent was handled.
    """

    SIG = signal.SIGURG

    def __init__(self, func: Callable, marker: str):
        self.code = func.__code__
        lines = [i for i, text in enumerate(linecache.getlines(self.code.co_filename), start=1)
                 if marker in text and i >= self.code.co_firstlineno]
        assert lines, f"no line with {marker!r} in {func.__qualname__}"
        self.line = lines[0]
        self.inside = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._old: Optional[object] = None

    def _handler(self, signum, frame):
        if frame is not None and frame.f_code is self.code and frame.f_lineno == self.line:
            self.inside.set()

    def __enter__(self) -> "InsideCall":
        assert threading.current_thread() is threading.main_thread(), "arm the probe in the main thread"
        self._old = signal.signal(self.SIG, self._handler)
        return self

    def wait(self, timeout_s: float = 30.0) -> None:
        """Block until the main thread was seen inside the call (pokes it every 5 ms)."""
        deadline = time.monotonic() + timeout_s
        main = threading.main_thread().ident
        while not self.inside.is_set():
            assert time.monotonic() < deadline, f"the main thread did not enter line {self.line} within {timeout_s} s"
            with self._lock:
                if self._stop.is_set():
                    raise AssertionError("the probe was disarmed before the main thread entered the call")
                signal.pthread_kill(main, self.SIG)
            self.inside.wait(0.005)

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._stop.set()  # no signal is sent after this
        while self.SIG in signal.sigpending():  # delivered ones have run their handler by the next call
            time.sleep(0.001)
        signal.signal(self.SIG, self._old)
