"""The dispatch geometry words every rank compares before any row moves: their layout (the native kernels'
``dispatch_geometry_word``, csrc/kernels/device_common.cuh; four words, ``GEOMETRY_WORDS``), the words of a
call (``dispatch_geometry``, ``combine_geometry``: what the torch runtime sends with its counts), what each
word holds (``geometry_fields``) and the refusal every rank raises when a peer's words differ
(``geometry_error``). Both runtimes use it, so a rank with other arguments gets the same ``ValueError``
text on either backend.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

if TYPE_CHECKING:  # the argument records only; importing _runtime here would be circular
    from ._runtime import CombineArgs, DispatchArgs

__all__ = ["GEOMETRY_WORDS", "combine_geometry", "dispatch_geometry", "geometry_error", "geometry_fields"]

GEOMETRY_WORDS = 4  # as the native runtime's (csrc/kernels/sizing.hpp kGeometryWords)


def dispatch_geometry(a: DispatchArgs) -> Tuple[int, ...]:
    """The native runtime's dispatch geometry words of a call (``dispatch_geometry_word`` in
    csrc/kernels/device_common.cuh; decoded by ``geometry_fields``)."""
    packs = a.sf.shape[1] if a.sf is not None else 0
    return (a.num_max_tokens_per_rank, a.hidden * a.x.element_size(),
            (a.num_experts << 16) | (a.num_topk << 8) | (packs & 0xFF),
            (min(a.expert_alignment, 0xFFFFFF) << 8) | int(a.zero_copy))


def combine_geometry(a: CombineArgs) -> Tuple[int, ...]:
    """Combine's words in dispatch's layout: what its rows' bytes and meaning depend on (x's bytes per
    row, the handle's ``num_max_tokens_per_rank``, ``num_experts`` and top-k)."""
    h = a.handle
    return (h.num_max_tokens_per_rank, a.x.shape[1] * a.x.element_size(),
            (h.num_experts << 16) | (h.topk_idx.shape[1] << 8), 0)


def geometry_fields(word: int, theirs: int, mine: int) -> Tuple[Tuple[str, ...], Tuple[int, ...], Tuple[int, ...]]:
    """The arguments packed into dispatch geometry word ``word`` (csrc/kernels/sizing.hpp kGeometryWords),
    and their values in two ranks' words: ``(names, theirs, mine)``."""
    def unpack(v: int) -> Tuple[int, ...]:
        if word in (0, 1):
            return (v,)
        if word == 2:
            return (v >> 16, (v >> 8) & 0xFF, v & 0xFF)
        return (v >> 8, v & 1)
    names = {0: ("num_max_tokens_per_rank",), 1: ("bytes per row of x (hidden x element size)",),
             2: ("num_experts", "num_topk", "scale packs per token (mod 256)")}.get(
                 word, ("expert_alignment", "zero_copy"))
    return names, unpack(int(theirs)), unpack(int(mine))


# What every rank must pass alike to each call whose geometry words the ranks compare (geometry_error).
_AGREED = {"dispatch": "num_max_tokens_per_rank, hidden size and dtype of x, num_experts, top-k, scale packs, "
                       "expert_alignment and zero_copy",
           "combine": "hidden size of x, and the handle of the same dispatch (its num_max_tokens_per_rank, "
                      "num_experts and top-k)"}


def geometry_error(op: str, rank: int, peer: int, word: int, theirs: int, mine: int) -> ValueError:
    """The refusal every rank raises when geometry word ``word`` (``geometry_fields``) of ``peer``'s call
    differs from this rank's.

    Arguments:
        op: ``"dispatch"`` or ``"combine"`` (the torch runtime compares combine's words too).
        rank, peer: this rank and the lowest rank whose words differ.
        word, theirs, mine: the first differing word and its value in the two ranks' calls.

    Returns:
        A ``ValueError`` naming each argument packed into the word that differs, with both values.
    """
    diffs = [f"{name}: rank {peer} passed {a}, rank {rank} (this one) {b}"
             for name, a, b in zip(*geometry_fields(word, theirs, mine)) if a != b]
    return ValueError(f"{op}: the ranks called it with different arguments ("
                      + "; ".join(diffs or [f"geometry word {word}: {theirs} vs {mine}"])
                      + "), so every rank refused it: no row moved and the buffer stays usable. Every rank "
                      f"must pass the same {_AGREED[op]} to each {op}.")
