//! The cluster secret (issue #4, item 6): a node started with another secret
//! is refused by the members (it never hears from the leader, so never
//! becomes a member), nothing crashes, and once restarted with the right
//! secret it joins.

mod common;

use std::time::Duration;

use common::{wait_until, Sandbox};

const SECRET: &str = "the-cluster-secret-0001";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_another_secret_is_refused_until_it_has_the_right_one() {
    let mut sb = Sandbox::new();
    sb.add(1);
    sb.node_mut(1).secret = Some(SECRET.into());
    sb.node_mut(1).start(true).await;
    sb.node(1).c().bootstrap().await.expect("bootstrap");
    wait_until(Duration::from_secs(10), "node 1 joined", || {
        sb.node(1).c().joined()
    })
    .await;

    sb.add(2);
    sb.node_mut(2).secret = Some("another-secret-000000".into());
    sb.node_mut(2).start(true).await;
    // The membership change is recorded; replicating to node 2 is refused
    // at every connection.
    let (raft2, http2) = (sb.node(2).raft_addr.clone(), sb.node(2).http_addr.clone());
    let added = tokio::time::timeout(
        Duration::from_secs(3),
        sb.node(1).c().add_node(2, &raft2, &http2),
    )
    .await;
    eprintln!("add_node of a node with another secret: {added:?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let v2 = sb.node(2).view();
    assert_eq!(v2.leader, None, "node 2 heard from a leader: {v2:?}");
    assert!(!sb.node(2).c().joined(), "node 2 joined without the secret");
    // Node 1 is still leader of its cluster.
    assert_eq!(sb.node(1).view().leader, Some(1));

    // Restarted with the right secret, node 2 catches up and joins.
    sb.node_mut(2).kill().await;
    sb.node_mut(2).secret = Some(SECRET.into());
    sb.node_mut(2).start(true).await;
    wait_until(
        Duration::from_secs(30),
        "node 2 joined with the secret",
        || sb.node(2).c().joined() && sb.node(2).view().leader == Some(1),
    )
    .await;
}
