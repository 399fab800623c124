#!/usr/bin/env bash
# Sets up the machine (tools/setup_env.sh: which Python environment and torch, and what it installs
# when something is missing) and runs every package's test suite with that environment's Python.
#   bash tools/test.sh [pytest args...]      (e.g. -q tests/tools: with a path, only that path runs)
# GPU tests skip where there is no GPU. Fails when pytest collects no test.
set -euo pipefail
# shellcheck source=tools/setup_env.sh
source "$(dirname "$0")/setup_env.sh"
cd "$COMMKIT_ROOT"
where=(tests)
for arg in "$@"; do
  case "$arg" in -*) ;; *) [ -e "${arg%%::*}" ] && where=() ;; esac
done
set +e
"$COMMKIT_PYTHON" -m pytest "${where[@]}" "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "pytest collected no test: failing" >&2
  exit 1
fi
exit $rc
