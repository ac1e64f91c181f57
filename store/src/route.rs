//! Routes: which event types a handler receives.
//!
//! A route is an exact event type (`issues.opened`) or a prefix pattern
//! ending in `*` (`issues.*`, `inv*`, `*`): the pattern `p*` matches every type
//! that starts with `p`, except the reserved `lanebus.` types (lanebus's
//! operational events, [`crate::operational`]): only a route that itself
//! starts with `lanebus.` matches those (`lanebus.*`, `lanebus.handler.*`,
//! `lanebus.handler.disabled`), so `*` and other catch-alls do not receive
//! them unasked.

use crate::Result;

pub use crate::rules::route::MAX_TYPE_LEN;

/// Checks an event type ([`crate::rules::route::event_type`]).
///
/// # Errors
/// [`StoreError::Invalid`] with the offending type.
pub fn validate_event_type(t: &str) -> Result<()> {
    Ok(crate::rules::route::event_type(t)?)
}

/// Checks a route pattern ([`crate::rules::route::pattern`]).
///
/// # Errors
/// [`StoreError::Invalid`] with the offending pattern.
pub fn validate_pattern(p: &str) -> Result<()> {
    Ok(crate::rules::route::pattern(p)?)
}

/// Whether `pattern` matches `event_type` (see the module docs for the
/// reserved `lanebus.` types).
pub fn matches(pattern: &str, event_type: &str) -> bool {
    use crate::rules::event::is_reserved;
    match pattern.strip_suffix('*') {
        Some(prefix) => {
            event_type.starts_with(prefix) && (!is_reserved(event_type) || is_reserved(pattern))
        }
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
    fn only_lanebus_routes_match_lanebus_types() {
        let t = "lanebus.handler.disabled";
        for p in ["lanebus.*", "lanebus.handler.*", t, "lanebus.h*"] {
            assert!(matches(p, t), "{p}");
        }
        for p in ["*", "l*", "lanebus*", "lanebus.delivery.*"] {
            assert!(!matches(p, t), "{p}");
        }
        assert!(matches("lane*", "lanes.x"), "ordinary types as before");
    }
}
