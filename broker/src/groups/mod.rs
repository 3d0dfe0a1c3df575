//! Consumer groups of partitioned queues: the pure assignment machine ([`machine`]). The
//! driver that carries its effects out to consumers lives in the node layer.

pub mod machine;
#[cfg(test)]
mod machine_tests;

pub use machine::{GroupCommand, GroupEffect, GroupKey, GroupTable, MemberId, Slot};
