//! `/v1/subjects`: erasing a subject's personal fields
//! (`lanebus_store::personal`, crypto-shredding).
//!
//! ```text
//! DELETE /v1/subjects/{id}   → 204 (also for a subject with no key: erasure is idempotent)
//! ```
//!
//! The subject's data key is deleted from the store and dropped from this
//! node's cache; every node reads a key's row before it uses it, so none
//! decrypts the subject's fields once this answered. Events are not
//! rewritten: their encrypted fields stay, unreadable, and are delivered
//! as `null` with header `lanebus-redacted`.

use axum::extract::State;
use axum::http::StatusCode;

use crate::error::ApiError;
use crate::extract::Path;
use crate::ApiState;

/// Handler of `DELETE /v1/subjects/{id}`: `204` whether or not the subject
/// had a key (a repeated or unneeded erasure succeeds), `422
/// invalid_input` for an id that is no subject id.
pub(crate) async fn forget(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    lanebus_store::personal::forget_subject(&*state.store, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}
