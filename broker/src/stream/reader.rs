//! A stream consumer over AMQP 0-9-1: what its basic.consume asks for, and its cursor.
//!
//! RabbitMQ's rules for stream consumers, with its reply codes and texts: a prefetch is
//! required (406 `consumer prefetch count is not set for stream ...`), automatic
//! acknowledgement is refused (540 `automatic acknowledgement not supported by stream ...`),
//! and an ack only gives credit back: nothing is removed. The cursor delivers in offset order
//! within its credit, skipping chunks whose filter cannot match and messages that do not.

use amq_protocol::types::{AMQPValue, FieldTable};
use warren_amqp::{AmqpError, ReplyCode};

use super::filter::message_matches;
use super::log::StreamLog;
use super::spec::OffsetSpec;

/// Longest consumer name for server-side offset tracking (`x-stream-consumer-name`).
pub const CONSUMER_NAME_MAX: usize = super::log::TRACKED_NAME_MAX;

/// What a basic.consume on a stream asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumeSpec {
    /// Where to start (`x-stream-offset`, default `next`).
    pub offset: OffsetSpec,
    /// `x-stream-filter`: the filter values wanted (empty: every message).
    pub filter: Vec<String>,
    /// `x-stream-match-unfiltered`: also messages without a filter value.
    pub match_unfiltered: bool,
    /// Warren's `x-stream-consumer-name`: the broker tracks this consumer's offset and a
    /// consumer of that name without `x-stream-offset` resumes after it.
    pub name: Option<String>,
    /// Whether `x-stream-offset` was given (a named consumer that gives one starts there).
    pub explicit_offset: bool,
}

/// Read and check a stream consume: `what` is RabbitMQ's `queue 'q' in vhost '/'`.
///
/// # Errors
/// RabbitMQ's refusals: no prefetch (406), automatic acknowledgement (540), a bad
/// `x-stream-offset` or a bad consumer name (406).
pub fn consume_spec(
    args: &FieldTable,
    prefetch: u16,
    no_ack: bool,
    what: &str,
) -> Result<ConsumeSpec, AmqpError> {
    if prefetch == 0 {
        return Err(AmqpError::channel(
            ReplyCode::PreconditionFailed,
            // RabbitMQ's text, quotes and all ('~ts' around the resource string).
            format!("consumer prefetch count is not set for '{what}'"),
        ));
    }
    if no_ack {
        return Err(AmqpError::channel(
            ReplyCode::NotImplemented,
            format!("automatic acknowledgement not supported by stream queues {what}"),
        ));
    }
    let table = args.inner();
    let (offset, explicit_offset) = match table.get("x-stream-offset") {
        None => (OffsetSpec::Next, false),
        Some(v) => (
            OffsetSpec::from_value(v)
                .map_err(|e| AmqpError::channel(ReplyCode::PreconditionFailed, e.to_string()))?,
            true,
        ),
    };
    let text = crate::args::text_value;
    // As RabbitMQ: a string or an array of strings (other elements ignored).
    let filter: Option<Vec<String>> = match table.get("x-stream-filter") {
        Some(AMQPValue::FieldArray(a)) => Some(a.as_slice().iter().filter_map(text).collect()),
        Some(v) => text(v).map(|s| vec![s]),
        None => None,
    };
    let match_unfiltered = filter.is_some()
        && matches!(
            table.get("x-stream-match-unfiltered"),
            Some(AMQPValue::Boolean(true))
        );
    let name = match table.get("x-stream-consumer-name") {
        None => None,
        Some(v) => match text(v) {
            Some(n) if !n.is_empty() && n.len() <= CONSUMER_NAME_MAX => Some(n),
            _ => {
                return Err(AmqpError::channel(
                    ReplyCode::PreconditionFailed,
                    format!(
                        "x-stream-consumer-name must be a string of 1 to {CONSUMER_NAME_MAX} bytes"
                    ),
                ));
            }
        },
    };
    Ok(ConsumeSpec {
        offset,
        filter: filter.unwrap_or_default(),
        match_unfiltered,
        name,
        explicit_offset,
    })
}

/// One consumer's position and credit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// The next offset to look at.
    pub next: u64,
    /// Deliveries it may still receive before acking (the prefetch, given back by acks).
    pub credit: u32,
    filter: Vec<String>,
    match_unfiltered: bool,
}

/// One message the cursor chose from a chunk: its offset and its index in the chunk's
/// messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    /// The message's offset (the `x-stream-offset` header of its delivery).
    pub offset: u64,
    /// Its index in the chunk.
    pub index: usize,
}

impl Cursor {
    /// A consumer attaching to `log` at `now_ms` with `spec` and `prefetch`; `stored` is the
    /// next offset tracked for its name, if any (used unless it gave `x-stream-offset`).
    #[must_use]
    pub fn attach(
        log: &StreamLog,
        spec: &ConsumeSpec,
        prefetch: u16,
        stored: Option<u64>,
        now_ms: u64,
    ) -> Self {
        let next = match stored {
            Some(s) if !spec.explicit_offset => s.clamp(log.first_offset(), log.next_offset()),
            _ => log.resolve(spec.offset, now_ms),
        };
        Self {
            next,
            credit: u32::from(prefetch),
            filter: spec.filter.clone(),
            match_unfiltered: spec.match_unfiltered,
        }
    }

    /// An ack (or nack, or reject: a stream removes nothing) of `n` deliveries gives their
    /// credit back, up to `prefetch`.
    pub fn settle(&mut self, n: u32, prefetch: u16) {
        self.credit = self.credit.saturating_add(n).min(u32::from(prefetch));
    }

    /// The chunk to read next (its first offset), skipping chunks whose filter rules it out
    /// and what retention dropped; None when it has no credit or is at `durable_next` (the
    /// writer's durable end: a consumer never sees what a crash could take back).
    #[must_use]
    pub fn next_chunk(&mut self, log: &StreamLog, durable_next: u64) -> Option<u64> {
        if self.credit == 0 {
            return None;
        }
        self.next = self.next.max(log.first_offset());
        for (_, chunk) in log.chunks_from(self.next) {
            if chunk.first >= durable_next {
                return None;
            }
            if chunk.filter.may_match(&self.filter, self.match_unfiltered) {
                return Some(chunk.first);
            }
            // Nothing in it can match: move past it without reading it.
            self.next = chunk.end();
        }
        None
    }

    /// Choose from a chunk read back (starting at offset `first`, `values` its messages'
    /// filter values) what to deliver now, within the credit, and move past it.
    pub fn pick(&mut self, first: u64, values: &[Option<&str>]) -> Vec<Pick> {
        let mut picks = Vec::new();
        for (index, value) in values.iter().enumerate() {
            let offset = first + index as u64;
            if offset < self.next {
                continue;
            }
            if self.credit == 0 {
                break;
            }
            self.next = offset + 1;
            if message_matches(*value, &self.filter, self.match_unfiltered) {
                self.credit -= 1;
                picks.push(Pick { offset, index });
            }
        }
        picks
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::table as args;
    use crate::stream::log::{Command, MessageMeta, StreamConfig};
    use amq_protocol::types::{FieldArray, LongString};

    fn text(s: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(s))
    }

    const WHAT: &str = "queue 's' in vhost '/'";

    #[test]
    fn consumes_are_refused_as_rabbitmq_refuses_them() {
        let e = consume_spec(&FieldTable::default(), 0, false, WHAT).unwrap_err();
        assert_eq!(e.code, ReplyCode::PreconditionFailed);
        assert!(
            e.to_string()
                .contains("consumer prefetch count is not set for 'queue 's' in vhost '/''"),
            "{e}"
        );
        let e = consume_spec(&FieldTable::default(), 10, true, WHAT).unwrap_err();
        assert_eq!(e.code, ReplyCode::NotImplemented);
        assert!(
            e.to_string()
                .contains("automatic acknowledgement not supported by stream queues queue 's'"),
            "{e}"
        );
        let e = consume_spec(
            &args(&[("x-stream-offset", text("sometime"))]),
            10,
            false,
            WHAT,
        )
        .unwrap_err();
        assert_eq!(e.code, ReplyCode::PreconditionFailed);
        let e = consume_spec(
            &args(&[("x-stream-consumer-name", text(""))]),
            10,
            false,
            WHAT,
        )
        .unwrap_err();
        assert_eq!(e.code, ReplyCode::PreconditionFailed);
    }

    #[test]
    fn consume_arguments_read() {
        let s = consume_spec(&FieldTable::default(), 10, false, WHAT).unwrap();
        assert_eq!(
            (s.offset, s.explicit_offset, s.filter.len()),
            (OffsetSpec::Next, false, 0)
        );
        let s = consume_spec(
            &args(&[
                ("x-stream-offset", AMQPValue::LongLongInt(-5)),
                (
                    "x-stream-filter",
                    AMQPValue::FieldArray(FieldArray::from(vec![
                        text("ca"),
                        text("tx"),
                        AMQPValue::Boolean(true),
                    ])),
                ),
                ("x-stream-match-unfiltered", AMQPValue::Boolean(true)),
                ("x-stream-consumer-name", text("billing")),
            ]),
            10,
            false,
            WHAT,
        )
        .unwrap();
        assert_eq!(s.offset, OffsetSpec::FromEnd(5));
        assert_eq!(s.filter, vec!["ca".to_string(), "tx".to_string()]);
        assert!(s.match_unfiltered && s.explicit_offset);
        assert_eq!(s.name.as_deref(), Some("billing"));
        // Match-unfiltered means nothing without a filter (RabbitMQ).
        let s = consume_spec(
            &args(&[("x-stream-match-unfiltered", AMQPValue::Boolean(true))]),
            1,
            false,
            WHAT,
        )
        .unwrap();
        assert!(!s.match_unfiltered);
    }

    fn stream(chunks: &[&[Option<&str>]]) -> StreamLog {
        let mut l = StreamLog::new(StreamConfig::default());
        for (t, values) in chunks.iter().enumerate() {
            let metas = values
                .iter()
                .map(|v| MessageMeta {
                    bytes: 10,
                    filter: v.map(str::to_string),
                })
                .collect();
            l.apply(t as u64, Command::Append(metas)).unwrap();
        }
        l
    }

    #[test]
    fn a_cursor_reads_within_its_credit_and_skips_unmatched_chunks() {
        let chunks: &[&[Option<&str>]] = &[
            &[Some("tx"), Some("tx")],       // 0..2: cannot match "ca"
            &[Some("ca"), Some("tx"), None], // 2..5
            &[None, Some("ca")],             // 5..7
        ];
        let log = stream(chunks);
        let spec = ConsumeSpec {
            offset: OffsetSpec::First,
            filter: vec!["ca".into()],
            match_unfiltered: false,
            name: None,
            explicit_offset: true,
        };
        let mut c = Cursor::attach(&log, &spec, 1, None, 0);
        assert_eq!(
            c.next_chunk(&log, u64::MAX),
            Some(2),
            "the first chunk is skipped unread"
        );
        assert_eq!(
            c.pick(2, chunks[1]),
            vec![Pick {
                offset: 2,
                index: 0
            }]
        );
        // Out of credit: nothing until an ack.
        assert_eq!(c.next_chunk(&log, u64::MAX), None);
        c.settle(1, 1);
        assert_eq!(
            c.next_chunk(&log, u64::MAX),
            Some(2),
            "the rest of the chunk"
        );
        assert_eq!(c.pick(2, chunks[1]), vec![]);
        assert_eq!(c.next_chunk(&log, u64::MAX), Some(5));
        assert_eq!(
            c.pick(5, chunks[2]),
            vec![Pick {
                offset: 6,
                index: 1
            }]
        );
        c.settle(1, 1);
        assert_eq!(c.next_chunk(&log, u64::MAX), None, "at the end");
        assert_eq!(c.next, 7);
        // Nothing past the durable end, even with credit.
        let mut d = Cursor::attach(&log, &spec, 5, None, 0);
        assert_eq!(d.next_chunk(&log, 2), None);
        assert_eq!(d.next_chunk(&log, 5), Some(2));
        // A named consumer resumes from its stored offset unless it asks for one.
        let named = ConsumeSpec {
            explicit_offset: false,
            name: Some("b".into()),
            ..spec.clone()
        };
        assert_eq!(Cursor::attach(&log, &named, 5, Some(4), 0).next, 4);
        assert_eq!(Cursor::attach(&log, &spec, 5, Some(4), 0).next, 0);
    }
}
