//! The lane of an event as the contract defines it (`fnv1a_64(key) mod
//! lanes`, by event id when unkeyed; `docs/design.md` glossary and
//! `store/src/lane.rs`), computed here apart from the store's code, so a
//! checker that places deliveries in lanes does not share the store's
//! mistakes.

/// FNV-1a, 64-bit (offset basis `0xcbf29ce484222325`, prime
/// `0x100000001b3`; Fowler, Noll and Vo,
/// <http://www.isthe.com/chongo/tech/comp/fnv/>).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The lane of an event: by key when keyed, else by event id; `lanes` of 0
/// is taken as 1.
pub fn lane_of(key: Option<&str>, event_id: &str, lanes: u16) -> u16 {
    (fnv1a(key.unwrap_or(event_id).as_bytes()) % u64::from(lanes.max(1))) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_matches_the_published_vectors() {
        assert_eq!(fnv1a(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a(b"foobar"), 0x85944171f73967e8);
        assert_eq!(lane_of(None, "", 256), (0xcbf29ce484222325u64 % 256) as u16);
        assert_eq!(lane_of(Some("foobar"), "evt", 1), 0);
    }
}
