//! `--advertise-addr`: nodes bound to the unspecified address (as in a
//! container) record the host other nodes reach them at, an IP or a DNS
//! name, and form a cluster through it; without it such a node is refused.

mod common;

use std::time::Duration;

use common::{wait_until, Sandbox};
use lanebus_cluster::{Cluster, ClusterConfig, ClusterError};

const SECRET: &str = "the-cluster-secret-0002";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_bound_to_every_address_form_a_cluster_through_their_advertised_hosts() {
    let mut sb = Sandbox::new();
    // Node 1 advertises an IP, node 2 a DNS name.
    for (id, host) in [(1, "127.0.0.1"), (2, "localhost")] {
        sb.add(id);
        let n = sb.node_mut(id);
        n.raft_addr = "0.0.0.0:0".into();
        n.http_addr = format!("0.0.0.0:{}", 18_100 + id);
        n.secret = Some(SECRET.into());
        n.advertise = Some(host.into());
    }
    sb.node_mut(1).start(true).await;
    sb.node(1).c().bootstrap().await.expect("bootstrap");
    sb.node_mut(2).start(true).await;
    let (raft2, http2) = (
        sb.node(2).c().raft_addr().to_owned(),
        sb.node(2).c().http_addr().to_owned(),
    );
    assert!(raft2.starts_with("localhost:"), "{raft2}");
    assert_eq!(http2, "localhost:18102");
    sb.node(1)
        .c()
        .add_node(2, &raft2, &http2)
        .await
        .expect("add node 2 by its DNS name");
    wait_until(Duration::from_secs(30), "node 2 joined", || {
        sb.node(2).c().joined() && sb.node(2).view().leader == Some(1)
    })
    .await;
    let members = sb.node(2).view().members;
    let addrs: Vec<(u64, &str, &str)> = members
        .iter()
        .map(|m| (m.id, m.raft_addr.as_str(), m.http_addr.as_str()))
        .collect();
    assert_eq!(addrs.len(), 2, "{addrs:?}");
    assert!(
        addrs[0].1.starts_with("127.0.0.1:") && addrs[0].2 == "127.0.0.1:18101",
        "{addrs:?}"
    );
    assert_eq!(
        (addrs[1].1, addrs[1].2),
        (raft2.as_str(), "localhost:18102")
    );
    assert!(
        members.iter().all(|m| !m.raft_addr.starts_with("0.0.0.0")),
        "{addrs:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unspecified_bind_needs_an_advertised_host() {
    let dir = tempfile::tempdir().unwrap();
    let start = |advertise: Option<&str>| {
        let mut cfg = ClusterConfig::new(9, "0.0.0.0:0", "0.0.0.0:18199", dir.path());
        cfg.secret = Some(lanebus_cluster::ClusterSecret(SECRET.into()));
        cfg.advertise_host = advertise.map(str::to_owned);
        Cluster::start(cfg)
    };
    for (advertise, says) in [
        (None, "advertise_addr (--advertise-addr)"),
        (Some("0.0.0.0"), "is an unspecified address"),
        (Some("node_9:80"), "must be an IP or a DNS name"),
    ] {
        match start(advertise).await {
            Err(ClusterError::Config(m)) => assert!(m.contains(says), "{advertise:?}: {m}"),
            Err(e) => panic!("{advertise:?}: {e}"),
            Ok(_) => panic!("{advertise:?}: started"),
        }
    }
}
