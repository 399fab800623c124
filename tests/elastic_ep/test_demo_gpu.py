"""``python -m elastic_ep.demo`` on GPUs: one dispatch and one combine of the native backend, every output
bitwise equal to the plain-torch computation from the same seeds; two ranks over NCCL, or with
``COMMKIT_TEST_SHARE_GPU=1`` sharing one GPU through the CUDA-IPC window. The MoE layer with timings is
tools/block_elastic_ep.py (test_block_gpu.py)."""
import subprocess
import sys

import pytest
import torch

import elastic_ep

pytestmark = pytest.mark.skipif(not elastic_ep.native_available(), reason="built without the CUDA kernels")


def _demo(*args):
    p = subprocess.run([sys.executable, "-m", "elastic_ep.demo", "--device", "cuda", *args], capture_output=True,
                       text=True, timeout=300)
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert p.stdout.rstrip().endswith("demo OK")
    return p.stdout


@pytest.mark.smoke
@pytest.mark.gpu
def test_demo_native_ep1():
    out = _demo("--world", "1", "--tokens", "128", "--hidden", "7168", "--experts", "256", "--topk", "8")
    assert "rank 0 (native backend on cuda:0): dispatch received 128 rows" in out


@pytest.mark.multigpu(2, shared_ok=True)
def test_demo_native_ep2():
    out = _demo()
    assert out.count("(native backend on cuda:") == 2 and out.count("every output bitwise equal") == 2
    assert ("CUDA-IPC window" in out) == (torch.cuda.device_count() < 2)
