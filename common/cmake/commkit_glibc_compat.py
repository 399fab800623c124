#!/usr/bin/env python3
"""Stub glibc libraries for linking extensions that must load on an older glibc than the build
machine's (release wheels tagged manylinux_2_28 built on Debian 12's glibc 2.36), and the check of
the linked result. Used by CommkitGlibcCompat.cmake (read its header first); stdlib and binutils only.

    python commkit_glibc_compat.py stubs --glibc 2.28 --cxx g++ --out DIR
    python commkit_glibc_compat.py check --glibc 2.28 [--cxx g++] LIB.so

``stubs`` writes into DIR, for libc.so.6, libm.so.6, libpthread.so.0, libdl.so.2, librt.so.1 and the
dynamic loader, a shared object with the same soname that defines every public symbol of the real
library that has a version <= GLIBC_<glibc>, each with only the highest such version and that version
as its default (``name@@GLIBC_x``), plus the linker scripts libc.so, libm.so, libpthread.so, libdl.so
and librt.so that make ``-lc`` / ``-lm`` / ``-lpthread`` / ... pick those stubs when DIR comes first on
the library path. Why stubs: the static linker binds an unversioned reference (ours, libstdc++.a's,
libcudart_static.a's alike; no source-level .symver reaches the last two) to the *default* version of
the library it links against, and on glibc 2.36 that is GLIBC_2.34 for pthread_create & co. Against the
stubs the same reference binds to the version a glibc 2.28 system has, and a function newer than 2.28
is not there at all (``check`` then names it) instead of slipping through.

Where glibc 2.32-2.34 moved a function into libc.so.6 (pthread_*, sem_*, dl*, shm_open, timer_*, ...),
libc.so.6 keeps its old version only as a compat (non-default) one; such a symbol goes into the stub of
the library that held it before the move (libpthread.so.0, libdl.so.2, librt.so.1), so that the
extension's DT_NEEDED and version needs are those a glibc 2.28 system satisfies. On glibc >= 2.34 those
libraries are empty shells that still define the old version nodes, and the dynamic loader looks a
versioned symbol up by name and version in every loaded object, so the same reference finds libc's compat
symbol there: each such version is checked against the shell's (or real library's) version definitions
here, which is what the loader checks. Moved symbols of libraries we do not stub (libutil, libanl,
libresolv) are left out: using one is an error of ``check``, not a silently wrong placement.

``check`` fails (exit 1, one line per problem) when the linked object needs a GLIBC version above the
cap or GLIBC_PRIVATE, needs libstdc++ (GLIBCXX / CXXABI versions or a DT_NEEDED libstdc++.so.6: the
compat build links it statically), or has a strong undefined reference without version to a symbol
the real glibc defines (a glibc function newer than the cap, which the stubs do not define: a shared
object links with undefined symbols, so without this check it would fail only when loaded on the old
system). Undefined references glibc does not define (Python's C API, NCCL) are not its business.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

# The libraries stubbed: (soname, the library that -l<name> finds, -l name). The dynamic loader's name
# comes from libc.so.6's DT_NEEDED.
LIBS = [("libc.so.6", "c"), ("libm.so.6", "m"), ("libpthread.so.0", "pthread"), ("libdl.so.2", "dl"),
        ("librt.so.1", "rt")]
# Where the symbols that glibc 2.32-2.34 moved into libc.so.6 lived before (only the libraries stubbed).
MOVED = [
    ("libpthread.so.0", re.compile(r"^(pthread_|__pthread_|_pthread_|sem_|thrd_|mtx_|cnd_|tss_|call_once$)")),
    ("libdl.so.2", re.compile(r"^(dladdr1?|dlclose|dlerror|dlinfo|dlmopen|dlopen|dlsym|dlvsym)$")),
    ("librt.so.1", re.compile(r"^(aio_|lio_|mq_|__mq_open_2$|shm_open$|shm_unlink$|timer_)")),
]
# The version glibc 2.32-2.34 gave the moved symbols in libc.so.6 (their old one became a compat version).
MOVE_VERSIONS = {(2, 32), (2, 33), (2, 34)}
SYMBOL = re.compile(r"^\s*\d+:\s+[0-9a-f]+\s+(\d+|0x[0-9a-f]+)\s+(\w+)\s+(\w+)\s+\w+\s+(\w+)\s+(\S+?)(@@?)(\S+)")
UNDEF = re.compile(r"^\s*\d+:\s+[0-9a-f]+\s+\S+\s+\w+\s+(\w+)\s+\w+\s+UND\s+([^@\s]+)(?:@(\S+))?")


def glibc_version(name: str):
    """(2, 28) for GLIBC_2.28; None for GLIBC_PRIVATE and other version names."""
    m = re.match(r"^GLIBC_(\d+(?:\.\d+)+)$", name)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def find_library(cxx: str, name: str) -> str:
    """The file the compiler's linker would take for ``name`` (libc.so.6, libc_nonshared.a ...)."""
    path = _run([cxx, f"-print-file-name={name}"]).strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        raise SystemExit(f"commkit_glibc_compat: {cxx} does not find {name}")
    return os.path.realpath(path)


def defined_symbols(path: str):
    """{name: [(version, is_default, type, bind, size)]} of the public symbols ``path`` defines."""
    out: dict[str, list] = {}
    for line in _run(["readelf", "--dyn-syms", "-W", path]).splitlines():
        m = SYMBOL.match(line)
        if not m:
            continue
        size, typ, bind, ndx, name, at, ver = m.groups()
        if ndx in ("UND", "ABS") or bind == "LOCAL":
            continue
        out.setdefault(name, []).append((ver, at == "@@", typ, bind, int(size, 0)))
    return out


def version_definitions(path: str) -> set:
    """The version nodes ``path`` defines (what the dynamic loader checks a version need against)."""
    names = set()
    section = False
    for line in _run(["readelf", "-V", "-W", path]).splitlines():
        if line.startswith("Version definition section"):
            section = True
        elif line.startswith("Version needs section") or line.startswith("Version symbols section"):
            section = False
        elif section:
            m = re.search(r"Name: (\S+)", line)
            if m:
                names.add(m.group(1))
    return names


def needed(path: str) -> list[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _run(["readelf", "-d", "-W", path]))


def plan(cxx: str, cap: tuple):
    """{soname: {symbol: (version, type, bind, size)}} of the stubs, the real files and the loader name."""
    real = {soname: find_library(cxx, soname) for soname, _ in LIBS}
    loader = next((n for n in needed(real["libc.so.6"]) if n.startswith("ld-")), None)
    if loader is None:
        raise SystemExit(f"commkit_glibc_compat: {real['libc.so.6']} names no dynamic loader")
    real[loader] = find_library(cxx, loader)
    verdefs = {soname: version_definitions(path) for soname, path in real.items()}
    stubs: dict[str, dict] = {soname: {} for soname in real}
    for soname, path in real.items():
        for name, versions in defined_symbols(path).items():
            if name.endswith("_version_placeholder"):  # the empty shells' markers of their version nodes
                continue
            usable = [v for v in versions if glibc_version(v[0]) and glibc_version(v[0]) <= cap]
            if not usable:
                continue
            ver, is_default, typ, bind, size = max(usable, key=lambda v: glibc_version(v[0]))
            target = soname
            if soname == "libc.so.6" and not is_default and any(
                    v[1] and glibc_version(v[0]) in MOVE_VERSIONS for v in versions):
                target = next((lib for lib, pattern in MOVED if pattern.match(name)), None)
                if target is None:  # moved from a library that is not stubbed (libutil, libanl, libresolv)
                    continue
                if ver not in verdefs[target]:
                    raise SystemExit(f"commkit_glibc_compat: {name}@{ver} would go into {target}, whose "
                                     f"{real[target]} defines no {ver} (the table MOVED is wrong for this glibc)")
            stubs[target].setdefault(name, (ver, typ, bind, size))
    return stubs, real, loader


def _assembly(symbols: dict) -> str:
    lines = ["# generated by commkit_glibc_compat.py: symbols only, never run"]
    for name in sorted(symbols):
        _, typ, bind, size = symbols[name]
        lines.append(f".weak {name}" if bind == "WEAK" else f".globl {name}")
        if typ == "OBJECT":
            lines += [".data", ".p2align 3", f".type {name}, @object", f"{name}:", f".zero {max(size, 1)}",
                      f".size {name}, {size}"]
        else:  # FUNC, IFUNC (an ordinary function to whoever links against it), NOTYPE
            lines += [".text", f".type {name}, @function", f"{name}:", "ret", f".size {name}, 1"]
    lines.append('.section .note.GNU-stack,"",@progbits')
    return "\n".join(lines) + "\n"


def _version_script(symbols: dict) -> str:
    by_version: dict[str, list] = {}
    for name, (ver, *_rest) in symbols.items():
        by_version.setdefault(ver, []).append(name)
    out, previous = [], None
    for ver in sorted(by_version, key=glibc_version):
        body = " ".join(f"{n};" for n in sorted(by_version[ver]))
        local = " local: *;" if previous is None else ""
        out.append(f"{ver} {{ global: {body}{local} }}{' ' + previous if previous else ''};")
        previous = ver
    return "\n".join(out) + "\n"


def make_stubs(cxx: str, cap: tuple, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    stubs, real, loader = plan(cxx, cap)
    for soname, symbols in stubs.items():
        base = os.path.join(out, soname)
        with open(base + ".s", "w") as f:
            f.write(_assembly(symbols))
        with open(base + ".map", "w") as f:
            f.write(_version_script(symbols))
        subprocess.run([cxx, "-nostdlib", "-shared", "-fPIC", "-o", base, f"-Wl,-soname,{soname}",
                        f"-Wl,--version-script,{base}.map", base + ".s"], check=True)
    # The linker scripts -l<name> finds first (DIR comes before the system folders). libc.so keeps the
    # real libc_nonshared.a (atexit, pthread_atfork, ...: calls into libc that the stub versions cover).
    nonshared = find_library(cxx, "libc_nonshared.a")
    scripts = {"c": f"GROUP ( {out}/libc.so.6 {nonshared} AS_NEEDED ( {out}/{loader} ) )"}
    scripts.update({short: f"GROUP ( {out}/{soname} )" for soname, short in LIBS if short != "c"})
    for short, text in scripts.items():
        with open(os.path.join(out, f"lib{short}.so"), "w") as f:
            f.write(f"/* generated by commkit_glibc_compat.py: glibc <= {'.'.join(map(str, cap))} */\n{text}\n")
    with open(os.path.join(out, "stubs.txt"), "w") as f:
        for soname, symbols in stubs.items():
            f.write(f"{soname} ({real[soname]}): {len(symbols)} symbols\n")
    print(f"commkit_glibc_compat: glibc <= {'.'.join(map(str, cap))} stubs in {out}: " +
          ", ".join(f"{s} {len(v)}" for s, v in stubs.items()))


def check(path: str, cap: tuple, cxx: str) -> list[str]:
    problems = []
    glibc_names: set = set()
    for soname, _ in LIBS:
        try:
            glibc_names |= set(defined_symbols(find_library(cxx, soname)))
        except SystemExit:
            pass
    for line in _run(["readelf", "--dyn-syms", "-W", path]).splitlines():
        m = UNDEF.match(line)
        if not m:
            continue
        bind, name, ver = m.groups()
        ver = re.sub(r"\s*\(\d+\)$", "", ver or "")
        if ver.startswith(("GLIBCXX_", "CXXABI_")):
            problems.append(f"{name}@{ver}: libstdc++ is dynamic (the compat build links it statically)")
        elif ver == "GLIBC_PRIVATE" or (glibc_version(ver) and glibc_version(ver) > cap):
            problems.append(f"{name}@{ver}: newer than GLIBC_{'.'.join(map(str, cap))}")
        elif not ver and bind != "WEAK" and name in glibc_names:
            problems.append(f"{name}: a glibc symbol without a version <= {'.'.join(map(str, cap))} (newer "
                            f"than the target; give it a fallback in commkit_glibc_compat.cpp or avoid it)")
    if "libstdc++.so.6" in needed(path):
        problems.append("DT_NEEDED libstdc++.so.6 (the compat build links libstdc++ statically)")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stubs", help="write the stub libraries and linker scripts")
    s.add_argument("--out", required=True)
    c = sub.add_parser("check", help="check a linked shared object")
    c.add_argument("lib")
    for p in (s, c):
        p.add_argument("--glibc", default="2.28", help="the newest glibc version allowed (2.28)")
        p.add_argument("--cxx", default=os.environ.get("CXX", "g++"), help="the compiler driver that links")
    a = ap.parse_args(argv)
    cap = glibc_version("GLIBC_" + a.glibc.replace("_", "."))
    if cap is None:
        ap.error(f"--glibc {a.glibc}: expected a version such as 2.28")
    if a.cmd == "stubs":
        make_stubs(a.cxx, cap, os.path.abspath(a.out))
        return 0
    problems = check(a.lib, cap, a.cxx)
    for p in problems:
        print(f"commkit_glibc_compat: {os.path.basename(a.lib)}: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
