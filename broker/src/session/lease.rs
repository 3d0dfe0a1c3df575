//! Warren's AMQP lease extension: extending a delivery's consumer timeout and giving it back
//! with a delay, sent by unmodified clients as a `basic.publish` to the reserved exchange
//! [`LEASE_EXCHANGE`] on the channel that holds the delivery.
//!
//! | routing key | headers | what happens |
//! |---|---|---|
//! | `extend` | `x-delivery-tag` (integer), `x-lease-ms` (integer ≥ 1) | the delivery's consumer-timeout deadline moves to `x-lease-ms` from now, cut to the queue's `x-lease-extension-max-ms` and to `x-lease-lifetime-max-ms` after the delivery |
//! | `release` | `x-delivery-tag`, optional `x-delay-ms` (integer ≥ 0), optional `x-reason` (string) | the delivery goes back as failed (as `basic.nack` with requeue), ready again after `x-delay-ms` (without it: the queue's retry policy); past the delivery limit it is dead-lettered with `x-reason` as its failure reason |
//!
//! The message body is ignored. A confirm channel's publish is confirmed once done. A tag this
//! channel does not hold is `406 PRECONDITION_FAILED - unknown delivery tag N`, as
//! `basic.ack` answers; other misuse is a 406 naming it. The server advertises the extension
//! as the capability `warren.lease_extension`. Names under `amq.` are reserved, so no
//! exchange of a user's can collide, and a RabbitMQ answers such a publish with 404.

use warren_amqp::assembler::Content;
use warren_amqp::{AmqpError, ReplyCode};

use super::common::stream_requeue_refused;
use super::{Call, Mode};

/// The reserved exchange a client publishes to for the extension.
pub const LEASE_EXCHANGE: &str = "amq.warren.lease";

/// Most bytes of an `x-reason` kept.
pub const LEASE_REASON_MAX: usize = 1_024;

fn refused(text: impl std::fmt::Display) -> AmqpError {
    AmqpError::channel(ReplyCode::PreconditionFailed, text)
}

fn int_header(headers: &amq_protocol::types::FieldTable, key: &str) -> Option<i128> {
    headers.inner().get(key).and_then(crate::args::int_value)
}

impl Call<'_> {
    /// A publish to [`LEASE_EXCHANGE`]: extend or release one of this channel's deliveries.
    pub(super) fn lease_extension(
        &mut self,
        routing_key: &str,
        content: &Content,
    ) -> Result<(), AmqpError> {
        if matches!(self.chan.mode, Mode::Tx(_)) {
            return Err(refused(format!(
                "{LEASE_EXCHANGE} is not transactional: use it outside tx.select"
            )));
        }
        let headers = content.properties.headers().unwrap_or_default();
        let tag = int_header(&headers, "x-delivery-tag")
            .and_then(|t| u64::try_from(t).ok())
            .ok_or_else(|| refused(format!("{LEASE_EXCHANGE} needs an integer x-delivery-tag")))?;
        let Some(u) = self.chan.unacked.get(&tag) else {
            return Err(refused(format!("unknown delivery tag {tag}")));
        };
        match routing_key {
            "extend" => {
                let lease_ms = int_header(&headers, "x-lease-ms")
                    .and_then(|n| u64::try_from(n).ok())
                    .filter(|n| *n > 0)
                    .ok_or_else(|| {
                        refused("extend needs an x-lease-ms header of at least 1 (ms)")
                    })?;
                // Without a consumer timeout nothing would end the delivery: nothing to move.
                if u.deadline != u64::MAX {
                    let cfg = u.queue.work_config().lease;
                    let now = crate::timers::wall_ms();
                    let deadline = now
                        .saturating_add(lease_ms.min(cfg.extension_max_ms))
                        .min(u.delivered_at.saturating_add(cfg.lifetime_max_ms))
                        // Past the lifetime cap an extension does not pull a deadline still
                        // ahead back before now + 1 ms; one already passed stays passed.
                        .max(u.deadline.min(now.saturating_add(1)));
                    let old = u.deadline;
                    self.chan.deadlines.remove(&(old, tag));
                    self.chan.deadlines.insert((deadline, tag));
                    if let Some(u) = self.chan.unacked.get_mut(&tag) {
                        u.deadline = deadline;
                    }
                }
            }
            "release" => {
                if u.queue.is_stream {
                    return Err(stream_requeue_refused(&u.queue));
                }
                let delay_ms = match headers.inner().get("x-delay-ms") {
                    None => None,
                    Some(v) => Some(
                        crate::args::int_value(v)
                            .and_then(|n| u64::try_from(n).ok())
                            .filter(|n| i128::from(*n) <= crate::args::work::WORK_MS_MAX)
                            .ok_or_else(|| {
                                refused("x-delay-ms must be an integer from 0 to 4294967295 (ms)")
                            })?,
                    ),
                };
                let mut reason = headers
                    .inner()
                    .get("x-reason")
                    .and_then(crate::args::text_value)
                    .unwrap_or_default();
                if reason.len() > LEASE_REASON_MAX {
                    let mut end = LEASE_REASON_MAX;
                    while !reason.is_char_boundary(end) {
                        end -= 1;
                    }
                    reason.truncate(end);
                }
                let Some(u) = self.chan.unacked.remove(&tag) else {
                    return Err(refused(format!("unknown delivery tag {tag}")));
                };
                self.chan.deadlines.remove(&(u.deadline, tag));
                let worker = self
                    .chan
                    .consumers
                    .iter()
                    .find(|(_, c)| c.id == u.consumer)
                    .map_or_else(|| "basic.get".to_string(), |(t, _)| t.clone());
                u.queue.retry(vec![u.id], delay_ms, reason, worker);
                self.chan.limiter.release(u32::from(u.counted)).run();
            }
            other => {
                return Err(refused(format!(
                    "{LEASE_EXCHANGE} takes routing key extend or release, not '{other}'"
                )));
            }
        }
        // Confirmed at the next flush: nothing waits for a store.
        let _ = self.chan.mode.next_publish_seq();
        Ok(())
    }
}
