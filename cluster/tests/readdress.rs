//! A member restarted at other addresses (a new IP or other ports, as after
//! a container is rescheduled) records them itself: the others reach it
//! again, it renews its lease and gets its share of lanes back, without an
//! operator removing and re-joining it.

mod common;

use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_restarted_at_other_addresses_is_reached_there() {
    let mut sb = Sandbox::three_balanced().await;
    let old_raft = sb.node(3).raft_addr.clone();

    // Node 3 comes back on another Raft port and another HTTP port, from
    // its data dir.
    sb.node_mut(3).kill().await;
    sb.node_mut(3).raft_addr = "127.0.0.1:0".into();
    sb.node_mut(3).http_addr = "127.0.0.1:18203".into();
    sb.node_mut(3).start(true).await;
    let new_raft = sb.node(3).raft_addr.clone();
    assert_ne!(new_raft, old_raft);

    wait_until(
        Duration::from_secs(60),
        "node 3 recorded at its new addresses and balanced again",
        || {
            let v = sb.node(1).view();
            let recorded = v
                .members
                .iter()
                .any(|m| m.id == 3 && m.raft_addr == new_raft && m.http_addr == "127.0.0.1:18203");
            recorded && sb.node(3).c().joined() && balanced_over(&v, &[1, 2, 3]) && views_agree(&sb)
        },
    )
    .await;
    // Raft reaches it there: it applies what the leader commits now.
    sb.node(1).c().remove_node(2).await.expect("remove node 2");
    wait_until(Duration::from_secs(30), "node 3 sees node 2 leave", || {
        sb.node(3).view().members.iter().all(|m| m.id != 2)
    })
    .await;
}
