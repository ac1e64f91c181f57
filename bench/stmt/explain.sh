#!/usr/bin/env bash
# EXPLAIN (ANALYZE, BUFFERS) of store/src/postgres/sql/publish.sql for one
# unkeyed single-event batch (with its NOTIFY), prepared as sqlx prepares it: six executions
# under plan_cache_mode = auto (custom plans: planning time each time), then
# one with the generic plan. Usage: bench/stmt/explain.sh URL
# URL: a database with the lanebus schema (e.g. one a PgStore opened) and
# at least one handler; the events it inserts are left there.
set -euo pipefail
url=${1:?usage: explain.sh URL}
sql=$(cd "$(dirname "$0")/../.." && pwd)/store/src/postgres/sql/publish.sql
run() {
  local tag=$1
  echo "EXPLAIN (ANALYZE, BUFFERS, SUMMARY) EXECUTE p(ARRAY['explain-$tag-' || clock_timestamp()::text], '{issues.opened}', '{NULL}', '{7}', ARRAY[convert_to(repeat('x', 200), 'UTF8')], '{f}', '{NULL}', true);"
}
{
  echo "PREPARE p(text[], text[], text[], int[], bytea[], bool[], timestamptz[], bool) AS"
  grep -v '^\s*--' "$sql"
  echo ";"
  for i in 1 2 3 4 5 6; do run "auto$i"; done
  echo "SET plan_cache_mode = force_generic_plan;"
  run generic
} | psql -X -q "$url" | grep -E "Planning Time|Execution Time"
