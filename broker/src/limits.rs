//! Broker limits with their defaults.

/// Deliveries a consumer may have queued for its socket but not yet written. Bounds each
/// connection's outbox and the memory a slow consumer can pin; acked consumers are further
/// bounded by their prefetch.
pub const CONSUMER_WINDOW_DEFAULT: u32 = 2000;
/// Highest consumer priority, prefetch and similar values are u16/u32 on the wire; nothing here yet.
pub const CONSUMERS_PER_CHANNEL_MAX: usize = 65_535;
