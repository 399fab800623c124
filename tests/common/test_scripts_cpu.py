"""Every shell script of the repository parses (`bash -n`): tools/gpu.sh only runs on a GPU machine,
where a syntax error would cost the whole call (tests/tools/test_gpu_runner.py checks what it runs)."""
import glob
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "tools", "*.sh")) + glob.glob(os.path.join(ROOT, "packages", "*", "scripts", "*.sh"))
                 + glob.glob(os.path.join(ROOT, ".ci", "*")))


@pytest.mark.parametrize("path", SCRIPTS, ids=[os.path.relpath(p, ROOT) for p in SCRIPTS])
def test_script_parses(path):
    with open(path, "rb") as f:
        head = f.read(64)
    if path.endswith(".sh") or head.startswith(b"#!") and b"sh" in head.split(b"\n")[0]:
        out = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
