#!/usr/bin/env bash
# The label listing at 1,000,000 records on PostgreSQL, schema 16 (join to
# `sandboxes`) against schema 17 (label rows carry the record), in one run
# on one server (docs/cluster.md "Measured"). Plain psql and pgbench; the
# schema SQL is read from crates/stratad/src/store/postgres/schema.rs.
#   d=$(STRATA_TEST_PG_FSYNC=on scripts/test-pg.sh start)
#   PGHOST=$d PGPORT=55432 PGUSER=strata PGDATABASE=postgres scripts/pg-label-ab.sh
#   scripts/test-pg.sh stop "$d"
# Uses the schema `label_ab` (dropped at the end); about 1.5 GB of disk.
set -euo pipefail
cd "$(dirname "$0")/.."
S=label_ab
schema_rs=crates/stratad/src/store/postgres/schema.rs
v14=$(awk '/^const V14: &str = r#"/{f=1;next} f&&/^"#;/{f=0} f' "$schema_rs")
v17=$(awk '/^const V17: &str = r#"/{f=1;next} f&&/^"#;/{f=0} f' "$schema_rs")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; psql -q -c "DROP SCHEMA IF EXISTS $S CASCADE" >/dev/null 2>&1 || true' EXIT

seed() { # schema 16 with the bench's records (strata-bench `scale`)
  psql -q -c "DROP SCHEMA IF EXISTS $S CASCADE" -c "CREATE SCHEMA $S" 2>/dev/null
  { echo "SET search_path=$S;"; echo "$v14"
    echo "CREATE INDEX sandboxes_live_by_tenant ON sandboxes (tenant_id, created_at, id) WHERE state != 'deleted';"
    echo "DROP INDEX sandboxes_by_tenant;"; } | psql -q -v ON_ERROR_STOP=1
  psql -q -v ON_ERROR_STOP=1 <<SQL
SET search_path=$S;
INSERT INTO sandboxes (id, tenant_id, vcpus, memory_mib, disk_gib, labels, state, created_at,
    updated_at, last_activity_at, pid, deleted_at, version)
SELECT 'sb-' || lpad(i::text, 8, '0') || substr(md5(i::text), 1, 4), 'default', 2, 2048, 10,
  '{"team":"t' || (i % 50) || '"}',
  CASE WHEN i + 10000 >= 1000000 THEN 'running' WHEN i < 500000 THEN 'deleted'
       WHEN i % 5 = 0 THEN 'paused' ELSE 'hibernated' END,
  1765000000000 + i::bigint * 1000, 1765000000000 + i::bigint * 1000, 1765000000000 + i::bigint * 1000,
  CASE WHEN i + 10000 >= 1000000 THEN 1 END,
  CASE WHEN i < 500000 THEN 1765000000000 + i::bigint * 1000 END, 0
FROM generate_series(0, 999999) i;
INSERT INTO sandbox_labels (sandbox_id, key, value, tenant_id, created_at)
SELECT id, 'team', labels::json->>'team', tenant_id, created_at FROM sandboxes
WHERE state != 'deleted' ORDER BY id;
ANALYZE;
SQL
}
migrate() { # $1: the migration's SQL
  local t0; t0=$(date +%s.%N)
  { echo "SET search_path=$S; BEGIN;"; echo "$1"; echo "COMMIT;"; } | psql -q -v ON_ERROR_STOP=1
  echo "migration 17: $(echo "$(date +%s.%N) - $t0" | bc) s"
}
run() { # name sql: EXPLAIN (ANALYZE, BUFFERS) x100, execution time percentiles
  for _ in $(seq 100); do echo "EXPLAIN (ANALYZE, BUFFERS) $2;"; done >"$tmp/q.sql"
  psql -q -At -v ON_ERROR_STOP=1 -c "SET search_path=$S" -f "$tmp/q.sql" >"$tmp/out.txt"
  grep 'Execution Time' "$tmp/out.txt" | awk '{print $3}' | sort -n | awk -v n="$1" \
    '{a[NR]=$1} END {printf "%-52s p50 %.3f p95 %.3f p99 %.3f max %.3f ms", n, a[int(NR*0.5)], a[int(NR*0.95)], a[int(NR*0.99)], a[NR]}'
  echo "  | $(grep -m1 -E 'Index|Scan' "$tmp/out.txt" | sed 's/ (cost.*//;s/^ *//;s/->  //') | first run $(grep -m1 'Buffers' "$tmp/out.txt" | sed 's/^ *//')"
}
client() { # name sql (with :t, a random team number): pgbench, 1000 transactions
  printf '\\set t random(0, 49)\nSET search_path=%s;\n%s;\n' "$S" "$2" >"$tmp/pgb.sql"
  (cd "$tmp" && pgbench -n -f pgb.sql -t 1000 -l --log-prefix=pgb >/dev/null 2>&1)
  cat "$tmp"/pgb.* | awk '{print $3/1000}' | sort -n | awk -v n="$1" \
    '{a[NR]=$1} END {printf "client %-45s p50 %.3f p95 %.3f p99 %.3f ms\n", n, a[int(NR*0.5)], a[int(NR*0.95)], a[int(NR*0.99)]}'
  rm -f "$tmp"/pgb.*
}
command -v pgbench >/dev/null || PATH=/usr/lib/postgresql/15/bin:$PATH
COLS="sandbox_id, tenant_id, template_id, source_snapshot_id, vcpus, memory_mib, disk_gib, labels, \
state, state_reason, pending_op, idle_timeout_s, snapshot_interval_s, created_at, updated_at, \
last_activity_at, pid, accel, deleted_at, version"
JOIN="SELECT s.* FROM sandbox_labels l JOIN sandboxes s ON s.id = l.sandbox_id WHERE l.tenant_id = 'default' \
AND l.key = 'team' AND l.value = 't7' AND s.tenant_id = l.tenant_id AND s.state != 'deleted' \
ORDER BY l.created_at, l.sandbox_id LIMIT 101"
NEW="SELECT $COLS FROM sandbox_labels WHERE tenant_id = 'default' AND key = 'team' AND value = 't7' \
AND state != 'deleted' ORDER BY created_at, sandbox_id LIMIT 101"
FIRST="SELECT s.* FROM sandboxes s WHERE s.tenant_id = 'default' AND s.state != 'deleted' ORDER BY s.created_at, s.id LIMIT 101"
GETID="'sb-00500000$(echo -n 500000 | md5sum | cut -c1-4)'"
CUR="1765749999000, 'sb-00749999$(echo -n 749999 | md5sum | cut -c1-4)'"
common() {
  run "get by id" "SELECT * FROM sandboxes WHERE id = $GETID"
  run "list, first page of 100" "$FIRST"
  run "list, page half-way (cursor)" "SELECT s.* FROM sandboxes s WHERE s.tenant_id = 'default' \
AND s.state != 'deleted' AND (s.created_at, s.id) > ($CUR) ORDER BY s.created_at, s.id LIMIT 101"
  run "list state=running" "SELECT s.* FROM sandboxes s WHERE s.tenant_id = 'default' \
AND s.state IN ('running') ORDER BY s.created_at, s.id LIMIT 101"
}
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
seed
echo "== schema 16"
common
run "list label team=t7 (join)" "$JOIN"
client "label team=tN (join)" "${JOIN//\'t7\'/\'t\' || :t}"
client "first page" "$FIRST"
migrate "$v17"
echo "== schema 17 (label rows as the migration lays them out)"
common
run "list label team=t7 (label rows alone)" "$NEW"
run "list label team=t7 (the schema-16 join)" "$JOIN"
client "label team=tN (label rows alone)" "${NEW//\'t7\'/\'t\' || :t}"
client "first page" "$FIRST"
echo "== schema 17, label rows in creation order (as the daemon writes them)"
seed
migrate "${v17//ORDER BY s.tenant_id, l.key, l.value, s.created_at, l.sandbox_id/ORDER BY l.sandbox_id}"
run "list label team=t7 (label rows alone)" "$NEW"
run "list label team=t7 (the schema-16 join)" "$JOIN"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
