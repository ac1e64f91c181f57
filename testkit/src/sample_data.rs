//! Real input: the GitHub webhook examples shipped in the repository's
//! `data/` (`@octokit/webhooks-examples` 7.6.1, MIT; see `data/README.md`).
//!
//! Each example becomes a [`Sample`]: its event type (`name`, plus `.` and
//! the payload's `action` when it has one) and its payload as compact JSON
//! text. Streams of any length take samples round-robin and give each a
//! synthetic key, so that sizes and shapes stay real while the key
//! cardinality is chosen by the caller.

use std::path::{Path, PathBuf};

/// File name of the examples.
pub const FILE_NAME: &str = "github-webhook-examples.json";

/// One real payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// Event type, such as `issues.opened` or `push`.
    pub event_type: String,
    /// The payload as compact JSON text.
    pub payload: String,
}

/// Why the examples could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// No candidate path exists.
    #[error("{FILE_NAME} not found (looked in: {0}); pass --data PATH or set LANEBUS_DATA")]
    NotFound(String),
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not the expected JSON shape.
    #[error("{path} is not a JSON array of {{name, examples}}: {message}")]
    Shape {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
}

/// Finds the examples file: `explicit` (a `--data` flag), `LANEBUS_DATA`,
/// `data/` relative to the current directory, and the repository's `data/`
/// (next to this crate's workspace).
///
/// # Errors
/// [`DataError::NotFound`] listing the places looked at.
pub fn find(explicit: Option<&Path>) -> Result<PathBuf, DataError> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = explicit {
        candidates.push(p.to_path_buf());
    } else {
        if let Some(p) = std::env::var_os("LANEBUS_DATA") {
            candidates.push(PathBuf::from(p));
        }
        candidates.push(PathBuf::from("data").join(FILE_NAME));
        candidates.push(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../data")
                .join(FILE_NAME),
        );
    }
    for c in &candidates {
        let c = if c.is_dir() {
            c.join(FILE_NAME)
        } else {
            c.clone()
        };
        if c.is_file() {
            return Ok(c);
        }
    }
    Err(DataError::NotFound(
        candidates
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    ))
}

/// Loads every example of the file, in file order.
///
/// # Errors
/// [`DataError::Read`] or [`DataError::Shape`].
pub fn load(path: &Path) -> Result<Vec<Sample>, DataError> {
    let text = std::fs::read(path).map_err(|source| DataError::Read {
        path: path.into(),
        source,
    })?;
    let shape = |message: String| DataError::Shape {
        path: path.into(),
        message,
    };
    let doc: serde_json::Value = serde_json::from_slice(&text).map_err(|e| shape(e.to_string()))?;
    let entries = doc
        .as_array()
        .ok_or_else(|| shape("top level is not an array".into()))?;
    let mut out = Vec::new();
    for e in entries {
        let name = e
            .get("name")
            .and_then(|n| n.as_str())
            .ok_or_else(|| shape("an entry has no name".into()))?;
        for ex in e
            .get("examples")
            .and_then(|x| x.as_array())
            .into_iter()
            .flatten()
        {
            let event_type = match ex.get("action").and_then(|a| a.as_str()) {
                Some(action) => format!("{name}.{action}"),
                None => name.to_string(),
            };
            out.push(Sample {
                event_type,
                payload: serde_json::to_string(ex).map_err(|e| shape(e.to_string()))?,
            });
        }
    }
    if out.is_empty() {
        return Err(shape("no examples".into()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_examples_load_with_types_from_name_and_action() {
        let Ok(path) = find(None) else {
            panic!("data/{FILE_NAME} must be reachable from the crate");
        };
        let samples = load(&path).unwrap();
        assert_eq!(samples.len(), 329);
        assert!(samples.iter().any(|s| s.event_type == "issues.opened"));
        assert!(samples.iter().any(|s| s.event_type == "push"));
        for s in &samples {
            lanebus_store::route::validate_event_type(&s.event_type).unwrap();
        }
    }
}
