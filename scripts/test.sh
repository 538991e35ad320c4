#!/usr/bin/env bash
# One command: set up a fresh Debian 12 host and run strata's whole test suite.
#   sudo scripts/test.sh            # everything
#   sudo scripts/test.sh -p stratad # extra args go to `cargo test`
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
# A clean clone builds once: incremental state would only take disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

bash scripts/setup.sh

echo "== lint" >&2
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings

echo "== build (agent + CLI, release)" >&2
cargo build --release -p strata-agent -p strata-cli

echo "== guest image (cached by recipe hash under /var/cache/strata/images)" >&2
"${CARGO_TARGET_DIR:-target}/release/strata" image build

echo "== previous release's guest agent (cached under /var/cache/strata/compat)" >&2
# Built once per release from the commit in tests/compat/PREVIOUS_RELEASE; the
# compatibility test (crates/strata-runtime/tests/compat.rs) boots it.
bash scripts/previous-release.sh >/dev/null

# Templates built from recipes by the tests (the code interpreter's among
# them) are cached by recipe hash here and shared by every test daemon.
export STRATA_TEMPLATE_CACHE="${STRATA_TEMPLATE_CACHE:-/var/cache/strata/templates}"

# Every phase's output is kept under $STRATA_TEST_LOGS; the last lines this
# script prints are a summary of the phases run (counts parsed from the logs),
# also when a phase fails and the run stops there.
logs="${STRATA_TEST_LOGS:-/tmp/strata-test-logs}"
rm -rf "$logs" && mkdir -p "$logs"
summary=()
note() { summary+=("$1"); }
print_summary() {
  local rc=$1
  echo "== summary (logs in $logs)" >&2
  local line
  for line in "${summary[@]}"; do echo "$line"; done
  if [ "$rc" -eq 0 ]; then echo "strata test suite: PASSED"; else echo "strata test suite: FAILED (exit $rc)"; fi
}
# Counts from a cargo test log: the sum of its "test result:" lines.
cargo_counts() {
  awk '/^test result:/ { for (i = 1; i <= NF; i++) { v = $i + 0;
         if ($(i+1) ~ /^passed/) p += v; if ($(i+1) ~ /^failed/) f += v; if ($(i+1) ~ /^ignored/) g += v } n++ }
       END { printf "%d passed; %d failed; %d ignored (%d test binaries)", p, f, g, n }' "$1"
}
# Runs a phase with its output shown and kept in $logs/<name>.log.
phase() {
  local name=$1; shift
  "$@" 2>&1 | tee "$logs/$name.log"
}

echo "== PostgreSQL for the store tests (a throwaway cluster, removed on exit; docs/store.md)" >&2
pg_dir=$(bash scripts/test-pg.sh start)
trap 'rc=$?; bash scripts/test-pg.sh stop "$pg_dir"; print_summary "$rc"' EXIT
# Set: the PostgreSQL variants of the store tests must reach it (never skipped).
STRATA_TEST_PG_URL=$(cat "$pg_dir/url")
export STRATA_TEST_PG_URL

echo "== Kubernetes manifests: rendered with kubectl kustomize, validated offline against bundled schemas (docs/kubernetes.md)" >&2
status=0
phase k8s bash scripts/k8s-validate.sh || status=$?
note "kubernetes manifests: $(grep -E '^k8s-validate: ok' "$logs/k8s.log" | sed 's/^k8s-validate: //')"
[ "$status" -eq 0 ] || exit "$status"

echo "== the mcp SDK from PyPI for the MCP gateway tests (cached under /var/cache/strata/venv)" >&2
bash scripts/mcp-venv.sh >/dev/null
echo "== the e2b SDKs from PyPI (crates/stratad/tests/cluster_e2b.rs drives them in cargo test)" >&2
bash scripts/e2b-venv.sh >/dev/null

echo "== tests" >&2
# Integration tests boot real guests under TCG; on 2 cores run test binaries one at a time.
status=0
phase cargo-test cargo test --workspace --no-fail-fast "$@" -- --test-threads=2 || status=$?
counts=$(cargo_counts "$logs/cargo-test.log")
if [ "$status" -eq 0 ]; then note "test result: ok. $counts"; else note "test result: FAILED. $counts"; fi
if [ "$status" -ne 0 ]; then
  note "cargo test failures: $(grep -E '^test .* \.\.\. FAILED$' "$logs/cargo-test.log" | sed -E 's/^test (.*) \.\.\. FAILED$/\1/' | sort -u | paste -sd ' ' | cut -c1-2000)"
  exit "$status"
fi

echo "== E2B SDK compatibility: the unmodified e2b package from PyPI against stratad --e2b" >&2
status=0
phase e2b-python bash crates/strata-e2b/tests/run-python.sh || status=$?
note "e2b python SDK (pytest): $(grep -E '^=+ .*(passed|failed|error).* =+$' "$logs/e2b-python.log" | tail -1 | tr -d '=' | xargs)"
[ "$status" -eq 0 ] || exit "$status"

echo "== E2B JS SDK: the unmodified e2b package from npm, node --test (crates/strata-e2b/tests/js)" >&2
status=0
phase e2b-js bash crates/strata-e2b/tests/js/run-js.sh || status=$?
note "e2b JS SDK (node --test): $(grep -E '^(# |ℹ )(pass|fail) ' "$logs/e2b-js.log" | paste -sd ' ' | sed -E 's/(# |ℹ )//g')"
[ "$status" -eq 0 ] || exit "$status"

echo "== web console: end-to-end in headless chromium (tests/console, docs/console.md)" >&2
status=0
phase console bash scripts/run-console.sh || status=$?
note "web console (chromium, node --test): $(grep -E '^(# |ℹ )(pass|fail) ' "$logs/console.log" | paste -sd ' ' | sed -E 's/(# |ℹ )//g')"
[ "$status" -eq 0 ] || exit "$status"

echo "== fuzz: ${STRATA_FUZZ_SECONDS:-60} s per target (docs/fuzzing.md; libFuzzer's output in $logs/fuzz.log)" >&2
status=0
bash scripts/fuzz.sh "${STRATA_FUZZ_SECONDS:-60}" >"$logs/fuzz.log" 2>&1 || status=$?
grep -E '^fuzz: |^==[0-9]+==|panicked|SUMMARY' "$logs/fuzz.log" >&2 || true
note "fuzz: $(grep -E '^fuzz: (FAILED|[0-9]+ targets)' "$logs/fuzz.log" | tail -1 | sed 's/^fuzz: //')"
[ "$status" -eq 0 ] || exit "$status"

echo "== API fuzz: schemathesis against the served OpenAPI document, ${STRATA_API_FUZZ_SECONDS:-60} s (docs/fuzzing.md)" >&2
status=0
phase api-fuzz bash scripts/api-fuzz.sh "${STRATA_API_FUZZ_SECONDS:-60}" || status=$?
note "API fuzz (schemathesis; examples+coverage+fuzzing, then stateful): $(grep -E '^ *[0-9]+ generated' "$logs/api-fuzz.log" | xargs | sed 's/ skipped / skipped; /g')"
[ "$status" -eq 0 ] || exit "$status"
