//! HTTP basic auth against the broker's users, and RabbitMQ's tag-based access levels.

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use base64::Engine;

use crate::{ApiError, AppState};

/// The authenticated user of a request with the tags that decide what it may do.
#[derive(Debug, Clone)]
pub struct Caller {
    /// User name.
    pub name: String,
    /// Its tags.
    pub tags: Vec<String>,
    /// `warren ctl` over the local admin socket: an administrator whose changes are made by
    /// the broker itself (as rabbitmqctl's), not checked against a user's permissions.
    pub internal: bool,
}

/// Marks a request made in process for `warren ctl` (see [`crate::local_call`]). It can only
/// be set by code in this process, never by an HTTP client.
#[derive(Debug, Clone, Copy)]
pub struct LocalAdmin;

impl Caller {
    /// Whether the caller has `tag`.
    pub fn has(&self, tag: &str) -> bool {
        self.tags.iter().any(|t| t == tag)
    }

    /// `administrator`: users, vhosts, permissions, everything.
    pub fn is_admin(&self) -> bool {
        self.has("administrator")
    }

    /// `monitoring` or above: sees every vhost's objects.
    pub fn sees_all_vhosts(&self) -> bool {
        self.is_admin() || self.has("monitoring")
    }

    /// 401 unless the caller is an administrator (RabbitMQ's text).
    ///
    /// # Errors
    /// [`ApiError::unauthorised`].
    pub fn require_admin(&self) -> Result<(), ApiError> {
        if self.is_admin() {
            Ok(())
        } else {
            Err(ApiError::unauthorised("Not administrator user"))
        }
    }

    /// 401 unless the caller may manage policies in `vhost`: an administrator, or a
    /// policymaker with a permission entry there (RabbitMQ's rule).
    ///
    /// # Errors
    /// [`ApiError::unauthorised`].
    pub fn require_policymaker(&self, state: &AppState, vhost: &str) -> Result<(), ApiError> {
        let permitted = state
            .broker
            .list_permissions(Some(vhost), Some(&self.name))
            .iter()
            .any(|p| p.vhost == vhost);
        if self.is_admin() || (self.has("policymaker") && permitted) {
            Ok(())
        } else {
            Err(ApiError::unauthorised("Not policymaker user"))
        }
    }

    /// Whether the caller may see or act in `vhost`: monitoring and administrator see all,
    /// others only the vhosts they have permissions in.
    pub fn may_use_vhost(&self, state: &AppState, vhost: &str) -> bool {
        self.sees_all_vhosts()
            || state
                .broker
                .list_permissions(Some(vhost), Some(&self.name))
                .iter()
                .any(|p| p.vhost == vhost)
    }

    /// 401 unless [`Caller::may_use_vhost`].
    ///
    /// # Errors
    /// [`ApiError::unauthorised`].
    pub fn require_vhost(&self, state: &AppState, vhost: &str) -> Result<(), ApiError> {
        if self.may_use_vhost(state, vhost) {
            Ok(())
        } else {
            Err(ApiError::unauthorised(
                "User not authorised to access virtual host",
            ))
        }
    }
}

/// The tags that open the management API at all (RabbitMQ's `management` and above).
const MANAGEMENT_TAGS: &[&str] = &["management", "policymaker", "monitoring", "administrator"];

fn credentials(parts: &Parts) -> Option<(String, String)> {
    let value = parts.headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let encoded = value
        .strip_prefix("Basic ")
        .or_else(|| value.strip_prefix("basic "))?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (user, pass) = text.split_once(':')?;
    Some((user.to_string(), pass.to_string()))
}

/// Check a request's credentials: the user's name, or the 401 RabbitMQ answers (no
/// credentials, a failed login, a loopback-only user from elsewhere).
fn login(parts: &Parts, state: &AppState) -> Result<String, ApiError> {
    if !parts.headers.contains_key(header::AUTHORIZATION) {
        return Err(ApiError::no_credentials());
    }
    let (name, password) =
        credentials(parts).ok_or_else(|| ApiError::unauthorised("Login failed"))?;
    if !state.broker.authenticate(&name, &password) {
        return Err(ApiError::unauthorised("Login failed"));
    }
    // Without the peer address (a router used without connect info) count as remote.
    let loopback = parts
        .extensions
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .is_some_and(|c| c.0.ip().is_loopback());
    if state.broker.is_loopback_user(&name) && !loopback {
        return Err(ApiError::unauthorised("User can only log in via localhost"));
    }
    Ok(name)
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        if parts.extensions.get::<LocalAdmin>().is_some() {
            return Ok(Self {
                name: "warren-ctl".into(),
                tags: vec!["administrator".into()],
                internal: true,
            });
        }
        let name = login(parts, state)?;
        let tags = state
            .broker
            .list_users()
            .into_iter()
            .find(|u| u.name == name)
            .map(|u| u.tags)
            .unwrap_or_default();
        if !tags.iter().any(|t| MANAGEMENT_TAGS.contains(&t.as_str())) {
            return Err(ApiError::unauthorised("Not management user"));
        }
        Ok(Self {
            name,
            tags,
            internal: false,
        })
    }
}

/// A user of the HTTP queue API (`/v1`): any user who logs in, as an AMQP client does, with
/// no management tag. What it may do is its vhost permissions: write on a queue to publish
/// into it, read to claim from it and settle claims.
#[derive(Debug, Clone)]
pub struct QueueUser {
    /// User name.
    pub name: String,
    /// `warren ctl` on this node (the admin socket): every permission, as rabbitmqctl has.
    pub local_admin: bool,
}

impl FromRequestParts<AppState> for QueueUser {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        if parts.extensions.get::<LocalAdmin>().is_some() {
            return Ok(Self {
                name: "warren-ctl".into(),
                local_admin: true,
            });
        }
        Ok(Self {
            name: login(parts, state)?,
            local_admin: false,
        })
    }
}
