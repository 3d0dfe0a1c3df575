//! Error replies in RabbitMQ's shape: `{"error": ..., "reason": ...}` with its status codes.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use warren_amqp::AmqpError;

/// An API error: HTTP status, RabbitMQ's `error` word and a human `reason`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status} {error}: {reason}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// RabbitMQ's error word (`not_authorized`, `Object Not Found`, `bad_request`, ...).
    pub error: &'static str,
    /// Details.
    pub reason: String,
}

impl ApiError {
    /// 401 with `WWW-Authenticate`, as RabbitMQ answers a failed or insufficient login.
    #[must_use]
    pub fn unauthorised(reason: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            error: "not_authorized",
            reason: reason.into(),
        }
    }

    /// 404 for a missing vhost, user, queue or exchange.
    #[must_use]
    pub fn not_found() -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            error: "Object Not Found",
            reason: "Not Found".into(),
        }
    }

    /// 404 for a PUT or POST into a vhost that does not exist (RabbitMQ's shape for it).
    #[must_use]
    pub fn vhost_not_found() -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            error: "not_found",
            reason: "vhost_not_found".into(),
        }
    }

    /// 400 for a body or parameter that does not validate.
    #[must_use]
    pub fn bad_request(reason: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            error: "bad_request",
            reason: reason.into(),
        }
    }

    /// 401 without a body, as RabbitMQ answers a request without credentials.
    #[must_use]
    pub fn no_credentials() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            error: "",
            reason: String::new(),
        }
    }

    /// An AMQP error from the direct session, mapped as RabbitMQ's management plugin maps
    /// them (404 for NOT_FOUND, 401 for ACCESS_REFUSED, 400 otherwise), with AMQP's detail
    /// (without the `NAME - ` prefix, as RabbitMQ's API shows it).
    #[must_use]
    pub fn from_amqp(e: &AmqpError) -> Self {
        let text = e
            .text
            .split_once(" - ")
            .map_or_else(|| e.text.clone(), |(_, detail)| detail.to_string());
        match e.code.code() {
            404 => Self {
                status: StatusCode::NOT_FOUND,
                error: "not_found",
                reason: text,
            },
            403 => Self {
                status: StatusCode::UNAUTHORIZED,
                error: "not_authorized",
                reason: text,
            },
            _ => Self::bad_request(text),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = if self.error.is_empty() {
            self.status.into_response()
        } else {
            (
                self.status,
                axum::Json(json!({"error": self.error, "reason": self.reason})),
            )
                .into_response()
        };
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"RabbitMQ Management\""),
            );
        }
        r
    }
}
