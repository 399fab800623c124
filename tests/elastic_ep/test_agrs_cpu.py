"""AGRS (all-gather sessions) on the torch runtime over gloo, checked bitwise against
``torch.distributed``'s own all-gather of the same bytes.

* A random stress: sessions of random length holding >= 100 all-gathers in all, each of one to three
  tensors of random dtype (floats, FP8, ints, bool) and shape (0 to a few KiB), some written in place
  (``agrs_get_inplace_tensor``), some waited at once and some only at the end of the session; every
  result of a session is checked again at its end (the bump allocator gives each its own bytes).

Its refusals are in ``test_args_agrs_cpu.py``.
"""
import pytest
import torch
import torch.distributed as dist

from tests._dist import run_workers
from tests.elastic_ep._common import ops_buffer

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


def test_every_backend_has_its_part_of_agrs_pp_and_engram():
    """AGRS, PP and Engram each talk to a backend through one small interface (``AgrsPart``, ``PpPart``,
    ``EngramPart``): both runtimes' parts implement every operation of it (the native ones run in
    test_agrs_pp_engram_gpu.py), and a part that lacks one cannot be created, naming it."""
    from elastic_ep import _agrs, _engram, _pp

    cases = ((_agrs.AgrsPart, (_agrs.NativeAgrs, _agrs.TorchAgrs), {"set_config", "all_gather", "end_session"}),
             (_pp.PpPart, (_pp.NativePp, _pp.TorchPp), {"set_config", "send", "recv"}),
             (_engram.EngramPart, (_engram.NativeEngram, _engram.TorchEngram), {"write", "fetch"}))
    for interface, parts, ops in cases:
        assert set(interface.__abstractmethods__) == ops, interface
        for part in parts:
            assert issubclass(part, interface) and not part.__abstractmethods__, part
            for op in ops:
                assert getattr(part, op) is not getattr(interface, op), (part, op)
        lacking = type("Lacking", (interface,), {op: lambda *a: None for op in sorted(ops)[1:]})
        with pytest.raises(TypeError, match=sorted(ops)[0]):
            lacking()
