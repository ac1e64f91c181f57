"""Summarizes bench/stmt/run.sh's samples.jsonl: medians per cell and side,
the median of the per-pair ratios candidate / base, and the pgbench floor.
Usage: python3 bench/stmt/summary.py samples.jsonl"""
import json
import statistics
import sys
from collections import defaultdict

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
by = defaultdict(dict)  # (cell, pair) -> side -> sample
floor = defaultdict(list)  # clients -> rows
for r in rows:
    if r["side"] == "floor":
        floor[r["clients"]].append(r)
    else:
        by[(r["sample"]["cell"], r["pair"])][r["side"]] = r["sample"]

COUNTERS = ["cpu_db_ms", "cpu_app_ms", "statements", "wal_bytes", "wal_records"]
cells = sorted({c for c, _ in by})
print("| cell | measure | base (median) | candidate (median) | ratio (median of pairs) |")
print("| --- | --- | ---: | ---: | ---: |")
for cell in cells:
    pairs = [v for (c, _), v in sorted(by.items()) if c == cell and len(v) == 2]
    for m in ["rate"] + COUNTERS:
        get = (lambda s: s["rate"]) if m == "rate" else (lambda s, m=m: s["counters"][m])
        b = [get(p["base"]) for p in pairs]
        c = [get(p["cand"]) for p in pairs]
        ratios = [y / x for x, y in zip(b, c) if x]
        print(f"| `{cell}` | {m} | {statistics.median(b):.4g} | {statistics.median(c):.4g} | "
              f"{statistics.median(ratios):.3f} |" if ratios else f"| `{cell}` | {m} | – | – | – |")
print()
print("| pgbench floor (single-row insert transactions) | tps (median) | PostgreSQL CPU ms per transaction (median) |")
print("| --- | ---: | ---: |")
for c, rs in sorted(floor.items()):
    print(f"| {c} client(s), {len(rs)} runs of 8 s | {statistics.median(r['tps'] for r in rs):,.0f} | "
          f"{statistics.median(r['cpu_db_ms'] for r in rs):.4f} |")
