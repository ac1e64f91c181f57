//! A member that withholds its lease renewals (what a node does while its
//! actor thread is stalled) stops its own lanes when its lease lapses, the
//! leader moves them to the others after the lease plus the margin, and
//! once it renews again it gets lanes again.

mod common;

use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_withholding_renewals_loses_its_lanes_and_gets_them_back() {
    let sb = Sandbox::three_balanced().await;
    let leader = sb.leader().expect("a leader");
    let victim = [1, 2, 3]
        .into_iter()
        .find(|&n| n != leader)
        .expect("a follower");
    let others: Vec<_> = [1, 2, 3].into_iter().filter(|&n| n != victim).collect();

    sb.node(victim).c().withhold_renewals(true);
    wait_until(
        Duration::from_secs(30),
        "the withholding member's own lanes stopped and reassigned",
        || {
            let v = sb.node(leader).view();
            sb.node(victim).c().owned_lanes().borrow().is_empty()
                && v.lanes
                    .iter()
                    .all(|l| l.owner.is_some() && l.owner != Some(victim))
        },
    )
    .await;
    wait_until(Duration::from_secs(10), "2 nodes balanced", || {
        balanced_over(&sb.node(leader).view(), &others)
    })
    .await;

    sb.node(victim).c().withhold_renewals(false);
    wait_until(
        Duration::from_secs(30),
        "3 nodes balanced again after renewals resumed",
        || {
            let v = sb.node(leader).view();
            balanced_over(&v, &[1, 2, 3]) && views_agree(&sb)
        },
    )
    .await;
    assert!(
        !sb.node(victim).c().owned_lanes().borrow().is_empty(),
        "the member works lanes again"
    );
}
