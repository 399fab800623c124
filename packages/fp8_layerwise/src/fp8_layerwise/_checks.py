"""Argument checks shared by the package's modules, and the limits they check against.

Every public entry point checks its arguments here before anything is created or launched: a bad
one raises ValueError naming the argument (not a TypeError from the binding, or a wrong result).
"""
from __future__ import annotations

import collections.abc
import operator
from typing import Any, List, Optional, Tuple

import torch

from . import _C

KINDS = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")
CONTROL_BYTES: int = _C.FP8_LAYERWISE_CONTROL_BYTES
MAX_TP: int = _C.FP8_LAYERWISE_MAX_TP_SIZE
MAX_SLOTS: int = _C.FP8_LAYERWISE_MAX_SLOTS
MAX_COPY_STREAMS: int = _C.FP8_LAYERWISE_MAX_COPY_STREAMS

_U64_MAX, _I64_MIN, _I64_MAX, _I32_MAX = 2 ** 64 - 1, -2 ** 63, 2 ** 63 - 1, 2 ** 31 - 1


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _int_arg(name: str, value: Any, lo: int, hi: Optional[int] = None) -> int:
    """``value`` as a plain int in ``lo..hi`` (an int or an integer type such as numpy.int64; not a
    bool, a float or a string), else ValueError naming the argument."""
    if isinstance(value, bool):
        ok = False
    else:
        try:
            value = operator.index(value)
            ok = True
        except TypeError:
            ok = False
    rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
    _check(ok, f"{name} must be an integer ({rng}), got {value!r} ({type(value).__name__})")
    _check(lo <= value and (hi is None or value <= hi), f"{name} must be in {rng}, got {value}")
    return int(value)


def _layer_args(epoch: Any, layer_id: Any = 0, expert_count: Any = 1) -> Tuple[int, int, int]:
    """The integer arguments of join / run / wait, checked for type and width only (the native
    protocol checks their meaning: epoch 0, the layer's range, what rank 0 opened), so that a float
    or a string is a ValueError naming the argument instead of the binding's TypeError."""
    return (_int_arg("epoch", epoch, 0, _U64_MAX), _int_arg("layer_id", layer_id, _I64_MIN, _I64_MAX),
            _int_arg("expert_count", expert_count, -_I32_MAX - 1, _I32_MAX))


def _bool_arg(name: str, value: Any) -> bool:
    """``value`` as a bool (a bool or numpy.bool_), else ValueError naming the argument."""
    _check(isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")),
           f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def _expert_nbytes_arg(expert_nbytes: Any, num_experts: int = 1, lo: int = 1) -> List[int]:
    """``expert_nbytes`` as 4 plain ints in ``lo..`` whose product with ``num_experts`` fits an int64
    (a layer buffer's size), else ValueError naming the argument (or the entry) at fault."""
    _check(not isinstance(expert_nbytes, (str, bytes)) and hasattr(expert_nbytes, "__len__")
           and len(expert_nbytes) == 4,
           f"expert_nbytes must be 4 positive sizes {KINDS}, got {expert_nbytes!r}")
    return [_int_arg(f"expert_nbytes[{k}]", n, lo, _I64_MAX // num_experts) for k, n in enumerate(expert_nbytes)]


def _sources_arg(sources: Any) -> List[torch.Tensor]:
    """``sources`` as the list of the 4 whole-layer tensors, else ValueError: anything else (None, a
    string, numpy arrays) failed later with a TypeError or an AttributeError that named no argument."""
    seq = isinstance(sources, collections.abc.Sequence) and not isinstance(sources, (str, bytes))
    _check(seq and len(sources) == 4,
           f"sources must hold 4 tensors {KINDS}, got {len(sources) if seq else type(sources).__name__}")
    for i, t in enumerate(sources):
        _check(isinstance(t, torch.Tensor), f"sources[{i}] ({KINDS[i]}) must be a torch.Tensor, got {type(t).__name__}")
    return list(sources)


def _check_seconds(name: str, value: Any) -> None:
    _check(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
           f"{name} must be a positive number of seconds, got {value!r}")
