//! Helpers for the connection's unit tests: a gatekeeper that knows guest/guest, `CN=client`
//! and the vhost `/`, a client's handshake bytes, and driving the machine until it is idle.

use std::time::Instant;

use bytes::BytesMut;

use super::Connection;
use super::access::{AccessError, Gatekeeper, Login};
use crate::frame::FrameWriter;

pub(super) struct Open;

impl Gatekeeper for Open {
    fn login(&self, user: &str, password: &[u8], _loopback: bool) -> Result<Login, AccessError> {
        if user == "guest" && password == b"guest" {
            Ok(Login { user: user.into() })
        } else {
            Err(AccessError::LoginRefused)
        }
    }
    fn login_external(&self, user: &str, _loopback: bool) -> Result<Login, AccessError> {
        if user == "CN=client" {
            Ok(Login { user: user.into() })
        } else {
            Err(AccessError::LoginRefused)
        }
    }
    fn open_vhost(&self, _user: &str, vhost: &str) -> Result<(), AccessError> {
        if vhost == "/" {
            Ok(())
        } else {
            Err(AccessError::VhostNotFound(vhost.into()))
        }
    }
}

/// Client bytes for a complete handshake plus channel.open on channel 1.
pub(super) fn handshake() -> BytesMut {
    BytesMut::from(&crate::testkit::client_handshake(2047, 131_072, 0)[..])
}

/// Feed input until no frame is left, discarding events.
pub(super) fn drive(c: &mut Connection, input: &mut BytesMut, out: &mut FrameWriter, now: Instant) {
    loop {
        let before = input.len();
        c.handle_input(input, out, now, &Open);
        let mut any = false;
        while c.poll_event().is_some() {
            any = true;
        }
        if !any && input.len() == before {
            break;
        }
    }
}

pub(super) fn client_frames(f: impl FnOnce(&mut FrameWriter)) -> BytesMut {
    let mut w = FrameWriter::new();
    f(&mut w);
    BytesMut::from(w.as_slice())
}
