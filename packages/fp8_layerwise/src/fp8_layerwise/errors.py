"""Exceptions of fp8_layerwise and the ErrorCode enum.

Once any rank fails (writer exception, copy error, timeout, dead peer, protocol violation, close
while active) the shared control region is *poisoned*: exactly one claim records (code, rank,
message), and every rank's next or current call raises the matching exception below with that
original cause. ``Transport.reset()`` (collective) clears it.

Every runtime error the package raises is a :class:`TransportError` (the native core's errors are
mapped onto these classes, with the native attributes ``rank``, ``peer`` and ``where`` kept);
bad arguments raise the builtin ``ValueError``.
"""
from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Poison codes stored in the control region (``TransportPoisoned.code``)."""

    NONE = 0
    PROTOCOL = 1  #: an API misuse seen by the protocol (epoch reuse, wait before join, mismatch)
    TIMEOUT = 2  #: a wait made no progress for ``timeout_ms``
    CUDA_INIT = 3  #: the consumer could not initialise its device / stream
    COPY = 4  #: a host-to-device (or CPU backend) copy failed
    WRITER = 5  #: the producer's writer raised
    CLOSED_WHILE_ACTIVE = 6  #: a rank closed its transport during an active layer
    PEER_DEAD = 7  #: a rank's process died (or closed) while others waited on it
    USER = 8  #: poison() called explicitly, e.g. an exception inside ``with transport.layer()``
    INTERRUPTED = 9  #: a rank's blocked call was interrupted by a signal (Ctrl-C: KeyboardInterrupt)


class TransportError(RuntimeError):
    """Base class of every fp8_layerwise runtime error.

    Raised as such for failures outside the protocol (e.g. a shared-memory segment that cannot be
    opened). Errors from the native core carry ``rank`` and ``peer`` (-1 if unknown) and ``where``
    (``file:line`` of the C++ source).
    """


class TransportClosed(TransportError):
    """The transport is closed: a call on a closed transport, or a call that another thread of this
    process was blocked in (join / run / wait / reset, or run's writer) when ``close()`` ran. That
    call leaves before ``close()`` returns, so it never touches the unmapped memory."""


class TransportPoisoned(TransportError):
    """The transport's shared region is poisoned.

    Attributes:
        code: the :class:`ErrorCode` of the original failure.
        rank: the rank that recorded it (-1 if unknown).
        message: the original cause, as recorded by that rank.
        peer: the rank the failure is blamed on, when the recording rank knew one (a timeout names
            the rank it waited for, ``PeerDied`` the rank that went), else -1.
    """

    def __init__(self, code: int, rank: int, message: str, text: str = "", peer: int = -1):
        try:
            code = ErrorCode(code)
        except ValueError:
            pass
        self.code = code
        self.rank = rank
        self.message = message
        self.peer = peer
        super().__init__(text or f"transport poisoned (code {int(code)}, rank {rank}): {message}")

    def __reduce__(self):
        return (type(self), (int(self.code), self.rank, self.message, str(self), self.peer))


class ProtocolError(TransportPoisoned):
    """The protocol was misused (code PROTOCOL)."""


class TransportTimeout(TransportPoisoned, TimeoutError):
    """A wait made no progress within the timeout (code TIMEOUT). The message names the rank(s) it
    waited for, and ``peer`` is the first of them (-1 if none could be told).

    Also raised by ``reset()`` when the other ranks do not take part in time (the region then stays
    poisoned); that one carries the native ``operation`` (what it waited for), ``peer``,
    ``expected``, ``observed`` and ``where`` too.
    """


class PeerDied(TransportPoisoned):
    """A rank's process died or closed while the others depended on it (code PEER_DEAD)."""


_BY_CODE = {
    ErrorCode.PROTOCOL: ProtocolError,
    ErrorCode.TIMEOUT: TransportTimeout,
    ErrorCode.PEER_DEAD: PeerDied,
}


def _from_native(code: int, rank: int, message: str, text: str, peer: int = -1) -> TransportPoisoned:
    """Called by the C++ exception translator: build the exception for a poison record."""
    cls = _BY_CODE.get(code, TransportPoisoned)
    return cls(code, rank, message, text, peer)


def _from_native_timeout(text: str, rank: int, peer: int, where: str, operation: str, expected: int,
                         observed: int) -> TransportTimeout:
    """Called by the C++ exception translator for a native timeout outside the poison record
    (``reset()``): a :class:`TransportTimeout` with the native attributes."""
    exc = TransportTimeout(ErrorCode.TIMEOUT, rank, text, text, peer)
    exc.where, exc.operation, exc.expected, exc.observed = where, operation, expected, observed
    return exc


def _from_native_error(text: str, rank: int, peer: int, where: str, closed: bool) -> TransportError:
    """Called by the C++ exception translator for any other native runtime error."""
    exc = (TransportClosed if closed else TransportError)(text)
    exc.rank, exc.peer, exc.where = rank, peer, where
    return exc
