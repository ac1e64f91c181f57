//! Routes: which event types a handler receives.
//!
//! A route is an exact event type (`issues.opened`) or a prefix pattern
//! ending in `*` (`issues.*`, `inv*`, `*`): the pattern `p*` matches every type
//! that starts with `p`.

use crate::{Result, StoreError};

/// Longest event type or route pattern, in bytes.
pub const MAX_TYPE_LEN: usize = 128;

fn type_chars_ok(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':' | b'/'))
}

/// Checks an event type: 1 to 128 characters of `[A-Za-z0-9._:/-]`.
///
/// # Errors
/// [`StoreError::Invalid`] with the offending type.
pub fn validate_event_type(t: &str) -> Result<()> {
    if t.is_empty() || t.len() > MAX_TYPE_LEN || !type_chars_ok(t) {
        return Err(StoreError::Invalid(format!(
            "event type {t:?} must be 1 to {MAX_TYPE_LEN} characters of letters, digits and ._:/-"
        )));
    }
    Ok(())
}

/// Checks a route pattern: an event type, optionally ending in one `*`.
///
/// # Errors
/// [`StoreError::Invalid`] with the offending pattern.
pub fn validate_pattern(p: &str) -> Result<()> {
    let body = p.strip_suffix('*').unwrap_or(p);
    if p.len() > MAX_TYPE_LEN
        || body.contains('*')
        || (body.is_empty() && p != "*")
        || !type_chars_ok(body)
    {
        return Err(StoreError::Invalid(format!(
            "route {p:?} must be an event type or a prefix followed by one trailing '*'"
        )));
    }
    Ok(())
}

/// Whether `pattern` matches `event_type`.
pub fn matches(pattern: &str, event_type: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => event_type.starts_with(prefix),
        None => pattern == event_type,
    }
}

/// Whether any of `patterns` matches `event_type`.
pub fn any_matches<S: AsRef<str>>(patterns: &[S], event_type: &str) -> bool {
    patterns.iter().any(|p| matches(p.as_ref(), event_type))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_by_prefix_or_exactly() {
        assert!(matches("*", "push"));
        assert!(matches("issues.*", "issues.opened"));
        assert!(!matches("issues.*", "issues"));
        assert!(!matches("issues.*", "issue_comment.created"));
        assert!(matches("push", "push"));
        assert!(!matches("push", "push.x"));
    }

    #[test]
    fn bad_patterns_are_refused() {
        assert!(validate_pattern("a*b").is_err());
        assert!(validate_pattern("**").is_err());
        assert!(validate_pattern("").is_err());
        assert!(validate_pattern("has space").is_err());
        assert!(validate_pattern("*").is_ok());
        assert!(validate_pattern("issues.*").is_ok());
        assert!(validate_event_type("a*").is_err());
    }
}
