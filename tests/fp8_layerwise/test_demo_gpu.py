"""``python -m fp8_layerwise.demo`` on GPUs: the CUDA backend delivers every rank's shards into its GPU
layer buffers, byte for byte equal to plain-torch slices of the sources. The prefill loop and the
throughput runs are tools/block_fp8_layerwise.py (test_block_gpu.py)."""
import subprocess
import sys

import pytest

import fp8_layerwise as F

pytestmark = pytest.mark.skipif(not F.built_with_cuda(), reason="built without CUDA")


@pytest.mark.smoke
@pytest.mark.multigpu(2, shared_ok=True)  # no NCCL between the ranks: they may share a GPU
def test_demo_cuda_backend_two_ranks():
    out = subprocess.run([sys.executable, "-m", "fp8_layerwise.demo", "--backend", "cuda", "--layers", "3"],
                         capture_output=True, text=True, timeout=300)
    print(out.stdout)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert sum("(cuda backend): 3 layers x 4 experts" in line and "every byte equal" in line
               for line in out.stdout.splitlines()) == 2, out.stdout
    assert out.stdout.rstrip().endswith("demo OK")
