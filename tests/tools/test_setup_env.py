"""tools/setup_env.sh (through tools/run.sh) in a virtual environment that already has torch, offline:
it must use that environment as is (no .venv, no pip), build into it and run the CPU main job, saving
its output under out/. And in one without torch, which torch build it would install.

The environment under test is made from the interpreter running the tests: a venv of its base
interpreter with --system-site-packages, plus a .pth file with this interpreter's site-packages when
that is a venv itself (where torch is), so torch is importable but lives outside the new venv. The
repository is copied (tools/, common/, packages/fp8_layerwise), so nothing is built in the checkout.
pip is offline: no index (PIP_NO_INDEX=1) and an empty find-links folder, so a pip install of
anything missing would fail the run."""
import glob
import os
import shutil
import subprocess
import sys

import pytest

from tests._tools import ROOT

torch = pytest.importorskip("torch")


def _gpu_visible() -> bool:
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def _copy_repo(dst):
    ignore = shutil.ignore_patterns("build", "_build", "__pycache__", "*.so", "*.egg-info", ".pytest_cache")
    for part in ("tools", "common", os.path.join("packages", "fp8_layerwise")):
        shutil.copytree(os.path.join(ROOT, part), os.path.join(dst, part), ignore=ignore)
    shutil.copy(os.path.join(ROOT, "requirements-dev.txt"), dst)
    return dst


def _make_venv(path, see_this_env: bool):
    """A venv of this interpreter's base; with ``see_this_env`` it also sees this interpreter's packages."""
    in_venv = sys.prefix != sys.base_prefix
    base = os.path.join(sys.base_prefix, "bin", "python3") if in_venv else sys.executable
    subprocess.run([base, "-m", "venv", "--system-site-packages", "--without-pip", str(path)], check=True,
                   capture_output=True, timeout=120)
    py = os.path.join(str(path), "bin", "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    import sysconfig

    mine = sysconfig.get_paths()
    # pip itself must be importable in the new venv (it has none of its own): from this environment
    # when see_this_env, else from the base interpreter's site-packages. This environment's site
    # folders include those its own .pth files add (it may be layered on another venv like this one).
    lines = []
    if see_this_env and in_venv:
        lines = list(dict.fromkeys([mine["purelib"], mine["platlib"]] + [
            d for d in sys.path if os.path.basename(d) in ("site-packages", "dist-packages")]))
    with open(os.path.join(site, "_test_parent.pth"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return py, site


def _env(tmp_path, py, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COMMKIT_", "PIP_", "VIRTUAL_ENV", "CONDA")) and k not in ("TORCH_SPEC", "PYTHONPATH")}
    empty = tmp_path / "no-wheels"
    empty.mkdir(exist_ok=True)
    env.update(PYTHON=py, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(empty), PIP_DISABLE_PIP_VERSION_CHECK="1",
               COMMKIT_PACKAGES="fp8_layerwise", COMMKIT_BUILD_CUDA="OFF", COMMKIT_GPU="0",
               CMAKE_BUILD_PARALLEL_LEVEL="2")
    env.update(extra)
    return env


def test_run_sh_uses_the_venv_that_has_torch_offline(tmp_path):
    repo = _copy_repo(str(tmp_path / "repo"))
    venv = tmp_path / "venv"
    py, site = _make_venv(venv, see_this_env=True)
    if subprocess.run([py, "-c", "import torch, pip"], capture_output=True).returncode != 0:
        pytest.skip("this interpreter's torch/pip cannot be shared with a venv of its base")
    out = subprocess.run(["bash", os.path.join(repo, "tools", "run.sh"), "--layers", "3", "--experts", "8"],
                         env=_env(tmp_path, py), capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    env_lines = [line for line in log.splitlines() if line.startswith("[setup] environment ")]
    assert len(env_lines) == 1, log[-4000:]
    assert env_lines[0].startswith(f"[setup] environment {venv} (virtual environment, the interpreter's own)"), env_lines
    assert f"torch {torch.__version__} " in env_lines[0], env_lines
    # Nothing was installed: no pip run, no torch copied into the venv, no .venv made beside it.
    assert "[setup] pip install" not in log and "creating" not in log, log[-4000:]
    assert not os.path.exists(os.path.join(repo, ".venv"))
    assert not glob.glob(os.path.join(site, "torch*"))
    # The package was built into that venv, and the main job ran on it and saved its output.
    assert glob.glob(os.path.join(site, "fp8_layerwise", "_C*.so")), os.listdir(site)
    assert "[setup] built fp8_layerwise" in log and "demo OK" in log, log[-4000:]
    outs = glob.glob(os.path.join(repo, "out", "demo-*"))
    assert len(outs) == 1, outs
    listing = log[log.index("files written under " + outs[0]):]
    for name in ("demo.json", "demo.md", "run.log"):
        assert os.path.getsize(os.path.join(outs[0], name)) > 0 and f"  {name} (" in listing, (name, listing)
    assert "steady state per rank" in open(os.path.join(outs[0], "run.log")).read()


@pytest.mark.skipif(_gpu_visible(), reason="this machine has an NVIDIA device: the CUDA build is the choice")
@pytest.mark.parametrize("cuda_build,spec", [("OFF", "torch==2.13.0+cpu"), ("ON", "torch==2.14.1")])
def test_without_torch_it_picks_the_build_for_the_machine(tmp_path, cuda_build, spec):
    # No torch anywhere the venv sees: setup_env installs one into that venv (the interpreter's own
    # environment: no .venv on top of it). Offline that fails, after naming the torch it chose: the CPU
    # build without a GPU, unless CUDA sources are to be compiled (CI), which need the CUDA build's NCCL.
    repo = _copy_repo(str(tmp_path / "repo"))
    py, site = _make_venv(tmp_path / "venv", see_this_env=False)
    if subprocess.run([py, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("the base interpreter has torch")
    out = subprocess.run(["bash", "-c", f'source "{repo}/tools/setup_env.sh"'],
                         env=_env(tmp_path, py, COMMKIT_BUILD_CUDA=cuda_build, COMMKIT_SKIP_BUILD="1"),
                         capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode != 0, log
    assert f"[setup] no torch in {tmp_path / 'venv'}: installing {spec}" in log, log
    assert f"[setup] pip install {spec}" in log and "could not install" in log, log
    assert not os.path.exists(os.path.join(repo, ".venv"))
