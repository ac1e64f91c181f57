//! The orchestrator: builds base and candidate, starts the throwaway
//! PostgreSQL, runs every cell's samples interleaved (pair 0: base then
//! candidate; pair 1: candidate then base; ...), each as a child process of
//! its own build's binary, with a CPU spin timed before each sample; then
//! the peers; then writes `samples.jsonl`, `env.json` and `report.md`.
//!
//! # How a base runs a sample
//! The sample runner is the `sample` subcommand of `lanebus-bench` itself,
//! so the base must be a commit that has `bench/` (this harness, or later).
//! The base ref is checked out as a detached git worktree under
//! `bench/.work/src/base` and built there with `cargo build --release
//! --locked -p lanebus-bench`, into `<target>/sides/base` (each side has a
//! target directory of its own: see [`prepare_side`]); its binary is copied
//! to `bench/.work/bin/`. `--base-patch` / `--candidate-patch` apply a
//! patch to the checked-out tree before building (how the deliberate
//! regression of `bench/patches/` is measured). A ref that is the running
//! binary's own clean `HEAD` is not rebuilt: its binary is copied, unless a
//! file it is built from is newer than the binary ([`newer_source`]); then it
//! is built as any other ref. The side `.` (the tree as it is) is always
//! the running binary, which must then not be older than the tree.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::bail;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::cells::Cell;
use crate::peers::{self, PeerResult};
use crate::pg;
use crate::report;
use crate::sample::{SampleOut, SampleSpec};

/// Options of a run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Cells to run.
    pub cells: Vec<Cell>,
    /// Set name (`quick`, `full`).
    pub set: String,
    /// Base git ref.
    pub base: String,
    /// Patch applied to the base tree.
    pub base_patch: Option<PathBuf>,
    /// Candidate: `.` (this build) or a git ref.
    pub candidate: String,
    /// Patch applied to the candidate tree (then built from HEAD or the ref).
    pub candidate_patch: Option<PathBuf>,
    /// Pairs per cell of the quick set.
    pub pairs: usize,
    /// Pairs per cell outside the quick set.
    pub rest_pairs: usize,
    /// Start no further cell after this time (the peers still run).
    pub cells_until: Option<chrono::DateTime<chrono::Utc>>,
    /// Run the peers.
    pub peers: bool,
    /// Jobs per peer run.
    pub peer_jobs: usize,
    /// PostgreSQL port.
    pub port: u16,
    /// Output directory (default `bench/results/runs/<timestamp>`).
    pub out: Option<PathBuf>,
    /// Target dir for base builds.
    pub target_dir: Option<PathBuf>,
    /// Cargo profile of side builds (`release`; `dev` for a quick try).
    pub profile: String,
    /// SecantusDB server command for the MongoDB cells.
    pub mongo_cmd: Option<PathBuf>,
}

/// One measured side.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Side {
    /// `base` or `candidate`.
    pub label: String,
    /// Commit (with `+patch` / `+dirty` marks).
    pub rev: String,
    /// The binary that runs its samples.
    pub bin: PathBuf,
}

/// One line of `samples.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// Cell name.
    pub cell: String,
    /// `base` or `candidate`.
    pub side: String,
    /// Side's commit.
    pub rev: String,
    /// Pair number.
    pub pair: usize,
    /// 0: ran first in its pair.
    pub position: usize,
    /// CPU spin before the sample, ms.
    pub spin_ms: f64,
    /// Load average (1 min) before the sample.
    pub load1: f64,
    /// Start time (RFC 3339).
    pub started_at: String,
    /// The sample.
    pub out: SampleOut,
}

fn git(repo: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(args)
        .output()?;
    if !out.status.success() {
        bail!(
            "git {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

/// The workspace crates this binary is built from, and their folders whose
/// files go into it (sources, and files embedded with `include_str!`).
const BUILT_FROM: [&str; 7] = [
    "bench", "store", "node", "api", "cluster", "testkit", "types",
];
const BUILT_FOLDERS: [&str; 3] = ["src", "ui", "migrations"];

/// A tracked file of `repo` that goes into this binary ([`BUILT_FROM`],
/// [`BUILT_FOLDERS`]) modified after `built` (the running binary's build),
/// if any: that binary was built before the file changed, so it may not run
/// the tree's code (a commit made or checked out after the build). A file
/// that cargo does not build this binary from (a crate's tests, another
/// crate) does not count: a rebuild would not renew the binary. Errors: git
/// or a file's metadata.
fn newer_source(repo: &Path, built: std::time::SystemTime) -> anyhow::Result<Option<PathBuf>> {
    for file in git(repo, &["ls-files"])?.lines() {
        let mut parts = file.split('/');
        let (Some(krate), Some(folder)) = (parts.next(), parts.next()) else {
            continue;
        };
        if !BUILT_FROM.contains(&krate) || !BUILT_FOLDERS.contains(&folder) {
            continue;
        }
        let path = repo.join(file);
        // A file deleted from the tree, not yet from the index, is no source.
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        if meta.modified()? > built {
            return Ok(Some(path));
        }
    }
    Ok(None)
}

/// When the running binary was built (its file's modification time).
fn built_at() -> anyhow::Result<std::time::SystemTime> {
    Ok(std::fs::metadata(std::env::current_exe()?)?.modified()?)
}

/// The repository root of the current directory.
pub fn repo_root() -> anyhow::Result<PathBuf> {
    Ok(PathBuf::from(git(
        Path::new("."),
        &["rev-parse", "--show-toplevel"],
    )?))
}

/// The main worktree of the repository at `repo` (the parent of its common
/// git directory), when `repo` is another worktree of it.
pub fn main_worktree(repo: &Path) -> Option<PathBuf> {
    let common = git(
        repo,
        &["rev-parse", "--path-format=absolute", "--git-common-dir"],
    )
    .ok()?;
    let root = Path::new(&common).parent()?.to_owned();
    (root != repo).then_some(root)
}

/// A fixed CPU spin (xorshift, 40 million steps), milliseconds.
pub fn spin_ms() -> f64 {
    let t = Instant::now();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for _ in 0..40_000_000u32 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    std::hint::black_box(x);
    t.elapsed().as_secs_f64() * 1000.0
}

/// 1-minute load average.
pub fn load1() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(f64::NAN)
}

fn prepare_side(
    repo: &Path,
    work: &Path,
    label: &str,
    spec: &str,
    patch: Option<&Path>,
    target: &Path,
    profile: &str,
    own: &Path,
) -> anyhow::Result<Side> {
    let bin_dir = work.join("bin");
    std::fs::create_dir_all(&bin_dir)?;
    if spec == "." && patch.is_none() {
        if let Some(file) = newer_source(repo, built_at()?)? {
            bail!(
                "{} changed after this harness was built, so side `.` would not run the \
                 tree's code: rebuild it (cargo build --release -p lanebus-bench)",
                file.display()
            );
        }
        let head = git(repo, &["rev-parse", "--short=10", "HEAD"])?;
        let dirty = !git(repo, &["status", "--porcelain", "--untracked-files=no"])?.is_empty();
        let bin = bin_dir.join(format!("{label}-{head}"));
        std::fs::copy(own, &bin)?;
        return Ok(Side {
            label: label.into(),
            rev: format!("{head}{}", if dirty { "+dirty" } else { "" }),
            bin,
        });
    }
    let r = if spec == "." { "HEAD" } else { spec };
    let sha = git(
        repo,
        &["rev-parse", "--short=10", &format!("{r}^{{commit}}")],
    )?;
    // The ref is this binary's own clean HEAD: same code, same binary,
    // unless the binary was built before HEAD's files changed.
    let head = git(repo, &["rev-parse", "--short=10", "HEAD"])?;
    let clean = git(repo, &["status", "--porcelain", "--untracked-files=no"])?.is_empty();
    if patch.is_none() && sha == head && clean && newer_source(repo, built_at()?)?.is_none() {
        let bin = bin_dir.join(format!("{label}-{head}"));
        std::fs::copy(own, &bin)?;
        return Ok(Side {
            label: label.into(),
            rev: head,
            bin,
        });
    }
    let src = work.join("src").join(label);
    if src.join(".git").exists() {
        git(&src, &["checkout", "--quiet", "--detach", "--force", &sha])?;
        git(&src, &["clean", "-fdq", "-e", "target"])?;
    } else {
        let _ = git(repo, &["worktree", "prune"]);
        std::fs::create_dir_all(src.parent().unwrap_or(work))?;
        git(
            repo,
            &[
                "worktree",
                "add",
                "--detach",
                "--force",
                &src.to_string_lossy(),
                &sha,
            ],
        )?;
    }
    let mut rev = sha.clone();
    if let Some(p) = patch {
        let p = std::fs::canonicalize(p)?;
        git(&src, &["apply", &p.to_string_lossy()])?;
        rev = format!(
            "{sha}+{}",
            p.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        );
    }
    let log = work.join(format!("build-{label}.log"));
    // Each side builds into a target directory of its own: cargo decides
    // that a workspace crate is up to date by its sources' mtimes, and a
    // crate built last from another checkout (the repository, the other
    // side) is older than neither tree's untouched files, so a shared
    // directory handed one side the other side's code.
    let side_target = target.join("sides").join(label);
    let pb = ProgressBar::new_spinner();
    pb.set_message(format!("building {label} {rev} (log: {})", log.display()));
    pb.enable_steady_tick(Duration::from_millis(200));
    let status = Command::new("cargo")
        .args([
            "build",
            "--profile",
            profile,
            "--locked",
            "-p",
            "lanebus-bench",
        ])
        .current_dir(&src)
        .env("CARGO_TARGET_DIR", &side_target)
        .stdout(Stdio::from(std::fs::File::create(&log)?))
        .stderr(Stdio::from(
            std::fs::File::options().append(true).open(&log)?,
        ))
        .status()?;
    pb.finish_and_clear();
    if !status.success() {
        bail!("building {label} at {rev} failed; see {}", log.display());
    }
    let bin = bin_dir.join(format!("{label}-{}", rev.replace('+', "-")));
    let dir = if profile == "dev" { "debug" } else { profile };
    std::fs::copy(side_target.join(dir).join("lanebus-bench"), &bin)?;
    Ok(Side {
        label: label.into(),
        rev,
        bin,
    })
}

fn run_child(side: &Side, spec: &SampleSpec) -> anyhow::Result<SampleOut> {
    let out = Command::new(&side.bin)
        .arg("sample")
        .arg("--spec")
        .arg(serde_json::to_string(spec)?)
        .env("LANEBUS_WEBHOOK_ALLOW_CIDRS", "127.0.0.0/8,::1/128")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().rev().find_map(|l| l.strip_prefix("SAMPLE "));
    match line {
        Some(l) if out.status.success() => Ok(serde_json::from_str(l)?),
        _ => bail!(
            "sample of {} on {} failed ({}): {}",
            spec.cell.name,
            side.label,
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(15)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n")
        ),
    }
}

/// Machine and software fingerprint for env.json.
fn env_json(
    sides: &[Side],
    settings: &BTreeMap<String, String>,
    opts: &RunOptions,
    load_start: f64,
    started: &str,
) -> serde_json::Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let cpu = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("")
        .trim()
        .to_owned();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = read("/proc/meminfo")
        .lines()
        .next()
        .unwrap_or("")
        .to_owned();
    let kernel = read("/proc/sys/kernel/osrelease").trim().to_owned();
    let cmd = |c: &str, a: &[&str]| {
        Command::new(c)
            .args(a)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (&cpu, cores, &mem, &kernel).hash(&mut h);
    // Other processes on the machine while the run went (helpers building
    // and testing in parallel).
    let procs = cmd("sh", &["-c", "ps -eo pcpu,comm --sort=-pcpu | head -8"]);
    serde_json::json!({
        "fingerprint": format!("{:012x}", h.finish() & 0xffff_ffff_ffff),
        "started_at": started,
        "finished_at": chrono::Utc::now().to_rfc3339(),
        "cpu": cpu,
        "cores": cores,
        "memory": mem,
        "kernel": kernel,
        "load_average_start": load_start,
        "load_average_end": load1(),
        "busiest_processes_at_end": procs,
        "rustc": cmd("rustc", &["--version"]),
        "node": cmd("node", &["--version"]),
        "pgbench": cmd("pgbench", &["--version"]),
        "postgresql_settings": settings,
        "set": opts.set,
        "pairs": opts.pairs,
        "rest_pairs": opts.rest_pairs,
        "sides": sides,
    })
}

/// Runs everything; returns the output directory and whether the gate
/// passed. An invalid sample stops the run with an error after writing
/// what was measured.
pub async fn run(opts: RunOptions) -> anyhow::Result<(PathBuf, bool)> {
    let repo = repo_root()?;
    let work = repo.join("bench/.work");
    std::fs::create_dir_all(&work)?;
    let started = chrono::Utc::now();
    let stamp = started.format("%Y-%m-%dT%H-%M-%SZ").to_string();
    let out_dir = opts
        .out
        .clone()
        .unwrap_or_else(|| repo.join("bench/results/runs").join(&stamp));
    std::fs::create_dir_all(&out_dir)?;
    let target = opts
        .target_dir
        .clone()
        .unwrap_or_else(|| repo.join("target"));
    let load_start = load1();

    // This binary, copied before any side is built: a side built into the
    // target dir this binary runs from replaces it there.
    let own = work
        .join("bin")
        .join(format!("self-{}", std::process::id()));
    std::fs::create_dir_all(work.join("bin"))?;
    std::fs::copy(std::env::current_exe()?, &own)?;
    let base = prepare_side(
        &repo,
        &work,
        "base",
        &opts.base,
        opts.base_patch.as_deref(),
        &target,
        &opts.profile,
        &own,
    )?;
    let cand = prepare_side(
        &repo,
        &work,
        "candidate",
        &opts.candidate,
        opts.candidate_patch.as_deref(),
        &target,
        &opts.profile,
        &own,
    )?;
    let _ = std::fs::remove_file(&own);
    eprintln!(
        "base {} ({}), candidate {} ({})",
        base.rev,
        base.bin.display(),
        cand.rev,
        cand.bin.display()
    );
    let sides = [base, cand];

    let server =
        pg::Server::start(&repo, &work.join(format!("pg-{}", opts.port)), opts.port).await?;
    let result = run_cells(&opts, &sides, &server, &work, &out_dir).await;
    let peers = if opts.peers && result.is_ok() {
        match peers::run_all(&repo, &server, opts.peer_jobs).await {
            Ok(p) => p,
            Err(e) => {
                eprintln!("peers failed: {e:#}");
                vec![PeerResult::failed("peers", &format!("{e:#}"))]
            }
        }
    } else {
        Vec::new()
    };
    let settings = server.settings().await.unwrap_or_default();
    // The server's log (checkpoints, autovacuum, anything unexpected) goes
    // with the report.
    let _ = std::fs::copy(server.dir.join("log"), out_dir.join("postgres.log"));
    server.stop();
    let mut env = env_json(&sides, &settings, &opts, load_start, &started.to_rfc3339());
    let not_run: Vec<String> = match &result {
        Ok(records) => opts
            .cells
            .iter()
            .filter(|c| !records.iter().any(|r| r.cell == c.name))
            .map(|c| c.name.clone())
            .collect(),
        Err(_) => Vec::new(),
    };
    env["cells_not_run"] = serde_json::json!(not_run);
    env["cells_until"] = serde_json::json!(opts.cells_until.map(|t| t.to_rfc3339()));
    std::fs::write(
        out_dir.join("env.json"),
        serde_json::to_string_pretty(&env)?,
    )?;
    let (records, error) = match result {
        Ok(r) => (r, None),
        Err((r, e)) => (r, Some(e)),
    };
    let rep = report::build(
        &opts.cells,
        &sides,
        &records,
        &peers,
        &env,
        error.as_ref().map(|e| format!("{e:#}")),
    );
    let mut markdown = rep.markdown;
    if !not_run.is_empty() {
        let _ = writeln!(
            markdown,
            "\n## Cut\n\nNo cell was started after {} (`--cells-until`), to finish in the time there was; not run: {}.",
            opts.cells_until.map(|t| t.to_rfc3339()).unwrap_or_default(),
            not_run
                .iter()
                .map(|c| format!("`{c}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    std::fs::write(out_dir.join("report.md"), &markdown)?;
    std::fs::write(
        out_dir.join("peers.json"),
        serde_json::to_string_pretty(&peers)?,
    )?;
    if let Some(e) = error {
        return Err(e.context(format!(
            "run stopped; partial report in {}",
            out_dir.display()
        )));
    }
    Ok((out_dir, rep.gate_passed))
}

type CellsResult = Result<Vec<Record>, (Vec<Record>, anyhow::Error)>;

async fn run_cells(
    opts: &RunOptions,
    sides: &[Side; 2],
    server: &pg::Server,
    work: &Path,
    out_dir: &Path,
) -> CellsResult {
    let mut records = Vec::new();
    let quick: Vec<String> = crate::cells::quick().into_iter().map(|c| c.name).collect();
    let pairs_of = |c: &Cell| {
        if quick.contains(&c.name) {
            opts.pairs
        } else {
            opts.rest_pairs
        }
    };
    let total = opts.cells.iter().map(|c| pairs_of(c) * 2).sum::<usize>() as u64;
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template(
            "[{elapsed_precise}] {bar:30} {pos}/{len} samples, eta {eta} {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut jsonl = match std::fs::File::create(out_dir.join("samples.jsonl")) {
        Ok(f) => f,
        Err(e) => return Err((records, e.into())),
    };
    for cell in &opts.cells {
        if opts.cells_until.is_some_and(|t| chrono::Utc::now() > t) {
            pb.suspend(|| {
                eprintln!(
                    "--cells-until passed: {} and the cells after it are not run",
                    cell.name
                )
            });
            break;
        }
        for pair in 0..pairs_of(cell) {
            let order = if pair % 2 == 0 { [0, 1] } else { [1, 0] };
            for (position, &s) in order.iter().enumerate() {
                let side = &sides[s];
                pb.set_message(format!("{} pair {pair} {}", cell.name, side.label));
                let spec = SampleSpec {
                    cell: cell.clone(),
                    pg_url: server.url.clone(),
                    pg_dir: Some(server.dir.clone()),
                    work_dir: work.join("sqlite"),
                    mongo_cmd: opts.mongo_cmd.clone(),
                };
                let load = load1();
                let spin = spin_ms();
                let started_at = chrono::Utc::now().to_rfc3339();
                let side2 = side.clone();
                let out = tokio::task::spawn_blocking(move || run_child(&side2, &spec)).await;
                let out = match out {
                    Ok(Ok(o)) => o,
                    Ok(Err(e)) => return Err((records, e)),
                    Err(e) => return Err((records, e.into())),
                };
                let rec = Record {
                    cell: cell.name.clone(),
                    side: side.label.clone(),
                    rev: side.rev.clone(),
                    pair,
                    position,
                    spin_ms: spin,
                    load1: load,
                    started_at,
                    out,
                };
                if let Ok(line) = serde_json::to_string(&rec) {
                    let _ = writeln!(jsonl, "{line}");
                }
                pb.inc(1);
                pb.suspend(|| {
                    eprintln!(
                        "{:<28} pair {pair} {:<9} {:>10.0} {}/s  spin {:.0} ms{}",
                        cell.name,
                        side.label,
                        rec.out.rate,
                        cell.unit(),
                        spin,
                        if rec.out.problems.is_empty() {
                            String::new()
                        } else {
                            format!("  INVALID: {}", rec.out.problems.join("; "))
                        }
                    )
                });
                let problems = rec.out.problems.clone();
                records.push(rec);
                if !problems.is_empty() {
                    pb.abandon();
                    let e = anyhow::anyhow!(
                        "INVALID SAMPLE: {} on {} pair {pair}: {}",
                        cell.name,
                        side.label,
                        problems.join("; ")
                    );
                    return Err((records, e));
                }
            }
        }
    }
    pb.finish_and_clear();
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tracked_source_changed_after_the_build_is_found() {
        let dir = std::env::temp_dir().join(format!("lanebus-newer-source-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("store/src")).expect("dir");
        std::fs::create_dir_all(dir.join("store/tests")).expect("dir");
        std::fs::create_dir_all(dir.join("chaos/src")).expect("dir");
        git(&dir, &["init", "-q"]).expect("git init");
        let files = [
            "store/src/lib.rs",
            "store/tests/t.rs",
            "chaos/src/main.rs",
            "README.md",
        ];
        for f in files {
            std::fs::write(dir.join(f), "x").expect("write");
        }
        git(&dir, &["add", "."]).expect("git add");
        std::fs::write(dir.join("store/src/untracked.rs"), "x").expect("write");
        let built = std::time::SystemTime::now();
        let touch = |f: &str, t: std::time::SystemTime| {
            std::fs::File::options()
                .write(true)
                .open(dir.join(f))
                .and_then(|file| file.set_modified(t))
                .expect("set mtime");
        };
        let (before, after) = (
            built - Duration::from_secs(60),
            built + Duration::from_secs(60),
        );
        for f in files {
            touch(f, before);
        }
        touch("store/src/untracked.rs", after);
        assert_eq!(newer_source(&dir, built).expect("scan"), None);
        // Files the harness is not built from.
        for f in ["README.md", "store/tests/t.rs", "chaos/src/main.rs"] {
            touch(f, after);
        }
        assert_eq!(newer_source(&dir, built).expect("scan"), None);
        touch("store/src/lib.rs", after);
        assert_eq!(
            newer_source(&dir, built).expect("scan"),
            Some(dir.join("store/src/lib.rs"))
        );
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
