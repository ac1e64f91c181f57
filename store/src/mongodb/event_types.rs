//! The event-type catalog ([`crate::event_types`]): one `event_types`
//! document per type (`_id` the wire name, `names` its wire name and
//! aliases under a unique index, the schema as JSON text, since a schema's
//! `$`-keys are no BSON field names), and the `meta` document `catalog`
//! (version, strict setting). A publish reads the version in its
//! transaction ([`checked`]); a catalog change raises it in its own, so two
//! changes write-conflict and are serialized.

use ::mongodb::bson::{doc, Bson, Document};
use ::mongodb::ClientSession;
use chrono::Utc;
use futures::TryStreamExt;

use super::{get_int, get_string, names, MongoStore, TxnResult, FULL_BATCH};
use crate::common::{from_micros, to_micros, PublishPlan};
use crate::event_types::{CatalogSettings, Change, EventType, Stored, Write};
use crate::StoreError;

/// `_id` of the catalog's document in `meta`.
pub(super) const CATALOG_DOC: &str = "catalog";

/// The catalog's version and setting in the transaction's snapshot
/// (version 0, not strict, before the first change).
async fn state(s: &MongoStore, session: &mut ClientSession) -> TxnResult<(i64, bool)> {
    let d = s
        .coll(names::META)
        .find_one(doc! { "_id": CATALOG_DOC })
        .session(&mut *session)
        .await?;
    Ok(match d {
        Some(d) => (
            get_int(&d, "version")?,
            d.get_bool("strict").unwrap_or(false),
        ),
        None => (0, false),
    })
}

/// The stored catalog in the transaction's snapshot.
pub(super) async fn load(s: &MongoStore, session: &mut ClientSession) -> TxnResult<Stored> {
    let (version, strict) = state(s, session).await?;
    load_types(s, session, version, strict).await
}

/// The stored types, with the catalog `version` and `strict` setting read
/// before in the same transaction.
async fn load_types(
    s: &MongoStore,
    session: &mut ClientSession,
    version: i64,
    strict: bool,
) -> TxnResult<Stored> {
    let docs: Vec<Document> = s
        .coll(names::EVENT_TYPES)
        .find(doc! {})
        .sort(doc! { "_id": 1 })
        .batch_size(FULL_BATCH)
        .session(&mut *session)
        .await?
        .stream(&mut *session)
        .try_collect()
        .await?;
    let types = docs
        .iter()
        .map(from_doc)
        .collect::<crate::Result<Vec<_>>>()?;
    Ok(Stored {
        version,
        settings: CatalogSettings { strict },
        types,
    })
}

fn from_doc(d: &Document) -> crate::Result<EventType> {
    let bad = |e: String| StoreError::Database(format!("event_types document: {e}"));
    let schema = match d.get("schema") {
        None | Some(Bson::Null) => None,
        Some(Bson::String(s)) => Some(serde_json::from_str(s).map_err(|e| bad(e.to_string()))?),
        Some(other) => return Err(bad(format!("schema is not JSON text: {other:?}"))),
    };
    let aliases = d
        .get_array("aliases")
        .map_err(|e| bad(e.to_string()))?
        .iter()
        .map(|b| {
            b.as_str()
                .map(str::to_owned)
                .ok_or_else(|| bad("alias not a string".into()))
        })
        .collect::<crate::Result<_>>()?;
    Ok(EventType {
        name: get_string(d, "_id")?,
        description: get_string(d, "description")?,
        schema,
        aliases,
        deprecated: d.get_bool("deprecated").map_err(|e| bad(e.to_string()))?,
        created_at: from_micros(get_int(d, "created_at")?),
        updated_at: from_micros(get_int(d, "updated_at")?),
    })
}

/// Plans and writes `change` in the transaction on `session`, raising the
/// catalog version first (concurrent changes write-conflict and retry).
pub(super) async fn change_in(
    s: &MongoStore,
    session: &mut ClientSession,
    change: Change,
) -> TxnResult<Write> {
    let meta = s.coll(names::META);
    meta.update_one(
        doc! { "_id": CATALOG_DOC },
        doc! { "$inc": { "version": 1i64 }, "$setOnInsert": { "strict": false } },
    )
    .upsert(true)
    .session(&mut *session)
    .await?;
    let stored = load(s, session).await?;
    let write = change.plan(&stored, from_micros(to_micros(Utc::now())))?;
    match &write {
        Write::Put { old, t } => {
            let coll = s.coll(names::EVENT_TYPES);
            if let Some(old) = old {
                coll.delete_one(doc! { "_id": old })
                    .session(&mut *session)
                    .await?;
            }
            let names: Vec<&str> = t.names().collect();
            coll.insert_one(doc! {
                "_id": &t.name,
                "names": names,
                "description": &t.description,
                "schema": t.schema.as_ref().map_or(Bson::Null, |v| Bson::String(v.to_string())),
                "aliases": &t.aliases,
                "deprecated": t.deprecated,
                "created_at": to_micros(t.created_at),
                "updated_at": to_micros(t.updated_at),
            })
            .session(&mut *session)
            .await?;
        }
        Write::Settings(set) => {
            meta.update_one(
                doc! { "_id": CATALOG_DOC },
                doc! { "$set": { "strict": set.strict } },
            )
            .session(&mut *session)
            .await?;
        }
    }
    Ok(write)
}

/// Checks `plan` against the stored catalog in the publish's transaction:
/// unchanged when it was checked against the stored version, else checked
/// again (the cache reloaded first when it is stale).
pub(super) async fn checked(
    s: &MongoStore,
    session: &mut ClientSession,
    plan: &mut PublishPlan,
) -> TxnResult<()> {
    let (version, strict) = state(s, session).await?;
    if plan.catalog_version == Some(version) {
        return Ok(());
    }
    let mut snapshot = s.catalog.get();
    if snapshot.version != version {
        let stored = load_types(s, session, version, strict).await?;
        snapshot = s.catalog.replace(&stored)?;
    }
    snapshot.apply(plan)?;
    Ok(())
}
