"""Buffer sizing in Python: the seed's ``get_dispatch_buffer_size`` / ``get_combine_buffer_size`` /
``calculate_buffer_size`` for the torch backend and for CPU-only callers.

The native backend computes the same numbers in constexpr C++ (its layouts are the source of truth);
``tests/elastic_ep/test_sizing.py`` checks that both agree whenever the native module is built.

Token record (every part 16-byte aligned), as in DeepEP V2:
    dispatch: ``[hidden * elem | sf packs * 4 | topk idx int32 * K | topk weights f32 * K | src meta 2 x int32]``
    combine:  ``[hidden * 2 (bf16) | topk weights f32 * K]``
A buffer region for ``n`` ranks of ``m`` tokens each holds ``n * m`` records.
Direct mode (one scale-out rank):
    dispatch = send (0 ranks over NVLink, else 1) + receive (R ranks) regions of ``max_tokens`` records;
    combine  = send (0 over NVLink, else R regions of ``max_tokens * (1 if multi-red else K)``)
               + receive (``min(R, K)`` slots with multiple reduction, else ``K``) of ``max_tokens`` records.
Hybrid mode (S scale-out x U scale-up ranks, S > 1): the seed's formulas, with C = NUM_MAX_CHANNELS:
    dispatch = U regions of ``S * max_tokens`` + 1 of ``max_tokens`` + S of ``max_tokens + C`` records;
    combine  = ``min(U, K)`` (else K) slots of ``S * max_tokens`` + ``min(S, K)`` (else K) of ``max_tokens``
               + 1 (else K) of ``S * (max_tokens + C)`` records.
    Hybrid mode is not implemented by the native runtime; its sizes are given anyway (pure arithmetic,
    identical in ``csrc/sizing.hpp``) so a size hint never silently falls back to direct-mode figures.
``calculate_buffer_size`` = max(dispatch, combine) rounded up to 2 MiB, with ``num_topk=0`` meaning 32
and FP8 scale packs estimated as ``ceil(hidden / 32)``.
"""
from __future__ import annotations

import functools

from . import _checks

ALIGNMENT_BYTES = 2 * 1024 * 1024  # the symmetric window's granularity (the seed's kNumAlignmentBytes)
NUM_MAX_CHANNELS = 8 * 160         # the seed's kNumMaxChannels (hybrid mode; sizing.hpp kHybridNumMaxChannels)
MAX_TOPK = 32                      # sizing.hpp kMaxTopk


def align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def c_ints(**sizes) -> tuple:
    """The sizing arguments (by name, in order) as ints in a C int's range, which the native sizing
    takes: a float, a bool or a larger int is refused naming the argument (the native binding refused
    them only with pybind11's "incompatible function arguments", and took a bool as 0 / 1)."""
    out = []
    for name, v in sizes.items():
        i = _checks.int_arg(name, v)
        if not -_checks.INT32_MAX - 1 <= i <= _checks.INT32_MAX:
            raise ValueError(f"{name}: expected an int in [-2**31, 2**31) (the native sizing takes a C int), got {i}")
        out.append(i)
    return tuple(out)


def worst_case_num_expanded_tokens(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int,
                                   num_local_experts: int, expert_alignment: int) -> int:
    """Rows of an expand-mode output without a CPU sync (csrc/sizing.hpp's function of the same name):
    ``num_topk`` rows per received token (ids may repeat) plus each expert's alignment padding."""
    n = num_ranks * num_max_tokens_per_rank * num_topk + (expert_alignment - 1) * num_local_experts
    return align_up(n, expert_alignment)


def dispatch_token_bytes(hidden: int, elem_size: int, num_sf_packs: int, num_topk: int) -> int:
    """Bytes of one dispatch record (see the module docstring)."""
    return (align_up(hidden * elem_size, 16) + align_up(num_sf_packs * 4, 16) + align_up(num_topk * 4, 16)
            + align_up(num_topk * 4, 16) + 16)


def combine_token_bytes(hidden: int, elem_size: int, num_topk: int) -> int:
    """Bytes of one combine record (see the module docstring)."""
    return align_up(hidden * elem_size, 16) + align_up(num_topk * 4, 16)


def _region(token_bytes: int, num_ranks: int, num_tokens: int) -> int:
    return token_bytes * num_ranks * num_tokens


# Called on every dispatch with the same few shapes. Typed: 4.0 and True must not find the entries of 4
# and 1, and be checked (and refused) instead.
@functools.lru_cache(maxsize=256, typed=True)
def get_dispatch_buffer_size(num_max_tokens_per_rank: int, hidden: int, num_sf_packs: int, num_topk: int,
                             elem_size: int, num_scaleout_ranks: int, num_scaleup_ranks: int,
                             is_scaleup_nvlink: bool) -> int:
    """The seed's ``get_dispatch_buffer_size`` (same arguments, bytes).

    Raises:
        ValueError: an argument that is not an int in a C int's range (``c_ints``), or a size that is
            not positive (``num_sf_packs`` may be 0), with the native binding's message.
    """
    (num_max_tokens_per_rank, hidden, num_sf_packs, num_topk, elem_size, num_scaleout_ranks,
     num_scaleup_ranks) = c_ints(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                                 num_sf_packs=num_sf_packs, num_topk=num_topk, elem_size=elem_size,
                                 num_scaleout_ranks=num_scaleout_ranks, num_scaleup_ranks=num_scaleup_ranks)
    if not (num_max_tokens_per_rank > 0 and hidden > 0 and num_sf_packs >= 0 and num_topk > 0 and elem_size > 0
            and num_scaleout_ranks > 0 and num_scaleup_ranks > 0):
        raise ValueError("get_dispatch_buffer_size: every size must be positive (num_sf_packs >= 0)")
    if num_topk > MAX_TOPK:
        raise ValueError(f"get_dispatch_buffer_size: num_topk must be at most {MAX_TOPK}, got {num_topk}")
    tok = dispatch_token_bytes(hidden, elem_size, num_sf_packs, num_topk)
    num_ranks = num_scaleout_ranks * num_scaleup_ranks
    if num_scaleout_ranks == 1:
        return (_region(tok, 0 if is_scaleup_nvlink else 1, num_max_tokens_per_rank)
                + _region(tok, num_ranks, num_max_tokens_per_rank))
    return (_region(tok, num_scaleup_ranks, num_scaleout_ranks * num_max_tokens_per_rank)
            + _region(tok, 1, num_max_tokens_per_rank)
            + _region(tok, num_scaleout_ranks, num_max_tokens_per_rank + NUM_MAX_CHANNELS))


@functools.lru_cache(maxsize=256, typed=True)
def get_combine_buffer_size(num_max_tokens_per_rank: int, hidden: int, num_topk: int,
                            num_scaleout_ranks: int, num_scaleup_ranks: int,
                            is_scaleup_nvlink: bool, allow_multiple_reduction: bool) -> int:
    """The seed's ``get_combine_buffer_size`` (same arguments, bytes).

    Raises:
        ValueError: an argument that is not an int in a C int's range (``c_ints``), or a size that is
            not positive, with the native binding's message.
    """
    num_max_tokens_per_rank, hidden, num_topk, num_scaleout_ranks, num_scaleup_ranks = c_ints(
        num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk,
        num_scaleout_ranks=num_scaleout_ranks, num_scaleup_ranks=num_scaleup_ranks)
    if not (num_max_tokens_per_rank > 0 and hidden > 0 and num_topk > 0 and num_scaleout_ranks > 0
            and num_scaleup_ranks > 0):
        raise ValueError("get_combine_buffer_size: every size must be positive")
    if num_topk > MAX_TOPK:
        raise ValueError(f"get_combine_buffer_size: num_topk must be at most {MAX_TOPK}, got {num_topk}")
    tok = combine_token_bytes(hidden, 2, num_topk)
    num_ranks = num_scaleout_ranks * num_scaleup_ranks
    if num_scaleout_ranks == 1:
        slots = min(num_ranks, num_topk) if allow_multiple_reduction else num_topk
        send = _region(tok, 0 if is_scaleup_nvlink else num_ranks,
                       num_max_tokens_per_rank * (1 if allow_multiple_reduction else num_topk))
        return send + _region(tok, slots, num_max_tokens_per_rank)
    up_slots = min(num_scaleup_ranks, num_topk) if allow_multiple_reduction else num_topk
    out_slots = min(num_scaleout_ranks, num_topk) if allow_multiple_reduction else num_topk
    return (_region(tok, up_slots, num_scaleout_ranks * num_max_tokens_per_rank)
            + _region(tok, out_slots, num_max_tokens_per_rank)
            + _region(tok, 1 if allow_multiple_reduction else num_topk,
                      num_scaleout_ranks * (num_max_tokens_per_rank + NUM_MAX_CHANNELS)))


def calculate_buffer_size(num_max_tokens_per_rank: int, hidden: int, num_topk: int, use_fp8_dispatch: bool,
                          *, num_ranks: int, num_nvl_ranks: int, allow_hybrid_mode: bool = True,
                          allow_multiple_reduction: bool = True) -> int:
    """The seed's ``calculate_buffer_size`` with the topology given explicitly.

    Arguments:
        num_max_tokens_per_rank: tokens per rank the buffer must hold (> 0).
        hidden: hidden size (> 0).
        num_topk: experts per token; 0 sizes for the worst case, 32.
        use_fp8_dispatch: size dispatch records for FP8 rows plus scale packs.
        num_ranks: ranks of the group.
        num_nvl_ranks: ranks reachable over NVLink (the scale-up domain).
        allow_hybrid_mode: allow a scale-out dimension when ``num_nvl_ranks < num_ranks``.
        allow_multiple_reduction: combine reduces per rank.

    Returns:
        Bytes, a multiple of 2 MiB.

    Raises:
        ValueError: an argument that is not an int in a C int's range (``c_ints``), an argument out of
            range (the same checks and messages as the native ``calculate_buffer_size_for_domain``), or
            ``num_ranks`` not a multiple of ``num_nvl_ranks``: the seed derives its scale-out size as
            ``num_ranks / num_nvl_ranks`` (every NVLink domain holds the same number of ranks), and
            rounding it down would undersize the buffer.
    """
    num_max_tokens_per_rank, hidden, num_topk, num_ranks, num_nvl_ranks = c_ints(
        num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk, num_ranks=num_ranks,
        num_nvl_ranks=num_nvl_ranks)
    if num_max_tokens_per_rank <= 0:
        raise ValueError(f"num_max_tokens_per_rank must be positive, got {num_max_tokens_per_rank}")
    if hidden <= 0:
        raise ValueError(f"hidden must be positive, got {hidden}")
    if ceil_div(hidden, 32) * 4 > hidden:
        raise ValueError(f"hidden too small: the worst-case SF bytes ({ceil_div(hidden, 32) * 4}) exceed the "
                         "hidden bytes")
    if not 0 <= num_topk <= MAX_TOPK:
        raise ValueError(f"num_topk must be in [0, {MAX_TOPK}], got {num_topk}")
    if num_ranks <= 0 or num_nvl_ranks <= 0:
        raise ValueError(f"num_ranks and num_nvl_ranks must be positive, got {num_ranks} and {num_nvl_ranks}")
    if num_ranks % num_nvl_ranks:
        raise ValueError(f"num_ranks ({num_ranks}) must be a multiple of num_nvl_ranks ({num_nvl_ranks}): every "
                         "NVLink domain must hold the same number of ranks")
    num_topk = 32 if num_topk == 0 else num_topk
    if allow_hybrid_mode and num_nvl_ranks < num_ranks:
        scaleout, scaleup = num_ranks // num_nvl_ranks, num_nvl_ranks
    else:
        scaleout, scaleup = 1, num_ranks
    is_nvlink = scaleup == num_nvl_ranks
    elem = 1 if use_fp8_dispatch else 2
    packs = ceil_div(hidden, 32) if use_fp8_dispatch else 0
    d = get_dispatch_buffer_size(num_max_tokens_per_rank, hidden, packs, num_topk, elem, scaleout, scaleup, is_nvlink)
    c = get_combine_buffer_size(num_max_tokens_per_rank, hidden, num_topk, scaleout, scaleup, is_nvlink,
                                allow_multiple_reduction)
    return align_up(max(d, c), ALIGNMENT_BYTES)
