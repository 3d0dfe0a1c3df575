//! Dead-lettering: what the machine removed with a reason is held under the queue lock, then
//! republished to the dead-letter exchange with no queue lock held, through [`super::QueueHost`].

use super::*;

/// Why a message was dead-lettered past its delivery limit, as its last worker left it: the
/// dead letter carries it in `x-failure-reason`, `x-failure-worker` and `x-failure-attempts`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailureContext {
    /// The last release's reason, or `lease expired`.
    pub reason: String,
    /// The worker that held it last.
    pub worker: String,
    /// Deliveries returned, the last one included.
    pub delivery_count: u32,
}

impl Queue {
    pub(super) fn hold_dead_letter(
        &self,
        st: &mut State,
        msg: &Entry,
        reason: Removal,
        context: Option<FailureContext>,
    ) {
        if !st.dead_letters_here {
            return;
        }
        st.dead_letters.push((self.pin(msg), reason, context));
        self.dead_letters_pending.store(true, Ordering::Release);
    }

    /// Republish what this queue dead-lettered to its dead-letter exchange. Call with no
    /// queue lock held (routing takes the vhost lock, publishing takes other queues' locks).
    ///
    /// Dead-lettering into a queue can make that queue dead-letter in turn (a full drop-head
    /// queue): such nested work is queued on this thread and drained by the outermost call, so
    /// the stack does not grow with the length of the chain.
    pub fn dead_letter_pending(self: &Arc<Self>) {
        if !self.dead_letters_pending.load(Ordering::Acquire) {
            return;
        }
        let nested = DEAD_LETTER_WORK.with(|w| {
            let mut w = w.borrow_mut();
            match w.as_mut() {
                Some(queue) => {
                    queue.push_back(Arc::clone(self));
                    true
                }
                None => {
                    *w = Some(std::collections::VecDeque::new());
                    false
                }
            }
        });
        if nested {
            return;
        }
        let mut next = Some(Arc::clone(self));
        while let Some(q) = next {
            q.dead_letter_now();
            next = DEAD_LETTER_WORK.with(|w| w.borrow_mut().as_mut().and_then(|v| v.pop_front()));
        }
        DEAD_LETTER_WORK.with(|w| *w.borrow_mut() = None);
    }

    pub(super) fn dead_letter_now(self: &Arc<Self>) {
        if !self.dead_letters_pending.swap(false, Ordering::AcqRel) {
            return;
        }
        let (items, target) = {
            let mut st = self.state.lock();
            (std::mem::take(&mut st.dead_letters), st.dead_letter.clone())
        };
        let (Some(target), Some(vhost)) = (target.as_ref(), self.vhost_ref.upgrade()) else {
            return;
        };
        let now_s = crate::timers::wall_ms() / 1000;
        let mut targets = Vec::new();
        for (out, reason, context) in items {
            let Some(reason) = deadletter::reason_name(reason) else {
                continue;
            };
            let loaded = match out.load() {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(queue = %self.name, error = %e, "cannot read a message to dead-letter");
                    continue;
                }
            };
            let depth = warren_amqp::limits::TABLE_DEPTH_MAX;
            let Some(mut msg) =
                deadletter::dead_lettered(&loaded, &self.name, reason, now_s, target, depth)
            else {
                continue;
            };
            if let Some(c) = context {
                msg.properties = deadletter::with_failure(
                    &msg.properties,
                    &c.reason,
                    &c.worker,
                    c.delivery_count,
                );
            }
            let headers = RoutingHeaders::new(&msg.properties);
            targets.clear();
            // A missing dead-letter exchange drops the message, as in RabbitMQ.
            if vhost
                .route(&msg.exchange, &msg.routing_key, &headers, &mut targets)
                .is_err()
            {
                continue;
            }
            // Without x-dead-letter-routing-key the message keeps all its keys, CC included.
            if target.routing_key.is_none() {
                for cc in deadletter::sender_selected(&msg.properties).0 {
                    let _ = vhost.route(&msg.exchange, &cc, &headers, &mut targets);
                }
                let mut seen = std::collections::HashSet::new();
                targets.retain(|q| seen.insert(Arc::as_ptr(q)));
            }
            let deaths = deadletter::deaths(headers.get());
            targets.retain(|q| !deadletter::is_cycle(&deaths, &q.name));
            let msg = Arc::new(msg);
            let _ = publish_routed(&targets, &msg, || Box::new(|_| {}));
        }
    }
}

thread_local! {
    /// Queues with dead letters waiting while this thread is already dead-lettering.
    static DEAD_LETTER_WORK: std::cell::RefCell<Option<std::collections::VecDeque<Arc<Queue>>>> =
        const { std::cell::RefCell::new(None) };
}
