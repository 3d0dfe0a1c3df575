//! The handshake: connection.start with the offered mechanisms, start-ok and the SASL login
//! (PLAIN, AMQPLAIN, EXTERNAL), tune / tune-ok negotiation of frame_max, channel_max and
//! heartbeat, and connection.open of a vhost.

use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::{AMQPValue, LongString};

use super::access::{AccessError, Gatekeeper};
use super::config::Mechanism;
use super::{Connection, Event, State};
use crate::frame::{FRAME_METHOD, FrameWriter, RawFrame};
use crate::limits;
use crate::method;
use crate::reply::{AmqpError, ReplyCode};

impl Connection {
    fn expect_method(&self, frame: &RawFrame, expected: &str) -> Result<method::Method, AmqpError> {
        if frame.kind != FRAME_METHOD || frame.channel != 0 {
            if self.state == State::AwaitOpen {
                // RabbitMQ's text for anything but connection.open while opening.
                return Err(AmqpError::connection(
                    ReplyCode::UnexpectedFrame,
                    format!(
                        "type {}, all octets = {}",
                        frame.kind,
                        crate::frame::erlang_binary(&frame.payload)
                    ),
                ));
            }
            return Err(AmqpError::connection(
                ReplyCode::CommandInvalid,
                format!("expected '{expected}'"),
            ));
        }
        method::decode(&frame.payload, self.config.table_depth_max)
            .map_err(AmqpError::into_connection)
    }

    pub(super) fn handle_handshake(
        &mut self,
        frame: RawFrame,
        out: &mut FrameWriter,
        now: Instant,
        gate: &dyn Gatekeeper,
    ) -> Result<(), AmqpError> {
        let expected = match self.state {
            State::AwaitStartOk => "connection.start_ok",
            State::AwaitTuneOk => "connection.tune_ok",
            _ => "connection.open",
        };
        let m = self.expect_method(&frame, expected)?;
        match (self.state, m.class) {
            (_, AMQPClass::Connection(connection::AMQPMethod::Close(_))) => {
                // Before connection.open there is nothing in flight worth waiting for, and a
                // peer that has not logged in must not hold a socket for the linger time.
                Self::send_close_ok(out);
                self.finish();
                Ok(())
            }
            (
                State::AwaitStartOk,
                AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)),
            ) => {
                self.client_properties = start_ok.client_properties;
                let mechanism = start_ok.mechanism.as_str().to_string();
                let offered = Mechanism::from_name(&mechanism).filter(|m| self.offers(*m));
                let credentials = match (offered, &self.external_identity) {
                    (Some(Mechanism::Plain), _) => parse_plain(start_ok.response.as_bytes()),
                    (Some(Mechanism::Amqplain), _) => {
                        parse_amqplain(start_ok.response.as_bytes(), self.config.table_depth_max)
                    }
                    (Some(Mechanism::External), Some(identity)) => {
                        Some((identity.clone(), Vec::new()))
                    }
                    _ => {
                        // RabbitMQ sends no close method for an unknown mechanism; it drops the socket.
                        self.state = State::Closed;
                        return Ok(());
                    }
                };
                let login =
                    credentials
                        .ok_or(AccessError::LoginRefused)
                        .and_then(|(user, pass)| {
                            if mechanism == "EXTERNAL" {
                                gate.login_external(&user, self.peer_is_loopback)
                            } else {
                                gate.login(&user, &pass, self.peer_is_loopback)
                            }
                        });
                match login {
                    Ok(login) => {
                        self.user = Some(login.user);
                        let l = self.config.limits;
                        out.method(
                            0,
                            &AMQPClass::Connection(connection::AMQPMethod::Tune(
                                connection::Tune {
                                    channel_max: l.channel_max,
                                    frame_max: l.frame_max,
                                    heartbeat: l.heartbeat_s,
                                },
                            )),
                        );
                        self.state = State::AwaitTuneOk;
                        Ok(())
                    }
                    Err(_) => {
                        let e = AmqpError::connection(
                            ReplyCode::AccessRefused,
                            format!(
                                "Login was refused using authentication mechanism {mechanism}. For details see the broker logfile."
                            ),
                        );
                        if self.client_capability("authentication_failure_close") {
                            self.close_with(e, out, now);
                        } else {
                            // Clients without the capability expect the socket to be dropped.
                            self.state = State::Closed;
                        }
                        Ok(())
                    }
                }
            }
            (
                State::AwaitTuneOk,
                AMQPClass::Connection(connection::AMQPMethod::TuneOk(tune_ok)),
            ) => {
                let l = self.config.limits;
                let frame_max = negotiate(
                    "frame_max",
                    tune_ok.frame_max,
                    limits::FRAME_MIN_SIZE,
                    l.frame_max,
                )?;
                let channel_max = negotiate(
                    "channel_max",
                    u32::from(tune_ok.channel_max),
                    1,
                    u32::from(l.channel_max),
                )?;
                self.frame_max = frame_max;
                out.set_frame_max(frame_max);
                self.channel_max = u16::try_from(channel_max).unwrap_or(l.channel_max);
                self.heartbeat = (tune_ok.heartbeat > 0)
                    .then(|| Duration::from_secs(u64::from(tune_ok.heartbeat)));
                self.state = State::AwaitOpen;
                Ok(())
            }
            (State::AwaitOpen, AMQPClass::Connection(connection::AMQPMethod::Open(open))) => {
                let user = self.user.clone().unwrap_or_default();
                let vhost = open.virtual_host.as_str().to_string();
                gate.open_vhost(&user, &vhost).map_err(|e| {
                    AmqpError::connection(ReplyCode::NotAllowed, e.to_string()).with_method(10, 40)
                })?;
                out.method(
                    0,
                    &AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
                );
                self.state = State::Open;
                self.events.push_back(Event::Opened {
                    user,
                    vhost,
                    client_properties: self.client_properties.clone(),
                });
                Ok(())
            }
            _ => Err(AmqpError::connection(
                ReplyCode::CommandInvalid,
                format!("expected '{expected}'"),
            )
            .with_method(m.class_id, m.method_id)),
        }
    }

    /// Whether `m` is offered on this connection: configured, and for EXTERNAL a verified
    /// certificate identity.
    fn offers(&self, m: Mechanism) -> bool {
        self.config.mechanisms.contains(&m)
            && (m != Mechanism::External || self.external_identity.is_some())
    }

    pub(super) fn send_start(&mut self, out: &mut FrameWriter) {
        out.method(
            0,
            &AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: self.config.server_properties.clone(),
                mechanisms: LongString::from(
                    self.config
                        .mechanisms
                        .iter()
                        .filter(|m| self.offers(**m))
                        .map(|m| m.name())
                        .collect::<Vec<_>>()
                        .join(" ")
                        .into_bytes(),
                ),
                locales: LongString::from(b"en_US".to_vec()),
            })),
        );
    }
}

/// RabbitMQ's tune-ok validation: below the minimum or above what we offered is refused.
fn negotiate(field: &str, client: u32, min: u32, server: u32) -> Result<u32, AmqpError> {
    if client != 0 && client < min {
        return Err(AmqpError::connection(
            ReplyCode::NotAllowed,
            format!(
                "negotiated {field} = {client} is lower than the minimum allowed value ({min})"
            ),
        )
        .with_method(10, 31));
    }
    if client == 0 || client > server {
        // 0 asks for "no limit", which is above any limit we offered.
        let shown = if client == 0 {
            "0 (no limit)".to_string()
        } else {
            client.to_string()
        };
        return Err(AmqpError::connection(
            ReplyCode::NotAllowed,
            format!(
                "negotiated {field} = {shown} is higher than the maximum allowed value ({server})"
            ),
        )
        .with_method(10, 31));
    }
    Ok(client)
}

/// SASL PLAIN: `authzid \0 authcid \0 password`.
fn parse_plain(response: &[u8]) -> Option<(String, Vec<u8>)> {
    let mut parts = response.splitn(3, |b| *b == 0);
    let _authzid = parts.next()?;
    let user = parts.next()?;
    let pass = parts.next()?;
    Some((String::from_utf8(user.to_vec()).ok()?, pass.to_vec()))
}

/// AMQPLAIN: a field table body (no length prefix) with LOGIN and PASSWORD.
fn parse_amqplain(response: &[u8], depth_max: usize) -> Option<(String, Vec<u8>)> {
    let mut table = Vec::with_capacity(response.len() + 4);
    table.extend_from_slice(&u32::try_from(response.len()).ok()?.to_be_bytes());
    table.extend_from_slice(response);
    crate::table::check_table(&table, 0, depth_max).ok()?;
    let (_, t) = amq_protocol::types::parsing::parse_field_table(&table[..]).ok()?;
    let text = |v: Option<&AMQPValue>| -> Option<Vec<u8>> {
        match v? {
            AMQPValue::LongString(s) => Some(s.as_bytes().to_vec()),
            AMQPValue::ShortString(s) => Some(s.as_str().as_bytes().to_vec()),
            _ => None,
        }
    };
    let user = text(t.inner().get("LOGIN"))?;
    let pass = text(t.inner().get("PASSWORD"))?;
    Some((String::from_utf8(user).ok()?, pass))
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use amq_protocol::protocol::{AMQPClass, connection};
    use amq_protocol::types::{AMQPValue, FieldTable, LongString};
    use bytes::BytesMut;

    use crate::connection::config::{ConnectionConfig, Mechanism};
    use crate::connection::test_support::{Open, drive, handshake};
    use crate::connection::{Connection, Event, State};
    use crate::frame::{FrameWriter, PROTOCOL_HEADER};
    use crate::method;

    #[test]
    fn handshake_opens_connection_and_channel() {
        let now = Instant::now();
        let mut c = Connection::new(ConnectionConfig::default(), true, now);
        let mut out = FrameWriter::new();
        let mut input = handshake();
        c.handle_input(&mut input, &mut out, now, &Open);
        assert!(matches!(c.poll_event(), Some(Event::Opened { .. })));
        assert!(c.is_open());
        assert!(
            !c.channel_is_open(1),
            "frames after an event wait for the broker"
        );
        c.handle_input(&mut input, &mut out, now, &Open);
        assert_eq!(c.poll_event(), Some(Event::ChannelOpened(1)));
        assert!(c.channel_is_open(1));
    }

    /// Client bytes for the protocol header and a start-ok with `mechanism`.
    fn start_ok(mechanism: &str, response: &[u8]) -> BytesMut {
        let mut w = FrameWriter::new();
        w.raw(PROTOCOL_HEADER);
        let mut caps = FieldTable::default();
        caps.insert(
            "authentication_failure_close".into(),
            AMQPValue::Boolean(true),
        );
        let mut props = FieldTable::default();
        props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
        w.method(
            0,
            &AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: props,
                mechanism: mechanism.into(),
                response: LongString::from(response.to_vec()),
                locale: "en_US".into(),
            })),
        );
        BytesMut::from(w.as_slice())
    }

    fn offered_mechanisms(out: &FrameWriter) -> String {
        let mut written = BytesMut::from(out.as_slice());
        let frame = crate::frame::decode_frame(&mut written, u32::MAX)
            .ok()
            .flatten()
            .expect("connection.start is written first");
        let m = method::decode(&frame.payload, 8).expect("connection.start decodes");
        match m.class {
            AMQPClass::Connection(connection::AMQPMethod::Start(s)) => {
                String::from_utf8_lossy(s.mechanisms.as_bytes()).into_owned()
            }
            other => panic!("expected connection.start, got {other:?}"),
        }
    }

    #[test]
    fn external_is_offered_and_accepted_only_with_a_certificate_identity() {
        let now = Instant::now();
        // With a certificate identity: offered, and the identity logs in without a password.
        let with_external = || ConnectionConfig {
            mechanisms: vec![Mechanism::Plain, Mechanism::Amqplain, Mechanism::External],
            ..ConnectionConfig::default()
        };
        let mut c =
            Connection::new(with_external(), false, now).with_external_identity("CN=client".into());
        let mut out = FrameWriter::new();
        let mut input = start_ok("EXTERNAL", b"");
        drive(&mut c, &mut input, &mut out, now);
        assert_eq!(offered_mechanisms(&out), "PLAIN AMQPLAIN EXTERNAL");
        assert_eq!(c.state, State::AwaitTuneOk, "EXTERNAL login succeeded");

        // A certificate naming an unknown user: 403, as a refused password.
        let mut c = Connection::new(with_external(), false, now)
            .with_external_identity("CN=stranger".into());
        let mut out = FrameWriter::new();
        let mut input = start_ok("EXTERNAL", b"");
        drive(&mut c, &mut input, &mut out, now);
        assert!(matches!(c.state, State::CloseSent { .. }));
        assert!(
            String::from_utf8_lossy(out.as_slice())
                .contains("Login was refused using authentication mechanism EXTERNAL")
        );

        // Without a certificate EXTERNAL is not offered, and asking for it drops the socket.
        let mut c = Connection::new(with_external(), false, now);
        let mut out = FrameWriter::new();
        let mut input = start_ok("EXTERNAL", b"");
        drive(&mut c, &mut input, &mut out, now);
        assert_eq!(offered_mechanisms(&out), "PLAIN AMQPLAIN");
        assert!(c.is_closed());

        // Not configured (RabbitMQ's default auth_mechanisms): not offered even with a
        // certificate, so clients that prefer EXTERNAL (py-amqp) log in with a password.
        let mut c = Connection::new(ConnectionConfig::default(), false, now)
            .with_external_identity("CN=client".into());
        let mut out = FrameWriter::new();
        let mut input = start_ok("EXTERNAL", b"");
        drive(&mut c, &mut input, &mut out, now);
        assert_eq!(offered_mechanisms(&out), "PLAIN AMQPLAIN");
        assert!(
            c.is_closed(),
            "an unoffered mechanism is refused like an unknown one"
        );
    }
}
