"""tools/diag/ep_python_overhead.py drives the native backend's Python layers against a stub runtime;
running it here keeps the stub in step with the runtime methods those layers call (a renamed or new
runtime call fails this test instead of silently breaking the tool)."""
import os
import subprocess
import sys

from tests._tools import ROOT
from tests.elastic_ep._common import native_module_or_skip


def test_python_overhead_tool_runs():
    native_module_or_skip()  # needs the built package; a broken extension fails
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "diag", "ep_python_overhead.py"),
                          "--iters", "20", "--tokens", "64", "--hidden", "128"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if "median" in line]
    assert len(lines) == 2 and lines[0].startswith("dispatch") and lines[1].startswith("combine"), out.stdout
