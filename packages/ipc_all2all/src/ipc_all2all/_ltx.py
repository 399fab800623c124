"""What makes :class:`ipc_all2all.All2All` a drop-in for LTX's Python ``All2All`` beyond the
constructor: the ``copy_out`` / ``copy_output`` flag of the operations and the ``runtime`` attribute,
which in LTX's class is the native object (``get_local_ipc_handle``, ``sync``, ``set_rank_tokens``,
``set_timeout_seconds``, the three operations with a positional ``copy_out``, ``destroy``).
"""
from __future__ import annotations

from typing import Optional


def copy_flag(copy_out, copy_output: Optional[bool], what: str) -> bool:
    """The copy flag of an operation, from LTX's spelling ``copy_out`` or this package's ``copy_output``.

    Raises ``ValueError`` if either is not a bool, or if ``copy_output`` is given while ``copy_out``
    is True (``copy_out=False`` cannot be told apart from its default, so ``copy_out=False,
    copy_output=True`` means ``copy_output=True``).
    """
    if not isinstance(copy_out, bool):
        raise ValueError(f"{what}: copy_out must be a bool, got {type(copy_out).__name__}")
    if copy_output is None:
        return copy_out
    if not isinstance(copy_output, bool):
        raise ValueError(f"{what}: copy_output must be a bool, got {type(copy_output).__name__}")
    if copy_out:
        raise ValueError(f"{what}: pass copy_out (LTX's spelling) or copy_output, not both")
    return copy_output


class Runtime:
    """``All2All.runtime``: the methods of LTX's native ``all2all_cpp.All2All`` over an instance.

    LTX's Python class keeps its native object as ``runtime``; code that calls it directly gets the
    same method names and argument order here (``send_recv_heads(x, copy_out)`` with a positional
    flag). Every call goes to the instance, with its checks.
    """

    __slots__ = ("_a2a",)

    def __init__(self, a2a):
        self._a2a = a2a

    def get_local_ipc_handle(self) -> bytes:
        return self._a2a.get_local_ipc_handle()

    def sync(self, all_gathered_handles) -> None:
        self._a2a.sync(all_gathered_handles)

    def set_rank_tokens(self, rank_num_tokens) -> None:
        self._a2a.set_rank_tokens(rank_num_tokens)

    def set_timeout_seconds(self, seconds: float) -> None:
        self._a2a.set_timeout_seconds(seconds)

    def send_recv_heads(self, x, copy_out: bool = False):
        return self._a2a.send_recv_heads(x, copy_out=copy_out)

    def gather_heads(self, x, copy_out: bool = False):
        return self._a2a.gather_heads(x, copy_out=copy_out)

    def allgather(self, x, copy_out: bool = False):
        return self._a2a.allgather(x, copy_out=copy_out)

    def destroy(self) -> None:
        self._a2a.destroy()

    def __repr__(self) -> str:
        return f"<ipc_all2all runtime of {self._a2a!r}>"
