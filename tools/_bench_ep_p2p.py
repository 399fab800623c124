"""AGRS and PP cases of tools/bench_elastic_ep.py (``--ops agrs,pp``; two or more GPUs).

* ``agrs``: one all-gather of S bytes per rank inside a session (``with buf.agrs_new_session():
  all_gather(x); wait()``) against NCCL's ``all_gather_into_tensor`` of the same bytes; GB/s = bytes
  received from the other ranks, (R - 1) x S, over the time of the call (CUDA events on the current
  stream, median). Checked bitwise against the NCCL result.
* ``pp``: a ring step, ``pp_send`` to the next rank and ``pp_recv`` from the previous one, against NCCL
  ``batch_isend_irecv`` of the same ring; GB/s = S over the time of the step. Checked bitwise.

S in 1, 4, 16, 64 MiB (``--quick``: 1 and 16 MiB). Every iteration starts aligned (the caller's aligner).
"""
from __future__ import annotations

import statistics
from typing import Callable, List

import torch
import torch.distributed as dist

SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [1 << 20, 16 << 20]


def _median_us(fn: Callable[[], None], iters: int, align: Callable[[], None]) -> float:
    out = []
    for _ in range(iters):
        align()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(stop) * 1000.0)
    return statistics.median(out)


def _result(op: str, backend: str, size: int, us: float, moved: int, same: bool) -> dict:
    return dict(op=op, backend=backend, bytes=size, us=us, gbps=moved / us / 1e3, bitwise_equal=same)


def bench_agrs_pp(ep, group, rank: int, world: int, ops: List[str], iters: int, quick: bool,
                  align: Callable[[], None]) -> List[dict]:
    """The cases of ``ops`` (``agrs``, ``pp``) on this rank; every rank calls it alike."""
    sizes = QUICK_SIZES if quick else SIZES
    top = max(sizes)
    align_2m = 2 << 20
    nbytes = -(-2 * world * top // align_2m) * align_2m  # PP's slots: R x 2 in flight x S
    buf = ep.ElasticBuffer(group, nbytes, backend="native", explicitly_destroy=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    out = []
    g = torch.Generator(device=dev).manual_seed(rank)
    if "agrs" in ops:
        buf.agrs_set_config(world * top, 1)
        for size in sizes:
            x = torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev, generator=g)
            ref = torch.empty(world * size, dtype=torch.uint8, device=dev)
            got = torch.empty_like(ref)

            def ours():
                with buf.agrs_new_session():
                    gathered, wait = buf.all_gather(x)
                    wait()
                    got.copy_(gathered.view(-1))

            def nccl():
                dist.all_gather_into_tensor(ref, x, group=group)

            ours()
            nccl()
            torch.cuda.synchronize()
            same = torch.equal(got, ref)
            moved = (world - 1) * size
            out.append(_result("all_gather", "native", size, _median_us(ours, iters, align), moved, same))
            out.append(_result("all_gather", "nccl", size, _median_us(nccl, iters, align), moved, True))
    if "pp" in ops:
        buf.pp_set_config(top, 2)
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        for size in sizes:
            x = torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev, generator=g)
            y, y_ref = torch.empty_like(x), torch.empty_like(x)

            def ours():
                buf.pp_send(x, nxt)
                buf.pp_recv(y, prv)

            def nccl():
                ops_ = [dist.P2POp(dist.isend, x, nxt, group=group), dist.P2POp(dist.irecv, y_ref, prv, group=group)]
                for w in dist.batch_isend_irecv(ops_):
                    w.wait()

            ours()
            nccl()
            torch.cuda.synchronize()
            same = torch.equal(y, y_ref)
            out.append(_result("pp_ring", "native", size, _median_us(ours, iters, align), size, same))
            out.append(_result("pp_ring", "nccl", size, _median_us(nccl, iters, align), size, True))
    buf.barrier(with_cpu_sync=True)
    buf.destroy()
    return out


def markdown(rows: List[dict]) -> str:
    """Rank 0's table: per op and size, ours against NCCL."""
    if not rows:
        return ""
    lines = ["", "| op | MiB | native µs | native GB/s | NCCL µs | NCCL GB/s | bitwise |", "|---|---:|---:|---:|---:|---:|---|"]
    key = {(r["op"], r["backend"], r["bytes"]): r for r in rows}
    for (op, backend, size), r in key.items():
        if backend != "native":
            continue
        n = key.get((op, "nccl", size), {})
        lines.append(f"| {op} | {size >> 20} | {r['us']:.1f} | {r['gbps']:.1f} | {n.get('us', float('nan')):.1f} | "
                     f"{n.get('gbps', float('nan')):.1f} | {'yes' if r['bitwise_equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"
