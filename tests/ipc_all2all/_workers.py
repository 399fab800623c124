"""Worker bodies of the GPU correctness tests (module-level so spawned processes can import them):
bitwise equality with the torch path, validation before launch, back-to-back calls, CUDA graphs,
torch.compile, two streams and fp8 on the wire.

Every worker returns normally on success; an assertion or exception travels back to the test
through tests._dist.run_workers. The references (tests/ipc_all2all/_references.py) are independent
of ipc_all2all: the plain torch path or the full global tensor rebuilt on every rank from per-rank
seeds.
"""
from __future__ import annotations

import random

import torch

from tests.ipc_all2all._references import (
    _assert_same,
    _bytes,
    _count_sets,
    _normal_bf16,
    _rand,
    _setup,
    _stable_seed,
    qdq_e4m3,
    ref_allgather,
    ref_gather_heads,
    ref_send_recv_heads,
)


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
