#!/usr/bin/env bash
# The API reference of the three packages, generated from their docstrings (Sphinx autodoc, Google-style
# sections through napoleon; docs/conf.py), warnings as errors:
#   bash tools/docs.sh [OUT]        (default build/docs/html, git-ignored; open OUT/index.html)
# It documents the packages that $PYTHON (default: COMMKIT_PYTHON as set by tools/setup_env.sh, else
# python3) imports: the installed ones, or the source trees on PYTHONPATH with their extensions built.
# Sphinx is used from that interpreter when it has it; otherwise pip installs it once into
# build/docs-deps, which is appended to sys.path (the interpreter's own packages, torch's dependencies
# among them, keep precedence).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-${COMMKIT_PYTHON:-python3}}
OUT=${1:-$ROOT/build/docs/html}
DEPS=$ROOT/build/docs-deps
if ! "$PY" -c "import sphinx" 2>/dev/null && ! PYTHONPATH="$DEPS" "$PY" -c "import sphinx" 2>/dev/null; then
  echo "[docs] installing sphinx into $DEPS"
  mkdir -p "$ROOT/build"
  "$PY" -m pip install -q --disable-pip-version-check --target "$DEPS" "sphinx>=7" >"$ROOT/build/docs-deps.log" 2>&1 \
    || { tail -20 "$ROOT/build/docs-deps.log" >&2; echo "[docs] could not install sphinx into $DEPS" >&2; exit 1; }
fi
rm -rf "$OUT"
# -E: read every docstring again (no cached environment), -W --keep-going: every warning fails the build.
"$PY" - "$DEPS" -E -W --keep-going -q -b html -d "$OUT/../doctrees" "$ROOT/docs" "$OUT" <<'PY'
import sys

sys.path.append(sys.argv[1])
from sphinx.cmd.build import main

sys.exit(main(sys.argv[2:]))
PY
echo "[docs] API reference: $OUT/index.html"
