//! Redrive: moving messages out of a dead-letter queue, back to the queue each died in (its
//! `x-death`) or into a named queue, at a bounded rate, up to a count, those a filter chooses
//! (SQS's message move task, without a shovel).
//!
//! A task runs in rounds. It browses the source's ready messages (a look, not a cursor), picks
//! up to [`REDRIVE_BATCH_MAX`] that match, claims exactly those ([`Queue::take`]) under a lease
//! of [`REDRIVE_LEASE_MS`], enqueues each into its destination as a *move* carrying a key that
//! names the source message ([`Queue::publish_one`] with a move key), waits for the
//! destination to hold it durably, acknowledges the claims at the source, and finally lets
//! the destinations forget the keys. Interrupted at any point (kill -9, a leader change, a
//! cancel), every message is in the source, or in its destination, or, between the enqueue and
//! the source's ack, in both with the key remembered by the destination (in its Raft state or
//! its store record): the source's copy returns when its lease or node goes, the next redrive
//! enqueues it again, the destination drops it as a duplicate and the source's copy is
//! acknowledged. Nothing is lost, nothing ends up twice. See `queue::machine::moves`.
//!
//! Only messages in the source when the task started are moved (ids below its next id then),
//! so a destination that dead-letters them again does not feed the task forever.
//!
//! Tasks are held in memory on the node that runs them (a restart forgets them; the messages
//! stay where the invariant above says). Finished tasks are kept for listing, the newest
//! [`REDRIVES_KEPT`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use amq_protocol::types::AMQPValue;
use parking_lot::Mutex;

use crate::message::{Message, Outgoing};
use crate::queue::machine::{BrowseState, Claimed, Command, LeaseError, LeaseState};
use crate::queue::{Enqueued, PublishOptions, Queue, loaded_message};
use crate::routing::vhost::VHost;

/// Messages a task moves per second unless told otherwise.
pub const REDRIVE_RATE_DEFAULT: u32 = 500;
/// The fastest a task may be told to move, messages per second.
pub const REDRIVE_RATE_MAX: u32 = 100_000;
/// Most messages moved in one round (one take, one wait for the destinations, one ack).
pub const REDRIVE_BATCH_MAX: usize = 100;
/// The lease a round's claims hold: longer than a round may wait ([`ROUND_WAIT`]), short
/// enough that the messages of a round whose node died come back soon.
pub const REDRIVE_LEASE_MS: u64 = 30_000;
/// Ready messages looked at per browse.
const SCAN_PAGE: usize = 500;
/// How long a round waits for its source or destinations before it gives up (its claims
/// return when their lease runs out).
const ROUND_WAIT: Duration = Duration::from_secs(20);
/// Fault injection for the kill -9 test: a task started while this environment variable holds
/// a number of milliseconds waits that long between its destinations taking a round's
/// messages and its acks at the source, the window in which an interrupted move leaves a
/// message in both queues.
pub const ACK_DELAY_ENV: &str = "WARREN_TEST_REDRIVE_ACK_DELAY_MS";
/// Tasks running at once per node.
pub const REDRIVES_RUNNING_MAX: usize = 16;
/// Finished tasks kept for listing.
pub const REDRIVES_KEPT: usize = 100;
/// Longest filter value or destination name accepted (a queue name's limit).
pub const REDRIVE_NAME_MAX: usize = 255;

/// Whether the task's caller may publish into a queue (its write permission): a destination
/// it may not write is left alone, as a message without a destination is.
pub type MayWrite = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// Which messages a task moves (all given conditions must hold).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedriveFilter {
    /// The queue the message last died in (`x-last-death-queue`, or the newest `x-death`).
    pub origin: Option<String>,
    /// Why it died last (`rejected`, `expired`, `maxlen`, `delivery_limit`).
    pub reason: Option<String>,
    /// Its routing key.
    pub routing_key: Option<String>,
    /// Headers that must have these values (strings or numbers, compared as text).
    pub headers: Vec<(String, String)>,
}

/// What a task is asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedriveSpec {
    /// The vhost of both queues.
    pub vhost: String,
    /// The queue messages leave (a dead-letter queue).
    pub source: String,
    /// Where they go; None: each back to the queue it last died in.
    pub destination: Option<String>,
    /// Most messages to move (None: all that match).
    pub max_messages: Option<u64>,
    /// Messages per second at most.
    pub rate: u32,
    /// Which messages.
    pub filter: RedriveFilter,
}

/// Why a task did not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RedriveError {
    /// No such vhost.
    #[error("no vhost '{0}'")]
    NoVhost(String),
    /// No such source queue.
    #[error("no queue '{0}' in vhost '{1}'")]
    NoQueue(String, String),
    /// A stream keeps messages for every reader: nothing leaves it.
    #[error("queue '{0}' is a stream: its messages cannot be moved")]
    Stream(String),
    /// The source is a classic queue held on another node.
    #[error("queue '{0}' is held on another node: start the redrive there")]
    Elsewhere(String),
    /// A rate outside 1..=[`REDRIVE_RATE_MAX`].
    #[error("rate must be between 1 and {REDRIVE_RATE_MAX} messages per second")]
    Rate,
    /// A name or filter value past [`REDRIVE_NAME_MAX`] bytes.
    #[error("names and filter values are at most {REDRIVE_NAME_MAX} bytes")]
    TooLong,
    /// Source and destination are the same queue.
    #[error("source and destination are the same queue")]
    SameQueue,
    /// [`REDRIVES_RUNNING_MAX`] tasks run already.
    #[error("{REDRIVES_RUNNING_MAX} redrives are running already")]
    Busy,
    /// No such task.
    #[error("no redrive {0}")]
    NoTask(u64),
}

/// Where a task is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedriveStatus {
    /// Moving.
    Running,
    /// Nothing more to move (or the count reached).
    Completed,
    /// Stopped by a cancel (what was moved stays moved).
    Cancelled,
    /// Stopped by an error (the source or a destination went away, a round timed out).
    Failed,
}

impl RedriveStatus {
    /// The name the API shows (SQS's task statuses).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Running => "RUNNING",
            Self::Completed => "COMPLETED",
            Self::Cancelled => "CANCELLED",
            Self::Failed => "FAILED",
        }
    }
}

/// A task's progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedriveProgress {
    /// Where it is.
    pub status: RedriveStatus,
    /// Messages moved (taken by their destination and gone from the source).
    pub moved: u64,
    /// Messages a destination had taken before (an interrupted redrive's): acknowledged at
    /// the source, not enqueued again.
    pub duplicates: u64,
    /// Messages left in the source: not matching the filter, or with no destination (no
    /// `x-death`, or its queue is gone).
    pub skipped: u64,
    /// Messages a destination refused (its length limit): back in the source.
    pub refused: u64,
    /// Ready messages in the source when the task started.
    pub source_ready_at_start: u64,
    /// Wall-clock ms it started.
    pub started_at_ms: u64,
    /// Wall-clock ms it finished.
    pub finished_at_ms: Option<u64>,
    /// Why it failed.
    pub error: Option<String>,
}

/// One task.
#[derive(Debug)]
pub struct RedriveTask {
    /// Its id on this node.
    pub id: u64,
    /// What it was asked.
    pub spec: RedriveSpec,
    progress: Mutex<RedriveProgress>,
    cancel: AtomicBool,
    cancelled: tokio::sync::Notify,
}

impl RedriveTask {
    /// Its progress now.
    #[must_use]
    pub fn progress(&self) -> RedriveProgress {
        self.progress.lock().clone()
    }

    /// Ask it to stop after the round under way (whose moves complete).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
        self.cancelled.notify_waiters();
    }

    fn finish(&self, status: RedriveStatus, error: Option<String>) {
        let mut p = self.progress.lock();
        p.status = status;
        p.error = error;
        p.finished_at_ms = Some(crate::timers::wall_ms());
    }
}

/// What every redrive of the node did since it started (Prometheus counters).
#[derive(Debug, Default)]
pub struct RedriveTotals {
    /// Messages moved.
    pub moved: AtomicU64,
    /// Moves a destination had taken before.
    pub duplicates: AtomicU64,
    /// Messages left in their source (not chosen, or without a destination).
    pub skipped: AtomicU64,
    /// Messages a destination refused.
    pub refused: AtomicU64,
}

/// The node's redrive tasks.
#[derive(Debug, Default)]
pub struct Redrives {
    tasks: Mutex<BTreeMap<u64, Arc<RedriveTask>>>,
    next_id: AtomicU64,
    totals: Arc<RedriveTotals>,
}

impl Redrives {
    /// What every redrive of the node did since it started.
    #[must_use]
    pub fn totals(&self) -> &RedriveTotals {
        &self.totals
    }

    /// Tasks running now.
    #[must_use]
    pub fn running(&self) -> usize {
        self.tasks
            .lock()
            .values()
            .filter(|t| t.progress.lock().status == RedriveStatus::Running)
            .count()
    }

    /// Every task kept, oldest first.
    #[must_use]
    pub fn list(&self) -> Vec<Arc<RedriveTask>> {
        self.tasks.lock().values().cloned().collect()
    }

    /// One task.
    #[must_use]
    pub fn get(&self, id: u64) -> Option<Arc<RedriveTask>> {
        self.tasks.lock().get(&id).cloned()
    }

    /// Check `spec` against `vhost` and start a task on the current tokio runtime.
    ///
    /// # Errors
    /// A [`RedriveError`] saying what is wrong; nothing started.
    pub fn start(
        &self,
        vhost: Option<Arc<VHost>>,
        spec: RedriveSpec,
        may_write: MayWrite,
    ) -> Result<Arc<RedriveTask>, RedriveError> {
        let vhost = vhost.ok_or_else(|| RedriveError::NoVhost(spec.vhost.clone()))?;
        if spec.rate == 0 || spec.rate > REDRIVE_RATE_MAX {
            return Err(RedriveError::Rate);
        }
        let f = &spec.filter;
        let too_long = std::iter::once(&spec.source)
            .chain(&spec.destination)
            .chain(&f.origin)
            .chain(&f.reason)
            .chain(&f.routing_key)
            .chain(f.headers.iter().flat_map(|(k, v)| [k, v]))
            .any(|s| s.len() > REDRIVE_NAME_MAX);
        if too_long {
            return Err(RedriveError::TooLong);
        }
        let no_queue = |name: &str| RedriveError::NoQueue(name.to_string(), spec.vhost.clone());
        let source = vhost
            .queue(&spec.source)
            .ok_or_else(|| no_queue(&spec.source))?;
        if source.is_stream {
            return Err(RedriveError::Stream(spec.source.clone()));
        }
        if let Some(d) = &spec.destination {
            let dest = vhost.queue(d).ok_or_else(|| no_queue(d))?;
            if dest.is_stream {
                return Err(RedriveError::Stream(d.clone()));
            }
            if d == &spec.source {
                return Err(RedriveError::SameQueue);
            }
        }
        let Some(boundary) = source.next_message_id() else {
            return Err(RedriveError::Elsewhere(spec.source.clone()));
        };
        let task = {
            let mut tasks = self.tasks.lock();
            let running = tasks
                .values()
                .filter(|t| t.progress.lock().status == RedriveStatus::Running)
                .count();
            if running >= REDRIVES_RUNNING_MAX {
                return Err(RedriveError::Busy);
            }
            let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
            let task = Arc::new(RedriveTask {
                id,
                spec,
                progress: Mutex::new(RedriveProgress {
                    status: RedriveStatus::Running,
                    moved: 0,
                    duplicates: 0,
                    skipped: 0,
                    refused: 0,
                    source_ready_at_start: source.stats().ready,
                    started_at_ms: crate::timers::wall_ms(),
                    finished_at_ms: None,
                    error: None,
                }),
                cancel: AtomicBool::new(false),
                cancelled: tokio::sync::Notify::new(),
            });
            tasks.insert(id, Arc::clone(&task));
            // Finished tasks beyond the bound go, oldest first.
            let finished: Vec<u64> = tasks
                .iter()
                .filter(|(_, t)| t.progress.lock().status != RedriveStatus::Running)
                .map(|(id, _)| *id)
                .collect();
            for id in finished
                .iter()
                .take(finished.len().saturating_sub(REDRIVES_KEPT))
            {
                tasks.remove(id);
            }
            task
        };
        let ack_delay = std::env::var(ACK_DELAY_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis);
        let run = Run {
            task: Arc::clone(&task),
            vhost,
            source,
            boundary,
            may_write,
            ack_delay,
            totals: Arc::clone(&self.totals),
        };
        tokio::spawn(run.go());
        Ok(task)
    }

    /// Ask task `id` to stop.
    ///
    /// # Errors
    /// [`RedriveError::NoTask`].
    pub fn cancel(&self, id: u64) -> Result<Arc<RedriveTask>, RedriveError> {
        let task = self.get(id).ok_or(RedriveError::NoTask(id))?;
        task.cancel();
        Ok(task)
    }
}

/// A task at work.
struct Run {
    task: Arc<RedriveTask>,
    vhost: Arc<VHost>,
    source: Arc<Queue>,
    /// Messages with ids from here arrived after the start: not moved.
    boundary: u64,
    may_write: MayWrite,
    /// See [`ACK_DELAY_ENV`].
    ack_delay: Option<Duration>,
    totals: Arc<RedriveTotals>,
}

/// A claim whose message its destination holds, to acknowledge at the source.
struct Settled {
    claim: Claimed<Outgoing>,
    destination: Arc<Queue>,
    key: Option<Vec<u8>>,
    /// The destination had taken this move before.
    duplicate: bool,
}

/// A message chosen in a round, with where it goes.
struct Chosen {
    id: u64,
    destination: Arc<Queue>,
}

impl Run {
    async fn go(self) {
        let (status, error) = match self.rounds().await {
            Ok(status) => (status, None),
            Err(e) => (RedriveStatus::Failed, Some(e)),
        };
        tracing::info!(
            redrive = self.task.id,
            vhost = %self.task.spec.vhost,
            source = %self.task.spec.source,
            status = status.name(),
            error = error.as_deref().unwrap_or(""),
            "redrive finished"
        );
        self.task.finish(status, error);
    }

    async fn rounds(&self) -> Result<RedriveStatus, String> {
        let spec = &self.task.spec;
        let mut pacer = Pacer::new(spec.rate);
        // Position of the first ready message not yet looked at (those before it stay).
        let mut position = 0usize;
        loop {
            if self.task.cancel.load(Ordering::Relaxed) {
                return Ok(RedriveStatus::Cancelled);
            }
            let done = {
                let p = self.task.progress.lock();
                p.moved + p.duplicates
            };
            let left = spec
                .max_messages
                .map_or(u64::MAX, |m| m.saturating_sub(done));
            if left == 0 {
                return Ok(RedriveStatus::Completed);
            }
            let batch = usize::try_from(left)
                .unwrap_or(usize::MAX)
                .min(REDRIVE_BATCH_MAX)
                .min(spec.rate as usize);
            let Some((chosen, looked)) = self.choose(position, batch) else {
                return Err(format!("queue '{}' went away", spec.source));
            };
            if looked == 0 {
                return Ok(RedriveStatus::Completed);
            }
            position += looked - chosen.len();
            if chosen.is_empty() {
                continue;
            }
            tokio::select! {
                () = pacer.wait(chosen.len()) => {}
                () = self.task.cancelled.notified() => continue,
            }
            self.round(chosen).await?;
        }
    }

    /// Look at ready messages from `position` and choose up to `batch`; also how many were
    /// looked at (0: the end). None if the source is gone or not browsable here.
    fn choose(&self, position: usize, batch: usize) -> Option<(Vec<Chosen>, usize)> {
        if self.source.is_deleted() {
            return None;
        }
        let page = self
            .source
            .browse(BrowseState::Ready, position, SCAN_PAGE)?;
        let spec = &self.task.spec;
        // A named destination and no filter need nothing from a message: it is resolved once
        // and no body is read here (the claim reads each one it moves).
        let fixed = match &spec.destination {
            Some(d) if spec.filter == RedriveFilter::default() => Some(self.destination_named(d)),
            _ => None,
        };
        let mut chosen = Vec::new();
        let mut looked = 0;
        let mut skipped = 0;
        for b in page {
            if chosen.len() == batch {
                break;
            }
            looked += 1;
            if b.id >= self.boundary {
                continue;
            }
            let destination = match &fixed {
                Some(d) => d.clone(),
                None => {
                    let Some(message) = readable(&b.msg) else {
                        continue;
                    };
                    self.destination_of(&message)
                        .filter(|_| spec.filter.matches(&message))
                }
            };
            match destination {
                Some(destination) => chosen.push(Chosen {
                    id: b.id,
                    destination,
                }),
                None => skipped += 1,
            }
        }
        self.task.progress.lock().skipped += skipped;
        self.totals.skipped.fetch_add(skipped, Ordering::Relaxed);
        Some((chosen, looked))
    }

    /// The queue `message` goes to: the task's destination, or the one it last died in.
    fn destination_of(&self, message: &Message) -> Option<Arc<Queue>> {
        match &self.task.spec.destination {
            Some(d) => self.destination_named(d),
            None => self.destination_named(&origin(message)?),
        }
    }

    /// Queue `name` as a destination: not the source, writable by the caller, not a stream.
    fn destination_named(&self, name: &str) -> Option<Arc<Queue>> {
        if name == self.task.spec.source || !(self.may_write)(name) {
            return None;
        }
        self.vhost.queue(name).filter(|q| !q.is_stream)
    }

    /// Move the chosen messages: take, enqueue as moves, ack, forget the keys.
    async fn round(&self, chosen: Vec<Chosen>) -> Result<(), String> {
        let worker = format!("redrive {}", self.task.id);
        let ids = chosen.iter().map(|c| c.id).collect();
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.source.take(
            ids,
            Some(REDRIVE_LEASE_MS),
            worker,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        let claims = match tokio::time::timeout(ROUND_WAIT, rx).await {
            Ok(Ok(Ok(claims))) => claims,
            Ok(Ok(Err(e))) => return Err(format!("taking from the source: {e}")),
            _ => return Err("the source did not answer".into()),
        };
        let mut destinations: BTreeMap<u64, Arc<Queue>> =
            chosen.into_iter().map(|c| (c.id, c.destination)).collect();
        // Enqueue every claimed message into its destination, all at once.
        let mut pending = Vec::with_capacity(claims.len());
        for claim in claims {
            let Some(destination) = destinations.remove(&claim.id) else {
                continue;
            };
            let Some(message) = readable(&claim.msg).map(|m| as_move(&m, &destination.name)) else {
                pending.push((claim, destination, None, None));
                continue;
            };
            let key = move_key(&self.task.spec, claim.id, &message);
            let (tx, rx) = tokio::sync::oneshot::channel();
            destination.publish_one(
                &message,
                PublishOptions {
                    move_key: Some(key.clone()),
                    delay_ms: None,
                },
                Box::new(move |r| {
                    let _ = tx.send(r);
                }),
            );
            pending.push((claim, destination, Some(key), Some(rx)));
        }
        let mut acks = Vec::new();
        let mut releases = Vec::new();
        let mut refused = 0u64;
        let mut failure = None;
        for (claim, destination, key, rx) in pending {
            let outcome = match rx {
                Some(rx) => match tokio::time::timeout(ROUND_WAIT, rx).await {
                    Ok(Ok(r)) => r,
                    _ => Err("the destination did not answer".into()),
                },
                None => Err("unreadable message".into()),
            };
            match outcome {
                Ok(Enqueued::Accepted) => acks.push(Settled {
                    claim,
                    destination,
                    key,
                    duplicate: false,
                }),
                Ok(Enqueued::Duplicate) => acks.push(Settled {
                    claim,
                    destination,
                    key,
                    duplicate: true,
                }),
                Ok(Enqueued::Rejected | Enqueued::Gone) => {
                    refused += 1;
                    releases.push(claim);
                }
                Err(e) => {
                    // Not known to be in the destination: the claim runs out and the
                    // message returns (a next run's move of it is refused there if it was
                    // taken after all).
                    failure.get_or_insert(format!("moving into '{}': {e}", destination.name));
                }
            }
        }
        if let Some(delay) = self.ack_delay {
            // The line the kill -9 test waits for: every move of this round is durable in
            // its destination and none is acknowledged at the source yet.
            tracing::warn!(
                task = self.task.id,
                held = acks.len(),
                "redrive round held by fault injection ({ACK_DELAY_ENV}) for {} ms",
                delay.as_millis()
            );
            tokio::time::sleep(delay).await;
        }
        self.settle(acks, releases, refused).await;
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Acknowledge what the destinations hold, release what they refused, then let the
    /// destinations forget the keys of the moves acknowledged.
    async fn settle(&self, acks: Vec<Settled>, releases: Vec<Claimed<Outgoing>>, refused: u64) {
        let token = |c: &Claimed<Outgoing>| (c.id, c.generation, c.enqueued_at);
        let mut commands: Vec<Command<crate::message::Entry>> = acks
            .iter()
            .map(|a| {
                let (id, generation, enqueued_at) = token(&a.claim);
                Command::AckLease {
                    id,
                    generation,
                    enqueued_at,
                }
            })
            .collect();
        commands.extend(releases.iter().map(|c| {
            let (id, generation, enqueued_at) = token(c);
            Command::Release {
                id,
                generation,
                enqueued_at,
                delay_ms: Some(0),
                reason: "redrive: the destination refused it".into(),
            }
        }));
        let outcomes: Vec<Result<LeaseState, LeaseError>> = if commands.is_empty() {
            Vec::new()
        } else {
            let (tx, rx) = tokio::sync::oneshot::channel();
            self.source.settle_leases(
                commands,
                Box::new(move |r| {
                    let _ = tx.send(r);
                }),
            );
            match tokio::time::timeout(ROUND_WAIT, rx).await {
                Ok(Ok(Ok(outcomes))) => outcomes,
                _ => Vec::new(),
            }
        };
        // Keys of moves whose source copy is gone; a move whose ack was refused (its lease
        // ran out, the message is back in the source) keeps its key, so its next move is
        // dropped as the duplicate it is.
        let mut forget: BTreeMap<String, (Arc<Queue>, Vec<Vec<u8>>)> = BTreeMap::new();
        let (mut moved, mut duplicates) = (0u64, 0u64);
        for (a, outcome) in acks.into_iter().zip(&outcomes) {
            if outcome != &Ok(LeaseState::Acked) {
                continue;
            }
            if a.duplicate {
                duplicates += 1;
            } else {
                moved += 1;
            }
            if let Some(key) = a.key {
                forget
                    .entry(a.destination.name.clone())
                    .or_insert_with(|| (Arc::clone(&a.destination), Vec::new()))
                    .1
                    .push(key);
            }
        }
        for (_, (destination, keys)) in forget {
            destination.forget_move_keys(keys);
        }
        self.totals.moved.fetch_add(moved, Ordering::Relaxed);
        self.totals
            .duplicates
            .fetch_add(duplicates, Ordering::Relaxed);
        self.totals.refused.fetch_add(refused, Ordering::Relaxed);
        let mut p = self.task.progress.lock();
        p.moved += moved;
        p.duplicates += duplicates;
        p.refused += refused;
    }
}

impl RedriveFilter {
    /// Whether `message` is one to move.
    #[must_use]
    pub fn matches(&self, message: &Message) -> bool {
        let headers = message.properties.headers();
        let header = |name: &str| {
            headers
                .as_ref()
                .and_then(|h| h.inner().get(name).and_then(text))
        };
        if let Some(o) = &self.origin
            && origin(message).as_ref() != Some(o)
        {
            return false;
        }
        if let Some(r) = &self.reason {
            let last = header("x-last-death-reason").or_else(|| {
                crate::deadletter::deaths(headers.as_ref())
                    .into_iter()
                    .next()
                    .map(|(_, reason)| reason)
            });
            if last.as_ref() != Some(r) {
                return false;
            }
        }
        if let Some(k) = &self.routing_key
            && &message.routing_key != k
        {
            return false;
        }
        self.headers
            .iter()
            .all(|(k, v)| header(k).as_ref() == Some(v))
    }
}

/// The queue a dead-lettered message last died in.
#[must_use]
pub fn origin(message: &Message) -> Option<String> {
    let headers = message.properties.headers();
    headers
        .as_ref()
        .and_then(|h| h.inner().get("x-last-death-queue").and_then(text))
        .or_else(|| {
            crate::deadletter::deaths(headers.as_ref())
                .into_iter()
                .next()
                .map(|(queue, _)| queue)
        })
        .filter(|q| !q.is_empty())
}

/// A header value as text (strings, and numbers as their digits).
fn text(v: &AMQPValue) -> Option<String> {
    crate::args::string_like(v)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .or_else(|| crate::args::int_value(v).map(|n| n.to_string()))
}

/// The message behind a browse or claim, if it can be read.
fn readable(msg: &Outgoing) -> Option<Arc<Message>> {
    msg.load().ok().and_then(|l| loaded_message(&l).ok())
}

/// `message` as it enters `queue`: through the default exchange with the queue's name as its
/// routing key (what a shovel's move does), everything else kept (its `x-death` included).
fn as_move(message: &Message, queue: &str) -> Arc<Message> {
    Arc::new(Message {
        exchange: String::new(),
        routing_key: queue.to_string(),
        properties: message.properties.clone(),
        body: message.body.clone(),
    })
}

/// The key naming a move of source message `id`: vhost, source queue, message id and a
/// digest of the body, which tells apart messages of two incarnations of the source that
/// share an id. Stable across restarts (FNV-1a, not the process's random hasher).
fn move_key(spec: &RedriveSpec, id: u64, message: &Message) -> Vec<u8> {
    let mut digest: u64 = 0xcbf2_9ce4_8422_2325;
    for b in message.body.iter() {
        digest ^= u64::from(*b);
        digest = digest.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!(
        "redrive\0{}\0{}\0{id}\0{digest:016x}",
        spec.vhost, spec.source
    )
    .into_bytes()
}

/// Paces a task at `rate` messages a second (a token bucket holding at most one batch).
struct Pacer {
    rate: f64,
    tokens: f64,
    last: tokio::time::Instant,
}

impl Pacer {
    fn new(rate: u32) -> Self {
        Self {
            rate: f64::from(rate),
            tokens: 0.0,
            last: tokio::time::Instant::now(),
        }
    }

    /// Wait until `n` messages may go, then take them.
    async fn wait(&mut self, n: usize) {
        let n = n as f64;
        let now = tokio::time::Instant::now();
        let cap = (REDRIVE_BATCH_MAX as f64).max(n);
        self.tokens =
            (self.tokens + now.duration_since(self.last).as_secs_f64() * self.rate).min(cap);
        self.last = now;
        if self.tokens < n {
            let wait = Duration::from_secs_f64((n - self.tokens) / self.rate);
            tokio::time::sleep(wait).await;
            self.tokens = n;
            self.last = tokio::time::Instant::now();
        }
        self.tokens -= n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::{FieldArray, FieldTable};
    use warren_amqp::properties::Properties;

    fn dead(queue: &str, reason: &str, extra: &[(&str, &str)]) -> Message {
        let mut death = FieldTable::default();
        death.insert("queue".into(), AMQPValue::LongString(queue.into()));
        death.insert("reason".into(), AMQPValue::LongString(reason.into()));
        let mut headers = FieldTable::default();
        headers.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
        );
        for (k, v) in extra {
            headers.insert((*k).into(), AMQPValue::LongString((*v).into()));
        }
        Message {
            exchange: "dlx".into(),
            routing_key: "orders.eu".into(),
            properties: Properties::parse(
                Properties::default().rewrite(&warren_amqp::table::encode_table(&headers), false),
                warren_amqp::limits::TABLE_DEPTH_MAX,
            )
            .expect("parses"),
            body: bytes::Bytes::from_static(b"body"),
        }
    }

    /// The origin comes from `x-last-death-queue`, else the newest `x-death`; the filter's
    /// conditions all hold or the message stays.
    #[test]
    fn filter_and_origin_read_the_death_headers() {
        let m = dead("orders", "rejected", &[("tenant", "7")]);
        assert_eq!(origin(&m).as_deref(), Some("orders"));
        let later = dead("orders", "rejected", &[("x-last-death-queue", "billing")]);
        assert_eq!(origin(&later).as_deref(), Some("billing"));
        let all = RedriveFilter::default();
        assert!(all.matches(&m));
        let f = RedriveFilter {
            origin: Some("orders".into()),
            reason: Some("rejected".into()),
            routing_key: Some("orders.eu".into()),
            headers: vec![("tenant".into(), "7".into())],
        };
        assert!(f.matches(&m));
        for other in [
            RedriveFilter {
                origin: Some("billing".into()),
                ..f.clone()
            },
            RedriveFilter {
                reason: Some("expired".into()),
                ..f.clone()
            },
            RedriveFilter {
                routing_key: Some("orders.us".into()),
                ..f.clone()
            },
            RedriveFilter {
                headers: vec![("tenant".into(), "8".into())],
                ..f.clone()
            },
        ] {
            assert!(!other.matches(&m), "{other:?}");
        }
        let plain = Message {
            properties: Properties::default(),
            ..dead("x", "y", &[])
        };
        assert_eq!(origin(&plain), None, "never dead-lettered");
    }

    /// A move's key is the same for the same message whenever it is computed (a restart in
    /// between included) and differs for another id, body or source.
    #[test]
    fn move_keys_name_the_source_message() {
        let spec = RedriveSpec {
            vhost: "/".into(),
            source: "dlq".into(),
            destination: None,
            max_messages: None,
            rate: 10,
            filter: RedriveFilter::default(),
        };
        let m = dead("orders", "rejected", &[]);
        let k = move_key(&spec, 7, &m);
        assert_eq!(k, move_key(&spec, 7, &m));
        assert_ne!(k, move_key(&spec, 8, &m));
        let other_body = Message {
            body: bytes::Bytes::from_static(b"other"),
            ..dead("orders", "rejected", &[])
        };
        assert_ne!(k, move_key(&spec, 7, &other_body));
        let other_source = RedriveSpec {
            source: "dlq2".into(),
            ..spec.clone()
        };
        assert_ne!(k, move_key(&other_source, 7, &m));
    }
}
