//! The Raft transport: TCP with length-prefixed bincode frames.
//!
//! ```text
//! frame = u32 big-endian length ‖ bincode(RpcRequest | RpcResponse)
//!
//! node A                                     node B (raft_addr)
//! Transport ── one connection per (peer, channel), reused ──▶ RPC server
//!   channel Raft:  AppendEntries, Vote, InstallSnapshot       └▶ Raft
//!   channel Write: ClientWrite(Command)  (forwarded writes)   └▶ Raft::client_write
//! ```
//!
//! One request is in flight per connection (a mutex around it), so answers
//! need no ids. Forwarded writes use their own connection so that a write
//! waiting for its commit does not hold up heartbeats or votes. Connecting has
//! its own timeout ([`CONNECT_TIMEOUT`]); every request has one too (openraft's
//! `RPCOption::hard_ttl` for Raft RPCs). After any error, or when the caller
//! drops a request half-way (openraft times RPCs out itself), the connection is
//! dropped and the next request connects again; a request on a reused
//! connection that finds it dead is retried once on a fresh one.
//!
//! [`NetSwitch`] is the fault-injection hook: when cut, this node neither
//! sends nor answers anything, as if its network cable were pulled.
//!
//! # The cluster secret
//!
//! Every connection starts with a challenge: the server sends 32 random
//! bytes (`nonce`), the client answers HMAC-SHA256(secret, `lanebus-raft-1`
//! ‖ nonce), the server answers `ok` or a refusal and closes. A peer without
//! the secret (or with another) never gets a request through; the server logs
//! it (at most every [`REFUSAL_LOG_INTERVAL`] per address) and goes on
//! serving. The secret never crosses the wire, and an answer seen once is
//! worth nothing for the next nonce. Without a configured secret the key is
//! empty (allowed only on a loopback Raft address, see
//! `ClusterConfig::secret`). The handshake authenticates peers; it does not
//! encrypt the frames that follow.
//!
//! ```text
//! client                         server
//!   ◀── frame(nonce, 32 bytes) ──
//!   ─── frame(hmac ‖ target id, 32 + 8 bytes) ──▶  hmac checked in constant
//!                                  time, then target id = the server's id
//!   ◀── frame("ok") ─────────────  or frame("refused: ...") and close
//! ```
//!
//! The target id (big-endian u64) is the node the client means to reach.
//! A server that is another node refuses: an address recorded for one node
//! that reaches another (the same host under another name or IP, a node
//! bound to 0.0.0.0 reached through any of its addresses, an address moved
//! to another node) never carries a Raft message to the wrong node. Without
//! this, a learner recorded at the leader's own address made the leader
//! replicate to itself, which openraft treats as a second leader of its term
//! and panics on (`assertion failed: self.leader.is_none()`).

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::state::{Command, CommandResult};
use crate::storage::{decode, encode};
use crate::{NodeId, Raft, TypeConfig};

/// How long connecting to a peer may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Largest frame accepted (a snapshot chunk is the largest message).
pub const MAX_FRAME_BYTES: u32 = 64 << 20;
/// An idle incoming connection is closed after this long.
const IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the server waits for a client's answer to its challenge.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// A refused peer address is logged at most this often.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);
/// Largest handshake frame accepted (before a peer is authenticated, no
/// large buffer is allocated for it).
const MAX_HANDSHAKE_BYTES: u32 = 256;
/// Domain of the handshake's HMAC.
const HANDSHAKE_LABEL: &[u8] = b"lanebus-raft-1";
/// The server's answer to a good proof.
const HANDSHAKE_OK: &[u8] = b"ok";

/// The key of the handshake: the cluster secret's bytes (empty without one).
pub(crate) type Secret = Arc<[u8]>;

/// The cluster secret (`cluster_secret`, `LANEBUS_CLUSTER_SECRET`): a
/// string every node of the cluster is given. Its `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(pub String);

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(***)")
    }
}

fn proof(secret: &[u8], nonce: &[u8]) -> [u8; 32] {
    use hmac::Mac as _;
    let mut mac =
        hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).expect("hmac takes any key length");
    mac.update(HANDSHAKE_LABEL);
    mac.update(nonce);
    mac.finalize().into_bytes().into()
}

async fn read_small_frame(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len);
    if len > MAX_HANDSHAKE_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("handshake frame of {len} bytes (not a lanebus raft peer of this version?)"),
        ));
    }
    let mut buf = vec![0u8; len as usize];
    stream.read_exact(&mut buf).await?;
    Ok(buf)
}

/// The server's side of the handshake (module docs): `Ok(())` when the
/// client proved the secret; otherwise the refusal was sent (if possible)
/// and the error says why.
pub(crate) async fn accept_handshake(
    stream: &mut TcpStream,
    secret: &[u8],
    me: NodeId,
) -> io::Result<()> {
    use subtle::ConstantTimeEq as _;
    let nonce: [u8; 32] = rand::random();
    write_frame(stream, &nonce).await?;
    let answer = tokio::time::timeout(HANDSHAKE_TIMEOUT, read_small_frame(stream))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no answer to the challenge"))??;
    if answer.len() == 32 {
        // The answer of builds before the target id (a rolling upgrade
        // across that change: restart every node on the new build).
        let why = "the peer runs an older lanebus (its handshake names no target node): run \
                   the same version on every node";
        let _ = write_frame(stream, format!("refused: {why}").as_bytes()).await;
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, why));
    }
    let good = answer.len() == 40 && bool::from(proof(secret, &nonce).ct_eq(&answer[..32]));
    if !good {
        let _ = write_frame(
            stream,
            b"refused: the cluster secret differs (cluster_secret, LANEBUS_CLUSTER_SECRET)",
        )
        .await;
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "the peer did not prove the cluster secret (cluster_secret / LANEBUS_CLUSTER_SECRET missing or different)",
        ));
    }
    let target = NodeId::from_be_bytes(answer[32..].try_into().expect("8 bytes"));
    if target != me {
        let why = format!(
            "this is node {me}, not node {target}: the address recorded for node {target} \
             reaches node {me}"
        );
        let _ = write_frame(stream, format!("refused: {why}").as_bytes()).await;
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, why));
    }
    write_frame(stream, HANDSHAKE_OK).await
}

/// The client's side of the handshake (module docs), to reach node
/// `target`.
pub(crate) async fn connect_handshake(
    stream: &mut TcpStream,
    secret: &[u8],
    target: NodeId,
) -> io::Result<()> {
    let nonce = read_small_frame(stream).await?;
    let mut answer = proof(secret, &nonce).to_vec();
    answer.extend_from_slice(&target.to_be_bytes());
    write_frame(stream, &answer).await?;
    let answer = read_small_frame(stream).await?;
    if answer != HANDSHAKE_OK {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            String::from_utf8_lossy(&answer).into_owned(),
        ));
    }
    Ok(())
}

/// A request on the wire.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum RpcRequest {
    AppendEntries(AppendEntriesRequest<TypeConfig>),
    Vote(VoteRequest<NodeId>),
    InstallSnapshot(InstallSnapshotRequest<TypeConfig>),
    /// A write forwarded by a node that is not the leader.
    ClientWrite(Command),
}

/// An answer on the wire. Remote Raft errors travel as text: they are all
/// fatal conditions of the remote node that the caller can only log.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum RpcResponse {
    AppendEntries(Result<AppendEntriesResponse<NodeId>, String>),
    Vote(Result<VoteResponse<NodeId>, String>),
    InstallSnapshot(Result<InstallSnapshotResponse<NodeId>, String>),
    ClientWrite(Result<CommandResult, WriteRejected>),
}

/// Why a forwarded write was not carried out by the node it was sent to.
#[derive(Debug, Clone, Serialize, Deserialize, thiserror::Error)]
pub enum WriteRejected {
    /// The receiver is not the leader (any more); `leader` is who it thinks
    /// leads now.
    #[error("node is not the leader (leader: {leader:?})")]
    ForwardToLeader {
        /// The leader as the receiver knows it.
        leader: Option<NodeId>,
    },
    /// Raft failed on the receiver (shutting down, storage fault).
    #[error("write failed on the leader: {0}")]
    Failed(String),
}

/// Fault injection: cuts this node off the network (both directions) while
/// set. Cheap to clone; all clones share the switch.
#[derive(Debug, Clone, Default)]
pub struct NetSwitch(Arc<AtomicBool>);

impl NetSwitch {
    /// Cuts (`true`) or restores (`false`) the network.
    pub fn set_cut(&self, cut: bool) {
        self.0.store(cut, Ordering::SeqCst);
    }

    /// Whether the network is cut.
    pub fn is_cut(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Which of the two connections to a peer a request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Channel {
    Raft,
    Write,
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    /// Could not connect (or the network is cut): the peer is unreachable.
    #[error("peer {addr} unreachable: {source}")]
    Unreachable { addr: String, source: io::Error },
    /// The connection failed or timed out during the request.
    #[error("rpc to {addr} failed: {source}")]
    Network { addr: String, source: io::Error },
}

type Slot = Arc<tokio::sync::Mutex<Option<TcpStream>>>;

/// Outgoing side: a pool of connections, one per (peer address, channel).
#[derive(Debug)]
pub(crate) struct Transport {
    pool: Mutex<HashMap<(NodeId, String, Channel), Slot>>,
    switch: NetSwitch,
    secret: Secret,
}

async fn write_frame(stream: &mut TcpStream, bytes: &[u8]) -> io::Result<()> {
    let len = u32::try_from(bytes.len())
        .ok()
        .filter(|&l| l <= MAX_FRAME_BYTES)
        .ok_or_else(|| io::Error::other(format!("frame of {} bytes is too large", bytes.len())))?;
    stream.write_all(&len.to_be_bytes()).await?;
    stream.write_all(bytes).await?;
    stream.flush().await
}

async fn read_frame(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len);
    if len > MAX_FRAME_BYTES {
        return Err(io::Error::other(format!(
            "frame of {len} bytes is too large"
        )));
    }
    let mut buf = vec![0u8; len as usize];
    stream.read_exact(&mut buf).await?;
    Ok(buf)
}

impl Transport {
    pub(crate) fn new(switch: NetSwitch, secret: Secret) -> Self {
        Transport {
            pool: Mutex::default(),
            switch,
            secret,
        }
    }

    fn slot(&self, target: NodeId, addr: &str, channel: Channel) -> Slot {
        let mut pool = self
            .pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        pool.entry((target, addr.to_owned(), channel))
            .or_default()
            .clone()
    }

    /// Connects to `addr` and runs the handshake as for node `target`,
    /// within `timeout`: `Ok` when node `target` answers there with the
    /// cluster secret; otherwise why not (unreachable, another node, the
    /// secret differs). Nothing is pooled.
    pub(crate) async fn probe(
        &self,
        target: NodeId,
        addr: &str,
        timeout: Duration,
    ) -> io::Result<()> {
        if self.switch.is_cut() {
            return Err(io::Error::other("network cut by the test hook"));
        }
        let secret = self.secret.clone();
        tokio::time::timeout(timeout, async move {
            let mut stream = TcpStream::connect(addr).await?;
            connect_handshake(&mut stream, &secret, target).await
        })
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no answer in time"))?
    }

    /// Sends `req` to node `target` at `addr` and waits for the answer, at
    /// most `timeout`. A server at `addr` that is not `target` refuses the
    /// connection (module docs): [`CallError::Unreachable`].
    pub(crate) async fn call(
        &self,
        target: NodeId,
        addr: &str,
        channel: Channel,
        req: &RpcRequest,
        timeout: Duration,
    ) -> Result<RpcResponse, CallError> {
        let bytes = encode(req).map_err(|e| CallError::Network {
            addr: addr.to_owned(),
            source: io::Error::other(e),
        })?;
        let slot = self.slot(target, addr, channel);
        let mut conn = slot.lock().await;
        for attempt in 0..2 {
            if self.switch.is_cut() {
                return Err(CallError::Unreachable {
                    addr: addr.to_owned(),
                    source: io::Error::other("network cut by the test hook"),
                });
            }
            // The stream is taken out of the pool for the request and put
            // back only after its answer was read: if the caller drops this
            // future half-way (openraft wraps RPCs in its own timeout), the
            // stream goes with it instead of staying pooled with an answer
            // still unread, which the next request would take for its own.
            let reused = conn.is_some();
            let mut stream = match conn.take() {
                Some(s) => s,
                None => {
                    let secret = self.secret.clone();
                    tokio::time::timeout(CONNECT_TIMEOUT + timeout, async move {
                        let mut stream = TcpStream::connect(addr).await?;
                        // Small frames must not wait for Nagle's algorithm.
                        let _ = stream.set_nodelay(true);
                        connect_handshake(&mut stream, &secret, target).await?;
                        Ok::<_, io::Error>(stream)
                    })
                    .await
                    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))
                    .and_then(|r| r)
                    .map_err(|source| {
                        if source.kind() == io::ErrorKind::PermissionDenied {
                            tracing::debug!(addr, error = %source, "raft peer refused this node");
                        }
                        CallError::Unreachable {
                            addr: addr.to_owned(),
                            source,
                        }
                    })?
                }
            };
            let result = tokio::time::timeout(timeout, async {
                write_frame(&mut stream, &bytes).await?;
                read_frame(&mut stream).await
            })
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "request timed out"))
            .and_then(|r| r);
            match result {
                Ok(answer) => {
                    let decoded = decode(&answer).map_err(|e| CallError::Network {
                        addr: addr.to_owned(),
                        source: io::Error::other(e),
                    });
                    if decoded.is_ok() {
                        *conn = Some(stream);
                    }
                    return decoded;
                }
                Err(source) => {
                    // A pooled connection the peer closed (it restarted):
                    // one fresh try. A timeout is not retried.
                    if reused && attempt == 0 && source.kind() != io::ErrorKind::TimedOut {
                        tracing::debug!(addr, error = %source, "stale raft connection, reconnecting");
                        continue;
                    }
                    return Err(CallError::Network {
                        addr: addr.to_owned(),
                        source,
                    });
                }
            }
        }
        Err(CallError::Network {
            addr: addr.to_owned(),
            source: io::Error::other("no connection"),
        })
    }
}

/// openraft's network factory: hands out [`PeerClient`]s sharing the pool.
#[derive(Debug, Clone)]
pub(crate) struct NetworkFactory {
    pub transport: Arc<Transport>,
}

impl RaftNetworkFactory<TypeConfig> for NetworkFactory {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> PeerClient {
        PeerClient {
            transport: self.transport.clone(),
            target,
            addr: node.addr.clone(),
        }
    }
}

/// The client openraft uses to reach one peer.
#[derive(Debug)]
pub(crate) struct PeerClient {
    transport: Arc<Transport>,
    target: NodeId,
    addr: String,
}

fn rpc_error<E: std::error::Error>(e: CallError) -> RPCError<NodeId, BasicNode, E> {
    match e {
        CallError::Unreachable { source, .. } => RPCError::Unreachable(Unreachable::new(&source)),
        CallError::Network { source, .. } => RPCError::Network(NetworkError::new(&source)),
    }
}

fn remote_error<E: std::error::Error>(
    target: NodeId,
    msg: String,
) -> RPCError<NodeId, BasicNode, E> {
    RPCError::Network(NetworkError::new(&io::Error::other(format!(
        "node {target} answered with an error: {msg}"
    ))))
}

fn unexpected<E: std::error::Error>(target: NodeId) -> RPCError<NodeId, BasicNode, E> {
    RPCError::Network(NetworkError::new(&io::Error::other(format!(
        "node {target} answered with the wrong message kind"
    ))))
}

impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        let req = RpcRequest::AppendEntries(rpc);
        match self
            .transport
            .call(
                self.target,
                &self.addr,
                Channel::Raft,
                &req,
                option.hard_ttl(),
            )
            .await
            .map_err(rpc_error)?
        {
            RpcResponse::AppendEntries(r) => r.map_err(|m| remote_error(self.target, m)),
            _ => Err(unexpected(self.target)),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        let req = RpcRequest::InstallSnapshot(rpc);
        match self
            .transport
            .call(
                self.target,
                &self.addr,
                Channel::Raft,
                &req,
                option.hard_ttl(),
            )
            .await
            .map_err(rpc_error)?
        {
            RpcResponse::InstallSnapshot(r) => r.map_err(|m| remote_error(self.target, m)),
            _ => Err(unexpected(self.target)),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        let req = RpcRequest::Vote(rpc);
        match self
            .transport
            .call(
                self.target,
                &self.addr,
                Channel::Raft,
                &req,
                option.hard_ttl(),
            )
            .await
            .map_err(rpc_error)?
        {
            RpcResponse::Vote(r) => r.map_err(|m| remote_error(self.target, m)),
            _ => Err(unexpected(self.target)),
        }
    }
}

/// Runs the RPC server on `listener` until the task is aborted (which also
/// aborts every connection it serves).
pub(crate) async fn serve(
    listener: TcpListener,
    raft: Raft,
    switch: NetSwitch,
    secret: Secret,
    me: NodeId,
) {
    let mut conns = JoinSet::new();
    let refusals: Refusals = Arc::default();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if switch.is_cut() {
                        drop(stream);
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    conns.spawn(serve_conn(
                        stream,
                        raft.clone(),
                        switch.clone(),
                        secret.clone(),
                        refusals.clone(),
                        peer,
                        me,
                    ));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "raft rpc accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// When each refused peer address was last logged.
type Refusals = Arc<Mutex<HashMap<std::net::IpAddr, std::time::Instant>>>;

async fn serve_conn(
    mut stream: TcpStream,
    raft: Raft,
    switch: NetSwitch,
    secret: Secret,
    refusals: Refusals,
    peer_addr: std::net::SocketAddr,
    me: NodeId,
) {
    let peer = peer_addr.to_string();
    if let Err(e) = accept_handshake(&mut stream, &secret, me).await {
        if e.kind() == io::ErrorKind::PermissionDenied || e.kind() == io::ErrorKind::InvalidData {
            let now = std::time::Instant::now();
            let mut seen = refusals
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let due = seen
                .get(&peer_addr.ip())
                .is_none_or(|t| now.duration_since(*t) >= REFUSAL_LOG_INTERVAL);
            if due {
                seen.insert(peer_addr.ip(), now);
                tracing::warn!(peer, error = %e, "raft peer refused");
            }
        } else {
            tracing::debug!(peer, error = %e, "raft handshake failed");
        }
        return;
    }
    loop {
        let frame = match tokio::time::timeout(IDLE_TIMEOUT, read_frame(&mut stream)).await {
            Ok(Ok(f)) => f,
            Ok(Err(e)) => {
                if e.kind() != io::ErrorKind::UnexpectedEof {
                    tracing::debug!(peer, error = %e, "raft rpc connection closed");
                }
                return;
            }
            Err(_) => return,
        };
        if switch.is_cut() {
            return;
        }
        let req: RpcRequest = match decode(&frame) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(peer, error = %e, "undecodable raft rpc frame; closing connection");
                return;
            }
        };
        let resp = handle(&raft, req).await;
        if switch.is_cut() {
            return;
        }
        let bytes = match encode(&resp) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(peer, error = %e, "could not encode raft rpc answer");
                return;
            }
        };
        if let Err(e) = write_frame(&mut stream, &bytes).await {
            tracing::debug!(peer, error = %e, "raft rpc answer not sent");
            return;
        }
    }
}

async fn handle(raft: &Raft, req: RpcRequest) -> RpcResponse {
    match req {
        RpcRequest::AppendEntries(r) => {
            RpcResponse::AppendEntries(raft.append_entries(r).await.map_err(|e| e.to_string()))
        }
        RpcRequest::Vote(r) => RpcResponse::Vote(raft.vote(r).await.map_err(|e| e.to_string())),
        RpcRequest::InstallSnapshot(r) => {
            RpcResponse::InstallSnapshot(raft.install_snapshot(r).await.map_err(|e| e.to_string()))
        }
        RpcRequest::ClientWrite(cmd) => {
            RpcResponse::ClientWrite(crate::cluster::local_write(raft, cmd).await.map(|r| r.data))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_oversized_frames_are_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let got = read_frame(&mut s).await.expect("frame");
            write_frame(&mut s, &got).await.expect("echo");
            // A length prefix above the limit is refused before reading.
            let too_big = (MAX_FRAME_BYTES + 1).to_be_bytes();
            s.write_all(&too_big).await.expect("write");
        });
        let mut c = TcpStream::connect(addr).await.expect("connect");
        write_frame(&mut c, b"hello").await.expect("send");
        assert_eq!(read_frame(&mut c).await.expect("echo"), b"hello");
        let err = read_frame(&mut c).await.unwrap_err();
        assert!(err.to_string().contains("too large"), "{err}");
        server.await.expect("server");
    }

    /// Regression: openraft wraps each RPC in its own timeout and drops our
    /// future half-way; the pooled connection then held an unread answer
    /// that the next request took for its own (an AppendEntries answered
    /// `Conflict` for `prev_log_id = None`, and openraft panicked).
    #[tokio::test]
    async fn a_request_dropped_half_way_does_not_leave_its_answer_to_the_next() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let answer = |reason: &str| {
            encode(&RpcResponse::ClientWrite(Ok(CommandResult {
                ok: true,
                reason: Some(reason.into()),
                index: None,
            })))
            .expect("encode")
        };
        let (first, second) = (answer("first"), answer("second"));
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                accept_handshake(&mut s, b"", 1).await.expect("handshake");
                let (first, second, count) = (first.clone(), second.clone(), count.clone());
                tokio::spawn(async move {
                    while read_frame(&mut s).await.is_ok() {
                        if count.fetch_add(1, Ordering::SeqCst) == 0 {
                            // Answer the first request late, after the caller
                            // gave up on it.
                            tokio::time::sleep(Duration::from_millis(150)).await;
                            let _ = write_frame(&mut s, &first).await;
                        } else {
                            let _ = write_frame(&mut s, &second).await;
                        }
                    }
                });
            }
        });
        let t = Transport::new(NetSwitch::default(), Arc::from(&b""[..]));
        let req = RpcRequest::ClientWrite(Command::RenewLease { node: 1 });
        let long = Duration::from_secs(2);
        let cut = tokio::time::timeout(
            Duration::from_millis(50),
            t.call(1, &addr, Channel::Write, &req, long),
        )
        .await;
        assert!(cut.is_err(), "the first call should have been dropped");
        tokio::time::sleep(Duration::from_millis(200)).await;
        match t.call(1, &addr, Channel::Write, &req, long).await {
            Ok(RpcResponse::ClientWrite(Ok(r))) => {
                assert_eq!(
                    r.reason.as_deref(),
                    Some("second"),
                    "got the dropped request's answer"
                )
            }
            other => panic!("unexpected answer: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_closed_port_or_a_cut_network_is_unreachable() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        drop(listener);
        let switch = NetSwitch::default();
        let t = Transport::new(switch.clone(), Arc::from(&b""[..]));
        let req = RpcRequest::ClientWrite(Command::RenewLease { node: 1 });
        let timeout = Duration::from_millis(200);
        let err = t
            .call(1, &addr, Channel::Write, &req, timeout)
            .await
            .unwrap_err();
        assert!(matches!(err, CallError::Unreachable { .. }), "{err}");
        switch.set_cut(true);
        let err = t
            .call(1, "127.0.0.1:1", Channel::Raft, &req, timeout)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("cut"), "{err}");
    }

    /// A server that runs the handshake with `secret` and then answers every
    /// request with one fixed answer; counts handshakes refused.
    async fn secret_server(secret: &'static [u8]) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = refused.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                let count = count.clone();
                tokio::spawn(async move {
                    if let Err(e) = accept_handshake(&mut s, secret, 1).await {
                        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
                        count.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    let ok = encode(&RpcResponse::ClientWrite(Ok(CommandResult {
                        ok: true,
                        reason: None,
                        index: None,
                    })))
                    .expect("encode");
                    while read_frame(&mut s).await.is_ok() {
                        let _ = write_frame(&mut s, &ok).await;
                    }
                });
            }
        });
        (addr, refused)
    }

    #[tokio::test]
    async fn a_peer_without_the_cluster_secret_is_refused_and_the_server_goes_on() {
        let (addr, refused) = secret_server(b"s3cret-of-the-cluster").await;
        let req = RpcRequest::ClientWrite(Command::RenewLease { node: 1 });
        let timeout = Duration::from_secs(2);
        for wrong in [&b""[..], &b"another-secret"[..]] {
            let t = Transport::new(NetSwitch::default(), Arc::from(wrong));
            let err = t
                .call(1, &addr, Channel::Write, &req, timeout)
                .await
                .unwrap_err();
            assert!(err.to_string().contains("cluster secret"), "{err}");
        }
        assert_eq!(refused.load(Ordering::SeqCst), 2);
        // A client that speaks no handshake at all (sends a request first).
        let mut raw = TcpStream::connect(&addr).await.expect("connect");
        let nonce = read_small_frame(&mut raw).await.expect("challenge");
        assert_eq!(nonce.len(), 32);
        write_frame(&mut raw, &encode(&req).expect("encode"))
            .await
            .expect("write");
        let answer = read_small_frame(&mut raw).await.expect("refusal");
        assert!(answer.starts_with(b"refused"), "{answer:?}");
        // The server still serves a peer with the secret.
        let t = Transport::new(
            NetSwitch::default(),
            Arc::from(&b"s3cret-of-the-cluster"[..]),
        );
        match t.call(1, &addr, Channel::Write, &req, timeout).await {
            Ok(RpcResponse::ClientWrite(Ok(r))) => assert!(r.ok),
            other => panic!("unexpected answer: {other:?}"),
        }
        assert_eq!(refused.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_server_that_is_another_node_refuses_and_says_which_it_is() {
        let (addr, refused) = secret_server(b"s3cret-of-the-cluster").await;
        let t = Transport::new(
            NetSwitch::default(),
            Arc::from(&b"s3cret-of-the-cluster"[..]),
        );
        let req = RpcRequest::ClientWrite(Command::RenewLease { node: 1 });
        let timeout = Duration::from_secs(2);
        // The server is node 1; the address was recorded for node 5.
        let err = t
            .call(5, &addr, Channel::Raft, &req, timeout)
            .await
            .unwrap_err();
        assert!(matches!(err, CallError::Unreachable { .. }), "{err}");
        assert!(
            err.to_string().contains("this is node 1, not node 5"),
            "{err}"
        );
        assert_eq!(refused.load(Ordering::SeqCst), 1);
        // Meant for node 1, the same address answers.
        match t.call(1, &addr, Channel::Raft, &req, timeout).await {
            Ok(RpcResponse::ClientWrite(Ok(r))) => assert!(r.ok),
            other => panic!("unexpected answer: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_peer_of_the_older_handshake_is_told_so() {
        let (addr, refused) = secret_server(b"s3cret-of-the-cluster").await;
        let mut raw = TcpStream::connect(&addr).await.expect("connect");
        let nonce = read_small_frame(&mut raw).await.expect("challenge");
        // Before the target id: the proof alone, 32 bytes.
        write_frame(&mut raw, &proof(b"s3cret-of-the-cluster", &nonce))
            .await
            .expect("write");
        let answer = read_small_frame(&mut raw).await.expect("refusal");
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.contains("older lanebus"), "{answer}");
        assert_eq!(refused.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn proofs_depend_on_secret_and_nonce() {
        let n1 = [1u8; 32];
        let n2 = [2u8; 32];
        assert_eq!(proof(b"a", &n1), proof(b"a", &n1));
        assert_ne!(proof(b"a", &n1), proof(b"b", &n1));
        assert_ne!(proof(b"a", &n1), proof(b"a", &n2));
    }
}
