"""The Ulysses attention layer on GPUs (``python tools/block_ipc_all2all.py``, ipc_all2all's model
block), small shapes: ipc_all2all's layer output must be bitwise the NCCL path's (permute ->
all_to_all_single -> permute), and the fp8 wire's bitwise the NCCL path's with the e4m3 round trip
applied in torch; the report must carry every figure. With one GPU (COMMKIT_TEST_SHARE_GPU=1) the two
ranks share it and the baseline goes over gloo: correctness only. Speed is reported, not asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ipc_all2all
from tests._tools import ROOT

pytestmark = [pytest.mark.multigpu(2, shared_ok=True),
              pytest.mark.skipif(not ipc_all2all.built_with_cuda(), reason="built without CUDA")]


def _run(args, tmp_path, timeout=300):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "block_ipc_all2all.py"), "--world", "2", *args,
                        "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))
    print(r.stdout)  # the table, in the test's log
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert "all checks passed (ipc_all2all's layer output is bitwise the NCCL path's)" in r.stdout, r.stdout
    return json.loads((tmp_path / "block_ipc_all2all.json").read_text())


def _check(data, tokens, counts):
    shared = torch.cuda.device_count() < 2
    assert data["mode"] == ("shared" if shared else "gpu") and data["meta"]["world"] == 2, data["meta"]
    assert not data["failures"]
    assert [r["tokens"] for r in data["rows"]] == tokens
    for row, want in zip(data["rows"], counts):
        assert row["counts"] == want
        assert row["bitwise"] is True and row["fp8_bitwise"] is True, row
        # lossy: e4m3 keeps 3 mantissa bits, ~5 % of the output's range at these shapes (measured in
        # bf16 on the CPU with the same round trip)
        assert 0 < row["fp8_rel_err"] < 0.2, row
        for path in ("nccl", "ipc", "ipc_fp8"):
            assert row[path]["layer_ms"] > 0 and 0 < row[path]["comm_share"] < 1, (path, row[path])
        assert row["speedup"] > 0 and row["speedup_fp8"] > 0


@pytest.mark.smoke
def test_block_layer_bitwise_small(tmp_path):
    """32 heads x 128, bf16, 2k and 4k tokens, even shards."""
    data = _run(["--tokens", "2k,4k", "--warmup", "1", "--iters", "3"], tmp_path)
    _check(data, [2048, 4096], [[1024, 1024], [2048, 2048]])
    assert (tmp_path / "block_ipc_all2all.md").read_text().count("| yes |") >= 2


def test_block_layer_bitwise_uneven_batched(tmp_path):
    """Batch 2 and uneven shards (1/3 and 2/3 of the tokens): the baseline's permutes for batch > 1 and
    ipc_all2all's uneven counts, 16 heads x 64."""
    data = _run(["--tokens", "1000,3000", "--uneven", "--batch", "2", "--heads", "16", "--head-dim", "64",
                 "--warmup", "1", "--iters", "2"], tmp_path)
    _check(data, [1000, 3000], [[334, 666], [1000, 2000]])
