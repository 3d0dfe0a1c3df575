//! Reply codes and protocol errors.
//!
//! Every error a peer can cause is an [`AmqpError`] value carrying the reply code RabbitMQ would
//! send and whether it closes the channel or the whole connection. Errors are turned into
//! `channel.close` / `connection.close` in exactly one place (the connection machine).

use std::fmt;

/// AMQP 0-9-1 reply codes (with RabbitMQ's names).
#[repr(u16)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplyCode {
    ReplySuccess = 200,
    ContentTooLarge = 311,
    NoRoute = 312,
    NoConsumers = 313,
    ConnectionForced = 320,
    InvalidPath = 402,
    AccessRefused = 403,
    NotFound = 404,
    ResourceLocked = 405,
    PreconditionFailed = 406,
    FrameError = 501,
    SyntaxError = 502,
    CommandInvalid = 503,
    ChannelError = 504,
    UnexpectedFrame = 505,
    ResourceError = 506,
    NotAllowed = 530,
    NotImplemented = 540,
    InternalError = 541,
}

impl ReplyCode {
    /// The numeric code sent on the wire.
    #[must_use]
    pub fn code(self) -> u16 {
        self as u16
    }

    /// Whether RabbitMQ treats the code as a channel ("soft") or connection ("hard") error.
    #[must_use]
    pub fn default_scope(self) -> Scope {
        match self {
            Self::ContentTooLarge
            | Self::NoRoute
            | Self::NoConsumers
            | Self::AccessRefused
            | Self::NotFound
            | Self::ResourceLocked
            | Self::PreconditionFailed => Scope::Channel,
            _ => Scope::Connection,
        }
    }

    /// The upper-case name RabbitMQ prefixes reply texts with.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::ReplySuccess => "REPLY_SUCCESS",
            Self::ContentTooLarge => "CONTENT_TOO_LARGE",
            Self::NoRoute => "NO_ROUTE",
            Self::NoConsumers => "NO_CONSUMERS",
            Self::ConnectionForced => "CONNECTION_FORCED",
            Self::InvalidPath => "INVALID_PATH",
            Self::AccessRefused => "ACCESS_REFUSED",
            Self::NotFound => "NOT_FOUND",
            Self::ResourceLocked => "RESOURCE_LOCKED",
            Self::PreconditionFailed => "PRECONDITION_FAILED",
            Self::FrameError => "FRAME_ERROR",
            Self::SyntaxError => "SYNTAX_ERROR",
            Self::CommandInvalid => "COMMAND_INVALID",
            Self::ChannelError => "CHANNEL_ERROR",
            Self::UnexpectedFrame => "UNEXPECTED_FRAME",
            Self::ResourceError => "RESOURCE_ERROR",
            Self::NotAllowed => "NOT_ALLOWED",
            Self::NotImplemented => "NOT_IMPLEMENTED",
            Self::InternalError => "INTERNAL_ERROR",
        }
    }
}

/// Whether an error closes one channel or the whole connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Answered with `channel.close`; the connection stays up.
    Channel,
    /// Answered with `connection.close`; every channel goes.
    Connection,
}

/// A protocol error with everything needed to build the close method.
///
/// `text` already carries RabbitMQ's `"NAME - detail"` form and is at most 255 bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct AmqpError {
    /// Channel or connection error.
    pub scope: Scope,
    /// The reply code.
    pub code: ReplyCode,
    /// The reply text, `"NAME - detail"`, truncated to a short string.
    pub text: String,
    /// Class of the method that caused the error (0 if none).
    pub class_id: u16,
    /// Method that caused the error (0 if none).
    pub method_id: u16,
}

impl fmt::Display for AmqpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.text, self.code.code())
    }
}

/// Short strings hold at most 255 bytes; like RabbitMQ, cut to 252 and append "...".
fn truncate_short(mut s: String) -> String {
    if s.len() > 255 {
        let mut end = 252;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("...");
    }
    s
}

impl AmqpError {
    fn new(scope: Scope, code: ReplyCode, detail: impl fmt::Display) -> Self {
        Self {
            scope,
            code,
            text: truncate_short(format!("{} - {}", code.name(), detail)),
            class_id: 0,
            method_id: 0,
        }
    }

    /// An error raised while handling a channel's method.
    ///
    /// Like RabbitMQ's `lookup_amqp_exception`, the code decides the scope: the "soft" codes
    /// (311, 312, 313, 403, 404, 405, 406) close the channel, every other code closes the
    /// connection (so NOT_ALLOWED for a reused consumer tag closes the connection).
    pub fn channel(code: ReplyCode, detail: impl fmt::Display) -> Self {
        Self::new(code.default_scope(), code, detail)
    }

    /// A connection error: the connection is closed.
    pub fn connection(code: ReplyCode, detail: impl fmt::Display) -> Self {
        Self::new(Scope::Connection, code, detail)
    }

    /// Record the method that caused the error (sent back in the close method).
    #[must_use]
    pub fn with_method(mut self, class_id: u16, method_id: u16) -> Self {
        if self.class_id == 0 && self.method_id == 0 {
            self.class_id = class_id;
            self.method_id = method_id;
        }
        self
    }

    /// The same error escalated to a connection error (used for errors on channel 0).
    #[must_use]
    pub fn into_connection(mut self) -> Self {
        self.scope = Scope::Connection;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_carries_rabbitmq_prefix_and_is_bounded() {
        let e = AmqpError::channel(ReplyCode::NotFound, "no queue 'q' in vhost '/'");
        assert_eq!(e.text, "NOT_FOUND - no queue 'q' in vhost '/'");
        assert_eq!(e.code.code(), 404);
        let long = AmqpError::connection(ReplyCode::FrameError, "é".repeat(300));
        assert!(long.text.len() <= 255 && long.text.ends_with("..."));
        assert_eq!(
            AmqpError::channel(ReplyCode::NotAllowed, "x").scope,
            Scope::Connection
        );
        assert_eq!(long.scope, Scope::Connection);
    }
}
