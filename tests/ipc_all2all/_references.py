"""What every GPU worker of ipc_all2all's tests shares: the process-group set-up, seeded random inputs
and byte-exact comparison, and the references, independent of ipc_all2all: the plain torch path
(permute -> all_to_all_single -> permute, all_gather_into_tensor) and the e4m3 round trip of fp8 on
the wire in torch.
"""
from __future__ import annotations

import zlib

import torch

from tests._dist import all_gather_into_tensor, all_to_all_single, init_gpu_group


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def _setup(rank, world, rdzv, reverse_devices=False):
    n = torch.cuda.device_count()
    dev = (world - 1 - rank) % n if reverse_devices else rank % n
    return init_gpu_group(rank, world, rdzv, device=dev)


def _rand(shape, dtype, device, seed):
    """Random bytes viewed as dtype (every bit pattern, NaNs included: comparisons are bytewise)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    it = torch.empty((), dtype=dtype).element_size()
    shape = list(shape)
    raw = torch.randint(0, 256, shape[:-1] + [shape[-1] * it], dtype=torch.uint8, device=device, generator=g)
    return raw.view(dtype)


def _stable_seed(*key) -> int:
    """A seed derived from ``key`` that is the same in every process and run (``hash`` of a str is
    salted per process by PYTHONHASHSEED, so a failure seeded by it could not be reproduced)."""
    return zlib.crc32(repr(key).encode()) % (1 << 30)


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _assert_same(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    gb, wb = _bytes(got), _bytes(want)
    if not torch.equal(gb, wb):
        bad = (gb != wb).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}")


# ------------------------------------------------------------------ NCCL references (bytes on the wire)
def ref_send_recv_heads(x, counts, world, rank):
    b, n, H, D = x.shape
    hpr = H // world
    xb = _bytes(x)  # [b, n, H, D*it]
    De = xb.shape[-1]
    inp = xb.view(b, n, world, hpr, De).permute(2, 0, 1, 3, 4).contiguous()  # [W, b, n, hpr, D*it]
    row = hpr * De
    out = torch.empty(sum(b * c * row for c in counts), dtype=torch.uint8, device=x.device)
    all_to_all_single(out, inp.view(-1), [b * c * row for c in counts], [b * n * row] * world)
    parts = torch.split(out, [b * c * row for c in counts])
    y = torch.cat([p.view(b, c, hpr, De) for p, c in zip(parts, counts)], dim=1)
    return y.view(x.dtype)


def ref_gather_heads(y, counts, world, rank):
    b, T, hpr, _ = y.shape
    yb = _bytes(y)
    De = yb.shape[-1]
    row = hpr * De
    n = counts[rank]
    inp = torch.cat([yb[:, sum(counts[:r]):sum(counts[:r + 1])].reshape(-1) for r in range(world)])
    out = torch.empty(world * b * n * row, dtype=torch.uint8, device=y.device)
    all_to_all_single(out, inp, [b * n * row] * world, [b * c * row for c in counts])
    x = out.view(world, b, n, hpr, De).permute(1, 2, 0, 3, 4).reshape(b, n, world * hpr, De)
    return x.contiguous().view(y.dtype)


def ref_allgather(x, counts, world, rank):
    b, n, h, _ = x.shape
    xb = _bytes(x)
    De = xb.shape[-1]
    if len(set(counts)) == 1:
        # output concatenated along dim 0 (the form every backend accepts), then viewed per rank
        out = torch.empty((world * b,) + tuple(xb.shape[1:]), dtype=torch.uint8, device=x.device)
        all_gather_into_tensor(out, xb)
        return out.view((world,) + tuple(xb.shape)).permute(1, 0, 2, 3, 4).reshape(b, sum(counts), h, De).contiguous().view(x.dtype)
    row = h * De
    out = torch.empty(sum(b * c * row for c in counts), dtype=torch.uint8, device=x.device)
    all_to_all_single(out, xb.reshape(-1).repeat(world), [b * c * row for c in counts], [b * n * row] * world)
    parts = torch.split(out, [b * c * row for c in counts])
    return torch.cat([p.view(b, c, h, De) for p, c in zip(parts, counts)], dim=1).view(x.dtype)


def _count_sets(world):
    even = [48] * world
    uneven = [0] + [13 + 29 * r for r in range(1, world)]  # rank 0 has no tokens
    return {"even": even, "uneven": uneven, "uneven_rev": list(reversed(uneven))}


def qdq_e4m3(x):
    """The fp8-on-the-wire round trip in plain torch: per head vector (last dim) s = amax / 448 (1 when
    amax is 0), q = e4m3(x / s), back = bf16(float(q) * s)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # A tensor divisor: torch turns division by a Python scalar into a multiply by its reciprocal,
    # which rounds differently from the IEEE division the kernel does.
    scale = torch.where(amax > 0, amax / torch.full_like(amax, 448.0), torch.ones_like(amax))
    return ((xf / scale).to(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16)


def _normal_bf16(shape, device, seed):
    """Finite bf16 values over many magnitudes, with some all-zero head vectors and subnormal scales."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    x = torch.randn(shape, device=device, generator=g)
    mag = torch.exp2(torch.randint(-30, 20, tuple(shape[:-1]) + (1,), device=device, generator=g).float())
    x = x * mag
    if x.numel():
        x.view(-1, shape[-1])[::7] = 0  # amax == 0: scale 1
    return x.to(torch.bfloat16)
