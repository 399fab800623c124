"""Helpers shared by the tools/bench_*.py scripts."""
from __future__ import annotations

import os
import subprocess


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
