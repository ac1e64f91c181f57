//! `lanebus demo`: the main job, self-contained (single node for now).
//!
//! 1. opens a store (a temporary SQLite file unless `--store`), starts a node
//!    in-process (HTTP API on 127.0.0.1:0) and a webhook receiver;
//! 2. registers two handlers through the HTTP API: `issues` (`issues.*`)
//!    and `all` (`*`);
//! 3. publishes real GitHub payloads (round-robin over the examples, keys
//!    `repo-<n>` for n in 0..K) through `POST /v1/events` in batches;
//! 4. waits until the receiver has every delivery, then prints deliveries
//!    per second and the exactness verdict read back from the receiver.
//!
//! Exits non-zero if an invariant broke (lost, duplicated, out of order,
//! bad signature) or if deliveries did not all arrive in time.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::Args;
use lanebus_node::receiver::{Expected, Receiver};
use lanebus_node::{sample_data, NodeOptions, StoreSource};
use serde_json::value::RawValue;

/// Flags of `lanebus demo`; each also reads `LANEBUS_*` and the key of the
/// same name in the `--config` file.
#[derive(Debug, Default, Args, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DemoFlags {
    /// TOML config file (keys as the flags in snake case; unknown keys are an error).
    #[arg(long, env = "LANEBUS_DEMO_CONFIG")]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// Store URL [default: a temporary SQLite file, removed afterwards].
    #[arg(long, env = "LANEBUS_STORE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    store: Option<String>,
    /// Events to publish [default: 3290, the real payloads ten times].
    #[arg(long, env = "LANEBUS_DEMO_EVENTS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    events: Option<usize>,
    /// Distinct keys, `repo-0` .. `repo-<K-1>` [default: 20].
    #[arg(long, env = "LANEBUS_DEMO_KEYS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    keys: Option<usize>,
    /// Path of github-webhook-examples.json [default: looked up in shared/data].
    #[arg(long, env = "LANEBUS_DATA")]
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<PathBuf>,
    /// Events per publish call [default: 100].
    #[arg(long, env = "LANEBUS_DEMO_BATCH")]
    #[serde(skip_serializing_if = "Option::is_none")]
    batch: Option<usize>,
    /// Give up waiting for deliveries after this many seconds [default: 120].
    #[arg(long, env = "LANEBUS_DEMO_TIMEOUT_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    timeout_secs: Option<u64>,
}

/// The demo's settings after layering and defaults.
#[derive(Debug)]
struct DemoArgs {
    store: Option<String>,
    events: usize,
    keys: usize,
    data: Option<PathBuf>,
    batch: usize,
    timeout_secs: u64,
}

impl DemoArgs {
    fn resolve(flags: DemoFlags) -> anyhow::Result<DemoArgs> {
        let file = flags.config.clone();
        let f = crate::config::layered(&flags, file.as_deref())?;
        let a = DemoArgs {
            store: f.store,
            events: f.events.unwrap_or(3290),
            keys: f.keys.unwrap_or(20),
            data: f.data,
            batch: f.batch.unwrap_or(100),
            timeout_secs: f.timeout_secs.unwrap_or(120),
        };
        if a.events == 0 || a.keys == 0 || a.batch == 0 {
            bail!(
                "events, keys and batch must be at least 1, got {}, {} and {}",
                a.events,
                a.keys,
                a.batch
            );
        }
        if a.batch > 1_000 {
            bail!(
                "batch must be at most 1000 (the API's limit), got {}",
                a.batch
            );
        }
        Ok(a)
    }
}

#[derive(serde::Serialize)]
struct EventOut<'a> {
    id: String,
    #[serde(rename = "type")]
    event_type: &'a str,
    key: String,
    payload: &'a RawValue,
}

pub async fn run(flags: DemoFlags) -> anyhow::Result<ExitCode> {
    let args = DemoArgs::resolve(flags)?;
    let data = sample_data::find(args.data.as_deref())?;
    let samples = sample_data::load(&data)?;
    let raws: Vec<Box<RawValue>> = samples
        .iter()
        .map(|s| RawValue::from_string(s.payload.clone()))
        .collect::<Result<_, _>>()
        .context("payload is not JSON")?;
    eprintln!(
        "demo: {} real payloads from {}",
        samples.len(),
        data.display()
    );

    let tmp = std::env::temp_dir().join(format!(
        "lanebus-demo-{}-{}",
        std::process::id(),
        uuid::Uuid::now_v7().simple()
    ));
    let store_url = match &args.store {
        Some(s) => s.clone(),
        None => {
            std::fs::create_dir_all(&tmp)
                .with_context(|| format!("cannot create {}", tmp.display()))?;
            format!("sqlite://{}", tmp.join("lanebus.db").display())
        }
    };
    let result = run_with(&args, &samples, &raws, &store_url).await;
    if args.store.is_none() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

async fn run_with(
    args: &DemoArgs,
    samples: &[sample_data::Sample],
    raws: &[Box<RawValue>],
    store_url: &str,
) -> anyhow::Result<ExitCode> {
    let receiver = Receiver::start()
        .await
        .context("cannot start the webhook receiver")?;
    let node = lanebus_node::start(NodeOptions::new(
        "demo-1",
        StoreSource::Url(store_url.to_string()),
    ))
    .await
    .context("cannot start the node")?;
    let api = node.base_url();
    eprintln!(
        "demo: node on {api} ({}), receiver on {}",
        node.store().backend(),
        receiver.base_url()
    );
    let http = reqwest::Client::new();

    let routes = [("issues", vec!["issues.*"]), ("all", vec!["*"])];
    for (name, types) in &routes {
        let resp = http
            .post(format!("{api}/v1/handlers"))
            .json(&serde_json::json!({"name": name, "url": receiver.url(name), "event_types": types, "max_attempts": 8}))
            .send()
            .await?;
        let status = resp.status();
        let body: serde_json::Value = resp.json().await?;
        if status.as_u16() != 201 {
            bail!("registering handler {name} answered {status}: {body}");
        }
        receiver.set_secret(
            name,
            body["secret"].as_str().context("handler without secret")?,
        );
    }

    // The stream: real payloads round-robin, synthetic keys.
    let run_id = uuid::Uuid::now_v7().simple().to_string();
    let mut expected = Vec::new();
    let mut events = Vec::with_capacity(args.events);
    for i in 0..args.events {
        let s = &samples[i % samples.len()];
        let id = format!("demo-{}-{i}", &run_id[20..]);
        let key = format!("repo-{}", i % args.keys);
        for (name, types) in &routes {
            if lanebus_store::route::any_matches(types, &s.event_type) {
                expected.push(Expected {
                    handler: name.to_string(),
                    event_id: id.clone(),
                    key: Some(key.clone()),
                });
            }
        }
        events.push(EventOut {
            id,
            event_type: &s.event_type,
            key,
            payload: &raws[i % raws.len()],
        });
    }

    let started = Instant::now();
    let mut published = 0;
    let mut last_report = Instant::now();
    for chunk in events.chunks(args.batch) {
        let resp = http
            .post(format!("{api}/v1/events"))
            .json(&serde_json::json!({ "events": chunk }))
            .send()
            .await?;
        let status = resp.status();
        if status.as_u16() != 202 {
            let body = resp.text().await.unwrap_or_default();
            bail!("publish answered {status}: {body}");
        }
        published += chunk.len();
        if last_report.elapsed() > Duration::from_millis(500) {
            eprintln!(
                "demo: published {published}/{}, delivered {}/{}",
                events.len(),
                receiver.accepted_distinct(),
                expected.len()
            );
            last_report = Instant::now();
        }
    }
    let publish_secs = started.elapsed().as_secs_f64();
    eprintln!(
        "demo: published {published} events in {publish_secs:.2} s; waiting for {} deliveries",
        expected.len()
    );

    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    let mut all = false;
    while Instant::now() < deadline {
        if receiver
            .wait_accepted(expected.len(), Duration::from_millis(500))
            .await
        {
            all = true;
            break;
        }
        eprintln!(
            "demo: delivered {}/{}",
            receiver.accepted_distinct(),
            expected.len()
        );
    }
    let secs = started.elapsed().as_secs_f64();
    // Let late repeats (if any) show up in the verdict.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let v = receiver.verdict(&expected);
    let requests = receiver.requests().len();
    let counts = node.store().counts().await.ok();
    node.shutdown().await.ok();

    println!(
        "lanebus demo ({}):",
        if store_url.starts_with("sqlite") {
            "sqlite"
        } else {
            "postgres"
        }
    );
    println!(
        "  events published      {published} ({} keys, {} payload types)",
        args.keys,
        samples.len()
    );
    println!("  deliveries expected   {}", v.expected);
    println!(
        "  deliveries accepted   {} in {requests} requests",
        v.delivered
    );
    println!(
        "  rate                  {:.0} deliveries/s (publish start to last delivery, {secs:.2} s)",
        v.delivered as f64 / secs
    );
    println!("  lost                  {}", v.lost);
    println!("  duplicated            {}", v.duplicated);
    println!("  out of order          {}", v.out_of_order);
    println!("  bad signatures        {}", v.bad_signatures);
    if let Some(c) = counts {
        println!(
            "  store                 {} events, {} pending, {} completions, {} dead letters",
            c.events, c.deliveries, c.completions, c.dead_letters
        );
    }
    for p in &v.problems {
        println!("  problem: {p}");
    }
    if v.exact() && all {
        println!("verdict: EXACT (every delivery once, in order per key, signatures valid)");
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "verdict: BROKEN{}",
            if all {
                ""
            } else {
                " (timed out waiting for deliveries)"
            }
        );
        Ok(ExitCode::FAILURE)
    }
}
