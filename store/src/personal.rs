//! Personal fields, encrypted per subject (crypto-shredding).
//!
//! # Marks
//!
//! A cataloged type's schema marks personal fields with
//! `"x-lanebus-personal": true` on a property (any depth, through
//! `properties`) and names the subject with the root keyword
//! `"x-lanebus-subject": "/json/pointer"` (RFC 6901, to a string or a
//! number in the payload). [`Spec::derive`] reads them when the catalog
//! compiles a type; marks without a subject are refused.
//!
//! # Keys
//!
//! Every subject has a data key (32 random bytes), created on first use
//! and stored wrapped ([`WrappedKey`]: AES-256-GCM under the master key,
//! with the master key's id). The master key ([`MasterKey`]) is given to
//! the store's [`Keyring`] by the node (a file or an environment
//! variable), never stored. Unwrapped keys are cached ([`CACHE_KEYS`]
//! entries), but every use reads the subject's stored row first and uses
//! the cached key only when it is the very row still stored: a key
//! deleted on one node is unusable on every node from the moment the
//! delete answered.
//!
//! # Envelope
//!
//! At publish each personal field's JSON value is replaced in place by
//! the string `lbenc:v1:<base64url(subject)>:<base64(nonce || ciphertext
//! || tag)>` (standard base64 with padding for the second part; base64url
//! without padding for the subject): AES-256-GCM of the value's JSON text
//! as published under the subject's data key, a random 96-bit nonce, and
//! additional data `lanebus:v1:<event id>\0<subject>\0<pointer>` binding
//! it to its event, subject and place. Only the value's bytes change
//! (`json_span.rs` finds them): delivery ([`open`]) splices the
//! decrypted text back, so a receiver gets the published bytes exactly.
//! The envelope names its subject, so delivery needs no
//! catalog: a payload that holds no envelope costs one byte search.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine as _;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};
use serde_json::Value;

use crate::json_span::escape;
use crate::rules::{self, Broken};
use crate::{Result, Store, StoreError};

/// The schema keyword marking a property personal.
pub const PERSONAL_KEYWORD: &str = "x-lanebus-personal";
/// The root schema keyword holding the subject's JSON pointer.
pub const SUBJECT_KEYWORD: &str = "x-lanebus-subject";
/// The prefix of an encrypted field's string.
pub const ENVELOPE_PREFIX: &str = "lbenc:v1:";
/// Most unwrapped data keys a [`Keyring`] keeps in memory.
pub const CACHE_KEYS: usize = 10_000;
/// Longest subject id, in bytes.
pub const MAX_SUBJECT_BYTES: usize = 256;

/// Where a type's payload holds its subject and its personal fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    /// JSON pointer to the subject id (a string or a number).
    pub subject: String,
    /// JSON pointers to the personal fields, sorted.
    pub fields: Vec<String>,
}

impl Spec {
    /// The spec a schema's marks give, `None` when it marks no field.
    ///
    /// # Errors
    /// [`Broken`] on `schema` ([`rules::Rule::Schema`]): marks without a
    /// subject pointer, a subject keyword that is not a JSON pointer, a
    /// subject inside a personal field, or a mark that is not `true`.
    pub fn derive(schema: &Value) -> std::result::Result<Option<Spec>, Broken> {
        let mut fields = Vec::new();
        let mut read = Vec::new();
        collect(schema, "", "", &mut fields, &mut read)?;
        let mut all = Vec::new();
        all_marks(schema, "", &mut all);
        if let Some(at) = all.iter().find(|m| !read.contains(m)) {
            return Err(rules::event_type::personal_marks(&format!(
                "the mark at {at} is not honoured: {PERSONAL_KEYWORD} counts only on a \
                 property reached from the root through `properties` alone (not under \
                 items, $ref, $defs, allOf/anyOf/oneOf, additionalProperties or \
                 patternProperties)"
            )));
        }
        fields.sort();
        let subject = match schema.get(SUBJECT_KEYWORD) {
            None => None,
            Some(Value::String(p)) if p.starts_with('/') => Some(p.clone()),
            Some(other) => {
                return Err(rules::event_type::personal_marks(&format!(
                    "{SUBJECT_KEYWORD} must be a JSON pointer starting with '/', not {other}"
                )))
            }
        };
        match (subject, fields.is_empty()) {
            (_, true) => Ok(None),
            (None, false) => Err(rules::event_type::personal_marks(&format!(
                "the schema marks personal fields ({}) but names no subject: add the root \
                 keyword {SUBJECT_KEYWORD} with the JSON pointer to the subject id",
                fields.join(", ")
            ))),
            (Some(subject), false) => {
                if let Some(f) = fields
                    .iter()
                    .find(|f| subject == **f || subject.starts_with(&format!("{f}/")))
                {
                    return Err(rules::event_type::personal_marks(&format!(
                        "the subject {subject} is inside the personal field {f}"
                    )));
                }
                Ok(Some(Spec { subject, fields }))
            }
        }
    }
}

/// Collects the personal properties under `schema` (at payload pointer
/// `at`, schema pointer `sat`), and the schema pointers of the marks it
/// read into `read`.
fn collect(
    schema: &Value,
    at: &str,
    sat: &str,
    out: &mut Vec<String>,
    read: &mut Vec<String>,
) -> std::result::Result<(), Broken> {
    let Some(props) = schema.get("properties").and_then(Value::as_object) else {
        return Ok(());
    };
    for (name, sub) in props {
        let token = escape(name);
        let here = format!("{at}/{token}");
        let shere = format!("{sat}/properties/{token}");
        match sub.get(PERSONAL_KEYWORD) {
            Some(Value::Bool(true)) => {
                // Marks inside a personal field change nothing: it is
                // sealed whole.
                all_marks(sub, &shere, read);
                out.push(here);
            }
            None => collect(sub, &here, &shere, out, read)?,
            Some(Value::Bool(false)) => {
                read.push(format!("{shere}/{PERSONAL_KEYWORD}"));
                collect(sub, &here, &shere, out, read)?;
            }
            Some(other) => {
                return Err(rules::event_type::personal_marks(&format!(
                    "{PERSONAL_KEYWORD} at {here} must be true or false, not {other}"
                )))
            }
        }
    }
    Ok(())
}

/// The schema pointers of every mark in `v` (at schema pointer `at`).
fn all_marks(v: &Value, at: &str, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let here = format!("{at}/{}", escape(k));
                if k == PERSONAL_KEYWORD {
                    out.push(here.clone());
                }
                all_marks(x, &here, out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                all_marks(x, &format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// The master key: wraps and unwraps data keys.
pub struct MasterKey {
    key: LessSafeKey,
    id: String,
}

impl std::fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MasterKey").field("id", &self.id).finish()
    }
}

impl PartialEq for MasterKey {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl MasterKey {
    /// A master key from its text: 32 bytes as 64 hex digits or as base64
    /// (standard alphabet, padded), surrounding whitespace ignored.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for anything else (the key is never repeated).
    pub fn parse(text: &str) -> Result<Self> {
        let t = text.trim();
        let bytes = if t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()) {
            (0..32)
                .map(|i| u8::from_str_radix(&t[2 * i..2 * i + 2], 16))
                .collect::<std::result::Result<Vec<u8>, _>>()
                .map_err(|_| bad_master())?
        } else {
            STANDARD.decode(t).map_err(|_| bad_master())?
        };
        Self::from_bytes(&bytes)
    }

    /// A master key from its 32 bytes.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for another length.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != 32 {
            return Err(bad_master());
        }
        let digest = ring::digest::digest(
            &ring::digest::SHA256,
            &[b"lanebus master key id\0".as_slice(), bytes].concat(),
        );
        let id = digest.as_ref()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(MasterKey {
            key: aes_key(bytes)?,
            id,
        })
    }

    /// The key's id (16 hex digits of a SHA-256 of it), stored with every
    /// key it wraps.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// `data` wrapped for `subject`.
    fn wrap(&self, subject: &str, data: &[u8; 32]) -> Result<WrappedKey> {
        Ok(WrappedKey {
            subject: subject.to_owned(),
            key_id: self.id.clone(),
            wrapped: seal(&self.key, &wrap_aad(subject), data)?,
        })
    }

    /// The data key of `w`.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] when `w` was wrapped by another master key
    /// or does not open.
    pub fn unwrap_key(&self, w: &WrappedKey) -> Result<LessSafeKey> {
        if w.key_id != self.id {
            return Err(StoreError::Invalid(format!(
                "the data key of subject {:?} is wrapped by master key {}, not by the \
                 configured one ({})",
                w.subject, w.key_id, self.id
            )));
        }
        let plain = open_sealed(&self.key, &wrap_aad(&w.subject), &w.wrapped).ok_or_else(|| {
            StoreError::Invalid(format!(
                "the data key of subject {:?} does not open under master key {}",
                w.subject, self.id
            ))
        })?;
        aes_key(&plain)
    }

    /// `w` wrapped by `self` instead of `old` (rotation).
    ///
    /// # Errors
    /// As [`unwrap_key`](Self::unwrap_key) on `old`.
    pub fn rewrap(&self, old: &MasterKey, w: &WrappedKey) -> Result<WrappedKey> {
        if w.key_id != old.id {
            return Err(old.unwrap_key(w).err().unwrap_or_else(bad_master));
        }
        let plain = open_sealed(&old.key, &wrap_aad(&w.subject), &w.wrapped).ok_or_else(|| {
            StoreError::Invalid(format!("subject {:?}: key does not open", w.subject))
        })?;
        let data: [u8; 32] = plain.try_into().map_err(|_| bad_master())?;
        self.wrap(&w.subject, &data)
    }
}

fn bad_master() -> StoreError {
    StoreError::Invalid("a master key must be 32 bytes, as 64 hex digits or base64".into())
}

fn wrap_aad(subject: &str) -> Vec<u8> {
    format!("lanebus:subject-key:v1:{subject}").into_bytes()
}

/// What a field's seal authenticates besides its value: the event, the
/// subject and the field, so an envelope copied into another event or
/// field does not open (it is sent as `null`).
fn field_aad(event_id: &str, subject: &str, pointer: &str) -> Vec<u8> {
    format!("lanebus:v1:{event_id}\0{subject}\0{pointer}").into_bytes()
}

fn aes_key(bytes: &[u8]) -> Result<LessSafeKey> {
    UnboundKey::new(&AES_256_GCM, bytes)
        .map(LessSafeKey::new)
        .map_err(|_| bad_master())
}

/// `nonce || ciphertext || tag` of `plain` under `key`, a random nonce.
fn seal(key: &LessSafeKey, aad: &[u8], plain: &[u8]) -> Result<Vec<u8>> {
    let mut nonce = [0u8; NONCE_LEN];
    SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| StoreError::Database("the system random source failed".into()))?;
    let mut out = plain.to_vec();
    key.seal_in_place_append_tag(
        Nonce::assume_unique_for_key(nonce),
        Aad::from(aad),
        &mut out,
    )
    .map_err(|_| StoreError::Database("AES-GCM sealing failed".into()))?;
    let mut sealed = nonce.to_vec();
    sealed.extend_from_slice(&out);
    Ok(sealed)
}

/// The plaintext of [`seal`]'s output, `None` when it does not open.
fn open_sealed(key: &LessSafeKey, aad: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
    if sealed.len() < NONCE_LEN {
        return None;
    }
    let (nonce, ct) = sealed.split_at(NONCE_LEN);
    let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
    let mut buf = ct.to_vec();
    let plain = key.open_in_place(nonce, Aad::from(aad), &mut buf).ok()?;
    Some(plain.to_vec())
}

/// A subject's data key as stored: wrapped by the master key `key_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrappedKey {
    /// The subject id.
    pub subject: String,
    /// Id of the master key that wrapped it ([`MasterKey::id`]).
    pub key_id: String,
    /// `nonce || ciphertext || tag` (12 + 32 + 16 bytes).
    pub wrapped: Vec<u8>,
}

/// The node's master key and its cache of unwrapped data keys (each
/// keyed by the wrapped bytes it came from, so a key deleted or rewrapped
/// in the store is never used from the cache).
#[derive(Debug, Default)]
pub struct Keyring {
    master: RwLock<Option<Arc<MasterKey>>>,
    cache: Mutex<Bounded>,
    /// Reads of this store's key rows, coalesced.
    reads: KeyReads,
}

#[derive(Default)]
struct Bounded {
    keys: BTreeMap<String, (Vec<u8>, Arc<LessSafeKey>)>,
    order: VecDeque<String>,
}

impl std::fmt::Debug for Bounded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bounded")
            .field("keys", &self.keys.len())
            .finish()
    }
}

impl Keyring {
    /// Sets the master key (the node does at start).
    pub fn set_master(&self, key: impl Into<Arc<MasterKey>>) {
        *self
            .master
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(key.into());
        self.cache().keys.clear();
    }

    /// The master key, if one is set.
    pub fn master(&self) -> Option<Arc<MasterKey>> {
        self.master
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Drops `subject`'s cached key.
    pub fn forget(&self, subject: &str) {
        self.cache().keys.remove(subject);
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Bounded> {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The data key of the stored row `w`, from the cache when it holds
    /// that very row.
    fn key(&self, master: &MasterKey, w: &WrappedKey) -> Result<Arc<LessSafeKey>> {
        if let Some((wrapped, k)) = self.cache().keys.get(&w.subject) {
            if *wrapped == w.wrapped {
                return Ok(Arc::clone(k));
            }
        }
        let k = Arc::new(master.unwrap_key(w)?);
        let mut c = self.cache();
        if c.keys
            .insert(w.subject.clone(), (w.wrapped.clone(), Arc::clone(&k)))
            .is_none()
        {
            c.order.push_back(w.subject.clone());
        }
        while c.keys.len() > CACHE_KEYS || c.order.len() > 2 * CACHE_KEYS {
            match c.order.pop_front() {
                Some(old) if old != w.subject => {
                    c.keys.remove(&old);
                }
                Some(_) => {}
                None => break,
            }
        }
        Ok(k)
    }
}

/// The subject id in the raw JSON text `raw` of the value at `pointer`.
fn subject_of(raw: Option<&[u8]>, pointer: &str) -> std::result::Result<String, Broken> {
    let s = match raw.and_then(|r| serde_json::from_slice::<Value>(r).ok()) {
        Some(Value::String(s)) => s,
        // An integer beyond 64 bits is read as a double: distinct ids
        // would share one subject (and one key).
        Some(Value::Number(n))
            if n.is_f64()
                && n.as_f64().is_some_and(|f| f.abs() >= 9e18)
                && !raw.unwrap_or_default().iter().any(|b| b".eE".contains(b)) =>
        {
            return Err(rules::event_type::subject_too_large(pointer));
        }
        Some(Value::Number(n)) => n.to_string(),
        _ => {
            return Err(rules::event_type::no_subject(pointer));
        }
    };
    rules::event_type::subject(&s)?;
    if s == "." || s == ".." {
        // Checked at publish only: DELETE /v1/subjects/{id} still takes a
        // key stored before, for a client that can send the segment.
        return Err(rules::event_type::subject_dot_segment(pointer));
    }
    Ok(s)
}

/// One event's payload read for sealing: its subject and the byte spans
/// of its personal values.
struct ToSeal {
    /// Index of the event in the plan.
    at: usize,
    subject: String,
    /// Each personal value's pointer and bytes, in payload order.
    fields: Vec<(String, std::ops::Range<usize>)>,
}

/// What a JSON value read from a payload is, for messages.
fn json_kind(value: &[u8]) -> &'static str {
    match value.first() {
        Some(b'[') => "an array",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        Some(b'{') => "an object",
        Some(b'n') => "null",
        _ => "a number",
    }
}

/// Reads the subject and the personal values' spans of `payload` (one
/// pass of the parser, no document built).
fn read_for_seal(
    payload: &[u8],
    spec: &Spec,
) -> Result<(String, Vec<(String, std::ops::Range<usize>)>)> {
    let mut pointers: Vec<&str> = vec![spec.subject.as_str()];
    pointers.extend(spec.fields.iter().map(String::as_str));
    let fields_end = pointers.len();
    // Every proper parent of a field (the root aside).
    let mut parents: Vec<&str> = spec
        .fields
        .iter()
        .flat_map(|f| f.match_indices('/').skip(1).map(move |(at, _)| &f[..at]))
        .collect();
    parents.sort_unstable();
    parents.dedup();
    pointers.extend(parents);
    let spans = crate::json_span::find(payload, &pointers)
        .map_err(|err| StoreError::Invalid(format!("payload is not JSON: {err}")))?;
    // A parent that is there but not an object (an array of objects with
    // the field's name, a string) holds values the mark's path does not
    // reach: they would be stored in clear.
    if let Some(s) = spans.iter().find(|s| {
        s.which >= fields_end
            && !matches!(payload[s.range.clone()].first(), Some(b'{') | Some(b'n'))
    }) {
        return Err(StoreError::Invalid(format!(
            "{} holds personal fields, so it must be an object (or null or absent), \
             not {}",
            pointers[s.which],
            json_kind(&payload[s.range.clone()])
        )));
    }
    // A field given twice would be sealed twice: a payload repeating one
    // would store an envelope (and cost a seal, and an open per attempt)
    // per repetition.
    let mut times = vec![0usize; pointers.len()];
    for s in &spans {
        times[s.which] += 1;
    }
    if let Some(i) = (1..fields_end).find(|&i| times[i] > 1) {
        return Err(StoreError::Invalid(format!(
            "the personal field {} is given more than once ({} times: a key repeated \
             in its object or in a parent's); give it once",
            pointers[i], times[i]
        )));
    }
    // The last of duplicate keys, as the schema validator saw it.
    let subject = spans
        .iter()
        .rev()
        .find(|s| s.which == 0)
        .map(|s| &payload[s.range.clone()]);
    let subject = subject_of(subject, &spec.subject)?;
    let fields = spans
        .into_iter()
        .filter(|s| s.which > 0 && s.which < fields_end)
        .map(|s| (pointers[s.which].to_owned(), s.range))
        .collect();
    Ok((subject, fields))
}

/// Encrypts the personal fields of every event in `plan` whose type has
/// some (set by the catalog check), creating missing data keys. Each
/// personal value's JSON text, as published, is replaced in place by its
/// envelope: every other byte of the payload is kept.
///
/// # Errors
/// [`StoreError::Invalid`] for a payload without its subject;
/// [`StoreError::Unavailable`] when events have personal fields and the
/// store has no master key, or one that does not open a stored data key;
/// the store's errors.
pub(crate) async fn seal_plan<S: Store + Clone + 'static>(
    store: &S,
    plan: &mut crate::common::PublishPlan,
) -> Result<()> {
    plan.sealed = true;
    let mut read = Vec::new();
    for (at, e) in plan.fresh.iter_mut().enumerate() {
        e.sealed = None;
        if let Some(spec) = &e.personal {
            let (subject, fields) = read_for_seal(&e.payload, spec).map_err(|err| match err {
                StoreError::Invalid(m) => StoreError::Invalid(format!("events[{}]: {m}", e.index)),
                other => other,
            })?;
            read.push(ToSeal {
                at,
                subject,
                fields,
            });
        }
    }
    if read.is_empty() {
        return Ok(());
    }
    let master = store.keyring().master().ok_or_else(no_master)?;
    let mut subjects: Vec<String> = read.iter().map(|p| p.subject.clone()).collect();
    subjects.sort();
    subjects.dedup();
    let keys = keys_for(store, &master, &subjects).await?;
    for r in read {
        let e = &mut plan.fresh[r.at];
        let spec = Arc::clone(e.personal.as_ref().ok_or_else(no_master)?);
        let key = &keys[&r.subject];
        let mut edits = Vec::with_capacity(r.fields.len());
        for (pointer, range) in r.fields {
            let sealed = seal(
                key,
                &field_aad(&e.id, &r.subject, &pointer),
                &e.payload[range.clone()],
            )?;
            let envelope = format!(
                "\"{ENVELOPE_PREFIX}{}:{}\"",
                URL_SAFE_NO_PAD.encode(&r.subject),
                STANDARD.encode(sealed)
            );
            edits.push((range, envelope));
        }
        let bytes = crate::json_span::splice(&e.payload, &edits);
        e.sealed = Some((spec, bytes));
    }
    Ok(())
}

/// A publish through [`crate::Store::publish`]: checks `plan` against the
/// catalog ([`crate::event_types::Cache::check`], `load` reading the
/// stored one), seals its personal fields and writes it in `group`. A
/// write refused because the stored catalog gave a type other
/// personal-field marks than the cached one (the write reloaded the cache)
/// is checked, sealed and written once more (the group hands the plan
/// back with such an error).
///
/// # Errors
/// As the check, [`seal_plan`] and the write.
pub(crate) async fn publish<S, F, Fut>(
    store: &S,
    group: &Arc<crate::group::Grouper>,
    catalog: &crate::event_types::Cache,
    load: F,
    mut plan: crate::common::PublishPlan,
) -> Result<crate::PublishOutcome>
where
    S: Store + crate::group::GroupWriter,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<crate::event_types::Stored>>,
{
    catalog.check(&mut plan, load()).await?;
    seal_plan(store, &mut plan).await?;
    match group.publish_or_back(store, plan).await {
        Ok(out) => Ok(out),
        Err((StoreError::Conflict(m), Some(plan))) if m.contains(PERSONAL_CHANGED) => {
            let mut plan = *plan;
            catalog.check(&mut plan, load()).await?;
            seal_plan(store, &mut plan).await?;
            group.publish(store, plan).await
        }
        Err((e, _)) => Err(e),
    }
}

/// Part of the message of the conflict [`publish`] retries.
pub(crate) const PERSONAL_CHANGED: &str = "personal fields of event type";

fn no_master() -> StoreError {
    StoreError::Unavailable(
        "events of this type have personal fields and this node has no master key \
         (--master-key-file or LANEBUS_MASTER_KEY)"
            .into(),
    )
}

/// Every subject's data key, created (insert-if-absent, then read back
/// the winner) when missing.
async fn keys_for<S: Store + Clone + 'static>(
    store: &S,
    master: &MasterKey,
    subjects: &[String],
) -> Result<HashMap<String, Arc<LessSafeKey>>> {
    let shared: Arc<dyn Store> = Arc::new(store.clone());
    let mut rows = store
        .keyring()
        .reads
        .read(shared, subjects.to_vec())
        .await?;
    let missing: Vec<&String> = subjects
        .iter()
        .filter(|s| !rows.iter().any(|r| r.subject == **s))
        .collect();
    if !missing.is_empty() {
        let rng = SystemRandom::new();
        let mut fresh = Vec::with_capacity(missing.len());
        for s in &missing {
            let mut data = [0u8; 32];
            rng.fill(&mut data)
                .map_err(|_| StoreError::Database("the system random source failed".into()))?;
            fresh.push(master.wrap(s, &data)?);
        }
        store.insert_subject_keys(&fresh).await?;
        let again: Vec<String> = missing.into_iter().cloned().collect();
        rows.extend(store.subject_keys(&again).await?);
    }
    let ring = store.keyring();
    let mut out = HashMap::with_capacity(rows.len());
    for r in &rows {
        // A key this node's master does not open: its configuration is
        // at fault (a master key rotated without it), not the publisher.
        let key = ring
            .key(master, r)
            .map_err(|e| StoreError::Unavailable(e.to_string()))?;
        out.insert(r.subject.clone(), key);
    }
    for s in subjects {
        if !out.contains_key(s) {
            return Err(StoreError::Conflict(format!(
                "the data key of subject {s:?} was deleted while it was being created; retry"
            )));
        }
    }
    Ok(out)
}

/// A payload made ready for sending by [`open`].
#[derive(Debug, Clone, PartialEq)]
pub struct Opened {
    /// The payload with every envelope decrypted (or `null`).
    pub payload: bytes::Bytes,
    /// Pointers of the fields sent as `null` because their subject's key
    /// is gone (header `lanebus-redacted`), in payload order.
    pub redacted: Vec<String>,
    /// How many fields were decrypted (the payload holds personal values
    /// in clear when not 0: what a receiver answers may quote them).
    pub decrypted: usize,
}

/// The payload of event `event_id` with its encrypted fields decrypted:
/// each envelope's bytes are replaced by the JSON text it sealed (the
/// value's text as published), every other byte is kept. A field whose
/// subject's data key is gone, or whose envelope does not open for this
/// event and field (one copied from elsewhere), becomes `null` and is
/// listed in [`Opened::redacted`]. A string that only starts like an
/// envelope (its subject or sealed part is not base64) is left as it is.
/// `None` for a payload holding no envelope (one substring search, SIMD).
///
/// # Errors
/// [`StoreError::Unavailable`] when the payload holds envelopes and the
/// node has no master key, or a stored data key it needs does not open
/// under the node's master key (a wrong or stale key: the attempt fails
/// and is retried, nothing is sent as erased); the store's errors reading
/// keys. Never for a deleted key.
pub async fn open<S: Store + ?Sized>(
    store: &S,
    event_id: &str,
    payload: &[u8],
) -> Result<Option<Opened>> {
    open_with(store.keyring(), event_id, payload, |subjects| async move {
        store.subject_keys(&subjects).await
    })
    .await
}

/// [`open`], its key rows read through the store's [`KeyReads`] (one
/// statement for the deliveries opened at about the same time).
///
/// # Errors
/// As [`open`].
pub async fn open_via(
    store: &Arc<dyn Store>,
    event_id: &str,
    payload: &[u8],
) -> Result<Option<Opened>> {
    let ring = store.keyring();
    open_with(ring, event_id, payload, |subjects| {
        ring.reads.read(Arc::clone(store), subjects)
    })
    .await
}

/// [`open`], reading the rows of the subjects it needs with `read`.
async fn open_with<F, Fut>(
    ring: &Keyring,
    event_id: &str,
    payload: &[u8],
    read: F,
) -> Result<Option<Opened>>
where
    F: FnOnce(Vec<String>) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<WrappedKey>>>,
{
    let found = envelopes(payload);
    if found.is_empty() {
        return Ok(None);
    }
    let master = ring.master().ok_or_else(no_master)?;
    let mut subjects: Vec<String> = found.iter().map(|f| f.2.clone()).collect();
    subjects.sort();
    subjects.dedup();
    let rows = read(subjects).await?;
    let mut keys = HashMap::new();
    for r in &rows {
        let k = ring
            .key(&master, r)
            .map_err(|e| StoreError::Unavailable(format!("personal fields: {e}")))?;
        keys.insert(r.subject.clone(), k);
    }
    let mut redacted = Vec::new();
    let mut edits = Vec::with_capacity(found.len());
    let decrypted = found.len();
    for (pointer, range, subject, sealed) in found {
        let plain = keys
            .get(&subject)
            .and_then(|key| open_sealed(key, &field_aad(event_id, &subject, &pointer), &sealed))
            // Authenticated, so ours; still, never splice in what is not
            // one JSON value.
            .filter(|bytes| serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_ok());
        let value = plain.unwrap_or_else(|| {
            redacted.push(pointer);
            b"null".to_vec()
        });
        edits.push((range, value));
    }
    Ok(Some(Opened {
        payload: crate::json_span::splice(payload, &edits).into(),
        decrypted: decrypted - redacted.len(),
        redacted,
    }))
}

/// Most subjects one coalesced read of [`KeyReads`] asks for; requests
/// beyond it wait for the next read.
pub const KEY_READ_SUBJECTS: usize = 1000;

/// Reads of subject key rows, coalesced: the requests that arrive while a
/// read is under way go together in the next one, so many publishes or
/// deliveries at once read their subjects' keys in a few statements
/// instead of one each. Each request is answered by a read that started
/// after it was made, so a key whose deletion answered before a request
/// is never used for it (the guarantee of [`open`]). Each store's
/// [`Keyring`] has one; every request names the store it reads (a clone
/// of the keyring's store), so the reader task holds no store between
/// reads. The task starts on the current tokio runtime at the first read
/// (again if that runtime stopped) and ends with the keyring.
///
/// Source of the method: the same group-commit pattern as publishes
/// (`group.rs`, seed 003), applied to reads.
#[derive(Default)]
pub struct KeyReads {
    queue: Mutex<Option<tokio::sync::mpsc::UnboundedSender<KeyRead>>>,
}

impl std::fmt::Debug for KeyReads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyReads").finish_non_exhaustive()
    }
}

/// One request to [`KeyReads`]: its store, subjects and where the rows go.
struct KeyRead {
    store: Arc<dyn Store>,
    subjects: Vec<String>,
    reply: tokio::sync::oneshot::Sender<Result<Vec<WrappedKey>>>,
}

impl KeyReads {
    /// The stored rows of `subjects` (those that exist) in `store`, whose
    /// keyring holds this value.
    ///
    /// # Errors
    /// The store's errors, for every request of the read that failed.
    pub async fn read(
        &self,
        store: Arc<dyn Store>,
        subjects: Vec<String>,
    ) -> Result<Vec<WrappedKey>> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let mut request = Some(KeyRead {
            store: Arc::clone(&store),
            subjects: subjects.clone(),
            reply,
        });
        {
            let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            // The task ends with the runtime that ran it: start another.
            if queue.as_ref().is_none_or(|q| q.is_closed()) {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                tokio::spawn(read_keys(rx));
                *queue = Some(tx);
            }
            if let Some(q) = queue.as_ref() {
                request = q
                    .send(request.take().expect("one request"))
                    .err()
                    .map(|e| e.0);
            }
        }
        match request {
            None => match answer.await {
                Ok(rows) => rows,
                // The task stopped mid-read: read alone.
                Err(_) => store.subject_keys(&subjects).await,
            },
            Some(_) => store.subject_keys(&subjects).await,
        }
    }
}

/// The reader task of [`KeyReads`]: takes every request waiting (up to
/// [`KEY_READ_SUBJECTS`] subjects), reads their rows in one call, answers
/// each with its own.
async fn read_keys(mut rx: tokio::sync::mpsc::UnboundedReceiver<KeyRead>) {
    let mut next: Option<KeyRead> = None;
    loop {
        let first = match next.take() {
            Some(r) => r,
            None => match rx.recv().await {
                Some(r) => r,
                None => return,
            },
        };
        let mut n = first.subjects.len();
        let mut reqs = vec![first];
        // Polled once each, not `try_recv`, which can park the thread
        // (see `wake::WakeReceiver`).
        while n < KEY_READ_SUBJECTS {
            match futures::FutureExt::now_or_never(rx.recv()).flatten() {
                Some(r) if n + r.subjects.len() > KEY_READ_SUBJECTS => {
                    next = Some(r);
                    break;
                }
                Some(r) => {
                    n += r.subjects.len();
                    reqs.push(r);
                }
                None => break,
            }
        }
        let mut all: Vec<String> = reqs
            .iter()
            .flat_map(|r| r.subjects.iter().cloned())
            .collect();
        all.sort();
        all.dedup();
        let rows = reqs[0].store.subject_keys(&all).await;
        for r in reqs {
            let own = rows.as_ref().map_err(Clone::clone).map(|rows| {
                rows.iter()
                    .filter(|w| r.subjects.contains(&w.subject))
                    .cloned()
                    .collect()
            });
            let _ = r.reply.send(own);
        }
    }
}

/// One envelope found: its pointer, bytes (quotes included), subject and
/// sealed bytes.
type Found = (String, std::ops::Range<usize>, String, Vec<u8>);

/// Every string of `payload` that delivery ([`open`]) reads as an
/// envelope, in document order; none for a payload that is not JSON (one
/// substring search when it holds no envelope prefix).
fn envelopes(payload: &[u8]) -> Vec<Found> {
    let needle = format!("\"{ENVELOPE_PREFIX}");
    if memchr::memmem::find(payload, needle.as_bytes()).is_none() {
        return Vec::new();
    }
    let Ok(strings) = crate::json_span::strings_with_prefix(payload, ENVELOPE_PREFIX) else {
        return Vec::new();
    };
    strings
        .into_iter()
        .filter_map(|(pointer, range)| {
            // Between the quotes.
            let text = std::str::from_utf8(&payload[range.start + 1..range.end - 1]).ok()?;
            let (subject, sealed) = envelope(text)?;
            Some((pointer, range, subject, sealed))
        })
        .collect()
}

/// The JSON pointer of the first string of a payload to publish that
/// delivery would read as an envelope (and decrypt, or send as `null`):
/// only lanebus writes those ([`crate::rules::event::no_envelope`] refuses
/// them). `None` when there is none.
pub(crate) fn envelope_lookalike(payload: &[u8]) -> Option<String> {
    envelopes(payload).into_iter().next().map(|f| f.0)
}

/// The subject and sealed bytes of an envelope's text, `None` when it is
/// malformed.
fn envelope(text: &str) -> Option<(String, Vec<u8>)> {
    let (subject, sealed) = text.strip_prefix(ENVELOPE_PREFIX)?.split_once(':')?;
    let subject = String::from_utf8(URL_SAFE_NO_PAD.decode(subject).ok()?).ok()?;
    Some((subject, STANDARD.decode(sealed).ok()?))
}

/// Destroys `subject`'s data key: deletes its row, then drops it from this
/// node's cache. Returns whether there was one. Other nodes read the row
/// before every use, so none uses the key once this returned.
///
/// # Errors
/// [`StoreError::Invalid`] for a malformed subject id; the store's errors.
pub async fn forget_subject<S: Store + ?Sized>(store: &S, subject: &str) -> Result<bool> {
    rules::event_type::subject(subject).map_err(StoreError::from)?;
    let gone = store.delete_subject_key(subject).await?;
    store.keyring().forget(subject);
    Ok(gone)
}

/// Rewraps every stored data key wrapped by `old` with `new` (events are
/// not touched: their fields are sealed under the data keys). A key
/// already wrapped by `new` is left alone; one changed or deleted
/// meanwhile is skipped. Returns how many were rewrapped.
///
/// # Errors
/// [`StoreError::Invalid`] for a key wrapped by neither master key or that
/// does not open (nothing after it is rewrapped); the store's errors.
pub async fn rotate<S: Store + ?Sized>(
    store: &S,
    old: &MasterKey,
    new: &MasterKey,
) -> Result<usize> {
    let mut n = 0;
    for w in store.all_subject_keys().await? {
        if w.key_id == new.id {
            continue;
        }
        let fresh = new.rewrap(old, &w)?;
        if store.replace_subject_key(&w, &fresh).await? {
            n += 1;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A personal field's parent that is present but not an object (an
    /// array holding objects with the field's name, a string) would leave
    /// the value in clear where the mark's path does not reach: refused.
    #[test]
    fn personal_fields_parents_must_be_objects() {
        let spec = Spec {
            subject: "/u".into(),
            fields: vec!["/user/email".into()],
        };
        for bad in [
            r#"{"u":"a","user":[{"email":"alice@example.org"}]}"#,
            r#"{"u":"a","user":"alice@example.org"}"#,
            r#"{"u":"a","user":7}"#,
        ] {
            let err = read_for_seal(bad.as_bytes(), &spec).unwrap_err();
            assert!(
                matches!(&err, StoreError::Invalid(m) if m.contains("/user")),
                "{bad}: {err}"
            );
        }
        for (good, n) in [
            (r#"{"u":"a","user":{"email":"alice@example.org"}}"#, 1),
            (r#"{"u":"a","user": null}"#, 0),
            (r#"{"u":"a","user":{}}"#, 0),
            (r#"{"u":"a"}"#, 0),
        ] {
            let (_, fields) = read_for_seal(good.as_bytes(), &spec).unwrap();
            assert_eq!(fields.len(), n, "{good}");
        }
    }

    /// Concurrent coalesced reads each get their own subjects' rows, and a
    /// read asked after a subject was forgotten never returns its key.
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn coalesced_key_reads_answer_each_and_see_deletions() {
        let store: Arc<dyn Store> = Arc::new(
            crate::sqlite::SqliteStore::connect("sqlite::memory:")
                .await
                .unwrap(),
        );
        let master = MasterKey::from_bytes(&[3; 32]).unwrap();
        let subjects: Vec<String> = (0..300).map(|i| format!("s{i}")).collect();
        let keys: Vec<WrappedKey> = subjects
            .iter()
            .map(|s| master.wrap(s, &[1; 32]).unwrap())
            .collect();
        store.insert_subject_keys(&keys).await.unwrap();
        let read = |subjects: Vec<String>| {
            let store = Arc::clone(&store);
            async move {
                store
                    .keyring()
                    .reads
                    .read(Arc::clone(&store), subjects)
                    .await
            }
        };
        let asks = (0..300).map(|i| {
            let own = vec![format!("s{i}"), format!("absent{i}")];
            let ask = read(own);
            tokio::spawn(async move { (i, ask.await.unwrap()) })
        });
        for a in futures::future::join_all(asks).await {
            let (i, rows) = a.unwrap();
            assert_eq!(rows.len(), 1, "request {i}");
            assert_eq!(rows[0].subject, format!("s{i}"));
        }
        assert!(forget_subject(&*store, "s7").await.unwrap());
        assert!(read(vec!["s7".into()]).await.unwrap().is_empty());
        assert_eq!(read(vec!["s8".into()]).await.unwrap().len(), 1);
    }

    #[test]
    fn derive_finds_nested_marks_and_needs_a_subject() {
        let s = json!({
            "x-lanebus-subject": "/user/id",
            "properties": {
                "user": {"properties": {
                    "id": {"type": "string"},
                    "e/mail": {"type": "string", "x-lanebus-personal": true}
                }},
                "note": {"x-lanebus-personal": true, "properties": {"x": {"x-lanebus-personal": true}}}
            }
        });
        let spec = Spec::derive(&s).unwrap().unwrap();
        assert_eq!(spec.subject, "/user/id");
        assert_eq!(spec.fields, vec!["/note", "/user/e~1mail"]);
        let no_subject = json!({"properties": {"a": {"x-lanebus-personal": true}}});
        assert!(Spec::derive(&no_subject)
            .unwrap_err()
            .message
            .contains("names no subject"));
        let inside = json!({"x-lanebus-subject": "/a/id",
            "properties": {"a": {"x-lanebus-personal": true}}});
        assert!(Spec::derive(&inside).is_err());
        assert_eq!(Spec::derive(&json!({"type": "object"})).unwrap(), None);
    }

    #[test]
    fn marks_lanebus_would_not_seal_are_refused() {
        let subject = json!({"type": "string"});
        for (schema, at) in [
            (
                json!({"properties": {"tags": {"items": {"properties": {"phone": {"x-lanebus-personal": true}}}}}}),
                "/properties/tags/items/properties/phone/x-lanebus-personal",
            ),
            (
                json!({"$defs": {"p": {"properties": {"iban": {"x-lanebus-personal": true}}}},
                       "properties": {"ref": {"$ref": "#/$defs/p"}}}),
                "/$defs/p/properties/iban/x-lanebus-personal",
            ),
            (
                json!({"properties": {"all": {"allOf": [{"properties": {"ssn": {"x-lanebus-personal": true}}}]}}}),
                "/properties/all/allOf/0/properties/ssn/x-lanebus-personal",
            ),
            (
                json!({"additionalProperties": {"x-lanebus-personal": true}}),
                "/additionalProperties/x-lanebus-personal",
            ),
        ] {
            let mut schema = schema;
            schema["x-lanebus-subject"] = json!("/user");
            schema["properties"]["user"] = subject.clone();
            let m = Spec::derive(&schema).unwrap_err().message;
            assert!(m.contains(at) && m.contains("not honoured"), "{m}");
        }
    }

    /// Break-it (issue 15): an integer subject too large for 64 bits was
    /// read as a double, so distinct ids (2^64 and 2^64 + 1) were one
    /// subject, one key: erasing either erased both, and neither alone.
    #[test]
    fn distinct_integer_subjects_are_distinct_subjects_or_refused() {
        let subject = |raw: &str| subject_of(Some(raw.as_bytes()), "/id");
        assert_eq!(
            subject("18446744073709551615").unwrap(),
            "18446744073709551615"
        );
        assert_eq!(
            subject("-9223372036854775808").unwrap(),
            "-9223372036854775808"
        );
        assert_eq!(subject("1e2").unwrap(), "100.0");
        assert_eq!(subject("100").unwrap(), "100");
        assert_eq!(subject("-0").unwrap(), "-0.0");
        assert_eq!(
            subject("\"18446744073709551616\"").unwrap(),
            "18446744073709551616"
        );
        for big in [
            "18446744073709551616",
            "18446744073709551617",
            "-9223372036854775809",
        ] {
            let b = subject(big).expect_err(big);
            assert!(b.message.contains("as a string"), "{big}: {}", b.message);
        }
    }

    /// Break-it (issue 15): a subject id `.` or `..` cannot be named in
    /// `DELETE /v1/subjects/{id}` by many HTTP clients: WHATWG URL parsers
    /// (browsers, the url crate under reqwest) resolve the dot segment,
    /// `%2E%2E` too, and send another path, so its fields could not be
    /// erased with them. Refused at publish.
    #[test]
    fn dot_segment_subjects_are_refused() {
        for dots in ["\".\"", "\"..\"", "\"\\u002e\\u002e\""] {
            let b = subject_of(Some(dots.as_bytes()), "/id").expect_err(dots);
            assert!(b.message.contains("dot segment"), "{dots}: {}", b.message);
        }
        for fine in ["\"...\"", "\"a.b\"", "\"./a\""] {
            assert!(subject_of(Some(fine.as_bytes()), "/id").is_ok(), "{fine}");
        }
    }

    #[test]
    fn master_key_parses_hex_and_base64_and_rewraps() {
        let hex = "00".repeat(31) + "01";
        let a = MasterKey::parse(&hex).unwrap();
        let b = MasterKey::parse(&STANDARD.encode([7u8; 32])).unwrap();
        assert!(MasterKey::parse("short").is_err());
        assert_ne!(a.id(), b.id());
        let w = a.wrap("s1", &[9u8; 32]).unwrap();
        assert!(b.unwrap_key(&w).is_err());
        let w2 = b.rewrap(&a, &w).unwrap();
        assert_eq!(w2.key_id, b.id());
        let k = b.unwrap_key(&w2).unwrap();
        let sealed = seal(&k, b"x", b"hello").unwrap();
        let k_old = a.unwrap_key(&w).unwrap();
        assert_eq!(open_sealed(&k_old, b"x", &sealed).unwrap(), b"hello");
        assert!(open_sealed(&k_old, b"y", &sealed).is_none());
    }
}
