//! Stream consumers: subscribe at an offset spec, read chunks (decoded once, cached), credit,
//! settle, and wake parked readers when the log grows.

use super::*;

impl StreamQueue {
    /// Attach consumer `id` with what its basic.consume asked for, at `now_ms`.
    ///
    /// # Errors
    /// The stream was deleted meanwhile (404).
    pub fn consume(
        &self,
        id: ConsumerId,
        spec: &ConsumeSpec,
        prefetch: u16,
        sink: ConsumerSink,
        now_ms: u64,
    ) -> Result<(), AmqpError> {
        if self.deleted.load(Ordering::Acquire) {
            return Err(AmqpError::channel(
                ReplyCode::NotFound,
                format!("no {}", self.what),
            ));
        }
        let cursor = {
            let disk = self.shared.disk.lock();
            let log = disk.log();
            let stored = spec.name.as_deref().and_then(|n| log.stored_offset(n));
            Cursor::attach(log, spec, prefetch, stored, now_ms)
        };
        let slot = Arc::new(ReaderSlot {
            sink,
            parked: AtomicBool::new(false),
            woken: AtomicBool::new(false),
            reader: Mutex::new(Reader {
                cursor,
                prefetch,
                name: spec.name.clone(),
                chunk: None,
                outstanding: BTreeSet::new(),
                untracked: false,
                released: None,
            }),
        });
        {
            // Checked again under the readers' lock: a delete drains them under it.
            let mut readers = self.readers.lock();
            if self.deleted.load(Ordering::Acquire) {
                return Err(AmqpError::channel(
                    ReplyCode::NotFound,
                    format!("no {}", self.what),
                ));
            }
            readers.insert(id, Arc::clone(&slot));
        }
        self.wake(id, &slot);
        Ok(())
    }

    /// Detach consumer `id`. Nothing is removed from a stream; a named consumer's later acks
    /// of what it still holds move its tracked offset as before, and its position stays at
    /// its lowest unacked offset.
    pub fn cancel(&self, id: ConsumerId) {
        let Some(slot) = self.readers.lock().remove(&id) else {
            return;
        };
        let r = slot.reader.lock();
        if let Some(name) = r.name.as_deref().filter(|_| !r.untracked) {
            // What waited for its next proposal goes now.
            self.propose_pending(name);
        }
        if let Some(name) = r.name.clone().filter(|_| !r.untracked)
            && !r.outstanding.is_empty()
        {
            self.departed.lock().insert(
                id,
                Departed {
                    name,
                    outstanding: r.outstanding.clone(),
                    next: r.released.map_or(r.cursor.next, |x| x.min(r.cursor.next)),
                },
            );
        }
    }

    /// Consumer `id` acknowledged the deliveries at `offsets`: their credit comes back, and a
    /// named consumer's tracked offset moves to its lowest offset still unacked.
    pub fn settle(&self, id: ConsumerId, offsets: &[u64]) {
        self.settled(id, offsets, true);
    }

    /// The deliveries at `offsets` of consumer `id` will never be acked (its channel closed):
    /// credit back, and a named consumer's tracked offset stays where it is (they are read
    /// again when it resumes).
    pub fn release(&self, id: ConsumerId, offsets: &[u64]) {
        self.settled(id, offsets, false);
    }

    pub(super) fn settled(&self, id: ConsumerId, offsets: &[u64], acked: bool) {
        let Some(slot) = self.readers.lock().get(&id).cloned() else {
            self.settle_departed(id, offsets, acked);
            return;
        };
        let starved = {
            let mut r = slot.reader.lock();
            let starved = r.cursor.credit == 0;
            let mut n = 0;
            for o in offsets {
                if r.outstanding.remove(o) {
                    n += 1;
                    if !acked {
                        r.released = Some(r.released.map_or(*o, |x| x.min(*o)));
                    }
                }
            }
            let prefetch = r.prefetch;
            r.cursor
                .settle(u32::try_from(n).unwrap_or(u32::MAX), prefetch);
            if acked && n > 0 {
                let next = r.tracked_next();
                if let Some(name) = r.name.clone().filter(|_| !r.untracked)
                    && !self.track(&name, next)
                {
                    r.untracked = true;
                }
            }
            starved && n > 0
        };
        if starved {
            self.wake(id, &slot);
        }
    }

    pub(super) fn settle_departed(&self, id: ConsumerId, offsets: &[u64], acked: bool) {
        let mut departed = self.departed.lock();
        let Some(d) = departed.get_mut(&id) else {
            return;
        };
        let mut n = 0;
        for o in offsets {
            if d.outstanding.remove(o) {
                n += 1;
                if !acked {
                    d.next = d.next.min(*o);
                }
            }
        }
        let next = d.outstanding.first().map_or(d.next, |o| d.next.min(*o));
        let name = d.name.clone();
        let last = d.outstanding.is_empty();
        if last {
            departed.remove(&id);
        }
        drop(departed);
        if acked && n > 0 {
            self.track(&name, next);
        }
        if last {
            self.propose_pending(&name);
        }
    }

    /// Read what consumer `id` may be given now (within its credit). Called by the consumer's
    /// connection task when its [`Outbound::StreamReady`] arrives.
    #[must_use]
    pub fn pump(&self, id: ConsumerId) -> Vec<Delivery> {
        let Some(slot) = self.readers.lock().get(&id).cloned() else {
            return Vec::new();
        };
        let Some(queue) = self.owner.upgrade() else {
            return Vec::new();
        };
        slot.woken.store(false, Ordering::SeqCst);
        let mut out = Vec::new();
        let mut r = slot.reader.lock();
        loop {
            if r.cursor.credit == 0 {
                break;
            }
            let durable = self.shared.durable_next();
            let current = r
                .chunk
                .clone()
                .filter(|c| c.first <= r.cursor.next && r.cursor.next < c.end());
            let chunk = match current {
                Some(c) => c,
                None => {
                    let first = {
                        let disk = self.shared.disk.lock();
                        r.cursor.next_chunk(disk.log(), durable)
                    };
                    let Some(first) = first else {
                        // At the end (or nothing left that can match): park, then look
                        // again, so an append between the two is not missed.
                        slot.parked.store(true, Ordering::SeqCst);
                        if self.shared.durable_next() != durable {
                            slot.parked.store(false, Ordering::SeqCst);
                            continue;
                        }
                        break;
                    };
                    match self.decoded(first) {
                        Ok(Some(c)) => {
                            r.chunk = Some(Arc::clone(&c));
                            c
                        }
                        // Dropped by retention between the two looks: look again.
                        Ok(None) => continue,
                        Err(e) => {
                            // Nothing would wake this reader again: it is cancelled (the
                            // client gets basic.cancel and may consume again).
                            tracing::error!(stream = %self.what, error = %e, "cannot read a stream chunk; its consumer is cancelled");
                            drop(r);
                            self.readers.lock().remove(&id);
                            slot.sink.outbox.push(Outbound::Cancel {
                                channel: slot.sink.channel,
                                consumer: id,
                            });
                            self.delivered
                                .fetch_add(out.len() as u64, Ordering::Relaxed);
                            return out;
                        }
                    }
                }
            };
            let values: Vec<Option<&str>> = chunk.filters.iter().map(Option::as_deref).collect();
            let picks = r.cursor.pick(chunk.first, &values);
            for p in picks {
                r.outstanding.insert(p.offset);
                out.push(Delivery {
                    channel: slot.sink.channel,
                    consumer: id,
                    queue: Arc::clone(&queue),
                    id: p.offset,
                    message: Outgoing::Mem(Arc::clone(&chunk.messages[p.index])),
                    redelivered: false,
                    counted: false,
                    delivery_count: 0,
                });
            }
        }
        drop(r);
        self.delivered
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        out
    }

    pub(super) fn wake(&self, id: ConsumerId, slot: &ReaderSlot) {
        if slot.woken.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(queue) = self.owner.upgrade() {
            slot.sink.outbox.push(Outbound::StreamReady {
                channel: slot.sink.channel,
                consumer: id,
                queue,
            });
        }
    }

    /// The durable end moved: wake every parked reader.
    pub(super) fn wake_parked(&self) {
        let parked: Vec<(ConsumerId, Arc<ReaderSlot>)> = self
            .readers
            .lock()
            .iter()
            .filter(|(_, s)| s.parked.swap(false, Ordering::SeqCst))
            .map(|(id, s)| (*id, Arc::clone(s)))
            .collect();
        for (id, slot) in parked {
            self.wake(id, &slot);
        }
    }

    /// The chunk starting at `first`, decoded (from the cache, else read and decoded).
    pub(super) fn decoded(&self, first: u64) -> Result<Option<Arc<Decoded>>, StoreError> {
        if let Some(c) = self.cache.lock().iter().find(|c| c.first == first) {
            return Ok(Some(Arc::clone(c)));
        }
        let read = self.shared.disk.lock().read_chunk(first)?;
        let Some((first, records)) = read else {
            return Ok(None);
        };
        let mut messages = Vec::with_capacity(records.len());
        let mut filters = Vec::with_capacity(records.len());
        for (k, record) in records.into_iter().enumerate() {
            let offset = first + k as u64;
            let message = decode(&record.body, offset, self.table_depth_max).ok_or_else(|| {
                StoreError::Corrupt {
                    path: self.dir.clone(),
                    offset,
                    detail: "a stream message record does not decode".into(),
                }
            })?;
            messages.push(Arc::new(message));
            filters.push(record.filter_value);
        }
        let decoded = Arc::new(Decoded {
            first,
            messages,
            filters,
        });
        let mut cache = self.cache.lock();
        if !cache.iter().any(|c| c.first == first) {
            if cache.len() >= DECODED_CACHE_CHUNKS {
                cache.pop_front();
            }
            cache.push_back(Arc::clone(&decoded));
        }
        Ok(Some(decoded))
    }
}
