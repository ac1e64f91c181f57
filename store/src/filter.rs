//! Payload filters: a handler's condition on an event's payload, evaluated
//! at publish (docs/design.md, "Payload filters"). A handler with a filter
//! gets a delivery only for events whose payload matches it; one without
//! gets every event its routes match.
//!
//! # JSON shape
//!
//! A filter is one JSON object, either a condition on one field or a
//! combination:
//!
//! ```json
//! {"and": [{"path": "/order/total", "gte": 100},
//!          {"path": "/country", "in": ["DE", "FR"]},
//!          {"not": {"path": "/test", "equals": true}}]}
//! ```
//!
//! - `{"path": P, OP: V}`: a condition on the payload value at JSON pointer
//!   `P` (RFC 6901: `""` is the whole payload, `/a/0/b` is member `b` of
//!   element 0 of member `a`; `~1` stands for `/`, `~0` for `~`), with
//!   exactly one operator `OP`:
//!   - `equals`: the value is present and equal to `V` (a string, number,
//!     boolean or `null`);
//!   - `in`: the value is present and equal to one of the list `V`;
//!   - `exists`: `true`: the value is present (`null` counts); `false`: it
//!     is absent;
//!   - `gt`, `gte`, `lt`, `lte`: the value is a number greater than (or
//!     equal to, less than, at most) the number `V`.
//! - `{"and": [F, ...]}`: every filter matches; `{"or": [F, ...]}`: at
//!   least one does; `{"not": F}`: `F` does not.
//!
//! # Semantics (the same on every store)
//!
//! - Equality is type-strict: the string `"1"` never equals the number
//!   `1`, `false` never equals `0` or `null`. Numbers compare by value as
//!   64-bit floats (IEEE 754 doubles): `1` equals `1.0`, integers are exact
//!   up to 2^53. Strings compare by their characters (no normalization).
//! - A comparison (`gt`, `gte`, `lt`, `lte`) holds only when the value is a
//!   number; a string, a boolean, `null`, an object, an array or a missing
//!   value makes it false.
//! - A missing value (a member not there, an array index past the end or
//!   not of the form `0`, `1`, ... without leading zeros, a step into a
//!   scalar) is not `null`: `equals: null` and `exists: true` are false for
//!   it, `exists: false` is true.
//! - A payload that is not a JSON document matches no filter (`not`
//!   included), nor does one holding a number whose nearest double is
//!   infinite (serde_json refuses it); one nearer to 0 than half the least
//!   double is 0. PostgreSQL reads its `\u0000` escapes as U+FFFF; filter
//!   strings may hold neither (the rulebook), so it answers alike.
//!
//! Bounds (depth, conditions, `in` list length, size) are the rulebook's:
//! [`crate::rules::filter`].

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Number, Value};

/// A handler's payload filter (module docs: shape and semantics). Build one
/// from its JSON with [`Filter::parse`], which checks it
/// ([`crate::rules::filter::parse`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Filter {
    /// `{"and": [...]}`: every filter matches.
    And(Vec<Filter>),
    /// `{"or": [...]}`: at least one filter matches.
    Or(Vec<Filter>),
    /// `{"not": ...}`: the filter does not match.
    Not(Box<Filter>),
    /// `{"path": ..., OP: ...}`: a condition on one payload value.
    Field(Condition),
}

/// A condition on the payload value at a JSON pointer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    /// JSON pointer (RFC 6901) into the payload.
    pub path: String,
    /// What the value must satisfy.
    pub test: Test,
}

/// The operator of a [`Condition`] and its operand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Test {
    /// `equals`: present and equal to the scalar.
    Equals(Value),
    /// `in`: present and equal to one of the scalars.
    In(Vec<Value>),
    /// `exists`: present (`true`) or absent (`false`).
    Exists(bool),
    /// `gt`: a number greater than the operand.
    Gt(Number),
    /// `gte`: a number greater than or equal to the operand.
    Gte(Number),
    /// `lt`: a number less than the operand.
    Lt(Number),
    /// `lte`: a number less than or equal to the operand.
    Lte(Number),
}

impl Test {
    /// The operator's name in the JSON shape.
    pub fn name(&self) -> &'static str {
        match self {
            Test::Equals(_) => "equals",
            Test::In(_) => "in",
            Test::Exists(_) => "exists",
            Test::Gt(_) => "gt",
            Test::Gte(_) => "gte",
            Test::Lt(_) => "lt",
            Test::Lte(_) => "lte",
        }
    }

    fn operand(&self) -> Value {
        match self {
            Test::Equals(v) => v.clone(),
            Test::In(vs) => Value::Array(vs.clone()),
            Test::Exists(b) => Value::Bool(*b),
            Test::Gt(n) | Test::Gte(n) | Test::Lt(n) | Test::Lte(n) => Value::Number(n.clone()),
        }
    }

    fn holds(&self, value: Option<&Value>) -> bool {
        match (self, value) {
            (Test::Exists(want), v) => v.is_some() == *want,
            (_, None) => false,
            (Test::Equals(x), Some(v)) => equal(v, x),
            (Test::In(xs), Some(v)) => xs.iter().any(|x| equal(v, x)),
            (Test::Gt(n), Some(v)) => compare(v, n, |a, b| a > b),
            (Test::Gte(n), Some(v)) => compare(v, n, |a, b| a >= b),
            (Test::Lt(n), Some(v)) => compare(v, n, |a, b| a < b),
            (Test::Lte(n), Some(v)) => compare(v, n, |a, b| a <= b),
        }
    }
}

/// Type-strict equality of a payload value with a scalar operand; numbers
/// by value as doubles.
fn equal(v: &Value, x: &Value) -> bool {
    match (v, x) {
        (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
        (Value::String(a), Value::String(b)) => a == b,
        (Value::Bool(a), Value::Bool(b)) => a == b,
        (Value::Null, Value::Null) => true,
        _ => false,
    }
}

fn compare(v: &Value, n: &Number, op: fn(f64, f64) -> bool) -> bool {
    match (v.as_f64(), n.as_f64()) {
        (Some(a), Some(b)) => op(a, b),
        _ => false,
    }
}

impl Filter {
    /// Parses and checks a filter's JSON ([`crate::rules::filter::parse`]).
    ///
    /// # Errors
    /// The broken rule, its field named from `filter` on.
    pub fn parse(v: &Value) -> Result<Filter, crate::rules::Broken> {
        crate::rules::filter::parse(v)
    }

    /// The filter's JSON (the shape [`Filter::parse`] reads).
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        match self {
            Filter::And(fs) => {
                m.insert("and".into(), fs.iter().map(Filter::to_json).collect());
            }
            Filter::Or(fs) => {
                m.insert("or".into(), fs.iter().map(Filter::to_json).collect());
            }
            Filter::Not(f) => {
                m.insert("not".into(), f.to_json());
            }
            Filter::Field(c) => {
                m.insert("path".into(), Value::String(c.path.clone()));
                m.insert(c.test.name().into(), c.test.operand());
            }
        }
        Value::Object(m)
    }

    /// Whether the parsed payload `doc` matches.
    pub fn matches(&self, doc: &Value) -> bool {
        match self {
            Filter::And(fs) => fs.iter().all(|f| f.matches(doc)),
            Filter::Or(fs) => fs.iter().any(|f| f.matches(doc)),
            Filter::Not(f) => !f.matches(doc),
            Filter::Field(c) => c.test.holds(doc.pointer(&c.path)),
        }
    }

    /// Whether the payload bytes `payload` match: `false` when they are
    /// not a JSON document.
    pub fn matches_payload(&self, payload: &[u8]) -> bool {
        parse_payload(payload).is_some_and(|doc| self.matches(&doc))
    }
}

impl Filter {
    /// The filter as stores keep it: compact JSON.
    pub(crate) fn to_stored(&self) -> String {
        self.to_json().to_string()
    }

    /// A filter as stores keep it ([`Filter::to_stored`]) on handler `id`.
    ///
    /// # Errors
    /// [`crate::StoreError::Database`] when it is not a filter.
    pub(crate) fn from_stored(id: &str, json: &str) -> crate::Result<Filter> {
        serde_json::from_str(json).map_err(|e| {
            crate::StoreError::Database(format!("handlers.filter of {id} is not a filter: {e}"))
        })
    }
}

/// A payload parsed for filters: `None` when it is not a JSON document
/// (it then matches no filter). Parse once per event, not per handler.
pub fn parse_payload(payload: &[u8]) -> Option<Value> {
    serde_json::from_slice(payload).ok()
}

/// An event's payload for the filters of several handlers: parsed at the
/// first filter that needs it, then kept (handlers without a filter never
/// parse it).
pub(crate) struct Payload<'a> {
    raw: &'a [u8],
    doc: Option<Option<Value>>,
}

impl<'a> Payload<'a> {
    /// The payload bytes, not parsed yet.
    pub(crate) fn new(raw: &'a [u8]) -> Self {
        Payload { raw, doc: None }
    }

    /// Whether the payload passes `filter` (`None`: no filter, it passes).
    pub(crate) fn passes(&mut self, filter: Option<&Filter>) -> bool {
        let Some(f) = filter else { return true };
        let raw = self.raw;
        self.doc
            .get_or_insert_with(|| parse_payload(raw))
            .as_ref()
            .is_some_and(|doc| f.matches(doc))
    }
}

impl Serialize for Filter {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Filter {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        Filter::parse(&v).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn m(filter: Value, doc: Value) -> bool {
        Filter::parse(&filter).expect("valid filter").matches(&doc)
    }

    #[test]
    fn equals_is_type_strict_and_numeric_by_value() {
        let doc = json!({"n": 1, "s": "1", "f": 1.0, "b": false, "z": null});
        assert!(m(json!({"path": "/n", "equals": 1}), doc.clone()));
        assert!(m(json!({"path": "/n", "equals": 1.0}), doc.clone()));
        assert!(m(json!({"path": "/f", "equals": 1}), doc.clone()));
        assert!(!m(json!({"path": "/n", "equals": "1"}), doc.clone()));
        assert!(!m(json!({"path": "/s", "equals": 1}), doc.clone()));
        assert!(m(json!({"path": "/s", "equals": "1"}), doc.clone()));
        assert!(!m(json!({"path": "/b", "equals": 0}), doc.clone()));
        assert!(!m(json!({"path": "/b", "equals": null}), doc.clone()));
        assert!(m(json!({"path": "/z", "equals": null}), doc.clone()));
        assert!(!m(json!({"path": "/missing", "equals": null}), doc));
    }

    #[test]
    fn in_matches_any_listed_value() {
        let doc = json!({"country": "DE", "n": 2});
        assert!(m(
            json!({"path": "/country", "in": ["FR", "DE"]}),
            doc.clone()
        ));
        assert!(!m(
            json!({"path": "/country", "in": ["FR", "IT"]}),
            doc.clone()
        ));
        assert!(m(json!({"path": "/n", "in": ["2", 2.0]}), doc.clone()));
        assert!(!m(json!({"path": "/x", "in": [null]}), doc));
    }

    #[test]
    fn exists_tells_missing_from_null() {
        let doc = json!({"z": null, "a": [1]});
        assert!(m(json!({"path": "/z", "exists": true}), doc.clone()));
        assert!(!m(json!({"path": "/z", "exists": false}), doc.clone()));
        assert!(m(json!({"path": "/y", "exists": false}), doc.clone()));
        assert!(m(json!({"path": "/a/0", "exists": true}), doc.clone()));
        assert!(!m(json!({"path": "/a/1", "exists": true}), doc.clone()));
        assert!(!m(json!({"path": "/a/00", "exists": true}), doc.clone()));
        assert!(!m(json!({"path": "/z/k", "exists": true}), doc.clone()));
        assert!(m(json!({"path": "", "exists": true}), doc));
    }

    #[test]
    fn comparisons_hold_only_between_numbers() {
        let doc = json!({"t": 100, "s": "200", "z": null, "o": {"t": 5.5}});
        assert!(m(json!({"path": "/t", "gte": 100}), doc.clone()));
        assert!(!m(json!({"path": "/t", "gt": 100}), doc.clone()));
        assert!(m(json!({"path": "/t", "gt": 99.5}), doc.clone()));
        assert!(m(json!({"path": "/t", "lte": 100.0}), doc.clone()));
        assert!(!m(json!({"path": "/t", "lt": 100}), doc.clone()));
        assert!(m(json!({"path": "/o/t", "lt": 6}), doc.clone()));
        for p in ["/s", "/z", "/o", "/missing"] {
            for op in ["gt", "gte", "lt", "lte"] {
                assert!(!m(json!({"path": p, op: 0}), doc.clone()), "{p} {op}");
            }
        }
    }

    #[test]
    fn and_or_not_combine() {
        let f = json!({"and": [
            {"path": "/total", "gte": 100},
            {"or": [{"path": "/c", "in": ["DE", "FR"]}, {"path": "/vip", "equals": true}]},
            {"not": {"path": "/test", "exists": true}}
        ]});
        assert!(m(f.clone(), json!({"total": 150, "c": "DE"})));
        assert!(m(f.clone(), json!({"total": 100, "c": "US", "vip": true})));
        assert!(!m(f.clone(), json!({"total": 150, "c": "US"})));
        assert!(!m(
            f.clone(),
            json!({"total": 150, "c": "DE", "test": null})
        ));
        assert!(!m(f, json!({"total": 99, "c": "DE"})));
    }

    #[test]
    fn pointer_escapes_and_non_json_payloads() {
        let f = Filter::parse(&json!({"path": "/a~1b/c~0d", "equals": 1})).unwrap();
        assert!(f.matches_payload(br#"{"a/b": {"c~d": 1}}"#));
        let not = Filter::parse(&json!({"not": {"path": "/x", "exists": true}})).unwrap();
        assert!(not.matches_payload(b"{}"));
        assert!(!not.matches_payload(b"not json"));
    }

    #[test]
    fn the_json_shape_round_trips() {
        let v = json!({"or": [{"path": "/a", "lt": -1.5}, {"not": {"path": "", "in": [1, "x", null]}}]});
        let f = Filter::parse(&v).unwrap();
        assert_eq!(f.to_json(), v);
        let back: Filter = serde_json::from_str(&serde_json::to_string(&f).unwrap()).unwrap();
        assert_eq!(back, f);
    }
}
