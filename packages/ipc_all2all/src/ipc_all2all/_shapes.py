"""Shape, dtype and buffer-size logic of ipc_all2all, in pure Python (testable without a GPU).

Every public operation is planned here before anything launches: the plan names the output shape,
the bytes it needs and the row geometry the kernel uses, and every violation raises ``ValueError``
naming the argument and what was expected.

Token counts come in two modes:

* host mode (``set_rank_tokens([n0, n1, ...])``): shapes follow the counts exactly;
  ``send_recv_heads`` returns ``[b, sum(n), H/W, D]``.
* device mode (``set_rank_tokens(int32 CUDA tensor [W])``): the counts are read by the kernel, so
  they can change between CUDA-graph replays without a host sync. Shapes are then fixed by the input:
  a per-rank capacity ``L = x.shape[1]`` (``send_recv_heads``/``allgather``) and ``W * L`` rows for
  the all-token side; rank ``r``'s tokens start at row ``sum(n[:r])`` and rows past ``sum(n)`` are
  left untouched. Counts larger than ``L`` are clamped to ``L`` on the device.
"""
from __future__ import annotations

import operator

import math
from collections.abc import Iterable, Mapping, Set
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

MAX_WORLD_SIZE = 8
ALIGN = 16
SUPPORTED_ITEMSIZES = (1, 2, 4)

_QUANTIZED_DTYPES = frozenset(getattr(torch, n) for n in ("quint8", "qint8", "qint32", "quint4x2", "quint2x4")
                              if hasattr(torch, n))

OP_SEND_RECV_HEADS = 0
OP_GATHER_HEADS = 1
OP_ALLGATHER = 2
OP_NAMES = {OP_SEND_RECV_HEADS: "send_recv_heads", OP_GATHER_HEADS: "gather_heads", OP_ALLGATHER: "allgather"}


class Plan(NamedTuple):
    """Geometry of one launch (all sizes in elements of the tensor's dtype unless said bytes)."""

    op: int
    batch: int
    x_rows: int            # x.shape[1]
    out_rows: int          # rows per batch of the output, -1 = derived from host counts
    cap_rows: int          # device mode: per-rank token capacity the counts are clamped to, else -1
    chunk_bytes: int       # bytes moved per (batch, token) and target
    wide_bytes: int        # bytes of one full token row (all heads)
    out_shape: Tuple[int, int, int, int]
    out_bytes: int


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``; raises ``ValueError`` unless it is 1, 2 or 4 bytes wide (and not
    complex, bool or quantized).

    Arguments:
        dtype: a torch dtype (bf16, fp16, fp32, float8_e4m3fn, float8_e5m2, int8, ...).

    Returns:
        The element size in bytes.
    """
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor_dtype must be a torch.dtype, got {dtype!r}")
    if dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"tensor_dtype {dtype} is not supported (complex and bool are not)")
    # A quantized tensor's scale and zero point live outside its bytes: moving the bytes would hand
    # back values without them, and copy_output cannot even allocate one.
    if dtype in _QUANTIZED_DTYPES:
        raise ValueError(f"tensor_dtype {dtype} is a quantized dtype, which is not supported; pass its int_repr() "
                         "with the matching int dtype and move the scale and zero point yourself")
    size = torch.empty((), dtype=dtype).element_size()
    if size not in SUPPORTED_ITEMSIZES:
        raise ValueError(f"tensor_dtype {dtype} has {size}-byte elements; supported sizes are 1, 2 and 4 bytes")
    return size


def as_int(v):
    """``v`` as a Python int if it is an integer of any kind (numpy and torch integer scalars too, as the
    pybind11 bindings of LTX's All2All took them), else ``v`` unchanged; bools stay bools (refused later)."""
    if isinstance(v, bool):
        return v
    try:
        return operator.index(v)
    except TypeError:
        return v


def check_world(rank: int, world_size: int) -> None:
    """Raises ``ValueError`` unless ``0 <= rank < world_size <= MAX_WORLD_SIZE`` (integers of any kind)."""
    rank, world_size = as_int(rank), as_int(world_size)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be an int in [1, {MAX_WORLD_SIZE}], got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")


def capacity_bytes(num_tokens: int, hidden_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one output slot: ``num_tokens * hidden_dim`` elements, as in LTX's All2All.

    ``num_tokens`` counts rows of ``hidden_dim`` elements *per batch times batch*: send_recv_heads with
    ``W`` ranks needs ``batch * total_tokens / W`` of them, allgather ``batch * total_tokens``.
    """
    num_tokens, hidden_dim = as_int(num_tokens), as_int(hidden_dim)
    for name, v in (("num_tokens", num_tokens), ("hidden_dim", hidden_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    capacity = num_tokens * hidden_dim * element_size(dtype)
    from . import _C

    try:
        _C.check_capacity_bytes(capacity)  # the core's bound (csrc/core.cpp), before any CUDA work
    except TypeError:  # beyond an int64: past every bound, but the binding cannot say so by name
        raise ValueError(f"buffer capacity (num_tokens * hidden_dim * element size) must be at most about 2^62 "
                         f"bytes, got {num_tokens} * {hidden_dim} * {element_size(dtype)} = {capacity}") from None
    return capacity


def prefix_sums(counts: Sequence[int]) -> List[int]:
    """Exclusive prefix sums: ``[0, n0, n0+n1, ...]`` (length ``len(counts)``)."""
    out, acc = [], 0
    for n in counts:
        out.append(acc)
        acc += n
    return out


def check_counts(counts: Sequence[int], world_size: int) -> List[int]:
    """Validates host token counts: ``world_size`` non-negative ints below 2**31, in rank order."""
    # A set has no rank order and a mapping would give its keys: neither says which count is whose.
    if isinstance(counts, (str, bytes, bytearray, Set, Mapping)) or not isinstance(counts, Iterable):
        raise ValueError(f"rank_tokens must be a list of {world_size} ints (one per rank, in rank order) or an int32 "
                         f"device tensor, got {type(counts).__name__}")
    counts = [as_int(n) for n in counts]
    if len(counts) != world_size:
        raise ValueError(f"rank_tokens must have one entry per rank ({world_size}), got {len(counts)}")
    for i, n in enumerate(counts):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n >= 2**31:
            raise ValueError(f"rank_tokens[{i}] must be an int in [0, 2**31), got {n!r}")
    return counts


def check_counts_tensor(t: torch.Tensor, world_size: int, device: torch.device) -> torch.Tensor:
    """Validates device token counts: an int32, contiguous tensor of shape ``(world_size,)`` on ``device``
    (the instance's device; the kernel reads it there). Raises ``ValueError`` naming every violation."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"set_rank_tokens: expected a torch.Tensor, got {type(t).__name__}")
    problems = []
    if t.dtype != torch.int32:
        problems.append(f"dtype {t.dtype}")
    if tuple(t.shape) != (world_size,):
        problems.append(f"shape {tuple(t.shape)}")
    if t.device != device:
        problems.append(f"device {t.device}")
    if not t.is_contiguous():
        problems.append("non-contiguous strides")
    if problems:
        raise ValueError(f"set_rank_tokens: a counts tensor must be int32, contiguous, shape ({world_size},) on "
                         f"{device}; got " + ", ".join(problems))
    return t


def check_timeout_seconds(seconds) -> float:
    """``seconds`` as a float; raises ``ValueError`` unless it is a real number that the core accepts
    (finite, in ``[0, 1e9)``, 0 = wait forever). The bounds are the core's own
    (``_C.timeout_ns_from_seconds``, csrc/core.cpp), checked here before any CUDA work."""
    # numpy and torch booleans convert to 1.0 as Python's do: a flag passed by mistake, not a duration.
    if isinstance(seconds, (bool, str, bytes)) or str(getattr(seconds, "dtype", "")) in ("bool", "torch.bool"):
        raise ValueError(f"timeout_seconds must be a number of seconds, got {seconds!r}")
    try:
        s = float(seconds)
    except (TypeError, ValueError, OverflowError, RuntimeError):  # RuntimeError: a meta tensor has no value
        raise ValueError(f"timeout_seconds must be a number of seconds, got {seconds!r}") from None
    from . import _C

    _C.timeout_ns_from_seconds(s)  # ValueError naming timeout_seconds when out of range
    return s


def check_grid(num_blocks, self_blocks, world_size: int) -> Tuple[int, int]:
    """``(num_blocks, self_blocks)`` as ints; raises ``ValueError`` unless both are integers that the
    core accepts (``num_blocks`` in ``[world_size, 65535]``, ``self_blocks`` in ``[0, num_blocks)``,
    0 = automatic). The bounds are the core's own (``_C.check_grid_args``, csrc/core.cpp)."""
    num_blocks, self_blocks = as_int(num_blocks), as_int(self_blocks)
    for name, v in (("num_blocks", num_blocks), ("self_blocks", self_blocks)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an int, got {v!r}")
    from . import _C

    try:
        _C.check_grid_args(world_size, num_blocks, self_blocks)  # ValueError naming the argument
    except TypeError:  # beyond a C int: outside every bound
        raise ValueError(f"num_blocks must be in [world_size={world_size}, 65535] and self_blocks in "
                         f"[0, num_blocks), got {num_blocks}, {self_blocks}") from None
    return num_blocks, self_blocks


def _check_shape(shape: Sequence[int], what: str) -> Tuple[int, int, int, int]:
    if len(shape) != 4:
        raise ValueError(f"{what}: x must have 4 dimensions [batch, tokens, heads, head_dim], got shape {tuple(shape)}")
    # A tensor's shape is ints already; a shape given to plan() by hand must not be truncated (5.5 -> 5)
    # or parsed ("5") into one.
    b, t, h, d = dims = tuple(as_int(s) for s in shape)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in dims):
        raise ValueError(f"{what}: the shape must be 4 non-negative ints, got {tuple(shape)}")
    if h <= 0 or d <= 0:
        raise ValueError(f"{what}: heads and head_dim must be positive, got shape {tuple(shape)}")
    return b, t, h, d


def _finish(op, b, x_rows, out_rows, cap_rows, chunk, wide, out_shape, itemsize, capacity, what) -> Plan:
    if chunk % ALIGN:
        raise ValueError(
            f"{what}: each token moves {chunk} bytes per target (heads/W * head_dim * element size); "
            f"it must be a multiple of {ALIGN} bytes for 16-byte vector copies")
    out_bytes = math.prod(out_shape) * itemsize
    if out_bytes > capacity:
        raise ValueError(
            f"{what}: output {tuple(out_shape)} needs {out_bytes} bytes but the buffer holds {capacity} "
            f"(num_tokens * hidden_dim * element size); token counts exceed what the instance was built for")
    vec_rows = out_shape[0] * max(out_shape[1], x_rows) * (chunk // ALIGN)
    if vec_rows >= 2**31:
        raise ValueError(f"{what}: one call may move at most 2**31 16-byte vectors (32 GiB) per target")
    return Plan(op, b, x_rows, out_rows, cap_rows, chunk, wide, tuple(out_shape), out_bytes)


def plan_send_recv_heads(shape, itemsize: int, world_size: int, rank: int, counts: Optional[Sequence[int]],
                         capacity: int) -> Plan:
    """Plans ``x[b, local_tokens, H, D] -> out[b, total_tokens, H/W, D]``; ``counts=None`` is device mode."""
    what = "send_recv_heads"
    b, L, H, D = _check_shape(shape, what)
    if H % world_size:
        raise ValueError(f"{what}: heads ({H}) must be divisible by world_size ({world_size})")
    hpr = H // world_size
    chunk, wide = hpr * D * itemsize, H * D * itemsize
    if counts is not None:
        if L != counts[rank]:
            raise ValueError(f"{what}: x has {L} tokens but set_rank_tokens gave rank {rank} {counts[rank]}")
        return _finish(OP_SEND_RECV_HEADS, b, L, -1, -1, chunk, wide, (b, sum(counts), hpr, D), itemsize, capacity, what)
    return _finish(OP_SEND_RECV_HEADS, b, L, world_size * L, L, chunk, wide, (b, world_size * L, hpr, D), itemsize,
                   capacity, what)


def plan_gather_heads(shape, itemsize: int, world_size: int, rank: int, counts: Optional[Sequence[int]],
                      capacity: int) -> Plan:
    """Plans ``x[b, total_tokens, H/W, D] -> out[b, local_tokens, H, D]``; ``counts=None`` is device mode."""
    what = "gather_heads"
    b, T, hpr, D = _check_shape(shape, what)
    H = hpr * world_size
    chunk, wide = hpr * D * itemsize, H * D * itemsize
    if counts is not None:
        if T != sum(counts):
            raise ValueError(f"{what}: x has {T} tokens but set_rank_tokens gives a total of {sum(counts)}")
        # This rank writes n[p] rows into every target p's slot, not only its own n[rank]: the largest
        # count must fit every slot, or a rank with few tokens would write past a peer's buffer.
        biggest = b * max(counts) * H * D * itemsize
        if biggest > capacity:
            raise ValueError(
                f"{what}: the rank with {max(counts)} tokens needs an output of {biggest} bytes in every "
                f"rank's buffer, which holds {capacity} (num_tokens * hidden_dim * element size); token "
                f"counts exceed what the instance was built for")
        return _finish(OP_GATHER_HEADS, b, T, -1, -1, chunk, wide, (b, counts[rank], H, D), itemsize, capacity, what)
    if T % world_size:
        raise ValueError(f"{what}: in device-count mode x.shape[1] ({T}) must be world_size * per-rank capacity")
    L = T // world_size
    return _finish(OP_GATHER_HEADS, b, T, L, L, chunk, wide, (b, L, H, D), itemsize, capacity, what)


def plan_allgather(shape, itemsize: int, world_size: int, rank: int, counts: Optional[Sequence[int]],
                   capacity: int) -> Plan:
    """Plans ``x[b, local_tokens, h, d] -> out[b, total_tokens, h, d]``; ``counts=None`` is device mode."""
    what = "allgather"
    b, L, h, d = _check_shape(shape, what)
    chunk = h * d * itemsize
    if counts is not None:
        if L != counts[rank]:
            raise ValueError(f"{what}: x has {L} tokens but set_rank_tokens gave rank {rank} {counts[rank]}")
        return _finish(OP_ALLGATHER, b, L, -1, -1, chunk, chunk, (b, sum(counts), h, d), itemsize, capacity, what)
    return _finish(OP_ALLGATHER, b, L, world_size * L, L, chunk, chunk, (b, world_size * L, h, d), itemsize,
                   capacity, what)


PLANNERS = {OP_SEND_RECV_HEADS: plan_send_recv_heads, OP_GATHER_HEADS: plan_gather_heads, OP_ALLGATHER: plan_allgather}


def ranges_overlap(a_start: int, a_bytes: int, b_start: int, b_bytes: int) -> bool:
    """True when the byte ranges ``[a, a+na)`` and ``[b, b+nb)`` share a byte (empty ranges never do)."""
    return a_bytes > 0 and b_bytes > 0 and a_start < b_start + b_bytes and b_start < a_start + a_bytes


def check_dense_4d(x, what: str) -> None:
    """Raises ``ValueError`` unless ``x`` is a dense (strided, not nested) tensor of 4 dimensions; the
    checks that also hold while torch.compile traces (no data pointer, no device)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what}: x must be a torch.Tensor, got {type(x).__name__}")
    # Before the checks below: shape, is_contiguous() and data_ptr() raise on sparse and nested tensors
    # instead of naming the argument.
    if x.layout != torch.strided or x.is_nested:
        kind = "a nested tensor" if x.is_nested else f"layout {x.layout}"
        raise ValueError(f"{what}: x must be a dense (strided) tensor, got {kind}; call .to_dense() or "
                         ".to_padded_tensor()")
    if x.dim() != 4:
        raise ValueError(f"{what}: x must have 4 dimensions [batch, tokens, heads, head_dim], got shape "
                         f"{tuple(x.shape)}")


def validate_input(x, dtype: torch.dtype, device: torch.device, what: str) -> None:
    """Raises ``ValueError`` unless ``x`` is a dense 4-d, contiguous, 16-byte aligned ``dtype`` tensor on
    ``device``.

    Arguments:
        x: the operation's input.
        dtype: the instance's ``tensor_dtype``.
        device: the instance's device.
        what: the operation's name, for the message.
    """
    check_dense_4d(x, what)
    if x.dtype != dtype:
        raise ValueError(f"{what}: x has dtype {x.dtype}, this instance was built for {dtype}")
    if x.device != device:
        raise ValueError(f"{what}: x is on {x.device}, this instance lives on {device}")
    if not x.is_contiguous():
        raise ValueError(f"{what}: x must be contiguous (call .contiguous())")
    if x.data_ptr() % ALIGN:
        raise ValueError(f"{what}: x must be 16-byte aligned (data_ptr % 16 == {x.data_ptr() % ALIGN})")
