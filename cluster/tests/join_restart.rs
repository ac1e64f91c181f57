//! A fourth node joins and gets a quarter of the lanes by handover; removed on
//! purpose, it hands them back; then the whole cluster restarts from its data
//! dirs with the same members and lane table.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use lanebus_cluster::assignment::LaneState;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fourth_node_joins_by_handover_leaves_by_handover_and_all_restart() {
    let mut sb = Sandbox::three_balanced().await;
    // From here the test itself plays the drained lane owners.
    for id in [1, 2, 3] {
        sb.node_mut(id).set_drainer(false);
    }
    let before = owners(&sb.node(1).view());

    sb.add(4);
    sb.node_mut(4).start(false).await;
    sb.join(2, 4).await; // through a member that may not be the leader

    // The leader asks the others to hand 64 lanes over to node 4.
    let mut handing: BTreeMap<u64, Vec<u16>> = BTreeMap::new();
    wait_until(
        Duration::from_secs(10),
        "64 lanes in handover to node 4",
        || {
            handing = [1, 2, 3]
                .into_iter()
                .map(|id| {
                    (
                        id,
                        sb.node(id)
                            .c()
                            .node_lanes()
                            .borrow()
                            .releasing
                            .keys()
                            .copied()
                            .collect(),
                    )
                })
                .collect();
            handing.values().map(Vec::len).sum::<usize>() == 64
        },
    )
    .await;
    for (&id, lanes) in &handing {
        let owned = sb.node(id).c().node_lanes().borrow().owned.clone();
        for l in lanes {
            assert!(
                !owned.contains_key(l),
                "node {id} still works lane {l} it hands over"
            );
            assert_eq!(sb.node(id).c().node_lanes().borrow().releasing[l].to, 4);
        }
    }
    assert!(
        sb.node(4).c().node_lanes().borrow().owned.is_empty(),
        "nothing moves before release"
    );

    // Drained: release. Node 4 owns them at epoch + 1.
    for (&id, lanes) in &handing {
        for &l in lanes {
            let at = sb.node(id).c().node_lanes().borrow().releasing[&l].at;
            sb.node(id).c().release(l, at).await.expect("release");
        }
    }
    wait_until(Duration::from_secs(10), "node 4 owns 64 lanes", || {
        sb.node(4).c().node_lanes().borrow().owned.len() == 64
    })
    .await;
    let owned4 = sb.node(4).c().node_lanes().borrow().owned.clone();
    for (lane, epoch) in &owned4 {
        assert_eq!(*epoch, before[lane].1.next(), "lane {lane}");
    }
    wait_until(Duration::from_secs(10), "4 nodes balanced", || {
        balanced_over(&sb.node(1).view(), &[1, 2, 3, 4]) && views_agree(&sb)
    })
    .await;
    let v = sb.node(1).view();
    assert_eq!(voters(&v), 3, "the fourth node stays a learner");
    assert!(
        !v.members
            .iter()
            .find(|m| m.id == 4)
            .expect("member 4")
            .voter
    );
    // Releasing again is refused with the reason.
    let lane = *owned4.keys().next().expect("a lane");
    let err = sb.node(1).c().release(lane, None).await.unwrap_err();
    assert!(err.to_string().contains("not being released"), "{err}");

    // Planned removal of node 4: its lanes are handed back (epoch + 1 each),
    // then it is removed from Raft and forgotten.
    for id in [1, 2, 3, 4] {
        sb.node_mut(id).set_drainer(true);
    }
    let before = owners(&sb.node(1).view());
    sb.node(3).c().remove_node(4).await.expect("remove");
    wait_until(
        Duration::from_secs(15),
        "node 4 drained and forgotten",
        || {
            let v = sb.node(1).view();
            balanced_over(&v, &[1, 2, 3])
                && v.members.len() == 3
                && views_agree_among(&sb, &[1, 2, 3])
        },
    )
    .await;
    let after = owners(&sb.node(1).view());
    for (lane, (owner, epoch)) in &before {
        if *owner == Some(4) {
            assert_eq!(after[lane].1, epoch.next(), "lane {lane} handed over once");
        } else {
            assert_eq!(after[lane], (*owner, *epoch), "lane {lane} moved");
        }
    }
    sb.node_mut(4).kill().await;

    // The whole cluster stops and starts again from its data dirs.
    let expected = after_restart(&replicated(&sb.node(1).view()));
    for id in [1, 2, 3] {
        sb.node_mut(id).kill().await;
    }
    for id in [1, 2, 3] {
        sb.node_mut(id).start(true).await;
    }
    // Same members and owners; every lane one epoch further once the
    // restarted processes recorded their incarnations.
    wait_until(
        Duration::from_secs(20),
        "restarted cluster has a leader, agrees, and has the expected lane table",
        || sb.leader().is_some() && views_agree(&sb) && replicated(&sb.node(1).view()) == expected,
    )
    .await;
    let v = sb.node(1).view();
    assert!(v.lanes.iter().all(|l| l.state == LaneState::Active));
    wait_until(
        Duration::from_secs(5),
        "restarted nodes work their lanes",
        || {
            [1, 2, 3]
                .into_iter()
                .all(|id| sb.node(id).c().node_lanes().borrow().owned.len() >= 85)
        },
    )
    .await;
    for n in &mut sb.nodes {
        n.kill().await;
    }
}
