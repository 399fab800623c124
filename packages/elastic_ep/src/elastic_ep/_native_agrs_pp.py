"""The native runtime's AGRS (all-gather sessions) and PP send/recv, over the window that dispatch and
combine use (NCCL LSA pointers or the CUDA-IPC window): no NIC and no NCCL GIN, unlike DeepEP V2, whose
PP needs GIN even inside a node.

PP (kernels/pp.cuh): the receive slots ``[source rank][num_max_inflight_tensors][num_max_tensor_bytes]``
lie at the start of every rank's buffer. A send waits on the GPU for a free slot at the peer (the
peer's count of tensors it copied out), copies with ``num_sms`` blocks and publishes its count; a
receive waits for the peer's count, copies out and returns the slot. The counts live on the device,
so sends and receives can be captured in a CUDA graph and replayed. Both run on the current stream.

AGRS (kernels/agrs.cuh): the session region is the start of every rank's buffer. An ``all_gather``
copies this rank's part of each tensor into every rank's region with the copy engines
(``cudaMemcpyAsync`` to the peers' window addresses, on the communication stream, after it waited for
the current stream: no SMs taken from compute), then one small kernel counts the gather, signals
every peer and waits until every peer's copies landed; ``wait()`` makes the current stream wait for
that. Ending a session counts it, signals every peer and waits for every peer's end, so nobody writes
the next session's gathers into a region whose owner may still read the previous results.

Every device wait has the buffer's ``num_gpu_timeout_secs`` deadline; an expired one is recorded and
the next call raises ``CommTimeoutError`` naming the operation, rank and peer (the CUDA context stays
usable; the buffer must be recreated). The slots and the session region alias the dispatch/combine
area: a buffer runs one kind of operation at a time, as DeepEP's.
"""
from __future__ import annotations

from typing import Callable, List, Tuple

import torch

from ._runtime import AllGatherArgs

__all__ = ["NativeAgrsPp"]

_PP_BYTES_PER_SM = 256 << 10  # num_sms=0: one block per 256 KiB ...
_PP_MAX_AUTO_SMS = 32         # ... at most 32 (NVLink saturates well before)


class NativeAgrsPp:
    """AGRS and PP methods of ``NativeRuntime`` (mixed in; they use its ``_rt``, streams and window)."""

    # ------------------------------------------------------------------ PP
    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Flushes (every rank's work done, then a barrier) and sizes the slots; refuses while a tensor a
        peer delivered to this rank was not received (its slot would move)."""
        self._alive()
        torch.cuda.synchronize(self.device)
        self.barrier(True, True)
        pending = [(src, n) for src, n in enumerate(self._rt.pp_unreceived()) if n]
        if pending:
            raise ValueError("pp_set_config: tensors sent to this rank and not received yet ("
                             + ", ".join(f"{n} from rank {src}" for src, n in pending)
                             + "); receive them (pp_recv) before changing the configuration")
        self._pp_slot_bytes, self._pp_inflight = num_max_tensor_bytes, num_max_inflight_tensors

    def _pp_sms(self, nbytes: int, num_sms: int) -> int:
        if num_sms:
            return min(num_sms, self.num_device_sms)
        return max(1, min(_PP_MAX_AUTO_SMS, -(-nbytes // _PP_BYTES_PER_SM)))

    def _pp(self, send: bool, x: torch.Tensor, peer: int, num_sms: int) -> None:
        self._alive()
        if x.nbytes == 0:
            return
        self._rt.pp_transfer(send, x.data_ptr(), x.nbytes, peer, self._pp_slot_bytes, self._pp_inflight,
                             self._pp_sms(x.nbytes, num_sms), torch.cuda.current_stream(self.device).cuda_stream)

    def pp_send(self, x: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """One send kernel on the current stream (x is read before it ends: reusable in stream order)."""
        self._pp(True, x, dst_rank_idx, num_sms)

    def pp_recv(self, x: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """One receive kernel on the current stream (x holds the tensor when it ends)."""
        self._pp(False, x, src_rank_idx, num_sms)

    # ------------------------------------------------------------------ AGRS
    def agrs_set_config(self, num_max_session_bytes: int) -> torch.Tensor:
        """Flushes (every rank's work done, then a barrier); the region is the start of the buffer."""
        self._alive()
        torch.cuda.synchronize(self.device)
        self.barrier(True, True)
        return self._buffer_bytes()[:num_max_session_bytes]

    def all_gather(self, a: AllGatherArgs) -> Tuple[List[torch.Tensor], Callable[[], None]]:
        """Copy-engine copies into every rank's region and the gather's signals, on the communication
        stream after the current one; ``wait`` joins the current stream to it."""
        self._alive()
        region = self._buffer_bytes()
        compute = torch.cuda.current_stream(self.device)
        self.comm_stream.wait_stream(compute)
        with torch.cuda.stream(self.comm_stream):
            for t, inplace in zip(a.tensors, a.inplace):
                if not inplace:  # read by the copies queued on the communication stream
                    t.record_stream(self.comm_stream)
            self._rt.agrs_all_gather([t.data_ptr() for t in a.tensors], [t.nbytes for t in a.tensors],
                                     list(a.offsets), self._comm_raw)
            done = torch.cuda.Event()
            done.record(self.comm_stream)
        R = self.num_ranks
        outs = [region[o:o + R * t.nbytes].view(t.dtype).view(R, *t.shape) for t, o in zip(a.tensors, a.offsets)]

        def wait() -> None:
            torch.cuda.current_stream(self.device).wait_event(done)

        return outs, wait

    def agrs_end_session(self, session_idx: int) -> None:
        """The session-end kernel on the communication stream (after the current stream's reads of the
        results), which the current stream then waits for (a CUDA graph capture ends joined)."""
        self._alive()
        compute = torch.cuda.current_stream(self.device)
        self.comm_stream.wait_stream(compute)
        self._rt.agrs_session_end(self._comm_raw)
        compute.wait_stream(self.comm_stream)
