//! Frame assembly for one channel: method -> content header -> body frames.
//!
//! A three-state machine (as RabbitMQ's `rabbit_command_assembler`). An oversize message is
//! refused at the content header, before any body byte is buffered. A body that arrives in one
//! frame is passed on without copying; a multi-frame body is copied once into a buffer sized by
//! the (already checked) header.

use bytes::{Bytes, BytesMut};

use crate::frame::{FRAME_BODY, FRAME_HEADER, FRAME_METHOD, RawFrame};
use crate::method::{self, BASIC_PUBLISH, Method};
use crate::properties::Properties;
use crate::reply::{AmqpError, ReplyCode};

/// The content of a message: validated properties and the whole body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Content {
    /// Properties, kept raw for byte-exact forwarding.
    pub properties: Properties,
    /// The body.
    pub body: Bytes,
}

/// A complete command: a method and, for basic.publish, its content.
#[derive(Debug, Clone, PartialEq)]
pub struct Command {
    /// The method.
    pub method: Method,
    /// The content, present exactly when the method carries content.
    pub content: Option<Content>,
}

/// Limits the assembler enforces.
#[derive(Debug, Clone, Copy)]
pub struct AssemblyLimits {
    /// Largest body accepted (bytes).
    pub message_size_max: u64,
    /// Deepest table nesting accepted.
    pub table_depth_max: usize,
}

#[derive(Debug, Default)]
enum State {
    #[default]
    Idle,
    AwaitHeader(Method),
    AwaitBody {
        method: Method,
        properties: Properties,
        size: usize,
        body: Body,
    },
}

#[derive(Debug)]
enum Body {
    Empty,
    One(Bytes),
    Many(BytesMut),
}

impl Body {
    fn len(&self) -> usize {
        match self {
            Body::Empty => 0,
            Body::One(b) => b.len(),
            Body::Many(b) => b.len(),
        }
    }
}

/// Assembles frames of one channel into commands.
#[derive(Debug, Default)]
pub struct Assembler {
    state: State,
}

fn unexpected(detail: &str) -> AmqpError {
    AmqpError::connection(ReplyCode::UnexpectedFrame, detail)
}

/// An unexpected frame in the middle of a publish names basic.publish, as RabbitMQ does.
fn unexpected_in_publish(detail: &str) -> AmqpError {
    unexpected(detail).with_method(60, 40)
}

impl Assembler {
    /// Whether a content header or body is expected next.
    #[must_use]
    pub fn in_content(&self) -> bool {
        !matches!(self.state, State::Idle)
    }

    /// Feed one method, header or body frame. Returns a command once one is complete.
    pub fn handle_frame(
        &mut self,
        frame: RawFrame,
        limits: AssemblyLimits,
    ) -> Result<Option<Command>, AmqpError> {
        match (frame.kind, std::mem::take(&mut self.state)) {
            (FRAME_METHOD, State::Idle) => {
                let method = method::decode(&frame.payload, limits.table_depth_max)?;
                if (method.class_id, method.method_id) == BASIC_PUBLISH {
                    self.state = State::AwaitHeader(method);
                    Ok(None)
                } else {
                    Ok(Some(Command {
                        method,
                        content: None,
                    }))
                }
            }
            (FRAME_METHOD, State::AwaitHeader(_)) => Err(unexpected_in_publish(
                "expected content header for class 60, got non content header frame instead",
            )),
            (FRAME_METHOD, State::AwaitBody { .. }) | (FRAME_HEADER, State::AwaitBody { .. }) => {
                Err(unexpected_in_publish(
                    "expected content body, got non content body frame instead",
                ))
            }
            (FRAME_HEADER, State::AwaitHeader(method)) => {
                self.header(method, frame.payload, limits)
            }
            (
                FRAME_BODY,
                State::AwaitBody {
                    method,
                    properties,
                    size,
                    body,
                },
            ) => self.body(method, properties, size, body, frame.payload),
            (FRAME_HEADER | FRAME_BODY, State::Idle) => Err(unexpected(
                "expected method frame, got non method frame instead",
            )),
            (FRAME_BODY, State::AwaitHeader(_)) => Err(unexpected_in_publish(
                "expected content header for class 60, got non content header frame instead",
            )),
            (kind, _) => Err(AmqpError::connection(
                ReplyCode::FrameError,
                format!("unexpected frame type {kind}"),
            )),
        }
    }

    fn header(
        &mut self,
        method: Method,
        payload: Bytes,
        limits: AssemblyLimits,
    ) -> Result<Option<Command>, AmqpError> {
        if payload.len() < 14 {
            return Err(AmqpError::connection(
                ReplyCode::FrameError,
                "content header frame too short",
            ));
        }
        let class_id = u16::from_be_bytes([payload[0], payload[1]]);
        if class_id != method.class_id {
            return Err(unexpected_in_publish(&format!(
                "expected content header for class {}, got one for class {class_id} instead",
                method.class_id
            )));
        }
        let size = u64::from_be_bytes([
            payload[4],
            payload[5],
            payload[6],
            payload[7],
            payload[8],
            payload[9],
            payload[10],
            payload[11],
        ]);
        if size > limits.message_size_max {
            return Err(AmqpError::channel(
                ReplyCode::PreconditionFailed,
                format!(
                    "message size {size} is larger than configured max size {}",
                    limits.message_size_max
                ),
            )
            .with_method(60, 40));
        }
        let properties =
            Properties::parse(payload.slice(12..), limits.table_depth_max).map_err(|e| {
                AmqpError::connection(
                    ReplyCode::FrameError,
                    format!("cannot decode content header: {e}"),
                )
            })?;
        if size == 0 {
            return Ok(Some(Command {
                method,
                content: Some(Content {
                    properties,
                    body: Bytes::new(),
                }),
            }));
        }
        // The size fits in usize: it is at most message_size_max, itself far below usize::MAX.
        let size = usize::try_from(size)
            .map_err(|_| AmqpError::connection(ReplyCode::FrameError, "body size"))?;
        self.state = State::AwaitBody {
            method,
            properties,
            size,
            body: Body::Empty,
        };
        Ok(None)
    }

    fn body(
        &mut self,
        method: Method,
        properties: Properties,
        size: usize,
        body: Body,
        chunk: Bytes,
    ) -> Result<Option<Command>, AmqpError> {
        if body.len() + chunk.len() > size {
            return Err(AmqpError::connection(
                ReplyCode::FrameError,
                "content body frame exceeds remaining content size",
            )
            .with_method(60, 40));
        }
        let body = match body {
            Body::Empty => Body::One(chunk),
            Body::One(first) => {
                let mut buf = BytesMut::with_capacity(size);
                buf.extend_from_slice(&first);
                buf.extend_from_slice(&chunk);
                Body::Many(buf)
            }
            Body::Many(mut buf) => {
                buf.extend_from_slice(&chunk);
                Body::Many(buf)
            }
        };
        if body.len() < size {
            self.state = State::AwaitBody {
                method,
                properties,
                size,
                body,
            };
            return Ok(None);
        }
        let body = match body {
            Body::Empty => Bytes::new(),
            Body::One(b) => b,
            Body::Many(b) => b.freeze(),
        };
        Ok(Some(Command {
            method,
            content: Some(Content { properties, body }),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BufMut;

    const LIMITS: AssemblyLimits = AssemblyLimits {
        message_size_max: 1000,
        table_depth_max: 8,
    };

    fn publish() -> RawFrame {
        let mut b = BytesMut::new();
        b.put_u16(60);
        b.put_u16(40);
        b.put_u16(0);
        b.put_u8(0);
        b.put_u8(1);
        b.put_u8(b'q');
        b.put_u8(0);
        RawFrame {
            kind: FRAME_METHOD,
            channel: 1,
            payload: b.freeze(),
        }
    }

    fn header(size: u64) -> RawFrame {
        let mut b = BytesMut::new();
        b.put_u16(60);
        b.put_u16(0);
        b.put_u64(size);
        b.put_u16(0);
        RawFrame {
            kind: FRAME_HEADER,
            channel: 1,
            payload: b.freeze(),
        }
    }

    fn body(data: &'static [u8]) -> RawFrame {
        RawFrame {
            kind: FRAME_BODY,
            channel: 1,
            payload: Bytes::from_static(data),
        }
    }

    #[test]
    fn assembles_multi_frame_bodies() {
        let mut a = Assembler::default();
        assert!(a.handle_frame(publish(), LIMITS).unwrap().is_none());
        assert!(a.handle_frame(header(6), LIMITS).unwrap().is_none());
        assert!(a.handle_frame(body(b"abc"), LIMITS).unwrap().is_none());
        let cmd = a.handle_frame(body(b"def"), LIMITS).unwrap().unwrap();
        assert_eq!(&cmd.content.unwrap().body[..], b"abcdef");
        assert!(!a.in_content());
    }

    #[test]
    fn empty_body_completes_at_header() {
        let mut a = Assembler::default();
        a.handle_frame(publish(), LIMITS).unwrap();
        let cmd = a.handle_frame(header(0), LIMITS).unwrap().unwrap();
        assert!(cmd.content.unwrap().body.is_empty());
    }

    #[test]
    fn out_of_order_frames_are_unexpected() {
        let mut a = Assembler::default();
        assert_eq!(
            a.handle_frame(header(1), LIMITS).unwrap_err().code,
            ReplyCode::UnexpectedFrame
        );
        let mut a = Assembler::default();
        assert_eq!(
            a.handle_frame(body(b"x"), LIMITS).unwrap_err().code,
            ReplyCode::UnexpectedFrame
        );
        let mut a = Assembler::default();
        a.handle_frame(publish(), LIMITS).unwrap();
        assert_eq!(
            a.handle_frame(publish(), LIMITS).unwrap_err().code,
            ReplyCode::UnexpectedFrame
        );
        let mut a = Assembler::default();
        a.handle_frame(publish(), LIMITS).unwrap();
        a.handle_frame(header(2), LIMITS).unwrap();
        assert_eq!(
            a.handle_frame(body(b"xyz"), LIMITS).unwrap_err().code,
            ReplyCode::FrameError
        );
    }

    #[test]
    fn oversize_message_refused_at_header_as_channel_error() {
        let mut a = Assembler::default();
        a.handle_frame(publish(), LIMITS).unwrap();
        let e = a.handle_frame(header(1001), LIMITS).unwrap_err();
        assert_eq!(
            (e.code, e.scope),
            (ReplyCode::PreconditionFailed, crate::Scope::Channel)
        );
        assert_eq!(
            e.text,
            "PRECONDITION_FAILED - message size 1001 is larger than configured max size 1000"
        );
    }

    /// One generated frame: mostly well-formed publish sequences, with random method ids,
    /// header sizes and bodies mixed in, so the assembler's states are all reached.
    #[derive(Debug, Clone)]
    enum Gen {
        Publish,
        OtherMethod(u16, u16, Vec<u8>),
        Header(u64, u16, Vec<u8>),
        Body(Vec<u8>),
        Heartbeat,
    }

    fn gen_frame() -> impl proptest::strategy::Strategy<Value = Gen> {
        use proptest::prelude::*;
        prop_oneof![
            3 => Just(Gen::Publish),
            1 => (any::<u16>(), any::<u16>(), proptest::collection::vec(any::<u8>(), 0..24))
                .prop_map(|(c, m, a)| Gen::OtherMethod(c, m, a)),
            2 => (0u64..8).prop_map(|n| Gen::Header(n, 0, Vec::new())),
            1 => (0u64..1500, any::<u16>(), proptest::collection::vec(any::<u8>(), 0..24))
                .prop_map(|(n, f, p)| Gen::Header(n, f, p)),
            3 => proptest::collection::vec(any::<u8>(), 0..4).prop_map(Gen::Body),
            1 => proptest::collection::vec(any::<u8>(), 0..400).prop_map(Gen::Body),
            1 => Just(Gen::Heartbeat),
        ]
    }

    fn encode(g: &Gen) -> Vec<u8> {
        let (kind, payload): (u8, Vec<u8>) = match g {
            Gen::Publish => (FRAME_METHOD, publish().payload.to_vec()),
            Gen::OtherMethod(c, m, a) => {
                let mut p = Vec::new();
                p.extend_from_slice(&c.to_be_bytes());
                p.extend_from_slice(&m.to_be_bytes());
                p.extend_from_slice(a);
                (FRAME_METHOD, p)
            }
            Gen::Header(n, flags, props) => {
                let mut p = vec![0, 60, 0, 0];
                p.extend_from_slice(&n.to_be_bytes());
                p.extend_from_slice(&flags.to_be_bytes());
                p.extend_from_slice(props);
                (FRAME_HEADER, p)
            }
            Gen::Body(b) => (FRAME_BODY, b.clone()),
            Gen::Heartbeat => (crate::frame::FRAME_HEARTBEAT, Vec::new()),
        };
        let mut f = vec![kind, 0, 1];
        f.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
        f.extend_from_slice(&payload);
        f.push(crate::frame::FRAME_END);
        f
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

        /// Frame decoder + assembler over generated frame sequences delivered in arbitrary
        /// chunks: no panic, and every assembled message has exactly its declared size, which
        /// never exceeds the limit. After the first error the stream is abandoned, as the
        /// connection does.
        #[test]
        fn decoder_and_assembler_never_panic_and_respect_sizes(
            frames in proptest::collection::vec(gen_frame(), 1..40),
            cuts in proptest::collection::vec(1usize..64, 1..16),
        ) {
            let wire: Vec<u8> = frames.iter().flat_map(encode).collect();
            let mut a = Assembler::default();
            let mut buf = BytesMut::new();
            let mut at = 0;
            let mut cut = cuts.iter().cycle();
            let mut declared: Option<u64> = None;
            'feed: while at < wire.len() {
                let n = (*cut.next().unwrap()).min(wire.len() - at);
                buf.extend_from_slice(&wire[at..at + n]);
                at += n;
                loop {
                    match crate::frame::decode_frame(&mut buf, 4096) {
                        Ok(None) => break,
                        Err(_) => break 'feed,
                        Ok(Some(f)) if f.kind == crate::frame::FRAME_HEARTBEAT => {}
                        Ok(Some(f)) => {
                            if f.kind == FRAME_HEADER && f.payload.len() >= 12 {
                                let size: [u8; 8] = f.payload[4..12].try_into().unwrap();
                                declared = Some(u64::from_be_bytes(size));
                            }
                            match a.handle_frame(f, LIMITS) {
                                Err(_) => break 'feed,
                                Ok(None) => {}
                                Ok(Some(cmd)) => {
                                    if let Some(c) = cmd.content {
                                        let n = c.body.len() as u64;
                                        proptest::prop_assert!(n <= LIMITS.message_size_max);
                                        proptest::prop_assert_eq!(Some(n), declared);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
