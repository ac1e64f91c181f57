//! A TCP proxy for network faults, one in front of each destination (a
//! node's Raft address, the database). Each link (source node → this
//! destination) has a [`LinkMode`]; the source of a connection is found by
//! its socket's owner process (`/proc/net/tcp` inode → `/proc/PID/fd`), so
//! one listening port per destination serves per-link faults: partitions
//! (cut both ways) and asymmetric ones (cut one way) without network
//! namespaces.
//!
//! ```text
//! node 2 ──┐                      ┌─ mode(2→1) ─┐
//! node 3 ──┴─▶ proxy(node 1) ─────┤             ├─▶ node 1 raft_addr
//!                                 └─ mode(3→1) ─┘
//! ```
//!
//! Cutting closes the link's open connections and refuses new ones (they
//! are accepted and closed at once), which is what a sender sees of a
//! pulled cable once its retransmissions give up, only sooner.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

use crate::rng::Rng;

/// What a link does to its traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkMode {
    /// Forward as is.
    Pass,
    /// Forward each chunk after this many milliseconds.
    Delay(u64),
    /// Close the link's connections and refuse new ones.
    Cut,
    /// Reset a connection at a chunk with this probability (percent):
    /// lossy, flapping link.
    Flaky(u32),
}

/// Process ids of the sources, by name (the node id), shared with the
/// sandbox, which updates it when it restarts a node.
pub type Sources = Arc<Mutex<HashMap<u32, String>>>;

struct State {
    default: LinkMode,
    by_source: HashMap<String, LinkMode>,
    conns: Vec<(Option<String>, AbortHandle)>,
}

impl State {
    fn mode(&self, src: Option<&str>) -> LinkMode {
        src.and_then(|s| self.by_source.get(s))
            .copied()
            .unwrap_or(self.default)
    }
}

/// One proxy; cheap to clone.
#[derive(Clone)]
pub struct Proxy {
    /// Where it listens (give this address to the sources).
    pub listen: SocketAddr,
    state: Arc<Mutex<State>>,
    task: AbortHandle,
}

impl Proxy {
    /// Starts a proxy on `127.0.0.1:0` (or `listen` when given) to `target`.
    pub async fn start(
        target: SocketAddr,
        listen: Option<SocketAddr>,
        sources: Sources,
        seed: u64,
    ) -> anyhow::Result<Proxy> {
        let listener =
            TcpListener::bind(listen.unwrap_or_else(|| "127.0.0.1:0".parse().expect("addr")))
                .await?;
        let listen = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State {
            default: LinkMode::Pass,
            by_source: HashMap::new(),
            conns: Vec::new(),
        }));
        let st = state.clone();
        let task = tokio::spawn(async move {
            let mut n: u64 = 0;
            while let Ok((sock, peer)) = listener.accept().await {
                n += 1;
                let st = st.clone();
                let sources = sources.clone();
                let rng = Rng::derive(seed ^ n, "proxy");
                // Identifying reads /proc (blocking, and slow on a busy
                // machine): off the accept loop and off the runtime's
                // worker threads.
                tokio::spawn(async move {
                    // Only a proxy with a per-source mode (a partition or
                    // one-way cut under way) needs the source: identifying
                    // costs /proc reads, which a loaded machine makes slow,
                    // and a link waiting for them is a link down.
                    let per_source = !st.lock().expect("proxy lock").by_source.is_empty();
                    let src = if per_source {
                        identify_async(peer, listen, sources).await
                    } else {
                        None
                    };
                    let mode = st.lock().expect("proxy lock").mode(src.as_deref());
                    if mode == LinkMode::Cut {
                        drop(sock);
                        return;
                    }
                    let (st2, src2) = (st.clone(), src.clone());
                    let h = tokio::spawn(async move {
                        let _ = pipe(sock, target, st2, src2, rng).await;
                    });
                    let mut s = st.lock().expect("proxy lock");
                    s.conns.retain(|(_, h)| !h.is_finished());
                    s.conns.push((src, h.abort_handle()));
                });
            }
        })
        .abort_handle();
        Ok(Proxy {
            listen,
            state,
            task,
        })
    }

    /// Sets the mode of the link from `source` (`None`: every source without
    /// a mode of its own).
    pub fn set(&self, source: Option<&str>, mode: LinkMode) {
        let mut s = self.state.lock().expect("proxy lock");
        match source {
            Some(src) => {
                s.by_source.insert(src.to_string(), mode);
            }
            None => s.default = mode,
        }
        if mode == LinkMode::Cut {
            // A connection of unknown source (accepted while no link had a
            // mode of its own) may be the cut source's: it goes too, and
            // comes back identified.
            let cut: Vec<AbortHandle> = s
                .conns
                .iter()
                .filter(|(c, _)| source.is_none() || c.is_none() || c.as_deref() == source)
                .filter(|(c, _)| {
                    source.is_some() || c.as_deref().is_none_or(|c| !s.by_source.contains_key(c))
                })
                .map(|(_, h)| h.clone())
                .collect();
            for h in cut {
                h.abort();
            }
        }
    }

    /// Every link back to [`LinkMode::Pass`].
    pub fn heal(&self) {
        let mut s = self.state.lock().expect("proxy lock");
        s.default = LinkMode::Pass;
        s.by_source.clear();
    }

    /// Stops listening and drops every connection.
    pub fn stop(&self) {
        self.task.abort();
        for (_, h) in self.state.lock().expect("proxy lock").conns.drain(..) {
            h.abort();
        }
    }
}

async fn pipe(
    client: TcpStream,
    target: SocketAddr,
    st: Arc<Mutex<State>>,
    src: Option<String>,
    rng: Rng,
) -> anyhow::Result<()> {
    let server = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(target)).await??;
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let rng = Arc::new(Mutex::new(rng));
    let up = copy(cr, sw, st.clone(), src.clone(), rng.clone());
    let down = copy(sr, cw, st, src, rng);
    // Either direction ending ends both (a half-closed link is not a fault
    // we model).
    tokio::select! {
        r = up => r,
        r = down => r,
    }
}

async fn copy(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    st: Arc<Mutex<State>>,
    src: Option<String>,
    rng: Arc<Mutex<Rng>>,
) -> anyhow::Result<()> {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        let mode = st.lock().expect("proxy lock").mode(src.as_deref());
        match mode {
            LinkMode::Pass => {}
            LinkMode::Delay(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
            LinkMode::Cut => anyhow::bail!("cut"),
            LinkMode::Flaky(p) => {
                if rng.lock().expect("rng lock").percent(p) {
                    anyhow::bail!("dropped");
                }
            }
        }
        to.write_all(&buf[..n]).await?;
    }
}

/// The `/proc/net/tcp` form of an IPv4 address: `0100007F:1F90`.
fn proc_addr(a: SocketAddr) -> Option<String> {
    match a {
        SocketAddr::V4(v4) => Some(format!(
            "{:08X}:{:04X}",
            u32::from_le_bytes(v4.ip().octets()),
            v4.port()
        )),
        SocketAddr::V6(_) => None,
    }
}

/// Every socket of `/proc/net/tcp` text held by an fd: (local, remote) →
/// inode. Only a socket that an fd holds has one: a TIME_WAIT entry of an
/// earlier connection on the same ports shows inode 0 and is skipped.
fn inode_index(table: &str) -> HashMap<(String, String), u64> {
    let mut out = HashMap::new();
    for l in table.lines().skip(1) {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() > 9 {
            if let Some(i) = f[9].parse::<u64>().ok().filter(|i| *i != 0) {
                out.insert((f[1].to_string(), f[2].to_string()), i);
            }
        }
    }
    out
}

/// The inode of the socket `local` → `remote` in `/proc/net/tcp` text.
/// Only a socket that an fd holds has one: a TIME_WAIT entry of an earlier
/// connection on the same ports shows inode 0 and is skipped.
#[cfg(test)]
fn find_inode(table: &str, local: &str, remote: &str) -> Option<u64> {
    inode_index(table)
        .get(&(local.to_string(), remote.to_string()))
        .copied()
}

/// One connection waiting to be identified.
struct Pending {
    peer: SocketAddr,
    listen: SocketAddr,
    sources: Sources,
    answer: tokio::sync::oneshot::Sender<Option<String>>,
}

/// The identifying thread's queue. Identifying reads `/proc/net/tcp` (large
/// on a busy machine) and every source's fd table: one thread does it for
/// every connection waiting at that moment with one read of each, so a
/// reconnect storm (a cut link refuses every connection, the nodes connect
/// again at once) costs one pass per batch, not one per connection. Done
/// per connection, on the runtime or in a bounded pool, such storms starved
/// the suite's health checks for minutes, or queued connections behind
/// dead ones until no link worked.
static IDENTIFIER: std::sync::OnceLock<std::sync::mpsc::Sender<Pending>> =
    std::sync::OnceLock::new();

/// Which source process holds the client end of an accepted connection
/// (`None`: none of `sources`), found on the identifying thread.
pub(crate) async fn identify_async(
    peer: SocketAddr,
    listen: SocketAddr,
    sources: Sources,
) -> Option<String> {
    let queue = IDENTIFIER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Pending>();
        std::thread::spawn(move || {
            while let Ok(first) = rx.recv() {
                let mut batch = vec![first];
                batch.extend(rx.try_iter());
                identify_batch(batch);
            }
        });
        tx
    });
    let (answer, got) = tokio::sync::oneshot::channel();
    queue
        .send(Pending {
            peer,
            listen,
            sources,
            answer,
        })
        .ok()?;
    got.await.ok().flatten()
}

/// Answers a batch: `/proc/net/tcp` read until every entry is found (at
/// most 4 times: it is read in pages, not atomically), each source's fds
/// listed once.
fn identify_batch(batch: Vec<Pending>) {
    let mut inodes: Vec<Option<u64>> = vec![None; batch.len()];
    for _ in 0..4 {
        let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
            break;
        };
        // Parsed once per read (thousands of lines on a busy machine; a
        // scan per connection made a storm's batch take seconds).
        let index = inode_index(&table);
        for (p, slot) in batch.iter().zip(inodes.iter_mut()) {
            if slot.is_none() {
                if let (Some(l), Some(r)) = (proc_addr(p.peer), proc_addr(p.listen)) {
                    *slot = index.get(&(l, r)).copied();
                }
            }
        }
        if inodes.iter().all(Option::is_some) {
            break;
        }
    }
    let mut owner: HashMap<u64, String> = HashMap::new();
    let mut listed: std::collections::HashSet<u32> = std::collections::HashSet::new();
    for p in &batch {
        let pids: Vec<(u32, String)> = p
            .sources
            .lock()
            .expect("sources lock")
            .iter()
            .map(|(pid, n)| (*pid, n.clone()))
            .collect();
        for (pid, name) in pids {
            if !listed.insert(pid) {
                continue;
            }
            let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
                continue;
            };
            for fd in dir.flatten() {
                if let Ok(t) = std::fs::read_link(fd.path()) {
                    if let Some(i) = t
                        .to_string_lossy()
                        .strip_prefix("socket:[")
                        .and_then(|r| r.strip_suffix(']'))
                        .and_then(|r| r.parse().ok())
                    {
                        owner.insert(i, name.clone());
                    }
                }
            }
        }
    }
    for (p, inode) in batch.into_iter().zip(inodes) {
        let _ = p.answer.send(inode.and_then(|i| owner.get(&i).cloned()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_addresses_and_inodes_parse() {
        assert_eq!(
            proc_addr("127.0.0.1:8080".parse().unwrap()).as_deref(),
            Some("0100007F:1F90")
        );
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 4242 1 0 20 4 30 10 -1\n";
        assert_eq!(
            find_inode(table, "0100007F:1F90", "0100007F:D431"),
            Some(4242)
        );
        assert_eq!(find_inode(table, "0100007F:1F91", "0100007F:D431"), None);
        let with_time_wait = format!(
            "{}   1: 0100007F:1F90 0100007F:D431 06 00000000:00000000 03:00000000 00000000     0        0 0 1\n",
            table.lines().next().unwrap()
        ) + table.lines().nth(1).unwrap();
        assert_eq!(
            find_inode(&with_time_wait, "0100007F:1F90", "0100007F:D431"),
            Some(4242)
        );
    }

    #[tokio::test]
    async fn a_cut_link_refuses_and_a_healed_one_forwards_and_sources_are_found() {
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = echo.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 64];
                    while let Ok(n) = s.read(&mut b).await {
                        if n == 0 || s.write_all(&b[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let sources: Sources = Arc::default();
        sources
            .lock()
            .unwrap()
            .insert(std::process::id(), "me".into());
        let p = Proxy::start(target, None, sources.clone(), 1)
            .await
            .unwrap();
        let mut c = TcpStream::connect(p.listen).await.unwrap();
        c.write_all(b"hi").await.unwrap();
        let mut b = [0u8; 2];
        c.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"hi");
        assert_eq!(
            identify_async(c.local_addr().unwrap(), p.listen, sources.clone())
                .await
                .as_deref(),
            Some("me")
        );
        p.set(Some("me"), LinkMode::Cut);
        let mut b = [0u8; 2];
        let r = tokio::time::timeout(Duration::from_secs(2), async {
            let _ = c.write_all(b"hi").await;
            c.read(&mut b).await
        })
        .await
        .unwrap();
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
        p.heal();
        let mut c = TcpStream::connect(p.listen).await.unwrap();
        c.write_all(b"ok").await.unwrap();
        c.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"ok");
        p.stop();
    }
}
