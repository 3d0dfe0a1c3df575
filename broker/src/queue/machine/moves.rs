//! Move keys: what makes a redrive exactly-once across two queues that cannot commit
//! together (two Raft groups, or a queue and a group).
//!
//! A redrive claims a message in the source queue, enqueues it into the destination with a
//! key naming the source message ([`Command::MoveKey`](super::Command::MoveKey) just before
//! the `Enqueue`, in one submission), acknowledges the claim in the source, then tells the
//! destination to forget the key ([`Command::ForgetMoveKey`](super::Command::ForgetMoveKey)).
//! Interrupted anywhere (kill -9, a leader change), the message is in the source or in the
//! destination or, between the enqueue and the source's ack, in both with its key remembered
//! by the destination: the next redrive enqueues it again, the destination drops it as a
//! duplicate ([`Reply::Duplicate`](super::Reply::Duplicate)), and the source's copy is
//! acknowledged. So it ends in the destination once.
//!
//! Keys are remembered whatever the queue's deduplication settings (a redrive does not
//! depend on them), at most [`MOVE_KEYS_MAX`], the oldest forgotten first; a key lives from
//! its enqueue to its forget, so only interrupted moves keep keys for long. The window is
//! machine state (a quorum queue replicates it); a queue on the local store keeps each key
//! in the store with its message, and every key forgotten is an
//! [`Effect::KeyForgotten`](super::Effect::KeyForgotten) for the driver to delete there.
//!
//! Invariants: `by_key` and `by_seq` hold the same keys, each once, with the same sequence
//! number; at most [`MOVE_KEYS_MAX`] keys.

use std::collections::BTreeMap;

use super::command::{Effect, KeyKind};
use super::{MessageRef, QueueMachine};

/// Most move keys a queue remembers (in-flight moves are a redrive's batch, at most
/// a few hundred; the rest are interrupted moves). Tests use a small window, so that
/// every machine test checking invariants on each command stays quick.
pub const MOVE_KEYS_MAX: usize = if cfg!(test) { 64 } else { 10_000 };
/// Longest move key accepted; a longer one is not remembered (the enqueue goes ahead).
pub const MOVE_KEY_MAX: usize = 1_024;

/// The remembered move keys.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct MoveKeys {
    /// Key -> the order it was remembered in.
    by_key: BTreeMap<Vec<u8>, u64>,
    /// Order -> key, oldest first.
    by_seq: BTreeMap<u64, Vec<u8>>,
    next_seq: u64,
    /// The key the next `Enqueue` carries.
    pending: Option<Vec<u8>>,
}

impl MoveKeys {
    pub(super) fn len(&self) -> usize {
        self.by_key.len()
    }

    pub(super) fn contains(&self, key: &[u8]) -> bool {
        self.by_key.contains_key(key)
    }

    fn remember<M>(&mut self, key: Vec<u8>, effects: &mut Vec<Effect<M>>) {
        if self.by_key.contains_key(&key) {
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.by_key.insert(key.clone(), seq);
        self.by_seq.insert(seq, key);
        while self.by_key.len() > MOVE_KEYS_MAX {
            let Some((_, oldest)) = self.by_seq.pop_first() else {
                break;
            };
            self.by_key.remove(&oldest);
            effects.push(Effect::KeyForgotten {
                kind: KeyKind::Move,
                key: oldest,
            });
        }
    }

    fn forget(&mut self, key: &[u8]) -> bool {
        match self.by_key.remove(key) {
            Some(seq) => {
                self.by_seq.remove(&seq);
                true
            }
            None => false,
        }
    }

    /// Checks the module's invariants.
    pub(super) fn check(&self) {
        assert_eq!(
            self.by_key.len(),
            self.by_seq.len(),
            "each key indexed once"
        );
        assert!(self.by_key.len() <= MOVE_KEYS_MAX, "the window is bounded");
        for (key, seq) in &self.by_key {
            assert_eq!(self.by_seq.get(seq), Some(key), "both indexes agree");
            assert!(*seq < self.next_seq, "sequence numbers were handed out");
        }
    }
}

impl<M: MessageRef> QueueMachine<M> {
    /// Move keys remembered.
    #[must_use]
    pub fn move_keys_len(&self) -> usize {
        self.work.moves.len()
    }

    /// Whether an `Enqueue` carrying move key `key` now would be dropped as a duplicate
    /// (lets a driver skip storing it).
    #[must_use]
    pub fn would_refuse_move(&self, key: &[u8]) -> bool {
        self.work.moves.contains(key)
    }

    /// The next `Enqueue` carries move key `key` (one too long is ignored).
    pub(super) fn set_pending_move(&mut self, key: Vec<u8>) {
        self.work.moves.pending = (key.len() <= MOVE_KEY_MAX).then_some(key);
    }

    /// The pending move key of the `Enqueue` being applied: whether it is a duplicate (the
    /// message is then dropped), else the key to remember once the message is taken.
    pub(super) fn take_pending_move(&mut self) -> (bool, Option<Vec<u8>>) {
        match self.work.moves.pending.take() {
            Some(key) if self.work.moves.contains(&key) => {
                self.work.counters.moves_refused += 1;
                (true, None)
            }
            key => (false, key),
        }
    }

    /// Remember the move key of a message the queue took.
    pub(super) fn remember_move(&mut self, key: Vec<u8>, effects: &mut Vec<Effect<M>>) {
        self.work.moves.remember(key, effects);
    }

    /// Forget move keys (their moves finished); unknown ones are passed over.
    pub(super) fn forget_moves(&mut self, keys: Vec<Vec<u8>>, effects: &mut Vec<Effect<M>>) {
        for key in keys {
            if self.work.moves.forget(&key) {
                effects.push(Effect::KeyForgotten {
                    kind: KeyKind::Move,
                    key,
                });
            }
        }
    }
}
