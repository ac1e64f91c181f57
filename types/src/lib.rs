//! Values that both the cluster (`lanebus-cluster`, which issues them) and
//! the store (`lanebus-store`, which fences with them) speak. Neither crate
//! depends on the other, so the shared types live here, with no IO and no
//! dependency beyond serde.

#![warn(missing_docs)]

use std::fmt;

use serde::{Deserialize, Serialize};

/// A lane's fencing token: grows at every change of owner (design.md,
/// "owner, epoch" and "fencing").
///
/// The cluster assigns it in its Raft log and snapshots, where it is encoded
/// exactly as the `u64` it was before this type existed
/// (`#[serde(transparent)]`: the same bincode bytes, a JSON number). The
/// stores keep it as a signed 64-bit integer (SQL `BIGINT`, BSON `Int64`):
/// [`Epoch::to_i64`] and [`Epoch::try_from`]`(i64)` convert with a check, so
/// an epoch above `i64::MAX` or a negative stored value is an
/// [`EpochOutOfRange`] error, never a wrapped number.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Epoch(pub u64);

impl Epoch {
    /// The epoch of a lane nobody has owned yet.
    pub const ZERO: Epoch = Epoch(0);
    /// The largest epoch a store can hold (`i64::MAX`).
    pub const MAX_STORED: Epoch = Epoch(i64::MAX as u64);

    /// The epoch after this one.
    ///
    /// # Panics
    /// At `u64::MAX` (2^64 - 1 changes of owner): a wrapped epoch would
    /// break fencing.
    pub fn next(self) -> Epoch {
        Epoch(self.0.checked_add(1).expect("lane epoch overflows u64"))
    }

    /// The value a store binds (SQL `BIGINT`, BSON `Int64`).
    ///
    /// # Errors
    /// [`EpochOutOfRange`] above [`Epoch::MAX_STORED`].
    pub fn to_i64(self) -> Result<i64, EpochOutOfRange> {
        i64::try_from(self.0).map_err(|_| EpochOutOfRange(i128::from(self.0)))
    }
}

impl From<u64> for Epoch {
    fn from(v: u64) -> Self {
        Epoch(v)
    }
}

impl From<Epoch> for u64 {
    fn from(e: Epoch) -> Self {
        e.0
    }
}

/// A value read from a store (SQL `BIGINT`, BSON `Int64`).
impl TryFrom<i64> for Epoch {
    type Error = EpochOutOfRange;

    /// # Errors
    /// [`EpochOutOfRange`] for a negative value.
    fn try_from(v: i64) -> Result<Self, Self::Error> {
        u64::try_from(v)
            .map(Epoch)
            .map_err(|_| EpochOutOfRange(i128::from(v)))
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// An epoch that does not fit the other side of a conversion: above
/// `i64::MAX` for a store, or negative from one. Holds the value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("epoch {0} is outside 0..=9223372036854775807 (i64::MAX)")]
pub struct EpochOutOfRange(pub i128);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_to_and_from_i64_within_range() {
        for v in [0i64, 1, 42, i64::MAX] {
            let e = Epoch::try_from(v).unwrap();
            assert_eq!(e.0, v as u64);
            assert_eq!(e.to_i64(), Ok(v));
        }
        assert_eq!(Epoch::MAX_STORED.to_i64(), Ok(i64::MAX));
    }

    #[test]
    fn out_of_range_conversions_are_errors() {
        let above = Epoch::MAX_STORED.next();
        assert_eq!(above.to_i64(), Err(EpochOutOfRange(1 << 63)));
        assert!(Epoch(u64::MAX).to_i64().is_err());
        assert_eq!(Epoch::try_from(-1i64), Err(EpochOutOfRange(-1)));
        assert!(Epoch::try_from(i64::MIN).is_err());
    }

    #[test]
    fn next_grows_by_one_and_refuses_to_wrap() {
        assert_eq!(Epoch::ZERO.next(), Epoch(1));
        assert!(std::panic::catch_unwind(|| Epoch(u64::MAX).next()).is_err());
    }

    #[test]
    fn json_holds_a_plain_number() {
        assert_eq!(serde_json::to_string(&Epoch(17)).unwrap(), "17");
        assert_eq!(serde_json::from_str::<Epoch>("17").unwrap(), Epoch(17));
        assert!(serde_json::from_str::<Epoch>("-1").is_err());
    }

    #[test]
    fn displays_as_the_number() {
        assert_eq!(Epoch(17).to_string(), "17");
    }
}
