"""The low-level binding that mirrors DeepEP V2's C++ ``ElasticBuffer`` and its ``_C`` functions: the
native runtime itself (``NativeRuntime``, over ``NativeWindow``) and DeepEP's module-level functions."""
from ._events import EventHandle  # noqa: F401
from ._native_runtime import (CommError, CommTimeoutError, NativeRuntime, OverlapConfig,  # noqa: F401
                              check_nccl_version, create_nccl_comm, destroy_nccl_comm, get_elastic_buffer_alignment,
                              get_local_nccl_unique_id, get_logical_domain_size, get_physical_domain_size,
                              nccl_version, topk_idx_t)
