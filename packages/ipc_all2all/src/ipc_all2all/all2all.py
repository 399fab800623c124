"""The :class:`All2All` instance: construction (collective or by hand), token counts, the three
operations, errors and teardown. The package docstring describes the protocol."""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Dict, List, Optional, Sequence, Union

import torch

from . import _C, _collective, _lifetime, _registry, ops
from ._ltx import Runtime, copy_flag
from ._shapes import (
    OP_ALLGATHER,
    OP_GATHER_HEADS,
    OP_NAMES,
    OP_SEND_RECV_HEADS,
    PLANNERS,
    SUPPORTED_ITEMSIZES,
    Plan,
    _check_shape,
    as_int,
    capacity_bytes,
    check_counts,
    check_counts_tensor,
    check_grid,
    check_timeout_seconds,
    check_world,
    element_size,
    prefix_sums,
    ranges_overlap,
    validate_input,
)

#: head_dim values the fp8-on-the-wire mode takes (one group of D / 8 lanes per head vector).
FP8_WIRE_HEAD_DIMS = (16, 32, 64, 128, 256)
CommError = _C.CommError
CommTimeoutError = _C.CommTimeoutError
DEFAULT_TIMEOUT_SECONDS = 10.0
DESTROY_TIMEOUT_SECONDS = _lifetime.DESTROY_TIMEOUT_SECONDS


def built_with_cuda() -> bool:
    """Whether the extension was compiled with its CUDA kernels.

    Returns:
        True for a CUDA build; False for a host-only build, whose :class:`All2All` cannot be constructed.
    """
    return bool(_C.built_with_cuda())


def _device_sm_count() -> int:
    """The current CUDA device's SM count (the default ``num_sms``)."""
    if not torch.cuda.is_available():
        raise RuntimeError("ipc_all2all.All2All needs a CUDA device; none is available")
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


class All2All:
    """One CUDA-IPC all-to-all instance, with the constructor and methods of LTX's ``All2All``.

    Arguments:
        rank: this process's rank in ``[0, world_size)`` (with ``group``: its rank in the group); need
            not equal the CUDA device index (the instance lives on the current CUDA device at
            construction).
        world_size: number of ranks, 1 to 8 (with ``group``: the group's size).
        seqlen: rows of ``hidden_dim`` elements one output slot holds (LTX's name; ``num_tokens`` in
            :meth:`from_group`). ``send_recv_heads`` needs ``batch * ceil(total_tokens / W)`` of
            them (for even shards: ``batch * local_tokens``), ``gather_heads`` ``batch *
            local_tokens``, ``allgather`` ``batch * total_tokens``.
        hidden_dim: elements per token row (``heads * head_dim``) used for sizing.
        num_sms: CUDA blocks per launch (the SM count of the GPU is a good value); None: the current
            device's SM count.
        tensor_dtype: dtype of every tensor passed in; any 1-, 2- or 4-byte dtype.
        group: a ``torch.distributed`` process group. Given, the construction is collective over it,
            as LTX's is: every rank builds its instance, the ranks exchange the IPC handles, and the
            instance is ready to use; if any rank fails, every rank raises, naming it; ``destroy()``
            is collective too. ``None``: the low-level form, where the caller exchanges the handles
            (:meth:`get_local_ipc_handle`, :meth:`sync`). LTX's class treats ``None`` as the default
            group: pass ``torch.distributed.group.WORLD`` for that.
        timeout_seconds: device-side deadline of every wait (default 10 s; 0 = wait forever). The
            deadline restarts whenever the awaited counter moves.

    Collective (LTX's form)::

        a = All2All(rank, W, seqlen, hidden, num_sms, torch.bfloat16, group=group)

    Low-level (the caller exchanges handles: fixed-size bytes, ``_C.HANDLE_BYTES`` long, so one
    tensor all-gather carries them; ``all_gather_object`` would unpickle what the peers send)::

        a = All2All(rank, W, seqlen, hidden, num_sms, torch.bfloat16)
        mine = torch.frombuffer(bytearray(a.get_local_ipc_handle()), dtype=torch.uint8).cuda()  # gloo: CPU
        every = [torch.empty_like(mine) for _ in range(W)]; dist.all_gather(every, mine)
        a.sync([bytes(t.tolist()) for t in every])

    :meth:`from_group` is the collective form with keyword arguments and defaults.
    """

    def __init__(self, rank: int, world_size: int, seqlen: int, hidden_dim: int, num_sms: Optional[int],
                 tensor_dtype: torch.dtype, group=None, timeout_seconds: Optional[float] = None):
        if isinstance(group, (int, float)) and not isinstance(group, bool):
            # ipc_all2all 0.1.0 took timeout_seconds as the seventh argument, where group now is.
            if timeout_seconds is not None:
                raise ValueError(f"All2All: group must be a torch.distributed.ProcessGroup, got {group!r} (and "
                                 "timeout_seconds is given too)")
            warnings.warn("All2All(..., tensor_dtype, timeout_seconds) with timeout_seconds as the seventh argument "
                          "is deprecated: the seventh argument is group (LTX's order); pass timeout_seconds=...",
                          DeprecationWarning, stacklevel=2)
            group, timeout_seconds = None, group
        if group is None:
            self._build(rank, world_size, seqlen, hidden_dim, num_sms, tensor_dtype, timeout_seconds)
            return
        what = "All2All(group=...)"
        g_rank, g_world = _collective.group_rank_and_size(group, what)
        err, payload = None, None
        try:  # everything that can fail locally happens before the exchange, so no rank is left waiting
            if as_int(rank) != g_rank or as_int(world_size) != g_world:
                raise ValueError(f"rank={rank}, world_size={world_size} do not match the group (this process is "
                                 f"rank {g_rank} of {g_world})")
            self._build(rank, world_size, seqlen, hidden_dim, num_sms, tensor_dtype, timeout_seconds)
            payload = _collective.local_payload(self)
        except Exception as e:  # noqa: BLE001 - reported to every rank by the exchange
            err, payload = e, _collective.error_payload(e)
        # self, also after a failure: a native core built before the failure is released with it
        _collective.exchange(self, err, payload, group, g_rank, g_world, what)
        self._group = group
        self._collective = True

    def _build(self, rank, world_size, seqlen, hidden_dim, num_sms, tensor_dtype, timeout_seconds) -> None:
        """The local construction: checks every argument, then allocates the buffer on the current device."""
        check_world(rank, world_size)
        rank, world_size, seqlen, hidden_dim = (as_int(v) for v in (rank, world_size, seqlen, hidden_dim))
        _lifetime.release_deferred()
        self.itemsize = element_size(tensor_dtype)
        capacity = capacity_bytes(seqlen, hidden_dim, tensor_dtype)
        timeout_seconds = check_timeout_seconds(DEFAULT_TIMEOUT_SECONDS if timeout_seconds is None else timeout_seconds)
        num_sms = _device_sm_count() if num_sms is None else as_int(num_sms)
        if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < world_size:
            raise ValueError(f"num_sms must be an int >= world_size ({world_size}), got {num_sms!r}")
        try:  # the upper bound too, before the device checks below: an argument error must say so
            check_grid(num_sms, 0, world_size)
        except ValueError as e:
            raise ValueError(f"num_sms ({num_sms}) is out of range: {e}") from None
        if not torch.cuda.is_available():
            raise RuntimeError("ipc_all2all.All2All needs a CUDA device; none is available")
        if not built_with_cuda():
            raise RuntimeError("ipc_all2all was built without CUDA kernels (no nvcc at build time); rebuild with CUDA")
        self.rank = rank
        self.world_size = world_size
        self.seqlen = self.num_tokens = seqlen
        self.hidden_dim = hidden_dim
        self.num_sms = num_sms
        self.tensor_dtype = tensor_dtype
        self._core = _C.Core(rank, world_size, capacity, num_sms, float(timeout_seconds))
        self.device = torch.device("cuda", self._core.device)
        #: Bytes of one output slot, ``seqlen * hidden_dim * element size`` (LTX's ``buffer_size``; the
        #: allocation holds two slots and the signals).
        self.capacity = self.buffer_size = capacity
        self._group = None
        self._collective = False  # set by a collective construction: destroy() then waits for every rank of _group
        self._buf: Optional[torch.Tensor] = None
        # alive while _buf or a view of it is
        self._keeper: Optional["weakref.ref[_lifetime._CudaBytes]"] = None
        #: One-element tensor that the compilable ops (``ipc_all2all.ops``) declare as mutated, shared
        #: by every instance on this device: torch.compile then keeps every call, in program order.
        self.order_token = ops.order_token(self.device)
        self._counts: Optional[List[int]] = None
        self._counts_dev: Optional[torch.Tensor] = None
        self._captured_counts: Dict[int, torch.Tensor] = {}  # counts tensors captured graphs read
        self._plans: dict = {}
        self.comm_id = _registry.register(self)

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_group(cls, group=None, *, num_tokens: int, hidden_dim: int, tensor_dtype: torch.dtype,
                   num_sms: Optional[int] = None, timeout_seconds: Optional[float] = None) -> "All2All":
        """Builds an instance on every rank of ``group`` (collective) and exchanges the IPC handles.

        Arguments:
            group: a torch.distributed process group (default: WORLD), normally one process per GPU
                (ranks sharing a GPU work too, time-sliced: useful for tests, not for speed).
            num_tokens: the constructor's ``seqlen``.
            hidden_dim, tensor_dtype, timeout_seconds: as for the constructor.
            num_sms: blocks per launch; default the current device's SM count.

        Returns:
            A ready instance whose :meth:`destroy` is collective over ``group``. If any rank fails
            to build or to open a peer's buffer, every rank raises ``CommError`` naming it.
        """
        import torch.distributed as dist

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        obj, err = None, None
        try:  # everything that can fail locally happens before the exchange, so no rank is left waiting
            check_world(rank, world)
            capacity_bytes(num_tokens, hidden_dim, tensor_dtype)  # argument errors first, then the device
            check_timeout_seconds(DEFAULT_TIMEOUT_SECONDS if timeout_seconds is None else timeout_seconds)
            if num_sms is None:
                num_sms = _device_sm_count()
            obj = cls(rank, world, num_tokens, hidden_dim, num_sms, tensor_dtype, timeout_seconds=timeout_seconds)
            payload = _collective.local_payload(obj)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            err, payload = e, _collective.error_payload(e)
        _collective.exchange(obj, err, payload, group, rank, world, "All2All.from_group")
        obj._group = group  # None is the default group (WORLD): destroy() is collective over it too
        obj._collective = True
        return obj

    def get_local_ipc_handle(self) -> bytes:
        """This rank's handle, for every rank's :meth:`sync`.

        Returns:
            Opaque bytes (``_C.HANDLE_BYTES`` long) holding the CUDA IPC handle of the buffer and what
            every rank must agree on (world size, rank, slot capacity). Raises ``CommError`` after
            :meth:`destroy`.
        """
        return self._core.ipc_handle()

    def sync(self, all_gathered_handles: Sequence[Union[bytes, bytearray]]) -> None:
        """Opens every peer's buffer. Every rank must have been built with the same world size and
        ``num_tokens * hidden_dim * element size`` (the buffers share one layout): the handles carry
        both, and a mismatch raises ``ValueError`` naming the rank before any peer memory is opened.

        Arguments:
            all_gathered_handles: every rank's :meth:`get_local_ipc_handle`, indexed by rank.
        """
        # bytes iterate as ints and a non-sequence not at all: neither is every rank's handle
        if isinstance(all_gathered_handles, (str, bytes, bytearray)) or not isinstance(all_gathered_handles, Iterable):
            raise ValueError(f"sync(): all_gathered_handles must be a list of every rank's get_local_ipc_handle() "
                             f"(bytes, in rank order), got {type(all_gathered_handles).__name__}")
        handles = []
        for i, h in enumerate(all_gathered_handles):
            if not isinstance(h, (bytes, bytearray)):
                raise ValueError(f"sync(): handle {i} must be bytes, got {type(h).__name__}")
            handles.append(bytes(h))
        self._core.open_peers(handles)
        keeper = _lifetime._CudaBytes(self._core.buffer_ptr, self._core.buffer_bytes, owner=self._core,
                                      device=self.device)
        self._buf = _lifetime._buffer_tensor(keeper, self.device)
        self._keeper = weakref.ref(keeper)

    # ----------------------------------------------------------------------------- configuration
    def set_rank_tokens(self, rank_num_tokens: Union[Sequence[int], torch.Tensor]) -> None:
        """Sets every rank's token count for the following calls (the same on every rank).

        Arguments:
            rank_num_tokens: a list of ``world_size`` ints (host mode: output shapes follow them), or
                an int32 CUDA tensor of shape ``[world_size]`` on this instance's device (device mode:
                the kernels read it at run time, so it may change between CUDA-graph replays; shapes
                are then fixed by the inputs, see ``ipc_all2all._shapes``). No host synchronisation.
        """
        self._require_alive("set_rank_tokens")
        if isinstance(rank_num_tokens, torch.Tensor):
            self._counts, self._counts_dev = None, check_counts_tensor(rank_num_tokens, self.world_size, self.device)
        else:
            self._counts, self._counts_dev = check_counts(rank_num_tokens, self.world_size), None
        self._plans = {}

    def set_timeout_seconds(self, seconds: float) -> None:
        """Sets the device-side deadline of every wait; applies to later launches (a captured CUDA
        graph keeps the deadline it was captured with).

        Arguments:
            seconds: a real number in ``[0, 1e9)``; 0 waits forever. Any positive value, however small,
                is a deadline (at least 1 ns), never "forever". Raises ``ValueError`` otherwise.
        """
        self._require_alive("set_timeout_seconds")
        self._core.set_timeout_seconds(check_timeout_seconds(seconds))

    def set_grid(self, num_blocks: int, self_blocks: int = 0) -> None:
        """Tuning of later launches (ranks may differ; results do not depend on it).

        Arguments:
            num_blocks: CUDA blocks per launch, in ``[world_size, 65535]``.
            self_blocks: how many of them copy to the own rank, in ``[0, num_blocks)``; 0 = automatic.
        """
        self._require_alive("set_grid")
        self._core.set_grid(*check_grid(num_blocks, self_blocks, self.world_size))

    @property
    def rank_tokens(self) -> Optional[List[int]]:
        """The host token counts, or None in device mode / before :meth:`set_rank_tokens`."""
        return None if self._counts is None else list(self._counts)

    @property
    def total_tokens(self) -> Optional[int]:
        """Sum of the host token counts (None in device mode)."""
        return None if self._counts is None else sum(self._counts)

    @property
    def prefix_rank_tokens(self) -> Optional[List[int]]:
        """Exclusive prefix sums of the host token counts (None in device mode)."""
        return None if self._counts is None else prefix_sums(self._counts)

    # ----------------------------------------------------------------------------- operations
    def plan(self, op: int, shape: Sequence[int], itemsize: Optional[int] = None) -> Plan:
        """Validates a shape for ``op`` against the current token counts, without launching anything.

        Arguments:
            op: ``_shapes.OP_SEND_RECV_HEADS``, ``OP_GATHER_HEADS`` or ``OP_ALLGATHER``.
            shape: the input's shape ``[b, tokens, heads, head_dim]``.
            itemsize: bytes per element of what moves; default the instance's dtype.

        Returns:
            The launch plan (``_shapes.Plan``: output shape and bytes, row geometry). Raises
            ``ValueError`` naming what is wrong.
        """
        self._require_alive("plan")
        # Checked before the plan cache: True == 1 and 5.0 == 5 would find another call's plan there.
        if isinstance(op, bool) or op not in OP_NAMES:
            raise ValueError(f"plan: op must be one of {sorted(OP_NAMES)} ({', '.join(OP_NAMES.values())}), got {op!r}")
        if itemsize is not None and (isinstance(itemsize, bool) or itemsize not in SUPPORTED_ITEMSIZES):
            raise ValueError(f"plan: itemsize must be one of {SUPPORTED_ITEMSIZES} bytes, got {itemsize!r}")
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
            raise ValueError(f"plan: shape must be a sequence of 4 ints, got {type(shape).__name__}")
        shape = tuple(shape)
        _check_shape(shape, OP_NAMES[op])
        return self._plan(op, shape, itemsize)

    def _plan(self, op: int, shape: Sequence[int], itemsize: Optional[int] = None) -> Plan:
        """:meth:`plan` for the call path, whose ``op``, shape (a tensor's) and itemsize are known good."""
        if self._counts is None and self._counts_dev is None:
            raise ValueError(f"{OP_NAMES[op]}: call set_rank_tokens() first")
        itemsize = self.itemsize if itemsize is None else itemsize
        key = (op, tuple(shape), itemsize)
        plan = self._plans.get(key)
        if plan is None:  # planning is pure, so a step's repeated shapes skip it (host overhead per call)
            plan = PLANNERS[op](key[1], itemsize, self.world_size, self.rank, self._counts, self.capacity)
            self._plans[key] = plan
        return plan

    def _check_input(self, x: torch.Tensor, what: str) -> None:
        validate_input(x, self.tensor_dtype, self.device, what)

    def _run(self, op: int, x: torch.Tensor, copy_output: bool, fp8_wire: bool = False) -> torch.Tensor:
        what = OP_NAMES[op]
        if _lifetime._DEFERRED:
            _lifetime.release_deferred()
        self._require_alive(what)
        # One read: destroy() from another thread may clear self._buf meanwhile, and this reference
        # keeps the slots allocated until the output below is made.
        buf = self._buf
        if buf is None:
            if self._core.opened:
                raise CommError(f"{what}: this All2All instance was destroyed")
            raise CommError(f"{what}: call sync() (or use All2All.from_group) before the first operation")
        self._check_input(x, what)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        capture = self._core.capture_id(stream)  # 0: an eager call
        if fp8_wire:
            return self._run_fp8(op, x, what, stream, capture)
        p = self._plan(op, x.shape)
        slot = self._check_slot(x, what, capture)
        self._launch(op, x.data_ptr(), p, slot, stream, capture)
        off = self._core.slot_offset(slot)
        out = buf[off:off + p.out_bytes].view(self.tensor_dtype).view(p.out_shape)
        # Once calls of this instance sit in a CUDA graph, any replay may rewrite either slot behind
        # the host's back, so an eager view could not keep its promise (valid until call N+2): eager
        # calls then always return a copy, made on this stream before anything else can run.
        if copy_output or (capture == 0 and self._core.captured_calls > 0):
            out = out.clone()
            # The copy reads the slot too: a next call on another stream must wait for it, not only
            # for the kernel (the slot is rewritten two calls later).
            self._core.record_last_call(stream, capture != 0)
        return out

    def _check_slot(self, x: torch.Tensor, what: str, capture: int = 0) -> int:
        """The slot the next call writes; refuses an input that lies in it, and inside a CUDA graph
        capture an input that is a zero-copy view made outside that capture."""
        slot = self._core.next_slot
        base, nbytes = self._core.buffer_ptr, x.numel() * x.element_size()
        # Peers write this slot during the call; an input inside it would be overwritten while read.
        if ranges_overlap(x.data_ptr(), nbytes, base + self._core.slot_offset(slot), self.capacity):
            raise ValueError(f"{what}: x lies in the output slot this call writes (a zero-copy output from two "
                             "calls ago); pass copy_out=True to that call or clone x")
        other = 1 - slot
        if capture and self._core.slot_capture(other) != capture and \
                ranges_overlap(x.data_ptr(), nbytes, base + self._core.slot_offset(other), self.capacity):
            # Every replay would read that slot again, after later eager calls or other graphs'
            # replays have rewritten it.
            raise ValueError(f"{what}: inside a CUDA graph capture, x is a zero-copy output of a call made outside "
                             "this capture (eager, or in another graph); each replay would read that slot again "
                             "after other calls rewrote it. Pass copy_out=True to the call that made x, or "
                             "clone x into a static tensor before capturing")
        return slot

    def _launch(self, op: int, x_ptr: int, p: Plan, slot: int, stream: int, capture: int,
                pack_head_dim: int = 0) -> None:
        counts_ptr = 0 if self._counts_dev is None else self._counts_dev.data_ptr()
        if capture and counts_ptr:
            # Every replay reads the counts tensor set at capture time by address: a later
            # set_rank_tokens(other) must not let it be freed (and its memory reused) under the graph.
            self._captured_counts[id(self._counts_dev)] = self._counts_dev
        got = self._core.launch(op, x_ptr, stream, p.batch, p.x_rows, p.out_rows, p.cap_rows,
                                p.chunk_bytes, p.wide_bytes, self._counts or [], counts_ptr, pack_head_dim)
        assert got == slot

    def _run_fp8(self, op: int, x: torch.Tensor, what: str, stream: int, capture: int) -> torch.Tensor:
        """fp8 on the wire: the push packs every head vector into an e4m3 record as it moves it (the
        geometry is planned in record bytes), and the receiver unpacks its slot into a fresh bf16
        output (the kernels are described in csrc/kernels.cu)."""
        if op not in (OP_SEND_RECV_HEADS, OP_GATHER_HEADS):
            raise ValueError(f"{what}: fp8_wire applies to send_recv_heads and gather_heads only")
        if self.tensor_dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
            raise ValueError(f"{what}: fp8_wire needs a bfloat16 instance and input, got instance "
                             f"{self.tensor_dtype} and x {x.dtype}")
        b, rows, heads, D = x.shape
        if D not in FP8_WIRE_HEAD_DIMS:
            raise ValueError(f"{what}: fp8_wire needs head_dim (x.shape[3]) in {FP8_WIRE_HEAD_DIMS}, got {D}")
        p = self._plan(op, (b, rows, heads, D + _C.FP8_RECORD_PAD), itemsize=1)  # every check before the launch
        slot = self._check_slot(x, what, capture)
        self._launch(op, x.data_ptr(), p, slot, stream, capture, pack_head_dim=D)
        ob, orows, oheads, _ = p.out_shape
        out = torch.empty((ob, orows, oheads, D), dtype=torch.bfloat16, device=self.device)
        self._core.fp8_unpack(self._core.buffer_ptr + self._core.slot_offset(slot), out.data_ptr(),
                              ob * orows * oheads, D, stream)
        return out

    def send_recv_heads(self, x: torch.Tensor, copy_out: bool = False, *, copy_output: Optional[bool] = None,
                        fp8_wire: bool = False) -> torch.Tensor:
        """Scatters heads, gathers tokens: ``x[b, local_tokens, H, D] -> [b, total_tokens, H/W, D]``.

        Arguments:
            x: contiguous, 16-byte aligned, ``tensor_dtype``, on this instance's device; ``H`` divisible
                by ``world_size`` and ``H/W * D * element size`` a multiple of 16 bytes.
            copy_out: return a fresh tensor instead of a view into the shared buffer (outside a
                capture, always fresh once a call of this instance was captured in a CUDA graph).
                Positional too: LTX's C++ class takes it second (``send_recv_heads(x, True)``), its
                Python class by keyword.
            copy_output: the same flag under this package's older name (give one of the two).
            fp8_wire: send e4m3 plus one fp32 scale per head vector instead of bf16 (bf16 instance
                and input, ``D`` in 16..256, a power of two): about half the bytes on NVLink, lossy
                (each head vector is scaled to its own maximum, 448). The output is always a fresh
                bf16 tensor, bitwise equal to ``bf16(e4m3(x / s) * s)`` with ``s = amax / 448``
                moved by the exact path.

        Returns:
            Rank ``r``'s heads ``[r*H/W, (r+1)*H/W)`` of every rank's tokens, in rank order. Inside
            ``torch.compile`` the call is the custom op ``ipc_all2all::send_recv_heads`` and returns a
            fresh tensor whatever ``copy_out`` says.
        """
        copy = copy_flag(copy_out, copy_output, "send_recv_heads")
        if torch.compiler.is_compiling():
            return ops.send_recv_heads(x, self, fp8_wire=fp8_wire)
        return self._run(OP_SEND_RECV_HEADS, x, copy, fp8_wire)

    def gather_heads(self, x: torch.Tensor, copy_out: bool = False, *, copy_output: Optional[bool] = None,
                     fp8_wire: bool = False) -> torch.Tensor:
        """Inverse of :meth:`send_recv_heads`: ``x[b, total_tokens, H/W, D] -> [b, local_tokens, H, D]``.

        Arguments:
            x: as for :meth:`send_recv_heads`; may be the previous call's zero-copy output.
            copy_out, copy_output: as for :meth:`send_recv_heads`.
            fp8_wire: as for :meth:`send_recv_heads`.

        Returns:
            This rank's tokens with all heads (inside ``torch.compile``: the custom op, a fresh tensor).
        """
        copy = copy_flag(copy_out, copy_output, "gather_heads")
        if torch.compiler.is_compiling():
            return ops.gather_heads(x, self, fp8_wire=fp8_wire)
        return self._run(OP_GATHER_HEADS, x, copy, fp8_wire)

    def allgather(self, x: torch.Tensor, copy_out: bool = False, *,
                  copy_output: Optional[bool] = None) -> torch.Tensor:
        """Concatenates every rank's tokens: ``x[b, local_tokens, h, d] -> [b, total_tokens, h, d]``.

        Arguments:
            x: contiguous, 16-byte aligned, ``h * d * element size`` a multiple of 16 bytes.
            copy_out, copy_output: as for :meth:`send_recv_heads`.

        Returns:
            The same tensor on every rank (inside ``torch.compile``: the custom op, a fresh tensor).
        """
        copy = copy_flag(copy_out, copy_output, "allgather")
        if torch.compiler.is_compiling():
            return ops.allgather(x, self)
        return self._run(OP_ALLGATHER, x, copy)

    @property
    def runtime(self) -> Runtime:
        """The methods of LTX's native class (``runtime`` in LTX's ``All2All``) over this instance."""
        return Runtime(self)

    @property
    def group(self):
        """The process group of a collective construction (None: the default group, or the low-level form
        when :attr:`collective` is False)."""
        return self._group

    @property
    def collective(self) -> bool:
        """True for an instance built collectively (``group=`` or :meth:`from_group`): its :meth:`destroy`
        waits for every rank of the group."""
        return self._collective

    # ----------------------------------------------------------------------------- errors, teardown
    def check(self) -> None:
        """Raises what a finished launch recorded, as :meth:`synchronize` does, without waiting:
        ``CommTimeoutError`` (with ``.operation``, ``.rank``, ``.peer``) or ``CommError``. Returns
        None when nothing was recorded (also after :meth:`destroy`)."""
        self._core.check()

    def synchronize(self) -> None:
        """Waits for this device's current stream and for the instance's last call (whatever stream it
        was made on), then raises what a kernel recorded: ``CommTimeoutError`` for a timeout,
        ``CommError`` for a call the peers ran differently or a call abandoned after a failure."""
        self._core.synchronize(torch.cuda.current_stream(self.device).cuda_stream)

    @property
    def broken(self) -> bool:
        """True after a device-side failure was raised (timeout, mismatched call, abandoned call): the
        instance refuses further calls and must be destroyed on every rank and built anew."""
        return self._core.broken

    @property
    def destroyed(self) -> bool:
        """True once :meth:`destroy` ran; every later call raises ``CommError``."""
        return self._core.destroyed

    def _require_alive(self, what: str) -> None:
        """Raises ``CommError`` naming ``what`` once :meth:`destroy` ran. The native core refuses its own
        calls after destroy() too (sync, get_local_ipc_handle, synchronize, launches); this covers what
        the Python layer does alone (token counts, planning, tuning, entering a ``with`` block)."""
        if self._core.destroyed:
            raise CommError(f"{what}: this All2All instance was destroyed")

    def _unregister(self) -> None:
        _registry.unregister(self.comm_id)

    def destroy(self, *, timeout_seconds: Optional[float] = None) -> None:
        """Releases the buffer and the peers' mappings. Collective for instances built with a group
        (every rank's device finishes this instance's work, then every rank waits for the others'
        arrival word, written into its buffer: nobody frees memory a peer still writes); with the
        low-level constructor the caller must ensure that. Idempotent.

        Arguments:
            timeout_seconds: the deadline of each of destroy()'s waits: the device finishing this
                instance's kernels (past it their waits are ended, and the device gets it once more)
                and the peers' arrival. None: ``max(DESTROY_TIMEOUT_SECONDS, the instance's
                timeout_seconds)``, so 30 s also when the operations wait forever (0). The peer watch
                (``IPC_ALL2ALL_PEER_WATCH_MS``) ends the wait for a peer whose process died.

        Raises:
            ValueError: ``timeout_seconds`` is not a positive number below 1e9.
            CommError: after releasing what it safely could, naming this rank and each failure: ranks
                that did not arrive in time (``.peer``: the first; this rank's buffer then stays
                allocated until the process exits, as such a rank may still write into it), a device
                that did not finish (nothing is freed), a CUDA release that failed.

        Zero-copy views that are still referenced keep this rank's buffer allocated (it is freed when
        the last of them is dropped), so reading one after ``destroy()`` cannot touch freed or reused
        memory; its contents are those of the last call that wrote its slot."""
        bound = _lifetime.destroy_timeout(timeout_seconds, self._core.timeout_seconds)
        _lifetime.release_deferred()
        if self._core.destroyed:
            return
        # A collective destroy needs the peers' buffers open (a failed construction never opened them).
        collective = bool(self._collective and self._core.opened)
        # Whether zero-copy views outlive the instance (torch holds `keeper` while any view lives); its
        # finalizer must not release the core alone meanwhile.
        keeper = self._keeper() if self._keeper is not None else None
        if keeper is not None:
            keeper.owner = _lifetime.NO_OWNER
        self._buf = None
        self._counts_dev = None
        self._captured_counts.clear()
        self._unregister()
        del keeper
        # Held until destroy() returns, so that its finalizer runs after the core's destroy below; it
        # frees the buffer when the last view goes (after the capture if a view is dropped inside one).
        keeper = self._keeper() if self._keeper is not None else None
        if keeper is not None:
            keeper.owner = self._core
        self._core.destroy(free_buffer=keeper is None, timeout_seconds=bound, collective=collective)

    def __enter__(self) -> "All2All":
        self._require_alive("with All2All")
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __del__(self):
        core = getattr(self, "_core", None)
        if core is not None and not core.destroyed:
            warnings.warn("ipc_all2all.All2All was not destroyed; call destroy() (collective) or use `with`",
                          ResourceWarning, stacklevel=1)
            # Dropped inside a CUDA-graph capture, the core's own teardown (a device synchronisation,
            # cudaFree) would fail the capture: hold it until the capture ends.
            if _lifetime._capturing(getattr(self, "device", None)):
                with _lifetime._DEFERRED_LOCK:
                    _lifetime._DEFERRED.append((core.destroy, self.device))
