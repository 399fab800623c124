"""Buffer sizes and SM counts: how many bytes a buffer needs (DeepEP V2's ``calculate_buffer_size`` and
``get_buffer_size_hint``, computed by ``_C``) and how many SMs keep the bottleneck link busy
(``get_theoretical_num_sms``, over ``_domains``' bandwidth model). The per-feature hints live with their
feature (``_agrs``, ``_pp``, ``_engram``)."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import _C, _checks, _domains, _env, _nvml
from ._checks import int_arg

__all__ = ["ALIGNMENT_BYTES", "align", "calculate_elastic_buffer_size", "get_elastic_buffer_alignment",
           "get_buffer_size_hint", "theoretical_num_sms"]

#: The alignment of every buffer size: 2 MiB, as DeepEP's.
ALIGNMENT_BYTES = int(_C.get_elastic_buffer_alignment())


def align(x: int, a: int) -> int:
    """``x`` rounded up to a multiple of ``a``."""
    return (x + a - 1) // a * a


def calculate_elastic_buffer_size(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                                  use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                                  allow_multiple_reduction: bool = True, num_nvl_ranks: Optional[int] = None, *,
                                  zero_copy: bool = False) -> int:
    """Bytes of the buffer for a configuration (DeepEP V2's ``calculate_buffer_size``, computed by ``_C``).

    Arguments:
        num_ranks: ranks in the group.
        num_max_tokens_per_rank: most tokens any rank dispatches at once.
        hidden: hidden size.
        num_topk: experts per token; 0 sizes for the worst case (32).
        use_fp8_dispatch: FP8 rows plus scale packs (one 4-byte pack per 32 elements).
        allow_hybrid_mode, allow_multiple_reduction: as the buffer's options.
        num_nvl_ranks: ranks inside one NVLink domain (default: all of them).
        zero_copy: also room for ``dispatch(zero_copy=True)`` (its receive area after the records and
            the combine area; ours, not DeepEP's).

    Returns:
        The 2 MiB-aligned maximum of the dispatch and combine layouts (with ``zero_copy``: at least the
        zero-copy layout's size).
    """
    # Only None means "all of them": 0 is a bad count, not the default.
    R, M, H, K, nvl = _checks.c_ints(num_ranks=num_ranks, num_max_tokens_per_rank=num_max_tokens_per_rank,
                                     hidden=hidden, num_topk=num_topk,
                                     num_nvl_ranks=num_ranks if num_nvl_ranks is None else num_nvl_ranks)
    size = int(_C.calculate_elastic_buffer_size(R, M, H, K, bool(use_fp8_dispatch), bool(allow_hybrid_mode),
                                                bool(allow_multiple_reduction), nvl))
    if zero_copy:
        k = K or _checks.MAX_TOPK
        packs = (H + 31) // 32 if use_fp8_dispatch else 0
        size = max(size, _checks.zero_copy_layout(0, R, M, H, 1 if use_fp8_dispatch else 2, packs, k,
                                                  bool(allow_multiple_reduction))[1])
    return size


def get_elastic_buffer_alignment() -> int:
    """The alignment every buffer size has: 2 MiB (``ALIGNMENT_BYTES``), as DeepEP's."""
    return ALIGNMENT_BYTES


def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int,
                         num_topk: int = 0, use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                         allow_multiple_reduction: bool = True, *, zero_copy: bool = False) -> int:
    """Bytes a buffer needs for this configuration on ``group`` (2 MiB aligned): DeepEP's
    ``calculate_buffer_size`` (``zero_copy``: with room for ``dispatch(zero_copy=True)`` too).

    Not collective, so it cannot ask the other ranks for their nodes: the scale-up domain is
    ``ELASTIC_EP_NUM_SCALEUP_RANKS`` when set, else the launcher's ranks per node
    (``LOCAL_WORLD_SIZE``, torchrun's) with hybrid mode allowed, else every rank
    (``_domains.local_scaleup_ranks``). A buffer created with ``num_bytes=None`` sizes itself from
    the domains it detects."""
    R = dist.get_world_size(group)
    U = _domains.local_scaleup_ranks(R, bool(allow_hybrid_mode), _env.num_scaleup_ranks(), _env.local_world_size())
    return calculate_elastic_buffer_size(R, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                         allow_hybrid_mode, allow_multiple_reduction, U, zero_copy=zero_copy)


def theoretical_num_sms(buf: Any, num_experts: Any, num_topk: Any, num_scaleout_topk: Any, rdma_gbs: Any,
                        nvlink_gbs: Any, sm_read_gbs: Any, sm_write_gbs: Any) -> int:
    """``ElasticBuffer.get_theoretical_num_sms`` of ``buf`` (its domains, settings, device and
    ``prefer_overlap_with_compute``), arguments checked by name."""
    num_experts, num_topk = int_arg("num_experts", num_experts), int_arg("num_topk", num_topk)
    num_scaleout_topk = int_arg("num_scaleout_topk", num_scaleout_topk, 0)
    domains = buf.domains
    if num_scaleout_topk and not domains.hybrid:
        raise ValueError(f"num_scaleout_topk: expected 0 in direct mode (one scale-out domain), got "
                         f"{num_scaleout_topk}")
    if num_scaleout_topk > domains.num_scaleout_ranks:
        raise ValueError(f"num_scaleout_topk: expected at most the {domains.num_scaleout_ranks} scale-out "
                         f"domains, got {num_scaleout_topk}")
    nvlink_gbs = _checks.real_arg("nvlink_gbs", nvlink_gbs, 0)
    rdma_gbs = _checks.real_arg("rdma_gbs", rdma_gbs, 0)
    sm_read_gbs = _checks.real_arg("sm_read_gbs", sm_read_gbs, 0, lo_inclusive=False)
    sm_write_gbs = _checks.real_arg("sm_write_gbs", sm_write_gbs, 0, lo_inclusive=False)
    if buf._settings.num_sms:
        return buf._settings.num_sms
    R = buf.num_ranks
    if num_experts <= 0 or num_experts % R or not 0 < num_topk <= num_experts:
        raise ValueError(f"num_experts / num_topk: expected a positive multiple of {R} experts and 1.."
                         f"num_experts per token, got {num_experts} / {num_topk}")
    if R == 1:
        return buf._device_sms
    if not nvlink_gbs:
        props = torch.cuda.get_device_properties(buf.device) if buf.device.type == "cuda" else None
        nvlink_gbs = _nvml.nvlink_gbs(_nvml.pci_bus_id(props))
    if not rdma_gbs:
        rdma_gbs = nvlink_gbs if domains.num_rdma_ranks == 1 else _domains.NIC_GBS
    need = _domains.theoretical_num_sms(domains, num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs,
                                        sm_read_gbs, sm_write_gbs)
    n = max(4, math.ceil(need * 1.25))
    n += n % 2
    if not buf.prefer_overlap_with_compute:
        n = max(n, 64)
    return min(n, buf._device_sms)
