//! `lanebus node` configuration: one typed config, layered
//! defaults → TOML file (`--config`) → `LANEBUS_*` environment → flags,
//! validated at load with messages that name the value that was wrong.
//! Unknown keys in the file are an error.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Args;
use figment::providers::{Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

/// Flags of `lanebus node`. Every flag also reads `LANEBUS_<NAME>` and the
/// key `<name>` (snake case) of the `--config` file.
#[derive(Debug, Clone, Default, Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeArgs {
    /// TOML config file (keys as the flags in snake case; unknown keys are an error).
    #[arg(long, env = "LANEBUS_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Node id, a positive integer unique in the cluster.
    #[arg(long, env = "LANEBUS_ID")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<u64>,
    /// HTTP API address, IP:PORT [default: 127.0.0.1:8080].
    #[arg(long, env = "LANEBUS_HTTP_ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http_addr: Option<String>,
    /// Raft address, IP:PORT [default: 127.0.0.1:9080].
    #[arg(long, env = "LANEBUS_RAFT_ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raft_addr: Option<String>,
    /// Host name or IP the other nodes reach this one at, recorded in the
    /// cluster with the ports of http_addr and raft_addr (needed when those
    /// bind 0.0.0.0, as in a container) [default: the bound IPs].
    #[arg(long, env = "LANEBUS_ADVERTISE_ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise_addr: Option<String>,
    /// Directory for the node's files (created if missing).
    #[arg(long, env = "LANEBUS_DATA_DIR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_dir: Option<PathBuf>,
    /// Store URL: `postgres://...`, `mongodb://...` (a replica set) or `sqlite://PATH` [default: sqlite://DATA_DIR/lanebus.db].
    #[arg(long, env = "LANEBUS_STORE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
    /// Start a new cluster with this node (idempotent on restart).
    #[arg(long, env = "LANEBUS_BOOTSTRAP", conflicts_with = "join")]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bootstrap: bool,
    /// Join the cluster of the node at this URL, http://IP:PORT (asked
    /// until it answers; a restart from the data dir needs neither flag).
    #[arg(long, env = "LANEBUS_JOIN")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub join: Option<String>,
    /// Ceiling of the first retry delay, in milliseconds, 1 to 600000; also
    /// the shortest wait a `Retry-After` answer can ask for [default: 500].
    #[arg(long, env = "LANEBUS_RETRY_BASE_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_base_ms: Option<u64>,
    /// Largest delay between two retries, in milliseconds, at most
    /// 86400000 (24 h) [default: 600000].
    #[arg(long, env = "LANEBUS_RETRY_CAP_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_cap_ms: Option<u64>,
    /// Claim without wake-up at least this often, in milliseconds
    /// [default: 100 without store push, 1000 with].
    #[arg(long, env = "LANEBUS_POLL_INTERVAL_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub poll_interval_ms: Option<u64>,
    /// Most deliveries held per lane (queued + in flight), 1 to 100000
    /// [default: 256].
    #[arg(long, env = "LANEBUS_LANE_BUFFER")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lane_buffer: Option<usize>,
    /// Payload bytes all lanes of the node may hold in memory together, 1
    /// MiB to 64 GiB; lanes claim fewer deliveries when it is short, at
    /// least one each [default: 268435456 (256 MiB)].
    #[arg(long, env = "LANEBUS_BUFFER_BYTES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub buffer_bytes: Option<u64>,
    /// How long completed events are kept (for `POST
    /// /v1/handlers/{id}/recover`) before they are pruned, in seconds, 60 to
    /// 31536000 (365 days) [default: 86400 (24 h)].
    #[arg(long, env = "LANEBUS_RETENTION_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retention_secs: Option<u64>,
    /// Time between two retention pruning passes (run by the owner of lane
    /// 0), in milliseconds, 100 to 3600000 [default: 60000].
    #[arg(long, env = "LANEBUS_PRUNE_INTERVAL_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prune_interval_ms: Option<u64>,
    /// Longest wait of the store actor's completions, reschedules and dead
    /// letters before their batched write, in milliseconds (claims wait for
    /// no interval) [default: 2].
    #[arg(long, env = "LANEBUS_FLUSH_INTERVAL_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flush_interval_ms: Option<u64>,
    /// Run without a cluster: own every lane (fenced at a new epoch at each
    /// start; the last process started on a store wins).
    #[arg(long, env = "LANEBUS_SINGLE", conflicts_with_all = ["bootstrap", "join"])]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub single: bool,
    /// How long a committed lease renewal keeps this node's lanes, in
    /// milliseconds; must be at least the longest handler timeout plus
    /// the renewal interval plus 100 ms (an attempt starts only while the
    /// remaining lease covers its timeout plus 100 ms) [default: 15000].
    #[arg(long, env = "LANEBUS_LEASE_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
    /// How often the lease is renewed, in milliseconds; at most a third of
    /// the lease [default: 2000].
    #[arg(long, env = "LANEBUS_RENEW_INTERVAL_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub renew_interval_ms: Option<u64>,
    /// Extra wait of the leader past a dead node's lease before giving its
    /// lanes away, in milliseconds [default: 3000].
    #[arg(long, env = "LANEBUS_LEASE_MARGIN_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_margin_ms: Option<u64>,
    /// How many members are Raft voters (the first to join) [default: 3].
    #[arg(long, env = "LANEBUS_VOTERS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub voters: Option<usize>,
    /// Bound of the drain of a lane handed over, in milliseconds [default:
    /// the longest handler timeout + 500, at most lease - renew interval].
    #[arg(long, env = "LANEBUS_HANDOVER_DRAIN_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handover_drain_ms: Option<u64>,
    /// Local IP address webhook requests are sent from, such as 10.0.0.5
    /// (the address must be on one of this host's interfaces; pins the
    /// egress address a receiver's firewall sees) [default: chosen by the
    /// OS].
    #[arg(long, env = "LANEBUS_WEBHOOK_SOURCE_IP")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub webhook_source_ip: Option<String>,
    /// Disable a handler whose attempts failed without a single success
    /// for this long, in seconds, 1 to 31536000 (a year); its deliveries
    /// are kept until it is enabled [default: 432000 (5 days)].
    #[arg(long, env = "LANEBUS_AUTO_DISABLE_AFTER_S")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_disable_after_s: Option<u64>,
    /// CIDRs that handler URLs may point to although the SSRF guard refuses
    /// them otherwise (loopback, private, link-local, unique-local...),
    /// comma-separated, e.g. `127.0.0.0/8,::1/128` [default: none].
    #[arg(long, env = "LANEBUS_WEBHOOK_ALLOW_CIDRS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub webhook_allow_cidrs: Option<String>,
    /// User for NATS JetStream handlers (`nats://` URLs), with
    /// --nats-password [default: none].
    #[arg(long, env = "LANEBUS_NATS_USER")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nats_user: Option<String>,
    /// Password of --nats-user [default: none].
    #[arg(long, env = "LANEBUS_NATS_PASSWORD", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nats_password: Option<String>,
    /// Token for NATS JetStream handlers, instead of a user [default: none].
    #[arg(long, env = "LANEBUS_NATS_TOKEN", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nats_token: Option<String>,
    /// PEM file of CA certificates NATS servers' TLS certificates are
    /// checked against, besides the system's [default: none].
    #[arg(long, env = "LANEBUS_NATS_TLS_CA")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nats_tls_ca: Option<PathBuf>,
    /// Refuse NATS servers that do not offer TLS [default: false].
    #[arg(long, env = "LANEBUS_NATS_TLS_REQUIRED")]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub nats_tls_required: bool,
    /// NATS servers (`host:port`, as handler URLs name them) that get the
    /// NATS credentials, comma-separated; required with credentials, so a
    /// handler pointed at another server cannot collect them [default: none].
    #[arg(long, env = "LANEBUS_NATS_CREDENTIAL_SERVERS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nats_credential_servers: Option<String>,
    /// SASL mechanism for Kafka handlers (`kafka://` URLs): PLAIN,
    /// SCRAM-SHA-256 or SCRAM-SHA-512, with --kafka-sasl-username and
    /// --kafka-sasl-password [default: none].
    #[arg(long, env = "LANEBUS_KAFKA_SASL_MECHANISM")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kafka_sasl_mechanism: Option<String>,
    /// SASL user name for Kafka handlers [default: none].
    #[arg(long, env = "LANEBUS_KAFKA_SASL_USERNAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kafka_sasl_username: Option<String>,
    /// SASL password of --kafka-sasl-username [default: none].
    #[arg(long, env = "LANEBUS_KAFKA_SASL_PASSWORD", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kafka_sasl_password: Option<String>,
    /// Kafka bootstrap servers (`host:port`, as handler URLs name them)
    /// that Kafka handlers may produce to, comma-separated; they alone get
    /// the SASL credentials, which require them [default: any server the
    /// SSRF guard allows, without credentials].
    #[arg(long, env = "LANEBUS_KAFKA_SERVERS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kafka_servers: Option<String>,
    /// Connect to Kafka brokers over TLS [default: false].
    #[arg(long, env = "LANEBUS_KAFKA_TLS")]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub kafka_tls: bool,
    /// PEM file of CA certificates Kafka brokers' TLS certificates are
    /// checked against, instead of the system's; implies --kafka-tls
    /// [default: none].
    #[arg(long, env = "LANEBUS_KAFKA_TLS_CA")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kafka_tls_ca: Option<PathBuf>,
    /// API tokens with the `publish` scope (POST /v1/events), comma-separated;
    /// each the token in clear (16+ characters) or `sha256:` + the 64 hex
    /// digits of its SHA-256 hash [default: none].
    #[arg(long, env = "LANEBUS_PUBLISH_TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub publish_tokens: Option<String>,
    /// API tokens with the `admin` scope (every path; implies publish),
    /// comma-separated, in clear or `sha256:HEX`. Without any token the API
    /// must be bound to a loopback address [default: none].
    #[arg(long, env = "LANEBUS_ADMIN_TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_tokens: Option<String>,
    /// Secret every Raft connection between nodes proves (the same on every
    /// node); required unless the Raft address is loopback.
    #[arg(long, env = "LANEBUS_CLUSTER_SECRET", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster_secret: Option<String>,
    /// File holding the master key that wraps subjects' data keys
    /// (personal fields): 32 bytes as 64 hex digits or base64. The key
    /// itself may be given in LANEBUS_MASTER_KEY instead; never stored in
    /// the store [default: none, so types with personal fields cannot be
    /// published and their fields cannot be delivered].
    #[arg(long, env = "LANEBUS_MASTER_KEY_FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub master_key_file: Option<PathBuf>,
    /// Admin token sent with --join to the member asked [default: the first
    /// admin token given in clear].
    #[arg(long, env = "LANEBUS_JOIN_TOKEN", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub join_token: Option<String>,
}

/// The validated configuration of a node.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeConfig {
    pub id: u64,
    pub http_addr: SocketAddr,
    pub raft_addr: SocketAddr,
    pub advertise_addr: Option<String>,
    pub data_dir: PathBuf,
    pub store: String,
    pub bootstrap: bool,
    pub join: Option<String>,
    pub retry_base: Duration,
    pub retry_cap: Duration,
    pub poll_interval: Option<Duration>,
    pub lane_buffer: usize,
    pub buffer_bytes: usize,
    pub flush_interval: Duration,
    pub single: bool,
    pub lease: lanebus_cluster::LeaseConfig,
    pub voters: usize,
    pub handover_drain: Option<Duration>,
    pub webhook_source_ip: Option<std::net::IpAddr>,
    pub auto_disable_after: Duration,
    pub retention: Duration,
    pub prune_interval: Duration,
    pub webhook_allow: Vec<lanebus_api::egress::IpNet>,
    pub nats: lanebus_node::nats::NatsSettings,
    pub kafka: lanebus_node::kafka::KafkaSettings,
    pub auth: lanebus_api::auth::Auth,
    pub cluster_secret: Option<lanebus_cluster::ClusterSecret>,
    pub join_token: Option<String>,
    pub master_key: Option<std::sync::Arc<lanebus_store::personal::MasterKey>>,
}

/// Raft timing that fits the lease: elections must finish well within a
/// lease (less a renewal interval), or every leader change costs every node
/// its lanes. The defaults (heartbeat 250 ms, elections after 1 to 2 s) are
/// kept when they fit; shorter leases scale them down.
pub fn raft_timing(lease: &lanebus_cluster::LeaseConfig) -> lanebus_cluster::RaftTiming {
    let d = lanebus_cluster::RaftTiming::default();
    let room = lease.lease_ms.saturating_sub(lease.renew_interval_ms) / 2;
    let max = d.election_timeout_max_ms.min(room).max(40);
    let min = (max / 2).max(20);
    lanebus_cluster::RaftTiming {
        heartbeat_ms: d.heartbeat_ms.min(min / 3).max(10),
        election_timeout_min_ms: min,
        election_timeout_max_ms: max,
        ..d
    }
}

impl NodeConfig {
    pub fn node_options(&self) -> lanebus_node::NodeOptions {
        let mut o = lanebus_node::NodeOptions::new(
            self.id.to_string(),
            lanebus_node::StoreSource::Url(self.store.clone()),
        );
        o.http_addr = self.http_addr;
        o.lane.retry.base = self.retry_base;
        o.lane.retry.cap = self.retry_cap;
        o.lane.buffer_cap = self.lane_buffer;
        o.lane.buffer_bytes = self.buffer_bytes;
        o.poll_interval = self.poll_interval;
        o.store_actor.flush_interval = self.flush_interval;
        o.webhook_source_ip = self.webhook_source_ip;
        o.master_key.clone_from(&self.master_key);
        o.auto_disable_after = self.auto_disable_after;
        o.retention.retention = self.retention;
        o.retention.interval = self.prune_interval;
        o.egress = lanebus_api::egress::EgressPolicy::new(self.webhook_allow.clone());
        o.nats = self.nats.clone();
        o.kafka = self.kafka.clone();
        o.auth = self.auth.clone();
        if !self.single {
            let mut c = lanebus_node::node::ClusterOptions::new(
                self.id,
                self.raft_addr.to_string(),
                &self.data_dir,
            );
            c.lease = self.lease;
            c.voters = self.voters;
            c.raft = raft_timing(&self.lease);
            c.bootstrap = self.bootstrap;
            c.join = self.join.clone();
            c.handover_drain = self.handover_drain;
            c.secret = self.cluster_secret.clone();
            c.join_token = self.join_token.clone();
            c.advertise_host = self.advertise_addr.clone();
            o.cluster = Some(c);
        }
        o
    }
}

/// Merges the file under the flags and environment, then validates.
pub fn load(args: NodeArgs) -> anyhow::Result<NodeConfig> {
    let file = args.config.clone();
    validate(layered(&args, file.as_deref())?)
}

/// Layers a subcommand's flags (already merged with `LANEBUS_*` by clap)
/// over the TOML `file`: values set by flag or environment win, the file
/// fills the rest. `T` must skip unset fields when serialized and reject
/// unknown keys when deserialized.
///
/// # Errors
/// A missing file, bad TOML, an unknown key or a value of the wrong type,
/// naming the key.
pub fn layered<T: Serialize + serde::de::DeserializeOwned>(
    flags: &T,
    file: Option<&std::path::Path>,
) -> anyhow::Result<T> {
    let mut fig = Figment::new();
    if let Some(path) = file {
        if !path.is_file() {
            bail!("config file {} does not exist", path.display());
        }
        fig = fig.merge(Toml::file(path));
    }
    fig.merge(Serialized::defaults(flags))
        .extract()
        .map_err(config_error)
}

/// A figment error as a user reads it: `key: what is wrong (in FILE)`, one
/// per problem, without figment's profile name (`default.`) or the source
/// location of values that came from flags.
fn config_error(e: figment::Error) -> anyhow::Error {
    let problems: Vec<String> = e
        .into_iter()
        .map(|e| {
            let file = match e.metadata.as_ref().and_then(|m| m.source.as_ref()) {
                Some(figment::Source::File(p)) => format!(" (in {})", p.display()),
                _ => String::new(),
            };
            match e.path.join(".") {
                key if key.is_empty() => format!("{}{file}", e.kind),
                key => format!("{key}: {}{file}", e.kind),
            }
        })
        .collect();
    anyhow::anyhow!("config: {}", problems.join("; "))
}

fn addr(name: &str, value: Option<&str>, default: &str) -> anyhow::Result<SocketAddr> {
    let v = value.unwrap_or(default);
    v.parse()
        .with_context(|| format!("{name} {v:?} must be IP:PORT, such as 127.0.0.1:8080"))
}

/// Checks every value and fills defaults.
pub fn validate(a: NodeArgs) -> anyhow::Result<NodeConfig> {
    let id = match a.id {
        Some(0) => bail!("id must be a positive integer, got 0"),
        Some(id) => id,
        None => {
            bail!("missing node id: pass --id N, set LANEBUS_ID, or put `id` in the config file")
        }
    };
    let http_addr = addr("http_addr", a.http_addr.as_deref(), "127.0.0.1:8080")?;
    let raft_addr = addr("raft_addr", a.raft_addr.as_deref(), "127.0.0.1:9080")?;
    if http_addr == raft_addr && http_addr.port() != 0 {
        bail!("http_addr and raft_addr must differ, both are {http_addr}");
    }
    let advertise_addr = match a.advertise_addr.as_deref().map(str::trim) {
        None => None,
        Some("") => bail!(
            "advertise_addr is empty: give the host or IP the other nodes reach this one at, or leave it out"
        ),
        Some(h) => {
            lanebus_cluster::check_advertise_host(h).map_err(anyhow::Error::msg)?;
            Some(h.to_owned())
        }
    };
    let Some(data_dir) = a.data_dir else {
        bail!("missing data dir: pass --data-dir DIR, set LANEBUS_DATA_DIR, or put `data_dir` in the config file")
    };
    let store = match a.store {
        Some(s) => s,
        None => format!("sqlite://{}", data_dir.join("lanebus.db").display()),
    };
    if store.starts_with("mongodb+srv://") {
        bail!(
            "store {:?}: mongodb+srv:// needs a DNS SRV lookup that this build leaves out; \
             list the replica set members instead: mongodb://HOST1,HOST2/?replicaSet=NAME",
            redact(&store)
        );
    }
    if !(store.starts_with("postgres://")
        || store.starts_with("postgresql://")
        || store.starts_with("mongodb://")
        || store.starts_with("sqlite:"))
    {
        bail!(
            "store {:?} must start with postgres://, postgresql://, mongodb:// or sqlite://",
            redact(&store)
        );
    }
    let bootstrap = a.bootstrap;
    if bootstrap && a.join.is_some() {
        bail!("--bootstrap and --join exclude each other: a node either starts a cluster or joins one");
    }
    if let Some(j) = &a.join {
        let u = url::Url::parse(j)
            .with_context(|| format!("join {j:?} must be a URL such as http://127.0.0.1:8080"))?;
        if u.scheme() != "http" && u.scheme() != "https" || u.host().is_none() {
            bail!("join {j:?} must be an http:// or https:// URL with a host");
        }
    }
    let retry_base_ms = a.retry_base_ms.unwrap_or(500);
    if !(1..=600_000).contains(&retry_base_ms) {
        bail!("retry_base_ms must be 1 to 600000, got {retry_base_ms}");
    }
    let retry_cap_ms = a.retry_cap_ms.unwrap_or(600_000);
    if retry_cap_ms < retry_base_ms {
        bail!("retry_cap_ms ({retry_cap_ms}) must be at least retry_base_ms ({retry_base_ms})");
    }
    // Bounded so `now + delay` can never overflow (see retry::MAX_DELAY).
    if retry_cap_ms > 86_400_000 {
        bail!("retry_cap_ms must be at most 86400000 (24 h), got {retry_cap_ms}");
    }
    if let Some(p) = a.poll_interval_ms {
        if !(1..=60_000).contains(&p) {
            bail!("poll_interval_ms must be 1 to 60000, got {p}");
        }
    }
    let auto_disable_after_s = a
        .auto_disable_after_s
        .unwrap_or(lanebus_node::catalog::DEFAULT_AUTO_DISABLE_AFTER.as_secs());
    if !(1..=31_536_000).contains(&auto_disable_after_s) {
        bail!("auto_disable_after_s must be 1 to 31536000, got {auto_disable_after_s}");
    }
    let auto_disable_after = Duration::from_secs(auto_disable_after_s);
    let lane_buffer = a.lane_buffer.unwrap_or(256);
    if !(1..=100_000).contains(&lane_buffer) {
        bail!("lane_buffer must be 1 to 100000, got {lane_buffer}");
    }
    let buffer_bytes = a.buffer_bytes.unwrap_or(256 << 20);
    if !((1 << 20)..=(64 << 30)).contains(&buffer_bytes) {
        bail!("buffer_bytes must be 1048576 (1 MiB) to 68719476736 (64 GiB), got {buffer_bytes}");
    }
    let buffer_bytes = usize::try_from(buffer_bytes)
        .with_context(|| format!("buffer_bytes {buffer_bytes} does not fit this machine"))?;
    let retention_secs = a.retention_secs.unwrap_or(86_400);
    if !(60..=31_536_000).contains(&retention_secs) {
        bail!("retention_secs must be 60 to 31536000 (365 days), got {retention_secs}");
    }
    let prune_interval_ms = a.prune_interval_ms.unwrap_or(60_000);
    if !(100..=3_600_000).contains(&prune_interval_ms) {
        bail!("prune_interval_ms must be 100 to 3600000, got {prune_interval_ms}");
    }
    let flush_ms = a.flush_interval_ms.unwrap_or(2);
    if flush_ms > 1_000 {
        bail!("flush_interval_ms must be 0 to 1000, got {flush_ms}");
    }
    let lease = lanebus_cluster::LeaseConfig {
        lease_ms: a.lease_ms.unwrap_or(15_000),
        renew_interval_ms: a.renew_interval_ms.unwrap_or(2_000),
        margin_ms: a.lease_margin_ms.unwrap_or(3_000),
    };
    // The handler timeouts are checked at start, when the catalog is read.
    lease.validate(0).map_err(|e| anyhow::anyhow!("{e}"))?;
    let voters = a.voters.unwrap_or(3);
    if !(1..=9).contains(&voters) {
        bail!("voters must be 1 to 9, got {voters}");
    }
    if a.single && (a.bootstrap || a.join.is_some()) {
        bail!("--single runs without a cluster: it excludes --bootstrap and --join");
    }
    let webhook_source_ip = a
        .webhook_source_ip
        .as_deref()
        .map(|v| {
            v.parse::<std::net::IpAddr>().with_context(|| {
                format!("webhook_source_ip {v:?} must be an IP address such as 10.0.0.5")
            })
        })
        .transpose()?;
    let webhook_allow = match &a.webhook_allow_cidrs {
        Some(list) => lanebus_api::egress::EgressPolicy::parse_cidrs(list)
            .map_err(|e| anyhow::anyhow!("{e}"))?,
        None => Vec::new(),
    };
    if a.nats_user.is_some() != a.nats_password.is_some() {
        bail!("nats_user and nats_password go together: give both or neither");
    }
    if a.nats_token.is_some() && a.nats_user.is_some() {
        bail!("nats_token excludes nats_user and nats_password: give one way to authenticate");
    }
    let nats_credential_servers = servers("nats_credential_servers", &a.nats_credential_servers)?;
    let nats_credentials = a.nats_user.is_some() || a.nats_token.is_some();
    if nats_credentials == nats_credential_servers.is_empty() {
        bail!(
            "nats_credential_servers names the NATS servers (host:port) that get the NATS \
             credentials: give it with nats_user/nats_password or nats_token, and only then"
        );
    }
    readable("nats_tls_ca", a.nats_tls_ca.as_deref())?;
    let nats = lanebus_node::nats::NatsSettings {
        user: a.nats_user.clone(),
        password: a.nats_password.clone(),
        token: a.nats_token.clone(),
        credential_servers: nats_credential_servers,
        tls_ca: a.nats_tls_ca.clone(),
        tls_required: a.nats_tls_required,
    };
    let kafka_servers = servers("kafka_servers", &a.kafka_servers)?;
    match (
        &a.kafka_sasl_mechanism,
        &a.kafka_sasl_username,
        &a.kafka_sasl_password,
    ) {
        (None, None, None) => {}
        (Some(m), Some(_), Some(_)) => {
            if !lanebus_node::kafka::SASL_MECHANISMS.contains(&m.as_str()) {
                bail!(
                    "kafka_sasl_mechanism is {m:?}, expected one of {}",
                    lanebus_node::kafka::SASL_MECHANISMS.join(", ")
                );
            }
        }
        _ => bail!(
            "kafka_sasl_mechanism, kafka_sasl_username and kafka_sasl_password go together: \
             give all three or none"
        ),
    }
    if a.kafka_sasl_mechanism.is_some() && kafka_servers.is_empty() {
        bail!(
            "kafka_servers names the Kafka bootstrap servers (host:port) that handlers may use \
             and that get the SASL credentials: give it with kafka_sasl_mechanism"
        );
    }
    readable("kafka_tls_ca", a.kafka_tls_ca.as_deref())?;
    let kafka = lanebus_node::kafka::KafkaSettings {
        sasl_mechanism: a.kafka_sasl_mechanism.clone(),
        sasl_username: a.kafka_sasl_username.clone(),
        sasl_password: a.kafka_sasl_password.clone(),
        servers: kafka_servers,
        tls: a.kafka_tls || a.kafka_tls_ca.is_some(),
        tls_ca: a.kafka_tls_ca.clone(),
    };
    let (auth, first_clear_admin) = tokens(&a.publish_tokens, &a.admin_tokens)?;
    let cluster_secret = match a.cluster_secret.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(s) if s.len() < 16 => bail!(
            "cluster_secret must have at least 16 characters, it has {}",
            s.len()
        ),
        Some(s) => Some(lanebus_cluster::ClusterSecret(s.to_owned())),
    };
    let join_token = a
        .join_token
        .clone()
        .filter(|t| !t.trim().is_empty())
        .or(first_clear_admin);
    let master_key = master_key(
        a.master_key_file.as_deref(),
        std::env::var("LANEBUS_MASTER_KEY").ok().as_deref(),
    )?;
    Ok(NodeConfig {
        master_key,
        id,
        http_addr,
        raft_addr,
        advertise_addr,
        data_dir,
        store,
        bootstrap,
        join: a.join,
        retry_base: Duration::from_millis(retry_base_ms),
        retry_cap: Duration::from_millis(retry_cap_ms),
        poll_interval: a.poll_interval_ms.map(Duration::from_millis),
        lane_buffer,
        buffer_bytes,
        flush_interval: Duration::from_millis(flush_ms),
        single: a.single,
        lease,
        voters,
        handover_drain: a.handover_drain_ms.map(Duration::from_millis),
        webhook_source_ip,
        auto_disable_after,
        retention: Duration::from_secs(retention_secs),
        prune_interval: Duration::from_millis(prune_interval_ms),
        webhook_allow,
        nats,
        kafka,
        auth,
        cluster_secret,
        join_token,
    })
}

/// The API tokens of `publish_tokens` and `admin_tokens`, and the first
/// admin token given in clear (the default join token).
/// A comma-separated list of `host:port` servers (`field` names it in
/// errors); none for an absent or blank list.
fn servers(field: &str, list: &Option<String>) -> anyhow::Result<Vec<String>> {
    let Some(list) = list else {
        return Ok(Vec::new());
    };
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            let port = s.rsplit_once(':').map(|(h, p)| (h, p.parse::<u16>()));
            let host_ok = |h: &str| match h.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
                Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
                None => {
                    !h.is_empty()
                        && h.chars()
                            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
                }
            };
            match port {
                Some((h, Ok(p))) if host_ok(h) && p > 0 => Ok(s.to_owned()),
                _ => bail!("{field} holds {s:?}, expected host:port (an IPv6 host in brackets)"),
            }
        })
        .collect()
}

/// Refuses a file option (`field`) naming a file that cannot be read.
fn readable(field: &str, path: Option<&std::path::Path>) -> anyhow::Result<()> {
    if let Some(p) = path {
        std::fs::File::open(p)
            .with_context(|| format!("{field} names {}, which cannot be read", p.display()))?;
    }
    Ok(())
}

fn tokens(
    publish: &Option<String>,
    admin: &Option<String>,
) -> anyhow::Result<(lanebus_api::auth::Auth, Option<String>)> {
    use lanebus_api::auth::{Auth, Scope, HASH_PREFIX};
    let mut all = Vec::new();
    let mut first_clear_admin = None;
    for (scope, option, list) in [
        (Scope::Publish, "publish_tokens", publish),
        (Scope::Admin, "admin_tokens", admin),
    ] {
        let Some(list) = list else { continue };
        let hashes = Auth::parse_list(option, list).map_err(|e| anyhow::anyhow!("{e}"))?;
        all.extend(hashes.into_iter().map(|h| (scope, h)));
        if scope == Scope::Admin {
            first_clear_admin = list
                .split(',')
                .map(str::trim)
                .find(|t| !t.is_empty() && !t.starts_with(HASH_PREFIX))
                .map(str::to_owned);
        }
    }
    Ok((Auth::new(all), first_clear_admin))
}

/// The master key from `file` or, without one, from `env` (the value of
/// `LANEBUS_MASTER_KEY`); `None` when neither is given.
///
/// # Errors
/// Both given, an unreadable file, or a key that is not 32 bytes as hex or
/// base64 (the key is never repeated).
pub fn master_key(
    file: Option<&std::path::Path>,
    env: Option<&str>,
) -> anyhow::Result<Option<std::sync::Arc<lanebus_store::personal::MasterKey>>> {
    use lanebus_store::personal::MasterKey;
    let text = match (file, env.filter(|v| !v.trim().is_empty())) {
        (Some(_), Some(_)) => {
            bail!("give the master key in master_key_file or LANEBUS_MASTER_KEY, not both")
        }
        (Some(f), None) => std::fs::read_to_string(f)
            .with_context(|| format!("reading master_key_file {}", f.display()))?,
        (None, Some(v)) => v.to_owned(),
        (None, None) => return Ok(None),
    };
    let key = MasterKey::parse(&text).map_err(|e| anyhow::anyhow!("master key: {e}"))?;
    Ok(Some(std::sync::Arc::new(key)))
}

/// Creates the directory of a `sqlite://PATH` store if it is missing (SQLite
/// creates the file but not its directory); other URLs are left alone.
pub fn create_sqlite_dir(store: &str) -> anyhow::Result<()> {
    let Some(rest) = store.strip_prefix("sqlite:") else {
        return Ok(());
    };
    let path = rest.trim_start_matches("//");
    let path = path.split('?').next().unwrap_or(path);
    if path.is_empty() || path == ":memory:" {
        return Ok(());
    }
    if let Some(dir) = std::path::Path::new(path)
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
    {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create directory {}", dir.display()))?;
    }
    Ok(())
}

/// The URL with its password replaced by `***`, for logs and messages.
pub fn redact(store: &str) -> String {
    match url::Url::parse(store) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        _ => store.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> NodeArgs {
        NodeArgs {
            id: Some(1),
            data_dir: Some("/tmp/x".into()),
            ..NodeArgs::default()
        }
    }

    #[test]
    fn defaults_fill_in_and_store_defaults_to_the_data_dir() {
        let c = validate(base()).unwrap();
        assert_eq!(c.store, "sqlite:///tmp/x/lanebus.db");
        assert_eq!(c.http_addr, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(c.retry_base, Duration::from_millis(500));
        // The CLI defaults are the library's (LaneConfig) defaults.
        let lane = lanebus_node::actors::LaneConfig::default();
        assert_eq!(c.lane_buffer, 256);
        assert_eq!(c.lane_buffer, lane.buffer_cap);
        assert_eq!(c.buffer_bytes, 256 << 20);
        assert_eq!(c.buffer_bytes, lane.buffer_bytes);
        assert_eq!(c.node_options().lane.buffer_bytes, c.buffer_bytes);
    }

    #[test]
    fn nats_credentials_come_as_user_and_password_or_a_token() {
        let user = |u: Option<&str>, p: Option<&str>, t: Option<&str>| NodeArgs {
            nats_user: u.map(Into::into),
            nats_password: p.map(Into::into),
            nats_token: t.map(Into::into),
            nats_credential_servers: Some("nats.internal:4222, [::1]:4222".into()),
            ..base()
        };
        let c = validate(user(Some("lanebus"), Some("pw"), None)).unwrap();
        let n = c.node_options().nats;
        assert_eq!(
            (n.user.as_deref(), n.password.as_deref()),
            (Some("lanebus"), Some("pw"))
        );
        assert_eq!(n.credential_servers, ["nats.internal:4222", "[::1]:4222"]);
        assert_eq!(
            validate(user(None, None, Some("t")))
                .unwrap()
                .nats
                .token
                .as_deref(),
            Some("t")
        );
        for (args, says) in [
            (user(Some("lanebus"), None, None), "go together"),
            (user(None, Some("pw"), None), "go together"),
            (user(Some("u"), Some("p"), Some("t")), "excludes"),
            (
                NodeArgs {
                    nats_credential_servers: None,
                    ..user(Some("u"), Some("p"), None)
                },
                "nats_credential_servers names",
            ),
            (
                NodeArgs {
                    nats_credential_servers: Some("h:4222".into()),
                    ..base()
                },
                "and only then",
            ),
            (
                NodeArgs {
                    nats_credential_servers: Some("h".into()),
                    ..user(Some("u"), Some("p"), None)
                },
                "expected host:port",
            ),
            (
                NodeArgs {
                    nats_tls_ca: Some("/nonexistent/ca.pem".into()),
                    ..base()
                },
                "cannot be read",
            ),
        ] {
            let e = validate(args).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn kafka_credentials_come_whole_and_with_their_servers() {
        let sasl = |m: Option<&str>, u: Option<&str>, p: Option<&str>| NodeArgs {
            kafka_sasl_mechanism: m.map(Into::into),
            kafka_sasl_username: u.map(Into::into),
            kafka_sasl_password: p.map(Into::into),
            kafka_servers: Some("kafka.internal:9092".into()),
            ..base()
        };
        let k = validate(sasl(Some("SCRAM-SHA-512"), Some("u"), Some("p")))
            .unwrap()
            .node_options()
            .kafka;
        assert_eq!(
            (
                k.sasl_mechanism.as_deref(),
                k.sasl_username.as_deref(),
                k.sasl_password.as_deref(),
                k.servers.as_slice(),
                k.tls
            ),
            (
                Some("SCRAM-SHA-512"),
                Some("u"),
                Some("p"),
                &["kafka.internal:9092".to_owned()][..],
                false
            )
        );
        assert_eq!(validate(base()).unwrap().kafka, Default::default());
        for (args, says) in [
            (sasl(Some("PLAIN"), Some("u"), None), "go together"),
            (sasl(None, Some("u"), Some("p")), "go together"),
            (
                sasl(Some("GSSAPI"), Some("u"), Some("p")),
                "expected one of",
            ),
            (
                NodeArgs {
                    kafka_servers: None,
                    ..sasl(Some("PLAIN"), Some("u"), Some("p"))
                },
                "kafka_servers names",
            ),
            (
                NodeArgs {
                    kafka_servers: Some("kafka://h:9092".into()),
                    ..base()
                },
                "expected host:port",
            ),
            (
                NodeArgs {
                    kafka_servers: Some("::1:9092".into()),
                    ..base()
                },
                "expected host:port",
            ),
            (
                NodeArgs {
                    kafka_tls_ca: Some("/nonexistent/ca.pem".into()),
                    ..base()
                },
                "cannot be read",
            ),
        ] {
            let e = validate(args).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn master_key_comes_from_a_file_or_the_environment_not_both() {
        let dir = std::env::temp_dir().join(format!("lanebus-mk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("master.key");
        std::fs::write(&file, format!("{}\n", "ab".repeat(32))).unwrap();
        let from_file = master_key(Some(&file), None).unwrap().unwrap();
        let b64 = "q6urq6urq6urq6urq6urq6urq6urq6urq6urq6urq6s=";
        let from_env = master_key(None, Some(b64)).unwrap().unwrap();
        assert_eq!(
            from_file, from_env,
            "the same 32 bytes (0xab), hex and base64"
        );
        assert!(master_key(None, None).unwrap().is_none());
        let both = master_key(Some(&file), Some(b64)).unwrap_err().to_string();
        assert!(both.contains("not both"), "{both}");
        let short = master_key(None, Some("abcd")).unwrap_err().to_string();
        assert!(
            short.contains("32 bytes") && !short.contains("abcd"),
            "{short}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn webhook_source_ip_is_an_ip_address() {
        let c = validate(NodeArgs {
            webhook_source_ip: Some("127.0.0.3".into()),
            ..base()
        })
        .unwrap();
        assert_eq!(
            c.node_options().webhook_source_ip,
            Some([127, 0, 0, 3].into())
        );
        assert_eq!(validate(base()).unwrap().webhook_source_ip, None);
        let e = validate(NodeArgs {
            webhook_source_ip: Some("127.0.0.3:80".into()),
            ..base()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("webhook_source_ip"), "{e}");
    }

    #[test]
    fn bad_values_name_themselves() {
        let err = |a: NodeArgs| validate(a).unwrap_err().to_string();
        assert!(err(NodeArgs { id: None, ..base() }).contains("missing node id"));
        assert!(err(NodeArgs {
            http_addr: Some("localhost".into()),
            ..base()
        })
        .contains("\"localhost\""));
        assert!(err(NodeArgs {
            advertise_addr: Some(" ".into()),
            ..base()
        })
        .contains("advertise_addr is empty"));
        assert!(err(NodeArgs {
            advertise_addr: Some("lanebus-1:9080".into()),
            ..base()
        })
        .contains("advertise_addr \"lanebus-1:9080\" must be an IP or a DNS name"));
        assert_eq!(
            validate(NodeArgs {
                advertise_addr: Some(" lanebus-1.internal ".into()),
                ..base()
            })
            .unwrap()
            .advertise_addr
            .as_deref(),
            Some("lanebus-1.internal")
        );
        assert!(err(NodeArgs {
            store: Some("redis://x".into()),
            ..base()
        })
        .contains("redis://x"));
        assert!(err(NodeArgs {
            bootstrap: true,
            join: Some("http://1.2.3.4:1".into()),
            ..base()
        })
        .contains("exclude"));
        assert!(err(NodeArgs {
            join: Some("ftp://x".into()),
            ..base()
        })
        .contains("http://"));
        assert!(err(NodeArgs {
            store: Some("postgres://u:secret@h/db".into()),
            lane_buffer: Some(0),
            ..base()
        })
        .contains("lane_buffer"));
        for bad in [0, (1 << 20) - 1, (64 << 30) + 1] {
            assert!(err(NodeArgs {
                buffer_bytes: Some(bad),
                ..base()
            })
            .contains("buffer_bytes"));
        }
        assert!(err(NodeArgs {
            retry_cap_ms: Some(86_400_001),
            ..base()
        })
        .contains("retry_cap_ms must be at most 86400000"));
        assert!(err(NodeArgs {
            retry_base_ms: Some(600_001),
            ..base()
        })
        .contains("retry_base_ms"));
        assert!(validate(NodeArgs {
            retry_cap_ms: Some(86_400_000),
            ..base()
        })
        .is_ok());
        assert!(!redact("postgres://u:secret@h/db").contains("secret"));
    }

    #[test]
    fn lease_flags_are_checked_and_raft_timing_fits_the_lease() {
        let e = validate(NodeArgs {
            lease_ms: Some(1_000),
            renew_interval_ms: Some(500),
            ..base()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("renew_interval_ms 500"), "{e}");
        let c = validate(NodeArgs {
            lease_ms: Some(1_500),
            renew_interval_ms: Some(300),
            lease_margin_ms: Some(500),
            ..base()
        })
        .unwrap();
        let t = raft_timing(&c.lease);
        assert!(t.election_timeout_max_ms + 300 < 1_500, "{t:?}");
        assert!(t.heartbeat_ms < t.election_timeout_min_ms, "{t:?}");
        assert_eq!(
            raft_timing(&lanebus_cluster::LeaseConfig::default()),
            lanebus_cluster::RaftTiming::default()
        );
    }

    #[test]
    fn file_values_sit_under_flags_and_unknown_keys_fail() {
        let dir = std::env::temp_dir().join(format!("lanebus-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("node.toml");
        std::fs::write(
            &path,
            "id = 7\ndata_dir = \"/tmp/y\"\nhttp_addr = \"127.0.0.1:9999\"\n",
        )
        .unwrap();
        let c = load(NodeArgs {
            config: Some(path.clone()),
            http_addr: Some("127.0.0.1:7777".into()),
            ..NodeArgs::default()
        })
        .unwrap();
        assert_eq!((c.id, c.http_addr.port()), (7, 7777));
        assert_eq!(c.data_dir, PathBuf::from("/tmp/y"));
        std::fs::write(&path, "id = 7\ndata_dir = \"/tmp/y\"\nhttp_adr = \"x\"\n").unwrap();
        let e = load(NodeArgs {
            config: Some(path.clone()),
            ..NodeArgs::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("http_adr"), "{e}");
        // A wrong type names the key and the file, not figment's profile.
        std::fs::write(&path, "id = 7\nlease_ms = \"3s\"\n").unwrap();
        let e = load(NodeArgs {
            config: Some(path.clone()),
            ..NodeArgs::default()
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("config: lease_ms: invalid type")
                && e.contains(&format!("(in {})", path.display()))
                && !e.contains("default."),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
