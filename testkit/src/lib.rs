//! lanebus test tooling, not part of the product (`publish = false`): what
//! the node's tests, the demo, the chaos suite and the benchmark share.
//!
//! - [`receiver`]: a webhook receiver that records every request, answers
//!   as a test tells it, and judges the invariants of `docs/design.md`
//!   section 2 over what it received ([`receiver::Receiver::verdict`]);
//! - [`local_cluster`]: `lanebus node` child processes on this machine,
//!   with the checks made on them ([`local_cluster::balance`],
//!   [`local_cluster::repeats`]);
//! - [`oracle`]: the chaos suite's judge of a whole run (acknowledged
//!   publishes, the receiver's requests with their senders, lane samples):
//!   loss, order and overlaps per (handler, key), every repeat attributed
//!   to a cause, fencing, atomic publish;
//! - [`invariants`]: the one invariant checker the three above share:
//!   expected deliveries and observed hand-overs, judged by one set of
//!   rules (loss, order with rewinds, repeats with causes, overlaps);
//! - [`sample_data`]: the real GitHub payloads shipped in `data/`;
//! - [`lane`]: the contract's lane of an event, computed apart from the store;
//! - [`signature`]: the Standard Webhooks signature check the receiver
//!   applies, written apart from the node's signing code.
//!
//! It depends on no lanebus crate, so the node's `lanebus demo` can use it.

#![warn(missing_docs)]

pub mod invariants;
pub mod lane;
pub mod local_cluster;
pub mod oracle;
pub mod receiver;
pub mod sample_data;
pub mod signature;
