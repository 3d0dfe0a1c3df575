//! The connection state machine fed arbitrary byte streams, in arbitrary read sizes, with time
//! passing between reads: it never panics, never loops, and everything it writes is well-framed.
#![no_main]

use std::time::{Duration, Instant};

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use warren_amqp::connection::{AccessError, Connection, ConnectionConfig, Gatekeeper, Login};
use warren_amqp::frame::{FrameWriter, PROTOCOL_HEADER, decode_frame};

struct Gate;
impl Gatekeeper for Gate {
    fn login(&self, user: &str, password: &[u8], _loopback: bool) -> Result<Login, AccessError> {
        if user == "guest" && password == b"guest" {
            Ok(Login { user: user.into() })
        } else {
            Err(AccessError::LoginRefused)
        }
    }
    fn login_external(&self, user: &str, _loopback: bool) -> Result<Login, AccessError> {
        Ok(Login { user: user.into() })
    }
    fn open_vhost(&self, _user: &str, vhost: &str) -> Result<(), AccessError> {
        if vhost == "/" { Ok(()) } else { Err(AccessError::VhostNotFound(vhost.into())) }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, data)) = data.split_first() else { return };
    let mut stream = match mode % 3 {
        0 => Vec::new(),
        1 => PROTOCOL_HEADER.to_vec(),
        // A full handshake first, so that the fuzzer's bytes reach the open connection.
        _ => warren_amqp::testkit::client_handshake(16, 4096, 5),
    };
    // The rest: chunks of [read size, time step in ms, bytes...].
    let mut chunks = Vec::new();
    let mut rest = data;
    while rest.len() >= 2 {
        let size = usize::from(rest[0]).min(rest.len() - 2);
        let step = u64::from(rest[1]) * 50;
        chunks.push((rest[2..2 + size].to_vec(), step));
        rest = &rest[2 + size..];
    }
    let start = Instant::now();
    let mut now = start;
    let mut conn = Connection::new(ConnectionConfig::default(), true, now);
    if mode % 2 == 1 {
        conn = conn.with_external_identity("CN=fuzz".into());
    }
    let mut out = FrameWriter::new();
    let mut input = BytesMut::new();
    input.extend_from_slice(&stream);
    stream.clear();
    let feed = |conn: &mut Connection, input: &mut BytesMut, out: &mut FrameWriter, now| {
        // Bounded: each round consumes a frame or produces an event, and the input is finite.
        for _ in 0..100_000 {
            if conn.is_closed() {
                return;
            }
            let before = input.len();
            conn.handle_input(input, out, now, &Gate);
            let mut events = 0;
            while conn.poll_event().is_some() {
                events += 1;
            }
            if events == 0 && input.len() == before {
                return;
            }
        }
        panic!("handle_input did not settle");
    };
    feed(&mut conn, &mut input, &mut out, now);
    for (bytes, step) in chunks {
        now += Duration::from_millis(step);
        if conn.poll_timeout().is_some_and(|t| t <= now) {
            conn.handle_timeout(now, &mut out);
        }
        input.extend_from_slice(&bytes);
        feed(&mut conn, &mut input, &mut out, now);
        if conn.is_closed() {
            break;
        }
    }
    // Everything written must be whole frames (after the protocol header we may send back).
    let mut written = BytesMut::from(out.as_slice());
    if written.starts_with(PROTOCOL_HEADER) {
        let _ = written.split_to(PROTOCOL_HEADER.len());
    }
    while !written.is_empty() {
        match decode_frame(&mut written, u32::MAX) {
            Ok(Some(_)) => {}
            other => panic!("the machine wrote a malformed frame: {other:?}"),
        }
    }
});
