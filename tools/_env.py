"""The environment settings of tools/env.sh (their one source) for Python code.

``settings()`` returns them as a dict; ``apply()`` puts them into ``os.environ`` (overriding what is
there, as sourcing env.sh does) so that NCCL, PyTorch and the processes a script starts see them.
The benchmarks call ``apply()`` before they start any process; tests/conftest.py and tests/_dist.py
read the same file.
"""
from __future__ import annotations

import os
import re
from typing import Dict, MutableMapping, Optional

ENV_SH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "env.sh")
_LINE = re.compile(r"^export ([A-Za-z_][A-Za-z0-9_]*)=([A-Za-z0-9_.,:/+-]*)$")


def settings(path: str = ENV_SH) -> Dict[str, str]:
    """The ``export NAME=VALUE`` lines of ``path``; ValueError naming the line for anything else."""
    out: Dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            m = _LINE.match(line)
            if m is None:
                raise ValueError(f"{path}:{number}: expected 'export NAME=VALUE' (plain value, no quotes "
                                 f"or expansions), got {line!r}")
            out[m.group(1)] = m.group(2)
    return out


def apply(environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """Set every setting of tools/env.sh in ``environ`` (default ``os.environ``); returns them."""
    values = settings()
    (os.environ if environ is None else environ).update(values)
    return values
