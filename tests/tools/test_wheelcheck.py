"""tools/wheelcheck.py on small wheels made here: metadata, contents, RECORD, the ELF policy and the
retag; and the packages' build configuring with torch unimportable (the release path: no torch to build)."""
import base64
import csv
import contextlib
import hashlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

from tests._tools import ROOT, load_tool

wc = load_tool("wheelcheck")
NAME, VERSION = "demo_pkg", "1.2.3"
DIST_INFO = f"{NAME}-{VERSION}.dist-info"
METADATA = (f"Metadata-Version: 2.2\nName: demo-pkg\nVersion: {VERSION}\nSummary: a demo\nLicense: MIT\n"
            "Requires-Python: >=3.10\nRequires-Dist: torch>=2.11\nDescription-Content-Type: text/markdown\n\n"
            "# demo\n\nText.\n")


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _wheel(tmp_path, files=None, metadata=METADATA, record_fix=None):
    """A wheel holding ``files`` (name -> bytes) besides the package's __init__.py, with a RECORD that
    ``record_fix`` may alter."""
    files = {f"{NAME}/__init__.py": b"__version__ = '1.2.3'\n", **(files or {})}
    files[f"{DIST_INFO}/METADATA"] = metadata.encode()
    files[f"{DIST_INFO}/WHEEL"] = b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp311-cp311-linux_x86_64\n"
    rows = [[n, _hash(d), str(len(d))] for n, d in files.items()] + [[f"{DIST_INFO}/RECORD", "", ""]]
    if record_fix:
        rows = record_fix(rows)
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    files[f"{DIST_INFO}/RECORD"] = buf.getvalue().encode()
    path = tmp_path / f"{NAME}-{VERSION}-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for n, d in files.items():
            zf.writestr(n, d)
    return str(path)


def _so(tmp_path, rpath="$ORIGIN/../nvidia/nccl/lib") -> bytes:
    if shutil.which("gcc") is None or shutil.which("readelf") is None:
        pytest.skip("needs gcc and readelf")
    src = tmp_path / "x.c"
    src.write_text("#include <stdio.h>\nvoid hello(void) { puts(\"hi\"); }\n")
    out = tmp_path / "x.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src), f"-Wl,-rpath,{rpath}"], check=True)
    return out.read_bytes()


def _run(*args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = wc.main(list(args))
    return rc, out.getvalue()


def test_a_clean_wheel_passes_and_is_retagged(tmp_path):
    whl = _wheel(tmp_path, {f"{NAME}/_C.so": _so(tmp_path)})
    rc, out = _run(whl, "--plat", "manylinux_2_28_x86_64", "--retag", str(tmp_path / "out"))
    assert rc == 0, out
    new = tmp_path / "out" / f"{NAME}-{VERSION}-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert new.exists(), out
    with zipfile.ZipFile(new) as zf:
        assert "Tag: cp311-cp311-manylinux_2_28_x86_64" in zf.read(f"{DIST_INFO}/WHEEL").decode()
    rc, out = _run(str(new))  # its RECORD matches the rewritten WHEEL
    assert rc == 0, out


def test_record_mismatch_and_unlisted_files_fail(tmp_path):
    def corrupt(rows):
        rows[0][1] = _hash(b"something else")
        return [r for r in rows if not r[0].endswith("extra.py")]

    whl = _wheel(tmp_path, {f"{NAME}/extra.py": b"x = 1\n"}, record_fix=corrupt)
    rc, out = _run(whl)
    assert rc == 1
    assert f"RECORD's hash or size of {NAME}/__init__.py" in out and f"RECORD does not list {NAME}/extra.py" in out, out


def test_results_tests_build_files_and_bundled_nvidia_libraries_fail(tmp_path):
    whl = _wheel(tmp_path, {f"{NAME}/benchmarks/run.json": b"{}", f"{NAME}/tests/test_x.py": b"",
                            f"{NAME}/CMakeLists.txt": b"", f"{NAME}/libnccl.so.2": b"", "other/x.py": b""})
    rc, out = _run(whl)
    assert rc == 1
    for what in ("benchmarks/run.json", "tests/test_x.py", "CMakeLists.txt"):
        assert f"holds {NAME}/{what}" in out, (what, out)
    assert f"bundles {NAME}/libnccl.so.2" in out and "holds other/ beside its package" in out, out


def test_metadata_fields_and_rst_description(tmp_path):
    meta = METADATA.replace("Summary: a demo\n", "").replace("text/markdown", "text/x-rst")
    meta = meta.replace("# demo\n\nText.\n", "Title\n=====\n\n:bad-role:`x` and `unclosed\n")
    rc, out = _run(_wheel(tmp_path, metadata=meta))
    assert rc == 1
    assert "METADATA lacks Summary" in out, out
    if importlib.util.find_spec("docutils") is not None:
        assert "does not render" in out, out


def test_an_absolute_run_path_fails(tmp_path):
    whl = _wheel(tmp_path, {f"{NAME}/_C.so": _so(tmp_path, rpath="/home/builder/nccl/lib")})
    rc, out = _run(whl)
    assert rc == 1 and "absolute run path /home/builder/nccl/lib" in out, out


def test_policy_limits():
    p228 = next(p for p in wc.POLICIES if p[0] == "manylinux_2_28")
    ok = {"libc.so.6": {"GLIBC_2.2.5", "GLIBC_2.28"}, "libstdc++.so.6": {"GLIBCXX_3.4.25", "CXXABI_1.3.11"}}
    assert wc.policy_excess(ok, p228) == []
    newer = {"libc.so.6": {"GLIBC_2.34"}, "libstdc++.so.6": {"GLIBCXX_3.4.30", "CXXABI_1.3.13"}}
    assert wc.policy_excess(newer, p228) == ["CXXABI_1.3.13 (libstdc++.so.6)", "GLIBCXX_3.4.30 (libstdc++.so.6)",
                                             "GLIBC_2.34 (libc.so.6)"]
    lowest = next(p[0] for p in wc.POLICIES if not wc.policy_excess(newer, p))
    assert lowest == "manylinux_2_35"
    # The report's "newest versions" (and whether libstdc++ is needed at all).
    assert wc.highest_versions(newer) == "GLIBC_2.34, GLIBCXX_3.4.30, CXXABI_1.3.13"
    static = {"libc.so.6": {"GLIBC_2.2.5", "GLIBC_2.25", "GLIBC_2.3.4"}, "libgcc_s.so.1": {"GCC_3.0", "GCC_4.2.0"}}
    assert wc.highest_versions(static) == "GLIBC_2.25, GCC_4.2.0, no libstdc++ version"


def test_sdist_needs_common_and_no_results(tmp_path):
    top = tmp_path / f"{NAME}-{VERSION}"
    for rel, text in {"PKG-INFO": METADATA, "pyproject.toml": "", "CMakeLists.txt": "", "README.md": "x",
                      "common/CMakeLists.txt": "", "common/cmake/CommkitDeps.cmake": "",
                      "benchmarks/r.json": "{}"}.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_text(text)
    sdist = tmp_path / f"{NAME}-{VERSION}.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        tf.add(top, arcname=top.name)
    rc, out = _run(str(sdist))
    assert rc == 1
    assert "lacks common/include/commkit/check.hpp" in out and "holds benchmarks/r.json" in out, out


@pytest.mark.parametrize("pkg", ["elastic_ep", "ipc_all2all", "fp8_layerwise"])
def test_build_configures_with_torch_unimportable(tmp_path, pkg):
    # A torch that raises on import, first on the path: the build must not import torch at all.
    cmake = shutil.which("cmake")
    if cmake is None or importlib.util.find_spec("pybind11") is None:
        pytest.skip("needs cmake and pybind11")
    poison = tmp_path / "poison" / "torch"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('the build imported torch')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMKIT_", "CUDAARCHS"))}
    env["PYTHONPATH"] = os.pathsep.join([str(poison.parent)] + [p for p in [env.get("PYTHONPATH")] if p])
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    res = subprocess.run([cmake, *gen, "-S", os.path.join(ROOT, "packages", pkg), "-B", str(tmp_path / "b"),
                          f"-DPython_EXECUTABLE={sys.executable}", "-DCOMMKIT_BUILD_CUDA=OFF"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
