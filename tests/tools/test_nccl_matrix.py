"""tools/nccl_matrix.sh before it builds anything: its settings, and what it does when the NCCL wheels
cannot be downloaded (NOT RUN, exit 0, only when no package index offers them; a reachable index without
the pinned version is a failure). pip runs against local or unreachable indexes only: nothing is
downloaded and nothing is built."""
import importlib.util
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests._tools import ROOT

TOOL = os.path.join(ROOT, "tools", "nccl_matrix.sh")
DEFAULT = ["nvidia-nccl-cu13==2.28.9", "nvidia-nccl-cu13==2.32.6", "nvidia-nccl-cu12==2.32.3"]


def _run(tmp_path, *args, **env):
    """Runs the tool with the work folder in ``tmp_path``, pip configured only by ``env`` (no config
    file, no inherited PIP_* variable) and the test's interpreter; returns (exit status, output)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "NCCL_MATRIX"))}
    base.update(PIP_CONFIG_FILE=os.devnull, PYTHON=sys.executable, NCCL_MATRIX_DIR=str(tmp_path / "work"))
    base.update(env)
    res = subprocess.run(["bash", TOOL, *args], env=base, capture_output=True, text=True, timeout=120)
    return res.returncode, res.stdout + res.stderr


def _needs_pip_stage():
    if importlib.util.find_spec("scikit_build_core") is None or importlib.util.find_spec("pybind11") is None:
        pytest.skip("the tool needs scikit-build-core and pybind11 in this interpreter")
    if shutil.which("nm") is None:
        pytest.skip("the tool needs nm")


def _index(tmp_path, versions):
    """A file:// simple index that lists ``versions`` of nvidia-nccl-cu13 (the files themselves are absent)."""
    page = tmp_path / "simple" / "nvidia-nccl-cu13"
    page.mkdir(parents=True)
    links = "".join(f'<a href="nvidia_nccl_cu13-{v}-py3-none-manylinux_2_18_x86_64.whl">x</a>\n' for v in versions)
    (page / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    return (tmp_path / "simple").as_uri()


def _refused_url():
    """An http index on a local port nothing listens on (connection refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/simple"


@pytest.mark.parametrize("args, matrix, message", [
    (["--all"], None, "takes no arguments"),
    ([], "nccl==2.28.9", "is not nvidia-nccl-cu12==X.Y.Z or nvidia-nccl-cu13==X.Y.Z"),
    ([], "nvidia-nccl-cu13>=2.28.9", "is not nvidia-nccl-cu12==X.Y.Z"),
    ([], "nvidia-nccl-cu14==2.28.9", "is not nvidia-nccl-cu12==X.Y.Z"),
    ([], "nvidia-nccl-cu13==2.32.6 nvidia-nccl-cu12==2.32.3", "not elastic_ep's floor (NCCL_MIN_VERSION 22809)"),
    ([], " ", "NCCL_MATRIX is empty"),
])
def test_bad_settings_exit_2_before_any_download(tmp_path, args, matrix, message):
    env = {} if matrix is None else {"NCCL_MATRIX": matrix}
    rc, out = _run(tmp_path, *args, **env)
    assert rc == 2 and message in out, out
    assert "downloading" not in out


def test_help_prints_the_header():
    res = subprocess.run(["bash", TOOL, "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    assert "NCCL_MATRIX_CACHE" in res.stdout and "NOT RUN" in res.stdout and "set -euo" not in res.stdout


def test_no_package_index_is_not_run_and_passes(tmp_path):
    _needs_pip_stage()
    rc, out = _run(tmp_path, PIP_NO_INDEX="1", PIP_INDEX_URL="file:///nonexistent")
    assert rc == 0, out
    for spec in DEFAULT:
        assert f"NOT RUN: could not download {spec} (no package index)" in out, out
    # Once no index answered, the other wheels are not tried (each try could wait on the network).
    assert out.count("downloading") == 1, out
    assert "building" not in out and "FAILED" not in out


def test_no_package_index_fails_where_one_is_required(tmp_path):
    _needs_pip_stage()
    rc, out = _run(tmp_path, PIP_NO_INDEX="1", PIP_INDEX_URL="file:///nonexistent", NCCL_MATRIX_REQUIRED="1")
    assert rc == 1 and "NOT RUN: could not download" in out and "NCCL_MATRIX_REQUIRED=1: failing" in out, out


def test_unreachable_index_is_not_run_even_when_a_mirror_answers(tmp_path):
    # Offline machine with a local mirror that holds another NCCL: pip sees versions, but not from the index.
    _needs_pip_stage()
    rc, out = _run(tmp_path, NCCL_MATRIX="nvidia-nccl-cu13==2.28.9", PIP_INDEX_URL=_refused_url(),
                   PIP_EXTRA_INDEX_URL=_index(tmp_path, ["2.30.7"]))
    assert rc == 0, out
    assert "NOT RUN: could not download nvidia-nccl-cu13==2.28.9 (no package index: unreachable)" in out, out


def test_reachable_index_without_the_version_fails(tmp_path):
    _needs_pip_stage()
    rc, out = _run(tmp_path, NCCL_MATRIX="nvidia-nccl-cu13==2.28.9", PIP_INDEX_URL=_index(tmp_path, ["2.30.7"]))
    assert rc == 1, out
    assert "FAILED: could not install nvidia-nccl-cu13==2.28.9" in out and "NOT RUN" not in out, out
    # Nothing half-installed is left in the cache.
    assert os.listdir(tmp_path / "work" / "nccl") == [], os.listdir(tmp_path / "work" / "nccl")
