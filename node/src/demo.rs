//! `lanebus demo`: the main job, self-contained.
//!
//! 1. starts a webhook receiver in-process and THREE nodes as child
//!    processes of this binary (`lanebus node`, each with its own data dir
//!    under a temporary dir, free ports), node 1 with `--bootstrap`, nodes 2
//!    and 3 with `--join`, on a temporary SQLite file unless `--store`;
//!    leases of 3 s (renewed every 500 ms, 1 s margin);
//! 2. registers two handlers through the HTTP API: `issues` (`issues.*`)
//!    and `all` (`*`), 2 s timeout each;
//! 3. prints the lane table, then publishes real GitHub payloads
//!    (round-robin over the examples, keys `repo-<n>` for n in 0..K) through
//!    `POST /v1/events` of nodes 1 and 2 in batches;
//! 4. when half of the deliveries arrived, kills node 3 with SIGKILL and
//!    measures the failover: from the kill until node 1 shows every lane
//!    active on nodes 1 and 2;
//! 5. waits until the receiver has every delivery, then prints the lane
//!    table after, deliveries per second, the failover time and the
//!    exactness verdict read back from the receiver.
//!
//! Exits non-zero if an invariant broke (lost, out of order, bad signature,
//! a repeat that the kill does not explain: only deliveries in flight on the
//! killed node may arrive twice, docs/design.md invariant 3) or if deliveries did
//! not all arrive in time.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::Args;
use lanebus_testkit::local_cluster::{self, LocalCluster, Start};
use lanebus_testkit::receiver::{Expected, Receiver};
use lanebus_testkit::sample_data;
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
    /// Events to publish [default: 50000].
    #[arg(long, env = "LANEBUS_DEMO_EVENTS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    events: Option<usize>,
    /// Distinct keys, `repo-0` .. `repo-<K-1>` [default: 1000].
    #[arg(long, env = "LANEBUS_DEMO_KEYS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    keys: Option<usize>,
    /// Path of github-webhook-examples.json [default: the repository's data/].
    #[arg(long, env = "LANEBUS_DATA")]
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<PathBuf>,
    /// Events per publish call [default: 100].
    #[arg(long, env = "LANEBUS_DEMO_BATCH")]
    #[serde(skip_serializing_if = "Option::is_none")]
    batch: Option<usize>,
    /// Don't kill a node halfway.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    no_kill: bool,
    /// Give up waiting for deliveries after this many seconds without a new
    /// one [default: 120].
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
    kill: bool,
}

impl DemoArgs {
    fn resolve(flags: DemoFlags) -> anyhow::Result<DemoArgs> {
        let file = flags.config.clone();
        let f = crate::config::layered(&flags, file.as_deref())?;
        let a = DemoArgs {
            store: f.store,
            events: f.events.unwrap_or(50_000),
            keys: f.keys.unwrap_or(1_000),
            data: f.data,
            batch: f.batch.unwrap_or(100),
            timeout_secs: f.timeout_secs.unwrap_or(120),
            kill: !f.no_kill,
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
    lanebus_node::webhook::install_crypto_provider();
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
    std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let store_url = match &args.store {
        Some(s) => s.clone(),
        None => format!("sqlite://{}", tmp.join("lanebus.db").display()),
    };
    let result = run_with(&args, &samples, &raws, &store_url, &tmp).await;
    match &result {
        Ok(code) if *code == ExitCode::SUCCESS => {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        _ => eprintln!("demo: node logs kept in {}", tmp.display()),
    }
    result
}

/// The demo's nodes: a 3 s lease ([`local_cluster::LEASE_3S`]), retries
/// from 100 ms.
fn node_args() -> Vec<&'static str> {
    local_cluster::with_lease_3s(&["--retry-base-ms", "100"])
}
/// Handler timeout, below the lease.
const HANDLER_TIMEOUT_MS: u64 = 2_000;
/// The node killed halfway.
const VICTIM: u64 = 3;

async fn lane_table(cluster: &LocalCluster, via: u64) -> String {
    match cluster.get_json(via, "/admin/lanes").await {
        Ok(body) => crate::admin::lanes_table(&body),
        Err(e) => format!("(lane table unavailable: {e})\n"),
    }
}

async fn run_with(
    args: &DemoArgs,
    samples: &[sample_data::Sample],
    raws: &[Box<RawValue>],
    store_url: &str,
    tmp: &std::path::Path,
) -> anyhow::Result<ExitCode> {
    let receiver = Receiver::start()
        .await
        .context("cannot start the webhook receiver")?;
    let bin = std::env::current_exe().context("cannot find the lanebus binary")?;
    crate::config::create_sqlite_dir(store_url)?;
    let mut cluster = LocalCluster::new(bin, tmp, store_url, &node_args());
    let boot = Instant::now();
    cluster.spawn(1, Start::Bootstrap)?;
    cluster.wait_ready(1, Duration::from_secs(60)).await?;
    let api1 = cluster.url(1);
    for id in [2, 3] {
        cluster.spawn(id, Start::Join(api1.clone()))?;
    }
    for id in [2, 3] {
        cluster.wait_ready(id, Duration::from_secs(60)).await?;
    }
    cluster
        .wait_balanced(1, &[1, 2, 3], Duration::from_secs(60))
        .await?;
    eprintln!(
        "demo: three nodes up and balanced in {:.1} s ({}), receiver on {}",
        boot.elapsed().as_secs_f64(),
        (1..=3)
            .map(|i| format!("node {i} {}", cluster.url(i)))
            .collect::<Vec<_>>()
            .join(", "),
        receiver.base_url()
    );
    let http = reqwest::Client::new();

    let routes = [("issues", vec!["issues.*"]), ("all", vec!["*"])];
    for (name, types) in &routes {
        let resp = http
            .post(format!("{api1}/v1/handlers"))
            .json(&serde_json::json!({"name": name, "url": receiver.url(name), "event_types": types, "max_attempts": 8, "timeout_ms": HANDLER_TIMEOUT_MS}))
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
    let before = lane_table(&cluster, 1).await;

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
        events.push(serde_json::to_value(EventOut {
            id,
            event_type: &s.event_type,
            key,
            payload: &raws[i % raws.len()],
        })?);
    }

    // Publish through nodes 1 and 2 (never the victim: a publish cut by the
    // kill would leave its outcome unknown).
    let started = Instant::now();
    let publishers = [cluster.url(1), cluster.url(2)];
    let batch = args.batch;
    let total_events = events.len();
    let publisher = tokio::spawn(async move {
        let http = reqwest::Client::new();
        for (n, chunk) in events.chunks(batch).enumerate() {
            let body = serde_json::json!({ "events": chunk });
            let mut tries = 0;
            loop {
                let api = &publishers[(n + tries) % publishers.len()];
                let r = http
                    .post(format!("{api}/v1/events"))
                    .json(&body)
                    .send()
                    .await;
                match r {
                    Ok(resp) if resp.status().as_u16() == 202 => break,
                    Ok(resp) if tries >= 20 => {
                        let status = resp.status();
                        let text = resp.text().await.unwrap_or_default();
                        bail!("publish answered {status}: {text}");
                    }
                    Err(e) if tries >= 20 => bail!("publish failed: {e}"),
                    _ => {
                        // Idempotent by event id: a retry of a batch that
                        // did commit counts as duplicates.
                        tries += 1;
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }
        Ok::<_, anyhow::Error>(started.elapsed())
    });

    let want = expected.len();
    // Gives up only after a stall (no new delivery for the timeout), not
    // after a fixed time: on a loaded machine the publish alone can take
    // longer than any fixed bound.
    let stall = Duration::from_secs(args.timeout_secs);
    let (mut last_got, mut last_progress) = (0, Instant::now());
    let mut kill_ms = None;
    let mut killed_at = None;
    let mut failover: Option<Duration> = None;
    let mut moved_lanes = 0;
    let mut all = false;
    let mut last_report = Instant::now();
    while last_progress.elapsed() < stall {
        let got = receiver.accepted_distinct();
        if got >= want {
            all = true;
            break;
        }
        if got > last_got {
            (last_got, last_progress) = (got, Instant::now());
        }
        if args.kill && killed_at.is_none() && got >= want / 2 {
            moved_lanes = cluster
                .lanes(1)
                .await
                .map(|l| l.iter().filter(|l| l.owner.as_deref() == Some("3")).count())
                .unwrap_or(0);
            cluster.kill(VICTIM)?;
            kill_ms = Some(receiver.now_ms());
            killed_at = Some(Instant::now());
            eprintln!(
                "demo: SIGKILL node {VICTIM} at {got}/{want} deliveries ({moved_lanes} lanes to move)"
            );
        }
        if let (Some(at), None) = (killed_at, failover) {
            if let Ok(lanes) = cluster.lanes(1).await {
                let alive = ["1".to_string(), "2".to_string()].into_iter().collect();
                if local_cluster::balance(&lanes, &alive).is_ok() {
                    failover = Some(at.elapsed());
                    eprintln!(
                        "demo: node {VICTIM}'s lanes moved to nodes 1 and 2 in {:.2} s",
                        at.elapsed().as_secs_f64()
                    );
                }
            }
        }
        if last_report.elapsed() > Duration::from_millis(1000) {
            eprintln!("demo: delivered {got}/{want}");
            last_report = Instant::now();
        }
        receiver
            .wait_accepted(want, Duration::from_millis(100))
            .await;
    }
    let secs = started.elapsed().as_secs_f64();
    let publish_secs = match publisher.await {
        Ok(Ok(d)) => d.as_secs_f64(),
        Ok(Err(e)) => return Err(e),
        Err(e) => bail!("publisher task failed: {e}"),
    };
    // Let late repeats (if any) show up in the verdict.
    tokio::time::sleep(Duration::from_millis(300)).await;
    if killed_at.is_some() && failover.is_none() {
        let alive = ["1".to_string(), "2".to_string()].into_iter().collect();
        if let Ok(lanes) = cluster.lanes(1).await {
            if local_cluster::balance(&lanes, &alive).is_ok() {
                failover = killed_at.map(|a| a.elapsed());
            }
        }
    }
    let after = lane_table(&cluster, 1).await;
    let v = receiver.verdict(&expected);
    let log = receiver.requests();
    let reps = local_cluster::repeats(&log, &kill_ms.into_iter().collect::<Vec<_>>());
    let counts = lanebus_store::open(store_url).await.ok();
    let counts = match counts {
        Some(s) => s.counts().await.ok(),
        None => None,
    };
    for id in [1, 2] {
        let _ = cluster.stop(id, Duration::from_secs(10));
    }

    println!(
        "lanebus demo: three nodes ({}), node {VICTIM} killed halfway",
        if store_url.starts_with("sqlite") {
            "sqlite"
        } else {
            "postgres"
        }
    );
    println!("lanes before:");
    print!("{before}");
    println!("lanes after:");
    print!("{after}");
    println!(
        "  events published      {total_events} ({} keys, {} payload types) in {publish_secs:.2} s",
        args.keys,
        samples.len()
    );
    println!("  deliveries expected   {}", v.expected);
    println!(
        "  deliveries accepted   {} in {} requests",
        v.delivered,
        log.len()
    );
    println!(
        "  rate                  {:.0} deliveries/s (publish start to last delivery, {secs:.2} s)",
        v.delivered as f64 / secs
    );
    match (killed_at, failover) {
        (Some(_), Some(f)) => println!(
            "  failover              {:.2} s for {moved_lanes} lanes (SIGKILL to every lane active again; lease 3 s + margin 1 s)",
            f.as_secs_f64()
        ),
        (Some(_), None) => println!("  failover              not finished"),
        _ => println!("  failover              (no node killed)"),
    }
    println!("  lost                  {}", v.lost);
    println!(
        "  duplicated            {} (in flight on the killed node: {}, unexplained: {})",
        v.duplicated,
        reps.repeated,
        reps.unexplained.len()
    );
    println!("  out of order          {}", v.out_of_order);
    println!("  bad signatures        {}", v.bad_signatures);
    if let Some(c) = counts {
        println!(
            "  store                 {} events, {} pending, {} completions, {} dead letters",
            c.events, c.deliveries, c.completions, c.dead_letters
        );
    }
    for p in v
        .problems
        .iter()
        .filter(|p| !p.starts_with("accepted "))
        .take(20)
    {
        println!("  problem: {p}");
    }
    for p in reps.unexplained.iter().take(20) {
        println!("  problem: {p}");
    }
    let exact = v.lost == 0
        && v.out_of_order == 0
        && v.bad_signatures == 0
        && v.unexpected == 0
        && reps.unexplained.is_empty()
        && (killed_at.is_none() || failover.is_some());
    if exact && all {
        println!(
            "verdict: EXACT (none lost, in order per key, signatures valid; repeats: {}, all of deliveries in flight on the killed node)",
            v.duplicated
        );
        Ok(ExitCode::SUCCESS)
    } else {
        let why = if all {
            String::new()
        } else {
            format!(
                " (timed out: no new delivery for {} s, --timeout-secs)",
                args.timeout_secs
            )
        };
        println!("verdict: BROKEN{why}");
        Ok(ExitCode::FAILURE)
    }
}
