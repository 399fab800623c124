"""AGRS (all-gather sessions) on the torch runtime over gloo, checked bitwise against
``torch.distributed``'s own all-gather of the same bytes.

* A random stress: sessions of random length holding >= 100 all-gathers in all, each of one to three
  tensors of random dtype (floats, FP8, ints, bool) and shape (0 to a few KiB), some written in place
  (``agrs_get_inplace_tensor``), some waited at once and some only at the end of the session; every
  result of a session is checked again at its end (the bump allocator gives each its own bytes).
* Every refusal is a ``ValueError`` naming the problem, and the buffer stays usable after it.
"""
import pytest
import torch
import torch.distributed as dist

from tests._dist import init_gloo, run_workers
from tests.elastic_ep._common import import_elastic_ep, ops_buffer, refusal_checker

ep = import_elastic_ep()

MiB2 = 2 << 20
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int8,
          torch.uint8, torch.int32, torch.int64, torch.bool]
SESSION_BYTES = 48 << 10
MAX_GATHERS = 6


def _reference(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """``[R, nbytes]`` uint8: every rank's bytes of ``x`` by a plain torch all-gather."""
    src = x.reshape(-1).view(torch.uint8).clone()
    if dist.get_backend(group) == "gloo":
        src = src.cpu()
    out = torch.empty(world * src.numel(), dtype=torch.uint8, device=src.device)
    if src.numel():
        dist.all_gather_into_tensor(out, src, group=group)
    return out.view(world, -1)


def _random_shape(g: torch.Generator, itemsize: int):
    ndim = int(torch.randint(0, 4, (1,), generator=g))
    numel_cap = max(1, int(torch.randint(1, 3000, (1,), generator=g)) // itemsize)
    shape = []
    for _ in range(ndim):
        d = int(torch.randint(0, 9, (1,), generator=g))
        shape.append(d)
    if ndim and torch.rand(1, generator=g) < 0.7:  # mostly non-empty, up to a few KiB
        shape = [max(1, d) for d in shape]
        rest = 1
        for d in shape[1:]:
            rest *= d
        shape[0] = max(1, numel_cap // rest)
    return tuple(shape)


def _random_tensor(g: torch.Generator, shape, dtype: torch.dtype) -> torch.Tensor:
    """Random bytes as ``dtype`` (NaNs and infinities included), 0/1 for bool (other bytes are no bool)."""
    b = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        b &= 1
    return b.view(dtype).view(shape)


def _stress_worker(rank, world, rdzv, seed, backend="torch"):
    """The random sessions on the torch runtime over gloo, or (backend="native") on the native runtime's
    CUDA-IPC window (test_agrs_pp_engram_gpu.py), the reference then gathered over the test's group."""
    group, buf = ops_buffer(rank, world, rdzv, backend, num_bytes=MiB2)
    buf.agrs_set_config(SESSION_BYTES, MAX_GATHERS)
    plan = torch.Generator().manual_seed(seed)          # the same on every rank: shapes, dtypes, choices
    data = torch.Generator().manual_seed(seed * 100 + rank)  # this rank's bytes
    num_gathers = num_sessions = num_inplace = num_deferred = 0
    while num_gathers < 100:
        num_sessions += 1
        length = int(torch.randint(1, MAX_GATHERS + 1, (1,), generator=plan))
        checks = []  # (gathered tensors, references) of this session
        with buf.agrs_new_session():
            used = 0
            for _ in range(length):
                n = int(torch.randint(1, 4, (1,), generator=plan))
                inplace = bool(torch.rand(1, generator=plan) < 0.3)
                dtypes = [DTYPES[int(torch.randint(0, len(DTYPES), (1,), generator=plan))] for _ in range(n)]
                if inplace:
                    dtypes = [dtypes[0]] * n
                shapes = [_random_shape(plan, dt.itemsize) for dt in dtypes]
                need = sum((world * torch.Size(s).numel() * dt.itemsize + 31) // 32 * 32
                           for s, dt in zip(shapes, dtypes))
                if used + need > SESSION_BYTES:
                    break
                used += need
                xs = [_random_tensor(data, s, dt).to(buf.device) for s, dt in zip(shapes, dtypes)]
                if inplace:
                    views = buf.agrs_get_inplace_tensor(shapes, dtypes[0])
                    assert isinstance(views, tuple) and len(views) == n
                    for v, x in zip(views, xs):
                        assert v.shape == x.shape and v.dtype == x.dtype
                        v.copy_(x)
                    args = views
                    num_inplace += 1
                else:
                    args = xs
                single = n == 1 and bool(torch.rand(1, generator=plan) < 0.5)
                if single:
                    gathered, wait = buf.all_gather(args[0])
                    gathered = (gathered,)
                else:
                    *gathered, wait = buf.all_gather(list(args))
                assert callable(wait) and len(gathered) == n
                refs = [_reference(x, world, group) for x in xs]
                if torch.rand(1, generator=plan) < 0.5:
                    wait()
                else:
                    num_deferred += 1
                    checks.append(wait)
                for i, (gt, x) in enumerate(zip(gathered, xs)):
                    assert gt.shape == (world, *x.shape) and gt.dtype == x.dtype, (gt.shape, x.shape)
                    if inplace:  # this rank's row is the in-place tensor itself
                        assert gt[rank].data_ptr() == args[i].data_ptr() or x.numel() == 0
                checks.append((gathered, refs))
                num_gathers += 1
            for item in checks:  # the deferred waits, then every result of the session once more
                if callable(item):
                    item()
            for gathered, refs in (c for c in checks if not callable(c)):
                for gt, ref in zip(gathered, refs):
                    got = gt.reshape(world, -1).view(torch.uint8)
                    assert torch.equal(got.cpu(), ref.cpu()), f"all_gather differs: {gt.dtype} {tuple(gt.shape)}"
    buf.destroy()
    return num_gathers, num_sessions, num_inplace, num_deferred


@pytest.mark.parametrize("world", [2, 3])
def test_agrs_random_sessions_match_torch_all_gather(tmp_path, world):
    res = run_workers(_stress_worker, world, 7 + world, tmp_path=tmp_path, timeout=240)
    assert len(set(res)) == 1  # every rank ran the same plan
    num_gathers, num_sessions, num_inplace, num_deferred = res[0]
    assert num_gathers >= 100 and num_sessions >= 20 and num_inplace >= 10 and num_deferred >= 10, res[0]


def _refusal_worker(rank, world, rdzv):
    group = init_gloo(rank, world, rdzv)
    buf = ep.ElasticBuffer(group, num_bytes=MiB2, backend="torch")
    seen = []
    bad = refusal_checker(seen)
    x = torch.arange(10, dtype=torch.float32)
    bad("agrs_set_config", lambda: buf.all_gather(x))             # not configured
    bad("agrs_set_config", lambda: buf.agrs_get_inplace_tensor((2,), torch.int32))
    bad("num_max_session_bytes", lambda: buf.agrs_set_config(0, 4))
    bad("num_max_session_bytes", lambda: buf.agrs_set_config(MiB2 + 1, 4))   # over the buffer
    bad("num_max_session_bytes", lambda: buf.agrs_set_config(1.5, 4))
    bad("num_max_all_gathers_per_session", lambda: buf.agrs_set_config(1024, 0))
    bad("num_max_all_gathers_per_session", lambda: buf.agrs_set_config(1024, 33))  # DeepEP's limit: 32
    buf.agrs_set_config(1000, 3)  # rounded up to 1024 bytes
    bad("outside an AGRS session", lambda: buf.all_gather(x))
    bad("outside an AGRS session", lambda: buf.agrs_get_inplace_tensor((2,), torch.int32))
    bad("not inside an AGRS session", buf.destroy_agrs_session)
    with buf.agrs_new_session():
        bad("already inside", buf.create_agrs_session)
        bad("inside an AGRS session", lambda: buf.agrs_set_config(1024, 3))
        bad("non-empty sequence", lambda: buf.all_gather([]))
        bad("expected a tensor", lambda: buf.all_gather("x"))
        bad("t[1]: expected a tensor", lambda: buf.all_gather([x, None]))
        bad("contiguous", lambda: buf.all_gather(torch.zeros(4, 4)[:, 1]))
        bad("num_max_session_bytes", lambda: buf.all_gather(torch.zeros(1024 // world + 1, dtype=torch.uint8)))
        bad("num_max_session_bytes", lambda: buf.agrs_get_inplace_tensor([(200,), (200,)], torch.int32))
        bad("shapes", lambda: buf.agrs_get_inplace_tensor((2, 1.5), torch.int32))
        bad("dtype", lambda: buf.agrs_get_inplace_tensor((2,), "float"))
        # an in-place tensor gathered out of order: it is not this rank's part of that gather
        v = buf.agrs_get_inplace_tensor((4,), torch.float32)
        g0, w0 = buf.all_gather(torch.ones(3))          # takes the bytes the in-place tensor pointed at
        bad("this rank's part", lambda: buf.all_gather(v))
        w0()
        assert torch.equal(g0, torch.ones(world, 3))
        g1, g2, w1 = buf.all_gather([x, torch.full((2, 2), rank, dtype=torch.int64)])
        w1()
        assert torch.equal(g1, x.expand(world, 10)) and torch.equal(g2[:, 0, 0], torch.arange(world))
        g3, w3 = buf.all_gather(torch.tensor(rank, dtype=torch.int8))  # a 0-dim tensor: [R]
        w3()
        assert torch.equal(g3, torch.arange(world, dtype=torch.int8))
        bad("num_max_all_gathers_per_session", lambda: buf.all_gather(x))  # the 3 gathers are used
        bad("num_max_all_gathers_per_session", lambda: buf.agrs_get_inplace_tensor((1,), torch.int8))
    bad("session has ended", w1)
    # usable after every refusal: a session with an in-place gather
    with buf.agrs_new_session(enabled=True):
        v = buf.agrs_get_inplace_tensor(torch.Size([5]), torch.bfloat16)
        assert isinstance(v, torch.Tensor)
        v.fill_(rank + 1)
        g, w = buf.all_gather(v)
        w()
        assert torch.equal(g, torch.arange(1, world + 1, dtype=torch.bfloat16).view(world, 1).expand(world, 5))
    with buf.agrs_new_session(enabled=False):  # a no-op, as DeepEP's
        bad("outside an AGRS session", lambda: buf.all_gather(x))
    buf.destroy()
    return len(seen)


def test_agrs_refusals(tmp_path):
    counts = run_workers(_refusal_worker, 2, tmp_path=tmp_path, timeout=120)
    assert counts[0] == counts[1] == 25


def test_runtime_without_agrs_pp_engram_says_not_implemented():
    from elastic_ep._runtime import AllGatherArgs, Runtime

    class Native(Runtime):  # a runtime that keeps the interface's defaults for these ops
        backend = "native"
        dispatch = combine = barrier = destroy = get_comm_stream = None

    r = Native()
    for fn, op in ((lambda: r.agrs_set_config(1024), "agrs_set_config"),
                   (lambda: r.all_gather(AllGatherArgs([], [], [], 1, 0)), "all_gather"),
                   (lambda: r.agrs_end_session(1), "destroy_agrs_session"),
                   (lambda: r.pp_set_config(64, 2), "pp_set_config"), (lambda: r.pp_send(torch.zeros(1), 1), "pp_send"),
                   (lambda: r.pp_recv(torch.zeros(1), 1), "pp_recv"),
                   (lambda: r.engram_write(torch.zeros(1, 8), None), "engram_write"),
                   (lambda: r.engram_fetch(torch.zeros(1, 1, dtype=torch.int32), False), "engram_fetch")):
        with pytest.raises(NotImplementedError, match=rf"{op}: the native runtime does not implement it yet.*"
                                                      r"backend='torch'"):
            fn()
    try:
        from elastic_ep import _native_runtime
    except Exception:  # noqa: BLE001 - not importable on this machine: the interface check above stands
        return
    for op in ("agrs_set_config", "all_gather", "agrs_end_session", "pp_set_config", "pp_send", "pp_recv",
               "engram_write", "engram_fetch"):
        # the native runtime has its own (test_agrs_pp_engram_gpu.py)
        assert getattr(_native_runtime.NativeRuntime, op) is not getattr(Runtime, op)
