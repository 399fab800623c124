"""The domains of an expert-parallel group and the scale-out transport they call for.

DeepEP V2 sees a group twice:

* **physical** ``(num_rdma_ranks, num_nvl_ranks)``: NVLink domains of ``nvl`` ranks (NCCL's LSA team: the
  ranks whose windows a GPU can load and store), ``rdma`` of them joined by the network. Rank ``r``
  lies in domain ``r // nvl`` at index ``r % nvl``; domains of unequal size, or whose ranks are not
  consecutive, are refused (DeepEP's layout assumes it, and so do the rail peers below).
* **logical** ``(num_scaleout_ranks, num_scaleup_ranks)`` = ``(S, U)``: what dispatch/combine run on.
  DeepEP's rule: with ``allow_hybrid_mode`` and more than one NVLink domain, ``(rdma, nvl)`` (hybrid
  mode: a token crosses the network once per destination domain, to its *rail peer* -- the rank with
  the same scale-up index there -- which forwards it over NVLink); otherwise ``(1, R)`` (direct mode).
  ``ELASTIC_EP_NUM_SCALEUP_RANKS=N`` overrides it with ``(R / N, N)``: one node split into logical
  scale-out domains, so that the hybrid algorithm runs, and is tested, without a second node.

The scale-out transport of a native runtime (``scaleout_backend``):

* ``"none"``: direct mode (``S == 1``);
* ``"gin"``: NCCL's GPU-initiated networking, when ``S > 1`` spans real NVLink domains and NCCL reports a
  GIN-capable network (``ncclCommQueryProperties``, NCCL >= 2.29);
* ``"nvlink-emulated"``: the same device interface over NVLink stores and signals, only when the
  override made the scale-out domains (they all lie in one NVLink domain);
* several NVLink domains without GIN: refused with an error naming what is missing (never a hang).

Everything here is host-only arithmetic on what NCCL or the hosts report, so it is tested on the CPU.
"""
from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch.distributed as dist

from ._collective import gather_bytes
from ._env import num_scaleup_ranks

__all__ = ["Domains", "physical_from_nodes", "physical_from_lsa", "logical_domains", "make_domains",
           "scaleout_backend", "native_gin_request", "num_allocated_qps", "theoretical_num_qps", "gin_requirements", "node_key",
           "expected_distinct", "theoretical_num_sms", "local_scaleup_ranks", "detect", "get_physical_domain_size",
           "get_logical_domain_size", "GIN_TYPE_NAMES", "NIC_GBS"]

#: Scale-out GB/s per GPU assumed when ``rdma_gbs=0`` over a real network: one 400 Gb/s NIC per GPU at
#: 90 % (DeepEP reads the NIC's rate from ``ibstat``; this package has no NIC to ask).
NIC_GBS = 400 / 8 * 0.9

#: NCCL's ``ncclGinType_t`` values (``nccl_device/core.h``).
GIN_TYPE_NAMES = {0: "none", 2: "proxy", 3: "gdaki", 4: "gpi"}


@dataclass(frozen=True)
class Domains:
    """The domains of one rank of a group (see the module docstring)."""

    num_ranks: int
    rank_idx: int
    num_rdma_ranks: int          # physical: NVLink domains
    num_nvl_ranks: int           # physical: ranks per NVLink domain
    num_scaleout_ranks: int      # logical S
    num_scaleup_ranks: int       # logical U
    overridden: bool = False     # ELASTIC_EP_NUM_SCALEUP_RANKS set the logical domains

    @property
    def scaleout_rank_idx(self) -> int:
        return self.rank_idx // self.num_scaleup_ranks

    @property
    def scaleup_rank_idx(self) -> int:
        return self.rank_idx % self.num_scaleup_ranks

    @property
    def rdma_rank_idx(self) -> int:
        return self.rank_idx // self.num_nvl_ranks

    @property
    def nvl_rank_idx(self) -> int:
        return self.rank_idx % self.num_nvl_ranks

    @property
    def hybrid(self) -> bool:
        """True when dispatch/combine run DeepEP's hybrid algorithm (more than one scale-out domain)."""
        return self.num_scaleout_ranks > 1

    @property
    def physical(self) -> Tuple[int, int]:
        return self.num_rdma_ranks, self.num_nvl_ranks

    @property
    def logical(self) -> Tuple[int, int]:
        return self.num_scaleout_ranks, self.num_scaleup_ranks


def physical_from_lsa(num_ranks: int, lsa_size: int) -> Tuple[int, int]:
    """``(rdma, nvl)`` from the size of NCCL's LSA team (every rank's team has that size).

    Raises:
        ValueError: ``lsa_size`` is not a divisor of ``num_ranks`` in ``[1, num_ranks]``.
    """
    if not 1 <= lsa_size <= num_ranks or num_ranks % lsa_size:
        raise ValueError(f"NCCL reports an LSA (NVLink) team of {lsa_size} ranks in a group of {num_ranks}: "
                         "expected a divisor of the rank count (NVLink domains of equal size)")
    return num_ranks // lsa_size, lsa_size


def physical_from_nodes(keys: Sequence[str]) -> Tuple[int, int]:
    """``(rdma, nvl)`` from one node key per rank (rank order): ranks with the same key share an NVLink
    domain. The domains must be runs of consecutive ranks of one size.

    Raises:
        ValueError: domains of different sizes, or a domain whose ranks are not consecutive (naming them).
    """
    R = len(keys)
    if R == 0:
        raise ValueError("keys: expected one node key per rank, got none")
    runs = []  # (key, first rank, length)
    for r, k in enumerate(keys):
        if runs and runs[-1][0] == k:
            runs[-1][2] += 1
        else:
            runs.append([k, r, 1])
    seen = set()
    for k, first, _ in runs:
        if k in seen:
            raise ValueError(f"the ranks of node {k!r} are not consecutive (rank {first} follows another node's "
                             "ranks): order the group so that each node's ranks are consecutive, as DeepEP requires")
        seen.add(k)
    sizes = {n for _, _, n in runs}
    if len(sizes) != 1:
        detail = ", ".join(f"{k!r}: {n}" for k, _, n in runs)
        raise ValueError(f"NVLink domains of different sizes ({detail}): every node must hold the same number of ranks")
    nvl = runs[0][2]
    return R // nvl, nvl


def logical_domains(num_ranks: int, physical: Tuple[int, int], allow_hybrid_mode: bool,
                    num_scaleup_override: Optional[int]) -> Tuple[int, int, bool]:
    """``(S, U, overridden)``: DeepEP's rule, or the override (see the module docstring).

    Raises:
        ValueError: an override that is not a divisor of the NVLink domain size (a logical scale-up domain
            must lie inside one NVLink domain), or that asks for hybrid mode with ``allow_hybrid_mode=False``.
    """
    rdma, nvl = physical
    if num_scaleup_override is not None:
        n = num_scaleup_override
        if n < 1 or nvl % n:
            raise ValueError(f"ELASTIC_EP_NUM_SCALEUP_RANKS={n}: expected a divisor of the NVLink domain size "
                             f"{nvl} (a divisor of the {num_ranks} ranks that keeps each scale-up domain inside one "
                             "NVLink domain)")
        if n < num_ranks and not allow_hybrid_mode:
            raise ValueError(f"ELASTIC_EP_NUM_SCALEUP_RANKS={n} splits the {num_ranks} ranks into {num_ranks // n} "
                             "scale-out domains, which is hybrid mode, but the buffer has allow_hybrid_mode=False")
        return num_ranks // n, n, True
    if allow_hybrid_mode and rdma > 1:
        return rdma, nvl, False
    return 1, num_ranks, False


def make_domains(num_ranks: int, rank_idx: int, physical: Tuple[int, int], allow_hybrid_mode: bool,
                 num_scaleup_override: Optional[int]) -> Domains:
    """The ``Domains`` of ``rank_idx`` (see ``logical_domains`` for what raises)."""
    S, U, overridden = logical_domains(num_ranks, physical, allow_hybrid_mode, num_scaleup_override)
    return Domains(num_ranks, rank_idx, physical[0], physical[1], S, U, overridden)


def scaleout_backend(d: Domains, gin_type: Optional[int], nccl_version: Optional[int] = None) -> str:
    """The native runtime's scale-out transport for ``d`` (see the module docstring).

    Arguments:
        d: the domains.
        gin_type: NCCL's ``ncclGinType_t`` for this communicator (railed GIN in hybrid mode), or None when
            NCCL cannot tell (built or running below 2.29, or no NCCL communicator).
        nccl_version: the NCCL version code, for the error message.

    Raises:
        RuntimeError: ranks in several NVLink domains without GIN (hybrid mode), or in direct mode
            (``allow_hybrid_mode=False`` over several NVLink domains: DeepEP then runs direct mode over
            GIN, which this package does not).
    """
    if d.num_rdma_ranks > 1:
        if not d.hybrid:
            raise RuntimeError(f"the group spans {d.num_rdma_ranks} NVLink domains of {d.num_nvl_ranks} ranks, but "
                               "direct mode (allow_hybrid_mode=False) needs every rank in one NVLink domain: create "
                               "the buffer with allow_hybrid_mode=True")
        if gin_type is None:
            ver = f" (NCCL {nccl_version})" if nccl_version else ""
            raise RuntimeError(f"the group spans {d.num_rdma_ranks} NVLink domains, so hybrid mode needs NCCL GIN "
                               f"over the network, but this NCCL{ver} cannot report GIN support: NCCL >= 2.29 is "
                               "needed for the scale-out transport")
        if gin_type == 0:
            raise RuntimeError(f"the group spans {d.num_rdma_ranks} NVLink domains, so hybrid mode needs NCCL GIN, "
                               "but NCCL reports no GIN-capable network (ginType NONE): it needs InfiniBand/RoCE NICs "
                               "with GPUDirect RDMA (GDAKI) or NCCL_GIN_TYPE naming a proxy/plugin GIN")
        return "gin"
    return "nvlink-emulated" if d.hybrid else "none"


def native_gin_request(d: Domains, ipc: bool, gin_type: Optional[int], nccl_version: Optional[int], num_qps: int,
                       sl_idx: int, num_cpu_bytes: int) -> Optional[dict]:
    """The GIN request of a native runtime over ``d`` (``gin_requirements``), or None when its scale-out
    transport needs none (direct mode, or the NVLink emulation of the override).

    Arguments:
        d: the group's domains.
        ipc: the buffer's window is CUDA IPC (``window="ipc"``: one node only).
        gin_type, nccl_version: as ``scaleout_backend``'s (None for an IPC window).
        num_qps: the buffer's ``num_allocated_qps`` (one GIN context per QP, as DeepEP).
        sl_idx: the buffer's service level (the GIN traffic class).
        num_cpu_bytes: the buffer's Engram segment size.

    Raises:
        RuntimeError: an IPC window over several NVLink domains, or ``scaleout_backend``'s errors.
        ValueError: Engram (``num_cpu_bytes``) over several NVLink domains (its host segments are this
            node's shared memory; DeepEP reads them with GIN gets, which this package does not have).
    """
    if not d.hybrid and d.num_rdma_ranks == 1:
        return None
    if ipc and d.num_rdma_ranks > 1:
        raise RuntimeError(f"window='ipc' maps every rank's window over CUDA IPC, which needs one node, but the "
                           f"group spans {d.num_rdma_ranks} NVLink domains: use window='nccl'")
    if scaleout_backend(d, gin_type, nccl_version) != "gin":
        return None
    if d.num_scaleup_ranks != d.num_nvl_ranks:
        raise RuntimeError(f"ELASTIC_EP_NUM_SCALEUP_RANKS={d.num_scaleup_ranks} splits an NVLink domain, but this "
                           f"group spans {d.num_rdma_ranks} NVLink domains of {d.num_nvl_ranks} ranks, joined by GIN, "
                           "whose scale-up domains are the NVLink domains: unset it")
    if num_cpu_bytes:
        raise ValueError(f"num_cpu_bytes: Engram maps every rank's host segment through this node's shared memory, "
                         f"so it needs one node, but the group spans {d.num_rdma_ranks} NVLink domains")
    return gin_requirements(d, num_qps, sl_idx)


def num_allocated_qps(allow_hybrid_mode: bool, requested: int, fast_rdma_atomics: bool = False) -> int:
    """DeepEP's automatic QP count when ``requested`` is 0, decided by the buffer's ``allow_hybrid_mode``
    (as DeepEP's, not by whether the group is hybrid now): 17 without it; with it 65 on NICs with fast
    RDMA atomics (DeepEP's check by NIC name), else 129 -- a QP per scale-out channel plus one for
    notify. A machine without NICs gets 129."""
    if requested:
        return requested
    if not allow_hybrid_mode:
        return 17
    return 65 if fast_rdma_atomics else 129


def theoretical_num_qps(allow_hybrid_mode: bool, num_sms: int, num_allocated: int) -> int:
    """DeepEP's QPs for ``num_sms`` SMs: ``16 * num_sms + 1`` with hybrid mode allowed (16 channels of
    scale-out warps per SM plus notify), else ``min(num_sms, 9)``; at most ``num_allocated``."""
    n = 16 * num_sms + 1 if allow_hybrid_mode else min(num_sms, 9)
    return min(n, num_allocated)


def gin_requirements(d: Domains, num_qps: int, sl_idx: int) -> dict:
    """What the GIN backend asks ``ncclDevCommCreate`` for (DeepEP's request): one context per QP,
    exclusive, queue depth 1024, traffic class ``sl_idx``, ``R + 4`` signals, rail connections in
    hybrid mode (a rank talks over the network only to its rail peers), full ones otherwise."""
    return {"ginContextCount": num_qps, "ginExclusiveContexts": True, "ginQueueDepth": 1024,
            "ginTrafficClass": sl_idx, "ginSignalCount": d.num_ranks + 4,
            "ginConnectionType": "rail" if d.hybrid else "full"}


def expected_distinct(num_groups: int, num_experts: int, num_topk: int) -> float:
    """Expected number of distinct groups (of ``num_experts / num_groups`` experts each) hit by
    ``num_topk`` experts drawn without replacement: a balanced gate's ranks or domains per token."""
    per = num_experts // num_groups
    return num_groups * (1 - math.comb(num_experts - per, num_topk) / math.comb(num_experts, num_topk))


def node_key(group: dist.ProcessGroup) -> Tuple[str, ...]:
    """Every rank's node key (its host name), gathered over ``group`` (collective): what the physical
    domains come from when no NCCL communicator can tell (a gloo group)."""
    return tuple(k.decode("utf-8", "replace") for k in gather_bytes(group, socket.gethostname().encode()))


def local_scaleup_ranks(num_ranks: int, allow_hybrid_mode: bool, override: Optional[int],
                        local_world_size: Optional[int]) -> int:
    """The scale-up domain size a size hint assumes without asking the other ranks: the override, else
    the launcher's ranks per node (``LOCAL_WORLD_SIZE``, set by torchrun) when hybrid mode is allowed
    and it divides the rank count, else every rank."""
    if override is not None and override >= 1 and num_ranks % override == 0:
        return override
    if allow_hybrid_mode and local_world_size and 1 <= local_world_size < num_ranks \
            and num_ranks % local_world_size == 0:
        return local_world_size
    return num_ranks


def theoretical_num_sms(d: Domains, num_experts: int, num_topk: int, num_scaleout_topk: int, rdma_gbs: float,
                        nvlink_gbs: float, sm_read_gbs: float, sm_write_gbs: float) -> float:
    """SMs (before DeepEP's margin and rounding) that keep the bottleneck link busy for a balanced gate.

    In units of one row: a token is sent to ``k`` ranks (expected distinct ranks of ``num_topk``
    experts). Direct mode: per row written to a peer the SMs read ``1/k`` rows, and the NVLink link
    carries ``1 - 1/R`` of the rows. Hybrid mode: a token goes to ``k_out`` domains (expected distinct
    domains, or ``num_scaleout_topk`` for a node-limited gate) -- ``k_out (1 - 1/S)`` rows on the
    network -- and the forwarders send it to its ``k`` ranks -- ``k (1 - 1/U)`` rows on NVLink; the
    token rate is set by the slower link, and per token the SMs read ``1 + k_out`` rows (source row,
    forwarded rows) and write ``k_out + k``.
    """
    R, S, U = d.num_ranks, d.num_scaleout_ranks, d.num_scaleup_ranks
    k = expected_distinct(R, num_experts, num_topk)
    if S == 1:
        traffic = 1 - 1 / R
        return max(nvlink_gbs / traffic * (1 / k) / sm_read_gbs, nvlink_gbs / traffic / sm_write_gbs)
    k_out = num_scaleout_topk or expected_distinct(S, num_experts, num_topk)
    seconds_per_token = max(k_out * (1 - 1 / S) / rdma_gbs, k * (1 - 1 / U) / nvlink_gbs if U > 1 else 0.0)
    tokens = 1 / seconds_per_token
    return max(tokens * (1 + k_out) / sm_read_gbs, tokens * (k_out + k) / sm_write_gbs)


def detect(group: dist.ProcessGroup, allow_hybrid_mode: bool, num_scaleup_override: Optional[int]) -> Domains:
    """This rank's ``Domains`` in ``group`` (collective: the nodes of every rank).

    Raises:
        ValueError: see ``physical_from_nodes`` and ``logical_domains``.
    """
    R = dist.get_world_size(group)
    return make_domains(R, dist.get_rank(group), physical_from_nodes(node_key(group)), bool(allow_hybrid_mode),
                        num_scaleup_override)


def get_physical_domain_size(group: dist.ProcessGroup) -> Tuple[int, int]:
    """``(num_rdma_ranks, num_nvlink_ranks)`` of ``group`` (DeepEP's module function): the ranks' nodes
    (collective: every rank's host name is gathered), each node one NVLink domain.

    Raises:
        ValueError: nodes with different rank counts, or a node whose ranks are not consecutive.
    """
    return physical_from_nodes(node_key(group))


def get_logical_domain_size(group: dist.ProcessGroup, allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    """``(num_scaleout_ranks, num_scaleup_ranks)`` of ``group`` (DeepEP's module function; collective):
    ``(1, R)`` in direct mode; the physical domains in hybrid mode; ``(R / N, N)`` with
    ``ELASTIC_EP_NUM_SCALEUP_RANKS=N``.

    Raises:
        ValueError: see ``get_physical_domain_size``; an override that does not divide the NVLink domain.
    """
    return detect(group, allow_hybrid_mode, num_scaleup_ranks()).logical
