//! The chaos webhook receiver: a small HTTP/1.1 server on raw TCP, so that it
//! can do what a well-behaved framework will not: reset a connection, hold a
//! request without answering, answer after the handler's timeout.
//!
//! Every request is logged as an [`lanebus_testkit::oracle::Request`] (handler, event id, key,
//! sequence, attempt, arrival and answer time, status or none, the payload
//! bytes, whether the signature verified). What it answers is decided by
//! [`decide`] from the current [`Mode`], the run's seed and the attempt's
//! number as seen here; a pure function, so reruns fail the same attempts.
//!
//! ```text
//! POST /hook/{handler} ─▶ parse ─▶ decide(mode, seed, handler, id, n) ─▶ 200 | 500
//!                                                                     ├▶ reset (RST)
//!                                                                     ├▶ hold, then close
//!                                                                     └▶ wait, then 200
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::proxy::{identify_async, Sources};
use crate::rng::coin;
use lanebus_testkit::oracle::Request;

/// How the endpoint behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// 200 at once.
    Healthy,
    /// `percent` of attempts answer 500.
    Random500 {
        /// Share of failing attempts.
        percent: u32,
    },
    /// `percent` of attempts get their connection reset without an answer.
    Reset {
        /// Share of reset attempts.
        percent: u32,
    },
    /// `percent` of attempts are held without an answer for `ms`, then the
    /// connection is closed (a timeout for the sender).
    Timeout {
        /// Share of held attempts.
        percent: u32,
        /// How long to hold, in milliseconds.
        ms: u64,
    },
    /// `percent` of attempts are answered 200, but only after `ms` (longer
    /// than the handler timeout: the sender has given up).
    Stall {
        /// Share of stalled attempts.
        percent: u32,
        /// Delay before the answer, in milliseconds.
        ms: u64,
    },
    /// Every attempt answers 500 (dead letters expected).
    Down,
    /// The first attempt (as counted here) of `percent` % of deliveries
    /// answers 500, later ones 200.
    FailFirst {
        /// Share of deliveries whose first attempt fails.
        percent: u32,
    },
    /// The first attempt (as counted here) of `percent` % of deliveries is
    /// answered 200 after `ms` (within the handler timeout: a slow
    /// success); repeats are answered at once.
    SlowFirst {
        /// Share of deliveries whose first attempt is slow.
        percent: u32,
        /// Delay before the answer, in milliseconds.
        ms: u64,
    },
}

/// What one request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// Answer this status at once.
    Status(u16),
    /// Reset the connection.
    Reset,
    /// Hold for the duration, then close without an answer.
    Hold(Duration),
    /// Wait, then answer 200.
    Late(Duration),
}

type Trap = (TrapFor, tokio::sync::oneshot::Sender<Caught>);

/// Which request a trap catches (see [`Receiver::trap`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrapFor {
    /// The first request from node `sender` whose `lanebus-attempt` is
    /// `attempt`.
    Attempt {
        /// The sending node's id.
        sender: String,
        /// The attempt number.
        attempt: u32,
    },
    /// The first request of this delivery from a known node other than
    /// `not_sender`.
    Delivery {
        /// Handler name.
        handler: String,
        /// Event id.
        event_id: String,
        /// The node whose requests do not count.
        not_sender: String,
    },
}

impl TrapFor {
    fn matches(&self, handler: &str, event_id: &str, sender: Option<&str>, attempt: u32) -> bool {
        match self {
            TrapFor::Attempt {
                sender: s,
                attempt: a,
            } => sender == Some(s) && attempt == *a,
            TrapFor::Delivery {
                handler: h,
                event_id: e,
                not_sender,
            } => h == handler && e == event_id && sender.is_some_and(|s| s != not_sender),
        }
    }
}

/// A request a trap caught: the receiver holds it, unanswered, until
/// `answer` gets a status (or is dropped: then 200).
#[derive(Debug)]
pub struct Caught {
    /// Handler name.
    pub handler: String,
    /// Event id.
    pub event_id: String,
    /// The sending node.
    pub sender: Option<String>,
    /// `lanebus-attempt`.
    pub attempt: u32,
    /// Arrival, milliseconds since the run started.
    pub arrived_ms: f64,
    /// Where to send the status to answer with.
    pub answer: tokio::sync::oneshot::Sender<u16>,
}

/// The answer for the `n`th attempt (counted here, from 1) of
/// `(handler, event_id)`.
pub fn decide(mode: Mode, seed: u64, handler: &str, event_id: &str, n: u32) -> Answer {
    let hit = |p| coin(seed, handler, event_id, n, p);
    match mode {
        Mode::Healthy => Answer::Status(200),
        Mode::Random500 { percent } if hit(percent) => Answer::Status(500),
        Mode::Reset { percent } if hit(percent) => Answer::Reset,
        Mode::Timeout { percent, ms } if hit(percent) => Answer::Hold(Duration::from_millis(ms)),
        Mode::Stall { percent, ms } if hit(percent) => Answer::Late(Duration::from_millis(ms)),
        Mode::Down => Answer::Status(500),
        Mode::FailFirst { percent } if n == 1 && hit(percent) => Answer::Status(500),
        Mode::SlowFirst { percent, ms } if n == 1 && hit(percent) => {
            Answer::Late(Duration::from_millis(ms))
        }
        _ => Answer::Status(200),
    }
}

struct Inner {
    mode: Mode,
    secrets: HashMap<String, String>,
    seen: HashMap<(String, String), u32>,
    log: Vec<Request>,
    traps: Vec<Trap>,
}

/// The receiver; cheap to clone.
#[derive(Clone)]
pub struct Receiver {
    inner: Arc<Mutex<Inner>>,
    start: Instant,
    seed: u64,
    port: u16,
}

impl Receiver {
    /// Starts on `127.0.0.1:0`; times are measured from `start`.
    /// `sources` names the node processes, to tell which node sent a
    /// request (see [`crate::proxy::identify_async`]).
    pub async fn start(seed: u64, start: Instant, sources: Sources) -> anyhow::Result<Receiver> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let listen = listener.local_addr()?;
        let port = listen.port();
        let rx = Receiver {
            inner: Arc::new(Mutex::new(Inner {
                mode: Mode::Healthy,
                secrets: HashMap::new(),
                seen: HashMap::new(),
                log: Vec::new(),
                traps: Vec::new(),
            })),
            start,
            seed,
            port,
        };
        let me = rx.clone();
        tokio::spawn(async move {
            while let Ok((sock, peer)) = listener.accept().await {
                let me = me.clone();
                let sources = sources.clone();
                tokio::spawn(async move {
                    // A node with its own source address is known by it;
                    // else by the socket's owner process (reads /proc:
                    // blocking).
                    let sender = match crate::sandbox::sender_of(peer) {
                        Some(s) => Some(s),
                        None => identify_async(peer, listen, sources).await,
                    };
                    let _ = me.serve(sock, sender).await;
                });
            }
        });
        Ok(rx)
    }

    /// The webhook URL of `handler`.
    pub fn url(&self, handler: &str) -> String {
        format!("http://127.0.0.1:{}/hook/{handler}", self.port)
    }

    /// Sets how the endpoint behaves from now on.
    pub fn set_mode(&self, mode: Mode) {
        self.lock().mode = mode;
    }

    /// Records the signing secret of `handler`.
    pub fn set_secret(&self, handler: &str, secret: &str) {
        self.lock()
            .secrets
            .insert(handler.to_string(), secret.to_string());
    }

    /// Sets a trap: the first request that `what` matches is held without
    /// an answer and handed over (a [`Caught`]) through the returned
    /// channel; the trap then goes. Traps are checked in the order set.
    pub fn trap(&self, what: TrapFor) -> tokio::sync::oneshot::Receiver<Caught> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.lock().traps.push((what, tx));
        rx
    }

    /// Removes every trap not yet sprung.
    pub fn clear_traps(&self) {
        self.lock().traps.clear();
    }

    /// A copy of the log.
    pub fn log(&self) -> Vec<Request> {
        self.lock().log.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("receiver lock")
    }

    fn ms(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1e3
    }

    async fn serve(&self, mut sock: TcpStream, sender: Option<String>) -> anyhow::Result<()> {
        let mut buf: Vec<u8> = Vec::with_capacity(16 << 10);
        loop {
            // Head.
            let head_end = loop {
                if let Some(i) = find(&buf, b"\r\n\r\n") {
                    break i + 4;
                }
                let mut chunk = [0u8; 16 << 10];
                let n = sock.read(&mut chunk).await?;
                if n == 0 {
                    return Ok(());
                }
                buf.extend_from_slice(&chunk[..n]);
            };
            let arrived = self.ms();
            let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
            let mut lines = head.split("\r\n");
            let path = lines
                .next()
                .and_then(|l| l.split(' ').nth(1))
                .unwrap_or("")
                .to_string();
            let headers: HashMap<String, String> = lines
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
                .collect();
            let len: usize = headers
                .get("content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            while buf.len() < head_end + len {
                let mut chunk = [0u8; 64 << 10];
                let n = sock.read(&mut chunk).await?;
                if n == 0 {
                    return Ok(());
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            let body: Vec<u8> = buf[head_end..head_end + len].to_vec();
            buf.drain(..head_end + len);

            let handler = path.strip_prefix("/hook/").unwrap_or(&path).to_string();
            let h = |n: &str| headers.get(n).cloned();
            let event_id = h("webhook-id").unwrap_or_default();
            let attempt: u32 = h("lanebus-attempt")
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            let (answer, signature_ok, held) = {
                let mut inner = self.lock();
                let held = inner
                    .traps
                    .iter()
                    .position(|(t, _)| t.matches(&handler, &event_id, sender.as_deref(), attempt))
                    .map(|i| inner.traps.remove(i).1);
                let n = {
                    let n = inner
                        .seen
                        .entry((handler.clone(), event_id.clone()))
                        .or_default();
                    *n += 1;
                    *n
                };
                let answer = decide(inner.mode, self.seed, &handler, &event_id, n);
                let ok = inner.secrets.get(&handler).is_some_and(|s| {
                    lanebus_testkit::signature::valid(
                        s,
                        &event_id,
                        &h("webhook-timestamp").unwrap_or_default(),
                        &h("webhook-signature").unwrap_or_default(),
                        &body,
                    )
                });
                (answer, ok, held)
            };
            let mut rec = Request {
                handler,
                event_id,
                key: h("lanebus-key"),
                sequence: h("lanebus-sequence").and_then(|s| s.parse().ok()),
                attempt,
                arrived_ms: arrived,
                answered_ms: None,
                status: None,
                ended_ms: None,
                data: data_member(&body),
                signature_ok,
                sender: sender.clone(),
            };
            let answer = match held {
                Some(tx) => {
                    let (atx, arx) = tokio::sync::oneshot::channel();
                    let caught = Caught {
                        handler: rec.handler.clone(),
                        event_id: rec.event_id.clone(),
                        sender: sender.clone(),
                        attempt,
                        arrived_ms: arrived,
                        answer: atx,
                    };
                    // Nobody waiting any more: answer as the mode says.
                    match tx.send(caught) {
                        Ok(()) => Answer::Status(arx.await.unwrap_or(200)),
                        Err(_) => answer,
                    }
                }
                None => answer,
            };
            let status = match answer {
                Answer::Status(s) => Some(s),
                Answer::Late(d) => {
                    tokio::time::sleep(d).await;
                    Some(200)
                }
                Answer::Reset => {
                    // SO_LINGER 0: close with RST. It blocks on drop only
                    // with a non-zero linger time.
                    #[allow(deprecated)]
                    let _ = sock.set_linger(Some(Duration::ZERO));
                    rec.ended_ms = Some(self.ms());
                    self.lock().log.push(rec);
                    return Ok(());
                }
                Answer::Hold(d) => {
                    tokio::time::sleep(d).await;
                    rec.ended_ms = Some(self.ms());
                    self.lock().log.push(rec);
                    return Ok(());
                }
            };
            let s = status.unwrap_or(200);
            let reply = format!(
                "HTTP/1.1 {s} {}\r\ncontent-length: 0\r\n\r\n",
                if s == 200 {
                    "OK"
                } else {
                    "Internal Server Error"
                }
            );
            // Stamped before writing: the sender cannot have seen the answer
            // earlier, so order checks against it raise no false alarm when
            // this process is slow to get back to the task after the write.
            rec.answered_ms = Some(self.ms());
            rec.ended_ms = rec.answered_ms;
            let written = sock.write_all(reply.as_bytes()).await;
            rec.status = status;
            if written.is_err() {
                // The sender had hung up: it never saw the answer.
                rec.status = None;
                rec.answered_ms = None;
            }
            self.lock().log.push(rec);
            written?;
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The `data` member of a webhook body, as the bytes it was spliced in with:
/// the body is `{"type":T,"timestamp":"...","data":<payload>}` (docs/design.md
/// section 5; the node writes the payload bytes unchanged).
pub fn data_member(body: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(body).ok()?;
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    // Find the prefix by re-serializing the type and timestamp exactly as
    // the node does; fall back to a search for the member name.
    let prefix = format!(
        "{{\"type\":{},\"timestamp\":{},\"data\":",
        serde_json::to_string(v.get("type")?).ok()?,
        serde_json::to_string(v.get("timestamp")?).ok()?
    );
    let rest = text.strip_prefix(&prefix)?;
    rest.strip_suffix('}').map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_follow_the_seed_and_mode() {
        assert_eq!(decide(Mode::Healthy, 1, "h", "e", 1), Answer::Status(200));
        assert_eq!(decide(Mode::Down, 1, "h", "e", 9), Answer::Status(500));
        let fails = (0..1000)
            .filter(|i| {
                decide(Mode::Random500 { percent: 30 }, 5, "h", &format!("e{i}"), 1)
                    == Answer::Status(500)
            })
            .count();
        assert!((230..370).contains(&fails), "{fails}");
        let a: Vec<_> = (1..20)
            .map(|n| decide(Mode::Reset { percent: 50 }, 9, "h", "e", n))
            .collect();
        let b: Vec<_> = (1..20)
            .map(|n| decide(Mode::Reset { percent: 50 }, 9, "h", "e", n))
            .collect();
        assert_eq!(a, b);
    }

    #[test]
    fn fail_first_fails_only_a_share_of_first_attempts() {
        let mode = Mode::FailFirst { percent: 10 };
        let first = (0..1000)
            .filter(|i| decide(mode, 3, "h", &format!("e{i}"), 1) == Answer::Status(500))
            .count();
        assert!((50..150).contains(&first), "{first}");
        assert!((0..1000).all(|i| decide(mode, 3, "h", &format!("e{i}"), 2) == Answer::Status(200)));
    }

    #[test]
    fn slow_first_delays_a_share_of_first_attempts_and_answers_repeats_at_once() {
        let mode = Mode::SlowFirst {
            percent: 20,
            ms: 8_000,
        };
        let late = Answer::Late(Duration::from_millis(8_000));
        let slow = (0..1000)
            .filter(|i| decide(mode, 3, "h", &format!("e{i}"), 1) == late)
            .count();
        assert!((130..270).contains(&slow), "{slow}");
        assert!((0..1000).all(|i| decide(mode, 3, "h", &format!("e{i}"), 2) == Answer::Status(200)));
    }

    #[test]
    fn traps_match_the_attempt_of_a_sender_or_another_senders_request() {
        let a = TrapFor::Attempt {
            sender: "2".into(),
            attempt: 2,
        };
        assert!(a.matches("h", "e", Some("2"), 2));
        assert!(!a.matches("h", "e", Some("2"), 1));
        assert!(!a.matches("h", "e", Some("3"), 2));
        assert!(!a.matches("h", "e", None, 2));
        let d = TrapFor::Delivery {
            handler: "h".into(),
            event_id: "e".into(),
            not_sender: "2".into(),
        };
        assert!(d.matches("h", "e", Some("3"), 2));
        assert!(!d.matches("h", "e", Some("2"), 2));
        assert!(!d.matches("h", "e", None, 2));
        assert!(!d.matches("h", "f", Some("3"), 2));
        assert!(!d.matches("g", "e", Some("3"), 2));
    }

    /// One webhook-like POST from `127.0.1.<node>`; returns the status line.
    async fn post_from(node: u8, url_port: u16, event: &str, attempt: u32) -> String {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(std::net::SocketAddr::from(([127, 0, 1, node], 0)))
            .unwrap();
        let mut s = sock
            .connect(std::net::SocketAddr::from(([127, 0, 0, 1], url_port)))
            .await
            .unwrap();
        let body = r#"{"type":"a.b","timestamp":"t","data":{}}"#;
        let req = format!(
            "POST /hook/h HTTP/1.1\r\nwebhook-id: {event}\r\nlanebus-attempt: {attempt}\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut buf = [0u8; 256];
        let n = s.read(&mut buf).await.unwrap();
        String::from_utf8_lossy(&buf[..n])
            .lines()
            .next()
            .unwrap_or_default()
            .to_string()
    }

    #[tokio::test]
    async fn a_trapped_request_waits_for_the_answer_it_is_given() {
        let rx = Receiver::start(1, Instant::now(), Sources::default())
            .await
            .unwrap();
        let port = rx.port;
        let caught = rx.trap(TrapFor::Attempt {
            sender: "2".into(),
            attempt: 2,
        });
        // Not the trapped attempt: answered at once.
        assert_eq!(post_from(2, port, "e1", 1).await, "HTTP/1.1 200 OK");
        let held = tokio::spawn(post_from(2, port, "e1", 2));
        let c = caught.await.unwrap();
        assert_eq!((c.sender.as_deref(), c.attempt), (Some("2"), 2));
        assert!(!held.is_finished(), "answered before the trap was released");
        c.answer.send(500).unwrap();
        assert_eq!(held.await.unwrap(), "HTTP/1.1 500 Internal Server Error");
        // The trap went with its catch; the log has both requests.
        assert_eq!(post_from(2, port, "e1", 2).await, "HTTP/1.1 200 OK");
        // Logged just after the answer is written.
        let mut log = rx.log();
        for _ in 0..100 {
            if log.len() == 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            log = rx.log();
        }
        assert_eq!(log.len(), 3);
        assert_eq!(log.iter().filter(|r| r.status == Some(500)).count(), 1);
        assert!(log.iter().all(|r| r.sender.as_deref() == Some("2")));
    }

    #[test]
    fn data_member_returns_the_spliced_bytes() {
        let body = br#"{"type":"a.b","timestamp":"2026-01-01T00:00:00.000000Z","data":{"z":1,"a":[1, 2]}}"#;
        assert_eq!(data_member(body).as_deref(), Some(r#"{"z":1,"a":[1, 2]}"#));
        assert_eq!(data_member(b"not json"), None);
    }
}
