"""NCCL communicators for the native runtime, with DeepEP V2's ``_C`` function names: the import-time check
of the loaded NCCL, unique ids, creating and aborting communicators, torch's own communicator of a group."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from . import _C, _domains, _env
from ._checks import INT64_MAX, int_arg
from ._collective import gather_bytes

__all__ = ["need_cuda", "nccl_version", "railed_gin_type", "check_nccl_version", "get_local_nccl_unique_id", "create_nccl_comm",
           "destroy_nccl_comm", "comm_arg", "get_physical_domain_size", "get_logical_domain_size", "torch_nccl_comm",
           "new_nccl_comm"]


def need_cuda(what: str) -> None:
    if not _C.built_with_cuda():
        raise RuntimeError(f"elastic_ep.{what} needs the CUDA build of elastic_ep._C (this one was built without "
                           "nvcc); reinstall on a machine with the CUDA toolkit, or use backend='torch'")
    if not torch.cuda.is_available():
        raise RuntimeError(f"elastic_ep.{what} needs a CUDA device, and torch sees none")


def _version_str(code: int) -> str:
    return f"{code // 10000}.{(code // 100) % 100}.{code % 100}"


def nccl_version() -> int:
    """The NCCL_VERSION_CODE (e.g. 22809) of the libnccl loaded in this process."""
    need_cuda("nccl_version")
    return int(_C.nccl_version())


#: The oldest NCCL elastic_ep runs on (window registration, device communicators, LSA pointers; torch
#: 2.11's NCCL). Newer releases are used as they are: the native code picks the device-API structure
#: layout of the loaded library (``_C.devcomm_abi``) and looks up functions newer than this one at run time.
NCCL_MIN_VERSION = 22809


def check_nccl_version() -> None:
    """Raises ImportError when the loaded NCCL cannot serve this build: older than 2.28.9, or a 2.29+
    library with an extension built against 2.28.x headers (NCCL 2.29 put a version header in front of
    the device-API structures, which those headers do not write). A library older than the headers is
    fine from 2.28.9 on (direct mode; hybrid mode over GIN is refused when its window is made)."""
    if not _C.built_with_cuda():
        return
    built, loaded = int(_C.nccl_build_version()), int(_C.nccl_version())
    if loaded < NCCL_MIN_VERSION:
        raise ImportError(f"elastic_ep needs NCCL >= {_version_str(NCCL_MIN_VERSION)}, this process loaded NCCL "
                          f"{_version_str(loaded)}; install nvidia-nccl-cu13>={_version_str(NCCL_MIN_VERSION)} "
                          "(or -cu12), or load a newer libnccl first")
    if _C.devcomm_abi(loaded, False) == "unsupported":
        raise ImportError(f"elastic_ep was built against NCCL {_version_str(built)} headers, whose device-API "
                          f"structures NCCL {_version_str(loaded)} (loaded) no longer reads; rebuild elastic_ep "
                          "against NCCL >= 2.29 headers (pip install --no-build-isolation with nvidia-nccl-cu13 "
                          "of that version installed, or NCCL_HOME)")


if not _env.skip_nccl_version_check():
    check_nccl_version()


def comm_arg(nccl_comm: Any) -> int:
    """An ``ncclComm_t`` as the int64 the bindings take (int() would truncate a float into an address)."""
    return int_arg("nccl_comm", nccl_comm, 0, INT64_MAX)


def get_local_nccl_unique_id() -> bytes:
    """A new NCCL unique id (128 bytes) to broadcast from rank 0 before ``create_nccl_comm``."""
    need_cuda("get_local_nccl_unique_id")
    return bytes(_C.get_local_nccl_unique_id())


def create_nccl_comm(unique_id: bytes, num_ranks: int, rank: int) -> int:
    """An NCCL communicator on the current CUDA device (collective over ``num_ranks`` processes).

    Arguments:
        unique_id: rank 0's ``get_local_nccl_unique_id()``, the same bytes on every rank.
        num_ranks: number of ranks.
        rank: this process's rank in ``[0, num_ranks)``.

    Returns:
        The ``ncclComm_t`` as an int, for ``NativeRuntime`` and ``destroy_nccl_comm``.
    """
    if not isinstance(unique_id, (bytes, bytearray)):
        raise ValueError(f"unique_id must be bytes from get_local_nccl_unique_id(), got {type(unique_id).__name__}")
    num_ranks = int_arg("num_ranks", num_ranks, 1, int(_C.MAX_RANKS))
    rank = int_arg("rank", rank, 0, num_ranks - 1)
    need_cuda("create_nccl_comm")
    return int(_C.create_nccl_comm(bytes(unique_id), num_ranks, rank))


def destroy_nccl_comm(nccl_comm: int) -> None:
    """Aborts (frees) a communicator made by ``create_nccl_comm``; never blocks on dead peers."""
    nccl_comm = comm_arg(nccl_comm)
    need_cuda("destroy_nccl_comm")
    _C.destroy_nccl_comm(nccl_comm)


def get_physical_domain_size(nccl_comm: int) -> Tuple[int, int]:
    """``(num_rdma_ranks, num_nvl_ranks)`` of a communicator: from NCCL's count of LSA (NVLink) teams
    (``ncclCommQueryProperties``, NCCL >= 2.29), else ``(1, num_ranks)`` (the native runtime then checks
    the LSA team of its device communicator when it is created, and refuses a smaller one)."""
    nccl_comm = comm_arg(nccl_comm)
    need_cuda("get_physical_domain_size")
    _, size = _C.nccl_comm_rank_size(nccl_comm)
    props = _C.nccl_comm_gin_properties(nccl_comm)
    if props is not None and int(props[2]) > 0:
        return _domains.physical_from_lsa(int(size), int(size) // int(props[2]))
    return 1, int(size)


def get_logical_domain_size(nccl_comm: int, allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    """``(num_scaleout_ranks, num_scaleup_ranks)``: DeepEP's rule on ``get_physical_domain_size``, or
    ``ELASTIC_EP_NUM_SCALEUP_RANKS`` (``_domains``)."""
    physical = get_physical_domain_size(nccl_comm)
    S, U, _ = _domains.logical_domains(physical[0] * physical[1], physical, bool(allow_hybrid_mode),
                                       _env.num_scaleup_ranks())
    return S, U


def torch_nccl_comm(group: dist.ProcessGroup) -> int:
    """torch's own ncclComm_t of ``group`` as an int, or 0 when it cannot be reached."""
    try:
        return int(group._get_backend(torch.device("cuda"))._comm_ptr())
    except Exception:  # noqa: BLE001 - private API: absent or different in this torch
        return 0


def railed_gin_type(group: dist.ProcessGroup) -> Optional[int]:
    """The ``ncclGinType_t`` NCCL reports for rail connections of torch's communicator of ``group``
    (0: no GIN network), or None when it cannot tell (NCCL headers below 2.29, or torch's communicator
    out of reach)."""
    comm = torch_nccl_comm(group)
    props = _C.nccl_comm_gin_properties(comm) if comm else None
    return None if props is None else int(props[1])


def new_nccl_comm(group: dist.ProcessGroup) -> int:
    """A new communicator over the ranks of ``group`` (unique id from rank 0, exchanged over the group)."""
    rank = dist.get_rank(group)
    uid = get_local_nccl_unique_id() if rank == 0 else b""
    return create_nccl_comm(gather_bytes(group, uid)[0], dist.get_world_size(group), rank)


