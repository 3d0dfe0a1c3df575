//! Routing: a vhost's exchanges, queues and bindings ([`vhost`]), where a published message
//! goes, and the parts of routing that hold messages or state of their own: the delayed-message
//! exchange ([`delayed`]), direct reply-to ([`reply_to`]), and the cluster seam through which
//! topology changes are replicated ([`cluster`]). Imports the queue layer and below; queues reach
//! back up only through [`crate::queue::QueueHost`], which [`vhost::VHost`] implements.

pub mod cluster;
pub mod delayed;
pub mod partitions;
pub mod reply_to;
pub mod vhost;
