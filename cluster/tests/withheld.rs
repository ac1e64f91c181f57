//! A member that withholds its lease renewals (what a node does while its
//! actor thread is stalled) stops its own lanes when its lease lapses,
//! before any of them is reassigned; the leader moves them to the others
//! after the lease plus the margin; once it renews again it gets lanes
//! again. For a follower, then for the leader itself.

mod common;

use std::time::{Duration, Instant};

use common::*;
use lanebus_cluster::NodeId;

/// Withholds `victim`'s renewals, checks the order of stop and move as
/// `leader` sees it, then lets it renew and waits for the balance.
async fn withhold_and_check(sb: &Sandbox, victim: NodeId, observer: NodeId) {
    let victim_lanes = sb.node(victim).owned_now();
    assert!(!victim_lanes.is_empty());
    let lanes = sb.node(victim).c().node_lanes();
    let t0 = Instant::now();
    sb.node(victim).c().withhold_renewals(true);
    let (mut stopped_at, mut first_moved) = (None, None);
    loop {
        if stopped_at.is_none() && lanes.borrow().owned.is_empty() {
            stopped_at = Some(t0.elapsed());
        }
        let v = sb.node(observer).view();
        let moved = |l: &u16| v.lanes[usize::from(*l)].owner.is_some_and(|o| o != victim);
        if first_moved.is_none() && victim_lanes.iter().any(moved) {
            first_moved = Some(t0.elapsed());
        }
        if victim_lanes.iter().all(moved) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "node {victim}'s lanes not reassigned in time"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stopped_at = stopped_at.expect("the withholding node stopped its lanes before any moved");
    let first_moved = first_moved.expect("moved");
    eprintln!("node {victim} withholding renewals: stopped its lanes after {stopped_at:?}, the first moved after {first_moved:?}");
    assert!(stopped_at < first_moved);
    let others: Vec<_> = [1, 2, 3].into_iter().filter(|&n| n != victim).collect();
    wait_until(Duration::from_secs(10), "2 nodes balanced", || {
        balanced_over(&sb.node(observer).view(), &others)
    })
    .await;

    sb.node(victim).c().withhold_renewals(false);
    wait_until(
        Duration::from_secs(30),
        "3 nodes balanced again after renewals resumed",
        || balanced_over(&sb.node(observer).view(), &[1, 2, 3]) && views_agree(sb),
    )
    .await;
    assert!(
        !sb.node(victim).c().node_lanes().borrow().owned.is_empty(),
        "node {victim} works lanes again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_withholding_renewals_loses_its_lanes_and_gets_them_back() {
    let sb = Sandbox::three_balanced().await;
    let leader = sb.leader().expect("a leader");
    let follower = [1, 2, 3]
        .into_iter()
        .find(|&n| n != leader)
        .expect("a follower");
    withhold_and_check(&sb, follower, leader).await;
    // The leader withholding its own: it moves its own lanes away.
    let leader = sb.leader().expect("a leader");
    let observer = [1, 2, 3]
        .into_iter()
        .find(|&n| n != leader)
        .expect("another member");
    withhold_and_check(&sb, leader, observer).await;
}
