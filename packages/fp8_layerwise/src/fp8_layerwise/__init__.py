"""fp8_layerwise: stream one MoE layer's FP8 expert weights from CPU memory to every TP rank.

Rank 0 fills every rank's pinned shared-memory host slots with that rank's shard of the four
buffer kinds (w13, w13 scale, w2, w2 scale), expert by expert; each rank's consumer thread copies
filled slots into its layer buffers and acknowledges them; a POD control block in shared memory
coordinates the ranks (epochs, per-slot sequences, acks, a sticky poison record, liveness).

* :class:`Transport` -- the memory-owning API (``with t.layer(epoch, layer_id, n) as layer``).
* ``_C.FP8LayerwiseTransport`` -- the low-level binding with the constructor and calls of
  KTransformers' FP8LayerwiseTransport.
* :func:`make_shard_writer` -- the native writer over whole-layer source tensors.
* ``python -m fp8_layerwise.demo`` -- a runnable multi-process demo.
"""
import torch  # noqa: F401  (loads the CUDA runtime before _C)

from . import _C
from ._checks import CONTROL_BYTES, KINDS, MAX_COPY_STREAMS, MAX_SLOTS, MAX_TP
from ._shm import (DEFAULT_SLOTS, SMALL_EXPERT_BYTES, SMALL_EXPERT_SLOTS, ControlRegion, HostSlots,
                   default_num_slots)
from ._writers import CACHE_HINTS, DEFAULT_CACHE_HINT, default_cache_hint, default_writer_threads, make_shard_writer
from .block_fp8 import block_fp8_expert_nbytes, make_block_fp8_sources, reference_shard
from .errors import (ErrorCode, PeerDied, ProtocolError, TransportClosed, TransportError, TransportPoisoned,
                     TransportTimeout)
from .exchange import FileExchange, group_exchange
from .transport import Layer, LayerStats, Transport

__version__ = "0.2.0"
FP8LayerwiseTransport = _C.FP8LayerwiseTransport
initialize_fp8_layerwise_control = _C.initialize_fp8_layerwise_control
FP8_LAYERWISE_CONTROL_BYTES = _C.FP8_LAYERWISE_CONTROL_BYTES
FP8_LAYERWISE_MAX_TP_SIZE = _C.FP8_LAYERWISE_MAX_TP_SIZE


def built_with_cuda() -> bool:
    """True when the extension was compiled with the CUDA backend."""
    return _C.built_with_cuda()


__all__ = [
    "CACHE_HINTS", "CONTROL_BYTES", "DEFAULT_CACHE_HINT", "DEFAULT_SLOTS", "default_cache_hint",
    "SMALL_EXPERT_BYTES", "SMALL_EXPERT_SLOTS", "default_num_slots",
    "default_writer_threads", "KINDS",
    "MAX_COPY_STREAMS", "MAX_SLOTS", "MAX_TP", "ControlRegion", "ErrorCode",
    "FP8LayerwiseTransport", "FP8_LAYERWISE_CONTROL_BYTES", "FP8_LAYERWISE_MAX_TP_SIZE", "FileExchange",
    "HostSlots", "Layer", "LayerStats", "PeerDied", "ProtocolError", "Transport", "TransportClosed", "TransportError",
    "TransportPoisoned", "TransportTimeout", "block_fp8_expert_nbytes", "built_with_cuda", "group_exchange",
    "initialize_fp8_layerwise_control", "make_block_fp8_sources", "make_shard_writer", "reference_shard",
]
