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
    // Adding it is refused at once, with the reason: it does not answer
    // the Raft handshake with the secret.
    let (raft2, http2) = (sb.node(2).raft_addr.clone(), sb.node(2).http_addr.clone());
    let err = sb
        .node(1)
        .c()
        .add_node(2, &raft2, &http2)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("does not answer as node 2"),
        "{err}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let v2 = sb.node(2).view();
    assert_eq!(v2.leader, None, "node 2 heard from a leader: {v2:?}");
    assert!(!sb.node(2).c().joined(), "node 2 joined without the secret");
    // Node 1 is still leader of its cluster, with one member.
    assert_eq!(sb.node(1).view().leader, Some(1));
    assert_eq!(sb.node(1).view().members.len(), 1);

    // Restarted with the right secret, node 2 is added, catches up and joins.
    sb.node_mut(2).kill().await;
    sb.node_mut(2).secret = Some(SECRET.into());
    sb.node_mut(2).start(true).await;
    let (raft2, http2) = (sb.node(2).raft_addr.clone(), sb.node(2).http_addr.clone());
    sb.node(1)
        .c()
        .add_node(2, &raft2, &http2)
        .await
        .expect("add node 2 with the secret");
    wait_until(
        Duration::from_secs(30),
        "node 2 joined with the secret",
        || sb.node(2).c().joined() && sb.node(2).view().leader == Some(1),
    )
    .await;
}

/// A join naming a member's Raft address in another spelling (here the
/// leader's own, as `localhost` instead of `127.0.0.1`) is refused: the
/// leader would replicate to itself, which openraft panics on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_whose_address_reaches_another_node_is_refused() {
    let mut sb = Sandbox::new();
    sb.add(1);
    sb.node_mut(1).start(true).await;
    sb.node(1).c().bootstrap().await.expect("bootstrap");
    let port = sb.node(1).raft_addr.rsplit_once(':').unwrap().1.to_owned();
    let alias = format!("localhost:{port}");
    let err = sb
        .node(1)
        .c()
        .add_node(5, &alias, "127.0.0.1:18905")
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("this is node 1, not node 5"),
        "{err}"
    );
    assert_eq!(sb.node(1).view().members.len(), 1);
    // Still the leader, still serving.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sb.node(1).view().leader, Some(1));
}
