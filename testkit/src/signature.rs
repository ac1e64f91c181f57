//! The Standard Webhooks signature check, written from the specification
//! (<https://github.com/standard-webhooks/standard-webhooks/blob/main/spec/standard-webhooks.md>,
//! "Verifying webhooks") rather than shared with the node's signing code,
//! so a fault in how the node signs is not mirrored by the check that
//! judges it. The tests also check real requests with the official Python
//! and JavaScript libraries.

use base64::Engine as _;
use hmac::Mac as _;

/// Whether `signature_header` (space-separated `v1,<base64>` entries; other
/// versions are ignored) holds the base64 HMAC-SHA256 of
/// `"{msg_id}.{timestamp}.{body}"` keyed with the bytes of `secret`
/// (`whsec_` + base64). A secret without that prefix or with bad base64
/// verifies nothing.
pub fn valid(
    secret: &str,
    msg_id: &str,
    timestamp: &str,
    signature_header: &str,
    body: &[u8],
) -> bool {
    let b64 = base64::engine::general_purpose::STANDARD;
    let Some(key) = secret
        .strip_prefix("whsec_")
        .and_then(|k| b64.decode(k).ok())
    else {
        return false;
    };
    let mut mac =
        hmac::Hmac::<sha2::Sha256>::new_from_slice(&key).expect("HMAC takes a key of any length");
    for part in [msg_id.as_bytes(), b".", timestamp.as_bytes(), b".", body] {
        mac.update(part);
    }
    let expected = b64.encode(mac.finalize().into_bytes());
    signature_header
        .split_whitespace()
        .filter_map(|entry| entry.strip_prefix("v1,"))
        .any(|sig| sig == expected)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of the Standard Webhooks reference libraries' tests:
    /// secret, id, timestamp and payload with their published signature.
    #[test]
    fn the_specification_example_verifies() {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let id = "msg_p5jXN8AQM9LWM0D4loKWxJek";
        let ts = "1614265330";
        let body = br#"{"test": 2432232314}"#;
        let sig = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
        assert!(valid(secret, id, ts, sig, body));
        assert!(valid(secret, id, ts, &format!("v1,AAAA {sig}"), body));
        assert!(!valid(secret, id, "1614265331", sig, body));
        assert!(!valid(secret, id, ts, sig, br#"{"test": 2432232315}"#));
        assert!(!valid(
            "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            id,
            ts,
            sig,
            body
        ));
        assert!(!valid(
            secret,
            id,
            ts,
            "v2,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
            body
        ));
    }
}
