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
