//! The rulebook: every bound on what a caller hands lanebus, per entity
//! (event, route, handler, secret), defined once. The store checks them for
//! every caller, embedded ones included ([`Store::publish`],
//! [`Store::create_handler`], [`Store::update_handler`],
//! [`Store::rotate_handler_secret`] on every backend); the HTTP API checks
//! the same functions before it calls the store, and maps a [`Broken`] rule
//! to its status and error code.
//!
//! | entity | field | rule |
//! | --- | --- | --- |
//! | event | `id` | 1 to 128 printable ASCII characters without spaces |
//! | event | `type` | 1 to 128 characters of `[A-Za-z0-9._:/-]`; not starting with `lanebus.` (reserved for the operational events lanebus publishes itself, [`crate::operational`]) |
//! | event | `key` | 1 to 256 bytes, no control characters |
//! | event | `payload` | at most 1 MiB, nested at most 128 deep |
//! | event | `deliver_at` | at most 7 days ahead |
//! | event | `expected_seq` | 0 or more, and only with a `key` |
//! | event | `events` | at most 1,000 events per publish |
//! | route | `event_types[i]` | an event type, or a prefix with one trailing `*` |
//! | handler | `name` | 1 to 128 characters, not blank, no control characters |
//! | handler | `url` | an `http://` or `https://` URL with a host, at most 2,048 bytes, no whitespace, control characters or credentials |
//! | handler | `event_types` | 1 to 100 routes |
//! | handler | `max_attempts` | 1 to 100 |
//! | handler | `timeout_ms` | 100 to 300,000 |
//! | handler | `max_in_flight` | 1 to 10,000 |
//! | handler | `rate_limit.per_second`, `rate_limit.burst` | 1 to 100,000 |
//! | handler | `filter` | a payload filter ([`crate::filter`]): at most 8 levels of `and`/`or`/`not` around a condition, 32 conditions, 8,192 bytes of JSON |
//! | handler | `filter…path` | a JSON pointer (RFC 6901) of at most 256 bytes, without U+0000 or U+FFFF |
//! | handler | `filter…and`, `filter…or` | 1 or more filters |
//! | handler | `filter…in` | 1 to 100 strings (without U+0000 or U+FFFF), numbers, booleans or `null` |
//! | handler | `filter…equals` | a string (without U+0000 or U+FFFF), number, boolean or `null` |
//! | handler | `filter…gt`, `gte`, `lt`, `lte` | a number |
//! | handler | `filter…exists` | `true` or `false` |
//! | secret | `secret` | `whsec_` + standard base64 of 24 to 64 bytes |
//! | event type | `name`, `aliases[i]` | an event type (as `type` above), not reserved; a name is one type's wire name or alias, never two |
//! | event type | `aliases` | at most 20, none repeated, not the wire name |
//! | event type | `description` | at most 1,024 characters, no U+0000 |
//! | event type | `schema` | a JSON Schema (draft 2020-12) that compiles, at most 64 KiB as JSON, no external `$ref`, a `$schema` (if any) of draft 2020-12 or 2019-09, no U+0000 in its strings and member names |
//! | event | `payload` | satisfies its type's schema, if the catalog has one ([`crate::event_types`]) |
//! | event | `type` | in the catalog, when the store-wide strict setting is on |
//!
//! Rules of the HTTP request's shape stay with the API: well-formed JSON,
//! unknown fields, an RFC 3339 `deliver_at`, a non-empty `events` list (an
//! empty publish stores nothing and is no error here), a `secret` given as
//! `""` (here: generate one), handler ids of the form [`handler::ID_PATTERN`]
//! in paths, and a rotation's `grace_period_s` ([`secret::GRACE_PERIOD_S`]).
//!
//! Rules that depend on a node's configuration stay with the node: a
//! handler's `timeout_ms` must also fit the cluster's lane lease (the API
//! refuses a longer one; a node refuses to start with one stored), and a
//! handler's URL must pass the node's SSRF guard ([`crate::egress`]).
//!
//! [`Store::publish`]: crate::Store::publish
//! [`Store::create_handler`]: crate::Store::create_handler
//! [`Store::update_handler`]: crate::Store::update_handler
//! [`Store::rotate_handler_secret`]: crate::Store::rotate_handler_secret

use std::fmt;
use std::ops::RangeInclusive;

use crate::{Handler, HandlerPatch, NewEvent, NewHandler, RateLimit, Result, StoreError};

/// The kind of rule a value breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// A number outside its range.
    Range,
    /// A text or list of the wrong length.
    Length,
    /// A text of the wrong form (characters, prefix, syntax).
    Form,
    /// A payload larger than allowed.
    Size,
    /// A payload nested deeper than allowed.
    Depth,
    /// A time too far ahead.
    Horizon,
    /// A name reserved for lanebus itself (the `lanebus.` event types).
    Reserved,
    /// A field given without another one it needs (`expected_seq` without
    /// `key`).
    Requires,
    /// A payload that does not satisfy its event type's JSON Schema, or a
    /// schema that is not a valid one.
    Schema,
    /// An event type not in the catalog while the store-wide strict
    /// setting is on.
    Uncataloged,
}

/// A broken rule: which field, which kind of rule, and a message for
/// people that names the value (secrets are never repeated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Broken {
    /// The field as callers spell it: `max_attempts`, `rate_limit.burst`,
    /// `event_types[2]`, `events[3].key`, ...
    pub field: String,
    /// The kind of rule.
    pub rule: Rule,
    /// Lowercase text naming the value and the rule.
    pub message: String,
}

impl Broken {
    fn new(field: &str, rule: Rule, message: String) -> Self {
        Broken {
            field: field.to_owned(),
            rule,
            message,
        }
    }

    /// The same rule broken inside a list element or an object: `field`
    /// becomes `{prefix}.{field}` (or `{prefix}{field}` when `field` starts
    /// with `[`), and the message is prefixed by `{prefix}: `.
    pub fn within(self, prefix: &str) -> Self {
        let sep = if self.field.starts_with('[') { "" } else { "." };
        Broken {
            field: format!("{prefix}{sep}{}", self.field),
            rule: self.rule,
            message: format!("{prefix}: {}", self.message),
        }
    }
}

impl fmt::Display for Broken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Broken {}

impl From<Broken> for StoreError {
    fn from(b: Broken) -> Self {
        StoreError::Invalid(b.message)
    }
}

fn in_range<T: PartialOrd + fmt::Display>(
    field: &str,
    v: T,
    range: &RangeInclusive<T>,
) -> Result<(), Broken> {
    if range.contains(&v) {
        Ok(())
    } else {
        Err(Broken::new(
            field,
            Rule::Range,
            format!("{field} {v} must be {} to {}", range.start(), range.end()),
        ))
    }
}

/// A message from another library in our style: first letter lowercase, no
/// final period.
fn tidy(message: &str) -> String {
    let trimmed = message.trim().trim_end_matches('.');
    let mut chars = trimmed.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// Event rules ([`NewEvent`]).
pub mod event {
    use chrono::{DateTime, Utc};

    use super::{route, Broken, Rule};
    use crate::NewEvent;

    /// Longest event id, in bytes (printable ASCII, docs/design.md glossary).
    pub const MAX_ID_LEN: usize = 128;
    /// Longest event key, in bytes.
    pub const MAX_KEY_LEN: usize = 256;
    /// Largest payload, in bytes: 1 MiB.
    pub const MAX_PAYLOAD_BYTES: usize = 1 << 20;
    /// Deepest nesting of arrays and objects a payload may have: the default
    /// recursion limit of serde_json (128), which receivers parsing with it,
    /// or with parsers of similar limits, would otherwise fail on every
    /// attempt.
    pub const MAX_PAYLOAD_DEPTH: usize = 128;
    /// Most events in one publish.
    pub const MAX_BATCH: usize = 1_000;
    /// Farthest ahead a [`NewEvent::deliver_at`] may lie: 7 days. A delayed
    /// keyed event holds up its key's later events until it is delivered,
    /// so the bound keeps a typo (a year instead of a day) from blocking a
    /// key for good.
    pub const MAX_DELIVER_AHEAD: chrono::TimeDelta = chrono::TimeDelta::days(7);

    /// Checks a client-supplied event id.
    ///
    /// # Errors
    /// [`Rule::Form`] on `id`.
    pub fn id(id: &str) -> Result<(), Broken> {
        if id.is_empty() || id.len() > MAX_ID_LEN || !id.bytes().all(|b| (0x21..=0x7e).contains(&b))
        {
            return Err(Broken::new(
                "id",
                Rule::Form,
                format!(
                    "event id {id:?} must be 1 to {MAX_ID_LEN} printable ASCII characters without spaces"
                ),
            ));
        }
        Ok(())
    }

    /// Checks an ordering key: 1 to [`MAX_KEY_LEN`] bytes, no control
    /// characters (it travels in the `lanebus-key` header, where they
    /// cannot go, RFC 9110 section 5.5).
    ///
    /// # Errors
    /// [`Rule::Length`] or [`Rule::Form`] on `key`.
    pub fn key(key: &str) -> Result<(), Broken> {
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(Broken::new(
                "key",
                Rule::Length,
                format!(
                    "event key must be 1 to {MAX_KEY_LEN} bytes, got {} bytes",
                    key.len()
                ),
            ));
        }
        if key.chars().any(char::is_control) {
            return Err(Broken::new(
                "key",
                Rule::Form,
                format!("event key {key:?} must not contain control characters"),
            ));
        }
        Ok(())
    }

    /// Checks a payload's size ([`MAX_PAYLOAD_BYTES`]) and nesting
    /// ([`MAX_PAYLOAD_DEPTH`]).
    ///
    /// # Errors
    /// [`Rule::Size`] or [`Rule::Depth`] on `payload`.
    pub fn payload(raw: &[u8]) -> Result<(), Broken> {
        if raw.len() > MAX_PAYLOAD_BYTES {
            return Err(Broken::new(
                "payload",
                Rule::Size,
                format!(
                    "payload of {} bytes exceeds the limit of {MAX_PAYLOAD_BYTES} bytes",
                    raw.len()
                ),
            ));
        }
        if let Some(depth) = nesting_beyond(raw, MAX_PAYLOAD_DEPTH) {
            return Err(Broken::new(
                "payload",
                Rule::Depth,
                format!(
                    "payload nests {depth} or more arrays/objects deep; at most \
                     {MAX_PAYLOAD_DEPTH} are allowed (receivers' JSON parsers refuse deeper)"
                ),
            ));
        }
        Ok(())
    }

    /// Checks a delayed delivery time against `now` ([`MAX_DELIVER_AHEAD`]).
    ///
    /// # Errors
    /// [`Rule::Horizon`] on `deliver_at`.
    pub fn deliver_at(at: DateTime<Utc>, now: DateTime<Utc>) -> Result<(), Broken> {
        let latest = now + MAX_DELIVER_AHEAD;
        if at > latest {
            return Err(Broken::new(
                "deliver_at",
                Rule::Horizon,
                format!(
                    "deliver_at {} is more than {} days ahead (latest {})",
                    at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    MAX_DELIVER_AHEAD.num_days(),
                    latest.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                ),
            ));
        }
        Ok(())
    }

    /// Checks an expected sequence number ([`NewEvent::expected_seq`]): 0
    /// or more (0: the key has no event yet), and only on a keyed event
    /// (`keyed`): sequences are per key.
    ///
    /// # Errors
    /// [`Rule::Range`] or [`Rule::Requires`] on `expected_seq`.
    pub fn expected_seq(n: i64, keyed: bool) -> Result<(), Broken> {
        if n < 0 {
            return Err(Broken::new(
                "expected_seq",
                Rule::Range,
                format!("expected_seq {n} must be 0 or more (0: the key has no event yet)"),
            ));
        }
        if !keyed {
            return Err(Broken::new(
                "expected_seq",
                Rule::Requires,
                format!(
                    "expected_seq {n} needs a key: sequence numbers are per key, an unkeyed \
                     event has none"
                ),
            ));
        }
        Ok(())
    }

    /// Prefix of the event types lanebus publishes itself (its operational
    /// events, [`crate::operational`]); no one else may publish them.
    pub const RESERVED_PREFIX: &str = "lanebus.";

    /// Whether `t` is an event type under [`RESERVED_PREFIX`].
    pub fn is_reserved(t: &str) -> bool {
        t.starts_with(RESERVED_PREFIX)
    }

    /// Checks that an event type is not reserved ([`RESERVED_PREFIX`]).
    ///
    /// # Errors
    /// [`Rule::Reserved`] on `type`, naming the type.
    pub fn unreserved(t: &str) -> Result<(), Broken> {
        if is_reserved(t) {
            return Err(Broken::new(
                "type",
                Rule::Reserved,
                format!(
                    "event type {t:?} is reserved: types starting with {RESERVED_PREFIX:?} are \
                     lanebus's own operational events"
                ),
            ));
        }
        Ok(())
    }

    /// Checks one event, field by field, at `now`; its type must not be
    /// reserved ([`unreserved`]).
    ///
    /// # Errors
    /// The first [`Broken`] rule, naming the field.
    pub fn check(e: &NewEvent, now: DateTime<Utc>) -> Result<(), Broken> {
        if let Some(v) = &e.id {
            id(v)?;
        }
        route::event_type(&e.event_type)?;
        unreserved(&e.event_type)?;
        fields(e, now)?;
        no_envelope(&e.payload)
    }

    /// Checks that no string of a payload reads as an envelope of a
    /// personal field (`lbenc:v1:<base64url>:<base64>`, unescaped): delivery
    /// opens every one it finds, so a publisher's would be sent as `null`
    /// (or fail every attempt on a node without a master key). Only the
    /// store's sealing writes them ([`crate::personal`]). Not a rule of
    /// lanebus's own operational events.
    ///
    /// # Errors
    /// [`Rule::Reserved`] on `payload`, naming the string's pointer.
    pub fn no_envelope(raw: &[u8]) -> Result<(), Broken> {
        match crate::personal::envelope_lookalike(raw) {
            None => Ok(()),
            Some(at) => Err(Broken::new(
                "payload",
                Rule::Reserved,
                format!(
                    "the string at {at:?} reads as a personal field's envelope \
                     ({}<base64url>:<base64>), which only lanebus writes: delivery \
                     would decrypt it or send null; write its first character escaped \
                     (\\u006c) to send it as data",
                    crate::personal::ENVELOPE_PREFIX
                ),
            )),
        }
    }

    /// Checks one of lanebus's own operational events at `now`: as
    /// [`check`], but its type must be reserved ([`is_reserved`]).
    ///
    /// # Errors
    /// The first [`Broken`] rule, naming the field.
    pub fn check_operational(e: &NewEvent, now: DateTime<Utc>) -> Result<(), Broken> {
        if let Some(v) = &e.id {
            id(v)?;
        }
        route::event_type(&e.event_type)?;
        if !is_reserved(&e.event_type) {
            return Err(Broken::new(
                "type",
                Rule::Form,
                format!(
                    "event type {:?} is no operational event type (those start with \
                     {RESERVED_PREFIX:?})",
                    e.event_type
                ),
            ));
        }
        fields(e, now)
    }

    /// The rules of key, expected sequence, payload and delivery time.
    fn fields(e: &NewEvent, now: DateTime<Utc>) -> Result<(), Broken> {
        if let Some(k) = &e.key {
            key(k)?;
        }
        if let Some(n) = e.expected_seq {
            expected_seq(n, e.key.is_some())?;
        }
        payload(&e.payload)?;
        if let Some(at) = e.deliver_at {
            deliver_at(at, now)?;
        }
        Ok(())
    }

    /// Checks the size of a publish: at most [`MAX_BATCH`] events (an
    /// empty publish stores nothing and is no error).
    ///
    /// # Errors
    /// [`Rule::Length`] on `events`.
    pub fn batch_len(n: usize) -> Result<(), Broken> {
        if n > MAX_BATCH {
            return Err(Broken::new(
                "events",
                Rule::Length,
                format!("batch of {n} events exceeds the limit of {MAX_BATCH} events"),
            ));
        }
        Ok(())
    }

    /// Checks a publish: its size, then every event; an event's broken rule
    /// is named within `events[i]`.
    ///
    /// # Errors
    /// The first [`Broken`] rule.
    pub fn batch(events: &[NewEvent], now: DateTime<Utc>) -> Result<(), Broken> {
        batch_with(events, now, check)
    }

    /// As [`batch`], for lanebus's own operational events
    /// ([`check_operational`]).
    ///
    /// # Errors
    /// The first [`Broken`] rule.
    pub fn operational_batch(events: &[NewEvent], now: DateTime<Utc>) -> Result<(), Broken> {
        batch_with(events, now, check_operational)
    }

    fn batch_with(
        events: &[NewEvent],
        now: DateTime<Utc>,
        each: fn(&NewEvent, DateTime<Utc>) -> Result<(), Broken>,
    ) -> Result<(), Broken> {
        batch_len(events.len())?;
        for (i, e) in events.iter().enumerate() {
            each(e, now).map_err(|b| b.within(&format!("events[{i}]")))?;
        }
        Ok(())
    }

    /// `Some(max + 1)` when well-formed JSON `raw` nests arrays and objects
    /// deeper than `max`, else `None` (brackets inside strings do not count).
    fn nesting_beyond(raw: &[u8], max: usize) -> Option<usize> {
        let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
        for &b in raw {
            if in_string {
                match (escaped, b) {
                    (true, _) => escaped = false,
                    (false, b'\\') => escaped = true,
                    (false, b'"') => in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => in_string = true,
                b'[' | b'{' => {
                    depth += 1;
                    if depth > max {
                        return Some(depth);
                    }
                }
                b']' | b'}' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        None
    }
}

/// Event-type catalog rules ([`crate::event_types`]).
pub mod event_type {
    use super::{event, route, tidy, Broken, Rule};
    use crate::event_types::{EventTypePatch, NewEventType};

    /// Most aliases of one type.
    pub const MAX_ALIASES: usize = 20;
    /// Longest description, in characters.
    pub const MAX_DESCRIPTION_CHARS: usize = 1_024;
    /// Largest schema, in bytes of compact JSON.
    pub const MAX_SCHEMA_BYTES: usize = 64 << 10;

    /// Checks a wire name or alias given as `field`: an event type, not
    /// reserved.
    ///
    /// # Errors
    /// [`Rule::Form`] or [`Rule::Reserved`] on `field`.
    pub fn name(field: &str, n: &str) -> Result<(), Broken> {
        let rename = |b: Broken| Broken::new(field, b.rule, b.message);
        route::event_type(n).map_err(rename)?;
        event::unreserved(n).map_err(rename)
    }

    /// Checks a type's aliases next to its wire name `wire`.
    ///
    /// # Errors
    /// [`Rule::Length`] on `aliases`; a broken name on `aliases[i]`;
    /// [`Rule::Form`] for an alias repeated or equal to the wire name.
    pub fn aliases(wire: &str, aliases: &[String]) -> Result<(), Broken> {
        if aliases.len() > MAX_ALIASES {
            return Err(Broken::new(
                "aliases",
                Rule::Length,
                format!(
                    "{} aliases exceed the limit of {MAX_ALIASES}",
                    aliases.len()
                ),
            ));
        }
        for (i, a) in aliases.iter().enumerate() {
            let field = format!("aliases[{i}]");
            name(&field, a)?;
            if a == wire || aliases[..i].contains(a) {
                return Err(Broken::new(
                    &field,
                    Rule::Form,
                    format!("{field} {a:?} repeats a name of the type"),
                ));
            }
        }
        Ok(())
    }

    /// Checks a description.
    ///
    /// # Errors
    /// [`Rule::Length`] on `description`.
    pub fn description(d: &str) -> Result<(), Broken> {
        if d.contains('\0') {
            return Err(Broken::new(
                "description",
                Rule::Form,
                "description must not contain U+0000".to_owned(),
            ));
        }
        let n = d.chars().count();
        if n > MAX_DESCRIPTION_CHARS {
            return Err(Broken::new(
                "description",
                Rule::Length,
                format!("description of {n} characters exceeds {MAX_DESCRIPTION_CHARS}"),
            ));
        }
        Ok(())
    }

    /// Checks a schema: at most [`MAX_SCHEMA_BYTES`] as JSON, and a valid
    /// draft 2020-12 JSON Schema that compiles (an external `$ref` does
    /// not: nothing is fetched).
    ///
    /// # Errors
    /// [`Rule::Size`] or [`Rule::Schema`] on `schema`, saying what is wrong.
    pub fn schema(s: &serde_json::Value) -> Result<(), Broken> {
        let bytes = s.to_string().len();
        if bytes > MAX_SCHEMA_BYTES {
            return Err(Broken::new(
                "schema",
                Rule::Size,
                format!("schema of {bytes} bytes exceeds {MAX_SCHEMA_BYTES} bytes"),
            ));
        }
        let broken = |what: String| {
            Broken::new(
                "schema",
                Rule::Schema,
                format!("schema is not a valid JSON Schema (draft 2020-12): {what}"),
            )
        };
        if let Some(d) = s.get("$schema").and_then(serde_json::Value::as_str) {
            if !DRAFTS.contains(&d.trim_end_matches('#')) {
                return Err(broken(format!(
                    "$schema {d:?} is not draft 2020-12 or 2019-09, the drafts lanebus \
                     validates; drop $schema or migrate the schema"
                )));
            }
        }
        if has_nul(s) {
            return Err(broken("a string or member name holds U+0000".to_owned()));
        }
        if let Err(e) = jsonschema::draft202012::meta::validate(s) {
            let at = e.instance_path().as_str().to_owned();
            let at = if at.is_empty() { "/".to_owned() } else { at };
            return Err(broken(format!(
                "at {at}: {}",
                tidy(&e.masked().to_string())
            )));
        }
        jsonschema::draft202012::new(s).map_err(|e| broken(tidy(&e.to_string())))?;
        if let Some(spec) = crate::personal::Spec::derive(s)? {
            // Checked here, not in `derive`: a type stored before this
            // rule still compiles (delivery escapes its header).
            if let Some(f) = spec.fields.iter().find(|f| f.chars().any(char::is_control)) {
                return Err(personal_marks(&format!(
                    "the personal field {f:?} has a control character in its name; \
                     personal fields are named in the `lanebus-redacted` header, so \
                     rename the property or drop its mark"
                )));
            }
        }
        Ok(())
    }

    /// The `$schema` values a schema may declare (a trailing `#` aside):
    /// the drafts the validator applies as they say. Others (draft-04, 06,
    /// 07) would compile and check nothing of their own keywords' meaning.
    const DRAFTS: [&str; 4] = [
        "https://json-schema.org/draft/2020-12/schema",
        "https://json-schema.org/draft/2019-09/schema",
        "http://json-schema.org/draft/2020-12/schema",
        "http://json-schema.org/draft/2019-09/schema",
    ];

    /// Whether a string or member name anywhere in `v` holds U+0000 (the
    /// PostgreSQL store's `jsonb` cannot hold it).
    fn has_nul(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::String(x) => x.contains('\0'),
            serde_json::Value::Array(a) => a.iter().any(has_nul),
            serde_json::Value::Object(m) => m.iter().any(|(k, x)| k.contains('\0') || has_nul(x)),
            _ => false,
        }
    }

    /// The rule broken by a schema's personal-field marks
    /// ([`crate::personal::Spec::derive`]), `why` saying how.
    pub fn personal_marks(why: &str) -> Broken {
        Broken::new(
            "schema",
            Rule::Schema,
            format!("schema's personal-field marks are broken: {why}"),
        )
    }

    /// The rule broken by a payload of a type with personal fields that
    /// holds no string or number at its subject pointer `at`.
    pub fn no_subject(at: &str) -> Broken {
        Broken::new(
            "payload",
            Rule::Requires,
            format!("payload has personal fields but no subject id (a string or a number) at {at}"),
        )
    }

    /// A payload whose subject id at JSON pointer `at` is an integer
    /// beyond 64 bits (read as a double, distinct ids would be one
    /// subject).
    pub fn subject_too_large(at: &str) -> Broken {
        Broken::new(
            "payload",
            Rule::Range,
            format!(
                "the subject id at {at} is an integer beyond 64 bits, which would be read \
                 as a double (distinct ids one subject): send it as a string"
            ),
        )
    }

    /// A payload whose subject id at JSON pointer `at` is `.` or `..`,
    /// which many HTTP clients cannot name in `DELETE /v1/subjects/{id}`
    /// (WHATWG URL parsers resolve the dot segment, percent-encoded too).
    pub fn subject_dot_segment(at: &str) -> Broken {
        Broken::new(
            "payload",
            Rule::Form,
            format!(
                "the subject id at {at} is a dot segment (\".\" or \"..\"), which many HTTP \
                 clients rewrite in DELETE /v1/subjects/{{id}}: send another id"
            ),
        )
    }

    /// Checks a subject id: 1 to [`crate::personal::MAX_SUBJECT_BYTES`]
    /// bytes, no control characters.
    ///
    /// # Errors
    /// [`Rule::Length`] or [`Rule::Form`] on `subject`.
    pub fn subject(s: &str) -> Result<(), Broken> {
        let max = crate::personal::MAX_SUBJECT_BYTES;
        if s.is_empty() || s.len() > max {
            return Err(Broken::new(
                "subject",
                Rule::Length,
                format!("subject id of {} bytes is not 1 to {max} bytes", s.len()),
            ));
        }
        if s.chars().any(char::is_control) {
            return Err(Broken::new(
                "subject",
                Rule::Form,
                "subject id holds a control character".to_owned(),
            ));
        }
        Ok(())
    }

    /// Checks a type to create.
    ///
    /// # Errors
    /// The first [`Broken`] rule, naming the field.
    pub fn check(t: &NewEventType) -> Result<(), Broken> {
        name("name", &t.name)?;
        description(&t.description)?;
        aliases(&t.name, &t.aliases)?;
        t.schema.as_ref().map_or(Ok(()), schema)
    }

    /// Checks the fields of a change (the aliases again on the result,
    /// [`aliases`]).
    ///
    /// # Errors
    /// The first [`Broken`] rule, naming the field.
    pub fn check_patch(p: &EventTypePatch) -> Result<(), Broken> {
        if let Some(n) = &p.name {
            name("name", n)?;
        }
        if let Some(d) = &p.description {
            description(d)?;
        }
        if let Some(Some(s)) = &p.schema {
            schema(s)?;
        }
        Ok(())
    }

    /// The rule broken by a payload of type `wire` failing its schema at
    /// the JSON pointer `at` ("" for the whole payload) by `keyword`.
    pub fn payload_fails(wire: &str, at: &str, keyword: &str, why: &str) -> Broken {
        let at = if at.is_empty() { "/" } else { at };
        Broken::new(
            "payload",
            Rule::Schema,
            format!(
                "payload at {at} breaks the schema of event type {wire:?} \
                 (keyword {keyword:?}): {}",
                tidy(why)
            ),
        )
    }

    /// The rule broken by a type not in the catalog while strict.
    pub fn not_cataloged(t: &str) -> Broken {
        Broken::new(
            "type",
            Rule::Uncataloged,
            format!(
                "event type {t:?} is not in the catalog, and the store refuses types not in it"
            ),
        )
    }
}

/// Route rules: event types and the patterns handlers route by.
pub mod route {
    use super::{Broken, Rule};

    /// Longest event type or route pattern, in bytes.
    pub const MAX_TYPE_LEN: usize = 128;

    fn type_chars_ok(s: &str) -> bool {
        s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':' | b'/'))
    }

    /// Checks an event type: 1 to 128 characters of `[A-Za-z0-9._:/-]`.
    ///
    /// # Errors
    /// [`Rule::Form`] on `type`, naming the type.
    pub fn event_type(t: &str) -> Result<(), Broken> {
        if t.is_empty() || t.len() > MAX_TYPE_LEN || !type_chars_ok(t) {
            return Err(Broken::new(
                "type",
                Rule::Form,
                format!(
                    "event type {t:?} must be 1 to {MAX_TYPE_LEN} characters of letters, digits and ._:/-"
                ),
            ));
        }
        Ok(())
    }

    /// Checks a route pattern: an event type, optionally ending in one `*`.
    ///
    /// # Errors
    /// [`Rule::Form`] on `route`, naming the pattern.
    pub fn pattern(p: &str) -> Result<(), Broken> {
        let body = p.strip_suffix('*').unwrap_or(p);
        if p.len() > MAX_TYPE_LEN
            || body.contains('*')
            || (body.is_empty() && p != "*")
            || !type_chars_ok(body)
        {
            return Err(Broken::new(
                "route",
                Rule::Form,
                format!(
                    "route {p:?} must be an event type or a prefix followed by one trailing '*'"
                ),
            ));
        }
        Ok(())
    }
}

/// Signing secret rules.
pub mod secret {
    use std::ops::RangeInclusive;

    use base64::Engine as _;

    use super::{tidy, Broken, Rule};

    /// Prefix of every signing secret (Standard Webhooks).
    pub const PREFIX: &str = "whsec_";
    /// Allowed length of the decoded secret, in bytes (Standard Webhooks:
    /// 24 to 64).
    pub const BYTES: RangeInclusive<usize> = 24..=64;
    /// Allowed grace period of a rotation, in seconds: up to 30 days.
    pub const GRACE_PERIOD_S: RangeInclusive<u64> = 0..=2_592_000;
    /// Default grace period of a rotation: 24 hours.
    pub const DEFAULT_GRACE_PERIOD_S: u64 = 86_400;

    /// Checks a signing secret: [`PREFIX`] + standard base64 of [`BYTES`].
    ///
    /// # Errors
    /// [`Rule::Form`] or [`Rule::Length`] on `secret`; the message does not
    /// repeat the secret.
    pub fn check(secret: &str) -> Result<(), Broken> {
        let Some(b64) = secret.strip_prefix(PREFIX) else {
            return Err(Broken::new(
                "secret",
                Rule::Form,
                format!("secret must start with {PREFIX:?}"),
            ));
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| {
                Broken::new(
                    "secret",
                    Rule::Form,
                    format!(
                        "secret after {PREFIX:?} is not standard base64: {}",
                        tidy(&e.to_string())
                    ),
                )
            })?;
        if !BYTES.contains(&bytes.len()) {
            return Err(Broken::new(
                "secret",
                Rule::Length,
                format!(
                    "secret decodes to {} bytes, expected {} to {}",
                    bytes.len(),
                    BYTES.start(),
                    BYTES.end()
                ),
            ));
        }
        Ok(())
    }
}

/// Payload filter rules ([`crate::filter::Filter`], a handler's `filter`).
pub mod filter {
    use serde_json::{Map, Value};

    use super::{Broken, Rule};
    use crate::filter::{Condition, Filter, Test};

    /// Deepest nesting of a filter: levels of `and`, `or` and `not` around
    /// a condition (a condition alone is 0 levels).
    pub const MAX_DEPTH: usize = 8;
    /// Most conditions (`{"path": ...}` objects) in one filter.
    pub const MAX_CONDITIONS: usize = 32;
    /// Most values in one `in` list.
    pub const MAX_IN_VALUES: usize = 100;
    /// Largest filter, in bytes of its compact JSON.
    pub const MAX_BYTES: usize = 8_192;
    /// Longest `path`, in bytes.
    pub const MAX_PATH_BYTES: usize = 256;
    /// The operators of a condition.
    pub const OPERATORS: [&str; 7] = ["equals", "in", "exists", "gt", "gte", "lt", "lte"];

    fn form(field: &str, message: String) -> Broken {
        Broken::new(field, Rule::Form, format!("{field}: {message}"))
    }

    /// Parses a filter's JSON ([`crate::filter`] shape) and checks it
    /// ([`check`]).
    ///
    /// # Errors
    /// The first broken rule, its field named from `filter` on
    /// (`filter.and[1].path`): [`Rule::Form`] for a wrong shape (not an
    /// object, unknown or missing operator, two operators, an operand of
    /// the wrong type, a bad JSON pointer), [`Rule::Length`],
    /// [`Rule::Depth`] or [`Rule::Size`] for a bound.
    pub fn parse(v: &Value) -> Result<Filter, Broken> {
        let f = parse_at(v, "filter", 0)?;
        check(&f)?;
        Ok(f)
    }

    fn parse_at(v: &Value, field: &str, depth: usize) -> Result<Filter, Broken> {
        if depth > MAX_DEPTH {
            return Err(too_deep(field));
        }
        let Value::Object(m) = v else {
            return Err(form(
                field,
                "a filter must be a JSON object: {\"path\": ..., OP: ...}, {\"and\": [...]}, \
                 {\"or\": [...]} or {\"not\": ...}"
                    .into(),
            ));
        };
        let list = |key: &str, items: &Value| -> Result<Vec<Filter>, Broken> {
            let at = format!("{field}.{key}");
            let Value::Array(items) = items else {
                return Err(form(&at, "must be a list of filters".into()));
            };
            items
                .iter()
                .enumerate()
                .map(|(i, f)| parse_at(f, &format!("{at}[{i}]"), depth + 1))
                .collect()
        };
        if m.len() == 1 {
            if let Some(items) = m.get("and") {
                return Ok(Filter::And(list("and", items)?));
            }
            if let Some(items) = m.get("or") {
                return Ok(Filter::Or(list("or", items)?));
            }
            if let Some(inner) = m.get("not") {
                let at = format!("{field}.not");
                return Ok(Filter::Not(Box::new(parse_at(inner, &at, depth + 1)?)));
            }
        }
        condition(m, field).map(Filter::Field)
    }

    fn condition(m: &Map<String, Value>, field: &str) -> Result<Condition, Broken> {
        let Some(path) = m.get("path") else {
            return Err(form(
                field,
                format!(
                    "expected \"and\", \"or\" or \"not\" alone, or \"path\" with one operator of \
                     {OPERATORS:?}; got the keys {:?}",
                    m.keys().collect::<Vec<_>>()
                ),
            ));
        };
        let Value::String(path) = path else {
            return Err(form(&format!("{field}.path"), "must be a string".into()));
        };
        let ops: Vec<&String> = m.keys().filter(|k| *k != "path").collect();
        let [op] = ops.as_slice() else {
            return Err(form(
                field,
                format!("a condition takes exactly one operator of {OPERATORS:?}; got {ops:?}"),
            ));
        };
        let at = format!("{field}.{op}");
        let operand = &m[op.as_str()];
        let number = || match operand {
            Value::Number(n) => Ok(n.clone()),
            _ => Err(form(&at, format!("{op} takes a number, got {operand}"))),
        };
        let test = match op.as_str() {
            "equals" => Test::Equals(operand.clone()),
            "in" => match operand {
                Value::Array(vs) => Test::In(vs.clone()),
                _ => return Err(form(&at, "in takes a list of values".into())),
            },
            "exists" => match operand {
                Value::Bool(b) => Test::Exists(*b),
                _ => {
                    return Err(form(
                        &at,
                        format!("exists takes true or false, got {operand}"),
                    ))
                }
            },
            "gt" => Test::Gt(number()?),
            "gte" => Test::Gte(number()?),
            "lt" => Test::Lt(number()?),
            "lte" => Test::Lte(number()?),
            _ => {
                return Err(form(
                    field,
                    format!("unknown operator {op:?}; expected one of {OPERATORS:?}"),
                ))
            }
        };
        Ok(Condition {
            path: path.clone(),
            test,
        })
    }

    fn too_deep(field: &str) -> Broken {
        Broken::new(
            field,
            Rule::Depth,
            format!("{field}: filter nests more than {MAX_DEPTH} levels of and/or/not"),
        )
    }

    /// Checks a filter's bounds ([`MAX_DEPTH`], [`MAX_CONDITIONS`],
    /// [`MAX_IN_VALUES`], [`MAX_BYTES`], [`MAX_PATH_BYTES`]), its paths
    /// (JSON pointers: empty, or `/` and tokens in which `~` is followed by
    /// `0` or `1`), its operands (`equals` and `in`: scalars; comparisons: a
    /// finite number), and that `and`/`or` lists are not empty.
    ///
    /// # Errors
    /// The first broken rule, its field named from `filter` on.
    pub fn check(f: &Filter) -> Result<(), Broken> {
        let mut conditions = 0;
        walk(f, "filter", 0, &mut conditions)?;
        if conditions > MAX_CONDITIONS {
            return Err(Broken::new(
                "filter",
                Rule::Length,
                format!(
                    "filter: holds {conditions} conditions; at most {MAX_CONDITIONS} are allowed"
                ),
            ));
        }
        let bytes = f.to_json().to_string().len();
        if bytes > MAX_BYTES {
            return Err(Broken::new(
                "filter",
                Rule::Size,
                format!("filter: {bytes} bytes of JSON exceed the limit of {MAX_BYTES} bytes"),
            ));
        }
        Ok(())
    }

    fn walk(f: &Filter, field: &str, depth: usize, conditions: &mut usize) -> Result<(), Broken> {
        if depth > MAX_DEPTH {
            return Err(too_deep(field));
        }
        let (key, items) = match f {
            Filter::And(items) => ("and", items),
            Filter::Or(items) => ("or", items),
            Filter::Not(inner) => {
                return walk(inner, &format!("{field}.not"), depth + 1, conditions)
            }
            Filter::Field(c) => {
                *conditions += 1;
                return check_condition(c, field);
            }
        };
        let at = format!("{field}.{key}");
        if items.is_empty() {
            return Err(Broken::new(
                &at,
                Rule::Length,
                format!("{at}: must hold at least one filter"),
            ));
        }
        for (i, item) in items.iter().enumerate() {
            walk(item, &format!("{at}[{i}]"), depth + 1, conditions)?;
        }
        Ok(())
    }

    fn check_condition(c: &Condition, field: &str) -> Result<(), Broken> {
        let path_at = format!("{field}.path");
        pointer(&c.path)
            .map_err(|b| Broken::new(&path_at, b.rule, format!("{path_at}: {}", b.message)))?;
        if has_unmatchable(&c.path) {
            return Err(form(&path_at, UNMATCHABLE.into()));
        }
        let at = format!("{field}.{}", c.test.name());
        let scalar = |v: &Value, at: &str| match v {
            Value::Array(_) | Value::Object(_) => Err(form(
                at,
                format!("takes a string, number, boolean or null, got {v}"),
            )),
            Value::String(s) if has_unmatchable(s) => Err(form(at, UNMATCHABLE.into())),
            _ => Ok(()),
        };
        match &c.test {
            Test::Equals(v) => scalar(v, &at),
            Test::In(vs) => {
                if vs.is_empty() || vs.len() > MAX_IN_VALUES {
                    return Err(Broken::new(
                        &at,
                        Rule::Length,
                        format!(
                            "{at}: list of {} values must hold 1 to {MAX_IN_VALUES}",
                            vs.len()
                        ),
                    ));
                }
                for (i, v) in vs.iter().enumerate() {
                    scalar(v, &format!("{at}[{i}]"))?;
                }
                Ok(())
            }
            Test::Exists(_) => Ok(()),
            Test::Gt(n) | Test::Gte(n) | Test::Lt(n) | Test::Lte(n) => {
                if n.as_f64().is_some_and(f64::is_finite) {
                    Ok(())
                } else {
                    Err(form(&at, format!("{n} is not a finite number")))
                }
            }
        }
    }

    /// Why a filter's string may not hold U+0000 or U+FFFF: PostgreSQL's
    /// jsonb cannot hold U+0000, so there a payload's `\u0000` is read as
    /// U+FFFF (`lanebus.filter_doc`); neither may be named, so a payload
    /// string holding one equals no operand on every store.
    const UNMATCHABLE: &str = "must not hold the characters U+0000 or U+FFFF";

    fn has_unmatchable(s: &str) -> bool {
        s.contains(['\u{0}', '\u{ffff}'])
    }

    /// Checks a JSON pointer (RFC 6901): empty (the whole payload), or `/`
    /// followed by tokens separated by `/`, in which `~` is followed by `0`
    /// or `1`; at most [`MAX_PATH_BYTES`].
    ///
    /// # Errors
    /// [`Rule::Length`] or [`Rule::Form`] on `path`.
    pub fn pointer(path: &str) -> Result<(), Broken> {
        if path.len() > MAX_PATH_BYTES {
            return Err(Broken::new(
                "path",
                Rule::Length,
                format!(
                    "path of {} bytes exceeds the limit of {MAX_PATH_BYTES} bytes",
                    path.len()
                ),
            ));
        }
        let escapes_ok = path
            .split('~')
            .skip(1)
            .all(|rest| rest.starts_with('0') || rest.starts_with('1'));
        if !(path.is_empty() || path.starts_with('/')) || !escapes_ok {
            return Err(Broken::new(
                "path",
                Rule::Form,
                format!(
                    "path {path:?} must be a JSON pointer (RFC 6901): empty, or \"/\" and \
                     members or indexes separated by \"/\", with \"~1\" for \"/\" and \"~0\" \
                     for \"~\""
                ),
            ));
        }
        Ok(())
    }
}

/// Handler rules ([`NewHandler`], [`HandlerPatch`]).
pub mod handler {
    use std::ops::RangeInclusive;

    use super::{filter, in_range, route, secret, tidy, Broken, Rule};
    use crate::{HandlerPatch, NewHandler, RateLimit};

    /// Allowed length of `name`, in characters.
    pub const NAME_CHARS: RangeInclusive<usize> = 1..=128;
    /// Longest accepted `url`, in bytes.
    pub const MAX_URL_BYTES: usize = 2_048;
    /// Allowed number of routes per handler.
    pub const ROUTES: RangeInclusive<usize> = 1..=100;
    /// Allowed `max_attempts`.
    pub const MAX_ATTEMPTS: RangeInclusive<u32> = 1..=100;
    /// Allowed `timeout_ms`, in milliseconds.
    pub const TIMEOUT_MS: RangeInclusive<u64> = 100..=300_000;
    /// Allowed `max_in_flight`.
    pub const MAX_IN_FLIGHT: RangeInclusive<u32> = 1..=10_000;
    /// Allowed `rate_limit.per_second` and `rate_limit.burst`.
    pub const RATE_LIMIT: RangeInclusive<u32> = 1..=100_000;
    /// The form of every handler id (`hdl_` + a UUIDv7 in 32 lowercase hex
    /// digits, [`crate::generate_handler_id`]), as a regular expression.
    pub const ID_PATTERN: &str = "^hdl_[0-9a-f]{32}$";

    /// Whether `id` has the form of a handler id ([`ID_PATTERN`]).
    pub fn is_id(id: &str) -> bool {
        id.strip_prefix("hdl_").is_some_and(|hex| {
            hex.len() == 32 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        })
    }

    /// Checks a name: [`NAME_CHARS`] characters, not only whitespace, no
    /// control characters.
    ///
    /// # Errors
    /// [`Rule::Length`] or [`Rule::Form`] on `name`.
    pub fn name(name: &str) -> Result<(), Broken> {
        let chars = name.chars().count();
        if !NAME_CHARS.contains(&chars) {
            return Err(Broken::new(
                "name",
                Rule::Length,
                format!(
                    "name of {chars} characters must be {} to {} characters",
                    NAME_CHARS.start(),
                    NAME_CHARS.end()
                ),
            ));
        }
        if name.chars().any(char::is_control) {
            return Err(Broken::new(
                "name",
                Rule::Form,
                format!("name {name:?} must not hold control characters"),
            ));
        }
        if name.trim().is_empty() {
            return Err(Broken::new(
                "name",
                Rule::Form,
                format!("name {name:?} must not be only whitespace"),
            ));
        }
        Ok(())
    }

    /// `raw` with any userinfo (`user:password@`) of its authority replaced
    /// by `***@`, so refusals never repeat credentials.
    pub fn redacted(raw: &str) -> String {
        let start = raw.find("://").map_or(0, |i| i + 3);
        let rest = &raw[start..];
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        match rest[..authority_end].rfind('@') {
            Some(at) => format!("{}***{}", &raw[..start], &rest[at..]),
            None => raw.to_owned(),
        }
    }

    /// Checks a webhook URL: at most [`MAX_URL_BYTES`], no whitespace or
    /// control characters, parses (WHATWG URL), starts with `http://` or
    /// `https://`, has a host, and carries no credentials
    /// (`user:password@`): the URL is written to logs and answered by
    /// `GET /v1/handlers`, so credentials in it would leak; receivers
    /// authenticate lanebus by the request signature instead.
    ///
    /// # Errors
    /// [`Rule::Length`] or [`Rule::Form`] on `url`, naming the URL with any
    /// credentials masked.
    pub fn url(raw: &str) -> Result<(), Broken> {
        let form = |m: String| Broken::new("url", Rule::Form, m);
        if raw.len() > MAX_URL_BYTES {
            return Err(Broken::new(
                "url",
                Rule::Length,
                format!(
                    "url of {} bytes exceeds the limit of {MAX_URL_BYTES} bytes",
                    raw.len()
                ),
            ));
        }
        let shown = redacted(raw);
        if raw.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(form(format!(
                "url {shown:?} must not contain whitespace or control characters (percent-encode them)"
            )));
        }
        let url = url::Url::parse(raw).map_err(|e| {
            form(format!(
                "url {shown:?} does not parse: {}",
                tidy(&e.to_string())
            ))
        })?;
        if url.scheme() == NATS_SCHEME {
            return nats(raw).map(|_| ());
        }
        if url.scheme() == KAFKA_SCHEME {
            return kafka(raw).map(|_| ());
        }
        if !matches!(url.scheme(), "http" | "https") {
            return Err(form(format!(
                "url {shown:?} has scheme {:?}, expected http, https, nats or kafka",
                url.scheme()
            )));
        }
        if !(raw.starts_with("http://") || raw.starts_with("https://")) {
            return Err(form(format!(
                "url {shown:?} must start with http:// or https://"
            )));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(form(format!("url {shown:?} has no host")));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(form(format!(
                "url {shown:?} must not carry credentials (a user or password before \"@\"): urls are written to \
                 logs and shown by the api, so credentials in them leak; receivers authenticate \
                 requests by their webhook-signature"
            )));
        }
        Ok(())
    }

    /// `host:port`, an IPv6 host in brackets.
    pub fn host_port(host: &str, port: u16) -> String {
        if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        }
    }

    /// The host and port of broker URL `url` (`scheme://HOST[:PORT]/...`,
    /// `port` when it names none), refusing credentials (`flags` names the
    /// node settings that hold them), a port 0, a query and a fragment.
    fn broker_server(
        url: &url::Url,
        port: u16,
        flags: &str,
        form: impl Fn(String) -> Broken,
    ) -> Result<(String, u16), Broken> {
        if !url.username().is_empty() || url.password().is_some() {
            return Err(form(format!(
                "must not carry credentials (a user or password before \"@\"): urls are \
                 written to logs and shown by the api; give the node its credentials ({flags})"
            )));
        }
        let host = match url.host() {
            Some(url::Host::Domain(d)) if !d.is_empty() => d.to_owned(),
            Some(url::Host::Ipv4(ip)) => ip.to_string(),
            Some(url::Host::Ipv6(ip)) => ip.to_string(),
            _ => return Err(form("has no host".into())),
        };
        if url.port() == Some(0) {
            return Err(form("has port 0".into()));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(form("must not have a query or fragment".into()));
        }
        Ok((host, url.port().unwrap_or(port)))
    }

    /// The path of URL `raw` after its host, as written: `url::Url`
    /// resolves `a/../b` before its path can be seen.
    fn raw_path(raw: &str) -> &str {
        raw.splitn(4, '/')
            .nth(3)
            .and_then(|p| p.split(['?', '#']).next())
            .unwrap_or_default()
    }

    /// Scheme of NATS JetStream handler URLs: `nats://HOST[:PORT]/SUBJECT`.
    pub const NATS_SCHEME: &str = "nats";
    /// Port of a NATS URL that names none (the NATS client port).
    pub const NATS_PORT: u16 = 4222;
    /// Placeholders a NATS subject may hold: the event's type and key.
    pub const NATS_PLACEHOLDERS: [&str; 2] = ["{type}", "{key}"];

    /// A NATS JetStream destination, from a handler URL ([`nats`]).
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct NatsTarget {
        /// Host name or address (an IPv6 address without brackets).
        pub host: String,
        /// Port.
        pub port: u16,
        /// Subject, possibly with [`NATS_PLACEHOLDERS`].
        pub subject: String,
    }

    impl NatsTarget {
        /// `host:port`, an IPv6 host in brackets.
        pub fn server(&self) -> String {
            host_port(&self.host, self.port)
        }

        /// The subject of one event: `{type}` and `{key}` replaced.
        ///
        /// # Errors
        /// A message when the subject uses `{key}` and the event has no key,
        /// or a key that cannot stand in a subject token (empty, or holding
        /// whitespace, `.`, `*` or `>`).
        pub fn subject_for(&self, event_type: &str, key: Option<&str>) -> Result<String, String> {
            let mut subject = self.subject.replace("{type}", event_type);
            if subject.contains("{key}") {
                let Some(key) = key else {
                    return Err(format!(
                        "subject {:?} needs a key and the event has none",
                        self.subject
                    ));
                };
                if key.is_empty() || !key.chars().all(subject_char) {
                    return Err(format!(
                        "key {key:?} cannot stand in subject {:?} (no whitespace, '.', '*' or '>')",
                        self.subject
                    ));
                }
                subject = subject.replace("{key}", key);
            }
            Ok(subject)
        }
    }

    /// Whether `c` may stand in a subject token (NATS: no whitespace, no
    /// separator `.`, no wildcard `*` or `>`).
    fn subject_char(c: char) -> bool {
        !(c.is_whitespace() || c.is_control() || matches!(c, '.' | '*' | '>'))
    }

    /// Checks and parses a NATS JetStream handler URL:
    /// `nats://HOST[:PORT]/SUBJECT` (port [`NATS_PORT`] by default), no
    /// credentials (they are the node's settings: URLs are shown by the
    /// API), no query or fragment; SUBJECT is dot-separated tokens without
    /// wildcards, each non-empty, and may hold [`NATS_PLACEHOLDERS`].
    ///
    /// # Errors
    /// [`Rule::Form`] on `url`, saying what is wrong.
    pub fn nats(raw: &str) -> Result<NatsTarget, Broken> {
        let shown = redacted(raw);
        let form = |m: String| Broken::new("url", Rule::Form, format!("url {shown:?} {m}"));
        let url = url::Url::parse(raw)
            .map_err(|e| form(format!("does not parse: {}", tidy(&e.to_string()))))?;
        if url.scheme() != NATS_SCHEME || !raw.starts_with("nats://") {
            return Err(form("must start with nats://".into()));
        }
        let (host, port) = broker_server(
            &url,
            NATS_PORT,
            "--nats-user, --nats-password, --nats-token",
            form,
        )?;
        let subject =
            percent_decode(raw_path(raw)).ok_or_else(|| form("has a bad %-escape".into()))?;
        if subject.is_empty() {
            return Err(form("has no subject (nats://HOST:PORT/SUBJECT)".into()));
        }
        let bare = NATS_PLACEHOLDERS
            .iter()
            .fold(subject.clone(), |s, p| s.replace(p, "x"));
        if bare
            .split('.')
            .any(|token| token.is_empty() || !token.chars().all(subject_char))
            || bare.contains(['{', '}'])
        {
            return Err(form(format!(
                "has subject {subject:?}: expected dot-separated tokens, none empty, without \
                 whitespace or the wildcards '*' and '>', with {{type}} and {{key}} as the only \
                 placeholders"
            )));
        }
        Ok(NatsTarget {
            host,
            port,
            subject,
        })
    }

    /// Scheme of Kafka handler URLs: `kafka://HOST[:PORT]/TOPIC`.
    pub const KAFKA_SCHEME: &str = "kafka";
    /// Port of a Kafka URL that names none (the Kafka client port).
    pub const KAFKA_PORT: u16 = 9092;
    /// Longest Kafka topic name, in bytes (Kafka's `Topic.MAX_NAME_LENGTH`).
    pub const KAFKA_TOPIC_BYTES: usize = 249;

    /// A Kafka destination, from a handler URL ([`kafka`]).
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct KafkaTarget {
        /// Bootstrap host name or address (an IPv6 address without brackets).
        pub host: String,
        /// Bootstrap port.
        pub port: u16,
        /// Topic.
        pub topic: String,
    }

    impl KafkaTarget {
        /// `host:port` of the bootstrap server, an IPv6 host in brackets.
        pub fn server(&self) -> String {
            host_port(&self.host, self.port)
        }
    }

    /// Checks and parses a Kafka handler URL: `kafka://HOST[:PORT]/TOPIC`
    /// (port [`KAFKA_PORT`] by default; HOST is the bootstrap server), no
    /// credentials (they are the node's settings), no query or fragment;
    /// TOPIC is 1 to [`KAFKA_TOPIC_BYTES`] of `[A-Za-z0-9._-]`, not `.` or
    /// `..` (Kafka's own topic rule).
    ///
    /// # Errors
    /// [`Rule::Form`] on `url`, saying what is wrong.
    pub fn kafka(raw: &str) -> Result<KafkaTarget, Broken> {
        let shown = redacted(raw);
        let form = |m: String| Broken::new("url", Rule::Form, format!("url {shown:?} {m}"));
        let url = url::Url::parse(raw)
            .map_err(|e| form(format!("does not parse: {}", tidy(&e.to_string()))))?;
        if url.scheme() != KAFKA_SCHEME || !raw.starts_with("kafka://") {
            return Err(form("must start with kafka://".into()));
        }
        let (host, port) = broker_server(
            &url,
            KAFKA_PORT,
            "--kafka-sasl-username, --kafka-sasl-password",
            form,
        )?;
        let path = raw_path(raw);
        if path.is_empty() {
            return Err(form("has no topic (kafka://HOST:PORT/TOPIC)".into()));
        }
        if path.len() > KAFKA_TOPIC_BYTES
            || path == "."
            || path == ".."
            || !path
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(form(format!(
                "has topic {path:?}: expected 1 to {KAFKA_TOPIC_BYTES} of the characters \
                 A-Z a-z 0-9 . _ -, not \".\" or \"..\""
            )));
        }
        Ok(KafkaTarget {
            host,
            port,
            topic: path.to_owned(),
        })
    }

    /// `s` with `%XX` escapes decoded, if they are well-formed UTF-8.
    fn percent_decode(s: &str) -> Option<String> {
        let b = s.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' {
                let hex = s.get(i + 1..i + 3)?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            } else {
                out.push(b[i]);
                i += 1;
            }
        }
        String::from_utf8(out).ok()
    }

    /// Checks routes: [`ROUTES`] of them, each a valid
    /// [`route::pattern`] (named `event_types[i]`).
    ///
    /// # Errors
    /// [`Rule::Length`] on `event_types`, or the route's rule.
    pub fn routes(event_types: &[String]) -> Result<(), Broken> {
        if !ROUTES.contains(&event_types.len()) {
            return Err(Broken::new(
                "event_types",
                Rule::Length,
                format!(
                    "event_types holds {} routes, expected {} to {}",
                    event_types.len(),
                    ROUTES.start(),
                    ROUTES.end()
                ),
            ));
        }
        for (i, p) in event_types.iter().enumerate() {
            route::pattern(p).map_err(|b| Broken {
                field: format!("event_types[{i}]"),
                rule: b.rule,
                message: format!("event_types[{i}]: {}", b.message),
            })?;
        }
        Ok(())
    }

    /// Checks `max_attempts` ([`MAX_ATTEMPTS`]).
    ///
    /// # Errors
    /// [`Rule::Range`].
    pub fn max_attempts(v: u32) -> Result<(), Broken> {
        in_range("max_attempts", v, &MAX_ATTEMPTS)
    }

    /// Checks `timeout_ms` ([`TIMEOUT_MS`]). A node also bounds it by its
    /// lane lease (not checked here: it depends on the node's settings).
    ///
    /// # Errors
    /// [`Rule::Range`].
    pub fn timeout_ms(v: u64) -> Result<(), Broken> {
        in_range("timeout_ms", v, &TIMEOUT_MS)
    }

    /// Checks `max_in_flight` ([`MAX_IN_FLIGHT`]).
    ///
    /// # Errors
    /// [`Rule::Range`].
    pub fn max_in_flight(v: u32) -> Result<(), Broken> {
        in_range("max_in_flight", v, &MAX_IN_FLIGHT)
    }

    /// Checks a rate limit: both numbers in [`RATE_LIMIT`].
    ///
    /// # Errors
    /// [`Rule::Range`] on `rate_limit.per_second` or `rate_limit.burst`.
    pub fn rate_limit(r: &RateLimit) -> Result<(), Broken> {
        in_range("rate_limit.per_second", r.per_second, &RATE_LIMIT)?;
        in_range("rate_limit.burst", r.burst, &RATE_LIMIT)
    }

    /// Checks a registration, field by field; an empty `secret` passes
    /// (one is generated, [`NewHandler::normalized`]).
    ///
    /// # Errors
    /// The first [`Broken`] rule, naming the field.
    pub fn check(h: &NewHandler) -> Result<(), Broken> {
        name(&h.name)?;
        url(&h.url)?;
        routes(&h.event_types)?;
        max_attempts(h.max_attempts)?;
        timeout_ms(h.timeout_ms)?;
        max_in_flight(h.max_in_flight)?;
        if !h.secret.is_empty() {
            secret::check(&h.secret)?;
        }
        if let Some(r) = &h.rate_limit {
            rate_limit(r)?;
        }
        if let Some(f) = &h.filter {
            filter::check(f)?;
        }
        Ok(())
    }

    /// Checks the fields a change sets, with the rules of [`check`]; fields
    /// it leaves alone are not judged again (a handler stored under older
    /// bounds stays changeable).
    ///
    /// # Errors
    /// The first [`Broken`] rule, naming the field.
    pub fn check_patch(p: &HandlerPatch) -> Result<(), Broken> {
        if let Some(v) = &p.name {
            name(v)?;
        }
        if let Some(v) = &p.url {
            url(v)?;
        }
        if let Some(v) = &p.event_types {
            routes(v)?;
        }
        if let Some(v) = p.max_attempts {
            max_attempts(v)?;
        }
        if let Some(v) = p.timeout_ms {
            timeout_ms(v)?;
        }
        if let Some(v) = p.max_in_flight {
            max_in_flight(v)?;
        }
        if let Some(Some(r)) = &p.rate_limit {
            rate_limit(r)?;
        }
        if let Some(Some(f)) = &p.filter {
            filter::check(f)?;
        }
        Ok(())
    }
}

impl NewEvent {
    /// Checks the event's rules ([`event::check`]) at the current time: for
    /// every way in (the API and `publish_in`).
    ///
    /// # Errors
    /// [`StoreError::Invalid`] naming the field and the rule it breaks.
    pub fn validate(&self) -> Result<()> {
        Ok(event::check(self, chrono::Utc::now())?)
    }
}

impl NewHandler {
    /// Checks a handler registration ([`handler::check`]).
    ///
    /// # Errors
    /// [`StoreError::Invalid`] naming the field and the rule it breaks.
    pub fn validate(&self) -> Result<()> {
        Ok(handler::check(self)?)
    }

    /// Validates and fills in a generated secret when none was given.
    ///
    /// # Errors
    /// As [`NewHandler::validate`].
    pub fn normalized(mut self) -> Result<Self> {
        self.validate()?;
        if self.secret.is_empty() {
            self.secret = crate::generate_secret();
        }
        Ok(self)
    }
}

impl Handler {
    /// Applies `patch` to a copy of this handler, checking the fields it
    /// sets ([`handler::check_patch`]).
    ///
    /// # Errors
    /// [`StoreError::Invalid`] naming the field and the rule it breaks.
    pub fn patched(&self, patch: &HandlerPatch) -> Result<Handler> {
        handler::check_patch(patch)?;
        let mut h = self.clone();
        if let Some(v) = &patch.name {
            h.name = v.clone();
        }
        if let Some(v) = &patch.url {
            h.url = v.clone();
        }
        if let Some(v) = &patch.event_types {
            h.event_types = v.clone();
        }
        if let Some(v) = patch.max_attempts {
            h.max_attempts = v;
        }
        if let Some(v) = patch.timeout_ms {
            h.timeout_ms = v;
        }
        if let Some(v) = patch.max_in_flight {
            h.max_in_flight = v;
        }
        if let Some(v) = patch.rate_limit {
            h.rate_limit = v;
        }
        if let Some(v) = &patch.filter {
            h.filter = v.clone();
        }
        Ok(h)
    }
}

impl RateLimit {
    /// Checks both numbers ([`handler::rate_limit`]).
    ///
    /// # Errors
    /// [`StoreError::Invalid`] naming the field.
    pub fn validate(&self) -> Result<()> {
        Ok(handler::rate_limit(self)?)
    }
}

/// Checks a signing secret ([`secret::check`]).
///
/// # Errors
/// [`StoreError::Invalid`], without repeating the secret.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mongodb"))]
pub(crate) fn validate_secret(s: &str) -> Result<()> {
    Ok(secret::check(s)?)
}

#[cfg(test)]
mod tests {
    #[test]
    fn event_type_schemas_declare_a_draft_we_apply_and_hold_no_nul() {
        use serde_json::json;
        let ok =
            json!({"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object"});
        assert!(event_type::schema(&ok).is_ok());
        for d in [
            "http://json-schema.org/draft-07/schema#",
            "http://json-schema.org/draft-04/schema",
        ] {
            let m = event_type::schema(&json!({"$schema": d, "required": ["a"]}))
                .unwrap_err()
                .message;
            assert!(m.contains("2020-12 or 2019-09"), "{m}");
        }
        assert!(event_type::schema(&json!({"const": "a\u{0}b"})).is_err());
        assert!(event_type::schema(&json!({"properties": {"a\u{0}": {}}})).is_err());
        assert!(event_type::description("a\u{0}b").is_err());
        assert!(event_type::description("fine").is_ok());
    }

    use super::*;

    fn ev(id: Option<&str>, key: Option<&str>) -> NewEvent {
        NewEvent {
            id: id.map(str::to_owned),
            event_type: "t.x".into(),
            key: key.map(str::to_owned),
            payload: b"{}".to_vec(),
            deliver_at: None,
            expected_seq: None,
        }
    }

    #[test]
    fn an_expected_seq_needs_a_key_and_is_not_negative() {
        let now = chrono::Utc::now();
        let mut e = ev(None, Some("k"));
        for n in [0, 1, i64::MAX] {
            e.expected_seq = Some(n);
            assert!(event::check(&e, now).is_ok(), "{n}");
        }
        e.expected_seq = Some(-1);
        let b = event::check(&e, now).unwrap_err();
        assert_eq!((b.field.as_str(), b.rule), ("expected_seq", Rule::Range));
        let mut e = ev(None, None);
        e.expected_seq = Some(0);
        let b = event::batch(&[ev(None, None), e.clone()], now).unwrap_err();
        assert_eq!(
            (b.field.as_str(), b.rule),
            ("events[1].expected_seq", Rule::Requires)
        );
        assert!(b.message.contains("needs a key"), "{b}");
        assert!(e.validate().is_err());
    }

    /// Every way in (the API and `publish_in`) refuses a payload nested
    /// deeper than serde_json's limit; brackets in strings are text.
    #[test]
    fn payload_nesting_is_bounded() {
        let nested = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n)).into_bytes();
        let mut e = ev(None, None);
        e.payload = nested(event::MAX_PAYLOAD_DEPTH);
        assert!(e.validate().is_ok());
        e.payload = nested(event::MAX_PAYLOAD_DEPTH + 1);
        let err = e.validate().expect_err("too deep");
        assert!(
            matches!(&err, StoreError::Invalid(m) if m.starts_with("payload nests 129")),
            "{err:?}"
        );
        e.payload = format!(r#"{{"s":"\"{}"}}"#, "[".repeat(500)).into_bytes();
        assert!(e.validate().is_ok(), "brackets inside a string");
    }

    /// Break-it (issue 15): delivery opens every string reading as an
    /// envelope, so a publisher may send none; escaped, as a key, or not
    /// base64 after the prefix, it is data.
    #[test]
    fn payload_strings_reading_as_envelopes_are_reserved() {
        let now = chrono::Utc::now();
        let mut e = ev(None, None);
        e.payload = br#"{"a":[1,{"b~":"lbenc:v1:YQ:AAAA"}]}"#.to_vec();
        let b = event::check(&e, now).unwrap_err();
        assert_eq!((b.field.as_str(), b.rule), ("payload", Rule::Reserved));
        assert!(b.message.contains(r#""/a/1/b~0""#), "{b}");
        for fine in [
            r#"{"a":"\u006cbenc:v1:YQ:AAAA"}"#,
            r#"{"lbenc:v1:YQ:AAAA":1}"#,
            r#"{"a":"lbenc:v1:not base64!"}"#,
            r#"{"a":" lbenc:v1:YQ:AAAA"}"#,
        ] {
            e.payload = fine.as_bytes().to_vec();
            assert!(event::check(&e, now).is_ok(), "{fine}");
        }
    }

    #[test]
    fn payload_size_is_bounded() {
        let mut e = ev(None, None);
        e.payload = vec![b'1'; event::MAX_PAYLOAD_BYTES];
        assert!(e.validate().is_ok());
        e.payload.push(b'1');
        let b = event::check(&e, chrono::Utc::now()).expect_err("too large");
        assert_eq!((b.field.as_str(), b.rule), ("payload", Rule::Size));
    }

    #[test]
    fn keys_with_control_characters_are_refused() {
        for key in ["line\nbreak", "nul\u{0}", "tab\tkey", "del\u{7f}"] {
            let err = ev(None, Some(key)).validate().unwrap_err();
            assert!(
                matches!(&err, StoreError::Invalid(m) if m.contains("control")),
                "{key:?}: {err}"
            );
        }
        assert!(ev(None, Some("octo/répo ✓ with spaces")).validate().is_ok());
    }

    #[test]
    fn event_ids_are_printable_ascii_up_to_128() {
        assert!(ev(Some("evt_42"), None).validate().is_ok());
        assert!(ev(Some(&"a".repeat(128)), None).validate().is_ok());
        for bad in ["", "has space", "é", &"a".repeat(129)] {
            assert!(ev(Some(bad), None).validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_batch_names_the_event_and_field() {
        let now = chrono::Utc::now();
        let b = event::batch(&[ev(None, None), ev(None, Some(""))], now).unwrap_err();
        assert_eq!((b.field.as_str(), b.rule), ("events[1].key", Rule::Length));
        assert!(b.message.starts_with("events[1]: event key"), "{b}");
        let many = vec![ev(None, None); event::MAX_BATCH + 1];
        let b = event::batch(&many, now).unwrap_err();
        assert_eq!((b.field.as_str(), b.rule), ("events", Rule::Length));
        assert!(event::batch(&many[1..], now).is_ok());
    }

    /// Only lanebus publishes `lanebus.` types: every other way in is
    /// refused, and its own path takes nothing else.
    #[test]
    fn the_lanebus_prefix_is_reserved() {
        let now = chrono::Utc::now();
        let mut e = ev(None, Some("k"));
        e.event_type = "lanebus.handler.disabled".into();
        let b = event::check(&e, now).unwrap_err();
        assert_eq!((b.field.as_str(), b.rule), ("type", Rule::Reserved));
        assert!(b.message.contains("reserved"), "{b}");
        assert!(e.validate().is_err());
        assert!(event::check_operational(&e, now).is_ok());
        let b = event::batch(&[ev(None, None), e.clone()], now).unwrap_err();
        assert_eq!(b.field, "events[1].type");
        assert!(event::operational_batch(&[e.clone()], now).is_ok());
        // Its other rules hold for lanebus too.
        e.key = Some(String::new());
        assert_eq!(event::check_operational(&e, now).unwrap_err().field, "key");
        // Near misses are ordinary types.
        for t in ["lanebus", "lanebusx.y", "my.lanebus.x", "Lanebus.x"] {
            let mut e = ev(None, None);
            e.event_type = t.into();
            assert!(e.validate().is_ok(), "{t}");
            let b = event::operational_batch(&[e], now).unwrap_err();
            assert_eq!(b.field, "events[0].type", "{t}");
        }
    }

    #[test]
    fn bad_patterns_are_refused() {
        for bad in ["a*b", "**", "", "has space", &"a".repeat(129)] {
            assert!(route::pattern(bad).is_err(), "{bad:?}");
        }
        assert!(route::pattern("*").is_ok());
        assert!(route::pattern("issues.*").is_ok());
        assert!(route::event_type("a*").is_err());
    }

    #[test]
    fn handler_ids_have_one_form() {
        assert!(handler::is_id(&crate::generate_handler_id()));
        for bad in ["", "hdl_", "hdl_0193A5B2C4D87E6F8A9B0C1D2E3F4A5B", "a\0b"] {
            assert!(!handler::is_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn urls_need_a_lowercase_http_prefix_a_host_and_no_credentials() {
        for (url, says) in [
            ("HTTPS://example.com/", "must start with"),
            ("http:example.com/", "must start with"),
            ("ftp://example.com/", "expected http, https, nats or kafka"),
            ("https://u:p@example.com/", "credentials"),
            ("https://example.com/a b", "whitespace"),
            ("not a url", "whitespace"),
            ("nourl", "does not parse"),
        ] {
            let b = handler::url(url).unwrap_err();
            assert_eq!(b.field, "url");
            assert!(b.message.contains(says), "{url}: {b}");
            assert!(!b.message.contains("u:p@"), "{b}");
        }
        assert!(handler::url("http://127.0.0.1:9000/x?q=a@b").is_ok());
        assert_eq!(handler::redacted("https://a:b@h/x@y"), "https://***@h/x@y");
    }

    #[test]
    fn nats_urls_name_a_server_and_a_subject_template() {
        let t = handler::nats("nats://broker.example:4223/orders.{type}.{key}").expect("ok");
        assert_eq!(t.server(), "broker.example:4223");
        assert_eq!(t.subject, "orders.{type}.{key}");
        assert_eq!(
            t.subject_for("order.paid", Some("o-7")).as_deref(),
            Ok("orders.order.paid.o-7")
        );
        for key in [
            None,
            Some("a.b"),
            Some("a b"),
            Some("a*"),
            Some(">"),
            Some(""),
        ] {
            assert!(t.subject_for("t", key).is_err(), "{key:?}");
        }
        let t = handler::nats("nats://[::1]/events").expect("ok");
        assert_eq!(
            (t.server(), t.subject_for("t", None)),
            ("[::1]:4222".into(), Ok("events".into()))
        );
        for (url, says) in [
            ("nats://u:p@h:4222/s", "credentials"),
            ("nats://h:4222/", "no subject"),
            ("nats://h:4222", "no subject"),
            ("nats://h/a..b", "tokens"),
            ("nats://h/a.*", "wildcards"),
            ("nats://h/a.>", "wildcards"),
            ("nats://h/a.{id}", "placeholders"),
            ("nats://h/s?tls=1", "query"),
            ("nats:///s", "no host"),
            ("NATS://h/s", "must start with nats://"),
            ("nats://h:0/s", "port 0"),
            ("nats://h/a/../b", "tokens"),
        ] {
            let b = handler::url(url).unwrap_err();
            assert_eq!(b.field, "url");
            assert!(b.message.contains(says), "{url}: {b}");
            assert!(!b.message.contains("u:p@"), "{b}");
        }
    }

    #[test]
    fn kafka_urls_name_a_bootstrap_server_and_a_topic() {
        let t = handler::kafka("kafka://broker.example:9093/orders.v1").expect("ok");
        assert_eq!(
            (t.server(), t.topic.as_str()),
            ("broker.example:9093".into(), "orders.v1")
        );
        let t = handler::kafka("kafka://[::1]/a_b-c").expect("ok");
        assert_eq!(
            (t.server(), t.topic.as_str()),
            ("[::1]:9092".into(), "a_b-c")
        );
        assert!(handler::url(&format!("kafka://h/{}", "t".repeat(249))).is_ok());
        for (url, says) in [
            ("kafka://u:p@h:9092/t", "credentials"),
            ("kafka://h:9092/", "no topic"),
            ("kafka://h:9092", "no topic"),
            ("kafka://h:0/t", "port 0"),
            ("kafka://h/a/../b", "has topic"),
            ("kafka://h/a/b", "has topic"),
            ("kafka://h/..", "has topic"),
            ("kafka://h/a%20b", "has topic"),
            ("kafka://h/orders.{type}", "has topic"),
            (&format!("kafka://h/{}", "t".repeat(250)), "has topic"),
            ("kafka://h/t?acks=1", "query"),
            ("kafka:///t", "no host"),
            ("KAFKA://h/t", "must start with kafka://"),
        ] {
            let b = handler::url(url).unwrap_err();
            assert_eq!(b.field, "url");
            assert!(b.message.contains(says), "{url}: {b}");
            assert!(!b.message.contains("u:p@"), "{b}");
        }
    }

    #[test]
    fn a_patch_is_judged_on_the_fields_it_sets() {
        let stored = Handler::registered(
            crate::generate_handler_id(),
            NewHandler {
                name: "old".into(),
                url: "http://h/".into(),
                event_types: vec!["*".into()],
                // Stored under the older, looser bounds.
                max_attempts: 500,
                timeout_ms: 1,
                max_in_flight: 1,
                secret: crate::generate_secret(),
                rate_limit: None,
                filter: None,
            },
            chrono::Utc::now(),
        );
        let renamed = stored
            .patched(&HandlerPatch {
                name: Some("new".into()),
                ..HandlerPatch::default()
            })
            .expect("a rename judges the name only");
        assert_eq!((renamed.name.as_str(), renamed.max_attempts), ("new", 500));
        let err = stored
            .patched(&HandlerPatch {
                max_attempts: Some(101),
                ..HandlerPatch::default()
            })
            .unwrap_err();
        assert!(
            matches!(&err, StoreError::Invalid(m) if m == "max_attempts 101 must be 1 to 100"),
            "{err}"
        );
    }

    #[test]
    fn secrets_need_prefix_base64_and_length() {
        use base64::Engine as _;
        let b64 = |n: usize| base64::engine::general_purpose::STANDARD.encode(vec![7u8; n]);
        assert!(secret::check(&format!("whsec_{}", b64(24))).is_ok());
        assert!(secret::check(&format!("whsec_{}", b64(64))).is_ok());
        for bad in [
            format!("whsec_{}", b64(23)),
            format!("whsec_{}", b64(65)),
            b64(32),
            "whsec_!!!".into(),
        ] {
            let b = secret::check(&bad).unwrap_err();
            assert_eq!(b.field, "secret");
            assert!(!b.message.contains(&bad), "{b}");
        }
    }

    #[test]
    fn filters_are_refused_naming_the_field_and_rule() {
        use serde_json::json;
        let cases = [
            (json!([1]), "filter", Rule::Form),
            (json!({"path": "/a"}), "filter", Rule::Form),
            (
                json!({"path": "/a", "equals": 1, "gt": 2}),
                "filter",
                Rule::Form,
            ),
            (json!({"path": "/a", "like": "x"}), "filter", Rule::Form),
            (json!({"path": "a", "equals": 1}), "filter.path", Rule::Form),
            (
                json!({"path": "/a~2", "equals": 1}),
                "filter.path",
                Rule::Form,
            ),
            (json!({"path": 1, "equals": 1}), "filter.path", Rule::Form),
            (
                json!({"and": [{"path": "/a", "gt": "1"}]}),
                "filter.and[0].gt",
                Rule::Form,
            ),
            (
                json!({"or": [{"path": "/a", "exists": 1}]}),
                "filter.or[0].exists",
                Rule::Form,
            ),
            (
                json!({"path": "/a", "equals": {"b": 1}}),
                "filter.equals",
                Rule::Form,
            ),
            (
                json!({"path": "/a", "in": [1, [2]]}),
                "filter.in[1]",
                Rule::Form,
            ),
            (json!({"path": "/a", "in": []}), "filter.in", Rule::Length),
            (
                json!({"path": "/a", "in": vec![1; filter::MAX_IN_VALUES + 1]}),
                "filter.in",
                Rule::Length,
            ),
            (json!({"and": []}), "filter.and", Rule::Length),
            (
                json!({"not": {"not": {"not": {"not": {"not": {"not": {"not": {"not": {"not":
                {"path": "", "exists": true}}}}}}}}}}),
                "filter.not.not.not.not.not.not.not.not.not",
                Rule::Depth,
            ),
            (
                json!({"path": "/a\u{0}", "exists": true}),
                "filter.path",
                Rule::Form,
            ),
            (
                json!({"path": "/a", "equals": "x\u{0}"}),
                "filter.equals",
                Rule::Form,
            ),
            (
                json!({"path": "/a", "in": ["x", "\u{ffff}"]}),
                "filter.in[1]",
                Rule::Form,
            ),
            (
                json!({"path": format!("/{}", "a".repeat(filter::MAX_PATH_BYTES)), "exists": true}),
                "filter.path",
                Rule::Length,
            ),
        ];
        for (v, field, rule) in cases {
            let b = filter::parse(&v).expect_err(&v.to_string());
            assert_eq!((b.field.as_str(), b.rule), (field, rule), "{v}: {b}");
            assert!(b.message.starts_with(field), "{b}");
        }
        let many: Vec<_> = (0..=filter::MAX_CONDITIONS)
            .map(|i| json!({"path": format!("/{i}"), "exists": true}))
            .collect();
        let b = filter::parse(&json!({"or": many})).unwrap_err();
        assert_eq!((b.field.as_str(), b.rule), ("filter", Rule::Length));
        let big = json!({"path": "/a", "in": vec!["x".repeat(100); filter::MAX_IN_VALUES]});
        let b = filter::parse(&big).unwrap_err();
        assert_eq!((b.field.as_str(), b.rule), ("filter", Rule::Size));
        // Within the bounds: accepted, and checked again by the handler rules.
        let ok = json!({"and": [{"path": "/order/total", "gte": 100},
                                {"path": "/country", "in": ["DE", "FR"]}]});
        // 8 levels of and/or/not around a condition are within the bound.
        let deep = json!({"and": [{"not": {"not": {"not": {"not": {"not": {"not": {"not":
                   {"path": "", "exists": true}}}}}}}}]});
        assert_eq!(filter::parse(&deep).unwrap().to_json(), deep);
        let f = filter::parse(&ok).unwrap();
        let mut h = NewHandler {
            name: "n".into(),
            url: "https://example.com/".into(),
            event_types: vec!["*".into()],
            max_attempts: 1,
            timeout_ms: 1000,
            max_in_flight: 1,
            secret: String::new(),
            rate_limit: None,
            filter: Some(f),
        };
        assert!(handler::check(&h).is_ok());
        h.filter = Some(crate::Filter::And(vec![]));
        assert_eq!(handler::check(&h).unwrap_err().field, "filter.and");
    }
}
