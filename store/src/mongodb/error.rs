//! The MongoDB driver's errors mapped to [`StoreError`] kinds, by error kind,
//! label and server error code (MongoDB's `error_codes.yml`).

use ::mongodb::error::{Error as MongoError, ErrorKind, WriteFailure, TRANSIENT_TRANSACTION_ERROR};

use crate::StoreError;

/// Server error code of a duplicate key.
pub(super) const DUPLICATE_KEY: i32 = 11000;

/// The server error code of `e`, if it carries one (command error, write
/// error, or the first write error of an `insertMany`).
pub(crate) fn error_code(e: &MongoError) -> Option<i32> {
    match e.kind.as_ref() {
        ErrorKind::Command(c) => Some(c.code),
        ErrorKind::Write(WriteFailure::WriteError(w)) => Some(w.code),
        ErrorKind::Write(WriteFailure::WriteConcernError(w)) => Some(w.code),
        ErrorKind::InsertMany(m) => m
            .write_errors
            .as_ref()
            .and_then(|w| w.first())
            .map(|w| w.code)
            .or_else(|| m.write_concern_error.as_ref().map(|w| w.code)),
        _ => None,
    }
}

pub(super) fn is_duplicate_key(e: &MongoError) -> bool {
    error_code(e) == Some(DUPLICATE_KEY)
}

/// Maps a driver error to a [`StoreError`] kind:
///
/// | driver error | kind |
/// | --- | --- |
/// | duplicate key (11000); a transient transaction error (write conflict: retry the transaction) | `Conflict` |
/// | NetworkTimeout (89), MaxTimeMSExpired (50), ExceededTimeLimit (262) | `Timeout` |
/// | I/O, pool cleared, server selection, DNS, authentication; HostUnreachable, HostNotFound, ShutdownInProgress, PrimarySteppedDown, NotWritablePrimary, InterruptedAtShutdown, NotPrimaryNoSecondaryOk, NotPrimaryOrSecondary | `Unavailable` |
/// | anything else | `Database` |
pub(crate) fn map_err(e: MongoError) -> StoreError {
    if is_duplicate_key(&e) {
        return StoreError::Conflict(e.to_string());
    }
    if e.contains_label(TRANSIENT_TRANSACTION_ERROR) {
        return StoreError::Conflict(format!(
            "transient transaction error, retry the transaction: {e}"
        ));
    }
    let code = error_code(&e);
    if matches!(code, Some(50 | 89 | 262)) {
        return StoreError::Timeout(e.to_string());
    }
    let unavailable = matches!(
        e.kind.as_ref(),
        ErrorKind::Io(_)
            | ErrorKind::ConnectionPoolCleared { .. }
            | ErrorKind::ServerSelection { .. }
            | ErrorKind::DnsResolve { .. }
            | ErrorKind::Authentication { .. }
    ) || matches!(code, Some(6 | 7 | 91 | 189 | 10107 | 11600 | 13435 | 13436));
    if unavailable {
        StoreError::Unavailable(e.to_string())
    } else {
        StoreError::Database(e.to_string())
    }
}

/// An error inside a transaction body: a driver error (which may be
/// retried) or a decided [`StoreError`] (which is returned as is).
#[derive(Debug)]
pub(crate) enum TxnError {
    Mongo(MongoError),
    Store(StoreError),
}

impl From<MongoError> for TxnError {
    fn from(e: MongoError) -> Self {
        TxnError::Mongo(e)
    }
}

impl From<StoreError> for TxnError {
    fn from(e: StoreError) -> Self {
        TxnError::Store(e)
    }
}

impl From<TxnError> for StoreError {
    fn from(e: TxnError) -> Self {
        match e {
            TxnError::Mongo(e) => map_err(e),
            TxnError::Store(e) => e,
        }
    }
}

/// Result of a transaction body.
pub(crate) type TxnResult<T> = std::result::Result<T, TxnError>;
