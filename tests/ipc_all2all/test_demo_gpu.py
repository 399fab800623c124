"""``python -m ipc_all2all.demo`` on GPUs: ``send_recv_heads`` and ``gather_heads`` of two ranks bitwise
equal to permute -> all_to_all_single -> permute (with one GPU, COMMKIT_TEST_SHARE_GPU=1: the two ranks
share it and the reference goes over gloo). The attention layer with timings is
tools/block_ipc_all2all.py (test_block_gpu.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest

import ipc_all2all

pytestmark = [pytest.mark.multigpu(2, shared_ok=True),
              pytest.mark.skipif(not ipc_all2all.built_with_cuda(), reason="built without CUDA")]


@pytest.mark.smoke
@pytest.mark.parametrize("args", [[], ["--tokens", "1001", "--heads", "8", "--head-dim", "64"]])
def test_demo_exchanges_bitwise(args):
    r = subprocess.run([sys.executable, "-m", "ipc_all2all.demo", *args], capture_output=True, text=True, timeout=300)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert r.stdout.count("and gather_heads back: bitwise equal to permute + all_to_all_single + permute") == 2
    assert "no GPU run here" not in r.stdout and r.stdout.rstrip().endswith("demo OK")
