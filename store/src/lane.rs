//! Which lane an event belongs to.
//!
//! A keyed event's lane is `fnv1a_64(key bytes) mod lanes`: FNV-1a, 64-bit
//! (offset basis `0xcbf29ce484222325`, prime `0x100000001b3`; Fowler, Noll
//! and Vo, <http://www.isthe.com/chongo/tech/comp/fnv/>). It is stable across
//! versions and languages, so a publisher written in another language can
//! compute it. Unkeyed events use the same hash of their event id, which
//! spreads them over the lanes.

/// Default number of lanes of a new store.
pub const DEFAULT_LANES: u16 = 256;

/// FNV-1a 64-bit hash of `bytes`.
pub fn fnv1a_64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Lane of a key, in `0..lanes`.
///
/// # Panics
/// If `lanes` is 0.
pub fn lane_of_key(key: &str, lanes: u16) -> u16 {
    (fnv1a_64(key.as_bytes()) % u64::from(lanes)) as u16
}

/// Lane of an event: by key when keyed, else by event id.
pub fn lane_of_event(key: Option<&str>, event_id: &str, lanes: u16) -> u16 {
    lane_of_key(key.unwrap_or(event_id), lanes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_published_test_vectors() {
        // Test vectors from the FNV reference page.
        assert_eq!(fnv1a_64(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a_64(b"foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn lanes_are_in_range_and_spread() {
        let mut seen = vec![0u32; 256];
        for i in 0..10_000 {
            let l = lane_of_key(&format!("repo-{i}"), 256);
            seen[l as usize] += 1;
        }
        assert!(
            seen.iter().all(|&c| c > 10),
            "some lane got almost nothing: {seen:?}"
        );
        assert_eq!(
            lane_of_event(Some("k"), "id1", 256),
            lane_of_event(Some("k"), "id2", 256)
        );
    }
}
