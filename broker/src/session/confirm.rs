//! Publisher confirms: confirm.select, numbering a confirm channel's publishes, the store
//! completions that confirm them (and release replies held until a change is durable), and
//! the coalesced basic.ack / basic.nack written at each flush.

use std::collections::BTreeSet;
use std::sync::Arc;

use amq_protocol::protocol::{AMQPClass, confirm};
use warren_amqp::frame::FrameWriter;
use warren_amqp::method::{put_basic_ack, put_basic_nack};
use warren_amqp::{AmqpError, ReplyCode};

use crate::queue::outbox::Outbound;

use super::{Call, Ctx, Mode, Session};

impl Mode {
    /// In confirm mode, number the next publish (from 1, as the client counts); else `None`.
    pub(super) fn next_publish_seq(&mut self) -> Option<u64> {
        match self {
            Mode::Confirm { last_seq, .. } => {
                *last_seq += 1;
                Some(*last_seq)
            }
            _ => None,
        }
    }

    /// The completion a publish waiting for the store gets: in confirm mode it confirms `seq`
    /// (acks are held below the lowest waiting one), in tx mode it releases the held commit-ok.
    pub(super) fn durable_completion(
        &mut self,
        ctx: &Ctx,
        epoch: u64,
        ch: u16,
        seq: Option<u64>,
    ) -> warren_store::writer::Completion {
        match (self, seq) {
            (Mode::Confirm { unconfirmed, .. }, Some(seq)) => {
                unconfirmed.insert(seq);
                let outbox = Arc::clone(&ctx.outbox);
                Box::new(move |r| {
                    outbox.push(Outbound::Confirmed {
                        channel: ch,
                        epoch,
                        seq,
                        ok: r.is_ok(),
                        nack: matches!(&r, Err(e) if matches!(**e, warren_store::StoreError::Replication(_))),
                    });
                })
            }
            (Mode::Tx(_), _) => ctx.on_commit(),
            _ => Box::new(|_| {}),
        }
    }
}

impl Call<'_> {
    /// confirm.select: a plain channel becomes a confirm channel (not a transactional one).
    pub(super) fn confirm_select(&mut self, s: confirm::Select) -> Result<(), AmqpError> {
        match self.chan.mode {
            Mode::Tx(_) => {
                return Err(AmqpError::channel(
                    ReplyCode::PreconditionFailed,
                    "cannot switch from tx to confirm mode",
                ));
            }
            Mode::Confirm { .. } => {}
            Mode::Plain => {
                self.chan.mode = Mode::Confirm {
                    last_seq: 0,
                    acked_upto: 0,
                    unconfirmed: BTreeSet::new(),
                    nacks: BTreeSet::new(),
                    marks: std::collections::VecDeque::new(),
                    marked_upto: 0,
                };
            }
        }
        if !s.nowait {
            self.reply(AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(
                confirm::SelectOk {},
            )));
        }
        Ok(())
    }
}

impl Session {
    /// Write what is owed before the output is flushed: coalesced publisher confirms.
    pub fn flush(&mut self, out: &mut FrameWriter) {
        // One clock read per flush, and only when a confirm channel needs it: this measures,
        // it never decides anything.
        let mut now = None;
        for (ch, chan) in &mut self.channels {
            if let Mode::Confirm {
                last_seq,
                acked_upto,
                unconfirmed,
                nacks,
                marks,
                marked_upto,
            } = &mut chan.mode
            {
                let marked = marks.back().map_or(*marked_upto, |m| m.0);
                if *last_seq > marked {
                    let t = *now.get_or_insert_with(std::time::Instant::now);
                    marks.push_back((*last_seq, t));
                    self.ctx.count(|s| s.received_confirm += *last_seq - marked);
                }
                let upto = unconfirmed.first().map_or(*last_seq, |first| first - 1);
                while let Some(&n) = nacks.first()
                    && n <= upto
                {
                    nacks.pop_first();
                    unconfirmed.remove(&n);
                    if n - 1 > *acked_upto {
                        let multiple = n - 1 - *acked_upto > 1;
                        out.method_with(*ch, |b| put_basic_ack(b, n - 1, multiple));
                        let acked = n - 1 - *acked_upto;
                        self.ctx.count(|s| s.confirmed += acked);
                    }
                    out.method_with(*ch, |b| put_basic_nack(b, n, false));
                    self.ctx.count(|s| s.nacked += 1);
                    *acked_upto = n;
                }
                if upto > *acked_upto {
                    let multiple = upto - *acked_upto > 1;
                    out.method_with(*ch, |b| put_basic_ack(b, upto, multiple));
                    let n = upto - *acked_upto;
                    self.ctx.count(|s| s.confirmed += n);
                    *acked_upto = upto;
                }
                while let Some(&(seq, at)) = marks.front()
                    && seq <= *acked_upto
                {
                    marks.pop_front();
                    let t = *now.get_or_insert_with(std::time::Instant::now);
                    self.ctx.broker.stats().confirm_seconds.observe_n(
                        t.saturating_duration_since(at).as_secs_f64(),
                        seq - *marked_upto,
                    );
                    *marked_upto = seq;
                }
            }
        }
        let stats = self.ctx.stats.take();
        if !stats.is_zero() {
            self.ctx.broker.stats().add(&stats);
        }
    }

    /// A store completion from the outbox: a held reply may go out (or never will), a
    /// publish is confirmed or nacked.
    pub(super) fn store_completion(&mut self, item: &Outbound) {
        match *item {
            Outbound::Committed { ok } => {
                if ok {
                    self.ctx.gate.set(self.ctx.gate.get().saturating_sub(1));
                } else {
                    // The held replies must never go out: keep the gate raised.
                    self.store_failed = true;
                }
            }
            Outbound::Confirmed {
                channel,
                epoch,
                seq,
                ok,
                nack,
            } => {
                if nack {
                    if let Some(chan) = self.channels.get_mut(&channel)
                        && chan.epoch == epoch
                        && let Mode::Confirm {
                            unconfirmed, nacks, ..
                        } = &mut chan.mode
                    {
                        unconfirmed.remove(&seq);
                        nacks.insert(seq);
                    }
                } else if !ok {
                    // Never confirmed: the seq stays waiting, so no ack passes it.
                    self.store_failed = true;
                } else if let Some(chan) = self.channels.get_mut(&channel)
                    && chan.epoch == epoch
                    && let Mode::Confirm { unconfirmed, .. } = &mut chan.mode
                {
                    unconfirmed.remove(&seq);
                }
            }
            _ => {}
        }
    }
}
