//! Collections, indexes and the schema version in `meta`, and the lanes of
//! a new store.

use super::*;

/// Schema version written to `meta` (collections and indexes of this build).
const SCHEMA_VERSION: i64 = 3;

/// Creates the collections and indexes (idempotent; safe while other nodes
/// use the store), records the schema version and, for a new store, creates
/// `lanes` lanes. Returns the store's lane count (an existing store keeps
/// its own).
pub(super) async fn migrate(s: &MongoStore, lanes: u16) -> Result<u16> {
    // Collections cannot be created inside a transaction before
    // MongoDB 4.4: create them all up front. 48 = NamespaceExists.
    for name in names::ALL {
        if let Err(e) = s.db.create_collection(name).await {
            if error_code(&e) != Some(48) {
                return Err(map_err(e));
            }
        }
    }
    let index = |keys: Document, name: &str, unique: bool| {
        IndexModel::builder()
            .keys(keys)
            .options(
                IndexOptions::builder()
                    .name(name.to_string())
                    .unique(unique)
                    .build(),
            )
            .build()
    };
    s.coll(names::DELIVERIES)
        .create_indexes([
            index(doc! { "lane": 1, "pos": 1 }, "claim", true),
            index(doc! { "handler_id": 1 }, "by_handler", false),
        ])
        .await
        .map_err(map_err)?;
    s.coll(names::DEAD_LETTERS)
        .create_index(index(
            doc! { "handler_id": 1, "_id": 1 },
            "by_handler",
            false,
        ))
        .await
        .map_err(map_err)?;
    s.coll(names::COMPLETIONS)
        .create_indexes([
            index(doc! { "completed_at": 1 }, "retention", false),
            // Retention keeps an event completed at or after the cutoff
            // (a recovery needs it), however long ago it was published.
            index(doc! { "event_id": 1, "completed_at": 1 }, "by_event", false),
        ])
        .await
        .map_err(map_err)?;
    // Retention: events by publish time; dead letters by event id (an
    // event with a dead letter is kept). Deliveries have no event index
    // (it would cost every publish): a prune batch looks its candidates
    // up with `$in` on the collection.
    s.coll(names::EVENTS)
        .create_index(index(doc! { "published_at": 1 }, "retention", false))
        .await
        .map_err(map_err)?;
    s.coll(names::DEAD_LETTERS)
        .create_index(index(doc! { "event_id": 1 }, "by_event", false))
        .await
        .map_err(map_err)?;
    s.coll(names::HANDLERS)
        .create_index(index(doc! { "seq": 1 }, "creation_order", false))
        .await
        .map_err(map_err)?;
    // Version 2: the event-type catalog. A wire name or alias belongs to
    // one type only (`names`: the wire name and the aliases).
    s.coll(names::EVENT_TYPES)
        .create_index(index(doc! { "names": 1 }, "unique_names", true))
        .await
        .map_err(map_err)?;
    let meta = s.coll(names::META);
    let catalog = meta
        .update_one(
            doc! { "_id": super::event_types::CATALOG_DOC },
            doc! { "$setOnInsert": { "version": 0i64, "strict": false } },
        )
        .upsert(true);
    if let Err(e) = catalog.await {
        if !is_duplicate_key(&e) {
            return Err(map_err(e));
        }
    }

    // The lane count is fixed by whoever creates the store first.
    let meta = s.coll(names::META);
    let upsert = || {
        meta.update_one(
            doc! { "_id": "store" },
            doc! { "$setOnInsert": { "lanes": i32::from(lanes) },
            "$max": { "schema_version": SCHEMA_VERSION } },
        )
        .upsert(true)
    };
    if let Err(e) = upsert().await {
        // Two first opens at once: the loser's upsert hits the winner's
        // insert; the document exists now.
        if !is_duplicate_key(&e) {
            return Err(map_err(e));
        }
        upsert().await.map_err(map_err)?;
    }
    let meta_doc = meta
        .find_one(doc! { "_id": "store" })
        .await
        .map_err(map_err)?
        .ok_or_else(|| StoreError::Database("meta document vanished".into()))?;
    let version = get_int(&meta_doc, "schema_version")?;
    if version > SCHEMA_VERSION {
        return Err(StoreError::Database(format!(
            "database schema version {version} is newer than this build knows ({SCHEMA_VERSION})"
        )));
    }
    let stored = get_int(&meta_doc, "lanes")?;
    let lanes = u16::try_from(stored)
        .ok()
        .filter(|&l| l > 0)
        .ok_or_else(|| StoreError::Database(format!("meta.lanes {stored} is not a lane count")))?;
    let lane_coll = s.coll(names::LANES);
    let present = lane_coll.count_documents(doc! {}).await.map_err(map_err)?;
    if present < u64::from(lanes) {
        let docs = (0..lanes).map(
            |l| doc! { "_id": i32::from(l), "owner": Bson::Null, "epoch": 0i64, "writes": 0i64 },
        );
        if let Err(e) = lane_coll.insert_many(docs).ordered(false).await {
            // Lanes created by a concurrent first open are fine.
            let only_duplicates = match e.kind.as_ref() {
                ErrorKind::InsertMany(m) => {
                    m.write_concern_error.is_none()
                        && m.write_errors
                            .iter()
                            .flatten()
                            .all(|w| w.code == DUPLICATE_KEY)
                }
                _ => false,
            };
            if !only_duplicates {
                return Err(map_err(e));
            }
        }
    }
    Ok(lanes)
}
