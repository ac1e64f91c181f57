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
                    let src = identify_async(peer, listen, sources).await;
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
            let cut: Vec<AbortHandle> = s
                .conns
                .iter()
                .filter(|(c, _)| source.is_none() || c.as_deref() == source)
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

/// The inode of the socket `local` → `remote` in `/proc/net/tcp` text.
/// Only a socket that an fd holds has one: a TIME_WAIT entry of an earlier
/// connection on the same ports shows inode 0 and is skipped.
fn find_inode(table: &str, local: &str, remote: &str) -> Option<u64> {
    table.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() > 9 && f[1] == local && f[2] == remote)
            .then(|| f[9].parse().ok().filter(|i| *i != 0))
            .flatten()
    })
}

/// At most two identifications at once: under a reconnect storm (a cut
/// link refuses every connection, the node connects again at once) each
/// reads `/proc/net/tcp`, large on a busy machine; unbounded, they starved
/// the suite's own runtime (health checks, lane sampling) for minutes.
/// Waiting connections just wait, which slows the storm down.
static IDENTIFY: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// [`identify`] off the runtime's worker threads, two at a time.
pub(crate) async fn identify_async(
    peer: SocketAddr,
    listen: SocketAddr,
    sources: Sources,
) -> Option<String> {
    let _permit = IDENTIFY.acquire().await.ok()?;
    tokio::task::spawn_blocking(move || identify(peer, listen, &sources))
        .await
        .ok()
        .flatten()
}

/// Which source process holds the client end of an accepted connection.
pub(crate) fn identify(peer: SocketAddr, listen: SocketAddr, sources: &Sources) -> Option<String> {
    let pids: Vec<(u32, String)> = sources
        .lock()
        .expect("sources lock")
        .iter()
        .map(|(p, n)| (*p, n.clone()))
        .collect();
    if pids.is_empty() {
        return None;
    }
    // /proc/net/tcp is read in pages, not atomically: with sockets coming
    // and going an entry can be skipped, so look again before giving up.
    let (local, remote) = (proc_addr(peer)?, proc_addr(listen)?);
    let inode = (0..4).find_map(|_| {
        let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
        find_inode(&table, &local, &remote)
    })?;
    let needle = format!("socket:[{inode}]");
    for (pid, name) in pids {
        let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in dir.flatten() {
            if std::fs::read_link(fd.path()).is_ok_and(|t| t.to_string_lossy() == needle) {
                return Some(name);
            }
        }
    }
    None
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
            identify(c.local_addr().unwrap(), p.listen, &sources).as_deref(),
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
