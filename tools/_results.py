"""The one result writer of the benchmarks (tools/bench_*.py) and model blocks (tools/block_*.py).

* :func:`write_results` writes ``<name>.json`` (the figures, with a ``run`` record when given),
  ``<name>.md`` (the table) and ``<name>.png`` (a plot, drawn last: a plotting error, or no
  matplotlib, loses no figure) into a folder;
* :func:`run_record` is that record: UTC date, source revision, command line, machine;
* :func:`md_row` and :func:`cell` format table rows; :func:`pyplot` gives matplotlib's pyplot on a
  file backend; :func:`save` writes and closes a figure.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence


def git_revision() -> str:
    """The source revision to record with a result: ``$COMMKIT_GIT_REV`` if set (a GPU machine's copy
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


def utc_now(fmt: str = "%Y-%m-%d %H:%M UTC") -> str:
    """The current UTC time as ``fmt`` (``"iso"``: ISO 8601 to the second)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.isoformat(timespec="seconds") if fmt == "iso" else now.strftime(fmt)


def command_line(prog: str, argv: Optional[Sequence[str]] = None) -> str:
    """``prog`` followed by ``argv`` (default: this process's arguments), as the run was asked for."""
    return " ".join([prog] + list(sys.argv[1:] if argv is None else argv))


def machine() -> Dict[str, object]:
    """Host name, Python, torch and the GPUs torch sees (names only; none without CUDA)."""
    info: Dict[str, object] = dict(host=socket.gethostname(), python=platform.python_version())
    try:
        import torch

        info["torch"] = torch.__version__
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(n)]
    except ImportError:
        pass
    return info


def run_record(command: str) -> Dict[str, object]:
    """What a result file says about its run: date, revision, command and machine."""
    return dict(date=utc_now(), revision=git_revision(), command=command, machine=machine())


def cell(value: Optional[float], digits: int = 1, missing: str = "-") -> str:
    """A number for a table cell: ``digits`` decimals, or ``missing`` for None."""
    return missing if value is None else f"{value:.{digits}f}"


def md_row(cells: Sequence[object]) -> str:
    """One markdown table row of ``cells``."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def out_dir(path: str) -> str:
    """``path`` made absolute and created: the folder a run writes its results into (a relative
    path would move with a later ``chdir``)."""
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    return path


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only); ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str, dpi: int = 110) -> None:
    """Write ``fig`` to ``path`` and release it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def write_results(out: str, name: str, data: dict, table: str, plot: Optional[Callable[[str], object]] = None,
                  quiet: bool = False, run: Optional[dict] = None) -> List[str]:
    """Writes ``<name>.json`` (``data``, plus ``run`` under the key ``"run"`` when given), ``<name>.md``
    (``table``, markdown) and ``<name>.png`` (drawn by ``plot(path)``, which may decline, e.g. without
    matplotlib) into ``out`` (created; made absolute); prints and returns the paths that now exist.

    Raises:
        OSError: the folder or a file cannot be written (a plotting error is printed, not raised).
    """
    out = out_dir(out)
    paths = [os.path.join(out, f"{name}.{ext}") for ext in ("json", "md", "png")]
    with open(paths[0], "w") as f:
        json.dump(data if run is None else dict(data, run=run), f, indent=1, default=str)
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
