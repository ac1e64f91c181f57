//! The operator's dashboard at `GET /ui/`: hand-written HTML, CSS and
//! vanilla JavaScript, embedded in the binary with `include_str!`.
//!
//! ```text
//!  GET /ui            308 → ui/
//!  GET /ui/           index.html ── links ──▶ dashboard.css, dashboard.js
//!  dashboard.js polls every second (no overlap; paused while hidden):
//!      ../admin/lanes     → 256-cell grid, one colour per owner
//!      ../admin/cluster   → nodes: leader, liveness, lane counts
//!      ../admin/handlers  → handlers: state, dead-letter counts
//!  #event=ID (the search box)       ../v1/events/ID → per handler: state,
//!                                   attempts, next attempt, last error, attempt log
//!  #handler=ID&state=pending|dead|completed
//!      ../v1/handlers/ID/deliveries?state=&after=&limit=50 (on open, tab,
//!                                   page, refresh: not polled)
//!      ../admin/handlers/ID/activity every 10 s → three inline SVG plots
//!                                   (deliveries/s, failures/s, p99 ms; this
//!                                   node's attempts)
//! ```
//!
//! Constraints: nothing is fetched from anywhere but this node (the page's
//! `content-security-policy` says so to the browser too: `default-src
//! 'self'`); no build step; paths are relative (`../admin/...`) so the page
//! works behind a reverse proxy that adds a path prefix. Untrusted strings
//! (node ids, handler names) reach the page only through `textContent` and
//! attributes, never as HTML.
//!
//! For browser tests: each lane cell is `<li id="lane-N" data-lane="N"
//! data-owner="ID" data-state=... data-epoch=... data-backlog=...
//! data-in-flight=...>` (`data-owner` empty when unassigned) inside
//! `<ol id="lanes">`; node rows are `<tr data-node="ID" data-alive=...
//! data-leader=... data-lanes=...>`; handler rows `<tr data-handler="ID"
//! data-state=... data-dead-letters=...>`; `<body data-status>` is `loading`,
//! then `ok`, or `error` while the node does not answer, and
//! `data-updated` the time of the last good poll; `data-view` is
//! `overview`, `event` or `handler`, and `data-event` the id of the event
//! last shown. The event's rows are `<tr data-event-handler="ID"
//! data-state=... data-attempts=... data-attempt-log=N>`, a handler's
//! deliveries `<tr data-delivery="EVENT_ID" data-state=... data-attempts=...
//! data-attempt-log=N>` in `<table id="deliveries" data-loaded="STATE:PAGE">`
//! (page 0 first); a delivery with failed attempts is followed by `<tr
//! class="log-row">` holding its attempt log's rows `<tr data-attempt=N
//! data-status=...>` (hidden until its `.log-toggle` button is pressed);
//! each plot `<figure data-plot="deliveries|failures|p99" data-points=N
//! data-nonzero=N data-max=...>`.
//!
//! To look at it without a cluster: `cargo run -p lanebus-api --example
//! dashboard_preview` serves a made-up three-node cluster whose third node
//! fails after 5 seconds.

use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// One embedded file of the dashboard.
#[derive(Debug, Clone, Copy)]
pub struct Asset {
    /// Path the router serves it at.
    pub path: &'static str,
    /// Its `content-type`.
    pub content_type: &'static str,
    /// Its bytes.
    pub body: &'static str,
}

/// The page.
pub const INDEX: Asset = Asset {
    path: "/ui/",
    content_type: "text/html; charset=utf-8",
    body: include_str!("../ui/index.html"),
};

/// The script.
pub const SCRIPT: Asset = Asset {
    path: "/ui/dashboard.js",
    content_type: "text/javascript; charset=utf-8",
    body: include_str!("../ui/dashboard.js"),
};

/// The style sheet.
pub const STYLE: Asset = Asset {
    path: "/ui/dashboard.css",
    content_type: "text/css; charset=utf-8",
    body: include_str!("../ui/dashboard.css"),
};

/// Every embedded file.
pub const ASSETS: [Asset; 3] = [INDEX, SCRIPT, STYLE];

/// The browser may load and fetch from this node only; no inline script or
/// style (the page has none).
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                   connect-src 'self'; img-src 'self' data:; base-uri 'none'; \
                   form-action 'none'; frame-ancestors 'none'";

fn serve(asset: Asset) -> Response {
    let mut res = asset.body.into_response();
    let headers = res.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(asset.content_type),
    );
    // Assets change with the binary, and a node restarts with a new one:
    // revalidate rather than cache stale code across an upgrade.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    headers.insert(
        HeaderName::from_static("referrer-policy"),
        HeaderValue::from_static("no-referrer"),
    );
    res
}

/// Handler of `GET /ui/`.
pub(crate) async fn index() -> Response {
    serve(INDEX)
}

/// Handler of `GET /ui/dashboard.js`.
pub(crate) async fn script() -> Response {
    serve(SCRIPT)
}

/// Handler of `GET /ui/dashboard.css`.
pub(crate) async fn style() -> Response {
    serve(STYLE)
}

/// Handler of `GET /ui`: `308` to `ui/`. The target is relative (resolved
/// against `/ui`, it is `/ui/`) so it stays right behind a path prefix.
pub(crate) async fn redirect() -> Response {
    (
        StatusCode::PERMANENT_REDIRECT,
        [(header::LOCATION, HeaderValue::from_static("ui/"))],
    )
        .into_response()
}
