// Verifies webhook requests recorded by the node's tests with the official
// Standard Webhooks JavaScript package (npm: standardwebhooks), pinned by
// package-lock.json beside this file (scripts/test runs `npm ci` here).
//
// Usage: node verify.mjs FILE.json SECRET
// FILE.json holds [{"body": "...", "headers": {...}}, ...], the requests as
// received; SECRET is the handler's signing secret (whsec_...).
// Exits 1 if any request fails verification (or there are none), naming it.
import { readFileSync } from "node:fs";
import standardwebhooks from "standardwebhooks";

const { Webhook } = standardwebhooks;
const [file, secret] = process.argv.slice(2);
if (!file || !secret) {
  console.error("usage: node verify.mjs FILE.json SECRET");
  process.exit(2);
}
const requests = JSON.parse(readFileSync(file, "utf8"));
const wh = new Webhook(secret);
let failed = 0;
for (const r of requests) {
  const headers = Object.fromEntries(
    Object.entries(r.headers).filter(([k]) => k.toLowerCase().startsWith("webhook-")),
  );
  try {
    const payload = wh.verify(r.body, headers);
    if (JSON.stringify(payload) !== JSON.stringify(JSON.parse(r.body))) {
      throw new Error("verified payload differs from the body");
    }
  } catch (e) {
    failed += 1;
    console.log(`FAILED ${headers["webhook-id"]}: ${e}`);
  }
}
console.log(
  `${requests.length - failed} of ${requests.length} requests verified by standardwebhooks (JavaScript)`,
);
process.exit(failed > 0 || requests.length === 0 ? 1 : 0);
