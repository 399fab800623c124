import torch  # noqa: F401  (loads the CUDA runtime and NCCL before _C)
from . import _C
