"""AGRS, PP and Engram cases of tools/bench_elastic_ep.py (``--ops agrs,pp,engram``; AGRS and PP need two
or more GPUs).

* ``agrs``: one all-gather of S bytes per rank inside a session (``with buf.agrs_new_session():
  all_gather(x); wait()``) against NCCL's ``all_gather_into_tensor`` of the same bytes; GB/s = bytes
  received from the other ranks, (R - 1) x S, over the time of the call (CUDA events on the current
  stream, median). Checked bitwise against the NCCL result.
* ``pp``: a ring step, ``pp_send`` to the next rank and ``pp_recv`` from the previous one, against NCCL
  ``batch_isend_irecv`` of the same ring; GB/s = S over the time of the step. Checked bitwise.

* ``engram``: ``engram_fetch`` of 512 tokens x 24 entries of hidden 7168 bf16 (172 MiB) from a table of
  4096 entries per rank, random indices over every rank's shard, against the path without it: the
  rows gathered on the host (``index_select`` of a pinned table into a pinned tensor) and copied to
  the GPU; and the pinned host-to-device copy of the same bytes, whose bandwidth is the ceiling
  (target: >= 80 % of it). GB/s = fetched bytes over the time; also million entries per second.

S in 1, 4, 16, 64 MiB (``--quick``: 1 and 16 MiB). ``timed_us(fn)`` is the caller's timer (bench_elastic_ep's:
the median over its iterations, each started aligned on every GPU).
"""
from __future__ import annotations

from typing import Callable, List

import torch
import torch.distributed as dist

SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [1 << 20, 16 << 20]


def _result(op: str, backend: str, size: int, us: float, moved: int, same: bool) -> dict:
    return dict(op=op, backend=backend, bytes=size, us=us, gbps=moved / us / 1e3, bitwise_equal=same)


def bench_engram(ep, group, rank: int, world: int, timed_us: Callable[[Callable[[], None]], float]) -> List[dict]:
    """The Engram case (see the module docstring) on this rank; every rank calls it alike."""
    T, E, H, N = 512, 24, 7168, 4096
    row = H * 2
    fetched = T * E * row
    mib2 = 2 << 20
    cpu_bytes = -(-N * row // mib2) * mib2
    buf = ep.ElasticBuffer(group, -(-fetched // mib2) * mib2, num_cpu_bytes=cpu_bytes, backend="native",
                           explicitly_destroy=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(rank)
    shard = torch.randn((N, H), generator=g).to(torch.bfloat16)
    buf.engram_write(shard.to(dev))
    idx_cpu = torch.randint(0, N * world, (T, E), generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    idx = idx_cpu.to(dev)
    # The path without elastic_ep: a pinned host table (this rank's shard in every rank's place: the cost
    # does not depend on the bytes) gathered on the host, then one copy to the GPU.
    table = shard.repeat(world, 1).pin_memory()
    staged = torch.empty((T * E, H), dtype=torch.bfloat16).pin_memory()
    out = torch.empty((T * E, H), dtype=torch.bfloat16, device=dev)
    flat = idx_cpu.view(-1).long()

    def ours():
        buf.engram_fetch(idx)()

    def host_gather():
        torch.index_select(table, 0, flat, out=staged)
        out.copy_(staged, non_blocking=True)

    def pinned_copy():
        out.copy_(staged, non_blocking=True)

    data, _ = buf.engram_fetch(idx)()
    torch.cuda.synchronize()
    same = torch.equal(data[:, :H].cpu(), shard[idx_cpu[:, 0].long() % N]) if world == 1 else True
    res = []
    for backend, fn in (("native", ours), ("host_gather_h2d", host_gather), ("pinned_h2d", pinned_copy)):
        fn()
        torch.cuda.synchronize()
        us = timed_us(fn)
        r = _result("engram_fetch", backend, fetched, us, fetched, same if backend == "native" else True)
        r["mentries_per_s"] = T * E / us
        res.append(r)
    buf.barrier(with_cpu_sync=True)
    buf.destroy()
    return res


def bench_agrs_pp(ep, group, rank: int, world: int, ops: List[str], quick: bool,
                  timed_us: Callable[[Callable[[], None]], float]) -> List[dict]:
    """The cases of ``ops`` (``agrs``, ``pp``, ``engram``) on this rank; every rank calls it alike."""
    out = bench_engram(ep, group, rank, world, timed_us) if "engram" in ops else []
    ops = [o for o in ops if o in ("agrs", "pp")] if world >= 2 else []
    if not ops:
        return out
    sizes = QUICK_SIZES if quick else SIZES
    top = max(sizes)
    align_2m = 2 << 20
    nbytes = -(-2 * world * top // align_2m) * align_2m  # PP's slots: R x 2 in flight x S
    buf = ep.ElasticBuffer(group, nbytes, backend="native", explicitly_destroy=True)
    dev = torch.device("cuda", torch.cuda.current_device())
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
            out.append(_result("all_gather", "native", size, timed_us(ours), moved, same))
            out.append(_result("all_gather", "nccl", size, timed_us(nccl), moved, True))
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
            out.append(_result("pp_ring", "native", size, timed_us(ours), size, same))
            out.append(_result("pp_ring", "nccl", size, timed_us(nccl), size, True))
    buf.barrier(with_cpu_sync=True)
    buf.destroy()
    return out


def markdown(rows: List[dict]) -> str:
    """Rank 0's tables: per op and size, ours against NCCL; Engram against the host path and the pinned copy."""
    if not rows:
        return ""
    lines = ["", "| op | MiB | native µs | native GB/s | NCCL µs | NCCL GB/s | bitwise |", "|---|---:|---:|---:|---:|---:|---|"]
    key = {(r["op"], r["backend"], r["bytes"]): r for r in rows}
    eng = [r for r in rows if r["op"] == "engram_fetch"]
    if eng:
        peak = max((r["gbps"] for r in eng if r["backend"] == "pinned_h2d"), default=float("nan"))
        lines = ["", "| Engram fetch (512 x 24 x 7168 bf16) | µs | GB/s | M entries/s | of the pinned copy |",
                 "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['backend']} | {r['us']:.1f} | {r['gbps']:.1f} | {r['mentries_per_s']:.2f} | "
                  f"{100 * r['gbps'] / peak:.0f} % |" for r in eng]
        if len(key) > len(eng):
            lines += ["", "| op | MiB | native µs | native GB/s | NCCL µs | NCCL GB/s | bitwise |", "|---|---:|---:|---:|---:|---:|---|"]
    for (op, backend, size), r in key.items():
        if backend != "native" or op == "engram_fetch":
            continue
        n = key.get((op, "nccl", size), {})
        lines.append(f"| {op} | {size >> 20} | {r['us']:.1f} | {r['gbps']:.1f} | {n.get('us', float('nan')):.1f} | "
                     f"{n.get('gbps', float('nan')):.1f} | {'yes' if r['bitwise_equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"
