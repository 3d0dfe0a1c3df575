//! The tokio shell: accept connections and move bytes between sockets and the sans-IO machines.
//!
//! One task per connection owns its socket. Each wake-up (bytes read, outbox notified, timer,
//! shutdown) drains everything ready, then output is written from one buffer. Reading pauses
//! while more than `OUTPUT_HIGH_WATERMARK` bytes wait to be written, so a client that does not
//! read cannot grow our memory.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use warren_broker::stats::Lifecycle;

use amq_protocol::protocol::connection;
use anyhow::Context;
use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use warren_amqp::connection::{Connection, ConnectionConfig, Event, client_capability};
use warren_amqp::frame::FrameWriter;
use warren_amqp::{AMQPClass, AmqpError, ReplyCode, Scope};
use warren_broker::durable::Durable;
use warren_broker::node::connections::{ConnectionHandle, ConnectionInfo};
use warren_broker::queue::outbox::Outbox;
use warren_broker::{Broker, BrokerConfig, Session};
use warren_store::{Store, Writer};

use crate::config::ServerConfig;

/// Output bytes buffered before we stop reading from the client.
const OUTPUT_HIGH_WATERMARK: usize = 4 * 1024 * 1024;
/// Read buffer initial capacity.
const READ_BUFFER_INITIAL: usize = 64 * 1024;
/// Bytes submitted to the store and not yet committed above which connections stop reading
/// (publishers without confirms could otherwise outrun the disk and fill memory).
const STORE_PENDING_HIGH: u64 = 64 * 1024 * 1024;
/// How long shutdown waits for connections to finish their close handshake.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Run the broker until SIGINT or SIGTERM.
pub async fn run(cfg: ServerConfig) -> anyhow::Result<Exit> {
    for key in &cfg.ignored_keys {
        tracing::warn!(key, "rabbitmq.conf: Warren has no such setting; ignored");
    }
    std::fs::create_dir_all(&cfg.data_dir)
        .with_context(|| format!("creating data dir {}", cfg.data_dir.display()))?;
    let started = std::time::Instant::now();
    let (store, recovered) = Store::open(&cfg.data_dir, cfg.store)
        .with_context(|| format!("opening the store in {}", cfg.data_dir.display()))?;
    if recovered.truncated_bytes > 0 {
        tracing::warn!(
            bytes = recovered.truncated_bytes,
            "dropped uncommitted data left by a crash"
        );
    }
    let segments = store.segments();
    let writer = Writer::start(store).context("starting the store writer")?;
    let durable = Arc::new(Durable::new(writer, segments));
    durable.set_streams_dir(cfg.data_dir.join("streams"));
    // Connections paused on the store's backlog wait for the next commit.
    let (commit_tx, commit_rx) = watch::channel(0u64);
    durable.set_on_commit(Box::new(move |_pending| {
        commit_tx.send_modify(|generation| *generation = generation.wrapping_add(1));
    }));
    let broker = Broker::with_store(
        BrokerConfig {
            connection_max: cfg.connection_max,
            consumer_max_per_channel: cfg.consumer_max_per_channel,
            consumer_timeout_ms: cfg
                .consumer_timeout
                .map_or(BrokerConfig::default().consumer_timeout_ms, |t| {
                    Some(t).filter(|t| *t > 0)
                }),
            consumer_timeout_response: cfg.consumer_timeout_response,
            default_user: cfg.default_user.clone(),
            loopback_users: cfg.loopback_users.clone(),
            ..BrokerConfig::default()
        },
        Some(Arc::clone(&durable)),
    );
    let report = broker
        .recover(recovered)
        .context("recovering from the store")?;
    let orphans = broker.sweep_stream_dirs(&cfg.data_dir.join("streams"));
    if orphans > 0 {
        tracing::warn!(orphans, "removed stream directories no stream owns");
    }
    tracing::info!(
        exchanges = report.exchanges,
        queues = report.queues,
        bindings = report.bindings,
        messages = report.messages,
        delayed = report.delayed,
        policies = report.policies,
        users = report.users,
        vhosts = report.vhosts,
        dropped = report.dropped,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "recovered durable state"
    );

    // Before clients connect: quorum queues of a cluster are served once their groups run.
    let _cluster = match &cfg.cluster {
        Some(c) => Some(
            warren_cluster::node::ClusterNode::start(
                warren_cluster::node::NodeConfig {
                    name: c.node_name.clone(),
                    listen: c.listen,
                    peers: c.peers.clone(),
                    secret: c.secret.as_bytes().to_vec(),
                    data_dir: cfg.data_dir.join("cluster"),
                    join: c.join,
                    queue_log_pin_max: c.log_pin_max,
                    queue_log: c.quorum_log,
                    tls: c
                        .tls
                        .as_ref()
                        .map(crate::tls::cluster)
                        .transpose()
                        .context("cluster TLS")?,
                },
                Arc::clone(&broker),
            )
            .await
            .context("starting the cluster node")?,
        ),
        None => None,
    };

    broker.alarms().set_memory_watermark(cfg.watermarks.memory);
    broker
        .alarms()
        .set_disk_free_limit(cfg.watermarks.disk_free);
    // The first sample before clients connect, so an alarm that is already due holds at once.
    if let Some(sample) = crate::resources::sample(&cfg.data_dir) {
        broker.alarms().update(sample);
    }
    let monitor = tokio::spawn(crate::resources::monitor(
        Arc::clone(&broker),
        cfg.data_dir.clone(),
    ));

    // Bound before the AMQP listener, so that `warren ctl` works as soon as clients can connect.
    let admin_listener = crate::admin::bind(&crate::admin::socket_path(&cfg.data_dir))?;
    let listener = TcpListener::bind(cfg.amqp_listen)
        .await
        .with_context(|| format!("binding {}", cfg.amqp_listen))?;
    let local = listener.local_addr()?;
    tracing::info!(%local, "AMQP 0-9-1 listener started");
    // A line on stdout that tests and scripts can wait for.
    println!("warren: amqp listening on {local}");

    let amqps = match &cfg.amqps {
        Some((addr, opts)) => {
            let acceptor = crate::tls::acceptor(opts).context("configuring TLS")?;
            let listener = TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding {addr}"))?;
            let local = listener.local_addr()?;
            tracing::info!(%local, "AMQPS listener started");
            println!("warren: amqps listening on {local}");
            Some((listener, acceptor, opts.login_from))
        }
        None => None,
    };

    // The HTTP listeners are bound first: the API lists them (overview, port-listener check).
    let mut http_listeners = Vec::new();
    for (what, protocol, addr) in [
        ("management", "http", cfg.management_listen),
        ("prometheus", "http/prometheus", cfg.prometheus_listen),
    ] {
        let Some(addr) = addr else { continue };
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the {what} listener on {addr}"))?;
        let local = listener.local_addr()?;
        tracing::info!(%local, "{what} listener started");
        println!("warren: {what} listening on {local}");
        http_listeners.push((what, protocol, listener, local));
    }
    let node = warren_management::NodeInfo {
        message_size_max: cfg.limits.message_size_max,
        // A cluster node is known by its cluster name (queue leaders and members name it).
        node: cfg
            .cluster
            .as_ref()
            .map_or_else(|| format!("warren@{}", hostname()), |c| c.node_name.clone()),
        cluster_name: "warren".into(),
        identity: cfg.identity.clone(),
        listeners: std::iter::once(("amqp".to_string(), local))
            .chain(
                amqps
                    .as_ref()
                    .and_then(|(l, ..)| l.local_addr().ok())
                    .map(|a| ("amqp/ssl".to_string(), a)),
            )
            .chain(
                http_listeners
                    .iter()
                    .map(|(_, protocol, _, a)| ((*protocol).to_string(), *a)),
            )
            .collect(),
    };
    let app = warren_management::AppState::new(Arc::clone(&broker), node);
    let mut http_tasks = vec![tokio::spawn(warren_management::sample_rates(app.clone()))];
    for (what, _, listener, _) in http_listeners {
        let router = if what == "management" {
            warren_management::management_router(app.clone())
        } else {
            warren_management::prometheus_router(app.clone())
        };
        http_tasks.push(tokio::spawn(async move {
            let _ = warren_management::serve(listener, router).await;
        }));
    }

    let conn_config = ConnectionConfig {
        limits: cfg.limits,
        server_properties: warren_amqp::connection::server_properties(&cfg.identity, "warren"),
        mechanisms: cfg.mechanisms.clone(),
        ..ConnectionConfig::default()
    };
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let (done_tx, mut done_rx) = mpsc::channel::<()>(1);
    let env = ConnEnv {
        broker: Arc::clone(&broker),
        config: conn_config,
        shutdown: shutdown_rx,
        done: done_tx,
        store: StoreGate {
            durable: Arc::clone(&durable),
            commits: commit_rx,
        },
    };

    let joiner = Arc::new(crate::join::Joiner::new(
        cfg.standalone.clone(),
        cfg.data_dir.clone(),
    ));
    let admin = tokio::spawn(crate::admin::serve(
        admin_listener,
        Arc::clone(&broker),
        app.clone(),
        Arc::clone(&joiner),
    ));
    let signal = shutdown_signal();
    tokio::pin!(signal);
    let mut exit = Exit::Stopped;
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((socket, peer)) => {
                    tokio::spawn(serve_tcp(socket, peer, env.clone()));
                }
                Err(e) => accept_failed(e).await,
            },
            accepted = accept_opt(amqps.as_ref().map(|a| &a.0)) => match accepted {
                Ok((socket, peer)) => {
                    if let Some((_, acceptor, login_from)) = &amqps {
                        tokio::spawn(serve_tls(socket, peer, acceptor.clone(), *login_from, env.clone()));
                    }
                }
                Err(e) => accept_failed(e).await,
            },
            () = &mut signal => break,
            () = joiner.restart.notified() => {
                exit = Exit::Rejoin;
                break;
            }
        }
    }
    drop(amqps);
    tracing::info!("shutting down: closing connections with 320 CONNECTION_FORCED");
    drop(listener);
    let _ = shutdown_tx.send(true);
    // Every connection task holds a clone of `env.done`.
    drop(env);
    // Every connection task holds a sender; recv() returns None once all have finished.
    if tokio::time::timeout(SHUTDOWN_GRACE + Duration::from_secs(1), done_rx.recv())
        .await
        .is_err()
    {
        tracing::warn!("some connections did not close in time");
    }
    admin.abort();
    monitor.abort();
    for t in http_tasks {
        t.abort();
    }
    let _ = std::fs::remove_file(crate::admin::socket_path(&cfg.data_dir));
    // Everything submitted is committed before the process exits.
    broker.save_stream_offsets();
    durable.shutdown();
    tracing::info!("stopped");
    Ok(exit)
}

/// How the server ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Stopped (a signal).
    Stopped,
    /// Stopped to start again into a cluster (`warren ctl join_cluster`).
    Rejoin,
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// The machine's host name, for the node name (`warren@host`, as `rabbit@host`).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Back off after a failed accept (e.g. out of file descriptors) instead of spinning.
async fn accept_failed(e: std::io::Error) {
    tracing::warn!("accept failed: {e}");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// What every connection task takes from the server.
#[derive(Clone)]
struct ConnEnv {
    broker: Arc<Broker>,
    config: ConnectionConfig,
    shutdown: watch::Receiver<bool>,
    /// Dropped when the task ends: shutdown waits until every clone is gone.
    done: mpsc::Sender<()>,
    store: StoreGate,
}

async fn serve_tcp(socket: TcpStream, peer: SocketAddr, env: ConnEnv) {
    let _ = socket.set_nodelay(true);
    let local = socket.local_addr().unwrap_or(peer);
    let (rd, wr) = socket.into_split();
    let io = Io {
        rd,
        wr,
        peer,
        local,
        external_identity: None,
        tls: false,
    };
    serve(io, env).await;
}

async fn serve_tls(
    socket: TcpStream,
    peer: SocketAddr,
    acceptor: tokio_rustls::TlsAcceptor,
    login_from: crate::tls::CertLogin,
    env: ConnEnv,
) {
    let _ = socket.set_nodelay(true);
    let local = socket.local_addr().unwrap_or(peer);
    // The TLS handshake counts against the AMQP handshake timeout.
    let accepted =
        tokio::time::timeout(env.config.handshake_timeout, acceptor.accept(socket)).await;
    let stream = match accepted {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => {
            tracing::info!(%peer, "TLS handshake failed: {e}");
            return;
        }
        Err(_) => {
            tracing::info!(%peer, "TLS handshake timed out");
            return;
        }
    };
    let external_identity = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|certs| certs.first())
        .and_then(|cert| crate::tls::cert_identity(cert, login_from));
    let (rd, wr) = tokio::io::split(stream);
    let io = Io {
        rd,
        wr,
        peer,
        local,
        external_identity,
        tls: true,
    };
    serve(io, env).await;
}

/// What a connection needs to pause on the store's backlog.
#[derive(Clone)]
struct StoreGate {
    durable: Arc<Durable>,
    commits: watch::Receiver<u64>,
}

/// A connection's byte streams, plain or TLS, and what the transport established.
struct Io<R, W> {
    rd: R,
    wr: W,
    peer: SocketAddr,
    /// Our address the client connected to.
    local: SocketAddr,
    /// The user name of a verified client certificate (offers SASL EXTERNAL).
    external_identity: Option<String>,
    /// TLS buffers written bytes; they must be flushed once the output buffer is empty.
    tls: bool,
}

async fn accept_opt(listener: Option<&TcpListener>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match listener {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// Write what is pending, or flush the transport when nothing is (returns 0 then).
async fn write_or_flush<W: AsyncWrite + Unpin>(wr: &mut W, buf: &[u8]) -> std::io::Result<usize> {
    if buf.is_empty() {
        wr.flush().await.map(|()| 0)
    } else {
        wr.write(buf).await
    }
}

/// Drive one connection until it closes.
async fn serve<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(io: Io<R, W>, env: ConnEnv) {
    let ConnEnv {
        broker,
        config,
        mut shutdown,
        done: _done,
        mut store,
    } = env;
    let Io {
        mut rd,
        mut wr,
        peer,
        local,
        external_identity,
        tls,
    } = io;
    // Registered with the broker once open (management API: list, close).
    let mut registered: Option<Registered> = None;
    let mut close_request: Option<CloseFuture> = None;
    let mut snapshot_request: Option<DownFuture> = None;
    let mut conn = Connection::new(config, peer.ip().is_loopback(), Instant::now().into_std());
    if let Some(identity) = external_identity {
        conn = conn.with_external_identity(identity);
    }
    // Bytes handed to TLS but perhaps not yet on the socket.
    let mut unflushed = false;
    // Resource alarms: once this connection publishes while one is on, it is not read until
    // all clear. `alarm_mark` is its publish count when it first saw the alarm.
    let mut alarm = broker.alarms().subscribe();
    // Read once here and then only when the watch says it changed: no shared lock per wake-up.
    let mut alarms = *alarm.borrow_and_update();
    let mut alarm_live = true;
    let mut alarm_mark: Option<u64> = None;
    let mut blocked = false;
    let mut out = FrameWriter::new();
    let mut input = BytesMut::with_capacity(READ_BUFFER_INITIAL);
    let outbox = Arc::new(Outbox::default());
    let mut session: Option<Session> = None;
    let mut shutting_down = false;
    let mut shutdown_deadline: Option<Instant> = None;
    // Resolves when the connection's vhost is deleted (set once the session exists).
    let mut vhost_down: Option<DownFuture> = None;
    let mut watching_vhost = false;
    // Flow: reading pauses while a queue we publish into is over its limits (bounded).
    let mut flow: Option<(Arc<warren_broker::queue::Queue>, Instant)> = None;

    loop {
        if conn.is_closed() || conn.is_lingering() {
            break;
        }
        let timer = earliest(
            conn.poll_timeout().map(Instant::from_std),
            session
                .as_mut()
                .and_then(Session::next_deadline)
                .map(|wall| {
                    let wait = wall.saturating_sub(warren_broker::timers::wall_ms());
                    Instant::now() + Duration::from_millis(wait)
                }),
        );
        // Mark the commit generation seen before looking at the backlog: a commit after this
        // point wakes the select below, so no wake-up is lost.
        store.commits.borrow_and_update();
        if let Some(s) = session.as_ref()
            && conn.is_open()
        {
            if let Some(reason) = alarms.reason() {
                let mark = *alarm_mark.get_or_insert(s.publishes());
                if !blocked && s.publishes() > mark {
                    blocked = true;
                    if conn.client_capability("connection.blocked") {
                        out.method(
                            0,
                            &AMQPClass::Connection(connection::AMQPMethod::Blocked(
                                connection::Blocked {
                                    reason: reason.into(),
                                },
                            )),
                        );
                    }
                }
            } else {
                alarm_mark = None;
                if blocked {
                    blocked = false;
                    if conn.client_capability("connection.blocked") {
                        out.method(
                            0,
                            &AMQPClass::Connection(connection::AMQPMethod::Unblocked(
                                connection::Unblocked {},
                            )),
                        );
                    }
                }
            }
        }
        if blocked && !conn.is_open() {
            // Closing: its close-ok must be read (RabbitMQ reads a closing connection too).
            blocked = false;
        }
        let store_paused = store.durable.pending_bytes() > STORE_PENDING_HIGH;
        let read_enabled =
            out.pending() < OUTPUT_HIGH_WATERMARK && !store_paused && flow.is_none() && !blocked;
        if !read_enabled {
            conn.note_input_paused(Instant::now().into_std());
        }
        // Held output (a reply not durable yet) still lets a heartbeat put ahead of it out.
        let writable = if output_held(&session) {
            out.urgent()
        } else {
            out.pending()
        };
        tokio::select! {
            read = rd.read_buf(&mut input), if read_enabled => match read {
                Ok(0) | Err(_) => {
                    conn.handle_disconnect();
                }
                Ok(_) => {
                    // Frame by frame: each command is handled before the next frame is read,
                    // so a close in the same read cannot overtake earlier commands.
                    let now = Instant::now().into_std();
                    loop {
                        let before = input.len();
                        conn.handle_input(&mut input, &mut out, now, &*broker);
                        let handled = process_events(&mut conn, &mut session, &broker, &outbox, &mut out);
                        if handled == 0 && input.len() == before {
                            break;
                        }
                    }
                }
            },
            written = write_or_flush(&mut wr, &out.as_slice()[..writable]), if writable > 0 || unflushed => match written {
                Ok(0) if writable == 0 => unflushed = false,
                Ok(n) if n > 0 => {
                    out.consume(n);
                    unflushed = tls;
                    conn.note_sent(Instant::now().into_std());
                    if out.pending() == 0 && let Some(s) = session.as_mut() {
                        s.after_write();
                    }
                }
                _ => conn.handle_disconnect(),
            },
            () = outbox.notified(), if session.is_some() => {
                if let Some(s) = session.as_mut() {
                    s.drain_outbox(&mut out);
                }
            },
            _ = store.commits.changed(), if store_paused => {},
            changed = alarm.changed(), if alarm_live => {
                alarm_live = changed.is_ok();
                alarms = *alarm.borrow_and_update();
            },
            () = flow_released(flow.as_ref()), if flow.is_some() => flow = None,
            () = wait_opt(snapshot_request.as_mut()), if snapshot_request.is_some() => {
                if let (Some(s), Some(r)) = (session.as_ref(), registered.as_ref()) {
                    r.handle.answer_snapshots(&s.channel_infos());
                    let h = Arc::clone(&r.handle);
                    snapshot_request = Some(Box::pin(async move { h.snapshot_requested().await }));
                }
            },
            reason = wait_close(close_request.as_mut()), if close_request.is_some() => {
                close_request = None;
                let e = AmqpError::connection(ReplyCode::ConnectionForced, reason);
                conn.close_with(e, &mut out, Instant::now().into_std());
            },
            () = wait_opt(vhost_down.as_mut()), if vhost_down.is_some() => {
                vhost_down = None;
                let name = session.as_ref().map(|s| s.vhost().name.clone()).unwrap_or_default();
                let e = AmqpError::connection(ReplyCode::ConnectionForced, format!("vhost '{name}' is deleted"));
                conn.close_with(e, &mut out, Instant::now().into_std());
            },
            () = sleep_until(timer) => {
                conn.handle_timeout(Instant::now().into_std(), &mut out);
                if let Some(s) = session.as_mut() {
                    for (ch, e) in s.timed_out(warren_broker::timers::wall_ms(), &mut out) {
                        conn.close_channel(ch, e, &mut out);
                    }
                }
            },
            changed = shutdown.changed(), if !shutting_down => {
                shutting_down = true;
                let _ = changed;
                let e = AmqpError::connection(ReplyCode::ConnectionForced, "broker forced connection closure with reason 'shutdown'");
                conn.close_with(e, &mut out, Instant::now().into_std());
                shutdown_deadline = Some(Instant::now() + SHUTDOWN_GRACE);
            },
            () = sleep_until(shutdown_deadline) => break,
        }
        process_events(&mut conn, &mut session, &broker, &outbox, &mut out);
        if let Some(s) = session.as_mut() {
            if s.store_failed() {
                tracing::error!(%peer, "dropping the connection: a store operation it waits for failed");
                break;
            }
            s.flush(&mut out);
            if registered.is_none() {
                let info = ConnectionInfo {
                    name: format!("{peer} -> {local}"),
                    user: s.user().to_string(),
                    vhost: s.vhost().name.clone(),
                    peer,
                    local,
                    tls,
                    client_properties: conn.client_properties().clone(),
                    connected_at_ms: warren_broker::timers::wall_ms(),
                    frame_max: conn.frame_max(),
                    channel_max: conn.channel_max(),
                    heartbeat_s: conn.heartbeat_s(),
                };
                let handle = Registered::new(&broker, s.conn_id(), info);
                let h = Arc::clone(&handle);
                close_request = Some(Box::pin(async move { h.close_requested().await }));
                let h = Arc::clone(&handle);
                snapshot_request = Some(Box::pin(async move { h.snapshot_requested().await }));
                registered = Some(handle);
            }
            if let Some(r) = &registered {
                r.handle.set_channels(s.channel_count() as u64);
            }
            if !watching_vhost {
                watching_vhost = true;
                let vhost = Arc::clone(s.vhost());
                vhost_down = Some(Box::pin(async move { vhost.until_down().await }));
            }
            if flow.is_none()
                && let Some(q) = s.take_flow()
            {
                flow = Some((
                    q,
                    Instant::now()
                        + Duration::from_millis(warren_broker::limits::FLOW_PAUSE_MAX_MS),
                ));
            }
        }
    }
    // Replies held for the store are owed only once it committed them (bounded wait).
    let give_up = Instant::now() + SHUTDOWN_GRACE;
    while let Some(s) = session.as_mut() {
        s.drain_completions();
        if !s.output_held() || s.store_failed() {
            break;
        }
        if tokio::time::timeout_at(give_up, outbox.notified())
            .await
            .is_err()
        {
            break;
        }
    }
    // Deregistered here at the latest (or by the guard's drop if the task unwinds).
    drop(registered);
    let may_write = !output_held(&session) && !session.as_ref().is_some_and(Session::store_failed);
    // Released first: requeueing, exclusive queues and the connection counts must not wait
    // for a peer that stopped reading.
    if let Some(mut s) = session {
        s.close();
    }
    // Best effort, bounded: deliver the close frames we owe, then drop the socket. A TLS
    // shutdown waits until rustls has written everything it holds, so it is bounded too.
    let flushed = tokio::time::timeout(Duration::from_secs(1), async {
        if may_write && out.pending() > 0 {
            wr.write_all(out.as_slice()).await?;
            out.consume(out.pending());
        }
        if conn.is_lingering() {
            // TLS holds what it was given until flushed: the close-ok must reach the peer.
            wr.flush().await
        } else {
            wr.shutdown().await
        }
    })
    .await;
    // Linger only with the output written whole (else the peer is not reading, or gone).
    if conn.is_lingering() && may_write && matches!(flushed, Ok(Ok(()))) && !shutting_down {
        linger(
            &mut conn,
            (&mut rd, &mut wr),
            &mut input,
            &mut out,
            &*broker,
            &mut shutdown,
        )
        .await;
    }
}

/// After close-ok for the peer's connection.close: keep reading (the connection machine
/// discards everything but further closes, which it answers) until the peer closes the
/// socket, the machine's linger deadline passes or the node shuts down, so the peer's frames
/// still in flight never meet a closed socket. Every write is bounded by the same deadline:
/// a peer that sends closes and never reads cannot hold the task.
async fn linger<R, W>(
    conn: &mut Connection,
    (rd, wr): (&mut R, &mut W),
    input: &mut BytesMut,
    out: &mut FrameWriter,
    gate: &dyn warren_amqp::connection::Gatekeeper,
    shutdown: &mut watch::Receiver<bool>,
) where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    while conn.is_lingering() {
        let Some(deadline) = conn.poll_timeout().map(Instant::from_std) else {
            break;
        };
        tokio::select! {
            // Partial frames stay in `input` for the next read; the machine discards whole
            // ones, and one frame is at most frame_max.
            read = rd.read_buf(input) => match read {
                Ok(n) if n > 0 => {
                    conn.handle_input(input, out, Instant::now().into_std(), gate);
                    if out.pending() > 0 {
                        let written = tokio::time::timeout_at(deadline, async {
                            wr.write_all(out.as_slice()).await?;
                            wr.flush().await
                        })
                        .await;
                        if !matches!(written, Ok(Ok(()))) {
                            break;
                        }
                        out.consume(out.pending());
                    }
                }
                _ => break,
            },
            () = tokio::time::sleep_until(deadline) => {
                conn.handle_timeout(Instant::now().into_std(), out);
            }
            _ = shutdown.changed() => break,
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), wr.shutdown()).await;
}

fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Replies wait while a change they report is not durable yet (see `Session::output_held`).
fn output_held(session: &Option<Session>) -> bool {
    session.as_ref().is_some_and(Session::output_held)
}

/// Resolves when the connection's vhost is deleted.
/// One future for the connection's life, created once its vhost is known: polled by every
/// `select!`, so the vhost's shared `Notify` is touched once per connection, not per wake-up.
type DownFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// A connection's entry in the broker's registry, removed when dropped (also when the task
/// unwinds), so the management API never lists a connection that is gone.
struct Registered {
    broker: Arc<Broker>,
    id: u64,
    handle: Arc<ConnectionHandle>,
}

impl Registered {
    fn new(broker: &Arc<Broker>, id: u64, info: ConnectionInfo) -> Self {
        broker.stats().event(Lifecycle::ConnectionOpened);
        Self {
            broker: Arc::clone(broker),
            id,
            handle: broker.connections().register(id, info),
        }
    }
}

impl std::ops::Deref for Registered {
    type Target = Arc<ConnectionHandle>;
    fn deref(&self) -> &Self::Target {
        &self.handle
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.broker.connections().remove(self.id);
        self.broker.stats().event(Lifecycle::ConnectionClosed);
        // Whoever waits for this connection's channels gets none: it is gone.
        self.handle.answer_snapshots(&[]);
    }
}

/// Resolves with the reason when the management API asks the connection to close.
type CloseFuture = std::pin::Pin<Box<dyn std::future::Future<Output = String> + Send>>;

async fn wait_close(f: Option<&mut CloseFuture>) -> String {
    match f {
        Some(f) => f.as_mut().await,
        None => std::future::pending().await,
    }
}

async fn wait_opt(f: Option<&mut DownFuture>) {
    match f {
        Some(f) => f.as_mut().await,
        None => std::future::pending().await,
    }
}

/// Resolves when the queue a connection paused on drained, or the pause reached its bound.
async fn flow_released(flow: Option<&(Arc<warren_broker::queue::Queue>, Instant)>) {
    let Some((queue, until)) = flow else {
        return std::future::pending().await;
    };
    tokio::select! {
        () = queue.flow_released() => {},
        () = tokio::time::sleep_until(*until) => {},
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Hand the machine's events to the session; returns how many there were.
fn process_events(
    conn: &mut Connection,
    session: &mut Option<Session>,
    broker: &Arc<Broker>,
    outbox: &Arc<Outbox>,
    out: &mut FrameWriter,
) -> usize {
    let mut handled = 0;
    while let Some(event) = conn.poll_event() {
        handled += 1;
        match event {
            Event::Opened {
                user,
                vhost,
                client_properties,
            } => {
                let Some(vh) = broker.vhost(&vhost) else {
                    // Deleted since open_vhost counted this connection.
                    broker.release_connection(&user, &vhost);
                    let e = AmqpError::connection(
                        ReplyCode::NotAllowed,
                        format!("vhost {vhost} not found"),
                    );
                    conn.close_with(e, out, Instant::now().into_std());
                    continue;
                };
                let cancel_notify = client_capability(&client_properties, "consumer_cancel_notify");
                *session = Some(Session::new(
                    Arc::clone(broker),
                    vh,
                    user,
                    Arc::clone(outbox),
                    cancel_notify,
                ));
            }
            Event::ChannelOpened(ch) => {
                if let Some(s) = session.as_mut() {
                    s.channel_opened(ch);
                }
            }
            Event::ChannelClosed(ch) => {
                if let Some(s) = session.as_mut() {
                    s.channel_closed(ch);
                }
            }
            Event::Command(ch, cmd) => {
                // Commands decoded before an error closed their channel or the connection are dropped.
                if !conn.is_open() || !conn.channel_is_open(ch) {
                    continue;
                }
                let Some(s) = session.as_mut() else { continue };
                if let Err(e) = s.handle_command(ch, *cmd, out) {
                    match e.scope {
                        Scope::Channel => conn.close_channel(ch, e, out),
                        Scope::Connection => conn.close_with(e, out, Instant::now().into_std()),
                    }
                }
            }
        }
    }
    handled
}
