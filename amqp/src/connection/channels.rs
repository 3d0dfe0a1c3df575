//! Frames on an open connection: connection methods on channel 0 (close, update-secret,
//! blocked), channel.open within channel_max, each open channel's frames through its
//! [`Assembler`](crate::assembler::Assembler) into commands, and channel.close in both
//! directions (crossing closes included).

use std::time::Instant;

use amq_protocol::protocol::{AMQPClass, channel, connection};
use amq_protocol::types::ShortString;

use super::access::Gatekeeper;
use super::{ChannelState, Connection, Event};
use crate::assembler::AssemblyLimits;
use crate::frame::{FRAME_METHOD, FrameWriter, RawFrame};
use crate::method;
use crate::reply::{AmqpError, ReplyCode, Scope};

impl Connection {
    pub(super) fn handle_channel_zero(
        &mut self,
        frame: RawFrame,
        out: &mut FrameWriter,
        now: Instant,
    ) -> Result<(), AmqpError> {
        if frame.kind != FRAME_METHOD {
            return Err(AmqpError::connection(
                ReplyCode::UnexpectedFrame,
                format!("type {}, all octets = <<>>", frame.kind),
            ));
        }
        let m = method::decode(&frame.payload, self.config.table_depth_max)
            .map_err(AmqpError::into_connection)?;
        match m.class {
            AMQPClass::Connection(connection::AMQPMethod::Close(_)) => {
                self.answer_peer_close(out, now);
                Ok(())
            }
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => Ok(()),
            AMQPClass::Connection(connection::AMQPMethod::UpdateSecret(_)) => {
                out.method(
                    0,
                    &AMQPClass::Connection(connection::AMQPMethod::UpdateSecretOk(
                        connection::UpdateSecretOk {},
                    )),
                );
                Ok(())
            }
            AMQPClass::Connection(
                connection::AMQPMethod::Blocked(_) | connection::AMQPMethod::Unblocked(_),
            ) => Ok(()),
            _ => {
                let _ = now;
                Err(AmqpError::connection(
                    ReplyCode::ChannelError,
                    "unexpected method in connection state running",
                )
                .with_method(m.class_id, m.method_id))
            }
        }
    }

    pub(super) fn handle_channel_frame(
        &mut self,
        frame: RawFrame,
        out: &mut FrameWriter,
        gate: &dyn Gatekeeper,
    ) -> Result<(), AmqpError> {
        let ch = frame.channel;
        let limits = AssemblyLimits {
            message_size_max: self.config.limits.message_size_max,
            table_depth_max: self.config.table_depth_max,
        };
        match self.channels.get_mut(&ch) {
            None => {
                if frame.kind == FRAME_METHOD
                    && let Ok(m) = method::decode(&frame.payload, self.config.table_depth_max)
                    && let AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) = m.class
                {
                    // A close-ok for a channel already gone (the two sides' closes crossed
                    // and were both answered): nothing is owed, and it must not cost the peer
                    // its other channels.
                    return Ok(());
                }
                if frame.kind != FRAME_METHOD {
                    return Err(AmqpError::connection(
                        ReplyCode::ChannelError,
                        "expected 'channel.open'",
                    ));
                }
                let m = method::decode(&frame.payload, self.config.table_depth_max)?;
                match m.class {
                    AMQPClass::Channel(channel::AMQPMethod::Open(_)) => {
                        // RabbitMQ limits how many channels are open, not their numbers.
                        if self.channels.len() >= usize::from(self.channel_max) {
                            return Err(AmqpError::connection(
                                ReplyCode::NotAllowed,
                                format!(
                                    "number of channels opened ({}) has reached the negotiated channel_max ({})",
                                    self.channels.len(),
                                    self.channel_max
                                ),
                            ));
                        }
                        gate.open_channel(self.user.as_deref().unwrap_or_default())
                            .map_err(|e| {
                                AmqpError::connection(ReplyCode::NotAllowed, e.to_string())
                            })?;
                        self.channels.insert(ch, ChannelState::Open(Box::default()));
                        out.method(
                            ch,
                            &AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
                        );
                        self.events.push_back(Event::ChannelOpened(ch));
                        Ok(())
                    }
                    _ => Err(AmqpError::connection(
                        ReplyCode::ChannelError,
                        "expected 'channel.open'",
                    )
                    .with_method(m.class_id, m.method_id)),
                }
            }
            Some(ChannelState::Closing) => {
                // Drop everything but close / close-ok, as RabbitMQ does after channel.close.
                if frame.kind == FRAME_METHOD
                    && let Ok(m) = method::decode(&frame.payload, self.config.table_depth_max)
                {
                    match m.class {
                        AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => {
                            self.channels.remove(&ch);
                        }
                        AMQPClass::Channel(channel::AMQPMethod::Close(_)) => {
                            // The peer's close crossed ours: answer it, and keep waiting for
                            // the close-ok it owes for ours (RabbitMQ's closing channel does
                            // the same), so that close-ok is not taken for a frame on an
                            // unopened channel.
                            out.method(
                                ch,
                                &AMQPClass::Channel(channel::AMQPMethod::CloseOk(
                                    channel::CloseOk {},
                                )),
                            );
                        }
                        _ => {}
                    }
                }
                Ok(())
            }
            Some(ChannelState::Open(assembler)) => {
                let cmd = match assembler.handle_frame(frame, limits) {
                    Ok(Some(cmd)) => cmd,
                    Ok(None) => return Ok(()),
                    Err(e) if e.scope == Scope::Channel => {
                        self.close_channel(ch, e, out);
                        return Ok(());
                    }
                    Err(e) => return Err(e),
                };
                let (class_id, method_id) = (cmd.method.class_id, cmd.method.method_id);
                match &cmd.method.class {
                    AMQPClass::Connection(_) => Err(connection_on_channel(&cmd.method)),
                    AMQPClass::Channel(channel::AMQPMethod::Open(_)) => Err(AmqpError::connection(
                        ReplyCode::ChannelError,
                        "second 'channel.open' seen",
                    )
                    .with_method(class_id, method_id)),
                    AMQPClass::Channel(channel::AMQPMethod::Close(_)) => {
                        out.method(
                            ch,
                            &AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                        );
                        self.channels.remove(&ch);
                        self.events.push_back(Event::ChannelClosed(ch));
                        Ok(())
                    }
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => Ok(()),
                    _ => {
                        self.events.push_back(Event::Command(ch, Box::new(cmd)));
                        Ok(())
                    }
                }
            }
        }
    }

    /// Close a channel because of an error the broker found (or the assembler).
    ///
    /// Sends channel.close, drops further frames on it until close-ok, and emits
    /// [`Event::ChannelClosed`] so the broker releases what the channel holds.
    pub fn close_channel(&mut self, ch: u16, e: AmqpError, out: &mut FrameWriter) {
        debug_assert_eq!(e.scope, Scope::Channel);
        if !self.channel_is_open(ch) {
            return;
        }
        out.method(
            ch,
            &AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: e.code.code(),
                reply_text: ShortString::from(e.text),
                class_id: e.class_id,
                method_id: e.method_id,
            })),
        );
        self.channels.insert(ch, ChannelState::Closing);
        self.events.push_back(Event::ChannelClosed(ch));
    }
}

fn connection_on_channel(m: &method::Method) -> AmqpError {
    AmqpError::connection(ReplyCode::CommandInvalid, "unimplemented method")
        .with_method(m.class_id, m.method_id)
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use amq_protocol::protocol::{AMQPClass, channel};

    use crate::connection::test_support::{client_frames, drive, handshake};
    use crate::connection::{ChannelState, Connection, ConnectionConfig};
    use crate::frame::FrameWriter;
    use crate::reply::{AmqpError, ReplyCode};

    #[test]
    fn crossing_channel_closes_wait_for_the_peers_close_ok() {
        let now = Instant::now();
        let mut c = Connection::new(ConnectionConfig::default(), true, now);
        let mut out = FrameWriter::new();
        let mut input = handshake();
        drive(&mut c, &mut input, &mut out, now);
        c.close_channel(
            1,
            AmqpError::channel(ReplyCode::NotFound, "NOT_FOUND - no exchange"),
            &mut out,
        );
        let close = AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        }));
        let close_ok = AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}));
        let mut input = client_frames(|w| w.method(1, &close));
        drive(&mut c, &mut input, &mut out, now);
        assert!(
            matches!(c.channels.get(&1), Some(ChannelState::Closing)),
            "still owed the peer's close-ok"
        );
        let mut input = client_frames(|w| {
            w.method(1, &close_ok);
            w.method(1, &close_ok); // stray, for a channel already gone
        });
        drive(&mut c, &mut input, &mut out, now);
        assert!(c.channels.is_empty());
        assert!(c.is_open(), "a stray close-ok never closes the connection");
    }
}
