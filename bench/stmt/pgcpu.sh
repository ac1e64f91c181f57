#!/usr/bin/env bash
# Prints the CPU ticks (USER_HZ, 100/s) used so far by a PostgreSQL cluster:
# the postmaster's own and its exited children's (utime, stime, cutime,
# cstime of /proc/PID/stat), plus its live children's utime and stime, as
# the harness counts them (bench/README.md, "Counters").
# Usage: bench/stmt/pgcpu.sh PGDATA
set -euo pipefail
pm=$(head -1 "${1:?usage: pgcpu.sh PGDATA}/postmaster.pid")
ticks() { awk '{ s = 0; for (i = 14; i <= 17; i++) s += $i; print s }' "/proc/$1/stat" 2>/dev/null || echo 0; }
live() { awk '{ print $14 + $15 }' "/proc/$1/stat" 2>/dev/null || echo 0; }
total=$(ticks "$pm")
for c in $(cat /proc/"$pm"/task/*/children 2>/dev/null); do
  total=$((total + $(live "$c")))
done
echo "$total"
