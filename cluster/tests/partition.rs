//! A node cut off from the network stops its lanes by its own clock before
//! the others reassign them; healed, it gets its share back. The same for a
//! cut-off leader, which keeps believing it leads for a while.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// Cuts `victim` off and checks: its owned lanes go empty by its own clock
/// before any other node's view shows them reassigned, and they are
/// reassigned (within a deadline a loaded machine meets; when is lease
/// arithmetic, tested with manual time in `lanebus_cluster::lease`).
async fn cut_and_check(sb: &Sandbox, victim: u64, observer: u64, extra: Duration) {
    let victim_lanes = sb.node(victim).owned_now();
    assert!(!victim_lanes.is_empty());
    let lanes = sb.node(victim).c().node_lanes();
    let t0 = Instant::now();
    sb.node(victim).net().set_cut(true);
    let mut stopped_at = None;
    let reassigned_at;
    loop {
        if stopped_at.is_none() && lanes.borrow().owned.is_empty() {
            stopped_at = Some(t0.elapsed());
            assert!(
                sb.node(victim)
                    .c()
                    .node_lanes()
                    .borrow()
                    .releasing
                    .is_empty(),
                "nothing to hand over while the lease is lapsed"
            );
        }
        let v = sb.node(observer).view();
        if victim_lanes
            .iter()
            .all(|&l| v.lanes[usize::from(l)].owner.is_some_and(|o| o != victim))
        {
            reassigned_at = t0.elapsed();
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30) + extra,
            "node {victim}'s lanes not reassigned in time"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stopped_at = stopped_at.expect("the cut-off node stopped its lanes before reassignment");
    eprintln!("node {victim} cut off: stopped its lanes after {stopped_at:?}, reassigned after {reassigned_at:?}");
    assert!(stopped_at < reassigned_at);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_node_stops_its_lanes_before_they_are_reassigned() {
    let mut sb = Sandbox::three_balanced().await;

    // A follower.
    let leader = sb.leader().expect("leader");
    let follower = [1, 2, 3]
        .into_iter()
        .find(|&n| n != leader)
        .expect("follower");
    cut_and_check(&sb, follower, leader, Duration::ZERO).await;
    sb.node(follower).net().set_cut(false);
    wait_until(
        Duration::from_secs(20),
        "healed follower back in balance",
        || balanced_over(&sb.node(leader).view(), &[1, 2, 3]) && views_agree(&sb),
    )
    .await;
    assert!(!sb.node(follower).c().node_lanes().borrow().owned.is_empty());

    // The leader.
    let observer = follower;
    cut_and_check(&sb, leader, observer, Duration::from_secs(2)).await;
    let new_leader = sb.node(observer).view().leader.expect("new leader");
    assert_ne!(new_leader, leader);
    sb.node(leader).net().set_cut(false);
    wait_until(
        Duration::from_secs(20),
        "healed old leader back in balance",
        || balanced_over(&sb.node(observer).view(), &[1, 2, 3]) && views_agree(&sb),
    )
    .await;
    for n in &mut sb.nodes {
        n.kill().await;
    }
}
