"""Argument checks shared by the two low-level backends (native ``_low_level`` and ``_torch_backend``),
so both reject the same calls with the same messages before anything is launched."""
from __future__ import annotations

from typing import Mapping, Optional


def check_dispatch_modes(do_expand: bool, do_zero_padding: bool, do_cpu_sync: bool,
                         cached: Optional[Mapping[str, object]]) -> None:
    """Raise ValueError for an inconsistent combination of dispatch modes.

    Arguments:
        do_expand, do_zero_padding, do_cpu_sync: the dispatch flags.
        cached: in cached mode, the handle's fields by argument name (``None`` values are missing);
            ``None`` when not in cached mode.
    """
    if do_zero_padding and not do_expand:
        raise ValueError("do_zero_padding requires do_expand=True")
    if cached is None:
        return
    missing = [name for name, value in cached.items() if value is None]
    if missing:
        raise ValueError(f"cached dispatch needs the whole handle; missing {', '.join(missing)}")
    if do_cpu_sync:
        raise ValueError("cached dispatch cannot do a CPU sync (do_cpu_sync must be False)")
