"""Verifies webhook requests recorded by the node's tests with the official
Standard Webhooks Python package (pip: standardwebhooks).

Usage: verify_standardwebhooks.py FILE.json
FILE.json holds [{"secret": "whsec_...", "body": "...", "headers": {...}}, ...].
Exits 1 if any request fails verification, printing which.
"""
import json
import sys

from standardwebhooks.webhooks import Webhook


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        requests = json.load(f)
    failed = 0
    for r in requests:
        headers = {k: v for k, v in r["headers"].items() if k.startswith("webhook-")}
        try:
            Webhook(r["secret"]).verify(r["body"], headers)
        except Exception as e:  # noqa: BLE001 - report every failure
            failed += 1
            print(f"FAILED {headers.get('webhook-id')}: {e!r}")
    print(f"{len(requests) - failed} of {len(requests)} requests verified by standardwebhooks")
    return 1 if failed or not requests else 0


if __name__ == "__main__":
    sys.exit(main())
