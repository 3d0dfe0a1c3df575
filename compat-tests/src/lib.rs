//! Test harness: start the real `warren` binary on a free port and stop it afterwards.
//!
//! The binary is `$WARREN_BIN`, or `target/debug/warren` in the workspace (built by
//! `cargo build --bin warren`, which the README's test command runs first).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A running broker process, killed on drop (its data directory is removed then too).
#[derive(Debug)]
pub struct Broker {
    child: Child,
    /// `127.0.0.1:PORT` the broker listens on.
    pub addr: String,
    data_dir: PathBuf,
    keep_data: bool,
}

fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("WARREN_BIN") {
        return PathBuf::from(p);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("target")
        .join("debug")
        .join("warren")
}

impl Broker {
    /// Start a broker on an ephemeral loopback port and wait for its "listening" line.
    ///
    /// # Panics
    /// If the binary is missing or does not report a listening address within 20 s.
    #[must_use]
    pub fn start() -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let data_dir = std::env::temp_dir().join(format!(
            "warren-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        Self::start_in(data_dir, &[])
    }

    /// Start a broker on `data_dir` (recovering what it holds) with extra command-line flags.
    ///
    /// # Panics
    /// As [`Broker::start`].
    #[must_use]
    pub fn start_in(data_dir: PathBuf, extra_args: &[&str]) -> Self {
        let bin = binary();
        assert!(
            bin.exists(),
            "warren binary not found at {}; run `cargo build --bin warren`",
            bin.display()
        );
        let mut child = Command::new(&bin)
            .args([
                "server",
                "--amqp-listen",
                "127.0.0.1:0",
                "--management-listen",
                "127.0.0.1:0",
                "--prometheus-listen",
                "127.0.0.1:0",
                "--log-level",
                "warn",
                "--data-dir",
            ])
            .arg(&data_dir)
            .args(extra_args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn warren");
        let stdout = child.stdout.take().expect("stdout piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("warren: amqp listening on ") {
                    let _ = tx.send(addr.to_string());
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = rx
            .recv_timeout(deadline - Instant::now())
            .expect("warren did not report its listening address");
        Self {
            child,
            addr,
            data_dir,
            keep_data: false,
        }
    }

    /// The data directory.
    #[must_use]
    pub fn data_dir(&self) -> &std::path::Path {
        &self.data_dir
    }

    /// Run `warren ctl --data-dir <dir> <args>`; returns (success, stdout + stderr).
    ///
    /// # Panics
    /// If the binary cannot be run.
    #[must_use]
    pub fn ctl(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new(binary())
            .arg("ctl")
            .arg("--data-dir")
            .arg(&self.data_dir)
            .args(args)
            .output()
            .expect("run warren ctl");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    }

    /// Run several ctl commands in order, each of which must succeed.
    ///
    /// # Panics
    /// If one fails (with its output).
    pub fn ctl_all(&self, commands: &[&[&str]]) {
        for args in commands {
            let (ok, out) = self.ctl(args);
            assert!(ok, "{args:?}: {out}");
        }
    }

    /// `add_vhost NAME [extra...]` and full permissions on it for guest.
    ///
    /// # Panics
    /// If either command fails.
    pub fn add_vhost_for_guest(&self, name: &str, extra: &[&str]) {
        let mut add = vec!["add_vhost", name];
        add.extend_from_slice(extra);
        self.ctl_all(&[
            &add,
            &["set_permissions", "-p", name, "guest", ".*", ".*", ".*"],
        ]);
    }

    /// SIGKILL the broker (no chance to flush anything) and return its data directory, which
    /// is kept for a restart.
    #[must_use]
    pub fn kill9(mut self) -> PathBuf {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.keep_data = true;
        self.data_dir.clone()
    }

    /// SIGTERM the broker, wait for it, and return its data directory for a restart.
    ///
    /// # Panics
    /// If the broker does not exit with status 0.
    #[must_use]
    pub fn stop(mut self) -> PathBuf {
        let status = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status()
            .expect("kill");
        assert!(status.success());
        let code = self.child.wait().expect("wait").code();
        assert_eq!(code, Some(0), "warren exits 0 on SIGTERM");
        self.keep_data = true;
        self.data_dir.clone()
    }

    /// The AMQP URI for guest on vhost "/".
    #[must_use]
    pub fn uri(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }

    /// Send SIGTERM and wait for exit; returns the exit status code.
    ///
    /// # Panics
    /// If the process cannot be signalled or waited for.
    pub fn terminate(mut self) -> Option<i32> {
        let status = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status()
            .expect("kill");
        assert!(status.success());
        self.child.wait().expect("wait").code()
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !self.keep_data {
            let _ = std::fs::remove_dir_all(&self.data_dir);
        }
    }
}

/// lapin helpers shared by the integration tests (each panics on failure: a test fails).
pub mod client {
    use std::time::Duration;

    use futures_lite::StreamExt;
    use lapin::options::{
        BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions,
        QueueDeclareOptions,
    };
    use lapin::types::FieldTable;
    use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

    use super::Broker;

    /// How long a test waits for an expected delivery.
    pub const WAIT: Duration = Duration::from_secs(10);

    /// Connect as guest to vhost "/".
    ///
    /// # Panics
    /// If the connection fails.
    pub async fn connect(b: &Broker) -> Connection {
        Connection::connect(&b.uri(), ConnectionProperties::default())
            .await
            .expect("connect")
    }

    /// A new channel in confirm mode.
    ///
    /// # Panics
    /// If the channel cannot be opened or confirm.select fails.
    pub async fn confirm_channel(conn: &Connection) -> Channel {
        let ch = conn.create_channel().await.expect("channel");
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm.select");
        ch
    }

    /// Bind `queue` to `exchange` with `key` and no arguments.
    ///
    /// # Panics
    /// If the broker refuses.
    pub async fn bind(ch: &Channel, queue: &str, exchange: &str, key: &str) {
        ch.queue_bind(
            queue.into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind");
    }

    /// Start a consumer on `queue` with tag `tag` (acking, or no-ack).
    ///
    /// # Panics
    /// If the broker refuses.
    pub async fn consume(ch: &Channel, queue: &str, tag: &str, no_ack: bool) -> lapin::Consumer {
        ch.basic_consume(
            queue.into(),
            tag.into(),
            BasicConsumeOptions {
                no_ack,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("consume")
    }

    /// The ready-message count of an existing queue (passive declare).
    ///
    /// # Panics
    /// If the queue does not exist.
    pub async fn message_count(ch: &Channel, queue: &str) -> u32 {
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive declare")
        .message_count()
    }

    /// Declare a queue with default flags (or durable).
    ///
    /// # Panics
    /// If the broker refuses.
    pub async fn queue(ch: &Channel, name: &str, durable: bool) {
        ch.queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare");
    }

    /// Publish and wait for the confirm (if the channel is in confirm mode, it must be an ack).
    ///
    /// # Panics
    /// If the publish fails or is nacked.
    pub async fn publish(
        ch: &Channel,
        exchange: &str,
        rk: &str,
        body: &[u8],
        props: BasicProperties,
    ) {
        let confirm = ch
            .basic_publish(
                exchange.into(),
                rk.into(),
                BasicPublishOptions::default(),
                body,
                props,
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert!(!confirm.is_nack(), "publish nacked");
    }

    /// The next delivery of `consumer`, within [`WAIT`].
    ///
    /// # Panics
    /// If none arrives in time or the stream ends.
    pub async fn next(consumer: &mut lapin::Consumer) -> lapin::message::Delivery {
        tokio::time::timeout(WAIT, consumer.next())
            .await
            .expect("delivery in time")
            .expect("stream open")
            .expect("delivery")
    }
}
