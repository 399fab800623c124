"""``python -m ipc_all2all.demo`` on the CPU: the short correctness demo says that ipc_all2all needs
GPUs and checks what the CPU can (the plain-torch exchange against an all-gather exchange, round
trip, the op's shape); its refusals. The Ulysses attention layer with timings is
tools/block_ipc_all2all.py (test_block_cpu.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _demo(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "ipc_all2all.demo", *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=timeout)


def test_without_a_gpu_it_says_so_and_checks_the_exchange():
    r = _demo(env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "ipc_all2all demo: W = 2, 2048 tokens (1024/1024 per rank), 16 heads x 128, bf16", lines
    assert "no GPU run here (no CUDA device)" in lines[1]
    for rank in (0, 1):
        assert any(line.startswith(f"  rank {rank}: permute + all_to_all_single + permute [1, 1024, 16, 128] -> "
                                   "[1, 2048, 8, 128] bitwise equal") for line in lines), lines
    assert lines[-1] == "demo OK" and len(lines) == 5, lines


def test_three_ranks_uneven_tokens():
    r = _demo("--cpu", "--world", "3", "--heads", "12", "--head-dim", "32", "--tokens", "301")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(101/100/100 per rank)" in r.stdout and "(--cpu)" in r.stdout
    assert r.stdout.count("bitwise equal to the all-gather exchange, round trip exact") == 3, r.stdout


@pytest.mark.parametrize("args,match", [
    (["--world", "3"], "--heads (16) must be a positive multiple of the world size (3)"),
    (["--world", "9"], "--world must be 2..8"),
    (["--tokens", "1"], "--tokens >= --world"),
])
def test_bad_arguments(args, match):
    r = _demo("--cpu", *args)
    assert r.returncode == 2 and match in r.stderr, r.stderr
