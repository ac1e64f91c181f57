//! Snapshots bound the log under lease renewals, a node restarts from a
//! snapshot, and a node joining after the log was purged is brought up to
//! date by installing one.

mod common;

use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_purge_the_log_and_bring_a_late_joiner_up_to_date() {
    let mut sb = Sandbox::new();
    sb.add(1);
    sb.node_mut(1).snapshot_every = 20;
    sb.node_mut(1).start(true).await;
    sb.node(1).c().bootstrap().await.expect("bootstrap");
    sb.node(1)
        .c()
        .bootstrap()
        .await
        .expect("bootstrap is idempotent");

    // Renewals alone (about 3 a second) pass 20 entries in a few seconds.
    wait_until(
        Duration::from_secs(20),
        "a snapshot and a purged log",
        || {
            let m = sb.node(1).c().raft().metrics().borrow().clone();
            m.snapshot.is_some() && m.purged.is_some()
        },
    )
    .await;
    assert!(balanced_over(&sb.node(1).view(), &[1]));
    assert!(sb.node(1).c().joined());

    // Restart from the data dir: the state comes back (snapshot + log).
    let expected = after_restart(&replicated(&sb.node(1).view()));
    sb.node_mut(1).kill().await;
    sb.node_mut(1).start(true).await;
    wait_until(
        Duration::from_secs(10),
        "restarted node leads again with its lanes one epoch further",
        || sb.node(1).view().leader == Some(1) && replicated(&sb.node(1).view()) == expected,
    )
    .await;

    // A node joining now cannot be sent the purged entries: it gets the
    // snapshot, then the rest of the log.
    sb.add(2);
    sb.node_mut(2).start(true).await;
    sb.join(1, 2).await;
    wait_until(
        Duration::from_secs(20),
        "late joiner balanced and agreeing",
        || balanced_over(&sb.node(1).view(), &[1, 2]) && views_agree(&sb),
    )
    .await;
    let m2 = sb.node(2).c().raft().metrics().borrow().clone();
    assert!(m2.snapshot.is_some(), "node 2 installed a snapshot: {m2:?}");
    for n in &mut sb.nodes {
        n.kill().await;
    }
}
