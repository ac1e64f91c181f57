//! SQLite's errors (through sqlx) mapped to [`StoreError`] kinds.

use crate::StoreError;

/// SQLite result codes that mean "locked by someone else": SQLITE_BUSY and
/// its extended codes, SQLITE_LOCKED.
pub(super) fn is_busy(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|c| c.parse::<i32>().ok())
            .is_some_and(|c| c & 0xff == 5 || c & 0xff == 6),
        _ => false,
    }
}

/// Maps a sqlx error of the SQLite driver to a kind:
///
/// | sqlx error | kind |
/// | --- | --- |
/// | `RowNotFound` | `NotFound` |
/// | SQLITE_BUSY / SQLITE_LOCKED after the busy timeout, `PoolTimedOut` | `Timeout` |
/// | `Io`, `Tls`, `PoolClosed`, `WorkerCrashed` | `Unavailable` |
/// | a unique constraint | `Conflict` |
/// | anything else | `Database` |
pub(crate) fn map_err(e: sqlx::Error) -> StoreError {
    if is_busy(&e) {
        return StoreError::Timeout(format!("sqlite database is locked by another writer: {e}"));
    }
    match &e {
        sqlx::Error::RowNotFound => StoreError::NotFound(e.to_string()),
        sqlx::Error::PoolTimedOut => StoreError::Timeout(e.to_string()),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => StoreError::Unavailable(e.to_string()),
        sqlx::Error::Database(db) if db.is_unique_violation() => {
            StoreError::Conflict(db.message().to_string())
        }
        _ => StoreError::Database(e.to_string()),
    }
}
