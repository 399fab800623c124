"""Drop-in compatibility with DeepEP V2's ``deep_ep.ElasticBuffer`` API, checked on the CPU.

The tables below are written from the research notes (``shared/reference/elastic_ep.md`` §2, "Python
API"), not from this package. Where the notes abbreviate (``get_engram_storage_size_hint(entries,
hidden, max_tokens, dtype)``, ``pp_send(t, dst, num_sms=0)``, the unstated defaults of ``dispatch``'s
first arguments and of the events), the exact names and defaults are those of DeepEP's
``deep_ep/buffers/elastic.py``, ``deep_ep/utils/event.py`` and ``deep_ep/utils/envs.py`` (v2.1.0).

Compatible means: every upstream parameter exists, in upstream's position, with upstream's default,
as positional-or-keyword; our extra parameters are keyword-only or come after upstream's with a
default, so every upstream call binds here to the same parameters. Staticmethods stay static.

The behaviour half runs the torch backend over gloo: positional calls in upstream's order, the
return structures, the RDMA-only arguments, the size hints and ``EPHandle.deterministic_sort``.
"""
import inspect

import pytest
import torch

from tests._dist import run_workers
from tests.elastic_ep._common import import_elastic_ep

ep = import_elastic_ep()

REQ = inspect.Parameter.empty  # a parameter without a default

# ---------------------------------------------------------------------------------------------- tables
# (name, [(parameter, default)], is_static). Methods omit `self`.
BUFFER_METHODS = [
    ("__init__", [("group", REQ), ("num_bytes", None), ("num_cpu_bytes", 0), ("num_max_tokens_per_rank", 0),
                  ("hidden", 0), ("num_topk", 0), ("use_fp8_dispatch", False), ("deterministic", False),
                  ("allow_hybrid_mode", True), ("allow_multiple_reduction", True),
                  ("prefer_overlap_with_compute", True), ("sl_idx", 3), ("num_allocated_qps", 0),
                  ("num_cpu_timeout_secs", 300), ("num_gpu_timeout_secs", 100), ("explicitly_destroy", False)],
     False),
    ("destroy", [], False),
    ("get_buffer_size_hint", [("group", REQ), ("num_max_tokens_per_rank", REQ), ("hidden", REQ), ("num_topk", 0),
                              ("use_fp8_dispatch", False), ("allow_hybrid_mode", True),
                              ("allow_multiple_reduction", True)], True),
    ("get_engram_storage_size_hint", [("num_entries", REQ), ("hidden", REQ), ("num_max_tokens_per_rank", REQ),
                                      ("dtype", torch.bfloat16)], True),
    ("get_pp_buffer_size_hint", [("num_max_tensor_bytes", REQ), ("num_max_inflight_tensors", REQ)], True),
    ("get_agrs_num_max_session_bytes", [("group", REQ), ("shapes", REQ), ("dtype", REQ)], True),
    ("get_agrs_buffer_size_hint", [("group", REQ), ("num_max_session_bytes", REQ)], True),
    ("barrier", [("use_comm_stream", True), ("with_cpu_sync", False), ("sequential", True)], False),
    ("capture", [], True),
    ("get_comm_stream", [], False),
    ("get_physical_domain_size", [], False),
    ("get_logical_domain_size", [], False),
    ("get_theoretical_num_sms", [("num_experts", REQ), ("num_topk", REQ), ("num_scaleout_topk", 0), ("rdma_gbs", 0),
                                 ("nvlink_gbs", 0), ("sm_read_gbs", 200), ("sm_write_gbs", 50)], False),
    ("get_theoretical_num_qps", [("num_sms", REQ)], False),
    ("dispatch", [("x", REQ), ("topk_idx", None), ("topk_weights", None), ("cumulative_local_expert_recv_stats", None),
                  ("num_experts", None), ("num_max_tokens_per_rank", None), ("expert_alignment", None),
                  ("num_sms", 0), ("num_qps", 0), ("previous_event", None), ("previous_event_before_epilogue", None),
                  ("async_with_compute_stream", False), ("allocate_on_comm_stream", False), ("handle", None),
                  ("do_handle_copy", True), ("do_cpu_sync", None), ("do_expand", False), ("do_zero_padding", False),
                  ("use_tma_aligned_col_major_sf", False)], False),
    ("combine", [("x", REQ), ("handle", REQ), ("topk_weights", None), ("bias", None), ("num_sms", 0), ("num_qps", 0),
                 ("previous_event", None), ("previous_event_before_epilogue", None),
                 ("async_with_compute_stream", False), ("allocate_on_comm_stream", False)], False),
    # Engram / PP / AGRS: present with upstream's signatures (the torch backend runs them).
    ("engram_write", [("storage", REQ), ("sf", None)], False),
    ("engram_fetch", [("indices", REQ), ("num_qps", 0), ("use_tma_aligned_col_major_sf", False)], False),
    ("pp_set_config", [("num_max_tensor_bytes", REQ), ("num_max_inflight_tensors", REQ)], False),
    ("pp_send", [("t", REQ), ("dst_rank_idx", REQ), ("num_sms", 0)], False),
    ("pp_recv", [("t", REQ), ("src_rank_idx", REQ), ("num_sms", 0)], False),
    ("create_agrs_session", [], False),
    ("destroy_agrs_session", [], False),
    ("agrs_new_session", [("enabled", True)], False),
    ("agrs_set_config", [("num_max_session_bytes", REQ), ("num_max_all_gathers_per_session", REQ)], False),
    ("agrs_get_inplace_tensor", [("shapes", REQ), ("dtype", REQ)], False),
    ("all_gather", [("t", REQ)], False),
]

# Set by the constructor (upstream's documented attributes).
BUFFER_ATTRIBUTES = ["group", "rank_idx", "num_ranks", "nccl_comm_handle", "allow_hybrid_mode", "allow_multiple_reduction",
                     "prefer_overlap_with_compute", "deterministic", "num_bytes", "num_max_tokens_per_rank",
                     "num_allocated_qps", "explicitly_destroy", "runtime", "num_scaleout_ranks", "num_scaleup_ranks",
                     "scaleout_rank_idx", "scaleup_rank_idx", "num_rdma_ranks", "num_nvlink_ranks"]

HANDLE_FIELDS = ["do_expand", "num_experts", "expert_alignment", "num_max_tokens_per_rank", "num_sms", "topk_idx",
                 "num_recv_tokens", "num_expanded_tokens", "num_recv_tokens_per_expert_list",
                 "psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                 "num_unaligned_recv_tokens_per_expert", "recv_src_metadata", "dst_buffer_slot_idx",
                 "token_metadata_at_forward", "channel_linked_list"]
HANDLE_METHODS = [
    ("__init__", [(f, REQ) for f in HANDLE_FIELDS], False),
    ("deterministic_sort", [("do_cpu_sync", REQ), ("is_cached_dispatch", REQ), ("recv_x", REQ), ("recv_sf", REQ),
                            ("recv_topk_idx", REQ), ("recv_topk_weights", REQ), ("channel_linked_list", REQ)], False),
]

EVENT_OVERLAP_METHODS = [
    ("__init__", [("event", None), ("extra_tensors", None)], False),
    ("current_stream_wait", [("release_handle", False)], False),
    ("wait", [], False),
    ("register_hook_after_wait", [("hook_after_wait", REQ)], False),
    ("__call__", [("release_handle", False)], False),
    ("__enter__", [], False),
]

MODULE_FUNCTIONS = [
    ("get_physical_domain_size", [("group", REQ)]),
    ("get_logical_domain_size", [("group", REQ), ("allow_hybrid_mode", True)]),
    ("get_elastic_buffer_alignment", []),
]
# deep_ep's top level also has the V1 `Buffer` and `Config`, which are not part of the ElasticBuffer API.
MODULE_NAMES = ["ElasticBuffer", "EPHandle", "EventOverlap", "EventHandle", "topk_idx_t",
                "get_physical_domain_size", "get_logical_domain_size"]


def _compatible(fn, upstream, *, bound: bool) -> None:
    """``fn`` accepts every call upstream's signature accepts, binding each argument to the same name."""
    params = list(inspect.signature(fn).parameters.values())
    if bound and params and params[0].name == "self":
        params = params[1:]
    where = getattr(fn, "__qualname__", repr(fn))
    assert len(params) >= len(upstream), f"{where}: {[p.name for p in params]} lacks some of {upstream}"
    for p, (name, default) in zip(params, upstream):
        assert p.name == name, f"{where}: parameter {name!r} expected at this position, got {p.name!r}"
        assert p.kind == p.POSITIONAL_OR_KEYWORD, f"{where}: {name} must be positional-or-keyword, is {p.kind}"
        if default is REQ:
            continue  # a default here only accepts more calls
        assert p.default is not REQ and p.default == default and type(p.default) is type(default), \
            f"{where}: {name} defaults to {default!r} upstream, here to {p.default!r}"
    for p in params[len(upstream):]:
        assert p.kind == p.KEYWORD_ONLY or p.default is not REQ, \
            f"{where}: extra parameter {p.name} would change how upstream calls bind"
        assert p.kind not in (p.VAR_POSITIONAL,), f"{where}: *{p.name} would swallow upstream's arguments"


@pytest.mark.parametrize("name,upstream,static", BUFFER_METHODS, ids=[m[0] for m in BUFFER_METHODS])
def test_elastic_buffer_signatures(name, upstream, static):
    raw = inspect.getattr_static(ep.ElasticBuffer, name)
    assert isinstance(raw, staticmethod) == static, f"ElasticBuffer.{name}: static={static} upstream"
    _compatible(getattr(ep.ElasticBuffer, name), upstream, bound=not static)


@pytest.mark.parametrize("name,upstream,static", HANDLE_METHODS, ids=[m[0] for m in HANDLE_METHODS])
def test_ep_handle_signatures(name, upstream, static):
    _compatible(getattr(ep.EPHandle, name), upstream, bound=True)


@pytest.mark.parametrize("name,upstream,static", EVENT_OVERLAP_METHODS, ids=[m[0] for m in EVENT_OVERLAP_METHODS])
def test_event_overlap_signatures(name, upstream, static):
    _compatible(getattr(ep.EventOverlap, name), upstream, bound=True)


def test_module_level_names():
    for name in MODULE_NAMES:
        assert hasattr(ep, name), f"elastic_ep.{name} is missing"
    for name, upstream in MODULE_FUNCTIONS:
        _compatible(getattr(ep, name), upstream, bound=False)
    assert ep.topk_idx_t is torch.int64
    assert ep.get_elastic_buffer_alignment() == 2 * 1024 * 1024
    ep.EventHandle()  # constructible without arguments, recording on the current stream as upstream's


def test_event_overlap_behaviour():
    """Keyword calls with upstream's names, the hook's result through ``wait()``, the context manager
    (waits on exit; ``(release_handle=True)`` drops the event), and no event at all (the CPU case)."""
    waits = []

    class Ev:
        def current_stream_wait(self):
            waits.append(1)

    e = ep.EventOverlap(event=Ev(), extra_tensors=(torch.zeros(1),))
    e.register_hook_after_wait(hook_after_wait=lambda: "sorted")
    assert e.current_stream_wait(release_handle=False) == "sorted" and waits == [1]
    with e:
        assert not waits[1:]  # the body runs before the wait
    assert waits == [1, 1] and e.event is not None
    with e(release_handle=True):
        pass
    assert waits == [1, 1, 1] and e.event is None and e.extra_tensors is not None
    none = ep.EventOverlap()
    assert none.current_stream_wait() is None and none.wait() is None
    with none:
        pass


def test_size_hints_static():
    """The hints that need no group, by hand: 32 B-aligned rows or slots, 2 MiB-aligned totals."""
    B, MiB2 = ep.ElasticBuffer, 2 * 1024 * 1024
    # 7168 bf16 = 14336 B per entry: 4096 tokens = 28 x 2 MiB; 1000 entries = 14.3 MB -> 7 x 2 MiB
    assert B.get_engram_storage_size_hint(1000, 7168, 4096) == (28 * MiB2, 7 * MiB2)
    assert B.get_engram_storage_size_hint(1000, 7168, 4096, torch.float8_e4m3fn) == (14 * MiB2, 4 * MiB2)
    assert B.get_engram_storage_size_hint(1, 1, 1) == (MiB2, MiB2)  # 2 B -> 32 B -> 2 MiB
    assert B.get_pp_buffer_size_hint(100, 3) == MiB2  # 4 x 3 x 128 B
    assert B.get_pp_buffer_size_hint(2 ** 20 + 1, 2) == 5 * MiB2  # 4 x 2 x (1 MiB + 32 B) -> 8 MiB + 256 B


# ---------------------------------------------------------------------------------------------- behaviour
H, K, M = 128, 4, 24


def _deterministic_sort_checks(ep, group, buf, x, idx, w, E, rank):
    """EPHandle.deterministic_sort and the deterministic buffer against ``buf`` (a non-deterministic
    one); returns the deterministic buffer."""
    # ---- EPHandle.deterministic_sort on a non-deterministic buffer gives the deterministic buffer's
    # outputs. Expanded rows arrive in a random order inside each expert segment (as the native
    # kernels' may), so the sort has something to do.
    det = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, deterministic=True,
                           backend="torch")
    for b, seed in ((buf, 1), (det, 2)):
        b.runtime.shuffle_generator = torch.Generator().manual_seed(100 * seed + rank)
    for expand in (False, True):
        modes = dict(do_expand=expand, do_zero_padding=expand)
        rx, ri, rw, h, _ = buf.dispatch(x, idx, w, None, E, None, 4, **modes)
        dx, di, dw, dh, _ = det.dispatch(x, idx, w, None, E, None, 4, **modes)
        assert h.cached_recv_src_metadata_before_sort is None
        if expand:
            # upstream: a cached expanded dispatch is placed through recv_src_metadata, and sorting its
            # outputs does nothing (here on a handle never sorted: nothing moves, nothing is stored)
            ux, _, uw, _, _ = buf.dispatch(x, topk_weights=w, handle=h, **modes)
            before = ux.clone()
            h.deterministic_sort(False, True, ux, None, None, uw, None)
            assert torch.equal(ux, before) and h.perm is None and h.cached_recv_src_metadata_before_sort is None
        pre_sort = h.recv_src_metadata.clone()
        assert expand != torch.equal(rx, dx)  # shuffled expanded rows: the sort below has work to do
        h.deterministic_sort(True, False, rx, None, ri, rw, None)
        # upstream's plain attribute: a clone of the metadata the sort replaced
        saved = h.cached_recv_src_metadata_before_sort
        assert torch.equal(saved, pre_sort) and saved is not h.raw_recv_src_metadata
        assert torch.equal(rx, dx) and torch.equal(rw, dw) and torch.equal(h.recv_src_metadata, dh.recv_src_metadata)
        assert (ri is None and di is None) if expand else torch.equal(ri, di)
        h.deterministic_sort(True, False, rx, None, ri, rw, None)  # already sorted: nothing moves
        assert torch.equal(rx, dx)
        # a cached dispatch of this buffer returns the backend's order; the cached sort fixes it
        cx_, ci_, cw_, _, _ = buf.dispatch(x, topk_weights=w, handle=h, **modes)
        h.deterministic_sort(False, True, cx_, None, ci_, cw_, None)
        assert torch.equal(cx_, dx) and torch.equal(cw_, dw)
        # combine reads the backend's metadata and undoes the permutation, as for the deterministic buffer
        a = buf.combine(rx * 3, h, rw)
        b_ = det.combine(dx * 3, dh, dw)
        assert torch.equal(a[0], b_[0]) and torch.equal(a[1], b_[1])
        h.cached_recv_src_metadata_before_sort = None  # assignable; nothing reads it here
        assert torch.equal(buf.combine(rx * 3, h, rw)[0], a[0])
    try:
        h.deterministic_sort(True, False, rx, None, None, rw, torch.zeros(1))
    except ValueError as e:
        assert "channel_linked_list" in str(e)
    else:
        raise AssertionError("a hybrid-mode linked list was accepted")
    # async deterministic dispatch: the returned event works as upstream's (wait, then context manager)
    ax, _, _, _, aev = det.dispatch(x, idx, w, None, E, None, None, async_with_compute_stream=True)
    aev.current_stream_wait()
    with aev:
        pass
    return det


def api_worker(rank, world, rdzv):
    from tests._dist import init_gloo
    from tests.elastic_ep._common import make_inputs

    ep = import_elastic_ep()
    group = init_gloo(rank, world, rdzv)
    E = 4 * world
    MiB2 = 2 * 1024 * 1024

    # ---- constructor, positionally in upstream's order
    buf = ep.ElasticBuffer(group, None, 0, M, H, K, True, False, True, True, True, 3, 0, 60, 60, False,
                           backend="torch")
    for a in BUFFER_ATTRIBUTES:
        assert hasattr(buf, a), a
    assert (buf.rank_idx, buf.num_ranks, buf.num_max_tokens_per_rank) == (rank, world, M)
    assert (buf.num_scaleout_ranks, buf.num_scaleup_ranks, buf.scaleout_rank_idx, buf.scaleup_rank_idx) == \
        (1, world, 0, rank)
    assert (buf.num_rdma_ranks, buf.num_nvlink_ranks) == (1, world)
    assert buf.get_physical_domain_size() == (1, world) and buf.get_logical_domain_size() == (1, world)
    assert ep.get_physical_domain_size(group) == (1, world)
    assert ep.get_logical_domain_size(group, False) == (1, world)
    assert buf.num_bytes % ep.get_elastic_buffer_alignment() == 0
    assert buf.num_bytes == ep.ElasticBuffer.get_buffer_size_hint(group, M, H, K, True, True, True)
    # DeepEP's communicator object: get() is the ncclComm_t, 0 without NCCL (here: gloo, torch backend)
    assert buf.nccl_comm_handle.get() == buf.nccl_comm == 0
    buf.barrier(True, False, True)

    # ---- RDMA-only arguments: upstream's automatic QP counts; num_qps bounded by them, else no effect
    assert buf.num_allocated_qps == 129
    assert buf.get_theoretical_num_qps(4) == 65 and buf.get_theoretical_num_qps(20) == 129
    direct = ep.ElasticBuffer(group, None, 0, M, H, K, False, False, False, backend="torch")
    assert direct.num_allocated_qps == 17
    assert direct.get_theoretical_num_qps(4) == 4 and direct.get_theoretical_num_qps(20) == 9
    few = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_allocated_qps=5, sl_idx=0, backend="torch")
    assert few.get_theoretical_num_qps(4) == 5

    inp = make_inputs(rank, M - rank, H, K, E, "fp8", 5, "cpu")
    x8, sf, idx, w = inp["x"], inp["sf"], inp["topk_idx"], inp["topk_weights"]
    x = x8.float().to(torch.bfloat16)
    T = x.shape[0]
    try:
        buf.dispatch(x, idx, w, None, E, num_qps=130)
    except ValueError as e:
        assert "num_qps: expected at most num_allocated_qps=129, got 130" in str(e), e
    else:
        raise AssertionError("num_qps above num_allocated_qps accepted")

    # ---- dispatch / combine, every argument positionally in upstream's order, against keywords
    out = buf.dispatch(x, idx, w, None, E, None, None, 0, 0, None, None, False, False, None, True, None, False, False,
                       False)
    assert isinstance(out, tuple) and len(out) == 5
    recv_x, recv_idx, recv_w, handle, event = out
    assert isinstance(recv_x, torch.Tensor) and isinstance(handle, ep.EPHandle)
    assert isinstance(event, ep.EventOverlap)
    N = recv_x.shape[0]
    assert recv_idx.shape == (N, K) and recv_w.shape == (N, K) and handle.num_recv_tokens == N
    kw = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    assert torch.equal(kw[0], recv_x) and torch.equal(kw[1], recv_idx) and torch.equal(kw[2], recv_w)
    y = recv_x * 2
    comb = buf.combine(y, handle, recv_w, None, 0, 0, None, None, False, False)
    assert isinstance(comb, tuple) and len(comb) == 3
    cx, cw, cev = comb
    assert cx.shape == (T, H) and cx.dtype == torch.bfloat16 and cw.shape == (T, K)
    assert isinstance(cev, ep.EventOverlap)
    kx, kw_, _ = buf.combine(y, handle, topk_weights=recv_w)
    assert torch.equal(kx, cx) and torch.equal(kw_, cw)
    assert buf.combine(y, handle)[1] is None  # no weights given: none routed back
    # FP8 input -> (recv_x, recv_sf); expand mode -> no recv_topk_idx, 1-D weights
    (rx8, rsf), _, _, h8, _ = buf.dispatch((x8, sf), idx, w, None, E)
    assert rx8.dtype == torch.float8_e4m3fn and rsf.shape == (rx8.shape[0], sf.shape[1])
    ex, eidx, ew, eh, _ = buf.dispatch(x, idx, w, None, E, None, 4, do_expand=True)
    assert eidx is None and ew.dim() == 1 and ew.shape[0] == ex.shape[0] == eh.num_expanded_tokens
    # cached mode: positional handle (14th), as upstream's callers write it
    cx2, _, _, h2, _ = buf.dispatch(x, None, None, None, None, None, None, 0, 0, None, None, False, False, handle)
    assert h2 is handle and torch.equal(cx2, recv_x)
    # num_sms=0 is get_theoretical_num_sms, as upstream; the handle keeps it for combine
    assert handle.num_sms == buf.get_theoretical_num_sms(E, K) > 0
    # a 32-bit topk_idx (upstream's topk_idx_t in its default build) gives the same outputs and combine
    r32, i32, w32, h32, _ = buf.dispatch(x, idx.int(), w, None, E)
    assert torch.equal(r32, recv_x) and torch.equal(i32, recv_idx) and torch.equal(w32, recv_w)
    assert h32.topk_idx.dtype == torch.int32 and torch.equal(h32.topk_idx, idx.int())  # its copy, as given
    assert torch.equal(buf.combine(r32 * 2, h32, w32)[0], cx)
    e32 = buf.dispatch(x, idx.int(), w, None, E, None, 4, do_expand=True, do_zero_padding=True)
    assert torch.equal(e32[0], buf.dispatch(x, idx, w, None, E, None, 4, do_expand=True, do_zero_padding=True)[0])

    # ---- static hints that read the group
    assert ep.ElasticBuffer.get_agrs_num_max_session_bytes(group, (3, 5), torch.bfloat16) == \
        (world * 15 * 2 + 31) // 32 * 32
    assert ep.ElasticBuffer.get_agrs_num_max_session_bytes(group, torch.Size([3, 5]), torch.bfloat16) == \
        (world * 15 * 2 + 31) // 32 * 32
    assert ep.ElasticBuffer.get_agrs_num_max_session_bytes(group, [(3, 5), (7,)], torch.float32) == \
        (world * 15 * 4 + 31) // 32 * 32 + (world * 7 * 4 + 31) // 32 * 32
    assert ep.ElasticBuffer.get_agrs_buffer_size_hint(group, 1) == MiB2
    assert ep.ElasticBuffer.get_agrs_buffer_size_hint(group, MiB2 + 1) == 2 * MiB2
    # (AGRS, PP and Engram work on the torch backend: tests/elastic_ep/test_agrs_cpu.py, test_pp_cpu.py,
    # test_engram_cpu.py)
    with buf.agrs_new_session(enabled=False):  # a no-op upstream too
        pass

    det = _deterministic_sort_checks(ep, group, buf, x, idx, w, E, rank)
    for b in (buf, direct, few, det):
        b.destroy()
    return N


def test_api_positional_returns_and_extras_torch_backend(tmp_path):
    counts = run_workers(api_worker, 2, tmp_path=tmp_path, timeout=180)
    assert len(counts) == 2 and all(c > 0 for c in counts)


def debug_worker(rank, world, rdzv):
    import contextlib
    import io
    import os

    from tests._dist import init_gloo

    ep = import_elastic_ep()
    group = init_gloo(rank, world, rdzv)
    os.environ["EP_BUFFER_DEBUG"] = "1"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=128, backend="torch").destroy()
    return out.getvalue()


def test_ep_buffer_debug_reports_the_size(tmp_path):
    """``EP_BUFFER_DEBUG`` (one of DeepEP's variables) prints each rank's buffer size at creation."""
    outs = run_workers(debug_worker, 1, tmp_path=tmp_path, timeout=60)
    assert "rank 0/1: buffer of 2097152 bytes" in outs[0], outs
