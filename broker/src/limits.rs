//! Broker limits with their defaults.

/// Deliveries a consumer may have queued for its socket but not yet written. Bounds each
/// connection's outbox and the memory a slow consumer can pin; acked consumers are further
/// bounded by their prefetch.
pub const CONSUMER_WINDOW_DEFAULT: u32 = 2000;
/// Bytes of deliveries a consumer may have queued for its socket but not yet written (at
/// least one delivery is always allowed, so a message larger than this still goes out).
/// With [`CONSUMER_WINDOW_DEFAULT`] this bounds what a slow consumer pins in memory by size
/// as well as by count.
pub const CONSUMER_WINDOW_BYTES_DEFAULT: u64 = 4 * 1024 * 1024;
/// Highest consumer priority, prefetch and similar values are u16/u32 on the wire; nothing here yet.
pub const CONSUMERS_PER_CHANNEL_MAX: usize = 65_535;
/// Bytes of ready messages a durable queue keeps in memory at its head. Persistent messages
/// that become durable while more than this is ready keep only their place in the store and are
/// read back on delivery: a long backlog costs tens of bytes per message, not its bodies.
pub const QUEUE_HEAD_CACHE_BYTES: u64 = 8 * 1024 * 1024;
/// RabbitMQ's default `consumer_timeout`: a delivery unacked for 30 minutes closes its channel.
pub const CONSUMER_TIMEOUT_DEFAULT_MS: u64 = 30 * 60 * 1000;
/// Ready messages above which a queue whose consumers are receiving pushes back on its
/// publishers: their connections stop reading (RabbitMQ's `flow` state) until it drains below
/// half of this, for at most [`FLOW_PAUSE_MAX_MS`] at a time. Without it, publishers that are
/// cheaper to serve than consumers grow the queue without bound and starve the consumers
/// (measured: 4 publisher/consumer pairs fell from 320k to 92k deliveries/s at 4 GB RSS).
pub const FLOW_READY_HIGH: u64 = 10_000;
/// Ready bytes with the same effect as [`FLOW_READY_HIGH`].
pub const FLOW_READY_BYTES_HIGH: u64 = 16 * 1024 * 1024;
/// Longest one flow pause: a publisher still makes progress if the queue does not drain.
pub const FLOW_PAUSE_MAX_MS: u64 = 10;
/// A queue with no delivery for this long does not push back: its consumers are stuck or
/// absent (a backlog is allowed to build, as in RabbitMQ), not slower than its publishers.
pub const FLOW_CONSUMER_IDLE_MS: u64 = 100;
/// Messages submitted to a stream's writer and not yet durable above which its publishers
/// pause as for [`FLOW_READY_HIGH`] (until below half): the writer's own bound
/// ([`crate::stream::writer::SUBMISSIONS_MAX`]) would block a connection task instead.
pub const STREAM_PENDING_HIGH: u64 = 8192;
/// Bytes with the same effect as [`STREAM_PENDING_HIGH`].
pub const STREAM_PENDING_BYTES_HIGH: u64 = 64 * 1024 * 1024;
/// Users that may log in only from a loopback address (RabbitMQ's `loopback_users`).
pub const LOOPBACK_USERS: &[&str] = &["guest"];
/// The user a fresh node creates (RabbitMQ's `default_user` / `default_pass`), with the
/// administrator tag and full permissions on the default vhost.
pub const DEFAULT_USER: &str = "guest";
/// Its password.
pub const DEFAULT_PASS: &str = "guest";
/// Most partitions of one super stream or partitioned queue (RabbitMQ bounds super streams by
/// its `max_super_stream_partitions`): each is a queue of its own.
pub const SUPER_STREAM_PARTITIONS_MAX: u32 = 1024;
