"""The domain arithmetic of ``elastic_ep._domains`` for the node shapes of real clusters (1x8, 2x8, 4x8,
8x8 H200) and for the one-node override, worked out by hand: physical domains from per-rank node keys
and from NCCL's LSA team size, DeepEP's logical rule, the override's refusals, the scale-out backend
choice (and its errors), the GIN requirements (and NCCL's struct filled from them) and QP counts (DeepEP: 17 / 65 / 129;
``16 * sms + 1`` or ``min(sms, 9)``), and the buffer sizes the logical domains call for."""
import pytest

from tests.elastic_ep._common import import_elastic_ep

ep = import_elastic_ep()
from elastic_ep import _domains as dm  # noqa: E402

SHAPES = [(1, 8), (2, 8), (4, 8), (8, 8)]  # (nodes, GPUs per node)


def _keys(nodes, per_node):
    return [f"node{n}" for n in range(nodes) for _ in range(per_node)]


@pytest.mark.parametrize("nodes,per_node", SHAPES, ids=[f"{a}x{b}" for a, b in SHAPES])
def test_node_shapes(nodes, per_node):
    R = nodes * per_node
    assert dm.physical_from_nodes(_keys(nodes, per_node)) == (nodes, per_node)
    assert dm.physical_from_lsa(R, per_node) == (nodes, per_node)
    for rank in (0, R - 1, R // 2 + 1):
        d = dm.make_domains(R, rank, (nodes, per_node), True, None)
        assert d.logical == ((nodes, per_node) if nodes > 1 else (1, R))
        assert (d.scaleout_rank_idx, d.scaleup_rank_idx) == ((rank // per_node, rank % per_node) if nodes > 1
                                                             else (0, rank))
        assert d.hybrid == (nodes > 1)
        direct = dm.make_domains(R, rank, (nodes, per_node), False, None)
        assert direct.logical == (1, R) and not direct.hybrid
        # a multi-node group needs GIN; one node runs direct mode
        if nodes == 1:
            assert dm.scaleout_backend(d, None) == "none"
        else:
            assert dm.scaleout_backend(d, 3) == "gin"
            with pytest.raises(RuntimeError, match="NCCL >= 2.29"):
                dm.scaleout_backend(d, None, 22809)
            with pytest.raises(RuntimeError, match="no GIN-capable network"):
                dm.scaleout_backend(d, 0)
            with pytest.raises(RuntimeError, match="allow_hybrid_mode=True"):
                dm.scaleout_backend(direct, 3)
        req = dm.gin_requirements(d, 129, 3)
        assert req == {"ginContextCount": 129, "ginExclusiveContexts": True, "ginQueueDepth": 1024,
                       "ginTrafficClass": 3, "ginSignalCount": R + 4,
                       "ginConnectionType": "rail" if nodes > 1 else "full"}
        _check_devcomm_request(req)


def _check_devcomm_request(req):
    """The C++ side fills NCCL's ncclDevCommRequirements from the request (kernels.cu fill_gin): read back
    from the struct of the headers the package was built with, every field carries the request; a field
    those headers lack (NCCL 2.28.x has fewer) reads -1 and is then simply not sent."""
    from elastic_ep import _C

    if not hasattr(_C, "gin_devcomm_request"):
        pytest.skip("a host-only build of elastic_ep (no CUDA, no NCCL device headers)")
    got = _C.gin_devcomm_request(req["ginContextCount"], req["ginSignalCount"], req["ginQueueDepth"],
                                 req["ginTrafficClass"], req["ginConnectionType"], req["ginExclusiveContexts"])
    want = dict(req, ginConnectionType={"full": 1, "rail": 2}[req["ginConnectionType"]],
                ginExclusiveContexts=int(req["ginExclusiveContexts"]), ginCounterCount=0)
    newer = _C.nccl_build_version() >= 22900  # headers with every field (ncclGinConnectionType_t and the rest)
    for k, v in want.items():
        optional = k not in ("ginContextCount", "ginSignalCount", "ginCounterCount") and not newer
        assert got[k] == v or (optional and got[k] == -1), f"{k}: {got[k]} in NCCL's struct, requested {v}"


@pytest.mark.parametrize("nodes,per_node", SHAPES, ids=[f"{a}x{b}" for a, b in SHAPES])
def test_native_gin_request(nodes, per_node):
    """What the buffer hands the native runtime: the GIN request exactly when the group spans NVLink
    domains in hybrid mode (one context per allocated QP, R + 4 signals, rail connections), nothing on
    one node; IPC windows, Engram and the override across nodes refused with the reason."""
    R = nodes * per_node
    d = dm.make_domains(R, R - 1, (nodes, per_node), True, None)
    req = dm.native_gin_request(d, False, 3, 23007, 129, 5, 0)
    if nodes == 1:
        assert req is None
        assert dm.native_gin_request(d, True, None, None, 129, 5, 1 << 20) is None  # IPC and Engram: one node
        return
    assert req == {"ginContextCount": 129, "ginExclusiveContexts": True, "ginQueueDepth": 1024,
                   "ginTrafficClass": 5, "ginSignalCount": R + 4, "ginConnectionType": "rail"}
    assert dm.native_gin_request(d, False, 3, 23007, 65, 0, 0)["ginContextCount"] == 65
    with pytest.raises(RuntimeError, match="window='ipc'.*needs one node"):
        dm.native_gin_request(d, True, None, None, 129, 5, 0)
    with pytest.raises(ValueError, match="num_cpu_bytes: Engram"):
        dm.native_gin_request(d, False, 3, 23007, 129, 5, 1 << 20)
    with pytest.raises(RuntimeError, match="no GIN-capable network"):
        dm.native_gin_request(d, False, 0, 23007, 129, 5, 0)
    split = dm.make_domains(R, 0, (nodes, per_node), True, per_node // 2)
    with pytest.raises(RuntimeError, match="splits an NVLink domain"):
        dm.native_gin_request(split, False, 3, 23007, 129, 5, 0)
    _check_runtime_options(req, per_node)


def _check_runtime_options(req, per_node):
    """The request reaches the C++ runtime's options as given (RuntimeOptions.set_gin: what
    devcomm_create passes to NCCL), and bad requests are refused by name."""
    from elastic_ep import _C

    if not hasattr(_C, "RuntimeOptions"):
        pytest.skip("a host-only build of elastic_ep (no CUDA runtime)")
    o = _C.RuntimeOptions()
    assert (o.num_scaleup_ranks, o.use_gin) == (0, False)
    o.num_scaleup_ranks = per_node
    o.set_gin(contexts=req["ginContextCount"], signals=req["ginSignalCount"], queue_depth=req["ginQueueDepth"],
              traffic_class=req["ginTrafficClass"], connection=req["ginConnectionType"],
              exclusive=req["ginExclusiveContexts"])
    assert o.use_gin and o.num_scaleup_ranks == per_node
    assert o.gin == (req["ginContextCount"], req["ginSignalCount"], 1024, req["ginTrafficClass"], 2, True)
    with pytest.raises(ValueError, match="connection: expected 'rail', 'full' or 'none'"):
        o.set_gin(contexts=1, signals=1, queue_depth=1, traffic_class=0, connection="ring", exclusive=True)
    with pytest.raises(ValueError, match="positive contexts"):
        o.set_gin(contexts=0, signals=1, queue_depth=1, traffic_class=0, connection="rail", exclusive=True)


def test_override_splits_one_node():
    d = dm.make_domains(8, 5, (1, 8), True, 2)
    assert d.logical == (4, 2) and d.physical == (1, 8) and d.overridden and d.hybrid
    assert (d.scaleout_rank_idx, d.scaleup_rank_idx, d.rdma_rank_idx, d.nvl_rank_idx) == (2, 1, 0, 5)
    assert dm.scaleout_backend(d, None) == "nvlink-emulated"
    assert dm.make_domains(8, 0, (1, 8), True, 8).logical == (1, 8)  # N = R: direct mode
    assert dm.make_domains(16, 9, (2, 8), True, 4).logical == (4, 4)  # inside each NVLink domain
    with pytest.raises(ValueError, match="divisor of the NVLink domain size 8"):
        dm.make_domains(16, 0, (2, 8), True, 16)  # a scale-up domain across two nodes
    with pytest.raises(ValueError, match="divisor"):
        dm.make_domains(8, 0, (1, 8), True, 3)
    with pytest.raises(ValueError, match="allow_hybrid_mode=False"):
        dm.make_domains(8, 0, (1, 8), False, 4)
    assert dm.make_domains(8, 0, (1, 8), False, 8).logical == (1, 8)


def test_physical_domains_refused_when_not_deepep_layout():
    with pytest.raises(ValueError, match="not consecutive"):
        dm.physical_from_nodes(["a", "a", "b", "b", "a", "a"])
    with pytest.raises(ValueError, match="different sizes"):
        dm.physical_from_nodes(["a", "a", "a", "b"])
    with pytest.raises(ValueError, match="LSA"):
        dm.physical_from_lsa(12, 5)
    assert dm.physical_from_nodes(["only"]) == (1, 1)


def test_qp_counts_as_deepep():
    assert dm.num_allocated_qps(True, 0) == 129
    assert dm.num_allocated_qps(True, 0, fast_rdma_atomics=True) == 65
    assert dm.num_allocated_qps(False, 0) == 17
    assert dm.num_allocated_qps(True, 33) == 33
    assert [dm.theoretical_num_qps(True, s, 129) for s in (1, 4, 8, 20)] == [17, 65, 129, 129]
    assert [dm.theoretical_num_qps(False, s, 17) for s in (1, 9, 20)] == [1, 9, 9]


def test_local_scaleup_guess_of_the_size_hint():
    assert dm.local_scaleup_ranks(16, True, None, 8) == 8          # torchrun's LOCAL_WORLD_SIZE
    assert dm.local_scaleup_ranks(16, False, None, 8) == 16        # direct mode: every rank
    assert dm.local_scaleup_ranks(16, True, 4, 8) == 4             # the override wins
    assert dm.local_scaleup_ranks(8, True, None, 8) == 8
    assert dm.local_scaleup_ranks(12, True, None, 5) == 12         # not a divisor: ignored
    assert dm.local_scaleup_ranks(8, True, None, None) == 8


@pytest.mark.parametrize("nodes,per_node", SHAPES, ids=[f"{a}x{b}" for a, b in SHAPES])
def test_buffer_sizes_follow_the_logical_domains(nodes, per_node):
    """The size a hybrid buffer gets is DeepEP's hybrid layout for (nodes x per_node); one node keeps
    the direct layout (checked by hand for these shapes in test_sizing.py)."""
    R, M, H, K = nodes * per_node, 4096, 7168, 8
    S, U = dm.make_domains(R, 0, (nodes, per_node), True, None).logical
    got = ep.calculate_elastic_buffer_size(R, M, H, K, num_nvl_ranks=U)
    assert got == ep.calculate_elastic_buffer_size(R, M, H, K, num_nvl_ranks=per_node)
    if nodes > 1:
        assert got != ep.calculate_elastic_buffer_size(R, M, H, K, allow_hybrid_mode=False)


def test_a_build_without_gin_refuses_hybrid_across_domains_before_any_communicator(monkeypatch):
    """A group spanning NVLink domains needs the GIN transport; a build without it (ELASTIC_EP_GIN=OFF, the
    default) is refused while the domains are planned, naming the build option, before the native
    runtime makes a communicator (it would refuse only after creating torch's and its own)."""
    from elastic_ep import _C, _nccl, _setup
    import torch

    d = dm.make_domains(16, 3, (2, 8), True, None)
    monkeypatch.setattr(dm, "detect", lambda group, allow_hybrid, override: d)
    monkeypatch.setattr(dm, "num_allocated_qps", lambda allow_hybrid, n: 129)
    monkeypatch.setattr(_nccl, "railed_gin_type", lambda group: 3)
    monkeypatch.setattr(_nccl, "nccl_version", lambda: 23007)
    o = _setup.Options("native", "nccl", torch.device("cpu"), 1 << 21, 0, 64, 128, 4, 0, 60, 60)
    for with_gin in (False, True):
        monkeypatch.setattr(_C, "built_with_gin", lambda: with_gin)
        if with_gin:
            _, _, req, _ = _setup.plan_domains(None, o, None, False, True, True, 3)
            assert req["ginConnectionType"] == "rail"
        else:
            with pytest.raises(RuntimeError, match="needs the GIN scale-out transport.*ELASTIC_EP_GIN=ON"):
                _setup.plan_domains(None, o, None, False, True, True, 3)
