"""A short correctness demo of elastic_ep: one dispatch and one combine, bitwise against plain torch.

    python -m elastic_ep.demo [--world 2] [--tokens 64] [--hidden 512] [--experts 16] [--topk 4]
                              [--device auto|cuda|cpu]

It spawns ``--world`` processes (torch.multiprocessing). Every rank draws its tokens ``x [T, H]``
(bf16) and a top-k routing from a seed, builds an ``ElasticBuffer`` (``deterministic=True``) and
calls ``dispatch`` then ``combine`` of the received rows as they are (an identity expert). From the
same seeds every rank also computes, in plain torch, what it must receive: from each source rank in
turn, that rank's tokens with an expert here, in token order, their top-k ids as local expert ids
(-1 elsewhere) and their weights (0 elsewhere); and what combine must return: each token summed
once per rank it went to, ``bf16(x * n)``. Every output is compared bit for bit; one line per rank,
then ``demo OK`` (exit status 0), or what differs (exit status 1, with the failing rank's traceback).

On GPUs the buffer is the native backend (one GPU per rank over NCCL; ranks sharing a GPU use the
CUDA-IPC window over gloo); without a GPU, the torch backend over gloo.

The DeepSeek-V3 MoE layer with timings and micro-batch overlap is in the repository's tools:
``tools/block_elastic_ep.py``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from typing import Optional, Sequence

import torch


def init_rank(rank: int, world: int, rdzv: str, device: str):
    """This rank's device and process group: NCCL with one GPU per rank, gloo on the CPU or when ranks
    share GPUs (NCCL refuses two ranks on one device).

    Returns:
        ``(device, shares_gpus)``.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=300)
    if device == "cpu":
        # The ranks share the machine's cores; more threads than cores would only contend.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", init_method=rdzv, rank=rank, world_size=world, timeout=timeout)
        return torch.device("cpu"), False
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    if world > torch.cuda.device_count():
        dist.init_process_group("gloo", init_method=rdzv, rank=rank, world_size=world, timeout=timeout)
        return dev, True
    dist.init_process_group("nccl", init_method=rdzv, rank=rank, world_size=world, timeout=timeout, device_id=dev)
    return dev, False


def _inputs(rank: int, cfg: dict):
    """Rank ``rank``'s tokens, routing and weights, on the CPU (every rank can rebuild every rank's)."""
    g = torch.Generator().manual_seed(7919 * (rank + 1))
    x = torch.randn((cfg["tokens"], cfg["hidden"]), generator=g).to(torch.bfloat16)
    idx = torch.rand((cfg["tokens"], cfg["experts"]), generator=g).topk(cfg["topk"], dim=1).indices
    return x, idx.to(torch.int64), torch.rand((cfg["tokens"], cfg["topk"]), generator=g)


def reference(rank: int, world: int, cfg: dict):
    """What rank ``rank`` receives and what combine returns to it, in plain torch (see the module docstring):
    ``(recv_x, recv_topk_idx, recv_topk_weights, combined_x)`` on the CPU."""
    per_rank = cfg["experts"] // world
    xs, ids, ws = [], [], []
    for src in range(world):
        x, idx, w = _inputs(src, cfg)
        local = idx // per_rank == rank
        rows = local.any(dim=1)  # token order: the buffer is deterministic
        xs.append(x[rows])
        ids.append(torch.where(local, idx - rank * per_rank, torch.full_like(idx, -1))[rows])
        ws.append(torch.where(local, w, torch.zeros_like(w))[rows])
    x, idx, _ = _inputs(rank, cfg)
    destinations = torch.stack([(idx // per_rank == r).any(dim=1) for r in range(world)]).sum(dim=0)
    combined = (x.float() * destinations.unsqueeze(1)).to(torch.bfloat16)
    return torch.cat(xs), torch.cat(ids), torch.cat(ws), combined


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().contiguous(), b.contiguous()
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def _rank(rank: int, world: int, cfg: dict, tmp: str) -> None:
    import torch.distributed as dist

    import elastic_ep

    dev, shared = init_rank(rank, world, "file://" + os.path.join(tmp, "rdzv"), cfg["device"])
    native = dev.type == "cuda" and elastic_ep.native_available()
    kw = dict(backend="native", window="ipc" if shared else "auto") if native else dict(backend="torch")
    buf = elastic_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=cfg["tokens"], hidden=cfg["hidden"],
                                   num_topk=cfg["topk"], deterministic=True, explicitly_destroy=True, **kw)
    try:
        x, idx, w = (t.to(buf.device) for t in _inputs(rank, cfg))
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                           num_experts=cfg["experts"])
        combined, _, _ = buf.combine(recv_x, handle)
        got = (recv_x, recv_idx, recv_w, combined)
        where = f"{buf.backend} backend on {buf.device}" + (", CUDA-IPC window" if shared and native else "")
    finally:
        buf.destroy()
    names = ("recv_x", "recv_topk_idx", "recv_topk_weights", "combined_x")
    wrong = [n for n, a, b in zip(names, got, reference(rank, world, cfg)) if not _same(a, b)]
    if wrong:
        raise RuntimeError(f"rank {rank} ({where}): {', '.join(wrong)} differ from the plain-torch reference")
    # One write per line: the ranks print at once, and a separate newline could interleave.
    print(f"  rank {rank} ({where}): dispatch received {recv_x.shape[0]} rows, combine returned "
          f"{combined.shape[0]}: every output bitwise equal to the plain-torch reference\n", end="", flush=True)
    # The group torn down before the process exits: a gloo group left to the interpreter's exit can abort
    # it ("terminate called without an active exception") while a peer's last message is in flight.
    dist.destroy_process_group()


#: The integer options: (name, default, help); each must be >= 1.
_INT_OPTIONS = (("world", 2, "ranks (processes)"), ("tokens", 64, "tokens per rank"),
                ("hidden", 512, "hidden size, a multiple of 8"), ("experts", 16, "experts, a multiple of --world"),
                ("topk", 4, "experts per token"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse, check, run the ranks; 0 when every output matched (2: bad usage; a failed rank raises, with
    its traceback)."""
    p = argparse.ArgumentParser(prog="python -m elastic_ep.demo", description=__doc__.split("\n\n")[0])
    for name, default, what in _INT_OPTIONS:
        p.add_argument(f"--{name}", type=int, default=default, help=what)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="auto: cuda when torch sees a GPU")
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    for name, _, _ in _INT_OPTIONS:
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.experts % args.world or args.topk > args.experts or args.hidden % 8:
        p.error(f"--experts ({args.experts}) must be a multiple of --world ({args.world}) and >= --topk "
                f"({args.topk}), --hidden ({args.hidden}) a multiple of 8")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    cfg = dict(vars(args), device=device)
    print(f"elastic_ep demo: {args.world} ranks on {device}, {args.tokens} tokens per rank, hidden {args.hidden}, "
          f"top-{args.topk} of {args.experts} experts, bf16")
    with tempfile.TemporaryDirectory(prefix="elastic_ep_demo_") as tmp:
        # A failing rank raises here (ProcessRaisedException, with its traceback: exit status 1).
        mp.spawn(_rank, args=(args.world, cfg, tmp), nprocs=args.world)
    print("demo OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
