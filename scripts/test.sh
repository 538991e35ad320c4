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

echo "== PostgreSQL for the store tests (a throwaway cluster, removed on exit; docs/store.md)" >&2
pg_dir=$(bash scripts/test-pg.sh start)
trap 'bash scripts/test-pg.sh stop "$pg_dir"' EXIT
# Set: the PostgreSQL variants of the store tests must reach it (never skipped).
STRATA_TEST_PG_URL=$(cat "$pg_dir/url")
export STRATA_TEST_PG_URL

echo "== the mcp SDK from PyPI for the MCP gateway tests (cached under /var/cache/strata/venv)" >&2
bash scripts/mcp-venv.sh >/dev/null

echo "== tests" >&2
# Integration tests boot real guests under TCG; on 2 cores run test binaries one at a time.
cargo test --workspace --no-fail-fast "$@" -- --test-threads=2

echo "== E2B SDK compatibility: the unmodified e2b package from PyPI against stratad --e2b" >&2
bash crates/strata-e2b/tests/run-python.sh

echo "== E2B JS SDK: the unmodified e2b package from npm, node --test (crates/strata-e2b/tests/js)" >&2
bash crates/strata-e2b/tests/js/run-js.sh

echo "== web console: end-to-end in headless chromium (tests/console, docs/console.md)" >&2
bash scripts/run-console.sh

echo "== fuzz: ${STRATA_FUZZ_SECONDS:-60} s per target (docs/fuzzing.md)" >&2
bash scripts/fuzz.sh "${STRATA_FUZZ_SECONDS:-60}"

echo "== API fuzz: schemathesis against the served OpenAPI document, ${STRATA_API_FUZZ_SECONDS:-60} s (docs/fuzzing.md)" >&2
bash scripts/api-fuzz.sh "${STRATA_API_FUZZ_SECONDS:-60}"
