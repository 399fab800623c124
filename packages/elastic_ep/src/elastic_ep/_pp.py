"""PP send/recv (DeepEP V2's ``pp_set_config``, ``pp_send``, ``pp_recv``): the configuration, the argument
checks, and the two backends' parts.

``PipelineSendRecv`` validates every call and makes one call into its part (``PpPart``):

* ``NativePp`` (kernels/pp.cuh), over the window that dispatch and combine use (no NIC and no NCCL GIN,
  unlike DeepEP V2, whose PP needs GIN even inside a node): the receive slots
  ``[source rank][num_max_inflight_tensors][num_max_tensor_bytes]`` lie at the start of every rank's
  buffer. A send waits on the GPU for a free slot at the peer (the peer's count of tensors it copied
  out), copies with ``num_sms`` blocks and publishes its count; a receive waits for the peer's count,
  copies out and returns the slot. The counts live on the device, so sends and receives can be captured
  in a CUDA graph and replayed. Both run on the current stream; every device wait has the
  ``num_gpu_timeout_secs`` deadline (the next call then raises ``CommTimeoutError`` naming the operation,
  rank and peer). The slots alias the dispatch/combine area: one kind of operation at a time. At most
  ``kPpDescEntries / num_ranks`` tensors may be in flight per peer (the receivers' descriptor ring).
* ``TorchPp``: a send posts a header (its count, the tensor's descriptor and byte count) and, for a
  non-empty tensor, a staged copy of its bytes (``isend``, tag 0: per peer pair, messages match in the
  order posted, so ordering holds per pair); at most ``num_max_inflight_tensors`` stay outstanding per
  peer, the oldest waited for first (the credit DeepEP's receiver returns). A receive waits for the
  header, bounded by ``num_cpu_timeout_secs`` (gloo), then takes the bytes into ``t`` or, refused, into
  scratch.

Both check every transfer (``_peer_calls``): the receive compares the sender's descriptor (dtype,
numel, shape) with its own tensor's before copying a byte; a difference leaves ``t`` unchanged, drops
the tensor (the pair's next transfers meet as before) and raises a ``ValueError`` naming the field and
both values, on the receiver (torch: at once; native: at its next call) and, at its next
``pp_set_config``, on the sender.
"""
from __future__ import annotations

import abc
import collections
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _C
from ._checks import INT32_MAX, check_dense, describe, int_arg, off_device
from ._collective import agree_on_every_rank, gather_ints, group_device, on_every_rank
from ._peer_calls import U64, pp_descriptor, pp_difference, pp_recv_error, pp_send_error
from ._sizing import ALIGNMENT_BYTES, align

__all__ = ["PipelineSendRecv", "PpPart", "NativePp", "TorchPp", "get_pp_buffer_size_hint"]

_PP_BYTES_PER_SM = 256 << 10  # native num_sms=0: one block per 256 KiB ...
_PP_MAX_AUTO_SMS = 32         # ... at most 32 (NVLink saturates well before)


def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
    """Bytes PP send/recv would need (DeepEP's hint): four regions of
    ``num_max_inflight_tensors`` slots of ``num_max_tensor_bytes`` rounded up to 32 B, 2 MiB-aligned."""
    num_max_tensor_bytes = int_arg("num_max_tensor_bytes", num_max_tensor_bytes, 0)
    num_max_inflight_tensors = int_arg("num_max_inflight_tensors", num_max_inflight_tensors, 0)
    return align(4 * num_max_inflight_tensors * align(num_max_tensor_bytes, 32), ALIGNMENT_BYTES)


# ---------------------------------------------------------------------------------------------- backends
class PpPart(abc.ABC):
    """What a runtime does for PP, on validated arguments (another rank, within the configured size)."""

    @abc.abstractmethod
    def set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Flushes outstanding work on every rank (collective) and sizes PP send/recv."""

    @abc.abstractmethod
    def send(self, x: torch.Tensor, dst_rank_idx: int, num_sms: int) -> None:
        """Sends ``x``'s bytes to ``dst_rank_idx``; ``x`` may be reused when this returns (in stream order)."""

    @abc.abstractmethod
    def recv(self, x: torch.Tensor, src_rank_idx: int, num_sms: int) -> None:
        """Receives the next tensor ``src_rank_idx`` sent to this rank into ``x``."""

    def flush(self, op: str) -> None:
        """Waits for the sends still outstanding (before ``op``, e.g. the buffer's destroy)."""

    def max_inflight(self) -> Optional[int]:
        """Most tensors in flight per peer the part can track (None: no limit)."""
        return None


class NativePp(PpPart):
    """PP on the native runtime ``rt`` (one kernel per transfer, on the current stream)."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self._slot_bytes = self._inflight = 0
        self._refusals_seen: Dict[int, int] = {}  # per peer: k + 1 of the last refused tensor reported

    def max_inflight(self) -> Optional[int]:
        return int(self.rt._rt.pp_max_inflight)

    def set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Flushes (every rank's work done, then a barrier) and sizes the slots; refuses while a tensor a
        peer delivered to this rank was not received (its slot would move), and once after a peer
        refused one of this rank's tensors (the first point where the sender hears of it)."""
        rt = self.rt
        # A refusal reported since the last call (the buffer is usable) is raised after the flush: the
        # barrier below is collective, and every rank must reach it.
        deferred = None
        try:
            rt._alive("pp_set_config")
        except ValueError as e:
            deferred = e
        torch.cuda.synchronize(rt.device)
        rt.barrier(True, True)
        refused = []
        for peer, k1, field, receiver_value, sender_value in rt._rt.pp_refusals():
            if self._refusals_seen.get(peer) != k1:
                self._refusals_seen[peer] = k1
                refused.append(pp_send_error(rt.rank_idx, peer, k1 - 1, field, receiver_value, sender_value))
        if deferred is not None or refused:
            raise deferred if deferred is not None else refused[0]
        pending = [(src, n) for src, n in enumerate(rt._rt.pp_unreceived()) if n]
        if pending:
            raise ValueError("pp_set_config: tensors sent to this rank and not received yet ("
                             + ", ".join(f"{n} from rank {src}" for src, n in pending)
                             + "); receive them (pp_recv) before changing the configuration")
        self._slot_bytes, self._inflight = num_max_tensor_bytes, num_max_inflight_tensors

    def _transfer(self, send: bool, x: torch.Tensor, peer: int, num_sms: int) -> None:
        """One kernel, empty tensors too: their descriptor must meet the peer's like any other's."""
        rt = self.rt
        rt._alive("pp_send" if send else "pp_recv")
        if num_sms:
            num_sms = min(num_sms, rt.num_device_sms)
        else:
            num_sms = max(1, min(_PP_MAX_AUTO_SMS, -(-x.nbytes // _PP_BYTES_PER_SM)))
        code, numel, shape = pp_descriptor(x)
        rt._rt.pp_transfer(send=send, x=x.data_ptr(), nbytes=x.nbytes, peer=peer, slot_bytes=self._slot_bytes,
                           num_max_inflight=self._inflight, num_sms=num_sms, numel=numel, dtype_code=code,
                           shape_word=shape, stream=torch.cuda.current_stream(rt.device).cuda_stream)

    def send(self, x: torch.Tensor, dst_rank_idx: int, num_sms: int) -> None:
        """One send kernel on the current stream (x is read before it ends: reusable in stream order)."""
        self._transfer(True, x, dst_rank_idx, num_sms)

    def recv(self, x: torch.Tensor, src_rank_idx: int, num_sms: int) -> None:
        """One receive kernel on the current stream (x holds the tensor when it ends)."""
        self._transfer(False, x, src_rank_idx, num_sms)


class TorchPp(PpPart):
    """PP on the torch runtime ``rt`` (its group and bounded waits); see the module docstring."""

    _HEADER = 5  # int64 words: k + 1, then the descriptor (dtype code, numel, shape word), then the bytes

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self._inflight = self._max_bytes = 0
        self._sends: Dict[int, Deque[Tuple[List[object], Tuple[torch.Tensor, ...]]]] = {}  # per peer
        self._sent: Dict[int, int] = {}      # per peer: tensors sent to it (never reset, as the native counts)
        self._received: Dict[int, int] = {}  # per peer: tensors received from it
        self._refused: Dict[int, Tuple[int, int, int, int]] = {}  # per sender: (k, field, mine, theirs) untold

    def set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Flushes, then tells every sender of the tensors this rank refused since the last call (a
        collective all-gather): a sender raises, and so (on_every_rank) does every rank."""
        self.flush("pp_set_config")
        self.rt.barrier(True, True)
        R, me = self.rt.num_ranks, self.rt.rank_idx
        row: List[int] = []
        for src in range(R):
            k, field, mine, theirs = self._refused.pop(src, (-1, 0, 0, 0))
            row += [k + 1, field, mine, theirs]
        rows = gather_ints(self.rt.group, row, group_device(self.rt.group), unsigned=True)
        for dst in range(R):
            k1, field, receiver_value, sender_value = rows[dst][4 * me:4 * me + 4]
            if k1:
                raise pp_send_error(me, dst, k1 - 1, field, receiver_value, sender_value)
        self._inflight, self._max_bytes = num_max_inflight_tensors, num_max_tensor_bytes

    def send(self, x: torch.Tensor, dst_rank_idx: int, num_sms: int) -> None:
        sends = self._sends.setdefault(dst_rank_idx, collections.deque())
        while sends and (len(sends) >= self._inflight or all(w.is_completed() for w in sends[0][0])):
            for w in sends.popleft()[0]:
                self.rt.wait_work(w, f"pp_send to peer {dst_rank_idx} (waiting for a free slot)")
        k = self._sent.get(dst_rank_idx, 0)
        self._sent[dst_rank_idx] = k + 1
        words = [k + 1, *pp_descriptor(x), x.nbytes]
        header = torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in words], dtype=torch.int64,
                              device=self.rt.device)
        group = self.rt.group
        works, keep = [dist.isend(header, group=group, group_dst=dst_rank_idx)], (header,)
        if x.nbytes:
            staged = x.reshape(-1).view(torch.uint8).clone()
            works.append(dist.isend(staged, group=group, group_dst=dst_rank_idx))
            keep = (header, staged)
        sends.append((works, keep))

    def recv(self, x: torch.Tensor, src_rank_idx: int, num_sms: int) -> None:
        """Takes the header, compares the descriptors, then the bytes: into ``x``, or (refused) into
        scratch, so that the pair's next messages still meet."""
        group, src = self.rt.group, src_rank_idx
        header = torch.empty(self._HEADER, dtype=torch.int64, device=self.rt.device)
        self.rt.wait_work(dist.irecv(header, group=group, group_src=src), f"pp_recv from peer {src}")
        k1, *theirs, nbytes = (v & U64 for v in header.tolist())
        k = self._received.get(src, 0)
        if k1 != k + 1 or nbytes > self._max_bytes:
            raise RuntimeError(f"pp_recv [rank {self.rt.rank_idx}]: protocol error: rank {src}'s header says tensor "
                               f"#{k1 - 1} of {nbytes} bytes, this receive expects #{k} of at most "
                               f"{self._max_bytes} (a corrupted message)")
        self._received[src] = k + 1
        mine = pp_descriptor(x)
        field = pp_difference(theirs, mine)
        if nbytes:
            dst = x.reshape(-1).view(torch.uint8) if field is None else \
                torch.empty(nbytes, dtype=torch.uint8, device=self.rt.device)
            self.rt.wait_work(dist.irecv(dst, group=group, group_src=src), f"pp_recv from peer {src}")
        if field is not None:
            self._refused[src] = (k, field, mine[field], theirs[field])
            raise pp_recv_error(self.rt.rank_idx, src, k, field, theirs[field], mine[field])

    def flush(self, op: str) -> None:
        for peer, sends in self._sends.items():
            while sends:
                for w in sends.popleft()[0]:
                    self.rt.wait_work(w, f"{op}: pp_send to peer {peer}")


# ---------------------------------------------------------------------------------------------- front
class PipelineSendRecv:
    """One buffer's PP: the configuration and the checks of every call.

    Arguments:
        runtime, backend: the buffer's runtime and its backend, ``"native"`` or ``"torch"``.
        group: the buffer's process group (configuration errors are agreed on over it).
        num_bytes: the buffer's bytes (what the slots must fit).
        device: the buffer's device.
    """

    def __init__(self, runtime: Any, backend: str, group: dist.ProcessGroup, num_bytes: int,
                 device: torch.device) -> None:
        self.native = backend == "native"
        self.part: PpPart = NativePp(runtime) if self.native else TorchPp(runtime)
        self.group, self.num_bytes, self.device = group, num_bytes, device
        self.num_ranks, self.rank_idx = runtime.num_ranks, runtime.rank_idx
        self.max_bytes = 0  # pp_set_config's num_max_tensor_bytes (0: not configured)

    def _config_args(self, num_max_tensor_bytes: Any, num_max_inflight_tensors: Any) -> Tuple[int, int]:
        """``(tensor bytes rounded up to 32, tensors in flight per peer)``; DeepEP V2's four regions of
        ``inflight x bytes`` must fit the buffer's ``num_bytes``."""
        n = int_arg("num_max_tensor_bytes", num_max_tensor_bytes, 1)
        k = int_arg("num_max_inflight_tensors", num_max_inflight_tensors, 1)
        if 4 * n * k > self.num_bytes:
            raise ValueError(f"num_max_tensor_bytes x num_max_inflight_tensors: 4 x {n} x {k} bytes exceed the "
                             f"buffer's num_bytes={self.num_bytes} (get_pp_buffer_size_hint sizes a buffer for them)")
        cap = self.part.max_inflight()
        if cap is not None and k > cap:
            raise ValueError(f"num_max_inflight_tensors: at most {cap} with {self.num_ranks} ranks on the native "
                             f"runtime (its receivers track each tensor in flight), got {k}")
        if self.native:
            # Any peer may send: the native runtime keeps a row of slots per source rank.
            need = int(_C.pp_buffer_bytes(self.num_ranks, n, k))
            if need > self.num_bytes:
                raise ValueError(f"num_max_tensor_bytes x num_max_inflight_tensors: the native runtime's receive "
                                 f"slots, {self.num_ranks} ranks x {k} x {align(n, 32)} bytes = {need}, exceed the "
                                 f"buffer's num_bytes={self.num_bytes}")
        return align(n, 32), k

    def _transfer_args(self, op: str, t: Any, peer_name: str, peer: Any, num_sms: Any) -> Tuple[int, int]:
        """Checks ``pp_send`` / ``pp_recv``'s arguments; returns ``(the peer's rank index, num_sms)``."""
        if not self.max_bytes:
            raise ValueError(f"{op}: PP is not configured; call pp_set_config(num_max_tensor_bytes, "
                             "num_max_inflight_tensors) first")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"t: expected a tensor, got {describe(t)}")
        check_dense("t", t)
        if off_device(t, self.device) or not t.is_contiguous():
            raise ValueError(f"t: expected a contiguous tensor on {self.device}, got {describe(t)}")
        if t.nbytes > self.max_bytes:
            raise ValueError(f"t: {t.nbytes} bytes exceed num_max_tensor_bytes={self.max_bytes} (pp_set_config)")
        peer = int_arg(peer_name, peer, 0, self.num_ranks - 1, f" (the group has {self.num_ranks} ranks)")
        if peer == self.rank_idx:
            raise ValueError(f"{peer_name}: expected another rank than this one ({self.rank_idx})")
        return peer, int_arg("num_sms", num_sms, 0, INT32_MAX)

    def set_config(self, num_max_tensor_bytes: Any, num_max_inflight_tensors: Any) -> None:
        cfg = on_every_rank(self.group, "pp_set_config", self._config_args, num_max_tensor_bytes,
                            num_max_inflight_tensors)
        # A rank with other slots would write its tensors where its peers do not look.
        agree_on_every_rank(self.group, "pp_set_config", {"num_max_tensor_bytes": cfg[0],
                                                          "num_max_inflight_tensors": cfg[1]},
                            group_device(self.group))
        # The native runtime refuses while tensors delivered to this rank were not received: every rank
        # learns it, so none goes on with a configuration the others refused.
        on_every_rank(self.group, "pp_set_config", self.part.set_config, *cfg)
        self.max_bytes = cfg[0]

    def send(self, t: Any, dst_rank_idx: Any, num_sms: Any) -> None:
        self.part.send(t, *self._transfer_args("pp_send", t, "dst_rank_idx", dst_rank_idx, num_sms))

    def recv(self, t: Any, src_rank_idx: Any, num_sms: Any) -> None:
        self.part.recv(t, *self._transfer_args("pp_recv", t, "src_rank_idx", src_rank_idx, num_sms))

    def flush(self, op: str) -> None:
        self.part.flush(op)
