"""The dispatch geometry words every rank compares before any row moves: their layout (the native kernels',
csrc/kernels/geometry.hpp ``dispatch_geometry_value``, which ``_C.dispatch_geometry_words`` exposes; four
words, ``GEOMETRY_WORDS``), the words of a call (``dispatch_geometry``, ``combine_geometry``: what the torch
runtime sends with its counts, followed by ``handle_word``), what each word holds (``geometry_fields``) and
the refusal every rank raises when a peer's words differ (``geometry_error``). Both runtimes use it, so a
rank with other arguments gets the same ``ValueError`` text on either backend.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:  # the argument records only; importing _runtime here would be circular
    from ._handle import EPHandle
    from ._runtime import CombineArgs, DispatchArgs

__all__ = ["GEOMETRY_WORDS", "HANDLE_WORD", "combine_geometry", "dispatch_geometry", "geometry_error",
           "geometry_fields", "handle_word"]

GEOMETRY_WORDS = 4  # as the native runtime's (csrc/kernels/sizing.hpp kGeometryWords)
# The word the torch runtime sends after them: which dispatch's handle the call routes by (handle_word).
HANDLE_WORD = GEOMETRY_WORDS
_PACKS_BITS, _TOPK_BITS = 14, 6  # word 2's fields below num_experts (geometry.hpp)


def dispatch_geometry(a: DispatchArgs) -> Tuple[int, ...]:
    """The native runtime's dispatch geometry words of a call (csrc/kernels/geometry.hpp
    ``dispatch_geometry_value``; decoded by ``geometry_fields``). Every field is whole: the argument
    checks keep each within its bits (num_experts, top-k and ``_C.MAX_SF_PACKS`` scale packs)."""
    packs = a.sf.shape[1] if a.sf is not None else 0
    return (a.num_max_tokens_per_rank, a.hidden * a.x.element_size(), _word2(a.num_experts, a.num_topk, packs),
            (min(a.expert_alignment, 0xFFFFFF) << 8) | int(a.zero_copy))


def combine_geometry(a: CombineArgs) -> Tuple[int, ...]:
    """Combine's words in dispatch's layout: what its rows' bytes and meaning depend on (x's bytes per
    row, the handle's ``num_max_tokens_per_rank``, ``num_experts`` and top-k)."""
    h = a.handle
    return (h.num_max_tokens_per_rank, a.x.shape[1] * a.x.element_size(),
            _word2(h.num_experts, h.topk_idx.shape[1], 0), 0)


def handle_word(handle: Optional[EPHandle]) -> int:
    """Word ``HANDLE_WORD`` of a call: the serial number of the dispatch whose handle it routes by
    (``EPHandle.dispatch_id``, which every rank's runtime counts alike), 0 for a new dispatch. Ranks that
    pass handles of different dispatches of the same shapes would exchange rows by different routings."""
    return int(handle.dispatch_id) if handle is not None else 0


def _word2(num_experts: int, num_topk: int, packs: int) -> int:
    return (num_experts << (_TOPK_BITS + _PACKS_BITS)) | (num_topk << _PACKS_BITS) | packs


def geometry_fields(word: int, theirs: int, mine: int) -> Tuple[Tuple[str, ...], Tuple[int, ...], Tuple[int, ...]]:
    """The arguments packed into geometry word ``word`` (csrc/kernels/geometry.hpp; ``HANDLE_WORD``: the
    handle's dispatch), and their values in two ranks' words: ``(names, theirs, mine)``."""
    def unpack(v: int) -> Tuple[int, ...]:
        if word in (0, 1, HANDLE_WORD):
            return (v,)
        if word == 2:
            return (v >> (_TOPK_BITS + _PACKS_BITS), (v >> _PACKS_BITS) & ((1 << _TOPK_BITS) - 1),
                    v & ((1 << _PACKS_BITS) - 1))
        return (v >> 8, v & 1)
    names = {0: ("num_max_tokens_per_rank",), 1: ("bytes per row of x (hidden x element size)",),
             2: ("num_experts", "num_topk", "scale packs per token"), HANDLE_WORD: ("handle",)}.get(
                 word, ("expert_alignment", "zero_copy"))
    return names, unpack(int(theirs)), unpack(int(mine))


def _value_text(name: str, v: int) -> str:
    if name != "handle":
        return str(v)
    return f"the handle of this buffer's dispatch #{v}" if v else "no handle (a new dispatch)"


# What every rank must pass alike to each call whose geometry words the ranks compare (geometry_error).
_AGREED = {"dispatch": "num_max_tokens_per_rank, hidden size and dtype of x, num_experts, top-k, scale packs, "
                       "expert_alignment and zero_copy (and to a cached dispatch the handle of the same dispatch)",
           "combine": "hidden size of x, and the handle of the same dispatch (its num_max_tokens_per_rank, "
                      "num_experts and top-k)"}


def geometry_error(op: str, rank: int, peer: int, word: int, theirs: int, mine: int) -> ValueError:
    """The refusal every rank raises when geometry word ``word`` (``geometry_fields``) of ``peer``'s call
    differs from this rank's.

    Arguments:
        op: ``"dispatch"`` or ``"combine"`` (the torch runtime compares combine's words too).
        rank, peer: this rank and the lowest rank whose words differ.
        word, theirs, mine: the first differing word (``HANDLE_WORD`` too) and its value in the two ranks'
            calls.

    Returns:
        A ``ValueError`` naming each argument packed into the word that differs, with both values.
    """
    diffs = [f"{name}: rank {peer} passed {_value_text(name, a)}, rank {rank} (this one) {_value_text(name, b)}"
             for name, a, b in zip(*geometry_fields(word, theirs, mine)) if a != b]
    return ValueError(f"{op}: the ranks called it with different arguments ("
                      + "; ".join(diffs or [f"geometry word {word}: {theirs} vs {mine}"])
                      + "), so every rank refused it: no row moved and the buffer stays usable. Every rank "
                      f"must pass the same {_AGREED[op]} to each {op}.")
