//! Extractors whose every rejection is an [`ApiError`] (the JSON error shape)
//! instead of axum's plain-text rejections.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::{header, request::Parts, StatusCode};
use serde::de::DeserializeOwned;

use crate::error::{tidy, ApiError, ErrorCode};
use crate::ApiState;

/// A JSON request body, like [`axum::Json`], with these rejections:
///
/// - `415 unsupported_media_type`: `content-type` is missing or not JSON;
/// - `413 body_too_large`: more than [`crate::Limits::max_body_bytes`];
/// - `400 invalid_json`: not well-formed JSON;
/// - `422 invalid_body`: well-formed but the wrong shape (unknown or missing
///   field, wrong type); the message starts with the path (`events[1].foo`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Json<T>(pub T);

impl<T: DeserializeOwned> FromRequest<ApiState> for Json<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &ApiState) -> Result<Self, ApiError> {
        let content_type = content_type_of(&req);
        let limit = state.limits.max_body_bytes;
        if !is_json_content_type(content_type.as_deref()) {
            return Err(json_rejection(
                JsonRejection::MissingJsonContentType(Default::default()),
                content_type,
                limit,
            ));
        }
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| json_rejection(JsonRejection::from(e), content_type.clone(), limit))?;
        from_object_bytes(&bytes, content_type, limit).map(Json)
    }
}

/// Deserializes a body that must be a JSON object. serde's derived structs
/// also accept a JSON array (fields by position), and their message for
/// other values names the Rust type: every body of this API is an object
/// (found by schemathesis: `[null, null]` was taken as `{}`), so
/// well-formed JSON that is not one is `422 invalid_body` saying so.
fn from_object_bytes<T: DeserializeOwned>(
    bytes: &[u8],
    content_type: Option<String>,
    limit: usize,
) -> Result<T, ApiError> {
    let object = bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    if !object && serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_ok() {
        return Err(ApiError::new(
            ErrorCode::InvalidBody,
            "request body must be a JSON object",
        ));
    }
    let axum::Json(value) =
        axum::Json::<T>::from_bytes(bytes).map_err(|e| json_rejection(e, content_type, limit))?;
    Ok(value)
}

/// A JSON object body whose fields are all optional, like [`Json`], that may
/// also be left out: an empty body (with or without `content-type`) is
/// `T::default()`, as `{}` would be. Rejections as [`Json`].
#[derive(Debug, Clone, Copy, Default)]
pub struct OptionalJson<T>(pub T);

impl<T: DeserializeOwned + Default> FromRequest<ApiState> for OptionalJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &ApiState) -> Result<Self, ApiError> {
        let content_type = content_type_of(&req);
        let limit = state.limits.max_body_bytes;
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| json_rejection(JsonRejection::from(e), content_type.clone(), limit))?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(OptionalJson(T::default()));
        }
        if !is_json_content_type(content_type.as_deref()) {
            return Err(json_rejection(
                JsonRejection::MissingJsonContentType(Default::default()),
                content_type,
                limit,
            ));
        }
        from_object_bytes(&bytes, content_type, limit).map(OptionalJson)
    }
}

/// The request's `content-type`, if any (lossy UTF-8).
fn content_type_of(req: &Request) -> Option<String> {
    req.headers()
        .get(header::CONTENT_TYPE)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

/// `application/json` or `application/*+json`, parameters ignored (what
/// axum's own `Json` accepts).
fn is_json_content_type(content_type: Option<&str>) -> bool {
    let Some(ct) = content_type else {
        return false;
    };
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match essence.strip_prefix("application/") {
        Some(sub) => sub == "json" || sub.ends_with("+json"),
        None => false,
    }
}

/// The innermost useful message of an axum rejection: its source (serde's
/// message with the path) when there is one, else its own text.
fn inner_message(e: &dyn std::error::Error) -> String {
    e.source()
        .map(ToString::to_string)
        .unwrap_or_else(|| e.to_string())
}

fn json_rejection(
    rejection: JsonRejection,
    content_type: Option<String>,
    max_body_bytes: usize,
) -> ApiError {
    match &rejection {
        JsonRejection::MissingJsonContentType(_) => ApiError::new(
            ErrorCode::UnsupportedMediaType,
            match content_type {
                Some(ct) => format!("content-type {ct:?} is not application/json"),
                None => "content-type is missing, expected application/json".to_owned(),
            },
        ),
        JsonRejection::JsonSyntaxError(e) => ApiError::new(
            ErrorCode::InvalidJson,
            format!("invalid json: {}", inner_message(e)),
        ),
        JsonRejection::JsonDataError(e) => ApiError::new(ErrorCode::InvalidBody, inner_message(e)),
        JsonRejection::BytesRejection(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            ApiError::new(
                ErrorCode::BodyTooLarge,
                format!("request body exceeds the limit of {max_body_bytes} bytes"),
            )
        }
        other => ApiError::new(
            ErrorCode::InvalidBody,
            format!("cannot read request body: {}", inner_message(other)),
        ),
    }
}

/// A path parameter, like [`axum::extract::Path`]; a value that does not
/// parse is `400 invalid_parameter` naming it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Path<T>(pub T);

impl<T, S> FromRequestParts<S> for Path<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(Path(value)),
            Err(rejection) => Err(path_rejection(&rejection)),
        }
    }
}

fn path_rejection(rejection: &PathRejection) -> ApiError {
    let detail = match rejection {
        PathRejection::FailedToDeserializePathParams(e) => e.kind().to_string(),
        other => other.body_text(),
    };
    ApiError::new(
        ErrorCode::InvalidParameter,
        format!("bad path parameter: {}", tidy(&detail)),
    )
}

/// Query parameters, like [`axum::extract::Query`]; a value that does not
/// parse, or an unknown parameter (with `deny_unknown_fields`), is
/// `400 invalid_parameter` naming it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Query<T>(pub T);

impl<T, S> FromRequestParts<S> for Query<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(Query(value)),
            Err(rejection) => Err(query_rejection(&rejection)),
        }
    }
}

fn query_rejection(rejection: &QueryRejection) -> ApiError {
    ApiError::new(
        ErrorCode::InvalidParameter,
        format!("bad query parameter: {}", tidy(&inner_message(rejection))),
    )
}
