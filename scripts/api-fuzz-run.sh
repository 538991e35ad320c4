#!/usr/bin/env bash
# The schemathesis run of scripts/api-fuzz.sh, against the daemon
# run-python.sh started (E2B_API_URL, STRATA_TOKEN = its admin token).
set -euo pipefail
out="${SCRATCH:-/tmp/strata-api-fuzz}/schemathesis"
mkdir -p "$out"
config="$(cd "$(dirname "$0")" && pwd)/schemathesis.toml"
# schemathesis keeps its example database in the working directory.
cd "$out"
seed=()
[ -n "${STRATA_API_FUZZ_SEED:-}" ] && seed=(--seed "$STRATA_API_FUZZ_SEED")
exec "$STRATA_ST" --config-file "$config" run "$E2B_API_URL/v1/openapi.json" \
  -H "Authorization: Bearer $STRATA_TOKEN" \
  --max-time "$STRATA_API_FUZZ_SECONDS" --workers 1 \
  --phases examples,coverage,fuzzing,stateful \
  --checks all --exclude-checks positive_data_acceptance \
  --exclude-path-regex '^/v1/sandboxes/\{id\}/ports/' \
  --exclude-name 'PUT /v1/template-files/{id}' \
  --exclude-name 'DELETE /v1/tokens/{id}' \
  --request-timeout 120 --suppress-health-check all \
  --report junit --report-dir "$out" "${seed[@]}"
