//! Carries one [`Plan`] out: sandbox up, handlers registered, publishers and
//! the lane sampler running, faults injected on schedule, everything healed
//! at the end of the publish window, then recovery and drain measured and
//! the record handed to the [`oracle`](lanebus_testkit::oracle).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use crate::plan::{Fault, Plan, Target};
use crate::publisher::{self, PubSpec};
use crate::receiver::{Mode, TrapFor};
use crate::sandbox::{NodeFlags, PgServer, Sandbox, Store};
use lanebus_testkit::oracle::{self, HandlerSpec, LaneSample, Published, Record, Report};

/// What the whole suite shares.
pub struct Ctx {
    /// The `lanebus` binary.
    pub bin: PathBuf,
    /// What its `node` command accepts.
    pub flags: NodeFlags,
    /// The suite's PostgreSQL server, or `None` for SQLite files.
    pub pg: Option<Arc<PgServer>>,
    /// Where sandboxes go.
    pub work: PathBuf,
    /// Keep sandbox directories of passing scenarios too.
    pub keep: bool,
    /// Whether the node runs a real cluster, once a scenario found out.
    pub clustered: Option<bool>,
    /// This binary (for the child publisher).
    pub me: PathBuf,
}

/// How one scenario ended.
#[derive(Debug)]
pub enum Outcome {
    /// It ran and was judged.
    Ran {
        /// The oracle's report.
        report: Box<Report>,
        /// Milliseconds from the end of faults until every expected delivery
        /// was done (`None`: not within the bound).
        drained_ms: Option<u64>,
    },
    /// It could not run here, and why.
    Skipped(String),
    /// The harness failed (not a verdict on lanebus).
    Error(String),
}

/// Handlers of every scenario: (name, patterns).
const HANDLERS: &[(&str, &[&str])] = &[
    ("all", &["*"]),
    ("issues", &["issues.*", "pull_request.*"]),
    ("odd", &["chaos.*", "push"]),
];

/// Time allowed for health after a fault's end beyond lease + margin, in
/// milliseconds: a bound for a machine under load, not an invariant (the
/// slowest recovery seen was 15 s, with load average 23 on 2 cores; the
/// table reports each scenario's actual time).
const RECOVERY_SLACK_MS: u64 = 40_000;

/// How long health may take after a fault's end: lease + margin + slack.
fn recovery_bound(plan: &Plan) -> Duration {
    Duration::from_millis(plan.lease.lease_ms() + plan.lease.margin_ms() + RECOVERY_SLACK_MS)
}

/// How often the lane table is sampled, in milliseconds.
const SAMPLE_MS: u64 = 250;

/// Runs one plan.
pub async fn run(ctx: &mut Ctx, plan: &Plan, index: usize) -> Outcome {
    if plan.needs_db_server && ctx.pg.is_none() {
        return Outcome::Skipped("needs a database server (PostgreSQL)".into());
    }
    if plan.needs_cluster && ctx.clustered == Some(false) {
        return Outcome::Skipped("needs cluster (lanebus node runs single-node)".into());
    }
    let needs_proxies = plan
        .steps
        .iter()
        .any(|s| matches!(s.fault, Fault::Partition { .. } | Fault::OneWay { .. }));
    let dir = ctx
        .work
        .join(format!("{:02}-{}-{}", index, plan.name, plan.seed));
    let store = match &ctx.pg {
        Some(pg) => Store::Postgres {
            server: pg.clone(),
            db: format!("chaos_{index}_{}", plan.name.replace('-', "_")),
        },
        None => Store::Sqlite,
    };
    let mut sb = match Sandbox::start(
        &ctx.bin,
        ctx.flags,
        plan.lease,
        &store,
        plan.nodes,
        plan.seed,
        dir,
        needs_proxies,
    )
    .await
    {
        Ok(sb) => sb,
        Err(e) => return Outcome::Error(format!("sandbox: {e:#}")),
    };
    ctx.clustered = Some(sb.clustered);
    if plan.needs_cluster && !sb.clustered {
        sb.teardown(false).await;
        return Outcome::Skipped("needs cluster (lanebus node runs single-node)".into());
    }
    let out = drive(&mut sb, plan, ctx).await;
    let keep = ctx.keep || !matches!(&out, Outcome::Ran { report, .. } if report.passed());
    if keep {
        println!("  sandbox kept: {}", sb.dir.display());
    }
    if !matches!(&out, Outcome::Ran { report, .. } if report.passed()) {
        print_node_state(&sb).await;
        print_node_warnings(&sb.dir);
        // A failed run's nodes stay up this long (milliseconds) before the
        // teardown, for a debugger.
        if let Ok(v) = std::env::var("LANEBUS_CHAOS_HOLD_MS") {
            match v.parse::<u64>() {
                Ok(ms) => {
                    println!("  holding the nodes for {ms} ms (LANEBUS_CHAOS_HOLD_MS)");
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                Err(e) => println!("  LANEBUS_CHAOS_HOLD_MS={v:?} ignored: {e}"),
            }
        }
    }
    sb.teardown(keep).await;
    out
}

/// Prints what each live node holds at the end of a failed scenario, from
/// its `/metrics`: deliveries queued and in flight in its lanes, buffered
/// payload bytes and bytes reserved by claims under way, store errors.
/// Work held but not attempted, or a backlog left in the store while the
/// lanes hold nothing, point to different causes.
async fn print_node_state(sb: &Sandbox) {
    let live = sb.nodes.iter().filter(|n| n.running() && !n.paused);
    for (url, me, pid) in live.map(|n| (n.url(), n.id.to_string(), n.pid())) {
        if let Some(pid) = pid {
            println!("  {url} (pid {pid}): threads {}", thread_states(pid).await);
        }
        let Some(text) = metrics_text(sb, &url).await else {
            println!("  {url}/metrics: no answer");
            continue;
        };
        let sum = |name: &str| metric_sum(&text, name, "");
        // Its own holder lease as it sees it: an attempt starts only while
        // the lease has its handler's timeout (+ 100 ms) left.
        let lease = async {
            let v: serde_json::Value = sb
                .http
                .get(format!("{url}/admin/lanes"))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            let left: Vec<i64> = v["lanes"]
                .as_array()?
                .iter()
                .filter(|l| l["owner"].as_str() == Some(me.as_str()))
                .filter_map(|l| l["lease_expires_in_ms"].as_i64())
                .collect();
            Some(match (left.iter().min(), left.iter().max()) {
                (Some(lo), Some(hi)) => {
                    format!("own lanes {}, lease left {lo} to {hi} ms", left.len())
                }
                _ => "no own lanes".to_string(),
            })
        }
        .await
        .unwrap_or_else(|| "lanes unknown".into());
        println!(
            "  {url}: {lease}; lanes queued {}, in flight {}; buffered bytes {}, reserved by \
             claims {}; store errors {}",
            sum("lanebus_lane_queued"),
            sum("lanebus_lane_in_flight"),
            sum("lanebus_buffered_payload_bytes"),
            sum("lanebus_claim_reserved_bytes"),
            sum("lanebus_store_errors_total"),
        );
    }
}

/// The threads of process `pid` by name: in which states (`R` running,
/// `S` sleeping, `D` waiting for IO), the CPU time each name used over one
/// second (clock ticks) and how often its threads woke up in that second
/// (voluntary context switches), from `/proc`. A thread that runs all
/// second shows by its ticks; one that is never woken (the node's actor
/// thread with work waiting) by 0 wake-ups.
async fn thread_states(pid: u32) -> String {
    let read = || -> BTreeMap<String, (String, u64, u64)> {
        let mut by_name: BTreeMap<String, (String, u64, u64)> = BTreeMap::new();
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return by_name;
        };
        for t in tasks.flatten() {
            let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
                continue;
            };
            // pid (comm) state ... utime stime: fields 14 and 15.
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                continue;
            };
            let name = stat[open + 1..close].to_string();
            let rest: Vec<&str> = stat[close + 1..].split_whitespace().collect();
            let state = rest.first().copied().unwrap_or("?").to_string();
            let ticks = rest
                .get(11)
                .and_then(|u| u.parse::<u64>().ok())
                .unwrap_or(0)
                + rest
                    .get(12)
                    .and_then(|u| u.parse::<u64>().ok())
                    .unwrap_or(0);
            let woke = std::fs::read_to_string(t.path().join("status"))
                .ok()
                .and_then(|st| {
                    st.lines()
                        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                        .and_then(|v| v.trim().parse::<u64>().ok())
                })
                .unwrap_or(0);
            let e = by_name.entry(name).or_default();
            e.0.push_str(&state);
            e.1 += ticks;
            e.2 += woke;
        }
        by_name
    };
    let before = read();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = read();
    after
        .iter()
        .map(|(name, (states, ticks, woke))| {
            let b = before.get(name);
            let used = ticks.saturating_sub(b.map_or(0, |b| b.1));
            let woke = woke.saturating_sub(b.map_or(0, |b| b.2));
            format!("{name} [{states}] {used} ticks, {woke} wake-ups")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// How many WARN and ERROR lines of each node's log a failed scenario
/// prints (the last ones): CI keeps only the output, not the sandbox.
const WARNINGS_SHOWN: usize = 25;

/// Prints the last [`WARNINGS_SHOWN`] WARN and ERROR lines of every node
/// log in `dir` (`node-N.log`), each cut at 300 characters.
fn print_node_warnings(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut logs: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("node-") && n.ends_with(".log"))
        })
        .collect();
    logs.sort();
    for log in logs {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            .collect();
        let name = log.file_name().and_then(|n| n.to_str()).unwrap_or("?");
        println!(
            "  {name}: {} WARN/ERROR lines, the last {}:",
            lines.len(),
            lines.len().min(WARNINGS_SHOWN)
        );
        for l in &lines[lines.len().saturating_sub(WARNINGS_SHOWN)..] {
            let cut: String = l.chars().take(300).collect();
            println!("    {cut}");
        }
    }
}

async fn drive(sb: &mut Sandbox, plan: &Plan, ctx: &Ctx) -> Outcome {
    match drive_inner(sb, plan, ctx).await {
        Ok(o) => o,
        Err(e) => Outcome::Error(format!("{e:#}")),
    }
}

async fn register(sb: &Sandbox, plan: &Plan) -> anyhow::Result<HashMap<String, String>> {
    let mut ids = HashMap::new();
    for (name, patterns) in HANDLERS {
        let mut body = serde_json::json!({
            "name": name,
            "url": sb.receiver.url(name),
            "event_types": patterns,
            "timeout_ms": plan.timeout_ms,
            "max_attempts": plan.max_attempts,
        });
        if let Some((_, n)) = plan.max_in_flight.filter(|(h, _)| h == name) {
            body["max_in_flight"] = n.into();
        }
        let r = sb
            .http
            .post(format!("{}/v1/handlers", sb.nodes[0].url()))
            .json(&body)
            .send()
            .await?;
        let status = r.status();
        let v: serde_json::Value = r.json().await?;
        if status.as_u16() != 201 {
            bail!("handler {name}: {status} {v}");
        }
        sb.receiver
            .set_secret(name, v["secret"].as_str().unwrap_or_default());
        ids.insert(
            v["id"].as_str().unwrap_or_default().to_string(),
            name.to_string(),
        );
    }
    Ok(ids)
}

/// Samples `GET /admin/lanes` of every node until `stop`, one loop per node
/// so that a frozen node does not slow the others' sampling. A sample is
/// stamped when its answer arrived: an epoch never looks older than it is
/// (the oracle allows for the other direction with its slack).
fn sampler(
    http: reqwest::Client,
    urls: Vec<(String, String)>,
    start: Instant,
    stop: Arc<AtomicBool>,
    out: Arc<Mutex<Vec<LaneSample>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let loops = urls.into_iter().map(|(node, url)| {
            let (http, stop, out) = (http.clone(), stop.clone(), out.clone());
            async move {
                while !stop.load(Ordering::Relaxed) {
                    let got = async {
                        http.get(format!("{url}/admin/lanes"))
                            .timeout(Duration::from_millis(1_000))
                            .send()
                            .await
                            .ok()?
                            .json::<serde_json::Value>()
                            .await
                            .ok()
                    }
                    .await;
                    if let Some(v) = got {
                        let at = start.elapsed().as_millis() as u64;
                        out.lock()
                            .expect("samples")
                            .extend(lane_samples(&v, &node, at));
                    }
                    tokio::time::sleep(Duration::from_millis(SAMPLE_MS)).await;
                }
            }
        });
        futures::future::join_all(loops).await;
    })
}

fn lane_samples(v: &serde_json::Value, node: &str, at: u64) -> Vec<LaneSample> {
    v["lanes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| {
            Some(LaneSample {
                at_ms: at,
                node: node.to_string(),
                lane: u16::try_from(l["lane"].as_u64()?).ok()?,
                owner: l["owner"].as_str().map(str::to_owned),
                epoch: l["epoch"].as_i64()?,
            })
        })
        .collect()
}

/// Why the cluster is not healthy (every node ready and every lane owned
/// and active, as each node sees it): the first node that is not, and
/// what it answered (its `/readyz` refusal, or its lanes not owned and
/// active counted by state and owner); `None` when healthy.
async fn unhealthy(sb: &Sandbox) -> Option<String> {
    for url in sb.all_urls() {
        let ready = sb
            .http
            .get(format!("{url}/readyz"))
            .timeout(Duration::from_secs(1))
            .send()
            .await;
        match ready {
            Ok(r) if r.status().is_success() => {}
            Ok(r) => {
                let status = r.status();
                let body = r.text().await.unwrap_or_default();
                return Some(format!("{url}/readyz: {status} {}", body.trim()));
            }
            Err(e) => return Some(format!("{url}/readyz: {e}")),
        }
        let v = match sb
            .http
            .get(format!("{url}/admin/lanes"))
            .timeout(Duration::from_secs(1))
            .send()
            .await
        {
            Ok(r) => match r.json::<serde_json::Value>().await {
                Ok(v) => v,
                Err(e) => return Some(format!("{url}/admin/lanes: {e}")),
            },
            Err(e) => return Some(format!("{url}/admin/lanes: {e}")),
        };
        let lanes = v["lanes"].as_array().cloned().unwrap_or_default();
        if lanes.is_empty() {
            return Some(format!("{url}/admin/lanes: no lanes"));
        }
        let mut bad: BTreeMap<(String, String), usize> = BTreeMap::new();
        for l in &lanes {
            let state = l["state"].as_str().unwrap_or("?");
            if l["owner"].is_null() || state != "active" {
                let owner = l["owner"].as_str().unwrap_or("none").to_string();
                *bad.entry((state.to_string(), owner)).or_default() += 1;
            }
        }
        if !bad.is_empty() {
            let list: Vec<String> = bad
                .iter()
                .map(|((state, owner), n)| format!("{n} {state} (owner {owner})"))
                .collect();
            return Some(format!("{url}/admin/lanes: {}", list.join(", ")));
        }
    }
    None
}

async fn dead_letters(
    sb: &Sandbox,
    ids: &HashMap<String, String>,
) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let urls = sb.live_urls();
    let url = urls.first().context("no live node")?;
    let mut after: Option<i64> = None;
    loop {
        let mut q = format!("{url}/admin/dead-letters?limit=1000");
        if let Some(a) = after {
            q.push_str(&format!("&after={a}"));
        }
        let v: serde_json::Value = sb.http.get(q).send().await?.json().await?;
        for d in v["dead_letters"].as_array().into_iter().flatten() {
            let h = d["handler_id"].as_str().unwrap_or_default();
            out.push((
                ids.get(h).cloned().unwrap_or_else(|| h.to_string()),
                d["event_id"].as_str().unwrap_or_default().to_string(),
            ));
        }
        match v["next_after"].as_i64() {
            Some(a) => after = Some(a),
            None => return Ok(out),
        }
    }
}

async fn resolve(sb: &Sandbox, target: Target, count: usize) -> Vec<usize> {
    let n = sb.nodes.len();
    if n == 1 {
        return vec![0];
    }
    let leader = sb.leader().await;
    let followers: Vec<usize> = (0..n)
        .filter(|i| Some(*i) != leader && sb.nodes[*i].running())
        .collect();
    let mut out = Vec::new();
    match target {
        Target::Leader => out.extend(leader),
        Target::Follower(pick) => {
            for k in 0..count.min(followers.len()) {
                out.push(followers[(pick as usize + k) % followers.len()]);
            }
        }
    }
    if out.is_empty() {
        out.push(0);
    }
    out
}

async fn drive_inner(sb: &mut Sandbox, plan: &Plan, ctx: &Ctx) -> anyhow::Result<Outcome> {
    let ids = register(sb, plan).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let samples: Arc<Mutex<Vec<LaneSample>>> = Arc::default();
    let node_urls: Vec<(String, String)> = sb
        .nodes
        .iter()
        .map(|n| (n.id.to_string(), n.url()))
        .collect();
    let sampler = sampler(
        sb.http.clone(),
        node_urls,
        sb.start,
        stop.clone(),
        samples.clone(),
    );
    sb.receiver.set_mode(plan.endpoint);
    let payloads = Arc::new(publisher::payloads());
    let urls = Arc::new(Mutex::new(sb.live_urls()));
    let published: Arc<Mutex<Vec<Published>>> = Arc::default();
    let t0 = Instant::now();
    let until = t0 + Duration::from_millis(plan.publish_ms);
    let mut pubs = Vec::new();
    for p in 0..3 {
        let spec = PubSpec {
            name: format!("p{p}"),
            keys: 20,
            max_batch: 10,
            pause_ms: 40,
            unkeyed_percent: 10,
        };
        pubs.push(tokio::spawn(publisher::run(
            spec,
            plan.seed,
            payloads.clone(),
            urls.clone(),
            until,
            published.clone(),
        )));
    }
    let journal = sb.dir.join("child-publisher.jsonl");
    let mut child = if plan.child_publisher {
        Some(
            tokio::process::Command::new(&ctx.me)
                .arg("publish-child")
                .args(["--seed", &plan.seed.to_string()])
                .arg("--out")
                .arg(&journal)
                .args(sb.all_urls())
                .stdout(std::process::Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .context("cannot start the child publisher")?,
        )
    } else {
        None
    };

    // Per fault: from its end (the restart, SIGCONT, heal) until every node
    // is ready and every lane owned and active again, bounded.
    let mut fault_recovery: Vec<Option<u64>> = Vec::new();
    for step in &plan.steps {
        tokio::time::sleep_until((t0 + Duration::from_millis(step.at_ms)).into()).await;
        let at = sb.now_ms();
        let what = inject(
            sb,
            plan,
            &step.fault,
            &urls,
            &mut child,
            ctx.pg.as_ref(),
            &ids,
        )
        .await?;
        println!("  {at:>6} ms  {what}");
        let started = Instant::now();
        let bound = recovery_bound(plan);
        let mut rec = None;
        let mut why = None;
        while started.elapsed() < bound {
            why = unhealthy(sb).await;
            if why.is_none() {
                rec = Some(started.elapsed().as_millis() as u64);
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        println!(
            "  {:>6} ms  {}",
            sb.now_ms(),
            match rec {
                Some(ms) => format!("healthy again, {ms} ms after the fault ended"),
                None => format!(
                    "NOT healthy within {bound:?} of the fault's end: {}",
                    why.as_deref().unwrap_or("not asked")
                ),
            }
        );
        fault_recovery.push(rec);
    }
    tokio::time::sleep_until(until.into()).await;
    let mut stats = publisher::PubStats::default();
    for p in pubs {
        let s = p.await?;
        stats.calls += s.calls;
        stats.failed_calls += s.failed_calls;
    }
    if let Some(mut c) = child.take() {
        let _ = c.kill().await;
    }
    sb.receiver.set_mode(Mode::Healthy);
    sb.heal().await?;
    *urls.lock().expect("urls") = sb.live_urls();
    let healed = Instant::now();
    println!(
        "  {:>6} ms  faults over, healed ({} publish calls, {} failed and sent again)",
        sb.now_ms(),
        stats.calls,
        stats.failed_calls
    );

    // Recovery: every node ready, every lane owned.
    let bound = recovery_bound(plan);
    let mut healthy_at_end = false;
    let mut why = None;
    while healed.elapsed() < bound {
        why = unhealthy(sb).await;
        if why.is_none() {
            healthy_at_end = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if let Some(why) = why.filter(|_| !healthy_at_end) {
        println!(
            "  {:>6} ms  NOT healthy within {bound:?} of the heal: {why}",
            sb.now_ms()
        );
    }
    // The slowest fault's recovery; `None` if any fault, or the final heal,
    // missed its bound.
    let recovered_ms = if healthy_at_end && fault_recovery.iter().all(Option::is_some) {
        Some(fault_recovery.iter().flatten().copied().max().unwrap_or(0))
    } else {
        None
    };

    // Drain: every expected delivery accepted or dead-lettered.
    let mut all = published.lock().expect("published").clone();
    if plan.child_publisher {
        let text = std::fs::read_to_string(&journal).unwrap_or_default();
        all.extend(publisher::read_journal(&text, "child"));
    }
    let handlers: Vec<HandlerSpec> = HANDLERS
        .iter()
        .map(|(n, p)| HandlerSpec {
            name: n.to_string(),
            patterns: p.iter().map(|s| s.to_string()).collect(),
            timeout_ms: plan.timeout_ms,
            dead_letters_expected: plan.dead_letters_expected,
        })
        .collect();
    let expected: HashSet<(String, String)> = all
        .iter()
        .filter(|p| p.acked)
        .flat_map(|p| {
            handlers
                .iter()
                .filter(|h| h.matches(&p.event_type))
                .map(|h| (h.name.clone(), p.id.clone()))
        })
        .collect();
    let drain_bound = Duration::from_secs(120);
    let mut drained_ms = None;
    let mut dead = Vec::new();
    let mut last_dl = Instant::now() - Duration::from_secs(10);
    while healed.elapsed() < drain_bound {
        let log = sb.receiver.log();
        let mut done: HashSet<(String, String)> = log
            .iter()
            .filter(|r| matches!(r.status, Some(s) if (200..300).contains(&s)))
            .map(|r| (r.handler.clone(), r.event_id.clone()))
            .collect();
        if plan.dead_letters_expected && last_dl.elapsed() > Duration::from_secs(1) {
            dead = dead_letters(sb, &ids).await.unwrap_or_default();
            last_dl = Instant::now();
        }
        done.extend(dead.iter().cloned());
        if expected.iter().all(|e| done.contains(e)) {
            drained_ms = Some(healed.elapsed().as_millis() as u64);
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // Let stray repeats arrive before judging.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    dead = dead_letters(sb, &ids).await.unwrap_or(dead);
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.await;
    let lanes = samples
        .lock()
        .expect("samples")
        .iter()
        .map(|s| s.lane)
        .max()
        .map_or(256, |m| m + 1);
    let record = Record {
        lanes,
        published: all,
        handlers,
        requests: sb.receiver.log(),
        samples: samples.lock().expect("samples").clone(),
        dead_letters: dead,
        recovered_ms,
        sample_slack_ms: 8 * SAMPLE_MS,
    };
    let report = oracle::judge(&record);
    std::fs::write(
        sb.dir.join("samples.json"),
        serde_json::to_vec(
            &record
                .samples
                .iter()
                .map(|s| (s.at_ms, &s.node, s.lane, &s.owner, s.epoch))
                .collect::<Vec<_>>(),
        )
        .unwrap_or_default(),
    )
    .ok();
    std::fs::write(
        sb.dir.join("requests.json"),
        serde_json::to_vec(&record.requests).unwrap_or_default(),
    )
    .ok();
    Ok(Outcome::Ran {
        report: Box::new(report),
        drained_ms,
    })
}

/// Carries out one fault (including its end); returns a description.
async fn inject(
    sb: &mut Sandbox,
    plan: &Plan,
    fault: &Fault,
    urls: &Arc<Mutex<Vec<String>>>,
    child: &mut Option<tokio::process::Child>,
    pg: Option<&Arc<PgServer>>,
    handler_ids: &HashMap<String, String>,
) -> anyhow::Result<String> {
    let set_urls = |sb: &Sandbox| *urls.lock().expect("urls") = sb.live_urls();
    let ids = |sb: &Sandbox, v: &[usize]| {
        v.iter()
            .map(|i| sb.nodes[*i].id.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    Ok(match fault {
        Fault::Kill {
            target,
            count,
            down_ms,
        } => {
            let v = resolve(sb, *target, *count).await;
            for &i in &v {
                sb.kill(i).await;
            }
            set_urls(sb);
            tokio::time::sleep(Duration::from_millis(*down_ms)).await;
            for &i in &v {
                sb.spawn(i).await?;
            }
            set_urls(sb);
            format!(
                "SIGKILL node {} ({target:?}), restarted after {down_ms} ms",
                ids(sb, &v)
            )
        }
        Fault::Pause { target, ms } => {
            let i = resolve(sb, *target, 1).await[0];
            sb.pause(i, true).await;
            set_urls(sb);
            tokio::time::sleep(Duration::from_millis(*ms)).await;
            sb.pause(i, false).await;
            set_urls(sb);
            format!("SIGSTOP node {} for {ms} ms, then SIGCONT", sb.nodes[i].id)
        }
        Fault::Partition { target, ms } => {
            let i = resolve(sb, *target, 1).await[0];
            sb.isolate(i, true);
            tokio::time::sleep(Duration::from_millis(*ms)).await;
            sb.isolate(i, false);
            format!(
                "partitioned node {} ({target:?}) for {ms} ms",
                sb.nodes[i].id
            )
        }
        Fault::OneWay { from, loss, ms } => {
            let i = resolve(sb, *from, 1).await[0];
            sb.one_way(i, *loss);
            tokio::time::sleep(Duration::from_millis(*ms)).await;
            for p in &sb.raft_proxies {
                p.heal();
            }
            format!(
                "node {} cannot send, other links drop {loss} % of chunks, for {ms} ms",
                sb.nodes[i].id
            )
        }
        Fault::DbRestart { down_ms } => {
            let pg = pg.context("db-restart needs PostgreSQL")?;
            pg.down().await?;
            tokio::time::sleep(Duration::from_millis(*down_ms)).await;
            pg.up().await?;
            format!("database stopped, started again after {down_ms} ms")
        }
        Fault::DbCut { ms } => {
            let p = sb.db_proxy.as_ref().context("db-cut needs the db proxy")?;
            // A slow database first (every chunk 150 ms late), then none.
            p.set(None, crate::proxy::LinkMode::Delay(150));
            tokio::time::sleep(Duration::from_millis(1_000)).await;
            p.set(None, crate::proxy::LinkMode::Cut);
            tokio::time::sleep(Duration::from_millis(*ms)).await;
            p.heal();
            format!(
                "database links delayed 150 ms for 1 s, then cut (new ones refused) for {ms} ms"
            )
        }
        Fault::RollingRestart { gap_ms } => {
            for i in 0..sb.nodes.len() {
                sb.stop(i).await;
                set_urls(sb);
                sb.spawn(i).await?;
                sb.wait_ready(i, Duration::from_secs(60)).await?;
                set_urls(sb);
                tokio::time::sleep(Duration::from_millis(*gap_ms)).await;
            }
            format!(
                "rolling restart of {} node(s), {gap_ms} ms apart",
                sb.nodes.len()
            )
        }
        Fault::Endpoint { mode, ms } => {
            sb.receiver.set_mode(*mode);
            tokio::time::sleep(Duration::from_millis(*ms)).await;
            sb.receiver.set_mode(plan.endpoint);
            format!("endpoint {mode:?} for {ms} ms")
        }
        Fault::Remove { target } => {
            let i = resolve(sb, *target, 1).await[0];
            let r = remove(sb, i, recovery_bound(plan)).await;
            set_urls(sb);
            r?
        }
        Fault::KillPublisher => {
            let mut c = child.take().context("no child publisher")?;
            let _ = c.kill().await;
            "SIGKILL the child publisher".to_string()
        }
        Fault::StaleFinalAttempt {
            target,
            fail_percent,
            final_attempt,
            hold_ms,
        } => {
            let i = resolve(sb, *target, 1).await[0];
            let r = stale_final_attempt(
                sb,
                urls,
                i,
                (*fail_percent, *final_attempt, *hold_ms),
                handler_ids,
            )
            .await;
            sb.receiver.clear_traps();
            sb.receiver.set_mode(Mode::Healthy);
            // Resumed whatever happened (also when the catch failed).
            if sb.nodes[i].paused {
                sb.pause(i, false).await;
            }
            set_urls(sb);
            r?
        }
    })
}

/// The planned removal of node `i` (see [`Fault::Remove`]): asked of
/// another node (`POST /admin/cluster/remove`), awaited until that node's
/// `GET /admin/cluster` no longer lists `i` (its lanes handed over, at
/// most `bound`), then node `i` is stopped and retired.
async fn remove(sb: &mut Sandbox, i: usize, bound: Duration) -> anyhow::Result<String> {
    let id = sb.nodes[i].id.to_string();
    let via = match sb.leader().await {
        Some(l) if l != i => l,
        _ => (0..sb.nodes.len())
            .find(|j| *j != i && sb.nodes[*j].running() && !sb.nodes[*j].paused)
            .context("no other node to ask for the removal")?,
    };
    let url = sb.nodes[via].url();
    let asked = Instant::now();
    let r = sb
        .http
        .post(format!("{url}/admin/cluster/remove"))
        .json(&serde_json::json!({ "id": sb.nodes[i].id }))
        .timeout(Duration::from_secs(15))
        .send()
        .await?;
    let status = r.status();
    if !status.is_success() {
        bail!(
            "removal of node {id}: {status} {}",
            r.text().await.unwrap_or_default()
        );
    }
    let gone = loop {
        let listed = async {
            let v: serde_json::Value = sb
                .http
                .get(format!("{url}/admin/cluster"))
                .send()
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            Some(
                v["nodes"]
                    .as_array()?
                    .iter()
                    .any(|n| n["id"].as_str() == Some(id.as_str())),
            )
        }
        .await;
        if listed == Some(false) {
            break true;
        }
        if asked.elapsed() > bound {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let ms = asked.elapsed().as_millis();
    sb.retire(i).await;
    if !gone {
        bail!("node {id} still a member {ms} ms after its removal was asked (stopped anyway)");
    }
    Ok(format!(
        "planned removal of node {id} (asked node {}): lanes handed over and removed after {ms} ms, then SIGTERM",
        sb.nodes[via].id
    ))
}

/// How long to wait for the victim's final attempt once the first attempts
/// fail, in milliseconds.
const CATCH_MS: u64 = 30_000;

/// The `stale-final-attempt` fault on node `i` (see
/// [`Fault::StaleFinalAttempt`]); leaves the node resumed or paused (the
/// caller resumes it), the traps to the caller to clear.
async fn stale_final_attempt(
    sb: &mut Sandbox,
    urls: &Arc<Mutex<Vec<String>>>,
    i: usize,
    (fail_percent, final_attempt, hold_ms): (u32, u32, u64),
    handler_ids: &HashMap<String, String>,
) -> anyhow::Result<String> {
    let victim = sb.nodes[i].id.to_string();
    let victim_url = sb.nodes[i].url();
    let refused_before = refused_dead_letters(sb, &victim_url).await.unwrap_or(0);
    sb.receiver.set_mode(Mode::FailFirst {
        percent: fail_percent,
    });
    let first = sb.receiver.trap(TrapFor::Attempt {
        sender: victim.clone(),
        attempt: final_attempt,
    });
    let first = match tokio::time::timeout(Duration::from_millis(CATCH_MS), first).await {
        Ok(Ok(c)) => c,
        _ => bail!(
            "stale-final-attempt: node {victim} sent no attempt {final_attempt} within {CATCH_MS} ms"
        ),
    };
    sb.receiver.set_mode(Mode::Healthy);
    let (handler, event_id) = (first.handler.clone(), first.event_id.clone());
    let again = sb.receiver.trap(TrapFor::Delivery {
        handler: handler.clone(),
        event_id: event_id.clone(),
        not_sender: victim.clone(),
    });
    sb.pause(i, true).await;
    *urls.lock().expect("urls") = sb.live_urls();
    let frozen = Instant::now();
    // The answer waits in the socket until the node runs again.
    let _ = first.answer.send(500);
    let bound = Duration::from_millis(crate::LEASE_MS + crate::LEASE_MARGIN_MS + RECOVERY_SLACK_MS);
    let second = tokio::time::timeout(bound, again)
        .await
        .ok()
        .and_then(Result::ok);
    sb.pause(i, false).await;
    *urls.lock().expect("urls") = sb.live_urls();
    let frozen_ms = frozen.elapsed().as_millis();
    let Some(second) = second else {
        return Ok(format!(
            "node {victim}'s attempt {final_attempt} of {handler} {event_id} answered 500 while SIGSTOPped; no other node sent it within {bound:?}; SIGCONT after {frozen_ms} ms"
        ));
    };
    // Hold the new owner's request until the victim has written the end
    // of its attempt (a dead letter: refused, or moved), answering in time.
    let deadline_ms = second.arrived_ms + hold_ms as f64;
    let pair = (handler.clone(), event_id.clone());
    let mut verdict = "neither refused nor written (not seen)";
    while (sb.now_ms() as f64) < deadline_ms {
        if dead_letters(sb, handler_ids)
            .await
            .is_ok_and(|d| d.contains(&pair))
        {
            verdict = "WRITTEN (the delivery is now a dead letter)";
            break;
        }
        if refused_dead_letters(sb, &victim_url)
            .await
            .is_some_and(|n| n > refused_before)
        {
            verdict = "refused (fenced out)";
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let held_ms = sb.now_ms() as f64 - second.arrived_ms;
    let _ = second.answer.send(200);
    Ok(format!(
        "node {victim}'s attempt {final_attempt} of {handler} {event_id} answered 500 while SIGSTOPped; node {} sent it (attempt {}) after the lane moved, held; SIGCONT after {frozen_ms} ms; node {victim}'s dead letter: {verdict}; node {} answered 200 after {held_ms:.0} ms",
        second.sender.as_deref().unwrap_or("?"),
        second.attempt,
        second.sender.as_deref().unwrap_or("?"),
    ))
}

/// How many dead letters the node at `url` had refused
/// (`lanebus_store_fenced_out_total{op="dead_letter"}` of `GET /metrics`;
/// 0 before the first); `None`: no answer.
async fn refused_dead_letters(sb: &Sandbox, url: &str) -> Option<u64> {
    let text = metrics_text(sb, url).await?;
    Some(counter(
        &text,
        "lanebus_store_fenced_out_total",
        "op=\"dead_letter\"",
    ))
}

/// The sum of the Prometheus text-format samples of `name` whose labels
/// contain `label`.
fn counter(text: &str, name: &str, label: &str) -> u64 {
    metric_sum(text, name, label) as u64
}

/// The sum of the samples of metric `name` in the Prometheus `text` whose
/// labels contain `label`; with `label` empty, every sample of it, with
/// labels or without (not those of other metrics whose names start with
/// `name`).
fn metric_sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name).is_some_and(|rest| {
                (rest.starts_with('{') && rest.contains(label))
                    || (label.is_empty() && rest.starts_with(' '))
            })
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `GET /metrics` of the node at `url` (2 s at most); `None`: no answer.
async fn metrics_text(sb: &Sandbox, url: &str) -> Option<String> {
    sb.http
        .get(format!("{url}/metrics"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_sums_the_labelled_samples_of_one_metric() {
        let text = "# TYPE lanebus_store_fenced_out_total counter\n\
            lanebus_store_fenced_out_total{op=\"claim\"} 4\n\
            lanebus_store_fenced_out_total{op=\"dead_letter\"} 2\n\
            lanebus_store_fenced_out_total_x{op=\"dead_letter\"} 9\n";
        assert_eq!(
            counter(text, "lanebus_store_fenced_out_total", "op=\"dead_letter\""),
            2
        );
        assert_eq!(
            counter(text, "lanebus_store_fenced_out_total", "op=\"discard\""),
            0
        );
    }

    #[test]
    fn metric_sum_takes_every_sample_of_one_metric_without_a_label() {
        let text = "lanebus_lane_queued{lane=\"1\"} 3\n\
            lanebus_lane_queued{lane=\"2\"} 4\n\
            lanebus_lane_queued_x 100\n\
            lanebus_buffered_payload_bytes 2048\n";
        assert_eq!(metric_sum(text, "lanebus_lane_queued", ""), 7.0);
        assert_eq!(
            metric_sum(text, "lanebus_buffered_payload_bytes", ""),
            2048.0
        );
        assert_eq!(metric_sum(text, "lanebus_claim_reserved_bytes", ""), 0.0);
    }
}
