//! The event-type catalog: types with a description, an optional JSON
//! Schema (draft 2020-12) for their payload, a wire name and aliases, and
//! the store-wide setting that refuses types not in the catalog.
//!
//! # Wire names and aliases
//!
//! A type's [`name`](EventType::name) is its wire name: the `type` stored
//! with its events and sent to receivers. Its [`aliases`](EventType::aliases)
//! are other names publishers may still send (old names after a rename): a
//! publish rewrites an alias to the wire name before it stores the event,
//! and a route naming an alias (or a pattern matching one) still matches
//! the type's events. A name is one type's wire name or alias, never two.
//!
//! # Where validation happens
//!
//! Every store keeps the catalog in memory ([`Cache`], compiled validators)
//! with the catalog's version, a number raised by every catalog change in
//! the same transaction. A publish checks its batch against the cached
//! catalog before it queues ([`Cache::check`]); the write then reads the
//! stored version inside its own transaction (or statement), and when the
//! cache was stale it reloads the catalog there and checks the batch again
//! before anything is written. So a type created on another node is
//! honoured by the very next publish. An event of a type without a schema
//! costs one hash lookup; a batch when the catalog is empty and not strict,
//! nothing.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::common::PublishPlan;
use crate::rules::{self, Broken};
use crate::{Result, StoreError};

/// A cataloged event type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventType {
    /// The wire name: the `type` its events are stored and sent under (an
    /// event type, [`rules::event_type::name`]).
    pub name: String,
    /// What the type means, for people (may be empty).
    pub description: String,
    /// JSON Schema (draft 2020-12) every payload of the type must satisfy;
    /// `None`: any payload.
    pub schema: Option<Value>,
    /// Other names publishers may send for this type (old names), rewritten
    /// to [`name`](Self::name) at publish.
    pub aliases: Vec<String>,
    /// Deprecated: still accepted, shown as deprecated.
    pub deprecated: bool,
    /// When the type was created.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
}

impl EventType {
    /// The wire name, then the aliases.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.name.as_str()).chain(self.aliases.iter().map(String::as_str))
    }
}

/// A type to create ([`crate::Store::create_event_type`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NewEventType {
    /// The wire name.
    pub name: String,
    /// Description (may be empty).
    pub description: String,
    /// Payload schema, if any.
    pub schema: Option<Value>,
    /// Aliases.
    pub aliases: Vec<String>,
}

/// A change to a type ([`crate::Store::update_event_type`]); `None` fields
/// stay as they are.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EventTypePatch {
    /// A new wire name (a rename): the old wire name becomes an alias, so
    /// publishers still sending it and routes naming it keep working. The
    /// new name may be one of the type's aliases (it stops being one).
    pub name: Option<String>,
    /// A new description.
    pub description: Option<String>,
    /// `Some(None)` removes the schema, `Some(Some(s))` sets it.
    pub schema: Option<Option<Value>>,
    /// The aliases, replaced as a whole (a rename adds the old name after).
    pub aliases: Option<Vec<String>>,
    /// Deprecate (`true`) or undeprecate (`false`).
    pub deprecated: Option<bool>,
}

/// The store-wide catalog setting ([`crate::Store::catalog_settings`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CatalogSettings {
    /// Refuse publishes of types that are neither a wire name nor an alias
    /// in the catalog (lanebus's own `lanebus.` types exempt). Off by
    /// default.
    pub strict: bool,
}

/// The catalog as stored: its version, the setting, every type.
#[derive(Debug, Clone, Default)]
pub(crate) struct Stored {
    pub version: i64,
    pub settings: CatalogSettings,
    pub types: Vec<EventType>,
}

impl Stored {
    /// The type whose wire name or alias is `name`.
    pub fn find(&self, name: &str) -> Option<&EventType> {
        self.types.iter().find(|t| t.names().any(|n| n == name))
    }

    /// The type `new` creates at `now`, checked against its rules and the
    /// names already taken.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for a broken rule; [`StoreError::Conflict`]
    /// for a name already taken.
    pub fn create(&self, new: NewEventType, now: DateTime<Utc>) -> Result<EventType> {
        rules::event_type::check(&new)?;
        let t = EventType {
            name: new.name,
            description: new.description,
            schema: new.schema,
            aliases: new.aliases,
            deprecated: false,
            created_at: now,
            updated_at: now,
        };
        self.check_free(&t, None)?;
        Ok(t)
    }

    /// The type named `name` (wire name or alias) with `patch` applied at
    /// `now`, and its wire name before.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown name; otherwise as
    /// [`create`](Self::create).
    pub fn update(
        &self,
        name: &str,
        patch: &EventTypePatch,
        now: DateTime<Utc>,
    ) -> Result<(String, EventType)> {
        rules::event_type::check_patch(patch)?;
        let old = self.find(name).ok_or_else(|| not_found(name))?;
        let mut t = old.clone();
        if let Some(d) = &patch.description {
            t.description.clone_from(d);
        }
        if let Some(s) = &patch.schema {
            t.schema.clone_from(s);
        }
        if let Some(a) = &patch.aliases {
            t.aliases.clone_from(a);
        }
        if let Some(d) = patch.deprecated {
            t.deprecated = d;
        }
        if let Some(new_name) = patch.name.as_ref().filter(|n| **n != old.name) {
            t.aliases.retain(|a| a != new_name);
            if !t.aliases.contains(&old.name) {
                t.aliases.push(old.name.clone());
            }
            t.name.clone_from(new_name);
        }
        rules::event_type::aliases(&t.name, &t.aliases)?;
        t.updated_at = now;
        self.check_free(&t, Some(&old.name))?;
        Ok((old.name.clone(), t))
    }

    /// Checks that no other type than the one stored as `own` holds a name
    /// of `t`.
    fn check_free(&self, t: &EventType, own: Option<&str>) -> Result<()> {
        for other in self.types.iter().filter(|o| Some(o.name.as_str()) != own) {
            if let Some(n) = t.names().find(|n| other.names().any(|m| m == *n)) {
                return Err(StoreError::Conflict(format!(
                    "event type name {n:?} is already taken by event type {:?}",
                    other.name
                )));
            }
        }
        Ok(())
    }
}

/// The error for an unknown type name.
pub(crate) fn not_found(name: &str) -> StoreError {
    StoreError::NotFound(format!("event type {name:?}"))
}

/// One name's entry in a [`Snapshot`].
struct Entry {
    wire: Arc<str>,
    /// The type's aliases (route matching), `None` when it has none.
    aliases: Option<Arc<[String]>>,
    validator: Option<Arc<jsonschema::Validator>>,
    /// The type's personal fields, `None` when it has none.
    personal: Option<Arc<crate::personal::Spec>>,
}

/// The catalog compiled for publishes: every wire name and alias mapped to
/// its type's wire name, aliases and validator.
pub(crate) struct Snapshot {
    /// The stored catalog version it was built from (-1: none yet, so the
    /// first write reloads).
    pub version: i64,
    strict: bool,
    by_name: HashMap<String, Entry>,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot")
            .field("version", &self.version)
            .field("strict", &self.strict)
            .field("names", &self.by_name.len())
            .finish()
    }
}

impl Snapshot {
    fn empty() -> Self {
        Snapshot {
            version: -1,
            strict: false,
            by_name: HashMap::new(),
        }
    }

    /// Compiles a stored catalog.
    ///
    /// # Errors
    /// [`StoreError::Database`] for a stored schema that does not compile
    /// (the store holds only schemas that did).
    pub fn build(stored: &Stored) -> Result<Self> {
        let mut by_name = HashMap::new();
        for t in &stored.types {
            let validator = match &t.schema {
                Some(s) => Some(Arc::new(jsonschema::draft202012::new(s).map_err(|e| {
                    StoreError::Database(format!(
                        "stored schema of event type {:?} does not compile: {e}",
                        t.name
                    ))
                })?)),
                None => None,
            };
            let personal = match &t.schema {
                Some(s) => crate::personal::Spec::derive(s)
                    .map_err(|b| {
                        StoreError::Database(format!(
                            "stored schema of event type {:?}: {}",
                            t.name, b.message
                        ))
                    })?
                    .map(Arc::new),
                None => None,
            };
            let wire: Arc<str> = Arc::from(t.name.as_str());
            let aliases: Option<Arc<[String]>> =
                (!t.aliases.is_empty()).then(|| Arc::from(t.aliases.clone()));
            for n in t.names() {
                by_name.insert(
                    n.to_owned(),
                    Entry {
                        wire: Arc::clone(&wire),
                        aliases: aliases.clone(),
                        validator: validator.clone(),
                        personal: personal.clone(),
                    },
                );
            }
        }
        Ok(Snapshot {
            version: stored.version,
            strict: stored.settings.strict,
            by_name,
        })
    }

    /// Checks `plan` against this catalog and marks it with its version:
    /// rewrites aliases to wire names, validates payloads of types with a
    /// schema, and, when strict, refuses types not in the catalog. Reserved
    /// (`lanebus.`) types are left alone. Checks the names as published,
    /// so a plan may be checked again against a newer catalog.
    ///
    /// This is the check of a write: an event of a type with personal
    /// fields must have been encrypted by the spec it has now
    /// ([`crate::personal::seal_plan`]).
    ///
    /// # Errors
    /// [`StoreError::Invalid`] naming the first failing event (`events[i]`),
    /// for a payload: the JSON pointer in it and the schema keyword that
    /// failed; for a type with personal fields in a plan never sealed
    /// (`publish_in`). [`StoreError::Conflict`] when the type's personal
    /// fields changed since the plan was sealed (retry). Nothing of the
    /// plan is written.
    pub fn apply(&self, plan: &mut PublishPlan) -> Result<()> {
        self.apply_as(plan, true)
    }

    /// [`apply`](Self::apply), before sealing when `sealed` is false.
    fn apply_as(&self, plan: &mut PublishPlan, sealed: bool) -> Result<()> {
        plan.catalog_version = Some(self.version);
        if self.by_name.is_empty()
            && !self.strict
            && plan.fresh.iter().all(|e| e.sent_type.is_none())
        {
            return Ok(());
        }
        for e in &mut plan.fresh {
            let sent = e.sent_type.as_deref().unwrap_or(&e.event_type);
            if rules::event::is_reserved(sent) {
                continue;
            }
            let Some(entry) = self.by_name.get(sent) else {
                if self.strict {
                    return Err(rules::event_type::not_cataloged(sent)
                        .within(&format!("events[{}]", e.index))
                        .into());
                }
                if let Some(sent) = e.sent_type.take() {
                    e.event_type = sent;
                }
                e.aliases = None;
                e.personal = None;
                continue;
            };
            if let Some(v) = &entry.validator {
                check_payload(v, &e.payload, &entry.wire)
                    .map_err(|b| StoreError::from(b.within(&format!("events[{}]", e.index))))?;
            }
            if *entry.wire != *sent {
                let sent = std::mem::replace(&mut e.event_type, entry.wire.to_string());
                e.sent_type.get_or_insert(sent);
            } else if e.sent_type.is_some() {
                e.event_type = entry.wire.to_string();
            }
            e.aliases.clone_from(&entry.aliases);
            e.personal.clone_from(&entry.personal);
            if sealed {
                check_sealed(e, plan.sealed, &entry.wire)?;
            }
        }
        Ok(())
    }
}

/// Checks that `e` was encrypted by its type's personal spec as it is now.
fn check_sealed(e: &crate::common::PlannedEvent, plan_sealed: bool, wire: &str) -> Result<()> {
    let Some(spec) = &e.personal else {
        return Ok(());
    };
    match &e.sealed {
        Some((by, _)) if **by == **spec => Ok(()),
        _ if !plan_sealed => Err(StoreError::Invalid(format!(
            "events[{}]: event type {wire:?} has personal fields, which only a publish \
             through the store's publish encrypts (not publish_in inside a caller's \
             transaction, nor the SQL function)",
            e.index
        ))),
        _ => Err(StoreError::Conflict(format!(
            "events[{}]: the {} {wire:?} changed during the publish; retry",
            e.index,
            crate::personal::PERSONAL_CHANGED
        ))),
    }
}

/// Validates one payload (well-formed JSON, checked by the event rules).
fn check_payload(v: &jsonschema::Validator, payload: &[u8], wire: &str) -> Result<(), Broken> {
    let value: Value = serde_json::from_slice(payload).map_err(|e| {
        rules::event_type::payload_fails(wire, "", "type", &format!("not JSON: {e}"))
    })?;
    let first = v.iter_errors(&value).next();
    match first {
        None => Ok(()),
        Some(err) => {
            let keyword = err
                .schema_path()
                .as_str()
                .rsplit('/')
                .next()
                .unwrap_or_default()
                .to_owned();
            Err(rules::event_type::payload_fails(
                wire,
                err.instance_path().as_str(),
                &keyword,
                &err.masked().to_string(),
            ))
        }
    }
}

/// A store's cached catalog, shared by its clones.
#[derive(Debug)]
pub(crate) struct Cache {
    current: RwLock<Arc<Snapshot>>,
}

impl Default for Cache {
    fn default() -> Self {
        Cache {
            current: RwLock::new(Arc::new(Snapshot::empty())),
        }
    }
}

impl Cache {
    /// The cached catalog.
    pub fn get(&self) -> Arc<Snapshot> {
        Arc::clone(
            &self
                .current
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Replaces the cached catalog with `stored`, compiled, unless the
    /// cache already holds a newer one; returns the one now cached.
    ///
    /// # Errors
    /// As [`Snapshot::build`].
    pub fn replace(&self, stored: &Stored) -> Result<Arc<Snapshot>> {
        let fresh = Arc::new(Snapshot::build(stored)?);
        let mut cur = self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if cur.version <= fresh.version {
            *cur = Arc::clone(&fresh);
        }
        Ok(fresh)
    }

    /// Checks `plan` against the cached catalog ([`Snapshot::apply`]),
    /// and when that refuses it, against the stored catalog `load` reads
    /// (the cache may be older than a change that allows the batch): a
    /// refusal is always by a catalog read after the publish began. The
    /// write checks the version again ([`PublishPlan::catalog_version`]).
    ///
    /// # Errors
    /// As [`Snapshot::apply`], and `load`'s.
    pub async fn check<F>(&self, plan: &mut PublishPlan, load: F) -> Result<()>
    where
        F: std::future::Future<Output = Result<Stored>>,
    {
        if self.get().apply_as(plan, false).is_ok() {
            return Ok(());
        }
        self.replace(&load.await?)?.apply_as(plan, false)
    }
}

/// A change to the catalog, planned by [`Change::plan`] against the stored
/// catalog inside the backend's write transaction (which holds the
/// catalog's version row, so changes are serialized).
#[derive(Debug, Clone)]
pub(crate) enum Change {
    Create(NewEventType),
    Update(String, EventTypePatch),
    Settings(CatalogSettings),
}

/// What a [`Change`] writes.
#[derive(Debug, Clone)]
pub(crate) enum Write {
    /// Store `t`, replacing the type whose wire name was `old` (`None`: a
    /// new type).
    Put { old: Option<String>, t: EventType },
    /// Store the setting.
    Settings(CatalogSettings),
}

impl Write {
    /// The type a [`Write::Put`] stored.
    ///
    /// # Errors
    /// [`StoreError::Database`] for a [`Write::Settings`] (a backend bug).
    pub fn into_type(self) -> Result<EventType> {
        match self {
            Write::Put { t, .. } => Ok(t),
            Write::Settings(_) => Err(StoreError::Database(
                "a catalog change wrote a setting, not a type".into(),
            )),
        }
    }
}

impl Change {
    /// The write this change makes to `stored` at `now`.
    ///
    /// # Errors
    /// As [`Stored::create`] and [`Stored::update`].
    pub fn plan(self, stored: &Stored, now: DateTime<Utc>) -> Result<Write> {
        Ok(match self {
            Change::Create(new) => Write::Put {
                old: None,
                t: stored.create(new, now)?,
            },
            Change::Update(name, patch) => {
                let (old, t) = stored.update(&name, &patch, now)?;
                Write::Put { old: Some(old), t }
            }
            Change::Settings(s) => Write::Settings(s),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NewEvent;

    fn stored(version: i64, types: &[(&str, &[&str], Option<Value>)]) -> Stored {
        let now = Utc::now();
        Stored {
            version,
            settings: CatalogSettings::default(),
            types: types
                .iter()
                .map(|(name, aliases, schema)| EventType {
                    name: (*name).into(),
                    description: String::new(),
                    schema: schema.clone(),
                    aliases: aliases.iter().map(|a| (*a).into()).collect(),
                    deprecated: false,
                    created_at: now,
                    updated_at: now,
                })
                .collect(),
        }
    }

    fn plan(types: &[&str]) -> PublishPlan {
        let events = types
            .iter()
            .map(|t| NewEvent {
                event_type: (*t).into(),
                payload: br#"{"n":1}"#.to_vec(),
                ..NewEvent::default()
            })
            .collect();
        PublishPlan::new(events, 16).expect("valid")
    }

    #[test]
    fn a_plan_checked_again_follows_the_newer_catalog() {
        let old = Snapshot::build(&stored(1, &[("b.new", &["a.old"], None)])).expect("build");
        let mut p = plan(&["a.old", "b.new", "c.other"]);
        old.apply(&mut p).expect("apply");
        let types: Vec<&str> = p.fresh.iter().map(|e| e.event_type.as_str()).collect();
        assert_eq!(types, ["b.new", "b.new", "c.other"]);
        assert_eq!(p.fresh[0].sent_type.as_deref(), Some("a.old"));
        assert!(p.fresh[1].aliases.is_some() && p.fresh[2].aliases.is_none());
        assert_eq!(p.catalog_version, Some(1));

        // The alias moved to another type: the names as published decide.
        let newer = stored(2, &[("b.new", &[], None), ("d.next", &["a.old"], None)]);
        Snapshot::build(&newer)
            .expect("build")
            .apply(&mut p)
            .expect("apply");
        let types: Vec<&str> = p.fresh.iter().map(|e| e.event_type.as_str()).collect();
        assert_eq!(types, ["d.next", "b.new", "c.other"]);
        assert!(p.fresh[1].aliases.is_none());

        // The alias dropped: the event keeps the name it was published with.
        let newest = stored(
            3,
            &[("d.next", &[], Some(serde_json::json!({"type": "object"})))],
        );
        Snapshot::build(&newest)
            .expect("build")
            .apply(&mut p)
            .expect("apply");
        let types: Vec<&str> = p.fresh.iter().map(|e| e.event_type.as_str()).collect();
        assert_eq!(types, ["a.old", "b.new", "c.other"]);
        assert_eq!(p.catalog_version, Some(3));
    }

    #[test]
    fn a_cache_keeps_the_newest_catalog() {
        let cache = Cache::default();
        assert_eq!(cache.get().version, -1);
        cache.replace(&stored(5, &[])).expect("replace");
        cache
            .replace(&stored(4, &[("x.y", &[], None)]))
            .expect("older");
        assert_eq!(cache.get().version, 5);
    }
}
