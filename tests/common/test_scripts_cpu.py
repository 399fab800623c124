"""Every shell script of the repository parses (`bash -n`): the GPU-machine scripts (tools/gpu.sh,
tools/gpu_x2.sh, ...) only run on a device call, where a syntax error would cost the whole call."""
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


def test_gpu_x2_runs_the_steps_the_status_names():
    text = open(os.path.join(ROOT, "tools", "gpu_x2.sh")).read()
    for needle in ("bench_elastic_ep.py", "--overlap-push-blocks", "bench_ipc_all2all.py", "--num-blocks 264",
                   "test_lowlevel_gpu.py", "overlapped or refused", "tests/fp8_layerwise"):
        assert needle in text, needle


def test_gpu_x2b_and_x2c_run_the_follow_up_steps():
    text = open(os.path.join(ROOT, "tools", "gpu_x2b.sh")).read()
    for needle in ("tests/ipc_all2all", "-k soak"):
        assert needle in text, needle
    text = open(os.path.join(ROOT, "tools", "gpu_x2c.sh")).read()
    for needle in ("tests/fp8_layerwise", "bench_fp8_layerwise.py"):
        assert needle in text, needle


def test_gpu_step_helper_logs_and_limits_each_step(tmp_path):
    # tools/_gpu_steps.sh's step(): the command's output goes to OUT/NAME.log, a step past its limit is
    # cut (rc 124) and the next one still runs.
    script = (f'OUT={tmp_path}; ROOT={ROOT}; source "$ROOT/tools/_gpu_steps.sh"; '
              'step hello 5 echo hi; step slow 1 sleep 5; step after 5 pwd')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "rc=0 after hello" in out.stdout and "rc=124 after slow" in out.stdout and "rc=0 after after" in out.stdout
    assert (tmp_path / "hello.log").read_text() == "hi\n"
    assert (tmp_path / "after.log").read_text().strip() == "/tmp"  # steps run from /tmp
    for name in ("gpu_x2.sh", "gpu_x2b.sh", "gpu_x2c.sh"):
        assert 'source "$ROOT/tools/_gpu_steps.sh"' in open(os.path.join(ROOT, "tools", name)).read()
