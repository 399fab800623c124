"""Helpers shared by the tools/bench_*.py scripts."""
from __future__ import annotations

import json
import os
import subprocess
from typing import Callable, List, Optional


def git_revision() -> str:
    """The source revision to record with a result: ``$COMMKIT_GIT_REV`` if set (the GPU machine's copy
    of the tree has no ``.git``; tools/gpu.sh passes it on), else ``git rev-parse``, with ``-dirty``
    appended when tracked files differ from that commit (the result is then not of that revision);
    "unknown" if neither."""
    rev = os.environ.get("COMMKIT_GIT_REV", "").strip()
    if rev:
        return rev
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=here).stdout.strip()
        if rev:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, cwd=here).stdout.strip()
            if dirty:
                rev += "-dirty"
    except OSError:
        rev = ""
    return rev or "unknown"


def out_dir(path: str) -> str:
    """``path`` made absolute and created: the folder a benchmark writes its results into (a relative
    path would move with a later ``chdir``)."""
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    return path


def write_results(out: str, name: str, data: dict, table: str, plot: Optional[Callable[[str], object]] = None,
                  quiet: bool = False) -> List[str]:
    """Writes ``<name>.json`` (``data``), ``<name>.md`` (``table``, markdown) and ``<name>.png`` (drawn by
    ``plot(path)``, which may decline, e.g. without matplotlib) into ``out`` (created; made absolute);
    prints and returns the paths that now exist. The JSON and the table are written before the plot is
    drawn, so a plotting error cannot lose the measurements."""
    out = out_dir(out)
    paths = [os.path.join(out, f"{name}.{ext}") for ext in ("json", "md", "png")]
    with open(paths[0], "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
    with open(paths[1], "w") as f:
        f.write(table if table.endswith("\n") else table + "\n")
    if os.path.exists(paths[2]):
        os.remove(paths[2])  # an earlier run's plot must not pass for this one's
    if plot is not None:
        try:
            plot(paths[2])
        except Exception as exc:  # noqa: BLE001 - the table and JSON are what matter
            print(f"{name}: no plot ({type(exc).__name__}: {exc})")
    written = [p for p in paths if os.path.exists(p)]
    if not quiet:
        print(f"{name}: wrote " + ", ".join(written))
    return written
