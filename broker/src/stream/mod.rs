//! Streams (`x-queue-type: stream`): append-only logs with offsets and retention, read
//! without removing. This module holds the pure parts: where a consumer starts
//! ([`spec`]), the per-chunk filters ([`filter`]) and the log's state machine ([`log`]).

pub mod disk;
pub mod filter;
pub mod log;
pub mod reader;
pub mod spec;
