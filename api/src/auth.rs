//! Authentication: bearer tokens with two scopes.
//!
//! ```text
//! Authorization: Bearer <token>
//! ```
//!
//! | path | scope needed |
//! | --- | --- |
//! | `POST /v1/events` | `publish` |
//! | `/healthz`, `/readyz`, `/openapi.json`, `/ui`, `/ui/...` (the dashboard's static files) | none |
//! | everything else: `/v1/handlers...`, `/admin/...`, `/metrics` | `admin` |
//!
//! An `admin` token also has the `publish` scope. Paths are matched as
//! received, before routing ([`required_scope`]): only the exact open paths
//! and `/v1/events` need less than `admin`, so a path spelled differently,
//! or a route added later, needs `admin` (a safe default).
//!
//! Answers: no `Authorization` header, a scheme other than `Bearer`, or a
//! token no configured token matches: `401 unauthorized` with
//! `www-authenticate: Bearer realm="lanebus"` (plus `error="invalid_token"`
//! when a token was sent, RFC 6750 section 3); a valid `publish` token on an
//! `admin` path: `403 forbidden` with `www-authenticate: Bearer
//! realm="lanebus", error="insufficient_scope", scope="admin"`.
//!
//! Tokens are kept only as SHA-256 hashes ([`TokenHash`]); a presented token
//! is hashed and compared with every configured hash in constant time
//! (`subtle`), so neither the comparison nor the position of a match shows
//! in the time taken. Configured tokens come either in clear or as
//! `sha256:` + 64 hex digits of their hash ([`Auth::parse_list`]), so a
//! config file need not hold a secret.
//!
//! With no token configured ([`Auth::open`]) every request is allowed; the
//! node then binds its API only to a loopback address (it refuses to start
//! otherwise).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::{ApiError, ErrorCode};

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    /// Publish events (`POST /v1/events`).
    Publish,
    /// Everything: handlers, dead letters, cluster, metrics; implies
    /// [`Scope::Publish`].
    Admin,
}

impl Scope {
    /// `"publish"` or `"admin"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Publish => "publish",
            Scope::Admin => "admin",
        }
    }
}

/// Shortest clear token accepted, in bytes.
pub const MIN_TOKEN_BYTES: usize = 16;

/// Prefix of a token given by its hash: `sha256:` + 64 hex digits.
pub const HASH_PREFIX: &str = "sha256:";

/// The SHA-256 hash of a token.
pub type TokenHash = [u8; 32];

/// The SHA-256 hash of `token` (what [`Auth`] keeps; `sha256:` + its hex is
/// the form a config file can hold instead of the token).
pub fn hash_token(token: &str) -> TokenHash {
    Sha256::digest(token.as_bytes()).into()
}

/// `sha256:` + the hex of [`hash_token`].
pub fn hashed_form(token: &str) -> String {
    let mut s = String::from(HASH_PREFIX);
    for b in hash_token(token) {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// The configured tokens (hashed) and their scopes. Cheap to clone. The
/// default is [`Auth::open`].
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Auth {
    tokens: Arc<[(Scope, TokenHash)]>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("publish_tokens", &self.count(Scope::Publish))
            .field("admin_tokens", &self.count(Scope::Admin))
            .finish()
    }
}

/// What a presented `Authorization` header proves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The request may go on.
    Allowed,
    /// No header, or not `Bearer`: `401`.
    Missing,
    /// A bearer token that matches no configured token: `401`.
    Invalid,
    /// A valid token without the scope: `403`.
    Insufficient,
}

impl Auth {
    /// No tokens: every request is allowed (loopback-only nodes).
    pub fn open() -> Self {
        Auth::default()
    }

    /// Tokens by hash and scope.
    pub fn new(tokens: Vec<(Scope, TokenHash)>) -> Self {
        Auth {
            tokens: tokens.into(),
        }
    }

    /// Parses a comma-separated list of tokens (option `publish_tokens` or
    /// `admin_tokens`), each either the token in clear (at least
    /// [`MIN_TOKEN_BYTES`] visible ASCII characters, no comma) or
    /// `sha256:` + 64 hex digits of its SHA-256 hash. Blank entries are
    /// skipped. `option` names the list in messages (which never repeat a
    /// token).
    ///
    /// # Errors
    /// A message naming the option and the position of the bad entry.
    pub fn parse_list(option: &str, list: &str) -> Result<Vec<TokenHash>, String> {
        let mut out = Vec::new();
        for (i, entry) in list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .enumerate()
        {
            if let Some(hex) = entry.strip_prefix(HASH_PREFIX) {
                out.push(parse_hex(hex).ok_or_else(|| {
                    format!(
                        "{option} entry {}: sha256: must be followed by 64 hex digits",
                        i + 1
                    )
                })?);
                continue;
            }
            if entry.len() < MIN_TOKEN_BYTES {
                return Err(format!(
                    "{option} entry {}: a token must have at least {MIN_TOKEN_BYTES} characters, it has {}",
                    i + 1,
                    entry.len()
                ));
            }
            if !entry.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!(
                    "{option} entry {}: a token must be visible ASCII characters without spaces",
                    i + 1
                ));
            }
            out.push(hash_token(entry));
        }
        Ok(out)
    }

    /// Whether no token is configured (every request allowed).
    pub fn is_open(&self) -> bool {
        self.tokens.is_empty()
    }

    /// How many tokens have exactly `scope`.
    pub fn count(&self, scope: Scope) -> usize {
        self.tokens.iter().filter(|(s, _)| *s == scope).count()
    }

    /// The highest scope of `token`, if it is a configured token. Compares
    /// with every configured hash in constant time, without stopping early.
    pub fn scope_of(&self, token: &str) -> Option<Scope> {
        let h = hash_token(token);
        let mut best = None;
        for (scope, known) in self.tokens.iter() {
            if bool::from(known.ct_eq(&h)) {
                best = best.max(Some(*scope));
            }
        }
        best
    }

    /// Checks an `Authorization` header value against `need`.
    pub fn verdict(&self, authorization: Option<&HeaderValue>, need: Option<Scope>) -> Verdict {
        let Some(need) = need else {
            return Verdict::Allowed;
        };
        if self.is_open() {
            return Verdict::Allowed;
        }
        let Some(token) = authorization
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token)
        else {
            return Verdict::Missing;
        };
        match self.scope_of(token) {
            None => Verdict::Invalid,
            Some(have) if have >= need => Verdict::Allowed,
            Some(_) => Verdict::Insufficient,
        }
    }
}

/// The token of `Bearer <token>` (scheme case-insensitive, RFC 6750).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = token.trim();
    (!token.is_empty()).then_some(token)
}

fn parse_hex(hex: &str) -> Option<TokenHash> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// The scope a request to `path` needs (table in the module docs); `None`:
/// open.
pub fn required_scope(path: &str) -> Option<Scope> {
    match path {
        "/healthz" | "/readyz" | "/openapi.json" | "/ui" => None,
        p if p.starts_with("/ui/") => None,
        "/v1/events" => Some(Scope::Publish),
        _ => Some(Scope::Admin),
    }
}

/// The middleware: answers `401`/`403` (module docs) or passes the request on.
pub(crate) async fn authorize(State(auth): State<Auth>, req: Request, next: Next) -> Response {
    let need = required_scope(req.uri().path());
    let verdict = auth.verdict(req.headers().get(header::AUTHORIZATION), need);
    let (code, message, challenge) = match verdict {
        Verdict::Allowed => return next.run(req).await,
        Verdict::Missing => (
            ErrorCode::Unauthorized,
            "this path needs a bearer token: send authorization: Bearer TOKEN".to_owned(),
            r#"Bearer realm="lanebus""#.to_owned(),
        ),
        Verdict::Invalid => (
            ErrorCode::Unauthorized,
            "the bearer token is not valid".to_owned(),
            r#"Bearer realm="lanebus", error="invalid_token""#.to_owned(),
        ),
        Verdict::Insufficient => {
            let need = need.unwrap_or(Scope::Admin).as_str();
            (
                ErrorCode::Forbidden,
                format!("this path needs a token with the {need} scope"),
                format!(r#"Bearer realm="lanebus", error="insufficient_scope", scope="{need}""#),
            )
        }
    };
    crate::telemetry::api_error(code.as_str());
    let mut res = ApiError::new(code, message).into_response();
    if let Ok(v) = HeaderValue::from_str(&challenge) {
        res.headers_mut().insert(header::WWW_AUTHENTICATE, v);
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    const PUBLISH: &str = "pub-token-0123456789";
    const ADMIN: &str = "adm-token-0123456789";

    fn auth() -> Auth {
        let mut tokens: Vec<(Scope, TokenHash)> = Auth::parse_list("publish_tokens", PUBLISH)
            .unwrap()
            .into_iter()
            .map(|h| (Scope::Publish, h))
            .collect();
        // The admin token given by its hash.
        let hashed = hashed_form(ADMIN);
        tokens.extend(
            Auth::parse_list("admin_tokens", &format!(" ,{hashed}"))
                .unwrap()
                .into_iter()
                .map(|h| (Scope::Admin, h)),
        );
        Auth::new(tokens)
    }

    fn header(v: &str) -> HeaderValue {
        HeaderValue::from_str(v).unwrap()
    }

    #[test]
    fn scopes_are_checked_and_admin_implies_publish() {
        let a = auth();
        let p = Some(Scope::Publish);
        let ad = Some(Scope::Admin);
        assert_eq!(a.verdict(None, p), Verdict::Missing);
        assert_eq!(a.verdict(Some(&header("Basic abc")), p), Verdict::Missing);
        assert_eq!(a.verdict(Some(&header("Bearer ")), p), Verdict::Missing);
        assert_eq!(
            a.verdict(Some(&header("Bearer wrong-token-0123456")), p),
            Verdict::Invalid
        );
        let pubh = header(&format!("Bearer {PUBLISH}"));
        let admh = header(&format!("bearer {ADMIN}"));
        assert_eq!(a.verdict(Some(&pubh), p), Verdict::Allowed);
        assert_eq!(a.verdict(Some(&pubh), ad), Verdict::Insufficient);
        assert_eq!(a.verdict(Some(&admh), p), Verdict::Allowed);
        assert_eq!(a.verdict(Some(&admh), ad), Verdict::Allowed);
        assert_eq!(a.verdict(None, None), Verdict::Allowed);
        assert_eq!(Auth::open().verdict(None, ad), Verdict::Allowed);
        // The hashed form is not itself a token.
        let hashed = header(&format!("Bearer {}", hashed_form(ADMIN)));
        assert_eq!(a.verdict(Some(&hashed), p), Verdict::Invalid);
    }

    #[test]
    fn bad_token_lists_name_the_entry_without_repeating_it() {
        let e = Auth::parse_list("admin_tokens", "short").unwrap_err();
        assert!(
            e.contains("admin_tokens entry 1") && !e.contains("short\""),
            "{e}"
        );
        let e = Auth::parse_list("admin_tokens", "abcdefghijklmnopq,sha256:12").unwrap_err();
        assert!(e.contains("entry 2") && e.contains("64 hex"), "{e}");
        let e = Auth::parse_list("publish_tokens", "abcdefgh ijklmnopq").unwrap_err();
        assert!(e.contains("visible ASCII"), "{e}");
        assert!(Auth::parse_list("publish_tokens", "").unwrap().is_empty());
    }

    #[test]
    fn only_exact_open_paths_and_publish_need_less_than_admin() {
        for open in [
            "/healthz",
            "/readyz",
            "/openapi.json",
            "/ui",
            "/ui/",
            "/ui/dashboard.js",
        ] {
            assert_eq!(required_scope(open), None, "{open}");
        }
        assert_eq!(required_scope("/v1/events"), Some(Scope::Publish));
        for admin in [
            "/v1/events/",
            "/v1//events",
            "/v1/handlers",
            "/v1/handlers/hdl_x/enable",
            "/admin/lanes",
            "/metrics",
            "/healthz/",
            "/uix",
            "/",
        ] {
            assert_eq!(required_scope(admin), Some(Scope::Admin), "{admin}");
        }
    }
}
