import torch  # noqa: F401
from . import _C
