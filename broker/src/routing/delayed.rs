//! Delayed delivery (`x-delayed-message` exchanges, compatible with the
//! rabbitmq_delayed_message_exchange plugin): a publish with a positive `x-delay` header is held
//! until due, then routed through the exchange's bindings with its `x-delayed-type`.
//!
//! Scheduled messages wait in a map ordered by (due time, sequence): scheduling and firing cost
//! O(log n), nothing is ever scanned, and the timer thread is asked for the earliest due time
//! only. Persistent messages published to a durable delayed exchange are written to the store
//! under the reserved queue id [`DELAYED_QUEUE_ID`] with their due time as expiry, so they
//! survive restarts (unlike the plugin's node-local Mnesia table); the publisher confirm waits
//! for that write. After a restart only their store locations are held in memory.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};

use bytes::Bytes;
use parking_lot::Mutex;
use warren_amqp::properties::Properties;
use warren_store::writer::Completion;
use warren_store::{Batch, BodyRef, Location, Op};

use crate::durable::Durable;
use crate::exchange::RoutingHeaders;
use crate::message::codec::stored;
use crate::message::{Entry, Loaded, Message};
use crate::queue::QueueHost;
use crate::queue::publish_routed;
use crate::timers::{TimerTarget, Timers, wall_ms};

/// Store queue id under which vhost "/" indexes its scheduled persistent messages. Vhost
/// number `slot` (persisted in its record) uses `DELAYED_QUEUE_ID - slot`; queue ids handed
/// out by the broker count up from 1 and never reach the top 2^32 ids.
pub const DELAYED_QUEUE_ID: u64 = u64::MAX;

/// The lowest store id a delayed slot can map to.
pub const DELAYED_QUEUE_ID_MIN: u64 = DELAYED_QUEUE_ID - u32::MAX as u64;

/// The store queue id of delayed slot `slot`.
#[must_use]
pub fn store_id(slot: u32) -> u64 {
    DELAYED_QUEUE_ID - u64::from(slot)
}

/// The delay a publish asks for: its `x-delay` header in milliseconds, if positive.
#[must_use]
pub fn delay_of(props: &Properties) -> Option<u64> {
    // A byte search first: most messages have no headers or no x-delay.
    let raw = props.headers_raw()?;
    if !raw.windows(8).any(|w| w == b"\x07x-delay") {
        return None;
    }
    let headers = props.headers()?;
    let ms = crate::args::int_value(headers.inner().get("x-delay")?)?;
    u64::try_from(ms).ok().filter(|ms| *ms > 0)
}

#[derive(Debug)]
struct State {
    /// (due, seq) -> the message and whether it is in the store.
    due: BTreeMap<(u64, u64), (Entry, bool)>,
    next_seq: u64,
    /// When the timer thread will wake us.
    armed: Option<u64>,
    /// The vhost was deleted: nothing more is scheduled or stored.
    discarded: bool,
}

/// One vhost's scheduled messages.
#[derive(Debug)]
pub struct Delayed {
    vhost: Weak<dyn QueueHost>,
    store: Option<Arc<Durable>>,
    timers: Option<Arc<Timers>>,
    me: Weak<Delayed>,
    /// This vhost's delayed slot (its store id is [`store_id`] of it); set before use.
    slot: std::sync::atomic::AtomicU32,
    state: Mutex<State>,
}

impl Delayed {
    /// The store of `vhost`.
    #[must_use]
    pub fn new(
        vhost: Weak<dyn QueueHost>,
        store: Option<Arc<Durable>>,
        timers: Option<Arc<Timers>>,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            vhost,
            store,
            timers,
            me: me.clone(),
            slot: std::sync::atomic::AtomicU32::new(0),
            state: Mutex::new(State {
                due: BTreeMap::new(),
                next_seq: 1,
                armed: None,
                discarded: false,
            }),
        })
    }

    /// The vhost's delayed slot.
    #[must_use]
    pub fn slot(&self) -> u32 {
        self.slot.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Give the vhost its slot (when it is created or recovered, before any message).
    pub fn set_slot(&self, slot: u32) {
        self.slot.store(slot, std::sync::atomic::Ordering::Release);
    }

    fn store_queue(&self) -> u64 {
        store_id(self.slot())
    }

    /// Drop everything scheduled (the vhost is deleted): stored messages are settled so that
    /// a restart does not bring them back.
    pub fn discard_all(&self) {
        let stored: Vec<u64> = {
            let mut st = self.state.lock();
            st.discarded = true;
            let due = std::mem::take(&mut st.due);
            due.into_iter()
                .filter(|(_, (_, stored))| *stored)
                .map(|((_, seq), _)| seq)
                .collect()
        };
        if let Some(store) = &self.store
            && !stored.is_empty()
        {
            let queue = self.store_queue();
            store.submit_ops(
                stored
                    .into_iter()
                    .map(|id| Op::Settle { queue, id })
                    .collect(),
            );
        }
    }

    /// Messages waiting.
    #[must_use]
    pub fn len(&self) -> usize {
        self.state.lock().due.len()
    }

    /// Whether nothing is waiting.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Hold `message` until `due` (wall-clock ms). A persistent message on a durable exchange
    /// is written to the store first (under the lock, so its settle can never overtake it);
    /// `done` is then called for the completion the publisher waits on. Returns whether it
    /// was written.
    pub fn schedule(
        &self,
        message: Arc<Message>,
        due: u64,
        durable: bool,
        done: impl FnOnce() -> Completion,
    ) -> bool {
        let mut st = self.state.lock();
        if st.discarded {
            // A publish that raced the vhost's deletion: the vhost and its exchange are gone.
            return false;
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        let stored = match &self.store {
            Some(store) if durable && message.properties.persistent() => {
                store.submit(
                    Batch {
                        bodies: vec![stored(&message)],
                        ops: vec![Op::Enqueue {
                            queue: self.store_queue(),
                            id: seq,
                            body: BodyRef::New(0),
                            flags: 0,
                            expires_at: due,
                        }],
                    },
                    done(),
                );
                true
            }
            _ => false,
        };
        st.due.insert((due, seq), (Entry::Mem(message), stored));
        self.arm(&mut st);
        stored
    }

    /// Put back a scheduled message found in the store at start-up.
    pub fn restore(&self, seq: u64, location: Location, due: u64) {
        let mut st = self.state.lock();
        st.next_seq = st.next_seq.max(seq + 1);
        st.due.insert(
            (due, seq),
            (
                Entry::Stored {
                    location,
                    size: location.len,
                    priority: 0,
                },
                true,
            ),
        );
        self.arm(&mut st);
    }

    fn arm(&self, st: &mut State) {
        let Some(&(next, _)) = st.due.keys().next() else {
            return;
        };
        if let Some(timers) = &self.timers
            && st.armed.is_none_or(|armed| next < armed)
        {
            st.armed = Some(next);
            let target: Weak<dyn TimerTarget> = self.me.clone();
            timers.schedule(next, target);
        }
    }

    /// Route everything that is due.
    fn release_due(&self) {
        let now = wall_ms();
        let ready: Vec<((u64, u64), (Entry, bool))> = {
            let mut st = self.state.lock();
            st.armed = None;
            let later = st.due.split_off(&(now + 1, 0));
            let ready = std::mem::replace(&mut st.due, later);
            self.arm(&mut st);
            ready.into_iter().collect()
        };
        let Some(vhost) = self.vhost.upgrade() else {
            return;
        };
        let mut settles = Vec::new();
        let mut targets = Vec::new();
        for ((_, seq), (entry, stored)) in ready {
            // The record stays indexed until the settle below, so it is still readable.
            let loaded = match crate::durable::pin(&entry, self.store.as_deref()).load() {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(error = %e, "cannot read a delayed message");
                    continue;
                }
            };
            if let Some(message) = message_of(&loaded) {
                let headers = RoutingHeaders::new(&message.properties);
                targets.clear();
                // A deleted exchange drops the message, as the plugin does.
                if vhost
                    .route(
                        &message.exchange,
                        &message.routing_key,
                        &headers,
                        &mut targets,
                    )
                    .is_ok()
                {
                    let message = Arc::new(message);
                    let _ = publish_routed(&targets, &message, || Box::new(|_| {}));
                }
            }
            if stored {
                settles.push(Op::Settle {
                    queue: self.store_queue(),
                    id: seq,
                });
            }
        }
        if let Some(store) = &self.store {
            store.submit_ops(settles);
        }
    }
}

impl TimerTarget for Delayed {
    fn fire(self: Arc<Self>) {
        self.release_due();
    }
}

fn message_of(loaded: &Loaded) -> Option<Message> {
    Some(match loaded {
        Loaded::Mem(m) => Message {
            exchange: m.exchange.clone(),
            routing_key: m.routing_key.clone(),
            properties: m.properties.clone(),
            body: m.body.clone(),
        },
        Loaded::Read(m) => Message {
            exchange: String::from_utf8(m.exchange.to_vec()).ok()?,
            routing_key: String::from_utf8(m.routing_key.to_vec()).ok()?,
            properties: Properties::parse(
                Bytes::clone(&m.properties),
                warren_amqp::limits::TABLE_DEPTH_MAX,
            )
            .ok()?,
            body: m.body.clone(),
        },
    })
}
