//! Transactions: tx.select, tx.commit and tx.rollback. A transactional channel's publishes are
//! routed when they arrive and enqueued at commit; its acks, nacks and rejects wait for the
//! commit too (see [`super::TxBuffer`]).

use amq_protocol::protocol::{AMQPClass, tx};
use warren_amqp::{AmqpError, ReplyCode};

use super::common::apply_acks;
use super::{AckAction, Call, Mode, TxBuffer};

/// tx.commit or tx.rollback on a channel that is not transactional.
fn not_transactional() -> AmqpError {
    AmqpError::channel(
        ReplyCode::PreconditionFailed,
        "channel is not transactional",
    )
}

impl Call<'_> {
    /// tx.select: a plain channel becomes transactional (not a confirm channel).
    pub(super) fn tx_select(&mut self) -> Result<(), AmqpError> {
        match self.chan.mode {
            Mode::Confirm { .. } => {
                return Err(AmqpError::channel(
                    ReplyCode::PreconditionFailed,
                    "cannot switch from confirm to tx mode",
                ));
            }
            Mode::Plain => self.chan.mode = Mode::Tx(TxBuffer::default()),
            Mode::Tx(_) => {}
        }
        self.reply(AMQPClass::Tx(tx::AMQPMethod::SelectOk(tx::SelectOk {})));
        Ok(())
    }

    /// tx.commit: enqueue the publishes, then apply the acks, requeues and discards, each
    /// kind in one go; commit-ok waits until the removals are durable.
    pub(super) fn tx_commit(&mut self) -> Result<(), AmqpError> {
        let ctx = self.ctx;
        let Mode::Tx(buf) = &mut self.chan.mode else {
            return Err(not_transactional());
        };
        let buf = std::mem::take(buf);
        for p in buf.publishes {
            self.enqueue_routed(&p.message, p.targets, p.mandatory);
        }
        for action in [AckAction::Settle, AckAction::Requeue, AckAction::Discard] {
            let of_kind = buf
                .acks
                .iter()
                .filter(|(a, _, _)| *a == action)
                .map(|(_, _, u)| u.clone());
            apply_acks(
                &self.chan.limiter,
                action,
                of_kind,
                Some(&mut || ctx.on_commit()),
            );
        }
        self.reply(AMQPClass::Tx(tx::AMQPMethod::CommitOk(tx::CommitOk {})));
        Ok(())
    }

    /// tx.rollback: drop the publishes; acks not committed make their messages unacked again.
    pub(super) fn tx_rollback(&mut self) -> Result<(), AmqpError> {
        let Mode::Tx(buf) = &mut self.chan.mode else {
            return Err(not_transactional());
        };
        let buf = std::mem::take(buf);
        // Acks not committed make their messages unacked again.
        for (_, tag, u) in buf.acks {
            self.chan.track(tag, u);
        }
        self.reply(AMQPClass::Tx(tx::AMQPMethod::RollbackOk(tx::RollbackOk {})));
        Ok(())
    }
}
