//! The admin socket's wire format, shared by its server ([`super::socket`]) and its client
//! ([`super::client`]): where the socket lives and the JSON request sent on one line.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The socket of a data directory.
#[must_use]
pub fn socket_path(data_dir: &Path) -> PathBuf {
    data_dir.join("warren.sock")
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(super) enum Request {
    /// A management API request (method, path, JSON body).
    Api {
        method: String,
        path: String,
        body: Option<Value>,
        #[serde(default)]
        headers: Vec<(String, String)>,
    },
    SetMemoryWatermark {
        relative: Option<f64>,
        absolute: Option<u64>,
    },
    SetDiskFreeLimit {
        absolute: Option<u64>,
        mem_relative: Option<f64>,
    },
    ListAlarms,
    AuthenticateUser {
        name: String,
        password: String,
    },
    /// Join the cluster of these seeds (`name@host:port,...`), this node reached at
    /// `address` (default: its cluster listen address); see [`crate::join`].
    JoinCluster {
        seeds: String,
        address: Option<String>,
    },
}
