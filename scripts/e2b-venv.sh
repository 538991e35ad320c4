#!/usr/bin/env bash
# The unmodified E2B SDKs from PyPI (the judges of the E2B door): a venv at
# $VENV (default /tmp/strata-e2b-venv) with the pinned e2b,
# e2b-code-interpreter and pytest, made when missing or of other versions.
# Used by crates/strata-e2b/tests/run-python.sh and, before `cargo test`, by
# scripts/test.sh (crates/stratad/tests/cluster_e2b.rs drives the SDK too).
set -euo pipefail
VENV="${VENV:-/tmp/strata-e2b-venv}"
E2B=2.63.0
E2B_CI=2.11.5
if [ ! -x "$VENV/bin/pytest" ] || ! "$VENV/bin/python" -c "import sys; from importlib.metadata import version as v; sys.exit(0 if v('e2b') == '$E2B' and v('e2b-code-interpreter') == '$E2B_CI' else 1)" 2>/dev/null; then
  echo "e2b-venv: creating virtualenv $VENV (e2b==$E2B, e2b-code-interpreter==$E2B_CI, pytest)" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "e2b==$E2B" "e2b-code-interpreter==$E2B_CI" pytest
fi
echo "$VENV/bin/python"
