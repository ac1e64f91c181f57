//! Serving the router so that even the answers the HTTP server writes by
//! itself have the JSON error shape.
//!
//! hyper refuses a few requests before any router runs, with an empty body:
//! a request line whose URI exceeds 65,534 bytes (`414`) and a request it
//! cannot parse (`400`). [`listener`] wraps a TCP listener so that each such
//! answer is rewritten, on its way out, into `414 uri_too_long` or
//! `400 bad_request` with the body `{"error": {"code", "message"}}`. Every
//! other byte passes through unchanged: the router never answers a 4xx
//! without a JSON body, so an error head with `content-length: 0` can only
//! come from hyper.
//!
//! ```text
//! axum::serve(lanebus_api::serve::listener(tcp), router(state))
//! ```

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use crate::error::{error_body, ErrorCode};
use crate::MAX_URI_BYTES;

/// A TCP listener for `axum::serve` whose connections rewrite hyper's own
/// empty error answers into the JSON error shape (module docs).
#[derive(Debug)]
pub struct JsonErrorListener {
    inner: TcpListener,
}

/// Wraps `tcp` for `axum::serve` (module docs).
pub fn listener(tcp: TcpListener) -> JsonErrorListener {
    JsonErrorListener { inner: tcp }
}

impl axum::serve::Listener for JsonErrorListener {
    type Io = JsonErrorIo<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (io, addr) = axum::serve::Listener::accept(&mut self.inner).await;
        (JsonErrorIo::new(io), addr)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// One connection of a [`JsonErrorListener`]: reads pass through; a write
/// that is exactly one of hyper's empty error heads is replaced.
#[derive(Debug)]
pub struct JsonErrorIo<T> {
    inner: T,
    /// A replacement still to be written, and how much of it is.
    pending: Vec<u8>,
    written: usize,
}

impl<T> JsonErrorIo<T> {
    /// Wraps one connection.
    pub fn new(inner: T) -> Self {
        JsonErrorIo {
            inner,
            pending: Vec::new(),
            written: 0,
        }
    }
}

impl<T: AsyncWrite + Unpin> JsonErrorIo<T> {
    /// Writes out what is left of a replacement.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.pending.len() {
            let n =
                ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.pending.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for JsonErrorIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for JsonErrorIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        ready!(this.poll_pending(cx))?;
        if let Some(replacement) = rewrite(buf) {
            this.pending = replacement;
            this.written = 0;
            // The caller's bytes are taken; the replacement goes out now or
            // at the next write, flush or shutdown.
            if let Poll::Ready(Err(e)) = this.poll_pending(cx) {
                return Poll::Ready(Err(e));
            }
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    // Not vectored: hyper then writes each head as one contiguous buffer,
    // which is what `rewrite` recognizes.
    fn is_write_vectored(&self) -> bool {
        false
    }
}

/// The JSON answer replacing `buf`, if `buf` is exactly one of hyper's own
/// error heads: `HTTP/1.x 414` or `400`, no body (`content-length: 0`).
fn rewrite(buf: &[u8]) -> Option<Vec<u8>> {
    if buf.len() > 1024 || !buf.starts_with(b"HTTP/1.") {
        return None;
    }
    let head = std::str::from_utf8(buf).ok()?;
    let lines = head.strip_suffix("\r\n\r\n")?;
    if lines.contains("\r\n\r\n") {
        return None;
    }
    let mut lines = lines.split("\r\n");
    let status_line = lines.next()?;
    let headers: Vec<&str> = lines.collect();
    let empty = headers
        .iter()
        .any(|h| h.eq_ignore_ascii_case("content-length: 0"));
    let typed = headers
        .iter()
        .any(|h| h.to_ascii_lowercase().starts_with("content-type:"));
    if !empty || typed {
        return None;
    }
    let (code, message) = match status_line.get(9..13)? {
        "414 " => (
            ErrorCode::UriTooLong,
            format!("request uri exceeds the limit of {MAX_URI_BYTES} bytes"),
        ),
        "400 " => (
            ErrorCode::BadRequest,
            "the request could not be parsed as http".to_owned(),
        ),
        _ => return None,
    };
    crate::telemetry::api_error(code.as_str());
    let body = error_body(code, &message);
    let mut out = String::with_capacity(head.len() + 64);
    out.push_str(status_line);
    out.push_str("\r\n");
    for h in headers {
        if !h.to_ascii_lowercase().starts_with("content-length:") {
            out.push_str(h);
            out.push_str("\r\n");
        }
    }
    out.push_str("content-type: application/json\r\n");
    out.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
    let mut out = out.into_bytes();
    out.extend_from_slice(&body);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_only_hypers_empty_error_heads() {
        let hyper_414 = b"HTTP/1.1 414 URI Too Long\r\nconnection: close\r\ncontent-length: 0\r\ndate: Mon, 30 Nov 2026 14:13:08 GMT\r\n\r\n";
        let out = rewrite(hyper_414).expect("rewritten");
        let text = String::from_utf8(out).expect("utf-8");
        let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
        assert!(head.starts_with("HTTP/1.1 414 URI Too Long\r\n"), "{head}");
        assert!(head.contains("\r\nconnection: close"), "{head}");
        assert!(
            head.contains("\r\ncontent-type: application/json"),
            "{head}"
        );
        assert!(
            head.contains(&format!("\r\ncontent-length: {}", body.len())),
            "{head}"
        );
        assert!(!head.contains("content-length: 0"), "{head}");
        let v: serde_json::Value = serde_json::from_str(body).expect("json");
        assert_eq!(v["error"]["code"], "uri_too_long");

        let hyper_400 =
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\ndate: Mon, 30 Nov 2026 14:13:08 GMT\r\n\r\n";
        let out = String::from_utf8(rewrite(hyper_400).expect("rewritten")).expect("utf-8");
        assert!(out.contains(r#""code":"bad_request""#), "{out}");

        for untouched in [
            &b"HTTP/1.1 414 URI Too Long\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n"[..],
            b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 58\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\nHTTP/1.1 200 OK\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n",
            b"{\"events\": []}",
            b"",
        ] {
            assert!(
                rewrite(untouched).is_none(),
                "{}",
                String::from_utf8_lossy(untouched)
            );
        }
    }
}
