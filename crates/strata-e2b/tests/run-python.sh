#!/usr/bin/env bash
# Runs the e2b SDK test suite (tests/python) against a real strata daemon:
# builds stratad and starts it with the E2B door (`--e2b`; auth on,
# STRATA_TOKEN = its admin token; real QEMU guests, btrfs pool in a
# loop-mounted image), points the unmodified `e2b` package from PyPI at it,
# runs pytest, then stops the daemon, kills its QEMUs by pid and unmounts
# the pool. Needs root (loop mount), python3-venv, network for PyPI.
#
#   crates/strata-e2b/tests/run-python.sh [pytest args…]
#   BENCH=10 crates/strata-e2b/tests/run-python.sh   # also the latency bench
#
# Env: PORT (default 47983), SCRATCH (/tmp/strata-e2b-py), RUN_DIR
# (/tmp/se2b-run, short: unix socket paths), VENV (/tmp/strata-e2b-venv),
# CARGO_TARGET_DIR (where the binary is built), KEEP=1 keeps the data dir,
# STRATA_E2B_RUNNER: a command run (with the args) in place of pytest, no venv
# made — js/run-js.sh runs the JS SDK suite so.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
PORT="${PORT:-47983}"
SCRATCH="${SCRATCH:-/tmp/strata-e2b-py}"
RUN_DIR="${RUN_DIR:-/tmp/se2b-run}"
VENV="${VENV:-/tmp/strata-e2b-venv}"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
API_KEY="e2b_strata_test_key"
# A second key with its own tenant and actor, and a small upload limit (the
# bounds tests read both from the environment).
TENANT_KEY="e2b_strata_acme_key"
MAX_UPLOAD=8388608
URL="http://127.0.0.1:$PORT"

log() { echo "run-python: $*" >&2; }

(cd "$ROOT" && cargo build -p strata-daemon --bin stratad)
BIN="$TARGET/debug/stratad"

# The image of this tree's agent (cached by recipe hash), named explicitly:
# the daemon's default is the newest image of the cache, which may be another
# test's (the previous release's agent, a fixture image).
if [ -z "${IMAGE_DIR:-}" ]; then
  (cd "$ROOT" && cargo build --release -p strata-agent -p strata-cli)
  IMAGE_DIR="$(cd "$ROOT" && "$TARGET/release/strata" image build --json \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["dir"])')"
  log "image: $IMAGE_DIR"
fi

if [ -z "${STRATA_E2B_RUNNER:-}" ]; then
  VENV="$VENV" bash "$ROOT/scripts/e2b-venv.sh" >/dev/null
fi

mkdir -p "$SCRATCH" "$RUN_DIR"
DAEMON_PID=""
cleanup() {
  set +e
  if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill -TERM "$DAEMON_PID"
    for _ in $(seq 1 50); do kill -0 "$DAEMON_PID" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$DAEMON_PID" 2>/dev/null
  fi
  # The daemon leaves VMs running (as stratad does): kill ours by pid.
  for f in "$RUN_DIR"/*/qemu.pid; do
    [ -f "$f" ] || continue
    pid="$(cat "$f")"
    if [ -n "$pid" ] && grep -q qemu "/proc/$pid/cmdline" 2>/dev/null; then
      kill -KILL "$pid" 2>/dev/null
    fi
  done
  sleep 0.5
  if mountpoint -q "$SCRATCH/pool" 2>/dev/null; then
    umount "$SCRATCH/pool" || umount -l "$SCRATCH/pool"
  fi
  for dev in $(losetup -j "$SCRATCH/pool.img" -O NAME -n 2>/dev/null); do losetup -d "$dev"; done
  if [ "${KEEP:-0}" != 1 ]; then rm -rf "$SCRATCH" "$RUN_DIR"; fi
}
trap cleanup EXIT

log "starting stratad --e2b on $URL (log: $SCRATCH/daemon.log)"
printf 'max_upload_bytes = %s\n' "$MAX_UPLOAD" >"$SCRATCH/stratad.toml"
# test_code_interpreter.py builds the code-interpreter template from its
# recipe (pip through the builder's egress proxy). Where the registries'
# names resolve to non-public addresses (this host: a TLS-inspecting gateway
# in a documentation range), the operator names them, or the proxy refuses.
RANGES="$(python3 -c '
import ipaddress, socket
out = []
for h in ("pypi.org", "files.pythonhosted.org"):
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(h, 443, socket.AF_INET)}
    except OSError:
        addrs = set()
    for a in sorted(addrs):
        ip = ipaddress.ip_address(a)
        if not ip.is_global and f"\"{a}/32\"" not in out:
            out.append(f"\"{a}/32\"")
print(", ".join(out))')"
if [ -n "$RANGES" ]; then
  printf '[security]\negress_resolved_ranges = [%s]\n' "$RANGES" >>"$SCRATCH/stratad.toml"
fi
# test_templates.py builds through the E2B door: its builds trust the host's
# CA bundle (where registry TLS is re-signed by a local CA).
if [ -r /etc/ssl/certs/ca-certificates.crt ]; then
  printf '[e2b]\ntemplate_ca_bundle = "/etc/ssl/certs/ca-certificates.crt"\n' >>"$SCRATCH/stratad.toml"
fi
export STRATA_BIN="${STRATA_BIN:-$TARGET/release/strata}"
RUST_LOG="${RUST_LOG:-info}" "$BIN" --config "$SCRATCH/stratad.toml" --listen "127.0.0.1:$PORT" --data-dir "$SCRATCH" --key-dir "$SCRATCH/keys" \
  --run-dir "$RUN_DIR" --accel "${ACCEL:-tcg}" --pool-size-gib 16 --e2b \
  --e2b-api-key "$API_KEY" --e2b-api-key "$TENANT_KEY=acme:sdk-bot" \
  ${IMAGE_DIR:+--image-dir "$IMAGE_DIR"} >"$SCRATCH/daemon.log" 2>&1 &
DAEMON_PID=$!

for i in $(seq 1 600); do
  if curl -fsS "$URL/healthz" >/dev/null 2>&1; then break; fi
  kill -0 "$DAEMON_PID" 2>/dev/null || { tail -50 "$SCRATCH/daemon.log"; log "daemon died"; exit 1; }
  sleep 1
done
log "waiting for the default template"
for i in $(seq 1 400); do
  auth=()
  [ -r "$SCRATCH/admin.token" ] && auth=(-H "Authorization: Bearer $(cat "$SCRATCH/admin.token")")
  st="$(curl -fsS "${auth[@]}" "$URL/v1/templates" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(" ".join(t["status"] for t in d.get("items", d if isinstance(d, list) else [])))' 2>/dev/null || true)"
  case "$st" in *ready*) break ;; *failed*) tail -50 "$SCRATCH/daemon.log"; log "template build failed"; exit 1 ;; esac
  kill -0 "$DAEMON_PID" 2>/dev/null || { tail -50 "$SCRATCH/daemon.log"; log "daemon died"; exit 1; }
  sleep 1
done
case "$st" in *ready*) log "template ready after ${i}s" ;; *) tail -50 "$SCRATCH/daemon.log"; log "no ready template after ${i}s"; exit 1 ;; esac

export E2B_API_URL="$URL" E2B_SANDBOX_URL="$URL" E2B_API_KEY="$API_KEY" E2B_DEBUG=false
export E2B_TENANT_KEY="$TENANT_KEY" STRATA_MAX_UPLOAD_BYTES="$MAX_UPLOAD"
STRATA_TOKEN="$(cat "$SCRATCH/admin.token" 2>/dev/null || true)"; export STRATA_TOKEN
unset E2B_DOMAIN E2B_ACCESS_TOKEN || true
status=0
if [ -n "${STRATA_E2B_RUNNER:-}" ]; then
  $STRATA_E2B_RUNNER "$@" || status=$?
else
  (cd "$HERE/python" && "$VENV/bin/pytest" -v -p no:cacheprovider "$@") || status=$?
fi
if [ -n "${BENCH:-}" ]; then
  log "bench: $BENCH x (Sandbox.create + commands.run('true'), fork(count=4)); beside /v1: strata-bench --only sdk"
  (cd "$HERE/python" && "$VENV/bin/python" bench.py "$BENCH") || status=$?
fi
exit $status
