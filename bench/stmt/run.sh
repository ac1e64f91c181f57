#!/usr/bin/env bash
# The per-call publish statement on PostgreSQL, base against candidate in
# one run (bench/results/stmt.md has the method and a run's numbers).
#
# Usage: bench/stmt/run.sh BASE_BENCH CANDIDATE_BENCH [PAIRS] [OUT]
#   BASE_BENCH, CANDIDATE_BENCH: lanebus-bench binaries of the two sides
#   (`cargo build -p lanebus-bench` at each ref, the binary copied out; a
#   debug build is enough: the counters are the database's).
# Starts its own PostgreSQL (scripts/pg-start) with pg_stat_statements
# tracking planning, runs PAIRS (default 3) alternating pairs of the
# fixed-work cell pg-count-publish-b1 (2,000 single-event publishes, one
# publisher) and of pg-publish-p8-b1 (8 publishers, 2 s + 8 s), reads
# pg_stat_statements after each sample (the sample resets it after its
# setup), then the pgbench floor: single-row insert transactions
# (bench/stmt/floor.sql) with 1 and 8 clients, 8 s each, PostgreSQL CPU
# from bench/stmt/pgcpu.sh. Writes OUT (default /tmp/stmt-run) with one
# line per sample in samples.jsonl and statements.txt.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
base=$(realpath "${1:?usage: run.sh BASE_BENCH CANDIDATE_BENCH [PAIRS] [OUT]}")
cand=$(realpath "${2:?usage: run.sh BASE_BENCH CANDIDATE_BENCH [PAIRS] [OUT]}")
pairs=${3:-3}
out=${4:-/tmp/stmt-run}
mkdir -p "$out/work"
: >"$out/samples.jsonl"
: >"$out/statements.txt"
pgdir=$(mktemp -d /tmp/pg-stmt-run.XXXX)
url=$("$root/scripts/pg-start" "$pgdir")
trap '"$root/scripts/pg-stop" "$pgdir" >/dev/null 2>&1 || true' EXIT
echo "pg_stat_statements.track_planning = on" >>"$pgdir/postgresql.conf"
bindir=$(dirname "$(ls -d /usr/lib/postgresql/*/bin/pg_ctl | tail -1)")
if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$bindir/pg_ctl" -D "$pgdir" -w restart -l "$pgdir/log" >/dev/null
else "$bindir/pg_ctl" -D "$pgdir" -w restart -l "$pgdir/log" >/dev/null; fi
hostport=${url#postgres://postgres@}; host=${hostport%%:*}; port=${hostport#*:}; port=${port%%/*}
psql_() { psql -X -q -h "$host" -p "$port" -U postgres "$@"; }
psql_ -d postgres -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"

spec() { # cell-json
  printf '{"cell":%s,"pg_url":"%s","pg_dir":"%s","work_dir":"%s/work"}' "$1" "$url" "$pgdir" "$out"
}
b1='{"name":"pg-count-publish-b1","kind":"count_publish","publishers":1,"batch":1,"handlers":1,"preload":2000,"warmup_s":0,"steady_s":0}'
p8='{"name":"pg-publish-p8-b1","kind":"publish","publishers":8,"batch":1,"handlers":1}'

sample() { # side binary cell-json pair
  local line
  line=$("$2" sample --spec "$(spec "$3")" 2>>"$out/stderr.log" | sed -n 's/^SAMPLE //p')
  echo "{\"side\":\"$1\",\"pair\":$4,\"sample\":$line}" >>"$out/samples.jsonl"
  {
    echo "== $1 pair $4 $(echo "$line" | grep -o '"cell":"[^"]*"')"
    psql_ -d postgres -c "
      SELECT calls, plans,
             round((total_plan_time / calls)::numeric, 4) AS plan_ms_per_call,
             round((total_exec_time / calls)::numeric, 4) AS exec_ms_per_call,
             round(((shared_blks_hit + shared_blks_read) / calls)::numeric, 1) AS blocks_per_call,
             round((wal_bytes / calls)::numeric, 0) AS wal_bytes_per_call,
             left(regexp_replace(query, '\s+', ' ', 'g'), 70) AS query
      FROM pg_stat_statements
      WHERE calls >= 100 AND query NOT LIKE '%pg_stat%'
      ORDER BY total_plan_time + total_exec_time DESC LIMIT 8"
  } >>"$out/statements.txt"
}

for ((p = 0; p < pairs; p++)); do
  for cell in "$b1" "$p8"; do
    if ((p % 2 == 0)); then order="base cand"; else order="cand base"; fi
    for side in $order; do
      if [ "$side" = base ]; then bin=$base; else bin=$cand; fi
      sample "$side" "$bin" "$cell" "$p"
    done
  done
done

# The floor: single-row insert transactions on the same server.
psql_ -d postgres -c "DROP DATABASE IF EXISTS floor" -c "CREATE DATABASE floor"
psql_ -d floor -c "CREATE TABLE floor_rows (id bigserial PRIMARY KEY, payload text NOT NULL, at timestamptz NOT NULL DEFAULT now())"
for ((p = 0; p < pairs; p++)); do
  for c in 1 8; do
    a=$("$here/pgcpu.sh" "$pgdir")
    res=$(pgbench -n -h "$host" -p "$port" -U postgres -M prepared -c "$c" -j "$(( c > 1 ? 2 : 1 ))" -T 8 -f "$here/floor.sql" floor 2>&1)
    sleep 1
    b=$("$here/pgcpu.sh" "$pgdir")
    tx=$(echo "$res" | awk '/number of transactions actually processed/ { split($NF, a, "/"); print a[1] }')
    tps=$(echo "$res" | awk '/^tps/ { print $3 }')
    echo "{\"side\":\"floor\",\"pair\":$p,\"clients\":$c,\"tx\":$tx,\"tps\":$tps,\"cpu_db_ms\":$(awk -v a="$a" -v b="$b" -v t="$tx" 'BEGIN { printf "%.4f", (b - a) * 10 / t }')}" >>"$out/samples.jsonl"
  done
done
python3 "$here/summary.py" "$out/samples.jsonl"
