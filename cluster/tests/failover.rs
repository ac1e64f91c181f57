//! Three nodes on 127.0.0.1: formation, a follower killed, the killed node
//! restarted from its data dir, then the leader killed.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::*;

/// A deadline for a reassignment after a node died, not a speed check:
/// reassignment at lease + margin is lease arithmetic, tested with manual
/// time in `lanebus_cluster::lease`.
fn failover_bound() -> Duration {
    Duration::from_secs(30)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_form_lose_a_follower_and_the_leader() {
    let mut sb = Sandbox::new();
    sb.start_cluster(&[1, 2, 3]).await;

    // Formation: balanced, three voters, the same view everywhere.
    wait_until(
        Duration::from_secs(20),
        "3 nodes balanced, 3 voters, views agree",
        || {
            let v = sb.node(1).view();
            balanced_over(&v, &[1, 2, 3]) && voters(&v) == 3 && views_agree(&sb)
        },
    )
    .await;
    for n in sb.running() {
        let owned = n.c().node_lanes().borrow().owned.clone();
        assert!(
            (85..=86).contains(&owned.len()),
            "node {} owns {}",
            n.id,
            owned.len()
        );
    }

    // A follower dies: its lanes go to the others within the bound; no other
    // lane moves; moved epochs grow.
    let leader = sb.leader().expect("a leader");
    let victim = [1, 2, 3]
        .into_iter()
        .find(|&n| n != leader)
        .expect("a follower");
    let before = owners(&sb.node(leader).view());
    let t0 = Instant::now();
    sb.node_mut(victim).kill().await;
    let took = wait_until(
        failover_bound(),
        "the dead follower's lanes reassigned",
        || {
            let v = sb.node(leader).view();
            v.lanes
                .iter()
                .all(|l| l.owner.is_some() && l.owner != Some(victim))
        },
    )
    .await;
    let took = took.max(t0.elapsed());
    eprintln!("failover after a follower was killed: {took:?}");
    let after = owners(&sb.node(leader).view());
    for (lane, (owner, epoch)) in &before {
        let (new_owner, new_epoch) = after[lane];
        if *owner == Some(victim) {
            assert!(new_epoch > *epoch, "lane {lane}: epoch must grow");
        } else {
            assert_eq!(
                (new_owner, new_epoch),
                (*owner, *epoch),
                "lane {lane} moved"
            );
        }
    }
    let alive: Vec<_> = [1, 2, 3].into_iter().filter(|&n| n != victim).collect();
    wait_until(Duration::from_secs(5), "2 nodes balanced", || {
        balanced_over(&sb.node(leader).view(), &alive) && views_agree(&sb)
    })
    .await;

    // The killed node restarts from its data dir (no bootstrap, no join) and
    // gets its share back by handover.
    sb.node_mut(victim).start(true).await;
    wait_until(
        Duration::from_secs(20),
        "restarted node rejoined and balanced",
        || {
            let v = sb.node(leader).view();
            balanced_over(&v, &[1, 2, 3]) && views_agree(&sb)
        },
    )
    .await;

    // The leader dies: a new one is elected; only the old leader's lanes move.
    let before = owners(&sb.node(victim).view());
    let t0 = Instant::now();
    sb.node_mut(leader).kill().await;
    let elected = wait_until(Duration::from_secs(10), "a new leader", || {
        sb.leader().is_some_and(|l| l != leader)
    })
    .await;
    let took = wait_until(
        failover_bound() + elected,
        "the dead leader's lanes reassigned",
        || {
            let v = sb.node(victim).view();
            v.lanes
                .iter()
                .all(|l| l.owner.is_some() && l.owner != Some(leader))
        },
    )
    .await;
    let took = took.max(t0.elapsed());
    eprintln!("new leader after {elected:?}; failover after the leader was killed: {took:?}");
    let new_leader = sb.leader().expect("leader");
    let after = owners(&sb.node(new_leader).view());
    for (lane, (owner, epoch)) in &before {
        let (new_owner, new_epoch) = after[lane];
        if *owner == Some(leader) {
            assert!(new_epoch > *epoch, "lane {lane}: epoch must grow");
        } else {
            assert_eq!(
                (new_owner, new_epoch),
                (*owner, *epoch),
                "lane {lane} moved"
            );
        }
    }
    let owners_now: BTreeSet<_> = after.values().filter_map(|(o, _)| *o).collect();
    assert!(!owners_now.contains(&leader));
    for n in &mut sb.nodes {
        n.kill().await;
    }
}
