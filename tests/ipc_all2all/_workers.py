"""Worker bodies of the GPU tests (module-level so spawned processes can import them).

Every worker returns normally on success; an assertion or exception travels back to the test
through tests._dist.run_workers. References are independent of ipc_all2all: the plain torch path
(permute -> all_to_all_single -> permute, all_gather_into_tensor) or the full global tensor rebuilt
on every rank from per-rank seeds.
"""
from __future__ import annotations

import os
import random
import time
import zlib

import torch
import torch.distributed as dist

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


# ------------------------------------------------------------------ workers
def worker_matches_nccl(rank, world, rdzv, reverse_devices, dtype_names):
    import ipc_all2all

    dev = _setup(rank, world, rdzv, reverse_devices)
    H = 8 * world
    max_tokens = 2 * 3 * 13 * 8 * world + 2 * 48 * world  # ample for batch 2 and the largest total
    checked = 0
    for dtype in [getattr(torch, n) for n in dtype_names]:
        with ipc_all2all.All2All.from_group(num_tokens=max_tokens, hidden_dim=H * 128, tensor_dtype=dtype,
                                            timeout_seconds=10) as a2a:
            assert a2a.rank == rank and a2a.device == dev
            for b in (1, 2):
                for D in (64, 128):
                    for name, counts in _count_sets(world).items():
                        for copy_output in (False, True):
                            seed = _stable_seed(str(dtype), b, D, name, copy_output)
                            a2a.set_rank_tokens(counts)
                            x = _rand((b, counts[rank], H, D), dtype, dev, seed + rank)
                            what = f"{dtype} b={b} D={D} {name} copy={copy_output} seed={seed}+rank {rank}"
                            y = a2a.send_recv_heads(x, copy_output=copy_output)
                            _assert_same(y, ref_send_recv_heads(x, counts, world, rank), "send_recv_heads " + what)
                            z = a2a.gather_heads(y, copy_output=copy_output)
                            _assert_same(z, x, "round trip " + what)
                            y2 = _rand((b, sum(counts), H // world, D), dtype, dev, seed + 1000 + rank)
                            _assert_same(a2a.gather_heads(y2, copy_output=copy_output),
                                         ref_gather_heads(y2, counts, world, rank), "gather_heads " + what)
                            xa = _rand((b, counts[rank], 3, D), dtype, dev, seed + 2000 + rank)
                            if (3 * D * xa.element_size()) % 16 == 0:
                                _assert_same(a2a.allgather(xa, copy_output=copy_output),
                                             ref_allgather(xa, counts, world, rank), "allgather " + what)
                            checked += 1
            a2a.synchronize()
    # Hidden far beyond one block's threads (the original kernel looped forever here).
    with ipc_all2all.All2All.from_group(num_tokens=3 * world * 2, hidden_dim=65536, tensor_dtype=torch.bfloat16) as a2a:
        counts = [3] * world
        a2a.set_rank_tokens(counts)
        xa = _rand((1, 3, 2, 32768), torch.bfloat16, dev, 77 + rank)
        _assert_same(a2a.allgather(xa), ref_allgather(xa, counts, world, rank), "allgather hidden 65536")
    return checked


def worker_validation(rank, world, rdzv):
    import ipc_all2all

    dev = _setup(rank, world, rdzv)
    H, D = 4 * world, 128
    with ipc_all2all.All2All.from_group(num_tokens=64 * world, hidden_dim=H * D, tensor_dtype=torch.bfloat16) as a2a:
        counts = [16] * world
        a2a.set_rank_tokens(counts)
        x = torch.zeros(1, 16, H, D, dtype=torch.bfloat16, device=dev)
        errors = {}

        def expect(fn, match):
            try:
                fn()
            except ValueError as e:
                assert match in str(e), f"{match!r} not in {e}"
                errors[match] = str(e)
            else:
                raise AssertionError(f"no ValueError for {match}")

        calls_before = a2a._core.calls
        expect(lambda: a2a.send_recv_heads(x.float()), "dtype")
        expect(lambda: a2a.send_recv_heads(x.cpu()), "lives on")
        expect(lambda: a2a.send_recv_heads(x.transpose(1, 2)), "contiguous")
        flat = torch.zeros(x.numel() + 8, dtype=torch.bfloat16, device=dev)
        expect(lambda: a2a.send_recv_heads(flat[1:1 + x.numel()].view(x.shape)), "16-byte aligned")
        expect(lambda: a2a.send_recv_heads(x[:, :15].contiguous()), "x has 15 tokens")
        expect(lambda: a2a.send_recv_heads(torch.zeros(1, 16, H + 1, D, dtype=torch.bfloat16, device=dev)),
               "divisible by world_size")
        expect(lambda: a2a.set_rank_tokens([16] * (world + 1)), "one entry per rank")
        expect(lambda: a2a.set_rank_tokens(torch.zeros(world, dtype=torch.int64, device=dev)), "int32")
        a2a.set_rank_tokens([100 * world] * world)
        expect(lambda: a2a.send_recv_heads(torch.zeros(1, 100 * world, H, D, dtype=torch.bfloat16, device=dev)),
               "exceed what the instance was built for")
        a2a.set_rank_tokens(counts)
        assert a2a._core.calls == calls_before, "a rejected call must not launch"
        # An input inside the slot this call writes (a zero-copy output from two calls ago) is refused.
        y = a2a.send_recv_heads(x)                      # slot A
        a2a.gather_heads(torch.zeros_like(y))           # slot B
        expect(lambda: a2a.gather_heads(y), "output slot")
        a2a.synchronize()
    return sorted(errors)


def worker_stress(rank, world, rdzv, iters, copy_output):
    """Back-to-back round trips on one instance; rank 1 is delayed at random before reading results."""
    import ipc_all2all

    dev = _setup(rank, world, rdzv)
    H, D, n = 8 * world, 128, 256
    counts = [n + 8 * r for r in range(world)]
    xs = [_rand((1, counts[r], H, D), torch.bfloat16, dev, 4242 + r) for r in range(world)]
    hpr = H // world
    want = torch.cat([xs[r][:, :, rank * hpr:(rank + 1) * hpr] for r in range(world)], dim=1)
    want_b = _bytes(want)
    x_b = _bytes(xs[rank])
    errors = torch.zeros((), dtype=torch.int64, device=dev)
    rng = random.Random(1234 + rank)
    with ipc_all2all.All2All.from_group(num_tokens=sum(counts), hidden_dim=H * D, tensor_dtype=torch.bfloat16,
                                        timeout_seconds=10) as a2a:
        a2a.set_rank_tokens(counts)
        for i in range(iters):
            delta = i % 251
            x = (x_b + delta).view(torch.bfloat16)  # bytes + i, so every call carries different data
            if rank == 1 and rng.random() < 0.5:
                torch.cuda._sleep(rng.randint(0, 200_000))
            y = a2a.send_recv_heads(x, copy_output=copy_output)
            if rank == 1 and rng.random() < 0.5:
                torch.cuda._sleep(rng.randint(0, 200_000))  # a slow reader of the zero-copy output
            errors += (_bytes(y) != want_b + delta).sum()
            z = a2a.gather_heads(y, copy_output=copy_output)
            if rank == 1 and rng.random() < 0.3:
                torch.cuda._sleep(rng.randint(0, 200_000))
            errors += (_bytes(z) != x_b + delta).sum()
        a2a.synchronize()
        assert a2a._core.calls == 2 * iters
    assert int(errors) == 0, f"{int(errors)} corrupted bytes over {iters} round trips"
    return iters


def _graph_instance(world, L, H, D):
    """A bf16 instance for L tokens per rank of H heads x D (the CUDA-graph tests)."""
    import ipc_all2all

    return ipc_all2all.All2All.from_group(num_tokens=L * world, hidden_dim=H * D, tensor_dtype=torch.bfloat16,
                                          timeout_seconds=10)


def _device_counts(a2a, world, L, H, D, dev):
    """Device-side token counts (all L) and a static input [1, L, H, D] for graph capture."""
    counts_dev = torch.full((world,), L, dtype=torch.int32, device=dev)
    a2a.set_rank_tokens(counts_dev)
    return counts_dev, torch.zeros(1, L, H, D, dtype=torch.bfloat16, device=dev)


def worker_cuda_graph(rank, world, rdzv):
    """One captured send+gather replayed with token counts changed on the device between replays."""
    import ipc_all2all

    dev = _setup(rank, world, rdzv)
    H, D, L = 8 * world, 128, 96
    hpr = H // world
    with _graph_instance(world, L, H, D) as a2a:
        counts_dev, x = _device_counts(a2a, world, L, H, D, dev)
        # warm-up in eager mode (same number of calls on every rank)
        y = a2a.send_recv_heads(x)
        a2a.gather_heads(y)
        a2a.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = a2a.send_recv_heads(x, copy_output=False)
            z = a2a.gather_heads(y, copy_output=True)
        replays = 0
        rng = random.Random(99)
        for step in range(6):
            counts = [rng.randint(0, L) for _ in range(world)]
            if step == 0:
                counts = [L] * world
            if step == 1:
                counts[0] = 0
            xs = [_rand((1, L, H, D), torch.bfloat16, dev, 555 * step + r) for r in range(world)]
            x.copy_(xs[rank])
            counts_dev.copy_(torch.tensor(counts, dtype=torch.int32))
            if rank == 1:
                torch.cuda._sleep(100_000)
            g.replay()
            replays += 1
            total = sum(counts)
            want = torch.cat([xs[r][:, :counts[r], rank * hpr:(rank + 1) * hpr] for r in range(world)], dim=1)
            _assert_same(y[:, :total], want, f"graph replay {step} send_recv_heads counts={counts}")
            _assert_same(z[:, :counts[rank]], xs[rank][:, :counts[rank]], f"graph replay {step} round trip")
        a2a.synchronize()
        # eager calls still work after the replays (epochs advanced on the device)
        a2a.set_rank_tokens([L] * world)
        x.copy_(_rand((1, L, H, D), torch.bfloat16, dev, 31337 + rank))
        _assert_same(a2a.gather_heads(a2a.send_recv_heads(x)), x, "eager after graph")
        a2a.synchronize()
    return replays


def worker_compile(rank, world, rdzv):
    import torch.nn.functional as F

    import ipc_all2all
    from ipc_all2all import ops

    dev = _setup(rank, world, rdzv)
    H, D, n = 4 * world, 64, 64
    with ipc_all2all.All2All.from_group(num_tokens=n * world * 2, hidden_dim=H * D, tensor_dtype=torch.bfloat16,
                                        timeout_seconds=120) as a2a:
        a2a.set_rank_tokens([n] * world)

        def attention(q, k, v):
            qh = ops.send_recv_heads(q, a2a)  # [1, T, H/W, D]
            kh = ops.send_recv_heads(k, a2a)
            vh = ops.send_recv_heads(v, a2a)
            o = F.scaled_dot_product_attention(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2))
            return ops.gather_heads(o.transpose(1, 2).contiguous(), a2a)

        q, k, v = [torch.randn(1, n, H, D, dtype=torch.bfloat16, device=dev,
                               generator=torch.Generator(device=dev).manual_seed(s + rank)) for s in (1, 2, 3)]
        eager = attention(q, k, v)
        compiled = torch.compile(attention, fullgraph=True)
        out = compiled(q, k, v)
        out2 = compiled(q, k, v)
        torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2)
        _assert_same(out2, out, "compiled twice")
        # the communication ops themselves are exact under compile
        f = torch.compile(lambda t: ops.gather_heads(ops.send_recv_heads(t, a2a) * 1, a2a), fullgraph=True)
        _assert_same(f(q), q, "compiled round trip")
        a2a.synchronize()
    return True


def worker_timeout(rank, world, rdzv):
    """The last rank skips a call. The others time out naming it; a call they queued behind the failed
    one must not run (its record reaches the host even after the timeout was raised); the skipper's own
    late call fails at once (the others marked the instance failed in its memory); a new instance works."""
    import ipc_all2all

    dev = _setup(rank, world, rdzv)
    H, D = 4 * world, 128
    skipper = world - 1
    a2a = ipc_all2all.All2All.from_group(num_tokens=64 * world, hidden_dim=H * D, tensor_dtype=torch.bfloat16,
                                         timeout_seconds=1.0)
    a2a.set_rank_tokens([16] * world)
    x = torch.ones(1, 16, H, D, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        a2a.gather_heads(a2a.send_recv_heads(x), copy_output=True)
    # Load every kernel used below now: with CUDA's lazy module loading, the first launch of a kernel
    # waits for the kernels running in the context, here the one spinning on the skipped peer.
    torch.cuda._sleep(1)
    torch.cuda.Event().record()
    a2a.synchronize()
    result = {}
    if rank != skipper:
        t0 = time.monotonic()
        y = a2a.send_recv_heads(x)              # the skipper never makes this call
        failed = torch.cuda.Event()
        failed.record()
        # Hold the next call back until the host has taken the first failure (and cleared the
        # device-side record): it must still refuse to run, and say so.
        torch.cuda._sleep(int(1e9))  # ~0.5 s
        a2a.gather_heads(y, copy_output=True)   # queued behind the failed call
        failed.synchronize()
        try:
            a2a.check()
        except ipc_all2all.CommTimeoutError as e:
            result = {"elapsed": time.monotonic() - t0, "op": e.operation, "rank": e.rank, "peer": e.peer,
                      "msg": str(e)}
        else:
            raise AssertionError("a call the peer skipped did not time out")
        assert a2a.broken
        t1 = time.monotonic()
        try:
            a2a.synchronize()
        except ipc_all2all.CommTimeoutError as e:
            raise AssertionError(f"the queued call ran into the failed exchange: {e}")
        except ipc_all2all.CommError as e:
            assert "gather_heads" in str(e) and "abandoned" in str(e), e
            result["queued"] = str(e)
            result["queued_s"] = time.monotonic() - t1
        else:
            raise AssertionError("the call queued behind a failed one reported nothing")
        try:
            a2a.send_recv_heads(x)
        except ipc_all2all.CommError as e:
            assert "unusable" in str(e) and "destroy()" in str(e), e
        else:
            raise AssertionError("a broken instance accepted a call")
        # the CUDA context is still usable
        assert float(torch.ones(4, device=dev).sum()) == 4.0
    dist.barrier()  # every other rank has failed and marked the instance
    if rank == skipper:
        t0 = time.monotonic()
        a2a.send_recv_heads(x)                  # the skipped call, late
        try:
            a2a.synchronize()
        except ipc_all2all.CommTimeoutError as e:
            raise AssertionError(f"the late call waited for its deadline instead of failing at once: {e}")
        except ipc_all2all.CommError as e:
            assert "abandoned" in str(e) and "marked failed by rank" in str(e), e
            result = {"late": str(e), "late_s": time.monotonic() - t0, "peer": e.peer}
        else:
            raise AssertionError("the late call of a failed instance succeeded")
    dist.barrier()
    a2a.destroy()
    # and a fresh instance works
    with ipc_all2all.All2All.from_group(num_tokens=64 * world, hidden_dim=H * D, tensor_dtype=torch.bfloat16) as b2b:
        b2b.set_rank_tokens([16] * world)
        xr = _rand((1, 16, H, D), torch.bfloat16, dev, rank)
        _assert_same(b2b.gather_heads(b2b.send_recv_heads(xr)), xr, "round trip after a timeout")
        b2b.synchronize()
    return result


def worker_skipped_call(rank, world, rdzv):
    """Rank 1 skips one call of a send/gather sequence and carries on: its next gather_heads meets the
    others' send_recv_heads. Every rank must raise CommError naming both operations, rank and peer,
    fast (not by a timeout), and nothing returned before the failure may be wrong."""
    import ipc_all2all

    dev = _setup(rank, world, rdzv)
    H, D, n = 4 * world, 128, 16
    counts = [n] * world
    hpr = H // world
    xs = [_rand((1, n, H, D), torch.bfloat16, dev, 900 + r) for r in range(world)]
    want_y = torch.cat([xs[r][:, :, rank * hpr:(rank + 1) * hpr] for r in range(world)], dim=1)
    seq = ["send_recv_heads", "gather_heads"] * 4
    skip = 2  # rank 1 leaves out the second send_recv_heads
    outcome = {}
    with ipc_all2all.All2All.from_group(num_tokens=n * world, hidden_dim=H * D, tensor_dtype=torch.bfloat16,
                                        timeout_seconds=30) as a2a:
        a2a.set_rank_tokens(counts)
        good, y = [], None
        t0 = time.monotonic()
        try:
            for i, op in enumerate(seq):
                if rank == 1 and i == skip:
                    continue
                if op == "send_recv_heads":
                    y = a2a.send_recv_heads(xs[rank], copy_output=True)
                    good.append((i, y, want_y))
                else:
                    good.append((i, a2a.gather_heads(y, copy_output=True), xs[rank]))
            a2a.synchronize()
        except ipc_all2all.CommTimeoutError as e:
            raise AssertionError(f"a mismatched call must fail its handshake, not time out: {e}")
        except ipc_all2all.CommError as e:
            outcome = {"msg": str(e), "rank": e.rank, "peer": e.peer, "elapsed": time.monotonic() - t0,
                       "raised_at": len(good)}
        else:
            raise AssertionError("a rank that skipped a call was paired silently")
        assert a2a.broken
        # The calls before the skipped one completed; they must be right.
        for i, got, want in good[:skip]:
            _assert_same(got, want, f"call {i} before the skipped call")
        torch.cuda.synchronize()
    return outcome


def worker_two_streams(rank, world, rdzv, iters):
    """Calls of one instance alternate between two streams (one of them randomly delayed): they must run
    one after the other (the instance's block counters are shared), and every output must be right."""
    import ipc_all2all

    dev = _setup(rank, world, rdzv)
    H, D, n = 4 * world, 128, 64
    counts = [n + 8 * r for r in range(world)]
    hpr = H // world
    xs = [_rand((1, counts[r], H, D), torch.bfloat16, dev, 4300 + r) for r in range(world)]
    want = _bytes(torch.cat([xs[r][:, :, rank * hpr:(rank + 1) * hpr] for r in range(world)], dim=1))
    x_b = _bytes(xs[rank])
    streams = [torch.cuda.Stream(device=dev), torch.cuda.Stream(device=dev)]
    errors = [torch.zeros((), dtype=torch.int64, device=dev) for _ in streams]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream(dev))
    rng = random.Random(77 + rank)
    with ipc_all2all.All2All.from_group(num_tokens=sum(counts), hidden_dim=H * D, tensor_dtype=torch.bfloat16,
                                        timeout_seconds=20) as a2a:
        a2a.set_rank_tokens(counts)
        for i in range(iters):
            k = i % 2
            with torch.cuda.stream(streams[k]):
                if rng.random() < 0.5:
                    torch.cuda._sleep(rng.randint(0, 400_000))
                delta = i % 251
                x = (x_b + delta).view(torch.bfloat16)
                y = a2a.send_recv_heads(x, copy_output=True)
                errors[k] += (_bytes(y) != want + delta).sum()
                if rng.random() < 0.3:
                    torch.cuda._sleep(rng.randint(0, 400_000))
                z = a2a.gather_heads(y)  # a view, read on the stream that made the call
                errors[k] += (_bytes(z) != x_b + delta).sum()
        # synchronize() on the default stream also waits for the last call, made on a side stream
        a2a.synchronize()
        for s in streams:
            s.synchronize()
    bad = sum(int(e) for e in errors)
    assert bad == 0, f"{bad} corrupted bytes over {iters} round trips on two streams"
    return iters


def worker_release_in_capture(rank, world, rdzv):
    """A zero-copy view outlives destroy() and is dropped inside a CUDA-graph capture: freeing the buffer
    then (cudaFree) would fail the capture, so the free waits until the capture ended; the graph
    replays, the view's bytes were readable until dropped, and release_deferred() frees the buffer."""
    import gc

    import ipc_all2all

    dev = _setup(rank, world, rdzv)
    H, D, n = 2 * world, 64, 8
    a2a = ipc_all2all.All2All.from_group(num_tokens=n * world, hidden_dim=H * D, tensor_dtype=torch.bfloat16)
    a2a.set_rank_tokens([n] * world)
    xs = [_rand((1, n, H, D), torch.bfloat16, dev, 7100 + r) for r in range(world)]
    hpr = H // world
    view = a2a.send_recv_heads(xs[rank])  # a view into this rank's buffer
    a2a.synchronize()
    want = torch.cat([xs[r][:, :, rank * hpr:(rank + 1) * hpr] for r in range(world)], dim=1)
    core = a2a._core
    a2a.destroy()
    assert core.buffer_ptr != 0, "the buffer was freed under a live view"
    _assert_same(view, want, "a view after destroy()")
    static = torch.arange(64, dtype=torch.float32, device=dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        out = static * 3  # warm-up outside the capture
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = static * 3
        del view
        gc.collect()
        deferred_inside = len(ipc_all2all._lifetime._DEFERRED)
        assert ipc_all2all.release_deferred() == 0  # still capturing: nothing may run
    assert deferred_inside >= 1 and core.buffer_ptr != 0, (deferred_inside, core.buffer_ptr)
    static.add_(1)
    g.replay()
    torch.cuda.synchronize(dev)
    assert torch.equal(out, (torch.arange(64, dtype=torch.float32, device=dev) + 1) * 3)
    assert ipc_all2all.release_deferred() >= 1
    assert core.buffer_ptr == 0 and not ipc_all2all._lifetime._DEFERRED
    dist.barrier()
    return True


def worker_lifetimes_and_checks(rank, world, rdzv):
    """sync() refuses peers built with another slot size before opening anything; a view keeps the
    buffer allocated after destroy(); the CUDA-graph rules (inputs from outside a capture refused, eager
    calls after a capture return copies that a replay cannot overwrite)."""
    import gc

    import ipc_all2all

    dev = _setup(rank, world, rdzv)
    H, D, n = 4 * world, 128, 16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    # 1. Different num_tokens on one rank: every rank's sync() raises, naming a rank and the sizes.
    a = ipc_all2all.All2All(rank, world, n * world * (2 if rank == 0 else 1), H * D, sms, torch.bfloat16)
    handles = [None] * world
    dist.all_gather_object(handles, a.get_local_ipc_handle())
    try:
        a.sync(handles)
    except ValueError as e:
        assert "output slots of" in str(e) and "every rank must build the instance alike" in str(e), e
    else:
        raise AssertionError("sync() accepted a peer built with another slot size")
    assert not a._core.opened
    a.destroy()
    dist.barrier()

    counts = [n] * world
    hpr = H // world
    xs = [_rand((1, n, H, D), torch.bfloat16, dev, 300 + r) for r in range(world)]
    want_y = torch.cat([xs[r][:, :, rank * hpr:(rank + 1) * hpr] for r in range(world)], dim=1)
    # 2. A zero-copy view outlives destroy(): the buffer is freed with the last view.
    a2a = ipc_all2all.All2All.from_group(num_tokens=n * world, hidden_dim=H * D, tensor_dtype=torch.bfloat16)
    a2a.set_rank_tokens(counts)
    y = a2a.send_recv_heads(xs[rank])
    a2a.destroy()
    assert a2a._core.buffer_ptr != 0, "the buffer was freed under a live view"
    _assert_same(y, want_y, "a view read after destroy()")
    del y
    gc.collect()
    assert a2a._core.buffer_ptr == 0, "the buffer outlived its last view"

    # 3. CUDA graphs.
    with ipc_all2all.All2All.from_group(num_tokens=n * world, hidden_dim=H * D, tensor_dtype=torch.bfloat16,
                                        timeout_seconds=10) as a2a:
        a2a.set_rank_tokens(counts)
        x = xs[rank].clone()
        eager_view = a2a.send_recv_heads(x)
        a2a.synchronize()
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                a2a.gather_heads(eager_view)  # would re-read a slot that later calls rewrite
        except ValueError as e:
            assert "outside this capture" in str(e), e
        else:
            raise AssertionError("a capture accepted a zero-copy input made outside it")
        calls = a2a._core.calls
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            yg = a2a.send_recv_heads(x)               # a view: the graph's static output
            zg = a2a.gather_heads(yg, copy_output=True)
        assert a2a._core.calls == calls + 2 and a2a._core.captured_calls == 2
        g.replay()
        _assert_same(yg, want_y, "graph replay send_recv_heads")
        _assert_same(zg, x, "graph replay round trip")
        w = a2a.send_recv_heads(x)                    # eager after a capture: a copy
        lo, hi = a2a._core.buffer_ptr, a2a._core.buffer_ptr + a2a._core.buffer_bytes
        assert not lo <= w.data_ptr() < hi, "an eager call after a capture returned a view"
        x.copy_(xs[(rank + 1) % world])
        g.replay()                                    # rewrites both slots
        _assert_same(w, want_y, "eager output across a replay")
        a2a.synchronize()
    return True
def worker_leak(rank, world, rdzv, loops):
    import ipc_all2all

    dev = _setup(rank, world, rdzv)
    H, D = 4 * world, 128
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731

    def once():
        with ipc_all2all.All2All.from_group(num_tokens=16384, hidden_dim=H * D, tensor_dtype=torch.bfloat16) as a2a:
            a2a.set_rank_tokens([16] * world)
            x = torch.ones(1, 16, H, D, dtype=torch.bfloat16, device=dev)
            _assert_same(a2a.gather_heads(a2a.send_recv_heads(x)), x, "leak loop round trip")

    once()
    torch.cuda.synchronize()
    dist.barrier()  # ranks sharing a GPU see each other's allocations: measure when all are idle
    free0, fd0 = torch.cuda.mem_get_info(dev)[0], fds()
    for _ in range(loops):
        once()
    torch.cuda.synchronize()
    dist.barrier()
    free1, fd1 = torch.cuda.mem_get_info(dev)[0], fds()
    per_instance = 2 * 16384 * H * D * 2
    assert free0 - free1 < per_instance, f"device memory shrank by {free0 - free1} bytes over {loops} loops"
    assert fd1 - fd0 <= 2, f"{fd1 - fd0} file descriptors leaked"
    return free0 - free1


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


def worker_fp8_wire(rank, world, rdzv):
    """fp8 on the wire: send_recv_heads and gather_heads equal the exact path applied to the plain-torch
    e4m3 round trip of their input, bitwise; the compilable op too; bad arguments raise before launch."""
    import ipc_all2all
    from ipc_all2all import ops

    dev = _setup(rank, world, rdzv)
    H = 8 * world
    checked = 0
    with ipc_all2all.All2All.from_group(num_tokens=2 * 48 * world * 2, hidden_dim=H * 256,
                                        tensor_dtype=torch.bfloat16, timeout_seconds=10) as a2a:
        for b in (1, 2):
            for D in (16, 64, 128, 256):
                for name, counts in _count_sets(world).items():
                    a2a.set_rank_tokens(counts)
                    seed = _stable_seed(b, D, name)
                    x = _normal_bf16((b, counts[rank], H, D), dev, seed + rank)
                    what = f"fp8 wire b={b} D={D} {name} seed={seed}+rank {rank}"
                    y = a2a.send_recv_heads(x, fp8_wire=True)
                    _assert_same(y, ref_send_recv_heads(qdq_e4m3(x), counts, world, rank), "send_recv_heads " + what)
                    z = a2a.gather_heads(y, fp8_wire=True)
                    _assert_same(z, ref_gather_heads(qdq_e4m3(y), counts, world, rank), "gather_heads " + what)
                    checked += 1
        counts = _count_sets(world)["uneven"]
        a2a.set_rank_tokens(counts)
        x = _normal_bf16((1, counts[rank], H, 128), dev, 99 + rank)
        _assert_same(ops.send_recv_heads(x, a2a, fp8_wire=True),
                     ref_send_recv_heads(qdq_e4m3(x), counts, world, rank), "ops.send_recv_heads fp8 wire")
        for bad, match in ((lambda: a2a.send_recv_heads(_normal_bf16((1, counts[rank], H, 48), dev, 1), fp8_wire=True),
                            "head_dim"),
                           (lambda: a2a.allgather(x, fp8_wire=True), "fp8_wire")):
            try:
                bad()
            except (ValueError, TypeError) as e:
                assert match in str(e), e
            else:
                raise AssertionError(f"no error for {match}")
        a2a.synchronize()
    # CUDA graph with device-side counts that change between replays
    L, D = 64, 128
    hpr = H // world
    with _graph_instance(world, L, H, D) as a2a:
        counts_dev, x = _device_counts(a2a, world, L, H, D, dev)
        a2a.gather_heads(a2a.send_recv_heads(x, fp8_wire=True), fp8_wire=True)  # warm-up, same on every rank
        a2a.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = a2a.send_recv_heads(x, fp8_wire=True)
            z = a2a.gather_heads(y, fp8_wire=True)
        rng = random.Random(7)
        for step in range(4):
            counts = [L] * world if step == 0 else [rng.randint(0, L) for _ in range(world)]
            xs = [_normal_bf16((1, L, H, D), dev, 77 * step + r) for r in range(world)]
            x.copy_(xs[rank])
            counts_dev.copy_(torch.tensor(counts, dtype=torch.int32))
            g.replay()
            total, n = sum(counts), counts[rank]
            want = torch.cat([qdq_e4m3(xs[r][:, :counts[r], rank * hpr:(rank + 1) * hpr]) for r in range(world)], 1)
            _assert_same(y[:, :total], want, f"fp8 wire graph replay {step} counts={counts}")
            _assert_same(z[:, :n], qdq_e4m3(qdq_e4m3(xs[rank][:, :n])), f"fp8 wire graph replay {step} round trip")
        a2a.synchronize()
    with ipc_all2all.All2All.from_group(num_tokens=2 * 48 * world, hidden_dim=H * 128,
                                        tensor_dtype=torch.float16) as a2a:
        a2a.set_rank_tokens([48] * world)
        try:
            a2a.send_recv_heads(torch.zeros((1, 48, H, 128), dtype=torch.float16, device=dev), fp8_wire=True)
        except ValueError as e:
            assert "bfloat16" in str(e), e
        else:
            raise AssertionError("fp8_wire on a float16 instance did not raise")
    return checked


def worker_destroy_races_calls(rank, world, rdzv, rounds):
    """One rank alone (W = 1: no peers, no process group) on GPU 0. A second thread keeps calling while
    this one destroys: each call must either complete or raise CommError "destroyed"; none may launch
    into the freed buffer or use the freed event or record (destroy() runs without the GIL). The CUDA
    context must be healthy afterwards."""
    import threading

    import ipc_all2all

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    H, D, L = 8, 128, 256
    x = torch.randn(1, L, H, D, device=dev, dtype=torch.bfloat16)
    ends = {"completed": 0, "refused": 0}
    for i in range(rounds):
        a = ipc_all2all.All2All(0, 1, L, H * D, 8, torch.bfloat16, timeout_seconds=5)
        a.sync([a.get_local_ipc_handle()])
        a.set_rank_tokens([L])
        errors, started = [], threading.Event()

        def caller():
            try:
                while True:
                    y = a.send_recv_heads(x, copy_output=bool(i % 2))
                    started.set()
                    a.check()
                    assert y.shape == (1, L, H, D)
                    ends["completed"] += 1
            except ipc_all2all.CommError as e:
                if "destroyed" not in str(e):
                    errors.append(repr(e))
                ends["refused"] += 1
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))
            finally:
                started.set()

        t = threading.Thread(target=caller)
        t.start()
        started.wait(30)
        time.sleep(random.Random(i).random() * 0.002)
        a.destroy()
        t.join(60)
        assert not t.is_alive(), "the calling thread hangs after destroy()"
        assert not errors, errors
    torch.cuda.synchronize()  # an illegal address from a launch into freed memory would surface here
    torch.zeros(1, device=dev).add_(1).item()
    return ends
