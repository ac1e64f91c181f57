//! Publishers: they publish through `POST /v1/events` and record every
//! event whose publish was acknowledged (202), in publish order.
//!
//! Each publisher owns its keys, and publishes one call at a time, so the
//! publish order of a key is the order of its publisher's acknowledgements.
//! A call that fails (node down, paused, 5xx) is sent again with the same
//! ids to the next node: publish is idempotent by id, so a call that had
//! committed before its answer was lost is not published twice.
//!
//! The child publisher (`lanebus-chaos publish-child`) is a process of its
//! own that the scenario `publisher-killed` SIGKILLs mid-call: it writes a
//! `send` line (with the events) before each call and an `ack` line after
//! the 202, so that the last call without `ack` is the one in doubt.

use std::io::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::rng::Rng;
use lanebus_testkit::oracle::Published;

/// Payloads to publish: real GitHub webhook examples when found, plus a few
/// with escapes, non-ASCII text and odd numbers to catch re-encoding.
pub fn payloads() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = lanebus_testkit::sample_data::find(None)
        .ok()
        .and_then(|p| lanebus_testkit::sample_data::load(&p).ok())
        .map(|s| s.into_iter().map(|s| (s.event_type, s.payload)).collect())
        .unwrap_or_default();
    out.push((
        "chaos.odd".into(),
        r#"{"text":"caf\u00e9 é \"q\" \\ \ud83d\ude80 🚀","n":1.50,"big":12345678901234567890,"z":null,"a":[ ]}"#.into(),
    ));
    out.push(("chaos.small".into(), r#"{"k":"v"}"#.into()));
    out
}

/// One event as sent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sent {
    /// Id.
    pub id: String,
    /// Type.
    #[serde(rename = "type")]
    pub event_type: String,
    /// Key.
    pub key: Option<String>,
    /// Payload JSON text.
    pub payload: String,
}

/// The body of one publish call, with the payloads spliced in as they are.
pub fn body(events: &[Sent]) -> String {
    let mut s = String::from("{\"events\":[");
    for (i, e) in events.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&format!(
            "{{\"id\":{},\"type\":{},",
            serde_json::Value::from(e.id.as_str()),
            serde_json::Value::from(e.event_type.as_str())
        ));
        if let Some(k) = &e.key {
            s.push_str(&format!("\"key\":{},", serde_json::Value::from(k.as_str())));
        }
        s.push_str("\"payload\":");
        s.push_str(&e.payload);
        s.push('}');
    }
    s.push_str("]}");
    s
}

/// Settings of a publisher.
#[derive(Debug, Clone)]
pub struct PubSpec {
    /// Name, the prefix of its ids and keys.
    pub name: String,
    /// Keys it owns.
    pub keys: usize,
    /// Largest call, in events.
    pub max_batch: u64,
    /// Pause between calls, in milliseconds.
    pub pause_ms: u64,
    /// Share of unkeyed events, percent.
    pub unkeyed_percent: u32,
}

/// Builds call number `n` of a publisher.
pub fn batch(spec: &PubSpec, rng: &mut Rng, n: u64, payloads: &[(String, String)]) -> Vec<Sent> {
    let size = rng.range(1, spec.max_batch);
    (0..size)
        .map(|i| {
            let (t, p) = &payloads[rng.below(payloads.len() as u64) as usize];
            let key = (!rng.percent(spec.unkeyed_percent))
                .then(|| format!("{}-k{}", spec.name, rng.below(spec.keys as u64)));
            Sent {
                id: format!("{}-{n}-{i}", spec.name),
                event_type: t.clone(),
                key,
                payload: p.clone(),
            }
        })
        .collect()
}

/// Sends one call to `url`; `Ok` on 202.
pub async fn send(http: &reqwest::Client, url: &str, body: &str) -> anyhow::Result<()> {
    let r = http
        .post(format!("{url}/v1/events"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await?;
    let s = r.status();
    if s.as_u16() != 202 {
        anyhow::bail!(
            "publish answered {s}: {}",
            r.text().await.unwrap_or_default()
        );
    }
    Ok(())
}

/// Runs an in-process publisher until `until`, appending acknowledged
/// events to `out`. `urls` gives the nodes to try, refreshed at each call.
pub async fn run(
    spec: PubSpec,
    seed: u64,
    payloads: Arc<Vec<(String, String)>>,
    urls: Arc<Mutex<Vec<String>>>,
    until: Instant,
    out: Arc<Mutex<Vec<Published>>>,
) -> PubStats {
    let mut rng = Rng::derive(seed, &spec.name);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()
        .expect("client");
    let mut stats = PubStats::default();
    let mut n = 0u64;
    let mut rr = rng.next_u64() as usize;
    while Instant::now() < until {
        let events = batch(&spec, &mut rng, n, &payloads);
        let b = body(&events);
        // Until acknowledged, or 60 s: then it stays in doubt.
        let give_up = Instant::now() + Duration::from_secs(60);
        let mut acked = false;
        while Instant::now() < give_up {
            let list = urls.lock().expect("urls").clone();
            if list.is_empty() {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            rr = rr.wrapping_add(1);
            stats.calls += 1;
            match send(&http, &list[rr % list.len()], &b).await {
                Ok(()) => {
                    acked = true;
                    break;
                }
                Err(_) => {
                    stats.failed_calls += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        let batch_name = format!("{}/{n}", spec.name);
        out.lock()
            .expect("published")
            .extend(events.into_iter().map(|e| Published {
                id: e.id,
                event_type: e.event_type,
                key: e.key,
                payload: e.payload,
                acked,
                batch: batch_name.clone(),
            }));
        n += 1;
        tokio::time::sleep(Duration::from_millis(spec.pause_ms)).await;
    }
    stats
}

/// Counters of a publisher.
#[derive(Debug, Default, Clone, Copy)]
pub struct PubStats {
    /// Calls made.
    pub calls: u64,
    /// Calls that failed (and were sent again).
    pub failed_calls: u64,
}

/// One line of the child publisher's journal.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum Journal {
    /// About to send call `n`.
    Send {
        /// Call number.
        n: u64,
        /// Its events.
        events: Vec<Sent>,
    },
    /// Call `n` was acknowledged.
    Ack {
        /// Call number.
        n: u64,
    },
}

/// The child publisher's loop: publishes until killed, journaling to `out`.
pub async fn child(spec: PubSpec, seed: u64, urls: Vec<String>, out: &Path) -> anyhow::Result<()> {
    let payloads = payloads();
    let mut rng = Rng::derive(seed, &spec.name);
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(out)?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()?;
    let mut rr = 0usize;
    for n in 0.. {
        let events = batch(&spec, &mut rng, n, &payloads);
        let b = body(&events);
        writeln!(
            f,
            "{}",
            serde_json::to_string(&Journal::Send { n, events })?
        )?;
        loop {
            rr += 1;
            if send(&http, &urls[rr % urls.len()], &b).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        writeln!(f, "{}", serde_json::to_string(&Journal::Ack { n })?)?;
        tokio::time::sleep(Duration::from_millis(spec.pause_ms)).await;
    }
    Ok(())
}

/// Reads a child's journal: acknowledged events, then the call in doubt.
/// A torn last line (killed mid-write) is ignored: its call was never sent.
pub fn read_journal(text: &str, name: &str) -> Vec<Published> {
    let mut out: Vec<Published> = Vec::new();
    let mut pending: Option<(u64, Vec<Sent>)> = None;
    let flush = |out: &mut Vec<Published>, n: u64, events: Vec<Sent>, acked: bool| {
        out.extend(events.into_iter().map(|e| Published {
            id: e.id,
            event_type: e.event_type,
            key: e.key,
            payload: e.payload,
            acked,
            batch: format!("{name}/{n}"),
        }));
    };
    for line in text.lines() {
        match serde_json::from_str::<Journal>(line) {
            Ok(Journal::Send { n, events }) => {
                if let Some((pn, pe)) = pending.take() {
                    flush(&mut out, pn, pe, false);
                }
                pending = Some((n, events));
            }
            Ok(Journal::Ack { n }) => {
                if let Some((pn, pe)) = pending.take() {
                    flush(&mut out, pn, pe, pn == n);
                }
            }
            Err(_) => {}
        }
    }
    if let Some((pn, pe)) = pending {
        flush(&mut out, pn, pe, false);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_splice_payloads_unchanged() {
        let e = vec![Sent {
            id: "a".into(),
            event_type: "t.x".into(),
            key: Some("k\"1".into()),
            payload: r#"{"b":1,  "a":2}"#.into(),
        }];
        let b = body(&e);
        assert!(b.contains(r#""payload":{"b":1,  "a":2}"#), "{b}");
        let v: serde_json::Value = serde_json::from_str(&b).unwrap();
        assert_eq!(v["events"][0]["key"], "k\"1");
    }

    #[test]
    fn batches_follow_the_seed() {
        let spec = PubSpec {
            name: "p0".into(),
            keys: 5,
            max_batch: 10,
            pause_ms: 0,
            unkeyed_percent: 10,
        };
        let p = payloads();
        let a = batch(&spec, &mut Rng::new(3), 0, &p);
        let b = batch(&spec, &mut Rng::new(3), 0, &p);
        assert_eq!(body(&a), body(&b));
    }

    #[test]
    fn the_journal_marks_the_unacknowledged_call_in_doubt() {
        let ev = |id: &str| Sent {
            id: id.into(),
            event_type: "t".into(),
            key: None,
            payload: "{}".into(),
        };
        let mut text = String::new();
        for l in [
            Journal::Send {
                n: 0,
                events: vec![ev("a")],
            },
            Journal::Ack { n: 0 },
            Journal::Send {
                n: 1,
                events: vec![ev("b"), ev("c")],
            },
        ] {
            text.push_str(&serde_json::to_string(&l).unwrap());
            text.push('\n');
        }
        text.push_str("{\"state\":\"send\",\"n\":2,\"ev"); // torn
        let p = read_journal(&text, "c");
        assert_eq!(p.len(), 3);
        assert!(p[0].acked && !p[1].acked && !p[2].acked);
        assert_eq!(p[1].batch, "c/1");
    }
}
