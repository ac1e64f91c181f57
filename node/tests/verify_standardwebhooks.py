"""Verifies webhook requests recorded by the node's tests with the official
Standard Webhooks Python package (pip: standardwebhooks).

Usage: verify_standardwebhooks.py FILE.json
FILE.json holds [{"secret": "whsec_...", "body": "...", "headers": {...},
"received_at": UNIX_SECONDS}, ...]. With `received_at` a request is verified
as of the moment it was received (the package checks the timestamp against
its clock's now, within 5 minutes, as a receiver does on arrival), not as of
this check, which a long test run may reach later.
Exits 1 if any request fails verification, printing which.
"""
import json
import sys
from datetime import datetime

from standardwebhooks import webhooks
from standardwebhooks.webhooks import Webhook


class _At(datetime):
    """`datetime` whose `now` is the request's receive time."""

    at = None

    @classmethod
    def now(cls, tz=None):
        if cls.at is None:
            return datetime.now(tz)
        return datetime.fromtimestamp(cls.at, tz)


webhooks.datetime = _At


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        requests = json.load(f)
    failed = 0
    for r in requests:
        headers = {k: v for k, v in r["headers"].items() if k.startswith("webhook-")}
        _At.at = r.get("received_at")
        try:
            Webhook(r["secret"]).verify(r["body"], headers)
        except Exception as e:  # noqa: BLE001 - report every failure
            failed += 1
            print(f"FAILED {headers.get('webhook-id')}: {e!r}")
    print(f"{len(requests) - failed} of {len(requests)} requests verified by standardwebhooks")
    return 1 if failed or not requests else 0


if __name__ == "__main__":
    sys.exit(main())
