"""``python -m fp8_layerwise.demo`` on the CPU: the short correctness demo (TP ranks receive streamed
block-FP8 shards, checked byte for byte against plain-torch slices) and its refusals. The timing runs
(the streaming throughput, the prefill loop) are tools/block_fp8_layerwise.py: test_block_cpu.py."""
import subprocess
import sys

import pytest

pytest.importorskip("fp8_layerwise._C", reason="needs the built fp8_layerwise package")


def _demo(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fp8_layerwise.demo", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_demo_streams_byte_exact_shards_on_the_cpu_backend():
    out = _demo("--backend", "cpu")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("fp8_layerwise demo: tp=2, 2 layers x 4 experts"), lines
    for rank in (0, 1):
        assert any(line.startswith(f"  rank {rank} (cpu backend): 2 layers x 4 experts") and
                   "every byte equal to the reference shards" in line for line in lines), lines
    assert lines[-1] == "demo OK" and len(lines) == 4, lines  # a few lines, no table


def test_demo_three_ranks_more_layers():
    out = _demo("--backend", "cpu", "--tp", "3", "--layers", "3", "--experts", "2", "--intermediate", "384")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert sum("every byte equal to the reference shards" in line for line in out.stdout.splitlines()) == 3
    assert out.stdout.rstrip().endswith("demo OK")


@pytest.mark.parametrize("args,msg", [
    (["--intermediate", "200"], "--hidden / --intermediate / --tp"),
    (["--tp", "9"], "--tp must be at most 8"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--backend", "gpu"], "invalid choice"),
])
def test_bad_arguments_are_refused_before_launch(args, msg):
    out = _demo(*args)
    assert out.returncode == 2 and msg in out.stderr, out.stderr
