"""``Config``: DeepEP V1's performance-tuning record of normal mode, with its buffer-size hints and the
recommended configs per rank count (DeepEP V1's ``Buffer.get_dispatch_config`` / ``get_combine_config``).

DeepEP V1 streams tokens through per-channel queues in its NVLink buffer: ``num_sms / 2`` channels, each
sending chunks of ``num_max_nvl_chunked_send_tokens`` tokens into a ring of
``num_max_nvl_chunked_recv_tokens`` tokens per peer (the RDMA fields are its cross-node pipeline). Here
dispatch and combine run on ``ElasticBuffer`` (DeepEP V2's design, no channels): ``num_sms`` is the SM count
the kernels get; the chunk sizes are kept, checked as DeepEP V1 checks them, and feed the size hints.
"""
from __future__ import annotations

from typing import Dict, Tuple

from ._checks import int_arg

__all__ = ["Config", "NUM_MAX_NVL_PEERS", "recommended_config", "DISPATCH_CONFIGS", "COMBINE_CONFIGS"]

#: DeepEP V1's NVLink domain: at most 8 ranks; more are 8-rank nodes joined over RDMA.
NUM_MAX_NVL_PEERS = 8
#: DeepEP V1's assumptions behind its size hints: up to 128 top-k entries and 128 scales per token.
_HINT_MAX_TOPK = 128
_HINT_MAX_SCALES = 128
#: Bytes of DeepEP V1's per-token source record across nodes (two int32).
_SOURCE_META_BYTES = 8
_HINT_ALIGN = 128

# DeepEP V1's recommended configs (commit 567632dd, ``deep_ep/buffer.py``), per rank count:
# (nvl send chunk, nvl recv ring, rdma send chunk, rdma recv ring); num_sms comes from Buffer.num_sms.
DISPATCH_CONFIGS: Dict[int, Tuple[int, int, int, int]] = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}
COMBINE_CONFIGS: Dict[int, Tuple[int, int, int, int]] = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class Config:
    """DeepEP V1's ``deep_ep.Config`` (same constructor, defaults, fields and hints).

    Arguments:
        num_sms: SMs for the normal-mode kernels (DeepEP V1: two per channel, so it must be even where a
            call uses it); here the ``num_sms`` of ``ElasticBuffer.dispatch`` / ``combine``, 0: its
            theoretical count.
        num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens: DeepEP V1's NVLink chunk and
            ring sizes (send < recv); kept for the hints, no effect on the transfers here.
        num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens: its RDMA chunk and ring
            sizes; the ring is rounded up to a multiple of the chunk, which must be at most half of it.

    Raises:
        ValueError: what DeepEP V1 asserts (negative SMs, empty or inverted chunk sizes), naming the field.
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        self.num_sms = int_arg("num_sms", num_sms, 0)
        nvl_send = int_arg("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens, 1)
        nvl_recv = int_arg("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens, 1)
        if nvl_send >= nvl_recv:
            raise ValueError(f"num_max_nvl_chunked_send_tokens: must be below num_max_nvl_chunked_recv_tokens="
                             f"{nvl_recv}, got {nvl_send}")
        rdma_send = int_arg("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens, 1)
        rdma_recv = _align(int_arg("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens, 1), rdma_send)
        # The senders must always find room in the ring (DeepEP V1's lazy head update).
        if rdma_send > rdma_recv // 2:
            raise ValueError(f"num_max_rdma_chunked_send_tokens: must be at most half of "
                             f"num_max_rdma_chunked_recv_tokens (rounded up to a multiple of it: {rdma_recv}), "
                             f"got {rdma_send}")
        self.num_max_nvl_chunked_send_tokens = nvl_send
        self.num_max_nvl_chunked_recv_tokens = nvl_recv
        self.num_max_rdma_chunked_send_tokens = rdma_send
        self.num_max_rdma_chunked_recv_tokens = rdma_recv

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, "
                f"num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")

    def _channels(self, num_ranks: int) -> Tuple[int, int, int]:
        """``(channels, rdma ranks, nvl ranks)`` of DeepEP V1's layout for ``num_ranks``."""
        R = int_arg("num_ranks", num_ranks, 1)
        if R >= NUM_MAX_NVL_PEERS and R % NUM_MAX_NVL_PEERS:
            raise ValueError(f"num_ranks: DeepEP V1 needs fewer than {NUM_MAX_NVL_PEERS} ranks or a multiple of "
                             f"{NUM_MAX_NVL_PEERS}, got {R}")
        if R > NUM_MAX_NVL_PEERS and self.num_sms % 2:
            raise ValueError(f"num_sms: must be even across nodes (two SMs per channel), got {self.num_sms}")
        return self.num_sms // 2, max(R // NUM_MAX_NVL_PEERS, 1), min(R, NUM_MAX_NVL_PEERS)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP V1's NVLink buffer bytes for rows of ``hidden_bytes`` on ``num_ranks`` ranks.

        That buffer streams any token count through fixed queues; this package's buffer holds a whole
        call, so a ``Buffer`` of this size takes at most ``Buffer.get_max_tokens_per_rank`` tokens per rank
        and call (see the README's "From DeepEP V1").

        Arguments:
            hidden_bytes: bytes of one token's row (hidden x element size).
            num_ranks: ranks in the group.

        Returns:
            The bytes, a multiple of 128.

        Raises:
            ValueError: a bad argument (naming it).
        """
        hb = int_arg("hidden_bytes", hidden_bytes, 1)
        channels, rdma_ranks, nvl_ranks = self._channels(num_ranks)
        slots = channels * nvl_ranks * self.num_max_nvl_chunked_recv_tokens
        per_token = hb + _SOURCE_META_BYTES + _HINT_MAX_TOPK * (8 + 4) + _HINT_MAX_SCALES * 4
        total = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4 + slots * per_token
        return _align(total, _HINT_ALIGN)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP V1's RDMA buffer bytes: 0 inside one node (at most 8 ranks), else its cross-node rings.

        Arguments:
            hidden_bytes: bytes of one token's row.
            num_ranks: ranks in the group.

        Returns:
            The bytes, a multiple of 128 (0 for 8 ranks or fewer).

        Raises:
            ValueError: a bad argument (naming it).
        """
        hb = int_arg("hidden_bytes", hidden_bytes, 1)
        channels, rdma_ranks, _ = self._channels(num_ranks)
        if int(num_ranks) <= NUM_MAX_NVL_PEERS:
            return 0
        ring = channels * rdma_ranks * self.num_max_rdma_chunked_recv_tokens * 2  # send and receive sides
        per_token = hb + _SOURCE_META_BYTES + _HINT_MAX_TOPK * (8 + 4) + _HINT_MAX_SCALES * 4 + 16
        total = channels * rdma_ranks * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4 + ring * per_token + (1 << 20)
        return _align(total, _HINT_ALIGN)


def recommended_config(table: Dict[int, Tuple[int, int, int, int]], num_ranks: int, num_sms: int,
                       what: str) -> Config:
    """DeepEP V1's recommended ``Config`` of ``table`` for ``num_ranks`` with ``num_sms`` SMs.

    Raises:
        ValueError: a rank count DeepEP V1 has no entry for (it asserts).
    """
    R = int_arg("num_ranks", num_ranks, 1)
    if R not in table:
        raise ValueError(f"num_ranks: DeepEP V1 recommends {what} configs for {sorted(table)} ranks only, got {R}; "
                         f"pass config=Config(num_sms) to dispatch / combine instead")
    return Config(num_sms, *table[R])
