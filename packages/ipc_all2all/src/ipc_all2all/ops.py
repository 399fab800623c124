"""torch custom ops over :class:`ipc_all2all.All2All`, so models using it compile with
``torch.compile(fullgraph=True)``.

The ops take the instance's integer ``comm_id`` (a registry key; tensors cannot carry the instance)
and the output token count as plain ints, which dynamo treats as constants guarded on their values.
Their fake implementations only compute shapes. The ops always return a fresh tensor
(``copy_out=True``): a compiled graph may keep an output alive across later calls, which the
zero-copy view's lifetime would not survive.

Every op also takes the device's *order token* (:func:`order_token`, ``All2All.order_token``) and
declares it mutated, although it never writes it. Each call is a collective: every rank must make
the same calls in the same order. A pure-looking op may be deleted by the compiler when nothing
reads its output (inductor drops a ``gather_heads`` whose ``[b, 0, H, D]`` output on a rank with no
tokens feeds only empty work, so that rank falls out of step with the others) or moved past another
independent call. A mutated argument makes every call an effect that is never removed, and the
chain of mutations of one token keeps all calls on a device in program order. Neither
``has_side_effect`` nor an ordered-effect registration kept the call under inductor.

The real ops check the ``out_tokens`` and ``world_size`` they are given (which the fake uses) against
the instance before the collective call, so an output can never differ from the fake's shape. There
is no autograd formula: a backward through these ops raises.

Use the wrappers::

    q = ipc_all2all.ops.send_recv_heads(q_local, a2a)
    o = ipc_all2all.ops.gather_heads(attn_out, a2a)
"""
from __future__ import annotations

import threading

import torch

from . import _registry, _shapes

_TOKENS: dict = {}
_TOKENS_LOCK = threading.Lock()


def order_token(device) -> torch.Tensor:
    """The order token of ``device``, shared by every instance on it.

    Arguments:
        device: a ``torch.device`` or string; ``"cuda"`` means the current CUDA device.

    Returns:
        A one-element int32 tensor with a static address that every op here declares as mutated, so
        that compiled graphs keep each collective call and their order. Its value means nothing and
        is never written.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _TOKENS_LOCK:
        token = _TOKENS.get(device)
        if token is None:
            token = torch.zeros(1, dtype=torch.int32, device=device)
            # A fixed address: CUDA-graph trees (mode="reduce-overhead") accept the mutation of a static
            # input instead of skipping the graph.
            torch._dynamo.mark_static_address(token)
            _TOKENS[device] = token
    return token


def _fake_shape(op: int, x: torch.Tensor, out_tokens: int, world_size: int):
    """The output shape the fake implementations promise (the real ops check theirs against it).

    A raw ``torch.ops.ipc_all2all.*`` call may pass anything: refused by name here, where torch.compile
    would otherwise fail on an unpacking, a division by zero or a negative dimension."""
    name = f"ipc_all2all.ops.{_shapes.OP_NAMES[op]}"
    _shapes.check_dense_4d(x, name)
    if world_size < 1 or out_tokens < 0:
        raise ValueError(f"{name}: world_size must be >= 1 and out_tokens >= 0, got {world_size} and {out_tokens}")
    b, _, h, d = x.shape
    if op == _shapes.OP_SEND_RECV_HEADS:
        h = h // world_size
    elif op == _shapes.OP_GATHER_HEADS:
        h = h * world_size
    return (b, out_tokens, h, d)


def _run_checked(op: int, x: torch.Tensor, comm_id: int, out_tokens: int, world_size: int, **kw) -> torch.Tensor:
    """Runs ``op`` on the instance, after checking that ``out_tokens`` and ``world_size`` describe the
    output it will return: a compiled graph sizes everything downstream from the fake's shape, and an
    output of another shape would be read as that shape without any error."""
    comm = _registry.lookup(comm_id)
    name = _shapes.OP_NAMES[op]
    if world_size != comm.world_size or out_tokens != _out_tokens(comm, op, x):
        raise ValueError(f"ipc_all2all.ops.{name}: out_tokens={out_tokens}, world_size={world_size} do not match "
                         f"the instance (world_size {comm.world_size}, output tokens {_out_tokens(comm, op, x)} for "
                         f"x of shape {tuple(x.shape)} with its current set_rank_tokens); call the op through "
                         f"ipc_all2all.ops.{name}(x, comm), which derives both from the instance")
    out = getattr(comm, name)(x, copy_output=True, **kw)
    want = _fake_shape(op, x, out_tokens, world_size)
    if tuple(out.shape) != want:  # the fake and the planner disagree: a bug here, not the caller's
        raise RuntimeError(f"ipc_all2all.ops.{name}: returned shape {tuple(out.shape)}, the fake promised {want}")
    return out


# mutates_args=("token",): see the module docstring (the token is never written).
@torch.library.custom_op("ipc_all2all::send_recv_heads", mutates_args=("token",))
def _send_recv_heads(x: torch.Tensor, token: torch.Tensor, comm_id: int, out_tokens: int, world_size: int,
                     fp8_wire: bool = False) -> torch.Tensor:
    return _run_checked(_shapes.OP_SEND_RECV_HEADS, x, comm_id, out_tokens, world_size, fp8_wire=fp8_wire)


@_send_recv_heads.register_fake
def _(x, token, comm_id, out_tokens, world_size, fp8_wire=False):
    return x.new_empty(_fake_shape(_shapes.OP_SEND_RECV_HEADS, x, out_tokens, world_size))


@torch.library.custom_op("ipc_all2all::gather_heads", mutates_args=("token",))
def _gather_heads(x: torch.Tensor, token: torch.Tensor, comm_id: int, out_tokens: int, world_size: int,
                  fp8_wire: bool = False) -> torch.Tensor:
    return _run_checked(_shapes.OP_GATHER_HEADS, x, comm_id, out_tokens, world_size, fp8_wire=fp8_wire)


@_gather_heads.register_fake
def _(x, token, comm_id, out_tokens, world_size, fp8_wire=False):
    return x.new_empty(_fake_shape(_shapes.OP_GATHER_HEADS, x, out_tokens, world_size))


@torch.library.custom_op("ipc_all2all::allgather", mutates_args=("token",))
def _allgather(x: torch.Tensor, token: torch.Tensor, comm_id: int, out_tokens: int, world_size: int) -> torch.Tensor:
    return _run_checked(_shapes.OP_ALLGATHER, x, comm_id, out_tokens, world_size)


@_allgather.register_fake
def _(x, token, comm_id, out_tokens, world_size):
    return x.new_empty(_fake_shape(_shapes.OP_ALLGATHER, x, out_tokens, world_size))


def _check_call(op: int, x: torch.Tensor, comm) -> None:
    """What the wrappers read before the op runs: ``comm`` an instance, ``x`` a dense 4-d tensor."""
    name = f"ipc_all2all.ops.{_shapes.OP_NAMES[op]}"
    if not all(hasattr(comm, a) for a in ("comm_id", "order_token", "world_size", "rank_tokens")):
        raise ValueError(f"{name}: comm must be an ipc_all2all.All2All, got {type(comm).__name__}")
    _shapes.check_dense_4d(x, name)


def _out_tokens(comm, op: int, x: torch.Tensor) -> int:
    # Host counts fix the output length; device counts leave it to the input's (static) capacity.
    counts = comm.rank_tokens
    W = comm.world_size
    if counts is None:
        return x.shape[1] // W if op == _shapes.OP_GATHER_HEADS else x.shape[1] * W
    return counts[comm.rank] if op == _shapes.OP_GATHER_HEADS else sum(counts)


def send_recv_heads(x: torch.Tensor, comm, fp8_wire: bool = False) -> torch.Tensor:
    """``comm.send_recv_heads(x, copy_out=True, fp8_wire=fp8_wire)`` as a compilable op.

    Arguments:
        x: ``[b, local_tokens, H, D]``.
        comm: a synced :class:`ipc_all2all.All2All`.
        fp8_wire: e4m3 plus scales on the wire (see ``All2All.send_recv_heads``).

    Returns:
        ``[b, total_tokens, H/W, D]``, a fresh tensor.
    """
    _check_call(_shapes.OP_SEND_RECV_HEADS, x, comm)
    return _send_recv_heads(x, comm.order_token, comm.comm_id, _out_tokens(comm, _shapes.OP_SEND_RECV_HEADS, x),
                            comm.world_size, fp8_wire)


def gather_heads(x: torch.Tensor, comm, fp8_wire: bool = False) -> torch.Tensor:
    """``comm.gather_heads(x, copy_out=True, fp8_wire=fp8_wire)`` as a compilable op.

    Arguments:
        x: ``[b, total_tokens, H/W, D]``.
        comm: a synced :class:`ipc_all2all.All2All`.
        fp8_wire: e4m3 plus scales on the wire (see ``All2All.send_recv_heads``).

    Returns:
        ``[b, local_tokens, H, D]``, a fresh tensor.
    """
    _check_call(_shapes.OP_GATHER_HEADS, x, comm)
    return _gather_heads(x, comm.order_token, comm.comm_id, _out_tokens(comm, _shapes.OP_GATHER_HEADS, x),
                         comm.world_size, fp8_wire)


def allgather(x: torch.Tensor, comm) -> torch.Tensor:
    """``comm.allgather(x, copy_out=True)`` as a compilable op.

    Arguments:
        x: ``[b, local_tokens, h, d]``.
        comm: a synced :class:`ipc_all2all.All2All`.

    Returns:
        ``[b, total_tokens, h, d]``, a fresh tensor.
    """
    _check_call(_shapes.OP_ALLGATHER, x, comm)
    return _allgather(x, comm.order_token, comm.comm_id, _out_tokens(comm, _shapes.OP_ALLGATHER, x), comm.world_size)
