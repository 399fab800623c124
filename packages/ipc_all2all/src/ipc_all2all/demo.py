"""A short correctness demo of ipc_all2all: Ulysses' two exchanges, bitwise against plain torch.

    python -m ipc_all2all.demo [--world 2] [--tokens 2048] [--heads 16] [--head-dim 128] [--cpu]

It spawns ``--world`` processes (default 2; on one GPU they share it). Each holds ``tokens / world``
tokens of a sequence and every head, ``x [1, n, H, D]`` bf16, and calls ``send_recv_heads(x)``
(``[1, tokens, H / world, D]``: every token, this rank's heads) and ``gather_heads`` of the result
(back to ``x``), on an ``All2All`` built with LTX's constructor. Both outputs are compared bit for bit
with the plain-torch exchange permute -> ``all_to_all_single`` -> permute
(``ipc_all2all._ulysses.TorchComm``, through host memory over gloo when the ranks share a GPU). One
line per rank, then ``demo OK`` (exit status 0), or what differs (exit status 1, with the failing
rank's traceback).

Without a GPU (or with ``--cpu``) ipc_all2all cannot run: the demo says so and checks what the CPU
can, over gloo: the plain-torch exchange against the same exchange by all-gathers and slicing, and
the output shape of the ``torch.ops.ipc_all2all.send_recv_heads`` op (its fake implementation).

The Ulysses attention layer with timings against the NCCL path is in the repository's tools:
``tools/block_ipc_all2all.py``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from typing import Optional, Sequence

import torch


def init_rank(rank: int, world: int, rdzv: str, cpu: bool):
    """This rank's device and process group: NCCL with one rank per GPU, else gloo (on the CPU, or
    when ranks share a GPU: NCCL refuses two ranks on one device).

    Returns:
        ``(device, shared)``: ``shared`` is True when this rank shares its GPU with another rank.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=300)
    if cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", init_method=rdzv, rank=rank, world_size=world, timeout=timeout)
        return torch.device("cpu"), False
    n = torch.cuda.device_count()
    dev = torch.device("cuda", rank % n)
    torch.cuda.set_device(dev)
    if world <= n:
        dist.init_process_group("nccl", init_method=rdzv, rank=rank, world_size=world, timeout=timeout, device_id=dev)
        return dev, False
    dist.init_process_group("gloo", init_method=rdzv, rank=rank, world_size=world, timeout=timeout)
    return dev, True


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _input(rank: int, n: int, heads: int, head_dim: int, dtype, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(1, n, heads, head_dim, generator=g).to(dtype=dtype, device=device)


def _gpu_rank(rank: int, world: int, counts, heads: int, head_dim: int, rdzv: str) -> str:
    import torch.distributed as dist

    import ipc_all2all
    from ipc_all2all._ulysses import TorchComm

    dev, shared = init_rank(rank, world, rdzv, cpu=False)
    x = _input(rank, counts[rank], heads, head_dim, torch.bfloat16, dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    a2a = ipc_all2all.All2All(rank, world, max(counts), heads * head_dim, sms, torch.bfloat16, group=dist.group.WORLD)
    try:
        a2a.set_rank_tokens(list(counts))
        ref = TorchComm(rank, world, via_host=shared)
        ref.set_counts(counts)
        y = a2a.send_recv_heads(x, copy_out=True)
        y_ref = ref.send(x)
        back = a2a.gather_heads(y, copy_out=True)
        ok = [_same(y, y_ref), _same(back, ref.gather(y_ref)), _same(back, x)]
    finally:
        a2a.destroy()
    if not all(ok):
        raise RuntimeError(f"rank {rank}: send_recv_heads equal {ok[0]}, gather_heads equal {ok[1]}, round trip "
                           f"equal to the input {ok[2]} (expected all True)")
    return (f"rank {rank}: send_recv_heads {list(x.shape)} -> {list(y.shape)} and gather_heads back: bitwise "
            f"equal to permute + all_to_all_single + permute{' (over gloo, ranks share a GPU)' if shared else ''}")


def _cpu_rank(rank: int, world: int, counts, heads: int, head_dim: int, rdzv: str) -> str:
    import ipc_all2all  # noqa: F401  (registers torch.ops.ipc_all2all)
    from ipc_all2all._ulysses import GatherComm, TorchComm

    init_rank(rank, world, rdzv, cpu=True)
    x = _input(rank, counts[rank], heads, head_dim, torch.bfloat16, "cpu")
    a2a, other = TorchComm(rank, world), GatherComm(rank, world)
    a2a.set_counts(counts)
    other.set_counts(counts)
    y = a2a.send(x)
    ok = [_same(y, other.send(x)), _same(a2a.gather(y), x)]
    fake = torch.ops.ipc_all2all.send_recv_heads(torch.empty(x.shape, device="meta"), torch.empty(1, device="meta"),
                                                 0, sum(counts), world)
    ok.append(list(fake.shape) == list(y.shape))
    if not all(ok):
        raise RuntimeError(f"rank {rank}: all_to_all exchange equal to the all-gather one {ok[0]}, round trip equal "
                           f"{ok[1]}, op shape {list(fake.shape)} vs {list(y.shape)}")
    return (f"rank {rank}: permute + all_to_all_single + permute {list(x.shape)} -> {list(y.shape)} bitwise equal to "
            "the all-gather exchange, round trip exact, the op's shape the same")


def _rank(rank: int, world: int, counts, heads: int, head_dim: int, cpu: bool, tmp: str) -> None:
    import torch.distributed as dist

    fn = _cpu_rank if cpu else _gpu_rank
    line = fn(rank, world, counts, heads, head_dim, "file://" + os.path.join(tmp, "rdzv"))
    print(f"  {line}\n", end="", flush=True)  # one write: the ranks print at once, lines must not interleave
    # Every rank done, then the group torn down before the process exits: a gloo group left to the
    # interpreter's exit can abort it ("terminate called without an active exception") while a peer's
    # last message is still in flight.
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse, check, run the ranks; 0 when every output matched (2: bad usage; a failed rank raises, with
    its traceback)."""
    p = argparse.ArgumentParser(prog="python -m ipc_all2all.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks (processes), 2..8")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the whole sequence")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--cpu", action="store_true", help="the CPU check even where a GPU is visible")
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    import ipc_all2all
    from ipc_all2all._ulysses import split_tokens

    if not 2 <= args.world <= ipc_all2all.MAX_WORLD_SIZE:
        p.error(f"--world must be 2..{ipc_all2all.MAX_WORLD_SIZE}, got {args.world}")
    if args.heads < 1 or args.heads % args.world:
        p.error(f"--heads ({args.heads}) must be a positive multiple of the world size ({args.world})")
    if args.head_dim < 1 or args.tokens < args.world:
        p.error(f"--head-dim must be >= 1 and --tokens >= --world, got {args.head_dim} and {args.tokens}")
    why = "--cpu" if args.cpu else "" if torch.cuda.is_available() and torch.cuda.device_count() else "no CUDA device"
    if not why and not ipc_all2all.built_with_cuda():
        why = "ipc_all2all was built without its CUDA kernels"
    counts = split_tokens(args.tokens, args.world)
    print(f"ipc_all2all demo: W = {args.world}, {args.tokens} tokens ({'/'.join(map(str, counts))} per rank), "
          f"{args.heads} heads x {args.head_dim}, bf16")
    if why:
        print(f"  no GPU run here ({why}): ipc_all2all needs CUDA GPUs with peer access (or ranks sharing one); "
              "on the CPU, over gloo: the plain-torch exchange against an all-gather exchange, and the op's shape")
    with tempfile.TemporaryDirectory(prefix="ipc_all2all_demo_") as tmp:
        # A failing rank raises here (ProcessRaisedException, with its traceback: exit status 1).
        mp.spawn(_rank, args=(args.world, counts, args.heads, args.head_dim, bool(why), tmp), nprocs=args.world)
    print("demo OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
