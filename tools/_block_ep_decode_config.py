"""The decode block's configuration (tools/_block_ep_decode.py runs it): ``DecodeConfig`` (what every
rank receives), its defaults on GPUs and on the CPU, the split of a step's tokens into two micro-batches,
and the command line (``parser``, ``build_config``).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _block_ep_decode_report import NAME  # noqa: E402
from _block_ep_moe_layer import MoEConfig  # noqa: E402

_DESCRIPTION = ("Decode mode of elastic_ep's model block: the DeepSeek-V3 MoE layer at decode batch sizes through "
                "DeepEP V1's low-latency API, against V2's API and a torch reference.")

FORMATS = ("bf16", "fp8")
GPU_DEFAULTS = dict(tokens="1,32,128", experts=256, hidden=7168, intermediate=2048, iters=20, warmup=3)
CPU_DEFAULTS = dict(tokens="1,8,32", experts=32, hidden=256, intermediate=128, iters=3, warmup=1, world=2)
QUICK = dict(cuda=dict(iters=5, warmup=2), cpu=dict(iters=1, warmup=1))
CPU_MAX_WEIGHT_BYTES = 8 << 30

CPU_EXPLANATION = """\
No usable CUDA GPU: running the decode block's CPU fallback. On GPUs it runs a DeepSeek-V3 MoE layer at
decode sizes (1, 32, 128 tokens per rank, hidden 7168, top-8 of 256 experts), one rank per GPU: two
micro-batches overlapped through the receive hooks of elastic_ep's native low-latency dispatch/combine,
grouped expert GEMMs on the packed layout, eager and as a CUDA graph, against the same layer through V2's
ElasticBuffer and the low-latency API's torch backend, all checked bit for bit against a reference built
from every rank's inputs. Here: the same steps, small, on the torch backends over gloo on CPU processes;
the times are CPU times, not a benchmark."""


# ------------------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class DecodeConfig:
    """One run of the decode block (what every rank receives)."""

    moe: MoEConfig
    world: int
    tokens: Tuple[int, ...]
    device: str  # "cuda" or "cpu"
    iters: int
    warmup: int
    formats: Tuple[str, ...] = FORMATS
    gemm: str = "auto"
    graph: bool = True
    row_check: bool = True
    timeout_s: float = 900.0
    #: Tests only: return every output (as int16 numpy arrays) with the figures.
    return_outputs: bool = False

    def validate(self) -> None:
        """ValueError naming the first argument that does not fit, before anything starts."""
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"world: expected a positive int, got {self.world!r}")
        self.moe.validate(self.world)
        if not self.tokens or any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in self.tokens):
            raise ValueError(f"tokens: expected positive ints, got {self.tokens!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device: expected 'cuda' or 'cpu', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was asked for, but torch sees no CUDA device")
        if self.device == "cuda" and self.world > torch.cuda.device_count():
            raise ValueError(f"world: decode mode runs one rank per GPU, {self.world} ranks asked for, "
                             f"{torch.cuda.device_count()} GPU(s) seen")
        if not isinstance(self.iters, int) or self.iters < 1:
            raise ValueError(f"iters: expected a positive int, got {self.iters!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup: expected an int >= 0, got {self.warmup!r}")
        if not self.formats or any(f not in FORMATS for f in self.formats) or \
                len(set(self.formats)) != len(self.formats):
            raise ValueError(f"dispatch: expected distinct formats from {FORMATS}, got {self.formats!r}")
        if self.gemm not in ("auto", "grouped", "loop"):
            raise ValueError(f"gemm: expected 'auto', 'grouped' or 'loop', got {self.gemm!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout: expected > 0 seconds, got {self.timeout_s!r}")
        from elastic_ep import _C

        m = self.moe
        if m.num_experts // self.world > int(_C.MAX_LOCAL_EXPERTS):
            raise ValueError(f"experts: the low-latency kernels hold at most {int(_C.MAX_LOCAL_EXPERTS)} experts per "
                             f"rank, {m.num_experts} experts on {self.world} rank(s) asked for")
        if self.max_micro_batch > int(_C.LL_MAX_TOKENS):
            raise ValueError(f"tokens: a micro-batch holds at most {int(_C.LL_MAX_TOKENS)} tokens "
                             f"(num_max_dispatch_tokens_per_rank), {max(self.tokens)} tokens make one of "
                             f"{self.max_micro_batch}")
        weight_bytes = m.num_experts * 3 * m.hidden * m.intermediate * 2
        if self.device == "cpu" and weight_bytes > CPU_MAX_WEIGHT_BYTES:
            raise ValueError(f"experts/hidden/intermediate: on the CPU the experts' weights "
                             f"({weight_bytes / 2**30:.1f} GiB) must stay under {CPU_MAX_WEIGHT_BYTES >> 30} GiB; "
                             "use smaller shapes")

    @property
    def max_micro_batch(self) -> int:
        """``M``, every low-latency call's ``num_max_dispatch_tokens_per_rank`` (as a framework fixes it)."""
        return max(micro_batches(t)[0] for t in self.tokens)

    @property
    def capacity(self) -> int:
        """``C``: the most rows a rank can receive in one call (every token of every rank sends each of
        its ``min(K, L)`` possible lanes here), the compact buffer's fixed row count."""
        L = self.moe.num_experts // self.world
        return self.world * self.max_micro_batch * min(self.moe.num_topk, L)


def micro_batches(T: int) -> List[int]:
    """The two micro-batches of a step of ``T`` tokens (the first takes the odd one)."""
    return [T - T // 2, T // 2]


def _parse_list(name: str, text: str, conv: Callable[[str], Any]) -> Tuple[Any, ...]:
    try:
        return tuple(conv(t.strip()) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"{name}: expected a comma-separated list, got {text!r}") from None


def build_config(args: argparse.Namespace) -> DecodeConfig:
    """The run ``args`` asks for, with the defaults of the device it runs on; ValueError on bad input."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    defaults = dict(GPU_DEFAULTS, world=max(torch.cuda.device_count(), 1)) if device == "cuda" else dict(CPU_DEFAULTS)
    if args.quick:
        defaults.update(QUICK[device])

    def pick(name: str):
        v = getattr(args, name)
        return defaults[name] if v is None else v

    moe = MoEConfig(hidden=pick("hidden"), intermediate=pick("intermediate"), num_experts=pick("experts"),
                    seed=args.seed)
    cfg = DecodeConfig(moe=moe, world=pick("world"), tokens=_parse_list("tokens", str(pick("tokens")), int),
                       device=device, iters=pick("iters"), warmup=pick("warmup"),
                       formats=_parse_list("dispatch", args.dispatch, str), gemm=args.gemm,
                       graph=not args.no_graph, row_check=not args.quick, timeout_s=args.timeout)
    cfg.validate()
    return cfg


# ------------------------------------------------------------------------------------------ command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/block_elastic_ep.py --mode decode",
                                description=_DESCRIPTION)
    p.add_argument("--mode", default="decode", choices=("decode",), help=argparse.SUPPRESS)
    p.add_argument("--tokens", default=None,
                   help="tokens per rank per step, comma-separated (GPU 1,32,128; CPU 1,8,32)")
    p.add_argument("--dispatch", default=",".join(FORMATS), help="dispatch formats, from bf16,fp8 (default both)")
    p.add_argument("--experts", type=int, default=None, help="routed experts (GPU 256, CPU 32)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size, a multiple of 128 (GPU 7168, CPU 256)")
    p.add_argument("--intermediate", type=int, default=None, help="MoE intermediate size (GPU 2048, CPU 128)")
    p.add_argument("--iters", type=int, default=None, help="measured steps (GPU 20, CPU 3; --quick 5 / 1)")
    p.add_argument("--warmup", type=int, default=None, help="steps before measuring (GPU 3, CPU 1; --quick 2 / 1)")
    p.add_argument("--world", type=int, default=None, help="ranks (GPU: one per GPU; CPU 2)")
    p.add_argument("--quick", action="store_true", help="fewer steps, no row-invariance report")
    p.add_argument("--gemm", default="auto", choices=("auto", "grouped", "loop"),
                   help="expert GEMMs: torch._grouped_mm, a matmul per expert, or auto (grouped where it runs)")
    p.add_argument("--no-graph", action="store_true", help="no CUDA-graph replay")
    p.add_argument("--out", default=None, help=f"also write {NAME}.{{md,json,png}} into this folder")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="auto: cuda when torch sees a GPU")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights and tokens")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    return p
