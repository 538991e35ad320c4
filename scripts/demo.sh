#!/usr/bin/env bash
# One command: set up a fresh Debian 12 host, build strata and its guest image,
# start stratad on the embedded defaults (SQLite + a loop-mounted btrfs pool
# under /var/lib/strata) and walk through a demo: create, exec, snapshot,
# change, rewind, fork. The daemon keeps running afterwards; stop it with
# `kill $(cat /var/lib/strata/stratad.pid)`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

DATA_DIR="${STRATA_DATA_DIR:-/var/lib/strata}"
LISTEN="${STRATA_LISTEN:-127.0.0.1:7070}"
export STRATA_URL="http://$LISTEN"

bash scripts/setup.sh
echo "== build (release)" >&2
cargo build --release -p strata-agent -p strata-cli -p strata-daemon
BIN="$(realpath "${CARGO_TARGET_DIR:-target}")/release"

echo "== guest image (cached by recipe hash)" >&2
"$BIN/strata" image build >&2

mkdir -p "$DATA_DIR"
if [ -f "$DATA_DIR/stratad.pid" ] && kill -0 "$(cat "$DATA_DIR/stratad.pid")" 2>/dev/null; then
  echo "== stratad already running (pid $(cat "$DATA_DIR/stratad.pid"))" >&2
else
  echo "== starting stratad on $LISTEN (data: $DATA_DIR, log: $DATA_DIR/stratad.log)" >&2
  setsid "$BIN/stratad" --listen "$LISTEN" --data-dir "$DATA_DIR" >>"$DATA_DIR/stratad.log" 2>&1 < /dev/null &
  echo $! > "$DATA_DIR/stratad.pid"
fi
for _ in $(seq 1 120); do
  curl -fsS "$STRATA_URL/healthz" >/dev/null 2>&1 && break
  sleep 0.5
done
curl -fsS "$STRATA_URL/healthz" >/dev/null || { echo "stratad did not come up; see $DATA_DIR/stratad.log" >&2; exit 1; }
if [ -z "${STRATA_TOKEN:-}" ] && [ -r "$DATA_DIR/admin.token" ]; then
  STRATA_TOKEN="$(cat "$DATA_DIR/admin.token")"; export STRATA_TOKEN
fi

S="$BIN/strata"
step() { printf '\n\033[1m$ %s\033[0m\n' "$*" >&2; }

step "strata template ls   # the default template is built on first start (one cold boot)"
"$S" template ls
step "strata create --label demo=yes"
ID="$("$S" --json create --label demo=yes | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"
echo "$ID"
step "strata exec $ID -- uname -a"
"$S" exec "$ID" -- uname -a
step "strata exec $ID -- sh -c 'echo first > /root/notes.txt'"
"$S" exec "$ID" -- sh -c 'echo first > /root/notes.txt; cat /root/notes.txt'
step "strata snapshot $ID --label before-change"
SNAP="$("$S" --json snapshot "$ID" --label before-change | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"
echo "$SNAP"
step "strata exec $ID -- sh -c 'rm /root/notes.txt; echo changed > /root/other.txt'"
"$S" exec "$ID" -- sh -c 'rm /root/notes.txt; echo changed > /root/other.txt; ls /root'
step "strata rewind $ID --to $SNAP"
"$S" rewind "$ID" --to "$SNAP"
step "strata exec $ID -- cat /root/notes.txt   # back"
"$S" exec "$ID" -- cat /root/notes.txt
step "strata fork $ID"
FORK="$("$S" --json fork "$ID" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("id") or d.get("sandbox",{}).get("id"))')"
echo "$FORK"
step "strata exec $FORK -- sh -c 'hostname; cat /root/notes.txt'"
"$S" exec "$FORK" -- sh -c 'hostname; cat /root/notes.txt'
step "strata snapshots $ID"
"$S" snapshots "$ID"
step "strata ls"
"$S" ls
step "strata stats"
"$S" stats || true

cat >&2 <<MSG

Demo done. stratad keeps running (pid $(cat "$DATA_DIR/stratad.pid"), API $STRATA_URL).
  export STRATA_URL=$STRATA_URL${STRATA_TOKEN:+ STRATA_TOKEN=\$(cat $DATA_DIR/admin.token)}
  $BIN/strata ls
Stop it: kill \$(cat $DATA_DIR/stratad.pid)   (VMs keep running and are adopted on the next start)
MSG
