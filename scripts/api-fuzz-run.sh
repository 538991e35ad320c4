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
# Two runs, each with the whole budget: schemathesis shares --max-time among
# its phases in order, and the stateful phase (it follows the document's
# links: a created sandbox's id into exec, snapshot, fork, delete ...) came
# last and got none of it.
common=(-H "Authorization: Bearer $STRATA_TOKEN"
  --max-time "$STRATA_API_FUZZ_SECONDS" --workers 1
  --checks all --exclude-checks positive_data_acceptance
  --exclude-path-regex '^/v1/sandboxes/\{id\}/ports/'
  --exclude-name 'PUT /v1/template-files/{id}'
  --exclude-name 'DELETE /v1/tokens/{id}'
  --request-timeout 120 --suppress-health-check all
  --report junit --report-dir "$out" "${seed[@]}")
echo "api-fuzz: examples, coverage, fuzzing (${STRATA_API_FUZZ_SECONDS}s)" >&2
# Both passes run whatever the first found; the script fails if either did.
first=0
"$STRATA_ST" --config-file "$config" run "$E2B_API_URL/v1/openapi.json" \
  --phases examples,coverage,fuzzing "${common[@]}" || first=$?
# STRATA_API_FUZZ_STATEFUL=0 skips the stateful pass (docs/fuzzing.md).
if [ "${STRATA_API_FUZZ_STATEFUL:-1}" = 0 ]; then
  echo "api-fuzz: stateful pass skipped (STRATA_API_FUZZ_STATEFUL=0)" >&2
  exit "$first"
fi
echo "api-fuzz: stateful, following the document's links (${STRATA_API_FUZZ_SECONDS}s)" >&2
second=0
"$STRATA_ST" --config-file "$config" run "$E2B_API_URL/v1/openapi.json" \
  --phases stateful "${common[@]}" || second=$?
[ "$first" -eq 0 ] || exit "$first"
exit "$second"
