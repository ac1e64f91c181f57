//! Named cells: one scenario each, modelled on the reference's tables (seed
//! `000_…`). A cell is serialized as JSON and handed to the sample runner of
//! each build, so base and candidate run exactly the same scenario.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What a cell measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Events per second written by publishers (nothing dispatched).
    Publish,
    /// Deliveries per second completed from a preloaded backlog.
    Dispatch,
    /// Publishing at a fixed rate while dispatching: accepted rate and
    /// commit-to-handler latency.
    Mixed,
    /// Fixed work, for the counter gate: `preload` events published by one
    /// publisher, `batch` per call, one call after the other; database
    /// counters per event stored. The same work every time, so statements
    /// and rows per event are exact and WAL nearly so.
    CountPublish,
    /// Fixed work, for the counter gate: a backlog of `preload` events
    /// (published before the statistics reset) drained to the end through
    /// the store's own claim and complete calls with fixed sizes (claims of
    /// up to the lane buffer per lane, completions in chunks of 200, as
    /// `store/examples/store_probe.rs` does); database counters per
    /// delivery. No node: batch sizes do not follow timing, so statements
    /// and rows per delivery are exact and WAL nearly so.
    CountDrain,
}

impl Kind {
    /// Whether the cell does a fixed amount of work (its exact counters
    /// are gated) rather than run for a fixed time (its throughput is).
    pub fn fixed_work(self) -> bool {
        matches!(self, Kind::CountPublish | Kind::CountDrain)
    }
}

/// How events are published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Via {
    /// `Store::publish` (what the HTTP API calls, without HTTP).
    Store,
    /// `publish_in` inside a caller's transaction (PostgreSQL).
    PublishIn,
    /// `POST /v1/events` on an in-process node.
    Http,
}

/// The reference's dispatcher configurations translated to ours.
///
/// | reference | its meaning | ours |
/// | --- | --- | --- |
/// | `defaults` | concurrency 10, batch 10, poll 1 s, pool 10 | handler `max_in_flight` 10, `--lane-buffer` 10, poll 1 s |
/// | `mid` | concurrency 50, batch 200, pool 20 | `max_in_flight` 50, lane buffer 200, poll 1 s |
/// | `tuned` | concurrency 200, batch 200, pool 40, poll 50 ms | `max_in_flight` 200, lane buffer 200, poll 50 ms |
/// | `ours` | – | our defaults: `max_in_flight` 64, lane buffer 256, poll 1 s (push wake-ups) |
///
/// The reference's concurrency is per process; ours is per handler and
/// node. Its batch is the claim size; ours is the lane buffer (a claim asks
/// for up to the buffer). Its pool size has no counterpart: the store's
/// pool is fixed by the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Settings {
    /// Reference `defaults`.
    Defaults,
    /// Reference `mid`.
    Mid,
    /// Reference `tuned`.
    Tuned,
    /// Our own defaults.
    Ours,
}

impl Settings {
    /// Handler `max_in_flight`.
    pub fn max_in_flight(self) -> u32 {
        match self {
            Settings::Defaults => 10,
            Settings::Mid => 50,
            Settings::Tuned => 200,
            Settings::Ours => 64,
        }
    }
    /// Lane buffer (claim size).
    pub fn lane_buffer(self) -> usize {
        match self {
            Settings::Defaults => 10,
            Settings::Mid | Settings::Tuned => 200,
            Settings::Ours => 256,
        }
    }
    /// Poll interval (`None`: the node's default).
    pub fn poll(self) -> Option<Duration> {
        match self {
            Settings::Defaults | Settings::Mid => Some(Duration::from_secs(1)),
            Settings::Tuned => Some(Duration::from_millis(50)),
            Settings::Ours => None,
        }
    }
}

/// One named scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Cell {
    /// Unique name, such as `pg-dispatch-1n-tuned`.
    pub name: String,
    /// Human title for the report.
    pub title: String,
    /// What is measured.
    pub kind: Kind,
    /// `postgres`, `sqlite` or `mongodb`.
    pub store: String,
    /// Concurrent publishers.
    pub publishers: usize,
    /// Events per publish call.
    pub batch: usize,
    /// Matching handlers (fan-out).
    pub handlers: usize,
    /// Distinct keys (0: unkeyed).
    pub keys: usize,
    /// Publish path.
    pub via: Via,
    /// Dispatcher settings.
    pub settings: Settings,
    /// Events preloaded before a dispatch sample.
    pub preload: usize,
    /// Events per second offered in a mixed sample.
    pub rate: u64,
    /// Warm-up window, seconds.
    pub warmup_s: f64,
    /// Steady window, seconds.
    pub steady_s: f64,
    /// Payload size, bytes (a JSON object of about this size).
    pub payload_bytes: usize,
    /// Dispatch and mixed: handlers are webhooks to an HTTP receiver in the
    /// sample process (`lanebus_testkit::receiver`, signatures verified)
    /// instead of in-process no-ops: the webhook path.
    pub http_sink: bool,
    /// Dispatch: handlers are NATS JetStream subjects (`nats://`) on a
    /// nats-server the sample starts (a stream with file storage in the
    /// work dir): the broker path. A base built before this field reads
    /// such a cell as in-process: measure it with a base that has it.
    #[serde(default)]
    pub nats_sink: bool,
    /// Dispatch: nodes sharing the store. 1: one node owning every lane
    /// (`--single`); more: a Raft cluster of that many members in the
    /// sample process (each with its own runtime thread, store pool, Raft
    /// port and data dir; node 1 bootstraps, the others join it), the
    /// window starting once the lanes are balanced.
    pub nodes: usize,
    /// One personal field per event (`lanebus_store::personal`): the type
    /// is cataloged with a schema marking `/email` personal and the
    /// subject at `/subject` (one of [`PERSONAL_SUBJECTS`], so keys are
    /// created early and then reused), and the store has a master key.
    /// Compare with the same cell without it, in the same run. A base
    /// built before this field runs such a cell without personal fields.
    #[serde(default)]
    pub personal: bool,
    /// The type is cataloged with a JSON Schema that checks the payload's
    /// fields ([`SCHEMA`]), so every publish validates it. Compare with
    /// the same cell without it, in the same run.
    #[serde(default)]
    pub schema: bool,
}

/// The schema of a [`Cell::schema`] cell: what a publisher of
/// `issues.opened` would check, every payload of the bench passing it.
pub const SCHEMA: &str = r#"{
  "type": "object",
  "required": ["action", "body"],
  "properties": {
    "action": {"enum": ["opened", "closed", "reopened"]},
    "body": {"type": "string", "maxLength": 65536}
  }
}"#;

/// Distinct subjects of a [`Cell::personal`] cell's events.
pub const PERSONAL_SUBJECTS: usize = 1000;

impl Default for Cell {
    fn default() -> Self {
        Cell {
            name: String::new(),
            title: String::new(),
            kind: Kind::Publish,
            store: "postgres".into(),
            publishers: 8,
            batch: 1,
            handlers: 1,
            keys: 0,
            via: Via::Store,
            settings: Settings::Tuned,
            preload: 0,
            rate: 0,
            warmup_s: 2.0,
            steady_s: 8.0,
            payload_bytes: 200,
            http_sink: false,
            nats_sink: false,
            nodes: 1,
            personal: false,
            schema: false,
        }
    }
}

impl Cell {
    /// The unit rates and counters are given per.
    pub fn unit(&self) -> &'static str {
        match self.kind {
            Kind::Publish | Kind::CountPublish => "event",
            Kind::Dispatch | Kind::Mixed | Kind::CountDrain => "delivery",
        }
    }
}

fn publish(
    name: &str,
    title: &str,
    p: usize,
    batch: usize,
    handlers: usize,
    keys: usize,
    via: Via,
) -> Cell {
    Cell {
        name: name.into(),
        title: title.into(),
        kind: Kind::Publish,
        publishers: p,
        batch,
        handlers,
        keys,
        via,
        ..Cell::default()
    }
}

fn dispatch(
    name: &str,
    title: &str,
    settings: Settings,
    handlers: usize,
    keys: usize,
    preload: usize,
) -> Cell {
    Cell {
        name: name.into(),
        title: title.into(),
        kind: Kind::Dispatch,
        settings,
        handlers,
        keys,
        preload,
        warmup_s: 4.0,
        steady_s: 8.0,
        ..Cell::default()
    }
}

fn mixed(name: &str, title: &str, rate: u64, settings: Settings) -> Cell {
    Cell {
        name: name.into(),
        title: title.into(),
        kind: Kind::Mixed,
        settings,
        publishers: 32,
        batch: 1,
        keys: 1000,
        rate,
        warmup_s: 2.0,
        steady_s: 8.0,
        ..Cell::default()
    }
}

fn count(
    name: &str,
    title: &str,
    kind: Kind,
    events: usize,
    batch: usize,
    handlers: usize,
) -> Cell {
    Cell {
        name: name.into(),
        title: title.into(),
        kind,
        publishers: 1,
        batch,
        handlers,
        preload: events,
        warmup_s: 0.0,
        steady_s: 0.0,
        ..Cell::default()
    }
}

/// The fixed-work counter cells (the counter gate).
pub fn counter_cells() -> Vec<Cell> {
    vec![
        count(
            "pg-count-publish-b1",
            "PostgreSQL fixed work: 2,000 events, 1 per call",
            Kind::CountPublish,
            2_000,
            1,
            1,
        ),
        count(
            "pg-count-publish-b100",
            "PostgreSQL fixed work: 20,000 events, 100 per call",
            Kind::CountPublish,
            20_000,
            100,
            1,
        ),
        count(
            "pg-count-drain",
            "PostgreSQL fixed work: drain 20,000 deliveries (claim 200 per lane, complete 200 per call)",
            Kind::CountDrain,
            20_000,
            100,
            1,
        ),
        count(
            "pg-count-drain-fan5",
            "PostgreSQL fixed work: drain 4,000 events x 5 handlers (claim 200 per lane, complete 200 per call)",
            Kind::CountDrain,
            4_000,
            100,
            5,
        ),
    ]
}

/// The quick set (the gate; under 10 minutes with two pairs): the
/// fixed-work counter cells, then the time-windowed cells.
pub fn quick() -> Vec<Cell> {
    let mut v = counter_cells();
    v.extend([
        publish(
            "pg-publish-p8-b1",
            "PostgreSQL publish, P=8, batch 1",
            8,
            1,
            1,
            0,
            Via::Store,
        ),
        publish(
            "pg-publish-p8-b100",
            "PostgreSQL publish, P=8, batch 100",
            8,
            100,
            1,
            0,
            Via::Store,
        ),
        publish(
            "pg-publish-http-p64-b1",
            "PostgreSQL HTTP API, P=64, batch 1 (group commit)",
            64,
            1,
            1,
            0,
            Via::Http,
        ),
        dispatch(
            "pg-dispatch-1n-tuned",
            "PostgreSQL dispatch, 1 node, tuned",
            Settings::Tuned,
            1,
            0,
            1_000_000,
        ),
        dispatch(
            "pg-dispatch-1n-tuned-fan5",
            "PostgreSQL dispatch, fan-out 5, 1 node, tuned",
            Settings::Tuned,
            5,
            0,
            200_000,
        ),
        mixed(
            "pg-mixed-1000",
            "PostgreSQL mixed, 1,000/s, tuned",
            1000,
            Settings::Tuned,
        ),
    ]);
    v
}

/// The full set: the quick set plus the rest of the reference's tables that
/// run on one machine.
pub fn full() -> Vec<Cell> {
    let mut v = quick();
    v.extend([
        publish(
            "pg-publish-p1-b1",
            "PostgreSQL publish, P=1, batch 1",
            1,
            1,
            1,
            0,
            Via::Store,
        ),
        publish(
            "pg-publish-p1-b100",
            "PostgreSQL publish, P=1, batch 100",
            1,
            100,
            1,
            0,
            Via::Store,
        ),
        publish(
            "pg-publish-p8-b1-h5",
            "PostgreSQL publish, P=8, batch 1, 5 handlers",
            8,
            1,
            5,
            0,
            Via::Store,
        ),
        publish(
            "pg-publish-p8-b100-h5",
            "PostgreSQL publish, P=8, batch 100, 5 handlers",
            8,
            100,
            5,
            0,
            Via::Store,
        ),
        publish(
            "pg-publish-p8-b1-k1000",
            "PostgreSQL publish, P=8, batch 1, 1,000 distinct keys",
            8,
            1,
            1,
            1000,
            Via::Store,
        ),
        publish(
            "pg-publish-p8-b1-hot10",
            "PostgreSQL publish, P=8, batch 1, 10 hot keys",
            8,
            1,
            1,
            10,
            Via::Store,
        ),
        publish(
            "pg-publish-p8-b1-hot1",
            "PostgreSQL publish, P=8, batch 1, 1 hot key",
            8,
            1,
            1,
            1,
            Via::Store,
        ),
        publish(
            "pg-publish-in-p8-b1",
            "PostgreSQL publish_in, P=8, batch 1",
            8,
            1,
            1,
            0,
            Via::PublishIn,
        ),
        publish(
            "pg-publish-in-p8-b100",
            "PostgreSQL publish_in, P=8, batch 100",
            8,
            100,
            1,
            0,
            Via::PublishIn,
        ),
        publish(
            "pg-publish-p64-b1",
            "PostgreSQL publish, P=64, batch 1 (group commit)",
            64,
            1,
            1,
            0,
            Via::Store,
        ),
        publish(
            "pg-publish-http-p1-b1",
            "PostgreSQL HTTP API, P=1, batch 1",
            1,
            1,
            1,
            0,
            Via::Http,
        ),
        publish(
            "pg-publish-http-p8-b1",
            "PostgreSQL HTTP API, P=8, batch 1",
            8,
            1,
            1,
            0,
            Via::Http,
        ),
        publish(
            "pg-publish-http-p8-b100",
            "PostgreSQL HTTP API, P=8, batch 100",
            8,
            100,
            1,
            0,
            Via::Http,
        ),
        dispatch(
            "pg-dispatch-1n-defaults",
            "PostgreSQL dispatch, 1 node, defaults",
            Settings::Defaults,
            1,
            0,
            1_000_000,
        ),
        dispatch(
            "pg-dispatch-1n-mid",
            "PostgreSQL dispatch, 1 node, mid",
            Settings::Mid,
            1,
            0,
            1_000_000,
        ),
        dispatch(
            "pg-dispatch-1n-ours",
            "PostgreSQL dispatch, 1 node, our defaults",
            Settings::Ours,
            1,
            0,
            1_000_000,
        ),
        dispatch(
            "pg-dispatch-1n-tuned-k1000",
            "PostgreSQL dispatch, 1,000 distinct keys, 1 node, tuned",
            Settings::Tuned,
            1,
            1000,
            800_000,
        ),
        dispatch(
            "pg-dispatch-1n-tuned-hot10",
            "PostgreSQL dispatch, 10 hot keys, 1 node, tuned",
            Settings::Tuned,
            1,
            10,
            100_000,
        ),
        mixed(
            "pg-mixed-1000-defaults",
            "PostgreSQL mixed, 1,000/s, defaults",
            1000,
            Settings::Defaults,
        ),
        mixed(
            "pg-mixed-5000",
            "PostgreSQL mixed, 5,000/s, tuned",
            5000,
            Settings::Tuned,
        ),
        mixed(
            "pg-mixed-1000-ours",
            "PostgreSQL mixed, 1,000/s, our defaults",
            1000,
            Settings::Ours,
        ),
        // Validation: against pg-publish-p8-b1 (quick set) and
        // pg-publish-http-p8-b1 of the same run.
        Cell {
            schema: true,
            ..publish(
                "pg-publish-p8-b1-schema",
                "PostgreSQL publish, P=8, batch 1, type with a schema",
                8,
                1,
                1,
                0,
                Via::Store,
            )
        },
        Cell {
            schema: true,
            ..publish(
                "pg-publish-http-p8-b1-schema",
                "PostgreSQL publish via HTTP, P=8, batch 1, type with a schema",
                8,
                1,
                1,
                0,
                Via::Http,
            )
        },
        // Personal fields: against pg-publish-p8-b1 and pg-dispatch-1n-tuned
        // (quick set) of the same run.
        Cell {
            personal: true,
            ..publish(
                "pg-publish-p8-b1-personal",
                "PostgreSQL publish, P=8, batch 1, one personal field per event",
                8,
                1,
                1,
                0,
                Via::Store,
            )
        },
        Cell {
            personal: true,
            ..dispatch(
                "pg-dispatch-1n-tuned-personal",
                "PostgreSQL dispatch, 1 node, tuned, one personal field per event",
                Settings::Tuned,
                1,
                0,
                1_000_000,
            )
        },
        Cell {
            store: "sqlite".into(),
            ..publish(
                "sqlite-publish-p1-b100",
                "SQLite publish, P=1, batch 100",
                1,
                100,
                1,
                0,
                Via::Store,
            )
        },
        Cell {
            http_sink: true,
            ..dispatch(
                "pg-dispatch-1n-tuned-http",
                "PostgreSQL dispatch to an HTTP receiver (webhooks), 1 node, tuned",
                Settings::Tuned,
                1,
                0,
                400_000,
            )
        },
        Cell {
            nats_sink: true,
            ..dispatch(
                "pg-dispatch-1n-tuned-nats",
                "PostgreSQL dispatch to NATS JetStream (one nats-server, file storage), 1 node, tuned",
                Settings::Tuned,
                1,
                0,
                800_000,
            )
        },
        Cell {
            nodes: 3,
            ..dispatch(
                "pg-dispatch-3n-tuned",
                "PostgreSQL dispatch, 3 nodes (Raft cluster), tuned",
                Settings::Tuned,
                1,
                0,
                1_000_000,
            )
        },
        Cell {
            store: "sqlite".into(),
            ..dispatch(
                "sqlite-dispatch-1n-tuned",
                "SQLite dispatch, 1 node, tuned",
                Settings::Tuned,
                1,
                0,
                800_000,
            )
        },
    ]);
    v.extend(mongo_cells());
    v
}

/// The MongoDB cells (in the full set): publish and dispatch on a
/// throwaway SecantusDB per sample, a MongoDB-compatible test server in
/// Python (real `mongod` cannot be installed here), with a store of 16
/// lanes as the node tests use on it ([`crate::mongo`]). Their figures are
/// of that server, not of MongoDB; the backlog is sized so a sample takes
/// seconds there.
pub fn mongo_cells() -> Vec<Cell> {
    let m = |c: Cell| Cell {
        store: "mongodb".into(),
        ..c
    };
    vec![
        m(publish(
            "mongo-publish-p8-b1",
            "MongoDB (SecantusDB) publish, P=8, batch 1",
            8,
            1,
            1,
            0,
            Via::Store,
        )),
        m(publish(
            "mongo-publish-p8-b100",
            "MongoDB (SecantusDB) publish, P=8, batch 100",
            8,
            100,
            1,
            0,
            Via::Store,
        )),
        Cell {
            steady_s: 24.0,
            ..m(dispatch(
                "mongo-dispatch-1n-tuned",
                "MongoDB (SecantusDB) dispatch, 1 node, tuned",
                Settings::Tuned,
                1,
                0,
                MONGO_DISPATCH_PRELOAD,
            ))
        },
        // Keyed: the exactness check then also holds the MongoDB store to
        // per-key order (1, 2, 3, ... per handler and key). Keyed preloads
        // conflict on the key counters, so this backlog loads slower (about
        // 30 s for 5,000 events); the dev build completed 170 to 265 a
        // second from it, the release build 449 (5,000 drained inside warm-up
        // and window: the fourth full run stopped there), so 7,000 (about
        // 40 s to load). Much larger is no safer: claims slowed down with the
        // backlog on the test server (2 a second from 8,000 events, dev build).
        m(dispatch(
            "mongo-dispatch-1n-tuned-k1000",
            "MongoDB (SecantusDB) dispatch, 1,000 distinct keys, 1 node, tuned",
            Settings::Tuned,
            1,
            1000,
            7_000,
        )),
        m(count(
            "mongo-count-publish-b100",
            "MongoDB (SecantusDB) fixed work: 2,000 events, 100 per call",
            Kind::CountPublish,
            2_000,
            100,
            1,
        )),
        m(count(
            "mongo-count-drain",
            "MongoDB (SecantusDB) fixed work: drain 2,000 deliveries (claim 200 per lane, complete 200 per call)",
            Kind::CountDrain,
            2_000,
            100,
            1,
        )),
    ]
}

/// Backlog of `mongo-dispatch-1n-tuned`: the node's first claim hands over
/// 16 lanes x 200, whose completions go 512 per call; on the test server a
/// claim of 16 lanes costs about 16 scans of `deliveries`, so with this
/// backlog one completion call of 512 lands every several seconds
/// (21 to 64 completions a second seen) and the steady window is 24 s so
/// that it always holds some. The release build drained 6,000 events
/// inside warm-up and window (228 a second; the fourth full run stopped
/// there), so 12,000; the preload (4 loaders, 500 per call) takes about
/// 20 s there.
const MONGO_DISPATCH_PRELOAD: usize = 12_000;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cell_names_are_unique_and_round_trip() {
        let cells = full();
        let mut names: Vec<&str> = cells.iter().map(|c| c.name.as_str()).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n);
        for c in &cells {
            let back: Cell = serde_json::from_str(&serde_json::to_string(c).unwrap()).unwrap();
            assert_eq!(&back, c);
        }
        // Unknown future fields are tolerated, missing ones defaulted.
        let c: Cell = serde_json::from_str(r#"{"name":"x","kind":"dispatch"}"#).unwrap();
        assert_eq!(c.kind, Kind::Dispatch);
        assert_eq!(c.store, "postgres");
    }
}
