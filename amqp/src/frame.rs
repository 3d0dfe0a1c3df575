//! Frames: splitting the inbound byte stream and writing outbound frames.
//!
//! Wire layout of a frame:
//!
//! | offset | size | field                               |
//! |--------|------|-------------------------------------|
//! | 0      | 1    | type (1 method, 2 header, 3 body, 8 heartbeat) |
//! | 1      | 2    | channel                             |
//! | 3      | 4    | payload size N                      |
//! | 7      | N    | payload                             |
//! | 7+N    | 1    | frame end, 0xCE                     |
//!
//! The decoder checks the type and the size against `frame_max` from the 7-byte header, before
//! waiting for or allocating the payload, so a stray protocol header (`"AMQP"` read as type 0x41)
//! or a hostile length can never make us buffer gigabytes.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::reply::{AmqpError, ReplyCode};

/// Method frame type octet.
pub const FRAME_METHOD: u8 = 1;
/// Content header frame type octet.
pub const FRAME_HEADER: u8 = 2;
/// Content body frame type octet.
pub const FRAME_BODY: u8 = 3;
/// Heartbeat frame type octet.
pub const FRAME_HEARTBEAT: u8 = 8;
/// The octet that ends every frame.
pub const FRAME_END: u8 = 0xCE;
/// Bytes of framing around a payload (7 header + 1 end).
pub const FRAME_OVERHEAD: usize = 8;
/// The AMQP 0-9-1 protocol header a client opens with (and that we answer a wrong one with).
pub const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";

/// One frame, with its payload sliced out of the read buffer without copying.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawFrame {
    /// Frame type octet.
    pub kind: u8,
    /// Channel number.
    pub channel: u16,
    /// Payload bytes (frame end removed).
    pub payload: Bytes,
}

/// Take one complete frame off the front of `buf`.
///
/// Returns `Ok(None)` when more bytes are needed. `frame_max` is the negotiated maximum frame
/// size including the 8 bytes of framing; 0 means "no limit" in AMQP, which we never offer, so it
/// is treated as the pre-tune limit by the caller.
pub fn decode_frame(buf: &mut BytesMut, frame_max: u32) -> Result<Option<RawFrame>, AmqpError> {
    if buf.len() < 7 {
        return Ok(None);
    }
    let kind = buf[0];
    let channel = u16::from_be_bytes([buf[1], buf[2]]);
    let size = u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]);
    // Size first, as RabbitMQ: a protocol header sent mid-stream ("AMQP...") reads as type 65
    // with a huge size and is reported as frame_too_large.
    let payload_max = frame_max.saturating_sub(FRAME_OVERHEAD as u32);
    if size > payload_max {
        return Err(AmqpError::connection(
            ReplyCode::FrameError,
            format!("type {kind}, all octets = <<>>: {{frame_too_large,{size},{payload_max}}}"),
        ));
    }
    if !matches!(
        kind,
        FRAME_METHOD | FRAME_HEADER | FRAME_BODY | FRAME_HEARTBEAT
    ) {
        return Err(AmqpError::connection(
            ReplyCode::FrameError,
            format!("type {kind}, all octets = <<>>: unknown_frame"),
        ));
    }
    let total = size as usize + FRAME_OVERHEAD;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    if buf[total - 1] != FRAME_END {
        return Err(AmqpError::connection(
            ReplyCode::FrameError,
            format!(
                "type {kind}, first 16 octets = <<>>: {{invalid_frame_end_marker,{}}}",
                buf[total - 1]
            ),
        ));
    }
    buf.advance(7);
    let payload = buf.split_to(size as usize).freeze();
    buf.advance(1);
    Ok(Some(RawFrame {
        kind,
        channel,
        payload,
    }))
}

/// `bytes` as Erlang prints a binary in RabbitMQ's error texts: `<<"text">>` when every byte
/// is printable, `<<0,20,0,10>>` otherwise.
#[must_use]
pub fn erlang_binary(bytes: &[u8]) -> String {
    let printable = |b: u8| {
        (32..=126).contains(&b)
            || (160..=255).contains(&b)
            || b"\n\r\t\x0b\x08\x0c\x1b".contains(&b)
    };
    if !bytes.is_empty() && bytes.iter().all(|&b| printable(b)) {
        let mut s = String::from("<<\"");
        for &b in bytes {
            match b {
                b'"' => s.push_str("\\\""),
                b'\\' => s.push_str("\\\\"),
                b'\n' => s.push_str("\\n"),
                b'\r' => s.push_str("\\r"),
                b'\t' => s.push_str("\\t"),
                _ => s.push(char::from(b)),
            }
        }
        s.push_str("\">>");
        s
    } else {
        let parts: Vec<String> = bytes.iter().map(u8::to_string).collect();
        format!("<<{}>>", parts.join(","))
    }
}

/// Outbound frame buffer: everything produced in one wake-up goes here and is written with one
/// syscall.
///
/// It knows where its first whole frame starts (`frame_rest`), so that a heartbeat can be
/// put ahead of frames that may not be written yet: the caller may hold output while a reply
/// waits to become durable, and the peer must still hear heartbeats meanwhile (RabbitMQ's
/// heartbeater writes beside the channels). Bytes up to [`FrameWriter::urgent`] may be written
/// even while output is held.
#[derive(Debug)]
pub struct FrameWriter {
    buf: BytesMut,
    frame_max: u32,
    /// Bytes at the front that finish a frame partly written (0: the front starts a frame).
    frame_rest: usize,
    /// Bytes at the front that may be written while output is held: up to the end of a
    /// heartbeat put ahead of the rest.
    urgent: usize,
    /// Raw bytes (the protocol header) were appended: frames cannot be walked until the
    /// buffer drains.
    unframed: bool,
}

impl Default for FrameWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameWriter {
    /// An empty writer using the pre-tune frame_max.
    #[must_use]
    pub fn new() -> Self {
        Self {
            buf: BytesMut::with_capacity(64 * 1024),
            frame_max: crate::limits::FRAME_MAX_PRE_TUNE,
            frame_rest: 0,
            urgent: 0,
            unframed: false,
        }
    }

    /// Set the negotiated frame_max; body frames are split to fit it.
    pub fn set_frame_max(&mut self, frame_max: u32) {
        debug_assert!(frame_max >= crate::limits::FRAME_MIN_SIZE);
        self.frame_max = frame_max;
    }

    /// Bytes waiting to be written.
    #[must_use]
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The bytes waiting to be written.
    #[must_use]
    pub fn as_slice(&self) -> &[u8] {
        &self.buf
    }

    /// Bytes at the front that may be written even while output is held (a heartbeat put
    /// ahead of the rest, and the end of a frame partly written before it).
    #[must_use]
    pub fn urgent(&self) -> usize {
        self.urgent
    }

    /// Drop `n` bytes that have been written to the socket (at most what is pending: a
    /// socket writes no more than it was given; a larger `n` is a caller's bug, cut in
    /// release builds).
    pub fn consume(&mut self, n: usize) {
        debug_assert!(
            n <= self.buf.len(),
            "{n} bytes written of {} pending",
            self.buf.len()
        );
        let n = n.min(self.buf.len());
        self.urgent = self.urgent.saturating_sub(n);
        if n == self.buf.len() {
            self.buf.clear();
            self.frame_rest = 0;
            self.unframed = false;
            return;
        }
        if !self.unframed {
            // Walk the frames written to know where the next whole one starts. Every frame
            // in the buffer is whole (appended at once), so its header is there to read.
            let mut at = self.frame_rest.min(n);
            self.frame_rest -= at;
            while at < n {
                let len = self.frame_len_at(at);
                if at + len > n {
                    self.frame_rest = at + len - n;
                }
                at += len;
            }
        }
        self.buf.advance(n);
    }

    /// The length of the whole frame starting at `at` (header, payload and end octet).
    fn frame_len_at(&self, at: usize) -> usize {
        let size = self
            .buf
            .get(at + 3..at + 7)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map_or(0, u32::from_be_bytes);
        // A frame's header is always whole in the buffer; if it were not, the rest counts as
        // one frame (no heartbeat goes inside it).
        FRAME_OVERHEAD + size as usize
    }

    /// Append raw bytes (the protocol header).
    pub fn raw(&mut self, bytes: &[u8]) {
        self.unframed = true;
        self.buf.extend_from_slice(bytes);
    }

    /// Put a heartbeat frame ahead of every whole frame waiting (after a frame partly
    /// written), and let the bytes up to its end be written even while output is held. A
    /// heartbeat has no place in the order of the others. With raw bytes waiting it goes at
    /// the end, as the others.
    pub fn heartbeat(&mut self) {
        const HEARTBEAT: [u8; 8] = [FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, FRAME_END];
        if self.unframed {
            self.buf.extend_from_slice(&HEARTBEAT);
            return;
        }
        if self.urgent > 0 {
            // One is already ahead of the rest and not yet written.
            return;
        }
        let at = self.frame_rest;
        if at == self.buf.len() {
            self.buf.extend_from_slice(&HEARTBEAT);
        } else {
            let rest = self.buf.split_off(at);
            self.buf.extend_from_slice(&HEARTBEAT);
            self.buf.extend_from_slice(&rest);
        }
        self.urgent = at + HEARTBEAT.len();
    }

    /// Append a method frame built by amq-protocol's generator.
    pub fn method(&mut self, channel: u16, method: &amq_protocol::protocol::AMQPClass) {
        let start = self.begin_frame(FRAME_METHOD, channel);
        let payload = crate::method::encode(method);
        self.buf.extend_from_slice(&payload);
        self.end_frame(start);
    }

    /// Append a method frame whose payload is written by `f` (used for hot-path methods).
    pub fn method_with(&mut self, channel: u16, f: impl FnOnce(&mut BytesMut)) {
        let start = self.begin_frame(FRAME_METHOD, channel);
        f(&mut self.buf);
        self.end_frame(start);
    }

    /// Append a content header and the body frames for a message of class basic.
    ///
    /// `properties` is the raw property-flags + property-list, forwarded byte-exact.
    pub fn content(&mut self, channel: u16, properties: &[u8], body: &[u8]) {
        let start = self.begin_frame(FRAME_HEADER, channel);
        self.buf.put_u16(60);
        self.buf.put_u16(0);
        self.buf.put_u64(body.len() as u64);
        self.buf.extend_from_slice(properties);
        self.end_frame(start);
        let chunk = (self.frame_max as usize)
            .saturating_sub(FRAME_OVERHEAD)
            .max(1);
        for piece in body.chunks(chunk) {
            self.buf.reserve(piece.len() + FRAME_OVERHEAD);
            self.buf.put_u8(FRAME_BODY);
            self.buf.put_u16(channel);
            self.buf.put_u32(piece.len() as u32);
            self.buf.extend_from_slice(piece);
            self.buf.put_u8(FRAME_END);
        }
    }

    fn begin_frame(&mut self, kind: u8, channel: u16) -> usize {
        self.buf.put_u8(kind);
        self.buf.put_u16(channel);
        let start = self.buf.len();
        self.buf.put_u32(0);
        start
    }

    fn end_frame(&mut self, size_at: usize) {
        let size = (self.buf.len() - size_at - 4) as u32;
        self.buf[size_at..size_at + 4].copy_from_slice(&size.to_be_bytes());
        self.buf.put_u8(FRAME_END);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, channel: u16, payload: &[u8], end: u8) -> BytesMut {
        let mut b = BytesMut::new();
        b.put_u8(kind);
        b.put_u16(channel);
        b.put_u32(payload.len() as u32);
        b.extend_from_slice(payload);
        b.put_u8(end);
        b
    }

    #[test]
    fn erlang_binaries_print_as_rabbitmq_does() {
        assert_eq!(erlang_binary(b""), "<<>>");
        assert_eq!(erlang_binary(b"ab"), "<<\"ab\">>");
        assert_eq!(erlang_binary(&[0, 20, 0, 10, 0]), "<<0,20,0,10,0>>");
        assert_eq!(erlang_binary(b"a\"b"), "<<\"a\\\"b\">>");
    }

    #[test]
    fn a_protocol_header_mid_stream_is_too_large_before_it_is_unknown() {
        let mut buf = BytesMut::from(&PROTOCOL_HEADER[..]);
        let e = decode_frame(&mut buf, 131_072).unwrap_err();
        assert_eq!(e.code, ReplyCode::FrameError);
        assert_eq!(
            e.text,
            "FRAME_ERROR - type 65, all octets = <<>>: {frame_too_large,1342177289,131064}"
        );
    }

    #[test]
    fn splits_complete_frames_and_waits_for_partial_ones() {
        let mut all = frame(FRAME_BODY, 3, b"hello", FRAME_END);
        all.extend_from_slice(&frame(FRAME_HEARTBEAT, 0, b"", FRAME_END));
        let mut buf = BytesMut::new();
        buf.extend_from_slice(&all[..5]);
        assert_eq!(decode_frame(&mut buf, 4096), Ok(None));
        buf.extend_from_slice(&all[5..]);
        let f = decode_frame(&mut buf, 4096).unwrap().unwrap();
        assert_eq!(
            (f.kind, f.channel, &f.payload[..]),
            (FRAME_BODY, 3, &b"hello"[..])
        );
        let hb = decode_frame(&mut buf, 4096).unwrap().unwrap();
        assert_eq!(hb.kind, FRAME_HEARTBEAT);
        assert!(buf.is_empty());
    }

    #[test]
    fn rejects_oversize_frames_from_the_header_alone() {
        let mut buf = BytesMut::new();
        buf.put_u8(FRAME_BODY);
        buf.put_u16(1);
        buf.put_u32(1 << 30);
        let err = decode_frame(&mut buf, 131_072).unwrap_err();
        assert_eq!(err.code, ReplyCode::FrameError);
        assert!(
            buf.capacity() < 1 << 20,
            "must not reserve the announced size"
        );
    }

    #[test]
    fn rejects_protocol_header_mid_stream_and_bad_frame_end() {
        let mut buf = BytesMut::from(&PROTOCOL_HEADER[..]);
        assert_eq!(
            decode_frame(&mut buf, 131_072).unwrap_err().code,
            ReplyCode::FrameError
        );
        let mut bad_end = frame(FRAME_METHOD, 1, b"abcd", 0x00);
        assert_eq!(
            decode_frame(&mut bad_end, 131_072).unwrap_err().code,
            ReplyCode::FrameError
        );
    }

    #[test]
    fn writer_splits_bodies_to_frame_max() {
        let mut w = FrameWriter::new();
        w.set_frame_max(4096);
        let body = vec![7u8; 10_000];
        w.content(1, &[0, 0], &body);
        let mut buf = BytesMut::from(w.as_slice());
        let header = decode_frame(&mut buf, 4096).unwrap().unwrap();
        assert_eq!(header.kind, FRAME_HEADER);
        let mut got = Vec::new();
        while let Some(f) = decode_frame(&mut buf, 4096).unwrap() {
            assert_eq!(f.kind, FRAME_BODY);
            assert!(f.payload.len() <= 4096 - 8);
            got.extend_from_slice(&f.payload);
        }
        assert_eq!(got, body);
    }

    /// Write `n` bytes of `w` (at most what may be written) into `wire`.
    fn write(w: &mut FrameWriter, wire: &mut BytesMut, n: usize, held: bool) {
        let writable = if held { w.urgent() } else { w.pending() };
        let n = n.min(writable);
        wire.extend_from_slice(&w.as_slice()[..n]);
        w.consume(n);
    }

    #[test]
    fn a_heartbeat_goes_after_the_frame_partly_written_and_ahead_of_held_ones() {
        let mut w = FrameWriter::new();
        w.content(1, &[0, 0], &[7; 100]);
        let mut wire = BytesMut::new();
        write(&mut w, &mut wire, 10, false);
        // Output is held from here: only the heartbeat (and what finishes the frame in
        // progress before it) may go.
        w.method_with(1, |b| b.put_u32(0x000a_000b));
        w.heartbeat();
        // The header frame is 22 bytes (7 + 14 of payload + 1): 12 of it are left.
        assert_eq!(w.urgent(), 12 + 8);
        write(&mut w, &mut wire, usize::MAX, true);
        assert_eq!(w.urgent(), 0);
        let mut kinds = Vec::new();
        while let Some(f) = decode_frame(&mut wire, 1 << 20).unwrap() {
            kinds.push(f.kind);
        }
        assert_eq!(kinds, [FRAME_HEADER, FRAME_HEARTBEAT]);
        assert!(wire.is_empty());
        assert_eq!(w.pending(), 108 + 12, "the body and the method wait");
    }

    proptest::proptest! {
        /// However writes are cut and heartbeats interleaved, held or not, the peer reads
        /// whole frames: every frame appended in order, and the heartbeats.
        #[test]
        fn heartbeats_never_split_a_frame(
            steps in proptest::collection::vec((0u8..4, 0usize..10_000, proptest::prelude::any::<bool>()), 1..60)
        ) {
            let mut w = FrameWriter::new();
            w.set_frame_max(4096);
            let mut wire = BytesMut::new();
            let mut appended = Vec::new();
            let mut beats = 0;
            for (i, (action, n, held)) in steps.into_iter().enumerate() {
                match action {
                    0 => {
                        let body = vec![i as u8; n];
                        w.content(i as u16, &[0, 0], &body);
                        appended.push((FRAME_HEADER, i as u16));
                        for _ in body.chunks(4096 - FRAME_OVERHEAD) {
                            appended.push((FRAME_BODY, i as u16));
                        }
                    }
                    1 => {
                        w.method_with(i as u16, |b| b.put_u32(n as u32));
                        appended.push((FRAME_METHOD, i as u16));
                    }
                    2 => {
                        if w.urgent() == 0 {
                            beats += 1;
                        }
                        w.heartbeat();
                    }
                    _ => write(&mut w, &mut wire, n, held),
                }
            }
            write(&mut w, &mut wire, usize::MAX, false);
            let mut got = Vec::new();
            let mut got_beats = 0;
            while let Some(f) = decode_frame(&mut wire, 4096).unwrap() {
                if f.kind == FRAME_HEARTBEAT {
                    got_beats += 1;
                } else {
                    got.push((f.kind, f.channel));
                }
            }
            proptest::prop_assert!(wire.is_empty());
            proptest::prop_assert_eq!(got, appended);
            proptest::prop_assert_eq!(got_beats, beats);
        }
    }
}
