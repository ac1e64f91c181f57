//! `lanebus admin` against running nodes, as an operator runs it:
//!
//! - `--output json` prints what the API answers (`lanes`, `cluster`,
//!   `handlers`, `dead-letters list` compared with the same GET, on a node
//!   whose answers do not move while it is idle);
//! - tables: lane ranges per owner on a three-node cluster, dead letters,
//!   replays (one id, a handler by name);
//! - an error answer prints the API's code and message and exits non-zero;
//!   an unreachable node says so and exits non-zero;
//! - `LANEBUS_TOKEN` is sent as `Authorization: Bearer`;
//! - a closed standard output (`| head`) ends the command without a panic.

mod common;

use std::io::{Read as _, Write as _};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _};
use common::{start_node, stderr, stdout, Api, Backend, TestDb};
use lanebus_testkit::local_cluster::{free_port, LocalCluster, Start};
use lanebus_testkit::receiver::{Action, Receiver, Rule};
use serde_json::Value;

/// `lanebus admin ARGS` with no `LANEBUS_*` variable but `env`.
async fn admin(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Output> {
    common::cli(&[&["admin"], args].concat(), env, None).await
}

async fn ok(args: &[&str]) -> anyhow::Result<String> {
    common::cli_ok(&[&["admin"], args].concat()).await
}

async fn json(args: &[&str]) -> anyhow::Result<Value> {
    common::cli_json(&[&["admin"], args].concat()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_output_is_the_apis_answer_and_errors_are_clear() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Sqlite, "admin_cli").await?;
    let node = start_node(&db.url).await?;
    let url = node.base_url();
    let api = Api::new(&url);

    // A handler whose receiver always fails: one attempt, then a dead letter.
    let rx = Receiver::start().await?;
    rx.add_rule(Rule {
        handler: Some("payments".into()),
        key: None,
        action: Action::Status {
            status: 500,
            retry_after: None,
        },
    });
    let h = api
        .create_handler("payments", &rx.url("payments"), &["payment.*"], 1)
        .await?;
    let events: Vec<Value> = (0..5)
        .map(|i| serde_json::json!({"type": "payment.failed", "key": format!("acct-{i}"), "payload": {"n": i}}))
        .collect();
    api.publish(&events, 5).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while api.dead_letters(&h.id).await?.len() < 5 {
        ensure!(Instant::now() < deadline, "no 5 dead letters in 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Let the lanes settle (nothing in flight, backlog 0).
    tokio::time::sleep(Duration::from_millis(300)).await;

    // --output json is the API's JSON, for each read; --node or LANEBUS_NODE.
    for (cmd, path) in [
        (vec!["lanes"], "/admin/lanes".to_string()),
        (vec!["cluster"], "/admin/cluster".to_string()),
        (vec!["handlers"], "/admin/handlers".to_string()),
        (
            vec!["dead-letters", "list", "--handler", "payments"],
            format!("/admin/dead-letters?handler_id={}", h.id),
        ),
    ] {
        let (status, want) = api.get(&path).await?;
        ensure!(status == 200, "GET {path}: {status}");
        let mut args = cmd.clone();
        args.extend(["--output", "json", "--node", &url]);
        let got = json(&args).await?;
        ensure!(
            got == want,
            "{cmd:?} --output json differs from GET {path}:\n{got}\n{want}"
        );
    }
    let o = admin(
        &["lanes", "--output", "json"],
        &[("LANEBUS_NODE", url.as_str())],
    )
    .await?;
    ensure!(o.status.success(), "LANEBUS_NODE: {}", stderr(&o));
    let (_, want) = api.get("/admin/lanes").await?;
    ensure!(serde_json::from_slice::<Value>(&o.stdout)? == want);

    // Tables.
    let lanes = ok(&["lanes", "--node", &url]).await?;
    let row = lanes.lines().nth(1).context("no lane row")?;
    ensure!(
        lanes.lines().count() == 2
            && row.starts_with("test-1 ")
            && row.contains(" 256 ")
            && row.ends_with("0-255"),
        "{lanes}"
    );
    let handlers = ok(&["handlers", "--node", &url]).await?;
    ensure!(
        handlers.contains(&h.id) && handlers.contains("payments") && handlers.contains("enabled"),
        "{handlers}"
    );
    let cluster = ok(&["cluster", "--node", &url]).await?;
    ensure!(cluster.starts_with("answered by "), "{cluster}");
    let dead = ok(&["dead-letters", "list", "--node", &url, "--handler", &h.id]).await?;
    ensure!(
        dead.lines().count() == 6 && dead.contains("payment.failed") && dead.contains("acct-3"),
        "{dead}"
    );

    // Replays: one id, then the handler's by name.
    let first = api.dead_letters(&h.id).await?[0]["id"]
        .as_i64()
        .context("id")?;
    let one = ok(&["dead-letters", "replay", &first.to_string(), "--node", &url]).await?;
    ensure!(one == "replayed 1 dead letter\n", "{one}");
    // The replayed delivery fails again (the receiver always answers 500):
    // wait until it is a dead letter once more, so the handler's replay
    // below finds all five rather than racing it.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let dead = api.dead_letters(&h.id).await?;
        if dead.len() == 5 && dead.iter().all(|d| d["id"].as_i64() != Some(first)) {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the replayed delivery never came back: {dead:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rest = json(&[
        "dead-letters",
        "replay",
        "--handler",
        "payments",
        "--output",
        "json",
        "--node",
        &url,
    ])
    .await?;
    ensure!(rest["replayed"] == 5, "{rest}");

    // Disable and enable by name; JSON is the handler as the API answers.
    let off = ok(&["disable", "payments", "--node", &url]).await?;
    ensure!(
        off.starts_with(&format!("handler {} is disabled", h.id)),
        "{off}"
    );
    let (_, got) = api.get(&format!("/v1/handlers/{}", h.id)).await?;
    ensure!(
        got["state"] == "disabled" && got["state_reason"] == "api",
        "{got}"
    );
    let on = json(&["enable", &h.id, "--output", "json", "--node", &url]).await?;
    ensure!(
        on["state"] == "enabled" && on["id"] == h.id.as_str(),
        "{on}"
    );

    // An error answer: its code and message, a non-zero exit.
    let o = admin(
        &[
            "dead-letters",
            "list",
            "--handler",
            "hdl_0123456789abcdef0123456789abcdef",
            "--node",
            &url,
        ],
        &[],
    )
    .await?;
    let err = stderr(&o);
    ensure!(!o.status.success() && o.stdout.is_empty(), "{o:?}");
    ensure!(err.contains("404") && err.contains("not_found"), "{err}");
    ensure!(!err.contains("panicked"), "{err}");
    let o = admin(
        &[
            "dead-letters",
            "replay",
            "--handler",
            "nobody",
            "--node",
            &url,
        ],
        &[],
    )
    .await?;
    ensure!(
        !o.status.success() && stderr(&o).contains("no handler named \"nobody\""),
        "{o:?}"
    );
    let o = admin(&["dead-letters", "replay", "--node", &url], &[]).await?;
    ensure!(
        !o.status.success() && o.status.code() == Some(2),
        "replay without a selection: {o:?}"
    );

    // `| head`: standard output closed before anything is written.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_lanebus"))
        .args(["admin", "lanes", "--output", "json", "--node", &url])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    drop(child.stdout.take());
    let status = tokio::task::spawn_blocking(move || -> std::io::Result<_> {
        let mut err = String::new();
        child
            .stderr
            .take()
            .expect("piped")
            .read_to_string(&mut err)?;
        Ok((child.wait()?, err))
    })
    .await??;
    ensure!(
        status.0.success() && !status.1.contains("panicked"),
        "closed stdout: {} {}",
        status.0,
        status.1
    );

    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_table_names_owners_and_ranges_on_three_nodes() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Sqlite, "admin_cli3").await?;
    let _store = lanebus_store::open(&db.url).await?;
    let dir = std::env::temp_dir().join(format!(
        "lanebus-admin-cli-{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&dir)?;
    let mut cluster = LocalCluster::new(env!("CARGO_BIN_EXE_lanebus"), &dir, &db.url, &[]);
    cluster.spawn(1, Start::Bootstrap)?;
    cluster.wait_ready(1, Duration::from_secs(30)).await?;
    for id in [2, 3] {
        cluster.spawn(id, Start::Join(cluster.url(1)))?;
    }
    for id in [1, 2, 3] {
        cluster.wait_ready(id, Duration::from_secs(30)).await?;
    }
    cluster
        .wait_balanced(1, &[1, 2, 3], Duration::from_secs(30))
        .await?;

    // Balanced assignments still finish their hand-overs (a lane shows as
    // "releasing" under its old owner until the new one starts it): wait
    // until the table has one row per owner, all active.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let table = loop {
        let table = ok(&["lanes", "--node", &cluster.url(2)]).await?;
        let settled = table.lines().count() == 4
            && table
                .lines()
                .skip(1)
                .all(|l| l.split_whitespace().nth(1) == Some("active"));
        if settled || std::time::Instant::now() > deadline {
            break table;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut total = 0;
    for owner in ["1", "2", "3"] {
        let row = table
            .lines()
            .find(|l| l.starts_with(&format!("{owner} ")))
            .with_context(|| format!("no row for owner {owner}:\n{table}"))?;
        let cols: Vec<&str> = row.split_whitespace().collect();
        ensure!(cols[1] == "active", "{row}");
        let n: usize = cols[2].parse()?;
        total += n;
        // The ranges column covers exactly the owner's lanes (or, cut short
        // with ",... (+N ranges)" when there are many, at most them).
        let mut covered = 0;
        let cut = cols[6].ends_with(",...") || cols.len() > 7;
        for r in cols[6].split(',').filter(|r| *r != "...") {
            covered += match r.split_once('-') {
                Some((a, b)) => b.parse::<usize>()? - a.parse::<usize>()? + 1,
                None => {
                    r.parse::<usize>()?;
                    1
                }
            };
        }
        ensure!(
            if cut { covered < n } else { covered == n },
            "ranges of {owner} cover {covered} lanes, not {n}: {row}"
        );
    }
    ensure!(total == 256 && table.lines().count() == 4, "{table}");
    // Under load a lease renewal can be late for a moment (shown as NO):
    // the table must settle, not be right at the first look.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let c = loop {
        let c = ok(&["cluster", "--node", &cluster.url(3)]).await?;
        let settled = c.lines().count() == 5 && c.contains("leader") && !c.contains(" NO ");
        if settled || std::time::Instant::now() > deadline {
            break c;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    ensure!(
        c.lines().count() == 5 && c.contains("leader") && !c.contains(" NO "),
        "{c}"
    );
    println!("{table}{c}");
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
    db.drop_db().await;
    Ok(())
}

#[tokio::test]
async fn unreachable_node_is_a_clear_error() -> anyhow::Result<()> {
    let url = format!("http://{}", free_port()?);
    for cmd in [
        vec!["lanes"],
        vec!["cluster"],
        vec!["dead-letters", "replay", "--all"],
    ] {
        let mut args = cmd.clone();
        args.extend(["--node", &url]);
        let o = admin(&args, &[]).await?;
        let err = stderr(&o);
        ensure!(!o.status.success(), "{cmd:?} succeeded");
        ensure!(
            err.contains(&format!("cannot reach the node at {url}")) && !err.contains("panicked"),
            "{cmd:?}: {err}"
        );
    }
    let o = admin(&["lanes"], &[("LANEBUS_NODE", "127.0.0.1:8080")]).await?;
    ensure!(
        !o.status.success() && stderr(&o).contains("--node must be a URL"),
        "{o:?}"
    );
    Ok(())
}

#[tokio::test]
async fn token_is_sent_as_a_bearer() -> anyhow::Result<()> {
    // A stand-in node that records the request and answers a lane list.
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let url = format!("http://{}", listener.local_addr()?);
    let body = r#"{"lanes":[{"lane":0,"owner":"1","epoch":2,"state":"active","lease_expires_in_ms":900,"backlog":0,"in_flight":0}]}"#;
    let server = std::thread::spawn(move || -> std::io::Result<String> {
        let (mut s, _) = listener.accept()?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut req = Vec::new();
        let mut buf = [0u8; 4096];
        while !req.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            req.extend_from_slice(&buf[..n]);
        }
        write!(
            s,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )?;
        Ok(String::from_utf8_lossy(&req).into_owned())
    });
    let o = admin(
        &["lanes", "--output", "json"],
        &[
            ("LANEBUS_NODE", url.as_str()),
            ("LANEBUS_TOKEN", "s3cret-token"),
        ],
    )
    .await?;
    ensure!(o.status.success(), "{}", stderr(&o));
    ensure!(stdout(&o) == format!("{body}\n"), "{}", stdout(&o));
    let req = server.join().expect("server thread")?;
    ensure!(
        req.lines()
            .any(|l| l.eq_ignore_ascii_case("authorization: Bearer s3cret-token")),
        "{req}"
    );
    ensure!(req.starts_with("GET /admin/lanes "), "{req}");
    Ok(())
}
