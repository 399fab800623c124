"""elastic_ep: MoE expert-parallel dispatch/combine for one NVLink domain (DeepEP V2 ElasticBuffer API).

``ElasticBuffer(group, ...)`` is a drop-in for ``deep_ep.ElasticBuffer``: ``dispatch`` sends each token
to the ranks owning its top-k experts, ``combine`` brings the expert outputs back and sums them.
Two backends implement the low-level buffer:

* ``native``: torch-free C++/CUDA kernels over NCCL symmetric memory (``elastic_ep._low_level``),
  built ahead of time for sm_90a;
* ``torch``: ``torch.distributed`` collectives (``elastic_ep._torch_backend``), on any process group
  (gloo on the CPU, NCCL on GPUs); it is also the reference the native kernels are tested against.

``backend="auto"`` (the default) picks ``native`` for an NCCL group when the extension was built with
CUDA, else ``torch``. Importing this package never needs a GPU; the native module is loaded lazily.
"""
import torch  # noqa: F401  (the native extension relies on torch's CUDA runtime being loaded first)

from .buffer import (ElasticBuffer, EPHandle, EventHandle, EventOverlap, calculate_elastic_buffer_size,
                     get_elastic_buffer_alignment, get_logical_domain_size, get_physical_domain_size,
                     native_available)
from ._sizing import ALIGNMENT_BYTES

__version__ = "0.1.0"
topk_idx_t = torch.int64



def __getattr__(name: str):
    # The native exception types live in the extension, which is loaded lazily (importing the package
    # must work without it): resolved on first use.
    if name in ("CommError", "CommTimeoutError"):
        from . import _low_level

        return getattr(_low_level, name)
    raise AttributeError(f"module 'elastic_ep' has no attribute {name!r}")


__all__ = ["CommError", "CommTimeoutError", "ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap", "native_available", "ALIGNMENT_BYTES",
           "topk_idx_t", "calculate_elastic_buffer_size", "get_elastic_buffer_alignment", "get_physical_domain_size",
           "get_logical_domain_size"]
