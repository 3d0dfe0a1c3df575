//! A lean AMQP 0-9-1 client for the measured hot path (publish, confirm, deliver, ack).
//!
//! lapin writes every frame with its own syscall and costs about 40 µs of CPU per message on
//! a 2-core machine, which makes any broker look client-bound. This client encodes many frames
//! into one buffer and writes it with one syscall, and decodes everything one read returned, as
//! RabbitMQ's Java PerfTest does with its buffered socket. Both brokers are measured with the
//! same client, so ratios stay fair. Topology (declare, bind, purge, delete) still goes through
//! lapin: it is not measured.
//!
//! It speaks exactly what the scenarios need: PLAIN authentication, one channel, basic.publish
//! with confirms, basic.consume with prefetch and multiple acks. Anything else the broker sends
//! (connection.close, channel.close, basic.return) ends the run with an error.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, basic, channel, confirm, connection};
use amq_protocol::types::{AMQPValue, FieldTable};
use anyhow::{Context, bail};
use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use warren_amqp::frame::{
    FRAME_BODY, FRAME_HEADER, FRAME_HEARTBEAT, FRAME_METHOD, FrameWriter, PROTOCOL_HEADER,
    RawFrame, decode_frame,
};

use crate::{Args, Stats, nanos_since, record};

/// The frame size we ask for (RabbitMQ's default).
const FRAME_MAX: u32 = 131_072;
/// Encoded bytes a publisher accumulates before writing them.
const WRITE_BATCH: usize = 256 * 1024;
/// The channel every connection uses.
const CHANNEL: u16 = 1;

/// Connections in their handshake at once, across the process.
pub const OPENS_IN_FLIGHT: usize = 64;

/// Handshakes tried for one connection before its task fails.
pub const OPEN_ATTEMPTS: u32 = 3;

/// Whether `e` is an I/O error (the connection broke), not a protocol one.
fn is_io(e: &anyhow::Error) -> bool {
    e.chain()
        .any(|c| c.downcast_ref::<std::io::Error>().is_some())
}

static OPENING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(OPENS_IN_FLIGHT);

/// Where and as whom to connect, from an `amqp://user:pass@host:port/vhost` URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// `host:port`.
    pub addr: String,
    /// User name.
    pub user: String,
    /// Password.
    pub password: String,
    /// Virtual host (percent-decoded).
    pub vhost: String,
}

impl Endpoint {
    /// Parse the subset of the AMQP URI scheme the benchmark uses.
    pub fn parse(uri: &str) -> anyhow::Result<Self> {
        let rest = uri
            .strip_prefix("amqp://")
            .with_context(|| format!("{uri}: only amqp:// URIs are supported"))?;
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (creds, hostport) = match authority.rsplit_once('@') {
            Some((c, h)) => (c, h),
            None => ("guest:guest", authority),
        };
        let (user, password) = creds.split_once(':').unwrap_or((creds, ""));
        let addr = if hostport.contains(':') {
            hostport.to_string()
        } else {
            format!("{hostport}:5672")
        };
        let vhost = if path.is_empty() {
            "/".to_string()
        } else {
            percent_decode(path)?
        };
        Ok(Self {
            addr,
            user: percent_decode(user)?,
            password: percent_decode(password)?,
            vhost,
        })
    }
}

fn percent_decode(s: &str) -> anyhow::Result<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .with_context(|| format!("{s}: bad escape"))?;
            out.push(u8::from_str_radix(hex, 16).with_context(|| format!("{s}: bad escape"))?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(String::from_utf8(out)?)
}

/// An open connection with channel 1 open.
pub struct RawConn {
    stream: TcpStream,
    input: BytesMut,
    out: FrameWriter,
}

impl RawConn {
    /// Connect, authenticate, open the vhost and channel 1.
    pub async fn open(ep: &Endpoint) -> anyhow::Result<Self> {
        // Thousands of connections opened at once outrun a broker's acceptors: RabbitMQ
        // closes a connection whose handshake takes longer than its handshake_timeout (10 s).
        let _opening = OPENING.acquire().await?;
        let mut attempt = 1;
        loop {
            match Self::handshake(ep).await {
                Ok(c) => return Ok(c),
                // A reset or refused handshake is the broker shedding load (a client
                // library's connection recovery would try again too); anything else is not.
                Err(e) if attempt < OPEN_ATTEMPTS && is_io(&e) => {
                    eprintln!("warren-perf: opening a connection (attempt {attempt}): {e:#}");
                    attempt += 1;
                }
                Err(e) => return Err(e.context("opening a connection")),
            }
        }
    }

    async fn handshake(ep: &Endpoint) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(&ep.addr)
            .await
            .with_context(|| format!("connecting to {}", ep.addr))?;
        stream.set_nodelay(true)?;
        let mut c = Self {
            stream,
            input: BytesMut::with_capacity(64 * 1024),
            out: FrameWriter::new(),
        };
        c.out.raw(PROTOCOL_HEADER);
        c.flush().await?;
        c.expect(10, 10).await?;
        let mut props = FieldTable::default();
        props.insert(
            "product".into(),
            AMQPValue::LongString("warren-perf".into()),
        );
        c.send(&AMQPClass::Connection(connection::AMQPMethod::StartOk(
            connection::StartOk {
                client_properties: props,
                mechanism: "PLAIN".into(),
                response: format!("\0{}\0{}", ep.user, ep.password).into(),
                locale: "en_US".into(),
            },
        )));
        c.flush().await?;
        let tune = c.expect(10, 30).await?;
        let AMQPClass::Connection(connection::AMQPMethod::Tune(tune)) = tune else {
            bail!("expected connection.tune");
        };
        let frame_max = match tune.frame_max {
            0 => FRAME_MAX,
            n => n.min(FRAME_MAX),
        };
        c.out.set_frame_max(frame_max);
        c.send(&AMQPClass::Connection(connection::AMQPMethod::TuneOk(
            connection::TuneOk {
                channel_max: tune.channel_max,
                frame_max,
                heartbeat: 0,
            },
        )));
        c.send(&AMQPClass::Connection(connection::AMQPMethod::Open(
            connection::Open {
                virtual_host: ep.vhost.as_str().into(),
            },
        )));
        c.flush().await?;
        c.expect(10, 41).await?;
        c.out.method(
            CHANNEL,
            &AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        );
        c.flush().await?;
        c.expect(20, 11).await?;
        Ok(c)
    }

    fn send(&mut self, method: &AMQPClass) {
        let ch = match method {
            AMQPClass::Connection(_) => 0,
            _ => CHANNEL,
        };
        self.out.method(ch, method);
    }

    async fn flush(&mut self) -> anyhow::Result<()> {
        self.stream.write_all(self.out.as_slice()).await?;
        let n = self.out.pending();
        self.out.consume(n);
        Ok(())
    }

    /// Read frames until a method arrives; it must be `(class, method)`.
    async fn expect(&mut self, class_id: u16, method_id: u16) -> anyhow::Result<AMQPClass> {
        loop {
            while let Some(frame) = decode_frame(&mut self.input, FRAME_MAX)? {
                if frame.kind != FRAME_METHOD {
                    continue;
                }
                let m = warren_amqp::method::decode(&frame.payload, 64)?;
                if (m.class_id, m.method_id) != (class_id, method_id) {
                    bail!("expected method {class_id}.{method_id}, got {:?}", m.class);
                }
                return Ok(m.class);
            }
            if self.stream.read_buf(&mut self.input).await? == 0 {
                // An I/O error, as a reset would be: the broker went away (or shed us).
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "connection closed by the broker",
                )
                .into());
            }
        }
    }

    /// Close politely (bounded wait for close-ok).
    pub async fn close(mut self) {
        self.send(&AMQPClass::Connection(connection::AMQPMethod::Close(
            connection::Close {
                reply_code: 200,
                reply_text: "done".into(),
                class_id: 0,
                method_id: 0,
            },
        )));
        if self.flush().await.is_err() {
            return;
        }
        let wait = async {
            loop {
                match decode_frame(&mut self.input, FRAME_MAX) {
                    Ok(Some(f))
                        if f.kind == FRAME_METHOD
                            && f.payload.get(..4) == Some(&[0, 10, 0, 51]) =>
                    {
                        return;
                    }
                    Ok(Some(_)) => continue,
                    Ok(None) => {}
                    Err(_) => return,
                }
                self.input.reserve(64 * 1024);
                match self.stream.read_buf(&mut self.input).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(2), wait).await;
    }
}

/// Class and method ids of a method frame's payload.
fn method_ids(payload: &[u8]) -> Option<(u16, u16)> {
    let b = payload.get(..4)?;
    Some((
        u16::from_be_bytes([b[0], b[1]]),
        u16::from_be_bytes([b[2], b[3]]),
    ))
}

/// A method the hot loops do not expect: report it as the run's error.
fn unexpected(frame: &RawFrame) -> anyhow::Error {
    match warren_amqp::method::decode(&frame.payload, 64) {
        Ok(m) => anyhow::anyhow!("broker sent {:?}", m.class),
        Err(e) => anyhow::anyhow!("undecodable method from the broker: {e}"),
    }
}

fn encode_properties(props: &amq_protocol::protocol::BasicProperties) -> anyhow::Result<Vec<u8>> {
    cookie_factory::gen_simple(basic::gen_properties(props), Vec::new())
        .map_err(|e| anyhow::anyhow!("encoding properties: {e:?}"))
}

/// Publish `args.pmessages` (or until `stop`) to `exchange` with `routing_key`, batching frames
/// and keeping at most `args.confirm` unconfirmed.
pub async fn producer(
    args: &Args,
    exchange: &str,
    routing_key: &str,
    props: &amq_protocol::protocol::BasicProperties,
    epoch: Instant,
    stats: &Stats,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let ep = Endpoint::parse(&args.uri)?;
    let mut conn = RawConn::open(&ep).await?;
    if args.confirm > 0 {
        conn.send(&AMQPClass::Confirm(confirm::AMQPMethod::Select(
            confirm::Select { nowait: false },
        )));
        conn.flush().await?;
        conn.expect(85, 11).await?;
    }
    let publish = warren_amqp::method::encode(&AMQPClass::Basic(basic::AMQPMethod::Publish(
        basic::Publish {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            mandatory: false,
            immediate: false,
        },
    )));
    // One encoded property list per key (just one without --key-header), used in turn.
    let variants: Vec<Vec<u8>> = match &args.key_header {
        None => vec![encode_properties(props)?],
        Some(name) => (0..args.keys.max(1))
            .map(|k| {
                let mut headers = props.headers().clone().unwrap_or_default();
                headers.insert(
                    name.as_str().into(),
                    amq_protocol::types::AMQPValue::LongString(format!("key-{k}").into()),
                );
                encode_properties(&props.clone().with_headers(headers))
            })
            .collect::<anyhow::Result<_>>()?,
    };
    let mut body = vec![0u8; args.size.max(8)];
    // Send times of unconfirmed messages by publish sequence number (confirms of one
    // channel may arrive out of order when messages go to several queues).
    let mut unconfirmed: BTreeMap<u64, u64> = BTreeMap::new();
    let started = Instant::now();
    let mut sent = 0u64;
    let mut stopping = false;
    let RawConn { stream, input, out } = &mut conn;
    let (mut rd, mut wr) = stream.split();
    loop {
        let exhausted = stopping || (args.pmessages > 0 && sent >= args.pmessages);
        let mut next_due = None;
        while !exhausted
            && out.pending() < WRITE_BATCH
            && (args.confirm == 0 || unconfirmed.len() < args.confirm)
            && (args.pmessages == 0 || sent < args.pmessages)
        {
            if args.rate > 0 {
                let due = started + Duration::from_secs_f64(sent as f64 / args.rate as f64);
                if due > Instant::now() {
                    next_due = Some(due);
                    break;
                }
            }
            let now = nanos_since(epoch);
            body[..8].copy_from_slice(&now.to_be_bytes());
            out.method_with(CHANNEL, |b| b.extend_from_slice(&publish));
            #[allow(clippy::cast_possible_truncation)] // the index is below variants.len()
            let properties = &variants[(sent % variants.len() as u64) as usize];
            out.content(CHANNEL, properties, &body);
            sent += 1;
            stats.published.fetch_add(1, Ordering::Relaxed);
            if args.confirm > 0 {
                unconfirmed.insert(sent, now);
            }
        }
        if exhausted && unconfirmed.is_empty() && out.pending() == 0 {
            break;
        }
        let sleep = async {
            match next_due {
                Some(d) if out.pending() == 0 => {
                    tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await;
                }
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            w = wr.write(out.as_slice()), if out.pending() > 0 => {
                let n = w.context("publishing")?;
                if n == 0 {
                    bail!("connection closed by the broker");
                }
                out.consume(n);
            }
            r = rd.read_buf(input) => {
                if r.context("reading confirms")? == 0 {
                    bail!("connection closed by the broker");
                }
                while let Some(frame) = decode_frame(input, FRAME_MAX)? {
                    match (frame.kind, method_ids(&frame.payload)) {
                        (FRAME_METHOD, Some((60, 80 | 120))) if frame.payload.len() >= 13 => {
                            let p = &frame.payload;
                            let tag = u64::from_be_bytes(p[4..12].try_into()?);
                            let ack = method_ids(p) == Some((60, 80));
                            if p[12] & 1 == 1 {
                                let rest = unconfirmed.split_off(&(tag + 1));
                                for sent_at in std::mem::replace(&mut unconfirmed, rest).into_values() {
                                    settle(stats, epoch, sent_at, ack);
                                }
                            } else if let Some(sent_at) = unconfirmed.remove(&tag) {
                                settle(stats, epoch, sent_at, ack);
                            }
                        }
                        (FRAME_HEARTBEAT, _) => {}
                        _ => return Err(unexpected(&frame)),
                    }
                }
                input.reserve(64 * 1024);
            }
            () = sleep => {}
            _ = stop.changed(), if !stopping => stopping = true,
        }
    }
    conn.close().await;
    Ok(())
}

fn settle(stats: &Stats, epoch: Instant, sent_at: u64, ack: bool) {
    record(
        &stats.confirm_us,
        nanos_since(epoch).saturating_sub(sent_at) / 1000,
    );
    if ack {
        stats.confirmed.fetch_add(1, Ordering::Relaxed);
    } else {
        stats.nacked.fetch_add(1, Ordering::Relaxed);
    }
}

/// Consume from `queue` with `args.prefetch`, acking every `args.multi_ack` deliveries with
/// multiple=true, until `args.cmessages` (or `limit`) deliveries or `stop`.
pub async fn consumer(
    args: &Args,
    queue: &str,
    limit: u64,
    epoch: Instant,
    stats: &Stats,
    mut stop: watch::Receiver<bool>,
    subscribed: &tokio::sync::Semaphore,
) -> anyhow::Result<()> {
    let ep = Endpoint::parse(&args.uri)?;
    let mut conn = RawConn::open(&ep).await?;
    conn.send(&AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
        prefetch_count: args.prefetch,
        global: false,
    })));
    conn.flush().await.context("subscribing")?;
    conn.expect(60, 11).await.context("subscribing")?;
    conn.send(&AMQPClass::Basic(basic::AMQPMethod::Consume(
        basic::Consume {
            queue: queue.into(),
            consumer_tag: "".into(),
            no_local: false,
            no_ack: args.autoack,
            exclusive: false,
            nowait: false,
            arguments: crate::table(&args.consumer_args)?,
        },
    )));
    conn.flush().await.context("subscribing")?;
    conn.expect(60, 21).await.context("subscribing")?;
    subscribed.add_permits(1);
    let mut n = 0u64;
    let mut unacked = 0u64;
    let mut tag = 0u64;
    // Body bytes still to come for the current delivery, and its first 8 bytes.
    let mut remaining = 0u64;
    let mut stamp = [0u8; 8];
    let mut stamp_len = 0usize;
    'run: loop {
        tokio::select! {
            r = conn.stream.read_buf(&mut conn.input) => {
                if r.context("reading deliveries")? == 0 {
                    bail!("connection closed by the broker");
                }
            }
            _ = stop.changed() => break 'run,
        }
        while let Some(frame) = decode_frame(&mut conn.input, FRAME_MAX)? {
            let complete = match frame.kind {
                FRAME_METHOD => match method_ids(&frame.payload) {
                    Some((60, 60)) => {
                        let p = &frame.payload;
                        let ctag = usize::from(*p.get(4).context("short basic.deliver")?);
                        let at = 5 + ctag;
                        tag = u64::from_be_bytes(
                            p.get(at..at + 8)
                                .context("short basic.deliver")?
                                .try_into()?,
                        );
                        stamp_len = 0;
                        false
                    }
                    _ => return Err(unexpected(&frame)),
                },
                FRAME_HEADER => {
                    let p = &frame.payload;
                    remaining = u64::from_be_bytes(
                        p.get(4..12).context("short content header")?.try_into()?,
                    );
                    remaining == 0
                }
                FRAME_BODY => {
                    let take = (8 - stamp_len).min(frame.payload.len());
                    stamp[stamp_len..stamp_len + take].copy_from_slice(&frame.payload[..take]);
                    stamp_len += take;
                    remaining = remaining.saturating_sub(frame.payload.len() as u64);
                    remaining == 0
                }
                FRAME_HEARTBEAT => false,
                _ => bail!("unexpected frame type {}", frame.kind),
            };
            if !complete {
                continue;
            }
            if stamp_len == 8 {
                let sent_at = u64::from_be_bytes(stamp);
                record(
                    &stats.e2e_us,
                    nanos_since(epoch).saturating_sub(sent_at) / 1000,
                );
            }
            stats.consumed.fetch_add(1, Ordering::Relaxed);
            n += 1;
            let done = limit > 0 && n >= limit;
            if !args.autoack {
                unacked += 1;
                if unacked >= args.multi_ack.max(1) || done {
                    conn.out.method_with(CHANNEL, |b| {
                        warren_amqp::method::put_basic_ack(b, tag, args.multi_ack > 1);
                    });
                    unacked = 0;
                }
            }
            if done {
                conn.flush().await.context("acking")?;
                break 'run;
            }
        }
        if conn.out.pending() > 0 {
            conn.flush().await.context("acking")?;
        }
        conn.input.reserve(64 * 1024);
    }
    conn.close().await;
    Ok(())
}

/// Open `count` connections (with channel 1 open), `parallel` handshakes at a time.
pub async fn open_idle(uri: &str, count: usize, parallel: usize) -> anyhow::Result<Vec<RawConn>> {
    let ep = Endpoint::parse(uri)?;
    let mut conns = Vec::with_capacity(count);
    let mut set = tokio::task::JoinSet::new();
    let mut started = 0;
    while conns.len() < count {
        while started < count && set.len() < parallel.max(1) {
            let ep = ep.clone();
            set.spawn(async move { RawConn::open(&ep).await });
            started += 1;
        }
        match set.join_next().await {
            Some(r) => conns.push(r??),
            None => break,
        }
    }
    Ok(conns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_uris_with_defaults_and_escapes() {
        let e = Endpoint::parse("amqp://guest:guest@127.0.0.1:5680/%2F")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(e.addr, "127.0.0.1:5680");
        assert_eq!(e.vhost, "/");
        assert_eq!((e.user.as_str(), e.password.as_str()), ("guest", "guest"));
        let e = Endpoint::parse("amqp://localhost").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(e.addr, "localhost:5672");
        assert_eq!(e.vhost, "/");
        let e = Endpoint::parse("amqp://u%40x:p@h:1/v1").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(e.user, "u@x");
        assert_eq!(e.vhost, "v1");
        assert!(Endpoint::parse("http://h").is_err());
    }
}
