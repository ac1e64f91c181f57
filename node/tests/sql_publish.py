"""Publishes with lanebus.publish() from Python (psycopg 3), inside the
application's own transactions, as node/tests/sql_publish.rs drives it.

Usage: sql_publish.py URL KEY COUNT TAG

Transaction i inserts the application's row app_orders(TAG-i) and publishes
event type TAG.order on KEY in the same transaction; every third one is
rolled back, the others committed and followed by lanebus.wake(). Prints
one JSON line per transaction: {"id": event id, "committed": bool}.
"""

import json
import sys

import psycopg


def main() -> None:
    url, key, count, tag = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with psycopg.connect(url, autocommit=True) as conn:
        for i in range(count):
            commit = i % 3 != 2
            with conn.transaction(force_rollback=not commit):
                conn.execute(
                    "INSERT INTO app_orders (id, source) VALUES (%s, %s)", (f"{tag}-{i}", tag)
                )
                row = conn.execute(
                    "SELECT lanebus.publish(%s, %s, %s::jsonb)",
                    (f"{tag}.order", key, json.dumps({"n": i, "from": tag})),
                ).fetchone()
            if commit:
                conn.execute("SELECT lanebus.wake()")
            print(json.dumps({"id": row[0], "committed": commit}), flush=True)


if __name__ == "__main__":
    main()
