#!/usr/bin/env bash
# Fuzzes the HTTP API from its served OpenAPI document (docs/fuzzing.md):
# schemathesis (PyPI, pinned) against a real stratad with real guests,
# started and torn down by crates/strata-e2b/tests/run-python.sh. Phases:
# examples, coverage, fuzzing and stateful (it links the operations: create
# a sandbox, then snapshot, fork, exec, delete it ...) for N seconds in all
# (default 60). Fails on a server error, a response that breaks the
# document (status, content type, headers, schema), an invalid request
# accepted, a resource used after its delete or missing after its create,
# or an operation that answers without authentication.
#   scripts/api-fuzz.sh          # 60 s
#   scripts/api-fuzz.sh 600      # longer
# Reproduce a failure with the `st replay <id>` line it prints (same venv).
#
# Left out, and why: positive_data_acceptance (random path ids are unknown
# ids: 404 is the right answer); the guest port proxy
# (/v1/sandboxes/{id}/ports/...: its answers are the guest program's, a
# 502 when nothing listens); PUT /v1/template-files/{id} (a tar body,
# which schemathesis cannot generate); DELETE /v1/tokens/{id} (it revokes
# the run's own token, and every later request is a 401).
#
# Env: STRATA_ST_VENV (default /var/cache/strata/venv/schemathesis-<ver>),
# STRATA_API_FUZZ_SEED (replay a run), and run-python.sh's PORT, SCRATCH,
# RUN_DIR, KEEP.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

budget="${1:-${STRATA_API_FUZZ_SECONDS:-60}}"
case "$budget" in '' | *[!0-9]*) echo "api-fuzz: seconds must be a number, got '$budget'" >&2; exit 2 ;; esac

ST_VERSION=4.32.5
VENV="${STRATA_ST_VENV:-/var/cache/strata/venv/schemathesis-$ST_VERSION}"
if ! "$VENV/bin/st" --version 2>/dev/null | grep -q "$ST_VERSION"; then
  echo "api-fuzz: installing schemathesis==$ST_VERSION into $VENV" >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "schemathesis==$ST_VERSION"
fi

export STRATA_ST="$VENV/bin/st" STRATA_API_FUZZ_SECONDS="$budget"
PORT="${PORT:-47985}" SCRATCH="${SCRATCH:-/tmp/strata-api-fuzz}" RUN_DIR="${RUN_DIR:-/tmp/safz-run}" \
  STRATA_E2B_RUNNER="bash $ROOT/scripts/api-fuzz-run.sh" \
  bash "$ROOT/crates/strata-e2b/tests/run-python.sh"
