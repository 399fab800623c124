"""``python -m elastic_ep.demo`` on the CPU: the short correctness demo (one dispatch and one combine on
the torch backend over gloo, every output bitwise equal to a plain-torch computation from the same
seeds), its reference against a hand-made case, and its refusals. The DeepSeek-V3 MoE layer with
timings is tools/block_elastic_ep.py (test_block_cpu.py)."""
import subprocess
import sys

import pytest
import torch

from elastic_ep import demo


def _demo(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "elastic_ep.demo", "--device", "cpu", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_demo_two_ranks():
    p = _demo()
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "elastic_ep demo: 2 ranks on cpu, 64 tokens per rank, hidden 512, top-4 of 16 experts, bf16"
    for rank in (0, 1):
        assert any(line.startswith(f"  rank {rank} (torch backend on cpu): dispatch received ") and
                   line.endswith("every output bitwise equal to the plain-torch reference") for line in lines), lines
    assert lines[-1] == "demo OK" and len(lines) == 4, lines


def test_demo_three_ranks_top8():
    p = _demo("--world", "3", "--experts", "24", "--topk", "8", "--tokens", "33", "--hidden", "256")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("every output bitwise equal to the plain-torch reference") == 3


def test_reference_by_hand():
    # 2 ranks, 4 experts (2 per rank), top-2: the reference's rows, local ids, weights and combine sums
    # against the definition, token by token.
    cfg = dict(tokens=5, hidden=8, experts=4, topk=2)
    for rank in range(2):
        recv_x, recv_idx, recv_w, combined = demo.reference(rank, 2, cfg)
        rows, ids, ws = [], [], []
        for src in range(2):
            x, idx, w = demo._inputs(src, cfg)
            for t in range(5):
                mine = [k for k in range(2) if int(idx[t, k]) // 2 == rank]
                if mine:
                    rows.append(x[t])
                    ids.append([int(idx[t, k]) - 2 * rank if k in mine else -1 for k in range(2)])
                    ws.append([float(w[t, k]) if k in mine else 0.0 for k in range(2)])
        assert torch.equal(recv_x, torch.stack(rows)) and recv_idx.tolist() == ids and recv_w.tolist() == ws
        x, idx, _ = demo._inputs(rank, cfg)
        n = torch.tensor([len({int(e) // 2 for e in row}) for row in idx])
        assert torch.equal(combined, (x.float() * n.unsqueeze(1)).to(torch.bfloat16))


@pytest.mark.parametrize("args,match", [
    (["--experts", "15"], "--experts (15) must be a multiple of --world (2)"),
    (["--topk", "20"], "and >= --topk (20)"),
    (["--hidden", "100"], "--hidden (100) a multiple of 8"),
    (["--tokens", "0"], "--tokens must be >= 1"),
])
def test_bad_arguments(args, match):
    p = _demo(*args)
    assert p.returncode == 2 and match in p.stderr, p.stderr
