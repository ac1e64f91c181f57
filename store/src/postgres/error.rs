//! PostgreSQL's errors (through sqlx) mapped to [`StoreError`] kinds, by
//! SQLSTATE (PostgreSQL documentation, appendix A "Error Codes").

use crate::StoreError;

/// Maps a sqlx error of the PostgreSQL driver to a kind:
///
/// | sqlx error / SQLSTATE | kind |
/// | --- | --- |
/// | `RowNotFound` | `NotFound` |
/// | `23505` unique_violation | `Conflict` |
/// | `PoolTimedOut`; `55P03` lock_not_available (`lock_timeout`); `57014` query_canceled (`statement_timeout`) | `Timeout` |
/// | `Io`, `Tls`, `PoolClosed`, `WorkerCrashed`; class `08` connection exception; `57P01`..`57P03` (admin shutdown, crash shutdown, cannot connect now) | `Unavailable` |
/// | anything else | `Database` |
pub(crate) fn map_err(e: sqlx::Error) -> StoreError {
    match &e {
        sqlx::Error::RowNotFound => StoreError::NotFound(e.to_string()),
        sqlx::Error::PoolTimedOut => StoreError::Timeout(e.to_string()),
        sqlx::Error::Io(_)
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => StoreError::Unavailable(e.to_string()),
        sqlx::Error::Database(db) => {
            let message = db.message().to_string();
            match db.code().as_deref() {
                Some("23505") => StoreError::Conflict(message),
                Some("55P03" | "57014") => StoreError::Timeout(message),
                Some(c) if c.starts_with("08") || matches!(c, "57P01" | "57P02" | "57P03") => {
                    StoreError::Unavailable(message)
                }
                _ => StoreError::Database(e.to_string()),
            }
        }
        _ => StoreError::Database(e.to_string()),
    }
}
