#!/usr/bin/env bash
# Sets up a fresh machine (tools/setup_env.sh) and runs every package's test suite.
#   bash tools/test.sh [pytest args...]
# GPU tests skip where there is no GPU. Fails when pytest collects no test.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
cd "$COMMKIT_ROOT"
set +e
python -m pytest tests "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "pytest collected no test: failing" >&2
  exit 1
fi
exit $rc
