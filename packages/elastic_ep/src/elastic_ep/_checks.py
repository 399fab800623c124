"""Argument checks shared by the two low-level backends (native ``_low_level`` and ``_torch_backend``),
so both reject the same calls with the same messages before anything is launched."""
from __future__ import annotations

import os
from typing import Mapping, Optional


def index_check_enabled() -> bool:
    """Expert ids outside ``[-1, E)`` raise unless ``EP_SKIP_INDEX_CHECK=1``: the native backend's
    CPU-synced dispatch is then refused on every rank (the notify kernel counts them, free), the torch
    backend checks with torch ops (one host sync). With the check off they are treated as masked."""
    return os.environ.get("EP_SKIP_INDEX_CHECK", "0") != "1"


def expert_ids_error(num_bad: int, example: int, num_experts: int) -> ValueError:
    """The error for ``num_bad`` entries of ``topk_idx`` outside ``[-1, num_experts)``."""
    return ValueError(f"topk_idx: expert ids must be in [-1, {num_experts}), got {num_bad} outside it "
                      f"(e.g. {example})")


def count_bad_expert_ids(topk_idx, num_experts: int) -> tuple:
    """``(count, an example)`` of the ids outside ``[-1, num_experts)``, with plain torch ops (one host
    sync), for the torch backend; ``(0, 0)`` when there are none."""
    if topk_idx.numel() == 0:
        return 0, 0
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    num_bad = int(bad.sum())
    return (num_bad, int(topk_idx[bad][0])) if num_bad else (0, 0)


# The cached handle's fields a cached dispatch needs, by the low-level dispatch's argument names.
CACHED_HANDLE_FIELDS = ("cached_num_expanded_tokens", "cached_num_recv_tokens_per_expert_list",
                        "cached_psum_num_recv_tokens_per_scaleup_rank", "cached_psum_num_recv_tokens_per_expert",
                        "cached_num_unaligned_recv_tokens_per_expert", "cached_dst_buffer_slot_idx",
                        "cached_recv_src_metadata")


def cached_handle_fields(args: Mapping[str, object]) -> Optional[dict]:
    """``check_dispatch_modes``' ``cached`` argument from a low-level dispatch's arguments (e.g. its
    ``locals()``): the handle's fields in cached mode, None otherwise."""
    if args.get("cached_num_recv_tokens") is None:
        return None
    return {name: args.get(name) for name in CACHED_HANDLE_FIELDS}


def check_dispatch_modes(do_expand: bool, do_zero_padding: bool, do_cpu_sync: bool,
                         cached: Optional[Mapping[str, object]]) -> None:
    """Raise ValueError for an inconsistent combination of dispatch modes.

    Arguments:
        do_expand, do_zero_padding, do_cpu_sync: the dispatch flags.
        cached: in cached mode, the handle's fields by argument name (``None`` values are missing);
            ``None`` when not in cached mode.
    """
    if do_zero_padding and not do_expand:
        raise ValueError("do_zero_padding: only valid with do_expand=True (it zeroes the alignment gaps of the expanded layout)")
    if cached is None:
        return
    missing = [name for name, value in cached.items() if value is None]
    if missing:
        raise ValueError(f"cached dispatch needs the whole handle; missing {', '.join(missing)}")
    if do_cpu_sync:
        raise ValueError("cached dispatch cannot do a CPU sync (do_cpu_sync must be False)")
