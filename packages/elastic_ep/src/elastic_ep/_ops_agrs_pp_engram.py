"""``ElasticBuffer``'s AGRS, PP and Engram methods (DeepEP V2's names, arguments and returns).

``ElasticBuffer`` (buffer.py) inherits them. As there, each call is validated once (``_checks``) and
then makes one call into the buffer's runtime (``_runtime.Runtime``); the state they keep on the buffer
(``_agrs_*``, ``_pp_max_bytes``, ``_engram_shape``) is set by its constructor. Both runtimes
implement AGRS and PP; Engram only the torch runtime (the native one raises ``NotImplementedError``).
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

from . import _checks
from . import _checks_agrs_pp_engram as _op_checks

__all__ = ["AgrsPpEngramOps"]


class AgrsPpEngramOps:
    """AGRS (all-gather sessions), PP send/recv and Engram, mixed into ``ElasticBuffer``."""

    # ------------------------------------------------------------------ Engram
    def engram_write(self, storage: torch.Tensor, sf: Optional[torch.Tensor] = None) -> None:
        """Installs this rank's shard of the Engram table in its CPU segment (collective, as DeepEP).

        Rank ``r``'s ``storage`` holds global entries ``[r * num_entries, (r + 1) * num_entries)``.

        Arguments:
            storage: ``[num_entries, hidden]`` bf16, or float8_e4m3fn with ``sf``; at most ``num_cpu_bytes``;
                the same shape and dtype on every rank.
            sf: FP8 only: ``[num_entries * R, num_sf_packs]`` float32 or int32 (four UE8M0 exponents)
                scale factors of every global entry, the same on every rank.

        Raises:
            ValueError: bad arguments on any rank, or shards that differ between ranks (every rank raises).
        """
        self._check_alive()
        err = None
        try:
            _op_checks.engram_write_args(self, storage, sf)
        except ValueError as e:
            err = e
        _checks.raise_if_any_rank_failed(self.group, err, "engram_write")
        self._engram_shape = ()
        self.runtime.engram_write(storage, sf)
        self._engram_shape = (storage.shape[0], storage.shape[1], storage.element_size())

    def engram_fetch(self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False):
        """Gathers table rows by global entry index from whichever rank holds them (local: no peer takes part).

        Arguments:
            indices: ``[T, E]`` int32 global entry indices, each in ``[0, num_entries * R)``.
            num_qps: accepted (no RDMA); more than ``num_allocated_qps`` raises, as DeepEP.
            use_tma_aligned_col_major_sf: FP8: scale factors column-major, rows padded to 4.

        Returns:
            A hook; its call returns ``(data [T, E * hidden], sf [T, E * num_sf_packs] or None)``: token
            ``t``'s entries concatenated along the hidden dimension.

        Raises:
            ValueError: no table, bad ``indices`` (any index outside the table: DeepEP reads those unchecked).
        """
        self._check_alive()
        _op_checks.engram_fetch_args(self, indices, num_qps, use_tma_aligned_col_major_sf)
        return self.runtime.engram_fetch(indices, use_tma_aligned_col_major_sf)

    # ------------------------------------------------------------------ PP send/recv
    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Sizes pipeline send/recv (collective; flushes earlier work on every rank, as DeepEP).

        Arguments:
            num_max_tensor_bytes: the largest tensor sent (rounded up to 32).
            num_max_inflight_tensors: tensors sent to one peer and not yet received there; a further
                ``pp_send`` to that peer waits (with the CPU timeout) until the peer received one.
            DeepEP V2's four regions of ``num_max_inflight_tensors x num_max_tensor_bytes`` must fit
            ``num_bytes`` (``get_pp_buffer_size_hint``).

        Raises:
            ValueError: a bad value on any rank (every rank raises).
        """
        self._check_alive()
        err, cfg = None, None
        try:
            cfg = _op_checks.pp_config_args(self, num_max_tensor_bytes, num_max_inflight_tensors)
        except ValueError as e:
            err = e
        _checks.raise_if_any_rank_failed(self.group, err, "pp_set_config")
        try:
            # The native runtime refuses while tensors delivered to this rank were not received: every
            # rank learns it, so none goes on with a configuration the others refused.
            self.runtime.pp_set_config(*cfg)
        except ValueError as e:
            err = e
        _checks.raise_if_any_rank_failed(self.group, err, "pp_set_config")
        self._pp_max_bytes = cfg[0]

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """Sends ``t`` to rank ``dst_rank_idx`` (any other rank; DeepEP V2 allows the previous and next
        rank only). Tensors sent to one rank arrive in the order sent; ``t`` may be reused on return.

        Arguments:
            t: a contiguous tensor of at most ``num_max_tensor_bytes``; the receiver passes a tensor of
                the same number of bytes (its dtype and shape are the receiver's, not checked).
            dst_rank_idx: the receiving rank.
            num_sms: SMs the native kernel copies with (0: one per 256 KiB, at most 32); the torch
                backend uses none.

        Raises:
            ValueError: not configured, a bad tensor, this rank or no rank as ``dst_rank_idx``.
            TimeoutError: (torch backend) ``num_max_inflight_tensors`` sent to that rank stay unreceived
                past the CPU timeout. The native backend waits on the GPU, in stream order: a slot that
                stays taken past ``num_gpu_timeout_secs`` makes the next call raise ``CommTimeoutError``
                naming ``pp_send``, this rank and the peer.
        """
        self._check_alive()
        dst = _op_checks.pp_args(self, "pp_send", t, "dst_rank_idx", dst_rank_idx, num_sms)
        self.runtime.pp_send(t, dst, num_sms)

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """Receives into ``t`` the oldest tensor rank ``src_rank_idx`` sent to this rank and this rank has
        not received yet (``t`` holds it on return, in stream order). Arguments as ``pp_send``.

        Raises:
            ValueError: as ``pp_send``; TimeoutError (torch backend): nothing arrives within
                ``num_cpu_timeout_secs``; native: the next call raises ``CommTimeoutError`` naming
                ``pp_recv``, this rank and the peer when nothing arrived within ``num_gpu_timeout_secs``.
        """
        self._check_alive()
        src = _op_checks.pp_args(self, "pp_recv", t, "src_rank_idx", src_rank_idx, num_sms)
        self.runtime.pp_recv(t, src, num_sms)

    # ------------------------------------------------------------------ AGRS (all-gather sessions)
    # A session is a bump allocator over the session region: each all_gather takes the next
    # align32(R x nbytes) bytes per tensor and one of num_max_all_gathers_per_session slots; results are
    # views of the region, valid until a later session reuses it.
    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        """Sizes AGRS sessions (collective; flushes earlier work on every rank, as DeepEP).

        Arguments:
            num_max_session_bytes: most bytes of gathered results per session (``get_agrs_num_max_session_bytes``
                computes it), at most the buffer's ``num_bytes``; rounded up to 32.
            num_max_all_gathers_per_session: most ``all_gather`` calls per session, 1..32.

        Raises:
            ValueError: a bad value, or inside a session, on any rank (every rank raises).
        """
        self._check_alive()
        err, cfg = None, None
        try:
            cfg = _op_checks.agrs_config_args(self, num_max_session_bytes, num_max_all_gathers_per_session)
        except ValueError as e:
            err = e
        _checks.raise_if_any_rank_failed(self.group, err, "agrs_set_config")
        self._agrs_region = self.runtime.agrs_set_config(cfg[0])
        self._agrs_max_gathers = cfg[1]

    def create_agrs_session(self) -> None:
        """Starts an AGRS session (local, no communication). Raises ``ValueError`` inside a session."""
        self._check_alive()
        if self._agrs_in_session:
            raise ValueError("create_agrs_session: already inside an AGRS session; end it first")
        self._agrs_in_session = True
        self._agrs_offset = self._agrs_slot = 0
        self._agrs_session_idx += 1

    def destroy_agrs_session(self) -> None:
        """Ends the AGRS session: its gathers complete before the region is reused (their results stay
        readable until the next session's gathers overwrite them). Raises ``ValueError`` outside one."""
        self._check_alive()
        if not self._agrs_in_session:
            raise ValueError("destroy_agrs_session: not inside an AGRS session")
        self._agrs_in_session = False
        self.runtime.agrs_end_session(self._agrs_session_idx)

    @contextlib.contextmanager
    def agrs_new_session(self, enabled: bool = True):
        """``create_agrs_session`` on entry and ``destroy_agrs_session`` on exit (also on an exception);
        ``enabled=False``: a no-op, as DeepEP's."""
        if not enabled:
            yield
            return
        self.create_agrs_session()
        try:
            yield
        finally:
            self.destroy_agrs_session()

    def agrs_get_inplace_tensor(self, shapes, dtype: torch.dtype):
        """Views of this rank's part of the next all-gather(s) of this session, for a producer to write in
        place: ``all_gather`` of these tensors (same order, as the next call) copies nothing locally.

        Arguments:
            shapes: one shape, or a sequence of shapes (one per tensor of the next ``all_gather``).
            dtype: any torch dtype.

        Returns:
            One tensor for one shape, a tuple for a sequence (contents undefined until written).

        Raises:
            ValueError: not configured, outside a session, the session's bytes or gathers exhausted, bad shapes.
        """
        self._check_alive()
        parts, batched = _op_checks.agrs_inplace_args(self, shapes, dtype)
        region = self._agrs_region
        out = tuple(region[o:o + math.prod(s) * dtype.itemsize].view(dtype).view(s) for s, o in parts)
        return out if batched else out[0]

    def all_gather(self, t):
        """Gathers a tensor (or several) from every rank into the session region (collective).

        Arguments:
            t: a contiguous tensor of any dtype on the buffer's device, or a non-empty sequence of them;
                every rank passes the same shapes and dtypes in the same order (not checked). Shapes may
                differ from one call to the next.

        Returns:
            ``(gathered, wait)`` for a tensor, ``(*gathered, wait)`` for a sequence: ``gathered`` is
            ``[R, *t.shape]`` (row ``r`` is rank ``r``'s tensor), a view of the session region to read
            after ``wait()``; ``wait`` must be called inside the same session.

        Raises:
            ValueError: not configured, outside a session, over the session's bytes or gathers, a
                non-contiguous / other-device tensor, or a tensor inside the region that is not this
                rank's part of this gather.
        """
        self._check_alive()
        a, batched, end = _op_checks.all_gather_args(self, t)
        out, wait = self.runtime.all_gather(a)
        self._agrs_offset, self._agrs_slot = end, self._agrs_slot + 1
        session = self._agrs_session_idx

        def wait_fn() -> None:
            if not self._agrs_in_session or session != self._agrs_session_idx:
                raise ValueError("all_gather's wait: its AGRS session has ended; wait inside the session")
            wait()

        return (*out, wait_fn) if batched else (out[0], wait_fn)
