//! A direct (in-process) AMQP session: the management API declares, deletes, purges,
//! publishes and gets through the same [`Session`] an AMQP connection uses, so permissions,
//! argument validation, durability and reply texts are the same for both. RabbitMQ's
//! management plugin does the same over its direct AMQP connection.

use std::sync::Arc;
use std::time::Duration;

use amq_protocol::protocol::AMQPClass;
use bytes::BytesMut;
use warren_amqp::assembler::{Command, Content};
use warren_amqp::frame::{FRAME_BODY, FRAME_HEADER, FRAME_METHOD, FrameWriter, decode_frame};
use warren_amqp::method::{self, Method};
use warren_amqp::properties::Properties;
use warren_amqp::{AmqpError, limits};
use warren_broker::queue::outbox::Outbox;
use warren_broker::routing::vhost::VHost;
use warren_broker::{Broker, Session};

use crate::ApiError;

/// The one channel a direct session uses.
const CHANNEL: u16 = 1;
/// How long a call waits for the store to commit what it changed.
const COMMIT_WAIT: Duration = Duration::from_secs(30);

/// A reply: its method and, for basic.get-ok, the message.
#[derive(Debug)]
pub struct Reply {
    /// The reply method.
    pub method: AMQPClass,
    /// Content (basic.get-ok).
    pub content: Option<(Properties, BytesMut)>,
}

/// One direct session as `user` in `vhost`, closed on drop.
pub struct Direct {
    session: Session,
    outbox: Arc<Outbox>,
    out: FrameWriter,
}

impl Direct {
    /// Open a session (the vhost must exist).
    ///
    /// # Errors
    /// 404 when the vhost does not exist.
    pub fn open(broker: &Arc<Broker>, vhost: &str, user: &str) -> Result<Self, ApiError> {
        let vh: Arc<VHost> = broker.vhost(vhost).ok_or_else(ApiError::not_found)?;
        let outbox = Arc::new(Outbox::default());
        let mut session = Session::direct(
            Arc::clone(broker),
            vh,
            user.to_string(),
            Arc::clone(&outbox),
        );
        session.channel_opened(CHANNEL);
        Ok(Self {
            session,
            outbox,
            out: FrameWriter::new(),
        })
    }

    /// Open a session of the broker itself (definitions import): nothing is refused for
    /// lack of permissions, as RabbitMQ imports as its internal user.
    ///
    /// # Errors
    /// 404 when the vhost does not exist.
    pub fn internal(broker: &Arc<Broker>, vhost: &str) -> Result<Self, ApiError> {
        let vh: Arc<VHost> = broker.vhost(vhost).ok_or_else(ApiError::not_found)?;
        let outbox = Arc::new(Outbox::default());
        let mut session = Session::internal(Arc::clone(broker), vh, Arc::clone(&outbox));
        session.channel_opened(CHANNEL);
        Ok(Self {
            session,
            outbox,
            out: FrameWriter::new(),
        })
    }

    /// Send one method (with content for basic.publish) and return the replies, once the
    /// changes it holds replies for are durable (declares, deletes, binds; a publish is
    /// durable only in confirm mode, see [`Direct::later_replies`]).
    ///
    /// # Errors
    /// The AMQP error the broker answered with (channel and connection errors alike), or a
    /// 500 when the store failed.
    pub async fn call(
        &mut self,
        class: AMQPClass,
        content: Option<Content>,
    ) -> Result<Vec<Reply>, ApiError> {
        let cmd = Command {
            method: Method {
                class_id: class.get_amqp_class_id(),
                method_id: class.get_amqp_method_id(),
                class,
            },
            content,
        };
        if let Err(e) = self.session.handle_command(CHANNEL, cmd, &mut self.out) {
            return Err(ApiError::from_amqp(&e));
        }
        let deadline = tokio::time::Instant::now() + COMMIT_WAIT;
        loop {
            self.session.drain_completions();
            if self.session.store_failed() {
                return Err(store_failed());
            }
            if !self.session.output_held() {
                break;
            }
            if tokio::time::timeout_at(deadline, self.outbox.notified())
                .await
                .is_err()
            {
                return Err(store_failed());
            }
        }
        self.session.flush(&mut self.out);
        self.replies().map_err(|e| ApiError::from_amqp(&e))
    }

    /// Replies that arrive after a call returned (publisher confirms): drain what the store
    /// completed and flush, waiting for the outbox when nothing is there yet.
    ///
    /// # Errors
    /// A 500 when the store failed or nothing arrived within the commit wait.
    pub async fn later_replies(&mut self) -> Result<Vec<Reply>, ApiError> {
        let deadline = tokio::time::Instant::now() + COMMIT_WAIT;
        loop {
            self.session.drain_completions();
            if self.session.store_failed() {
                return Err(store_failed());
            }
            self.session.flush(&mut self.out);
            let replies = self.replies().map_err(|e| ApiError::from_amqp(&e))?;
            if !replies.is_empty() {
                return Ok(replies);
            }
            if tokio::time::timeout_at(deadline, self.outbox.notified())
                .await
                .is_err()
            {
                return Err(store_failed());
            }
        }
    }

    /// Decode what the session wrote since the last call.
    fn replies(&mut self) -> Result<Vec<Reply>, AmqpError> {
        let mut buf = BytesMut::from(self.out.as_slice());
        self.out.consume(self.out.pending());
        let mut replies: Vec<Reply> = Vec::new();
        while let Some(frame) = decode_frame(&mut buf, u32::MAX)? {
            match frame.kind {
                FRAME_METHOD => {
                    let m = method::decode(&frame.payload, limits::TABLE_DEPTH_MAX)?;
                    replies.push(Reply {
                        method: m.class,
                        content: None,
                    });
                }
                FRAME_HEADER if frame.payload.len() >= 12 => {
                    let props =
                        Properties::parse(frame.payload.slice(12..), limits::TABLE_DEPTH_MAX)
                            .map_err(|_| {
                                AmqpError::connection(
                                    warren_amqp::ReplyCode::InternalError,
                                    "bad header",
                                )
                            })?;
                    if let Some(last) = replies.last_mut() {
                        last.content = Some((props, BytesMut::new()));
                    }
                }
                FRAME_BODY => {
                    if let Some(Reply {
                        content: Some((_, body)),
                        ..
                    }) = replies.last_mut()
                    {
                        body.extend_from_slice(&frame.payload);
                    }
                }
                _ => {}
            }
        }
        Ok(replies)
    }
}

impl Drop for Direct {
    fn drop(&mut self) {
        self.session.close();
    }
}

fn store_failed() -> ApiError {
    ApiError {
        status: axum::http::StatusCode::INTERNAL_SERVER_ERROR,
        error: "internal_error",
        reason: "the store did not commit the change".into(),
    }
}
