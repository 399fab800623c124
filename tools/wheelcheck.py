#!/usr/bin/env python3
"""Release checks of one wheel, the ones `twine check` and `auditwheel show` / `repair` would make,
without either (neither is installable offline here), then the platform retag.

    python tools/wheelcheck.py WHEEL [--plat manylinux_2_28_x86_64] [--retag OUTDIR] [--allow-lower]
    python tools/wheelcheck.py SDIST.tar.gz        (metadata and contents only)

* metadata: the fields PyPI needs (Metadata-Version, Name, Version, Summary, Requires-Python, a
  license), name and version equal to the file name's, and a long description that renders in its
  declared format (text/x-rst through docutils with warnings as errors, as readme_renderer does;
  text/markdown and text/plain pass through as PyPI shows them);
* contents: only the package's folder and its .dist-info; no raw results, tests, benchmarks, build
  files or bundled NVIDIA libraries; RECORD lists every file once with its sha256 and size;
* ELF policy of every shared object: the glibc / libstdc++ / libgcc symbol versions it needs (the report
  names the newest of each) are those of the manylinux policy asked for, DT_NEEDED names only the policy's system libraries plus the NVIDIA
  libraries that come from NVIDIA's wheels or the driver (libnccl, libcudart, libcuda), and every run
  path is $ORIGIN-relative (an absolute build-machine folder would leak into users' machines).

The policy's limits are auditwheel's for manylinux_2_17 / 2_28 and the base distribution's glibc and
libstdc++ for the later ones. When the wheel needs more than the policy asked for, the report names the
lowest policy it meets and the symbols that exceed it; --allow-lower then retags with that policy
instead of failing (exit status 3 either way, so a release can say it missed its target).
--retag OUTDIR writes the wheel with its platform tag replaced (WHEEL's Tag lines, RECORD rewritten).
An sdist gets the metadata checks (PKG-INFO) and its contents': it must carry the shared common/
folder and the build files, and no results, compiled objects or build folders.
Exit status: 0 all checks passed, 1 a check failed, 3 only the manylinux target was missed.
"""
from __future__ import annotations

import argparse
import base64
import csv
import email.parser
import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile

# (glibc, CXXABI, GLIBCXX, GCC) maxima per policy, lowest first.
POLICIES = [
    ("manylinux_2_17", "2.17", "1.3.7", "3.4.19", "4.8.0"),
    ("manylinux_2_28", "2.28", "1.3.11", "3.4.25", "7.0.0"),
    ("manylinux_2_31", "2.31", "1.3.12", "3.4.28", "7.0.0"),
    ("manylinux_2_34", "2.34", "1.3.13", "3.4.29", "7.0.0"),
    ("manylinux_2_35", "2.35", "1.3.13", "3.4.30", "12.0.0"),
    ("manylinux_2_36", "2.36", "1.3.13", "3.4.30", "12.0.0"),
    ("manylinux_2_39", "2.39", "1.3.15", "3.4.33", "14.0.0"),
]
# auditwheel's lib_whitelist of the manylinux policies, plus the dynamic loader (glibc >= 2.34
# libraries name it), the same for every policy above.
SYSTEM_LIBS = {
    "libgcc_s.so.1", "libstdc++.so.6", "libm.so.6", "libdl.so.2", "librt.so.1", "libc.so.6", "libnsl.so.1",
    "libutil.so.1", "libpthread.so.0", "libresolv.so.2", "libX11.so.6", "libXext.so.6", "libXrender.so.1",
    "libICE.so.6", "libSM.so.6", "libGL.so.1", "libgobject-2.0.so.0", "libgthread-2.0.so.0",
    "libglib-2.0.so.0", "ld-linux-x86-64.so.2",
}
# Loaded from NVIDIA's wheels (nvidia-nccl-cu12/-cu13, nvidia-cuda-runtime) or the driver: never bundled.
NVIDIA_LIBS = re.compile(r"^(libnccl\.so\.2|libcudart\.so\.1[2-9]|libcuda\.so\.1)$")
BUNDLED_NVIDIA = re.compile(r"(^|/)lib(nccl|cudart|cuda|nvidia|cublas|nvrtc)[^/]*\.so(\.[0-9.]+)?$")
RESULT_FILES = re.compile(r"(^|/)(benchmarks|tests?|build|results|out|_skbuild)/|"
                          r"\.(json|png|jpe?g|svg|gif|csv|tsv|log|npz|npy|pt|pkl|o|a|obj|ninja)$|"
                          r"(^|/)(CMakeLists\.txt|CMakeCache\.txt|[^/]*\.cmake)$")
SDIST_JUNK = re.compile(r"(^|/)(benchmarks|build|_skbuild|out|\.venv)/|"
                        r"\.(json|png|jpe?g|svg|gif|csv|tsv|log|npz|npy|pt|pkl|o|a|so|whl)$")
SDIST_NEEDS = ("pyproject.toml", "CMakeLists.txt", "README.md", "common/CMakeLists.txt",
               "common/cmake/CommkitDeps.cmake", "common/include/commkit/check.hpp",
               # the release build's link for an older glibc (COMMKIT_MANYLINUX)
               "common/cmake/CommkitGlibcCompat.cmake", "common/cmake/commkit_glibc_compat.py",
               "common/cmake/commkit_glibc_compat.cpp")
REQUIRED_FIELDS = ("Metadata-Version", "Name", "Version", "Summary", "Requires-Python")


def _ver(s: str) -> tuple:
    return tuple(int(x) for x in s.split("."))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


class Report:
    def __init__(self):
        self.errors: list[str] = []
        self.notes: list[str] = []

    def fail(self, msg: str):
        self.errors.append(msg)

    def note(self, msg: str):
        self.notes.append(msg)


def parse_name(path: str):
    """(distribution, version, python tag, abi tag, platform tag) of a wheel file name."""
    m = re.match(r"^([^-]+)-([^-]+)-([^-]+)-([^-]+)-([^-]+)\.whl$", os.path.basename(path))
    if not m:
        raise SystemExit(f"{path}: not a wheel file name (name-version-python-abi-platform.whl)")
    return m.groups()


def check_description(meta, rep: Report):
    body = meta.get_payload() or meta.get("Description") or ""
    ctype = (meta.get("Description-Content-Type") or "text/x-rst").split(";")[0].strip().lower()
    if not body.strip():
        rep.fail("METADATA has no long description (the README)")
        return
    if ctype == "text/x-rst":
        try:
            import docutils.core
            import docutils.utils
        except ImportError:
            rep.fail("the long description is reStructuredText, and docutils (to render it) is not installed")
            return
        err = io.StringIO()
        try:
            docutils.core.publish_parts(body, writer_name="html", settings_overrides={
                "halt_level": 2, "report_level": 2, "warning_stream": err, "raw_enabled": False,
                "file_insertion_enabled": False})
        except docutils.utils.SystemMessage as e:
            rep.fail(f"the long description (reStructuredText) does not render: {e}")
            return
        rep.note("long description: reStructuredText, renders with docutils")
    elif ctype in ("text/markdown", "text/plain"):
        rep.note(f"long description: {ctype}, {len(body.splitlines())} lines (shown as written)")
    else:
        rep.fail(f"Description-Content-Type {ctype!r} is none of text/x-rst, text/markdown, text/plain")


def check_metadata(raw: str | None, where: str, name: str, version: str, rep: Report):
    if raw is None:
        rep.fail(f"no {where}")
        return
    meta = email.parser.Parser().parsestr(raw)
    for field in REQUIRED_FIELDS:
        if not (meta.get(field) or "").strip():
            rep.fail(f"METADATA lacks {field}")
    if not (meta.get("License") or meta.get("License-Expression") or
            any(c.startswith("License ::") for c in meta.get_all("Classifier") or [])):
        rep.fail("METADATA names no license (License, License-Expression or a License classifier)")
    if _norm(meta.get("Name", "")) != _norm(name):
        rep.fail(f"METADATA Name {meta.get('Name')!r} is not the file name's {name!r}")
    if meta.get("Version") != version:
        rep.fail(f"METADATA Version {meta.get('Version')!r} is not the file name's {version!r}")
    check_description(meta, rep)
    reqs = meta.get_all("Requires-Dist") or []
    rep.note("requires: " + (", ".join(reqs) if reqs else "nothing"))


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def check_record(zf: zipfile.ZipFile, dist_info: str, rep: Report):
    record_name = f"{dist_info}/RECORD"
    try:
        rows = list(csv.reader(io.StringIO(zf.read(record_name).decode("utf-8"))))
    except KeyError:
        rep.fail(f"no {record_name}")
        return
    listed = {}
    for row in rows:
        if not row:
            continue
        if len(row) != 3:
            rep.fail(f"RECORD row {row!r} has not 3 fields")
            continue
        if row[0] in listed:
            rep.fail(f"RECORD lists {row[0]} twice")
        listed[row[0]] = row
    files = [i.filename for i in zf.infolist() if not i.filename.endswith("/")]
    for f in files:
        if f not in listed:
            rep.fail(f"RECORD does not list {f}")
        elif f != record_name:
            data = zf.read(f)
            _, digest, size = listed[f]
            if digest != _record_hash(data) or size != str(len(data)):
                rep.fail(f"RECORD's hash or size of {f} does not match the file")
    for f in set(listed) - set(files):
        rep.fail(f"RECORD lists {f}, which the wheel does not hold")


def check_contents(zf: zipfile.ZipFile, dist_info: str, packages: list[str], rep: Report):
    files = [i.filename for i in zf.infolist() if not i.filename.endswith("/")]
    tops = {f.split("/", 1)[0] for f in files}
    for top in sorted(tops - set(packages) - {dist_info}):
        rep.fail(f"the wheel holds {top}/ beside its package ({', '.join(packages)}) and {dist_info}")
    for f in files:
        if f.startswith(dist_info + "/"):
            continue
        if RESULT_FILES.search(f):
            rep.fail(f"the wheel holds {f}: results, tests or build files do not ship")
        if BUNDLED_NVIDIA.search(f):
            rep.fail(f"the wheel bundles {f}: NVIDIA's libraries come from NVIDIA's wheels")
    exts = [f for f in files if f.endswith(".so")]
    rep.note(f"contents: {len(files)} files, extensions {', '.join(exts) or 'none'}")


def _readelf(args: list[str], path: str) -> str:
    return subprocess.run(["readelf", "-W", *args, path], check=True, capture_output=True, text=True).stdout


def elf_facts(path: str):
    """(needed sonames, run paths, {library: {version names}}) of one ELF file."""
    dyn = _readelf(["-d"], path)
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
    rpaths = []
    for kind, value in re.findall(r"\((RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[([^\]]*)\]", dyn):
        rpaths += [p for p in value.split(":") if p]
    versions: dict[str, set] = {}
    lib = None
    for line in _readelf(["-V"], path).splitlines():
        m = re.search(r"File: (\S+)\s+Cnt:", line)
        if m:
            lib = m.group(1)
            continue
        m = re.search(r"Name: (\S+)\s+Flags:", line)
        if m and lib:
            versions.setdefault(lib, set()).add(m.group(1))
    return needed, rpaths, versions


def policy_excess(versions: dict, policy) -> list[str]:
    """The symbol versions that ``policy`` does not allow."""
    _, glibc, cxxabi, glibcxx, gcc = policy
    limits = {"GLIBC": glibc, "CXXABI": cxxabi, "GLIBCXX": glibcxx, "GCC": gcc}
    out = []
    for lib, names in versions.items():
        for name in names:
            m = re.match(r"^(GLIBC|CXXABI|GLIBCXX|GCC)_([0-9.]+)$", name)
            if m and _ver(m.group(2)) > _ver(limits[m.group(1)]):
                out.append(f"{name} ({lib})")
            elif name == "GLIBC_PRIVATE":
                out.append(f"{name} ({lib})")
    return sorted(set(out))


def highest_versions(versions: dict) -> str:
    """The newest version of each family (GLIBC, GLIBCXX, CXXABI, GCC) that ``versions`` needs."""
    top: dict[str, tuple] = {}
    for names in versions.values():
        for name in names:
            m = re.match(r"^(GLIBC|CXXABI|GLIBCXX|GCC)_([0-9.]+)$", name)
            if m and _ver(m.group(2)) > top.get(m.group(1), ()):
                top[m.group(1)] = _ver(m.group(2))
    fams = [f for f in ("GLIBC", "GLIBCXX", "CXXABI", "GCC") if f in top]
    out = ", ".join(f"{f}_{'.'.join(map(str, top[f]))}" for f in fams)
    if "GLIBCXX" not in top and "CXXABI" not in top:
        out += (", " if out else "") + "no libstdc++ version"
    return out or "none"


def _first_symbols(path: str, excess: list[str], limit: int = 6) -> str:
    """A few symbols that need the versions in ``excess`` (what to look at in the build)."""
    wanted = {e.split(" ", 1)[0] for e in excess}
    dyn = subprocess.run(["objdump", "-T", path], capture_output=True, text=True).stdout
    syms = []
    for line in dyn.splitlines():
        m = re.search(r"\*UND\*\s+\S+\s+(?:\(?([A-Z_]+_[0-9.]+)\)?)\s+(\S+)$", line)
        if m and m.group(1) in wanted:
            syms.append(f"{m.group(2)}@{m.group(1)}")
    return ", ".join(sorted(set(syms))[:limit]) + (" ..." if len(set(syms)) > limit else "")


def check_elf(zf: zipfile.ZipFile, target: str, rep: Report):
    """Returns the lowest policy every shared object meets, or None when one meets none of them."""
    arch = target.split("_", 3)[-1]  # manylinux_2_28_x86_64 -> x86_64
    lowest = 0
    with tempfile.TemporaryDirectory() as tmp:
        for info in zf.infolist():
            if not (info.filename.endswith(".so") or ".so." in info.filename):
                continue
            path = zf.extract(info, tmp)
            if open(path, "rb").read(4) != b"\x7fELF":
                continue
            needed, rpaths, versions = elf_facts(path)
            for lib in needed:
                if lib not in SYSTEM_LIBS and not NVIDIA_LIBS.match(lib):
                    rep.fail(f"{info.filename} needs {lib}, which is neither a manylinux system library "
                             f"nor an NVIDIA library from NVIDIA's wheels or the driver")
            for rp in rpaths:
                if not rp.startswith("$ORIGIN"):
                    rep.fail(f"{info.filename} has the absolute run path {rp} (a folder of the build machine)")
            met = next((i for i, p in enumerate(POLICIES) if not policy_excess(versions, p)), None)
            if met is None:
                rep.fail(f"{info.filename} needs symbol versions newer than every known policy: "
                         f"{', '.join(policy_excess(versions, POLICIES[-1]))}")
                return None
            lowest = max(lowest, met)
            want = next(p for p in POLICIES if target == f"{p[0]}_{arch}")
            excess = policy_excess(versions, want)
            rep.note(f"{info.filename}: needs {', '.join(needed)}; run path {':'.join(rpaths) or 'none'}; "
                     f"newest versions {highest_versions(versions)}; meets {POLICIES[met][0]}")
            if excess:
                rep.note(f"{info.filename} exceeds {want[0]}: {', '.join(excess)}; e.g. "
                         f"{_first_symbols(path, excess)}")
    return f"{POLICIES[lowest][0]}_{arch}"


def retag(src: str, outdir: str, plat: str) -> str:
    """Writes ``src`` with platform tag ``plat`` into ``outdir``; returns the new path."""
    name, version, py, abi, _ = parse_name(src)
    dst = os.path.join(outdir, f"{name}-{version}-{py}-{abi}-{plat}.whl")
    dist_info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(src) as zin:
        items = [(i, zin.read(i.filename)) for i in zin.infolist()]
    out, record = [], []
    for info, data in items:
        if info.filename == f"{dist_info}/WHEEL":
            lines = [ln for ln in data.decode().splitlines() if not ln.startswith("Tag:")]
            lines += [f"Tag: {py_tag}-{abi}-{plat}" for py_tag in py.split(".")]
            data = ("\n".join(lines) + "\n").encode()
        if info.filename == f"{dist_info}/RECORD":
            continue
        out.append((info, data))
        if not info.filename.endswith("/"):
            record.append([info.filename, _record_hash(data), str(len(data))])
    record.append([f"{dist_info}/RECORD", "", ""])
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(record)
    tmp = dst + ".part"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zout:
        for info, data in out:
            zout.writestr(info, data)
        rec = zipfile.ZipInfo(f"{dist_info}/RECORD", date_time=out[-1][0].date_time)
        rec.external_attr = 0o644 << 16
        zout.writestr(rec, buf.getvalue(), compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, dst)
    return dst


def check_wheel(path: str, target: str, rep: Report):
    """Runs every check; returns the lowest manylinux tag the wheel meets (or None)."""
    name, version, _, _, plat = parse_name(path)
    dist_info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path) as zf:
        bad = zf.testzip()
        if bad:
            rep.fail(f"{bad} is corrupt in the archive")
        try:
            raw = zf.read(f"{dist_info}/METADATA").decode("utf-8")
        except KeyError:
            raw = None
        check_metadata(raw, f"{dist_info}/METADATA", name, version, rep)
        check_record(zf, dist_info, rep)
        packages = sorted({f.split("/", 1)[0] for f in zf.namelist()} - {dist_info})
        check_contents(zf, dist_info, [p for p in packages if _norm(p) == _norm(name)] or packages[:1], rep)
        try:
            wheel_meta = zf.read(f"{dist_info}/WHEEL").decode()
        except KeyError:
            rep.fail(f"no {dist_info}/WHEEL")
            wheel_meta = ""
        if "Root-Is-Purelib: false" not in wheel_meta and plat != "any":
            rep.fail("WHEEL says Root-Is-Purelib: true for a platform wheel")
        return check_elf(zf, target, rep)


def check_sdist(path: str, rep: Report):
    m = re.match(r"^(.+)-([^-]+)\.tar\.gz$", os.path.basename(path))
    if not m:
        raise SystemExit(f"{path}: not an sdist file name (name-version.tar.gz)")
    name, version = m.groups()
    top = f"{name}-{version}"
    with tarfile.open(path) as tf:
        members = [t for t in tf.getmembers() if t.isfile()]
        names = [t.name.split("/", 1)[1] if "/" in t.name else "" for t in members]
        outside = [t.name for t in members if not t.name.startswith(top + "/")]
        for t in outside:
            rep.fail(f"{t} lies outside {top}/")
        pkg_info = next((t for t in members if t.name == f"{top}/PKG-INFO"), None)
        raw = tf.extractfile(pkg_info).read().decode("utf-8") if pkg_info else None
    check_metadata(raw, f"{top}/PKG-INFO", name, version, rep)
    for need in SDIST_NEEDS:
        if need not in names:
            rep.fail(f"the sdist lacks {need} (a wheel cannot be built from it)")
    for n in names:
        if SDIST_JUNK.search(n):
            rep.fail(f"the sdist holds {n}: results, compiled files and build folders do not ship")
    rep.note(f"contents: {len(names)} files, common/ included")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", help="a .whl, or an sdist (.tar.gz)")
    ap.add_argument("--plat", default="manylinux_2_28_x86_64", help="target platform tag")
    ap.add_argument("--retag", metavar="OUTDIR", help="write the wheel with its platform tag replaced")
    ap.add_argument("--allow-lower", action="store_true",
                    help="retag with the lowest policy the wheel meets when it misses --plat")
    a = ap.parse_args(argv)
    rep = Report()
    if a.wheel.endswith(".tar.gz"):
        check_sdist(a.wheel, rep)
        print(f"{os.path.basename(a.wheel)}:")
        for line in rep.notes + [f"FAIL: {e}" for e in rep.errors]:
            print(f"  {line}")
        return 1 if rep.errors else 0
    if not any(a.plat == f"{p[0]}_x86_64" for p in POLICIES):
        ap.error(f"--plat {a.plat}: known are {', '.join(p[0] + '_x86_64' for p in POLICIES)}")
    lowest = check_wheel(a.wheel, a.plat, rep)
    print(f"{os.path.basename(a.wheel)}:")
    for n in rep.notes:
        print(f"  {n}")
    for e in rep.errors:
        print(f"  FAIL: {e}")
    if rep.errors or lowest is None:
        return 1
    order = [f"{p[0]}_x86_64" for p in POLICIES]
    missed = order.index(lowest) > order.index(a.plat)
    plat = lowest if missed else a.plat
    if missed:
        print(f"  MISSED: the wheel needs {lowest}, not {a.plat}" +
              ("" if a.allow_lower else " (not retagged; --allow-lower tags it with what it meets)"))
    if a.retag and (not missed or a.allow_lower):
        os.makedirs(a.retag, exist_ok=True)
        print(f"  retagged: {retag(a.wheel, a.retag, plat)}")
    elif not missed:
        print(f"  passed for {a.plat}")
    return 3 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
