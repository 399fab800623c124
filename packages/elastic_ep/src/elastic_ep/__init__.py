"""elastic_ep: MoE expert-parallel dispatch/combine for one NVLink domain (DeepEP V2's ElasticBuffer API).

``ElasticBuffer(group, ...)`` is a drop-in for ``deep_ep.ElasticBuffer``: ``dispatch`` sends each token
to the ranks owning its top-k experts, ``combine`` brings the expert outputs back and sums them. It
validates each call once and runs it on one of two runtimes (``elastic_ep._runtime.Runtime``):

* ``native``: torch-free C++/CUDA kernels over an NCCL symmetric window or a CUDA-IPC window
  (``elastic_ep._native_runtime``, also importable as DeepEP's low level, ``elastic_ep._low_level``),
  built ahead of time for sm_90a;
* ``torch``: ``torch.distributed`` collectives (``elastic_ep._torch_runtime``), on any process group
  (gloo on the CPU, NCCL on GPUs); also the reference the native kernels are tested against.

``backend="auto"`` (the default) picks ``native`` for an NCCL group when the extension was built with
CUDA, else ``torch``. Importing this package never needs a GPU; the buffer sizing lives in the extension
``elastic_ep._C``, which every build has (a host-only one without nvcc).

The modules:

* ``buffer``: ``ElasticBuffer``, which composes the parts below; ``_setup``: its constructor's checks,
  domains and runtime choice; ``_sizing``: buffer sizes and the SM count model;
* dispatch/combine: ``_checks`` (every argument check, into ``_runtime``'s typed arguments),
  ``_runtime`` (the runtime interface), ``_native_runtime`` (over ``_native_window``, the window and its
  life, and ``_native_plans``, the launch plans) and ``_torch_runtime`` (the two runtimes), ``_handle``
  (``EPHandle``), ``_events`` (events), ``_nccl`` (communicators);
* one module per DeepEP feature, each with its checks, its state and a native and a torch part over the
  buffer's runtime: ``_agrs`` (all-gather sessions), ``_pp`` (pipeline send/recv), ``_engram`` (Engram),
  ``_low_latency`` (DeepEP V1's low-latency mode; its torch part ``_low_latency_torch``); ``_peer_calls``:
  what AGRS and PP ranks tell each other about each call's tensors, and the errors a difference raises;
* DeepEP V1's ``Buffer`` (``_v1_buffer``: normal mode over ``ElasticBuffer``, with ``_v1_routing`` and
  ``_v1_config``; ``_v1_low_latency``: its low-latency methods over ``_low_latency``);
* hybrid mode: ``_domains`` (the group's domains, the GIN request, the SM / QP model) and ``_hybrid``
  (the torch runtime's two-hop exchange, the forwarders' metadata);
* ``_env`` (environment settings), ``_nvml`` (NVLink bandwidth), ``demo`` (``python -m elastic_ep.demo``).
"""
import torch  # noqa: F401  (loaded before the extension, which relies on torch's CUDA libraries)

from . import _C
from ._v1_buffer import Buffer
from ._v1_config import Config
from .buffer import (ALIGNMENT_BYTES, ElasticBuffer, EPHandle, EventHandle, EventOverlap, NcclCommHandle,
                     calculate_elastic_buffer_size, get_elastic_buffer_alignment, get_logical_domain_size,
                     get_physical_domain_size, native_available)

__version__ = "0.2.0"
#: DeepEP's top-k index dtype; int32 ``topk_idx`` is accepted too (DeepEP's 32-bit builds).
topk_idx_t = torch.int64
CommError = _C.CommError
CommTimeoutError = _C.CommTimeoutError

__all__ = ["Buffer", "Config", "CommError", "CommTimeoutError", "ElasticBuffer", "EPHandle", "EventHandle",
           "EventOverlap", "NcclCommHandle", "native_available", "ALIGNMENT_BYTES", "topk_idx_t",
           "calculate_elastic_buffer_size", "get_elastic_buffer_alignment", "get_physical_domain_size",
           "get_logical_domain_size"]
