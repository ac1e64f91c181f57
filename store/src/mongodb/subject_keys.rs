//! Subjects' data keys ([`crate::personal`]): collection `subject_keys`,
//! one document per subject (`_id`: the subject id).

use ::mongodb::bson::spec::BinarySubtype;
use ::mongodb::bson::{doc, Binary, Bson, Document};
use futures::TryStreamExt;

use super::error::{is_duplicate_key, map_err};
use super::{get_string, names, MongoStore};
use crate::personal::WrappedKey;
use crate::{Result, StoreError};

fn bin(b: &[u8]) -> Bson {
    Bson::Binary(Binary {
        subtype: BinarySubtype::Generic,
        bytes: b.to_vec(),
    })
}

fn key(d: &Document) -> Result<WrappedKey> {
    let wrapped = match d.get("wrapped") {
        Some(Bson::Binary(b)) => b.bytes.clone(),
        _ => {
            return Err(StoreError::Database(
                "subject_keys.wrapped is not binary".into(),
            ))
        }
    };
    Ok(WrappedKey {
        subject: get_string(d, "_id")?,
        key_id: get_string(d, "key_id")?,
        wrapped,
    })
}

async fn find(s: &MongoStore, filter: Document) -> Result<Vec<WrappedKey>> {
    let docs: Vec<Document> = s
        .coll(names::SUBJECT_KEYS)
        .find(filter)
        .sort(doc! { "_id": 1 })
        .await
        .map_err(map_err)?
        .try_collect()
        .await
        .map_err(map_err)?;
    docs.iter().map(key).collect()
}

pub(super) async fn get(s: &MongoStore, subjects: &[String]) -> Result<Vec<WrappedKey>> {
    find(s, doc! { "_id": { "$in": subjects } }).await
}

pub(super) async fn all(s: &MongoStore) -> Result<Vec<WrappedKey>> {
    find(s, doc! {}).await
}

pub(super) async fn insert(s: &MongoStore, keys: &[WrappedKey]) -> Result<()> {
    for k in keys {
        let r = s
            .coll(names::SUBJECT_KEYS)
            .insert_one(doc! {
                "_id": &k.subject,
                "key_id": &k.key_id,
                "wrapped": bin(&k.wrapped),
                "created_at": ::mongodb::bson::DateTime::now(),
            })
            .await;
        match r {
            Ok(_) => {}
            // Another node created it first: its key wins.
            Err(e) if is_duplicate_key(&e) => {}
            Err(e) => return Err(map_err(e)),
        }
    }
    Ok(())
}

pub(super) async fn delete(s: &MongoStore, subject: &str) -> Result<bool> {
    let r = s
        .coll(names::SUBJECT_KEYS)
        .delete_one(doc! { "_id": subject })
        .await
        .map_err(map_err)?;
    Ok(r.deleted_count > 0)
}

pub(super) async fn replace(s: &MongoStore, old: &WrappedKey, new: &WrappedKey) -> Result<bool> {
    let r = s
        .coll(names::SUBJECT_KEYS)
        .update_one(
            doc! { "_id": &old.subject, "wrapped": bin(&old.wrapped) },
            doc! { "$set": { "key_id": &new.key_id, "wrapped": bin(&new.wrapped) } },
        )
        .await
        .map_err(map_err)?;
    Ok(r.modified_count > 0)
}
