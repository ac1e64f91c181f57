//! lanebus test tooling, not part of the product (`publish = false`): what
//! the node's tests, the demo, the chaos suite and the benchmark share.
//!
//! - [`receiver`]: a webhook receiver that records every request, answers
//!   as a test tells it, and judges the invariants of `docs/design.md`
//!   section 2 over what it received ([`receiver::Receiver::verdict`]);
//! - [`local_cluster`]: `lanebus node` child processes on this machine,
//!   with the checks made on them ([`local_cluster::balance`],
//!   [`local_cluster::repeats`]);
//! - [`sample_data`]: the real GitHub payloads shipped in `data/`;
//! - [`signature`]: the Standard Webhooks signature check the receiver
//!   applies, written apart from the node's signing code.
//!
//! It depends on no lanebus crate, so the node's `lanebus demo` can use it.

#![warn(missing_docs)]

pub mod local_cluster;
pub mod receiver;
pub mod sample_data;
pub mod signature;
