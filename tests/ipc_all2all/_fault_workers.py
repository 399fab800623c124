"""Worker bodies of the GPU failure and lifetime tests (module-level so spawned processes can import
them): timeouts and skipped calls, view lifetimes and the handle and graph rules, frees deferred past
a capture, create/destroy loops, and destroy() racing calls in another thread.

Every worker returns normally on success; an assertion or exception travels back to the test
through tests._dist.run_workers.
"""
from __future__ import annotations

import os
import random
import time

import torch
import torch.distributed as dist

from tests.ipc_all2all._references import _assert_same, _rand, _setup


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
    from ipc_all2all import _collective

    dev = _setup(rank, world, rdzv)
    H, D, n = 4 * world, 128, 16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    # 1. Different num_tokens on one rank: every rank's sync() raises, naming a rank and the sizes.
    a = ipc_all2all.All2All(rank, world, n * world * (2 if rank == 0 else 1), H * D, sms, torch.bfloat16)
    handles = _collective.gather_bytes(dist.group.WORLD, a.get_local_ipc_handle())  # nothing unpickled
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
