//! `warren-perf`: Warren's PerfTest. Drives any AMQP 0-9-1 broker (Warren, RabbitMQ, LavinMQ)
//! with N publishers and consumers over one or more queues and reports publish, confirm and
//! consume rates and latency percentiles (HdrHistogram): a progress line per second and a final
//! JSON summary. With `--broker-pid` it also reports the broker's CPU per message and peak RSS
//! from `/proc`, which do not depend on the client's own cost.
//!
//! The standard scenarios have names (`--scenario transient|durable|quorum|parallel4|fanout8|
//! paced5k|backlog|idle|small16|stream|streamreplay`, see [`Scenario`]); explicit flags override a scenario's
//! settings. The hot path uses a batching client ([`raw`]) unless `--client lapin`.
//!
//! Examples (see docs/benchmarks.md for the scenarios):
//!
//! ```text
//! warren-perf --scenario durable --duration 20 --broker-pid $(pidof warren)
//! warren-perf --producers 1 --consumers 1 --size 1024 --duration 20
//! warren-perf --durable --persistent --confirm 1000 --prefetch 1000 --multi-ack 100
//! warren-perf --durable --persistent --confirm 1000 --consumers 0 --pmessages 2000000
//! warren-perf --consumers 1 --producers 0 --cmessages 2000000 --no-declare
//! ```

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser, ValueEnum};
use futures_lite::StreamExt;
use hdrhistogram::Histogram;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
    QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use serde::Serialize;
use tokio::sync::watch;

mod raw;

/// The standard scenarios of the performance issue, each a preset of the flags below.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Scenario {
    /// 1 publisher -> 1 transient queue -> 1 consumer, 1 KB.
    Transient,
    /// Durable queue, persistent messages, confirm window 1000.
    Durable,
    /// Quorum queue (`x-queue-type=quorum`), persistent, confirm window 1000.
    Quorum,
    /// 4 independent publisher -> queue -> consumer pairs.
    Parallel4,
    /// 1 publisher -> fanout exchange -> 8 queues, one consumer each.
    Fanout8,
    /// Persistent with confirms paced at 5,000 msg/s: end-to-end latency.
    Paced5k,
    /// Publish 500,000 persistent messages with no consumer, then drain them.
    Backlog,
    /// Open 10,000 idle connections and report the broker's RSS per connection.
    Idle,
    /// Transient 1 -> 1 with 16-byte bodies.
    Small16,
    /// A stream (`x-queue-type=stream`): 1 publisher with confirms (window 1000), 3
    /// independent consumers reading from `first`, 1 KB.
    Stream,
    /// Publish 1,000,000 messages into a stream with no consumer, then replay them all
    /// with one consumer from `first`.
    StreamReplay,
}

/// Which client library drives the hot path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Client {
    /// Warren's batching client (many frames per syscall).
    Raw,
    /// lapin, one syscall per frame.
    Lapin,
}

/// Drive an AMQP 0-9-1 broker and measure it.
#[derive(Debug, Clone, Parser, Serialize)]
#[command(name = "warren-perf", version, about)]
struct Args {
    /// A named standard scenario; flags given explicitly override its settings.
    #[arg(long, value_enum)]
    scenario: Option<Scenario>,
    /// Client used for publishing and consuming.
    #[arg(long, value_enum, default_value_t = Client::Raw)]
    client: Client,
    /// Broker URI.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    uri: String,
    /// Publishing connections.
    #[arg(long, default_value_t = 1)]
    producers: usize,
    /// Consuming connections per queue.
    #[arg(long, default_value_t = 1)]
    consumers: usize,
    /// Queues (`<queue>-0`, `<queue>-1`, ...); producers are spread over them round-robin.
    #[arg(long, default_value_t = 1)]
    queues: usize,
    /// Queue name prefix.
    #[arg(long, default_value = "perf")]
    queue: String,
    /// Message body size in bytes (at least 8: the send timestamp).
    #[arg(long, default_value_t = 1024)]
    size: usize,
    /// Publisher confirms: unconfirmed messages allowed per producer (0 = no confirms).
    #[arg(long, default_value_t = 0)]
    confirm: usize,
    /// Consumer prefetch (basic.qos).
    #[arg(long, default_value_t = 1000)]
    prefetch: u16,
    /// Ack every N deliveries with multiple=true (1 = one ack per message).
    #[arg(long, default_value_t = 100)]
    multi_ack: u64,
    /// Consume with no-ack.
    #[arg(long)]
    autoack: bool,
    /// Publish with delivery_mode 2.
    #[arg(long)]
    persistent: bool,
    /// Declare the queues durable.
    #[arg(long)]
    durable: bool,
    /// Extra queue argument `key=value` (integers are sent as integers), repeatable.
    #[arg(long = "queue-arg")]
    queue_args: Vec<String>,
    /// Publish to exchange `<queue>-x` of this type, bound to every queue (e.g. fanout, or
    /// x-delayed-message with `--exchange-arg x-delayed-type=direct`).
    #[arg(long)]
    exchange_type: Option<String>,
    /// Extra exchange argument `key=value`, repeatable.
    #[arg(long = "exchange-arg")]
    exchange_args: Vec<String>,
    /// basic.consume argument `key=value` (integers sent as integers), repeatable; e.g.
    /// x-stream-offset=first.
    #[arg(long = "consumer-arg")]
    consumer_args: Vec<String>,
    /// Message header `key=value` (integers sent as integers), repeatable; e.g. x-delay=2000.
    #[arg(long = "header")]
    headers: Vec<String>,
    /// Messages per second per producer (0 = as fast as possible).
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// Stop after this many seconds (0 = when the message counts are reached).
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Messages per producer, then it stops (0 = unlimited).
    #[arg(long, default_value_t = 0)]
    pmessages: u64,
    /// Messages per consumer, then it stops (0 = unlimited).
    #[arg(long, default_value_t = 0)]
    cmessages: u64,
    /// After publishing (with no consumers), drain the queues with `--consumers` consumers
    /// per queue (at least 1) and report the drain rate separately.
    #[arg(long)]
    drain: bool,
    /// Open this many idle connections and report the broker's RSS per connection (no
    /// publishing or consuming).
    #[arg(long, default_value_t = 0)]
    connections: usize,
    /// Delete the queues and the exchange when done.
    #[arg(long)]
    delete_after: bool,
    /// Do not declare queues or exchanges (use what exists).
    #[arg(long)]
    no_declare: bool,
    /// Purge the queues before starting.
    #[arg(long)]
    purge: bool,
    /// Broker process to sample for CPU time and RSS (Linux /proc).
    #[arg(long)]
    broker_pid: Option<u32>,
    /// Also write the JSON summary to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// With `--queues 1`: the queue is named exactly `--queue` (for example a partitioned
    /// queue's logical name), not `<queue>-0`.
    #[arg(long)]
    exact_name: bool,
    /// Give each message this header with one of `--keys` values, cycling (a partitioned
    /// queue's `x-partition-key: header:<name>`). Raw client only.
    #[arg(long)]
    key_header: Option<String>,
    /// How many distinct `--key-header` values.
    #[arg(long, default_value_t = 1024)]
    keys: usize,
}

/// Counters and histograms shared by all tasks.
struct Stats {
    published: AtomicU64,
    confirmed: AtomicU64,
    nacked: AtomicU64,
    consumed: AtomicU64,
    /// (whole run, current second) in microseconds.
    confirm_us: Mutex<(Histogram<u64>, Histogram<u64>)>,
    e2e_us: Mutex<(Histogram<u64>, Histogram<u64>)>,
}

fn histogram() -> Histogram<u64> {
    // 1 us .. 1 hour, 3 significant digits.
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

fn record(h: &Mutex<(Histogram<u64>, Histogram<u64>)>, us: u64) {
    let mut g = h.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let us = us.max(1);
    let _ = g.0.record(us);
    let _ = g.1.record(us);
}

#[derive(Debug, Serialize)]
struct Percentiles {
    count: u64,
    p50: u64,
    p95: u64,
    p99: u64,
    p999: u64,
    max: u64,
}

fn percentiles(h: &Histogram<u64>) -> Percentiles {
    Percentiles {
        count: h.len(),
        p50: h.value_at_quantile(0.5),
        p95: h.value_at_quantile(0.95),
        p99: h.value_at_quantile(0.99),
        p999: h.value_at_quantile(0.999),
        max: h.max(),
    }
}

/// Process CPU seconds (user + system) and resident set size in bytes, from /proc.
fn proc_sample(pid: u32) -> Option<(f64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit(')').next()?.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok());
    // Clock ticks are 100 per second on Linux.
    let cpu = (ticks(11)? + ticks(12)?) / 100.0;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())?;
    Some((cpu, rss_kb * 1024))
}

fn queue_arguments(args: &Args) -> anyhow::Result<FieldTable> {
    table(&args.queue_args)
}

/// `key=value` pairs as a field table (integers as integers).
fn table(pairs: &[String]) -> anyhow::Result<FieldTable> {
    let mut t = FieldTable::default();
    for kv in pairs {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("{kv}: expected key=value"))?;
        let value = match v.parse::<i64>() {
            Ok(n) => AMQPValue::LongLongInt(n),
            Err(_) => AMQPValue::LongString(LongString::from(v)),
        };
        t.insert(k.into(), value);
    }
    Ok(t)
}

fn queue_name(args: &Args, i: usize) -> String {
    if args.exact_name && args.queues <= 1 {
        return args.queue.clone();
    }
    format!("{}-{i}", args.queue)
}

async fn connect(uri: &str) -> anyhow::Result<Connection> {
    Connection::connect(uri, ConnectionProperties::default())
        .await
        .with_context(|| format!("connecting to {uri}"))
}

async fn declare(args: &Args) -> anyhow::Result<()> {
    if args.no_declare && !args.purge {
        // Nothing to do: no connection (a thousand-queue run opens enough of them).
        return Ok(());
    }
    let conn = connect(&args.uri).await?;
    let ch = conn.create_channel().await?;
    let arguments = queue_arguments(args)?;
    for i in 0..args.queues {
        let name = queue_name(args, i);
        if !args.no_declare {
            ch.queue_declare(
                name.as_str().into(),
                QueueDeclareOptions {
                    durable: args.durable,
                    ..QueueDeclareOptions::default()
                },
                arguments.clone(),
            )
            .await
            .with_context(|| format!("declaring queue {name}"))?;
        }
        if args.purge {
            ch.queue_purge(name.as_str().into(), QueuePurgeOptions::default())
                .await?;
        }
    }
    if let (Some(kind), false) = (&args.exchange_type, args.no_declare) {
        let x = format!("{}-x", args.queue);
        let kind = match kind.as_str() {
            "direct" => ExchangeKind::Direct,
            "fanout" => ExchangeKind::Fanout,
            "topic" => ExchangeKind::Topic,
            "headers" => ExchangeKind::Headers,
            other => ExchangeKind::Custom(other.into()),
        };
        ch.exchange_declare(
            x.as_str().into(),
            kind,
            ExchangeDeclareOptions {
                durable: args.durable,
                ..ExchangeDeclareOptions::default()
            },
            table(&args.exchange_args)?,
        )
        .await?;
        for i in 0..args.queues {
            let name = queue_name(args, i);
            ch.queue_bind(
                name.as_str().into(),
                x.as_str().into(),
                name.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        }
    }
    conn.close(200, "declared".into()).await?;
    Ok(())
}

fn nanos_since(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

async fn producer(
    args: Arc<Args>,
    index: usize,
    epoch: Instant,
    stats: Arc<Stats>,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let conn = connect(&args.uri).await?;
    let ch = conn.create_channel().await?;
    if args.confirm > 0 {
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
    }
    let (exchange, routing_key, props) = publish_target(&args, index)?;
    let mut body = vec![0u8; args.size.max(8)];
    let mut pending = VecDeque::new();
    let started = Instant::now();
    let mut sent = 0u64;
    while !*stop.borrow() && (args.pmessages == 0 || sent < args.pmessages) {
        if args.rate > 0 {
            let due = started + Duration::from_secs_f64(sent as f64 / args.rate as f64);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                tokio::select! {
                    () = tokio::time::sleep(wait) => {},
                    _ = stop.changed() => break,
                }
            }
        }
        let now = nanos_since(epoch);
        body[..8].copy_from_slice(&now.to_be_bytes());
        let confirm = ch
            .basic_publish(
                exchange.as_str().into(),
                routing_key.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                props.clone(),
            )
            .await?;
        sent += 1;
        stats.published.fetch_add(1, Ordering::Relaxed);
        if args.confirm > 0 {
            pending.push_back((now, confirm));
            while pending.len() >= args.confirm {
                settle_confirm(&mut pending, epoch, &stats).await?;
            }
        }
    }
    while !pending.is_empty() {
        settle_confirm(&mut pending, epoch, &stats).await?;
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

async fn settle_confirm(
    pending: &mut VecDeque<(u64, lapin::PublisherConfirm)>,
    epoch: Instant,
    stats: &Stats,
) -> anyhow::Result<()> {
    if let Some((sent_at, confirm)) = pending.pop_front() {
        let c = confirm.await?;
        let latency = nanos_since(epoch).saturating_sub(sent_at) / 1000;
        record(&stats.confirm_us, latency);
        if c.is_ack() {
            stats.confirmed.fetch_add(1, Ordering::Relaxed);
        } else {
            stats.nacked.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

async fn consumer(
    args: Arc<Args>,
    queue_index: usize,
    limit: u64,
    epoch: Instant,
    stats: Arc<Stats>,
    mut stop: watch::Receiver<bool>,
    subscribed: Arc<tokio::sync::Semaphore>,
) -> anyhow::Result<()> {
    let conn = connect(&args.uri).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(args.prefetch, BasicQosOptions::default())
        .await?;
    let queue = queue_name(&args, queue_index);
    let mut deliveries = ch
        .basic_consume(
            queue.as_str().into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: args.autoack,
                ..BasicConsumeOptions::default()
            },
            table(&args.consumer_args)?,
        )
        .await?;
    subscribed.add_permits(1);
    let mut n = 0u64;
    let mut unacked = 0u64;
    loop {
        let next = tokio::select! {
            d = deliveries.next() => d,
            _ = stop.changed() => None,
        };
        let Some(delivery) = next else { break };
        let delivery = delivery?;
        if delivery.data.len() >= 8 {
            let sent_at = u64::from_be_bytes(delivery.data[..8].try_into().unwrap_or_default());
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
                delivery
                    .ack(BasicAckOptions {
                        multiple: args.multi_ack > 1,
                    })
                    .await?;
                unacked = 0;
            }
        }
        if done {
            break;
        }
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

/// Set a scenario's flags, except those given on the command line.
fn apply_scenario(args: &mut Args, matches: &clap::ArgMatches) {
    let Some(scenario) = args.scenario else {
        return;
    };
    let given = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    macro_rules! set {
        ($field:ident, $value:expr) => {
            if !given(stringify!($field)) {
                args.$field = $value;
            }
        };
    }
    set!(queue, format!("{scenario:?}").to_lowercase());
    set!(duration, 15);
    let persistent_confirms = |args: &mut Args| {
        if !given("durable") {
            args.durable = true;
        }
        if !given("persistent") {
            args.persistent = true;
        }
        if !given("confirm") {
            args.confirm = 1000;
        }
    };
    match scenario {
        Scenario::Transient => {}
        Scenario::Durable => persistent_confirms(args),
        Scenario::Quorum => {
            persistent_confirms(args);
            set!(queue_args, vec!["x-queue-type=quorum".to_string()]);
        }
        Scenario::Parallel4 => {
            set!(queues, 4);
            set!(producers, 4);
        }
        Scenario::Fanout8 => {
            set!(queues, 8);
            set!(exchange_type, Some("fanout".to_string()));
        }
        Scenario::Paced5k => {
            persistent_confirms(args);
            set!(rate, 5000);
        }
        Scenario::Backlog => {
            persistent_confirms(args);
            set!(pmessages, 500_000);
            set!(duration, 0);
            set!(drain, true);
        }
        Scenario::Idle => set!(connections, 10_000),
        Scenario::Small16 => set!(size, 16),
        Scenario::Stream | Scenario::StreamReplay => {
            persistent_confirms(args);
            set!(queue_args, vec!["x-queue-type=stream".to_string()]);
            set!(consumer_args, vec!["x-stream-offset=first".to_string()]);
            if scenario == Scenario::Stream {
                set!(consumers, 3);
            } else {
                set!(pmessages, 1_000_000);
                set!(duration, 0);
                set!(drain, true);
            }
        }
    }
}

async fn delete(args: &Args) -> anyhow::Result<()> {
    let conn = connect(&args.uri).await?;
    let ch = conn.create_channel().await?;
    for i in 0..args.queues {
        ch.queue_delete(
            queue_name(args, i).as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await?;
    }
    if args.exchange_type.is_some() {
        ch.exchange_delete(
            format!("{}-x", args.queue).as_str().into(),
            lapin::options::ExchangeDeleteOptions::default(),
        )
        .await?;
    }
    conn.close(200, "deleted".into()).await?;
    Ok(())
}

/// What one phase (publish and/or consume) measured.
struct Phase {
    elapsed_s: f64,
    published: u64,
    confirmed: u64,
    nacked: u64,
    consumed: u64,
    confirm_latency_us: Percentiles,
    e2e_latency_us: Percentiles,
    broker_cpu_s: Option<f64>,
    peak_rss: u64,
    /// Publisher or consumer tasks that ended with an error.
    failed: usize,
}

/// How long producers wait for the consumers to subscribe.
const SUBSCRIBE_WAIT: Duration = Duration::from_secs(10);

/// Run `producers` publishers and `consumers` consumers per queue (each stopping after
/// `consumer_limit` deliveries if non-zero) until they finish or the duration passes.
async fn run_phase(
    args: &Arc<Args>,
    producers: usize,
    consumers: usize,
    consumer_limit: u64,
) -> Phase {
    let stats = Arc::new(Stats {
        published: AtomicU64::new(0),
        confirmed: AtomicU64::new(0),
        nacked: AtomicU64::new(0),
        consumed: AtomicU64::new(0),
        confirm_us: Mutex::new((histogram(), histogram())),
        e2e_us: Mutex::new((histogram(), histogram())),
    });
    let epoch = Instant::now();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    // Producers start once every consumer has subscribed (or after SUBSCRIBE_WAIT): a run
    // measures the steady state, not consumers still connecting while the queues fill.
    let subscribed = Arc::new(tokio::sync::Semaphore::new(0));
    for q in 0..args.queues {
        for _ in 0..consumers {
            let (args, stats, stop) = (Arc::clone(args), Arc::clone(&stats), stop_rx.clone());
            let subscribed = Arc::clone(&subscribed);
            tasks.push(tokio::spawn(async move {
                match args.client {
                    Client::Raw => {
                        let queue = queue_name(&args, q);
                        raw::consumer(
                            &args,
                            &queue,
                            consumer_limit,
                            epoch,
                            &stats,
                            stop,
                            &subscribed,
                        )
                        .await
                    }
                    Client::Lapin => {
                        consumer(args, q, consumer_limit, epoch, stats, stop, subscribed).await
                    }
                }
            }));
        }
    }
    let all = u32::try_from(args.queues * consumers).unwrap_or(u32::MAX);
    if tokio::time::timeout(SUBSCRIBE_WAIT, subscribed.acquire_many(all))
        .await
        .is_err()
    {
        eprintln!("warren-perf: not every consumer subscribed within {SUBSCRIBE_WAIT:?}");
    }
    for p in 0..producers {
        let (args, stats, stop) = (Arc::clone(args), Arc::clone(&stats), stop_rx.clone());
        tasks.push(tokio::spawn(async move {
            match args.client {
                Client::Raw => {
                    let (exchange, routing_key, props) = publish_target(&args, p)?;
                    raw::producer(&args, &exchange, &routing_key, &props, epoch, &stats, stop).await
                }
                Client::Lapin => producer(args, p, epoch, stats, stop).await,
            }
        }));
    }
    let broker_start = args.broker_pid.and_then(proc_sample);
    let mut peak_rss = broker_start.map_or(0, |(_, rss)| rss);
    let started = Instant::now();
    let mut last = (0u64, 0u64, 0u64);
    let mut second = 0u64;
    let mut failed = 0;
    let all_done = async {
        for t in &mut tasks {
            match t.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    failed += 1;
                    eprintln!("warren-perf: task failed: {e:#}");
                }
                Err(e) => {
                    failed += 1;
                    eprintln!("warren-perf: task panicked: {e}");
                }
            }
        }
    };
    tokio::pin!(all_done);
    let mut tick = tokio::time::interval_at(
        tokio::time::Instant::now() + Duration::from_secs(1),
        Duration::from_secs(1),
    );
    let deadline = (args.duration > 0).then(|| started + Duration::from_secs(args.duration));
    let mut stopping = false;
    loop {
        tokio::select! {
            () = &mut all_done => break,
            _ = tick.tick() => {
                second += 1;
                let now = (
                    stats.published.load(Ordering::Relaxed),
                    stats.confirmed.load(Ordering::Relaxed),
                    stats.consumed.load(Ordering::Relaxed),
                );
                let (c, e) = {
                    let mut c = stats.confirm_us.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    let mut e = stats.e2e_us.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    let r = (percentiles(&c.1), percentiles(&e.1));
                    c.1.reset();
                    e.1.reset();
                    r
                };
                let mut line = format!(
                    "{second:>4}s  published {:>7}/s  confirmed {:>7}/s  consumed {:>7}/s  confirm p50/p99 {}/{} us  e2e p50/p99 {}/{} us",
                    now.0 - last.0, now.1 - last.1, now.2 - last.2, c.p50, c.p99, e.p50, e.p99
                );
                if let Some((_, rss)) = args.broker_pid.and_then(proc_sample) {
                    peak_rss = peak_rss.max(rss);
                    line.push_str(&format!("  broker rss {} MB", rss / (1024 * 1024)));
                }
                println!("{line}");
                last = now;
                if !stopping && deadline.is_some_and(|d| Instant::now() >= d) {
                    stopping = true;
                    let _ = stop_tx.send(true);
                }
            }
        }
    }
    let elapsed_s = started.elapsed().as_secs_f64();
    let broker_end = args.broker_pid.and_then(proc_sample);
    if let Some((_, rss)) = broker_end {
        peak_rss = peak_rss.max(rss);
    }
    let histograms = |h: &Mutex<(Histogram<u64>, Histogram<u64>)>| {
        percentiles(
            &h.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0,
        )
    };
    Phase {
        elapsed_s,
        published: stats.published.load(Ordering::Relaxed),
        confirmed: stats.confirmed.load(Ordering::Relaxed),
        nacked: stats.nacked.load(Ordering::Relaxed),
        consumed: stats.consumed.load(Ordering::Relaxed),
        confirm_latency_us: histograms(&stats.confirm_us),
        e2e_latency_us: histograms(&stats.e2e_us),
        broker_cpu_s: broker_start.zip(broker_end).map(|((a, _), (b, _))| b - a),
        peak_rss,
        failed,
    }
}

/// Exchange, routing key and properties producer `index` publishes with.
fn publish_target(args: &Args, index: usize) -> anyhow::Result<(String, String, BasicProperties)> {
    let queue = queue_name(args, index % args.queues.max(1));
    let exchange = match &args.exchange_type {
        Some(_) => format!("{}-x", args.queue),
        None => String::new(),
    };
    let mut props = BasicProperties::default();
    if args.persistent {
        props = props.with_delivery_mode(2);
    }
    if !args.headers.is_empty() {
        props = props.with_headers(table(&args.headers)?);
    }
    Ok((exchange, queue, props))
}

#[derive(Debug, Serialize)]
struct Summary {
    args: Args,
    elapsed_s: f64,
    published: u64,
    confirmed: u64,
    nacked: u64,
    consumed: u64,
    publish_rate: f64,
    confirm_rate: f64,
    consume_rate: f64,
    confirm_latency_us: Percentiles,
    e2e_latency_us: Percentiles,
    broker_cpu_s: Option<f64>,
    broker_cpu_us_per_msg: Option<f64>,
    broker_peak_rss_mb: Option<f64>,
    /// With `--drain`: deliveries and rate of the drain phase (the fields above are the
    /// publish phase).
    drained: Option<u64>,
    drain_rate: Option<f64>,
    drain_broker_cpu_us_per_msg: Option<f64>,
    /// With `--connections`: connections held open, and broker RSS growth per connection.
    idle_connections: Option<usize>,
    rss_per_connection_kb: Option<f64>,
    /// Publisher and consumer tasks that ended in an error (the run exits 1 if any did).
    failed: usize,
}

fn per_msg_us(cpu: Option<f64>, messages: u64) -> Option<f64> {
    cpu.map(|c| c * 1e6 / messages.max(1) as f64)
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Open `args.connections` idle connections, measure, close them.
async fn idle(args: &Args) -> anyhow::Result<(usize, Option<f64>, Option<f64>)> {
    let before = args.broker_pid.and_then(proc_sample);
    let conns = raw::open_idle(&args.uri, args.connections, 64).await?;
    let n = conns.len();
    println!("opened {n} connections");
    // Let the broker finish the handshakes' bookkeeping before sampling.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = args.broker_pid.and_then(proc_sample);
    let per_conn = before
        .zip(after)
        .map(|((_, a), (_, b))| b.saturating_sub(a) as f64 / 1024.0 / n.max(1) as f64);
    drop(conns);
    Ok((n, per_conn, after.map(|(_, rss)| mb(rss))))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let matches = Args::command().get_matches();
    let mut args = Args::from_arg_matches(&matches)?;
    apply_scenario(&mut args, &matches);
    anyhow::ensure!(args.queues >= 1, "--queues must be at least 1");
    if args.connections > 0 {
        let (n, per_conn, rss) = idle(&args).await?;
        println!(
            "idle connections {n}  broker rss {}  per connection {}",
            rss.map_or("-".into(), |r| format!("{r:.0} MB")),
            per_conn.map_or("-".into(), |k| format!("{k:.1} KB"))
        );
        let summary = serde_json::json!({
            "args": args,
            "idle_connections": n,
            "rss_per_connection_kb": per_conn,
            "broker_rss_mb": rss,
        });
        return emit(&args, &serde_json::to_string_pretty(&summary)?);
    }
    declare(&args).await?;
    let args = Arc::new(args);
    let (main, drain) = if args.drain {
        let publish = run_phase(&args, args.producers, 0, 0).await;
        println!("published {}; draining", publish.published);
        let per_consumer = publish.published / (args.queues * args.consumers.max(1)) as u64;
        let drain = run_phase(&args, 0, args.consumers.max(1), per_consumer.max(1)).await;
        (publish, Some(drain))
    } else {
        let limit = args.cmessages;
        (
            run_phase(&args, args.producers, args.consumers, limit).await,
            None,
        )
    };
    if args.delete_after {
        delete(&args).await?;
    }
    let elapsed = main.elapsed_s;
    let peak_rss = main.peak_rss.max(drain.as_ref().map_or(0, |d| d.peak_rss));
    let summary = Summary {
        args: (*args).clone(),
        elapsed_s: elapsed,
        published: main.published,
        confirmed: main.confirmed,
        nacked: main.nacked,
        consumed: main.consumed,
        publish_rate: main.published as f64 / elapsed,
        confirm_rate: main.confirmed as f64 / elapsed,
        consume_rate: main.consumed as f64 / elapsed,
        confirm_latency_us: main.confirm_latency_us,
        e2e_latency_us: main.e2e_latency_us,
        broker_cpu_s: main.broker_cpu_s,
        broker_cpu_us_per_msg: per_msg_us(main.broker_cpu_s, main.published.max(main.consumed)),
        broker_peak_rss_mb: args.broker_pid.map(|_| mb(peak_rss)),
        drained: drain.as_ref().map(|d| d.consumed),
        drain_rate: drain.as_ref().map(|d| d.consumed as f64 / d.elapsed_s),
        drain_broker_cpu_us_per_msg: drain
            .as_ref()
            .and_then(|d| per_msg_us(d.broker_cpu_s, d.consumed)),
        idle_connections: None,
        rss_per_connection_kb: None,
        failed: main.failed + drain.as_ref().map_or(0, |d| d.failed),
    };
    print_table(&summary);
    emit(&args, &serde_json::to_string_pretty(&summary)?)?;
    if summary.failed > 0 {
        // The figures above stand for what ran; the exit says not everything did (each
        // task's error is on stderr). A plain message: this is an outcome, not a bug.
        eprintln!(
            "warren-perf: {} publisher or consumer tasks failed",
            summary.failed
        );
        std::process::exit(1);
    }
    Ok(())
}

/// The final human-readable table.
fn print_table(s: &Summary) {
    let opt = |v: Option<f64>, unit: &str| v.map_or("-".to_string(), |v| format!("{v:.1}{unit}"));
    println!("+---------------------------+----------------------+");
    let row = |k: &str, v: String| println!("| {k:<25} | {v:>20} |");
    row(
        "scenario",
        s.args
            .scenario
            .map_or("custom".into(), |x| format!("{x:?}").to_lowercase()),
    );
    row("published msg/s", format!("{:.0}", s.publish_rate));
    row("confirmed msg/s", format!("{:.0}", s.confirm_rate));
    row("consumed msg/s", format!("{:.0}", s.consume_rate));
    row(
        "confirm p50/p99 ms",
        format!(
            "{:.2}/{:.2}",
            s.confirm_latency_us.p50 as f64 / 1000.0,
            s.confirm_latency_us.p99 as f64 / 1000.0
        ),
    );
    row(
        "end-to-end p50/p99 ms",
        format!(
            "{:.2}/{:.2}",
            s.e2e_latency_us.p50 as f64 / 1000.0,
            s.e2e_latency_us.p99 as f64 / 1000.0
        ),
    );
    row("broker CPU us/msg", opt(s.broker_cpu_us_per_msg, ""));
    row("broker peak RSS MB", opt(s.broker_peak_rss_mb, ""));
    if s.drained.is_some() {
        row("drained msg/s", opt(s.drain_rate, ""));
        row(
            "drain broker CPU us/msg",
            opt(s.drain_broker_cpu_us_per_msg, ""),
        );
    }
    println!("+---------------------------+----------------------+");
}

fn emit(args: &Args, json: &str) -> anyhow::Result<()> {
    println!("{json}");
    if let Some(path) = &args.json {
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
