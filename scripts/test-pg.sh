#!/usr/bin/env bash
# A throwaway PostgreSQL 15 cluster for the store tests (docs/store.md).
#   dir=$(scripts/test-pg.sh start)   # prints its directory; $dir/url is the connection string
#   scripts/test-pg.sh stop "$dir"    # stops it and removes the directory
# The cluster is made by Debian's initdb in a temporary directory, owned by
# the `postgres` user (initdb refuses root), listens only on a unix socket in
# that directory (no TCP port, nothing else on the host can reach it) and
# trusts its one user `strata`. Debian's own `main` cluster is not touched.
set -euo pipefail
bin=/usr/lib/postgresql/15/bin
as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}
case "${1:-}" in
  start)
    [ -x "$bin/initdb" ] || { echo "test-pg: PostgreSQL 15 is not installed (apt-get install postgresql-15)" >&2; exit 1; }
    dir=$(mktemp -d /tmp/strata-pg.XXXXXX)
    chmod 0755 "$dir"
    [ "$(id -u)" = 0 ] && chown postgres: "$dir"
    port=${STRATA_TEST_PG_PORT:-55432}
    as_pg "$bin/initdb" -D "$dir/data" -A trust -U strata -E UTF8 --no-sync >"$dir/initdb.log" 2>&1 \
      || { cat "$dir/initdb.log" >&2; exit 1; }
    # fsync off: a test cluster, thrown away after the run (a benchmark sets
    # STRATA_TEST_PG_FSYNC=on to compare with SQLite's synchronous=FULL).
    fsync=${STRATA_TEST_PG_FSYNC:-off}
    as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/log" -w -t 60 \
      -o "-k $dir -p $port -c listen_addresses='' -c fsync=$fsync -c max_connections=200" start >/dev/null \
      || { cat "$dir/log" >&2; exit 1; }
    # A URL (what `[store] url` takes): the socket directory as the host,
    # percent-encoded.
    echo "postgresql://strata@${dir//\//%2F}:$port/postgres" >"$dir/url"
    echo "$dir"
    ;;
  stop)
    dir=${2:?usage: test-pg.sh stop DIR}
    case "$dir" in /tmp/strata-pg.*) ;; *) echo "test-pg: not a test cluster: $dir" >&2; exit 1 ;; esac
    as_pg "$bin/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null 2>&1 || true
    rm -rf "$dir"
    ;;
  *) echo "usage: $0 start | stop DIR" >&2; exit 2 ;;
esac
