"""Extension code must not use iostreams.

On an H200 host with torch 2.11.0, a ``std::ostream`` insertion inside our extensions after
``import torch`` crashed the process with SIGSEGV (in the num_put facet), so every C++ message goes
through ``commkit::str`` / the CK_* macros. This scan keeps it that way.
"""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATTERN = re.compile(r"#\s*include\s*<(sstream|iostream|ostream|iomanip|fstream)>|std::(cout|cerr|clog|ostringstream|stringstream|ostream)\b")


def test_no_iostreams_in_extension_sources():
    # Our sources only: common's headers and each package's csrc/ (not CMake's generated build trees).
    bases = [ROOT / "common" / "include"] + sorted((ROOT / "packages").glob("*/csrc"))
    files = [p for base in bases for p in base.rglob("*") if p.suffix in (".hpp", ".h", ".cpp", ".cu", ".cuh")]
    assert len(files) > 20, "the scan found too few sources; the layout changed?"
    hits = []
    for path in files:
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            code = line.split("//", 1)[0]
            if PATTERN.search(code):
                hits.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not hits, "iostreams in extension code (use commkit::str):\n" + "\n".join(hits)
