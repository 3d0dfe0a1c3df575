//! The stream queue against real files: ordering under concurrency, offset tracking, replicas
//! applying entries and snapshots.

use super::*;
use amq_protocol::types::AMQPValue;

/// A stream queue with no broker around it, its files in `dir` (a replica: no writer).
fn stream_queue(dir: &Path, replica: bool) -> Arc<Queue> {
    let args = crate::args::table(&[("x-queue-type", AMQPValue::LongString("stream".into()))]);
    let q = Queue::new(
        1,
        "s",
        "/",
        true,
        false,
        None,
        args,
        crate::queue::QueueEnv::default(),
    );
    if replica {
        q.open_stream_replica(dir).expect("open");
    } else {
        q.open_stream(dir, 16).expect("open");
    }
    q
}

/// A message with no properties and `body`.
fn message(body: impl Into<Bytes>) -> Message {
    Message {
        exchange: String::new(),
        routing_key: "s".into(),
        properties: Properties::parse(Bytes::from_static(&[0, 0]), 16).expect("props"),
        body: body.into(),
    }
}

fn props(headers: Option<&[(&str, AMQPValue)]>) -> Properties {
    // flags: headers present (bit 13) or nothing; then the table.
    let mut raw = Vec::new();
    match headers {
        Some(h) => {
            raw.extend_from_slice(&(1u16 << 13).to_be_bytes());
            raw.extend_from_slice(&warren_amqp::table::encode_table(&crate::args::table(h)));
        }
        None => raw.extend_from_slice(&0u16.to_be_bytes()),
    }
    Properties::parse(Bytes::from(raw), 16).expect("parse")
}

#[test]
fn a_record_decodes_to_the_message_with_its_offset_header() {
    for headers in [
        None,
        Some(&[("x-stream-filter-value", AMQPValue::LongString("ca".into()))][..]),
    ] {
        let m = Message {
            exchange: "ex".into(),
            routing_key: "rk".into(),
            properties: props(headers),
            body: Bytes::from_static(b"hello"),
        };
        assert_eq!(
            filter_value(&m.properties).as_deref(),
            headers.map(|_| "ca")
        );
        let record = encode(&m);
        let back = decode(&record, 42, 16).expect("decodes");
        assert_eq!(
            (back.exchange.as_str(), back.routing_key.as_str()),
            ("ex", "rk")
        );
        assert_eq!(&back.body[..], b"hello");
        let h = back.properties.headers().expect("headers");
        assert_eq!(
            h.inner().get("x-stream-offset"),
            Some(&AMQPValue::LongLongInt(42))
        );
        if headers.is_some() {
            assert!(h.inner().contains_key("x-stream-filter-value"));
        }
        // A damaged record is refused, never read past its end.
        for cut in [0, 1, 3, 7] {
            assert!(decode(&record.slice(..cut), 0, 16).is_none(), "cut {cut}");
        }
    }
}

/// Run `f` to completion on this thread (for the outbox's notification).
fn block_on<F: std::future::Future>(f: F, deadline: std::time::Instant) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        assert!(!left.is_zero(), "no wake-up in time: a reader stalled");
        std::thread::park_timeout(left);
    }
}

/// Publishers on three threads and consumers attached before and during the publishing:
/// every consumer gets every offset once, in order, within its credit, each message
/// carrying its own offset; none stalls (the park / wake hand-off loses no append).
#[test]
fn concurrent_publishers_and_consumers_see_every_offset_once_in_order() {
    const PER_PUBLISHER: u64 = 300;
    let dir = tempfile::tempdir().expect("tempdir");
    let q = stream_queue(dir.path(), false);
    let stream = Arc::clone(q.stream().expect("opened"));
    let outbox = Arc::new(crate::queue::outbox::Outbox::default());
    let first = crate::args::table(&[("x-stream-offset", AMQPValue::LongString("first".into()))]);
    let attach = |id: ConsumerId, prefetch: u16| {
        let spec = crate::stream::reader::consume_spec(&first, prefetch, false, "s").expect("spec");
        let sink = ConsumerSink {
            outbox: Arc::clone(&outbox),
            channel: 1,
            limiter: None,
        };
        stream
            .consume(id, &spec, prefetch, sink, 0)
            .expect("consume");
    };
    attach(1, 5);
    attach(2, 50);
    let publishers: Vec<_> = (0..3)
        .map(|p| {
            let stream = Arc::clone(&stream);
            std::thread::spawn(move || {
                for k in 0..PER_PUBLISHER {
                    let m = message(format!("p{p}-{k}"));
                    stream.append(&m, Box::new(|r| assert!(r.is_ok())));
                }
            })
        })
        .collect();
    let total = 3 * PER_PUBLISHER;
    let mut got: HashMap<ConsumerId, Vec<u64>> = HashMap::new();
    let mut items = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut late_attached = false;
    while got.values().map(Vec::len).sum::<usize>() < 3 * total as usize || got.len() < 3 {
        if !late_attached && got.get(&1).is_some_and(|g| g.len() > 100) {
            attach(3, 1);
            late_attached = true;
        }
        outbox.drain(&mut items);
        if items.is_empty() {
            block_on(outbox.notified(), deadline);
            continue;
        }
        for item in items.drain(..) {
            let Outbound::StreamReady { consumer, .. } = item else {
                panic!("only wake-ups are pushed");
            };
            for d in stream.pump(consumer) {
                let Outgoing::Mem(m) = &d.message else {
                    panic!("stream deliveries are in memory");
                };
                let h = m.properties.headers().expect("headers");
                assert_eq!(
                    h.inner().get("x-stream-offset"),
                    Some(&AMQPValue::LongLongInt(
                        i64::try_from(d.id).expect("offset")
                    ))
                );
                got.entry(consumer).or_default().push(d.id);
                stream.settle(consumer, &[d.id]);
            }
        }
    }
    for p in publishers {
        p.join().expect("publisher");
    }
    for (consumer, offsets) in &got {
        assert_eq!(
            offsets,
            &(0..total).collect::<Vec<_>>(),
            "consumer {consumer}"
        );
    }
    assert_eq!(stream.stats(0).messages, total);
    assert_eq!(stream.stats(0).unacked, 0);
}

/// A named consumer's tracked offset is its lowest unacked offset: acks out of order do
/// not skip, acks after its cancel still count, released deliveries never move it.
#[test]
fn tracked_offsets_never_pass_an_unacked_delivery() {
    let dir = tempfile::tempdir().expect("tempdir");
    let q = stream_queue(dir.path(), false);
    let stream = Arc::clone(q.stream().expect("opened"));
    let (tx, rx) = std::sync::mpsc::channel();
    for k in 0..10u8 {
        let m = message(vec![k]);
        let tx = tx.clone();
        stream.append(&m, Box::new(move |r| tx.send(r.is_ok()).expect("send")));
    }
    assert!(rx.iter().take(10).all(|ok| ok));
    let outbox = Arc::new(crate::queue::outbox::Outbox::default());
    let args = crate::args::table(&[
        ("x-stream-offset", AMQPValue::LongString("first".into())),
        ("x-stream-consumer-name", AMQPValue::LongString("c".into())),
    ]);
    let spec = crate::stream::reader::consume_spec(&args, 5, false, "s").expect("spec");
    let sink = ConsumerSink {
        outbox: Arc::clone(&outbox),
        channel: 1,
        limiter: None,
    };
    stream.consume(7, &spec, 5, sink, 0).expect("consume");
    let got: Vec<u64> = stream.pump(7).iter().map(|d| d.id).collect();
    assert_eq!(got, vec![0, 1, 2, 3, 4]);
    let tracked = || stream.stats(0).tracked.first().map(|t| t.offset);
    stream.settle(7, &[1, 2]);
    assert_eq!(tracked(), Some(0), "0 is still unacked");
    stream.settle(7, &[0]);
    assert_eq!(tracked(), Some(3));
    stream.cancel(7);
    stream.release(7, &[4]);
    assert_eq!(tracked(), Some(3), "a released delivery moves nothing");
    stream.settle(7, &[3]);
    assert_eq!(
        tracked(),
        Some(4),
        "an ack after the cancel counts, up to the released 4"
    );
    stream.settle(7, &[3]);
    assert_eq!(tracked(), Some(4));
}

/// A replica appends each committed entry as one chunk at the entry's time; after a
/// restart the log replays from its start and what the files already hold is skipped,
/// so offsets stay as every member has them.
#[test]
fn a_replica_applies_entries_once_across_a_replay() {
    use crate::message::Entry;
    use crate::queue::machine::Command;
    let dir = tempfile::tempdir().expect("tempdir");
    let entry = |k: u64| {
        (0..3)
            .map(|i| Command::Enqueue(Entry::Mem(Arc::new(message(format!("e{k}-{i}"))))))
            .chain([Command::Cancel(9)])
            .collect::<Vec<_>>()
    };
    let open = || stream_queue(dir.path(), true);
    let q = open();
    for k in 0..4 {
        let replies = q.apply_committed(1000 + k, entry(k));
        assert_eq!(replies.len(), 4, "one reply per command");
    }
    let stream = Arc::clone(q.stream().expect("opened"));
    assert_eq!(stream.stats(0).next_offset, 12);
    // A replicated tracked offset lands in the log of every member.
    q.apply_committed(
        1004,
        vec![Command::TrackOffset {
            name: "c".into(),
            next: 5,
        }],
    );
    assert_eq!(
        stream
            .stats(0)
            .tracked
            .first()
            .map(|t| (t.name.as_str(), t.offset)),
        Some(("c", 5))
    );
    let chunks: Vec<(u64, u64)> = stream
        .shared
        .disk
        .lock()
        .log()
        .chunks()
        .map(|(_, c)| (c.first, c.timestamp_ms))
        .collect();
    assert_eq!(chunks, vec![(0, 1000), (3, 1001), (6, 1002), (9, 1003)]);
    drop(stream);
    drop(q);
    // Restart: the whole log replays, then one more entry.
    let q = open();
    for k in 0..5 {
        q.apply_committed(1000 + k, entry(k));
    }
    let stream = Arc::clone(q.stream().expect("opened"));
    assert_eq!(stream.stats(0).next_offset, 15);
    let (first, messages) = stream
        .shared
        .disk
        .lock()
        .read_chunk(12)
        .expect("read")
        .expect("held");
    assert_eq!(first, 12);
    let m = decode(&messages[1].body, 13, 16).expect("decodes");
    assert_eq!(&m.body[..], b"e4-1");
}

/// A member behind the leader's purged log installs the leader's snapshot with its
/// chunks: it appends what its files lack (from empty, or continuing a prefix), keeps
/// the chunks' times, and goes on applying entries after it at the same offsets.
#[test]
fn a_sent_snapshot_brings_a_member_to_the_same_chunks() {
    use crate::message::Entry;
    use crate::queue::machine::Command;
    let entry = |k: u64| {
        (0..3)
            .map(|i| Command::Enqueue(Entry::Mem(Arc::new(message(format!("e{k}-{i}"))))))
            .collect::<Vec<_>>()
    };
    let chunks = |q: &Arc<Queue>| -> Vec<(u64, u64)> {
        let s = q.stream().expect("opened");
        s.shared
            .disk
            .lock()
            .log()
            .chunks()
            .map(|(_, c)| (c.first, c.timestamp_ms))
            .collect()
    };
    let (da, db, dc) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    let (a, b, c) = (
        stream_queue(da.path(), true),
        stream_queue(db.path(), true),
        stream_queue(dc.path(), true),
    );
    for k in 0..5 {
        a.apply_committed(1000 + k, entry(k));
    }
    for k in 0..2 {
        c.apply_committed(1000 + k, entry(k));
    }
    let sa = a.stream().expect("opened");
    let kept = sa.snapshot().expect("snapshot");
    assert_eq!((kept.next, kept.chunks.is_none()), (15, true));
    let sent = sa.expand(kept).expect("expand");
    assert_eq!(sent.chunks.as_ref().map(Vec::len), Some(5));
    for q in [&b, &c] {
        q.stream()
            .expect("opened")
            .install(sent.clone())
            .expect("install");
        assert_eq!(chunks(q), chunks(&a));
        q.apply_committed(1005, entry(5));
    }
    a.apply_committed(1005, entry(5));
    assert_eq!(chunks(&b), chunks(&a));
    assert_eq!(chunks(&c), chunks(&a));
    assert_eq!(b.stream().expect("opened").stats(0).next_offset, 18);
}

/// A snapshot whose data is gone (the sender's retention dropped it) still leaves the
/// member at the snapshot's end, also after a restart, so later offsets agree.
#[test]
fn a_snapshot_without_its_chunks_restarts_the_files_at_its_end() {
    use crate::message::Entry;
    use crate::queue::machine::Command;
    let dir = tempfile::tempdir().expect("tempdir");
    let q = stream_queue(dir.path(), true);
    q.apply_committed(
        1000,
        vec![Command::Enqueue(Entry::Mem(Arc::new(message("old"))))],
    );
    let snapshot = StreamSnapshot {
        next: 15,
        offsets: vec![("c".into(), 12)],
        chunks: Some(Vec::new()),
    };
    q.stream()
        .expect("opened")
        .install(snapshot)
        .expect("install");
    assert_eq!(q.stream().expect("opened").stats(0).next_offset, 15);
    drop(q);
    let q = stream_queue(dir.path(), true);
    let s = Arc::clone(q.stream().expect("opened"));
    assert_eq!((s.stats(0).first_offset, s.stats(0).next_offset), (15, 15));
    // After a restart the log replays from the snapshot: its end is where entries go.
    s.install(StreamSnapshot {
        next: 15,
        offsets: Vec::new(),
        chunks: None,
    })
    .expect("install");
    q.apply_committed(
        1001,
        vec![Command::Enqueue(Entry::Mem(Arc::new(message("new"))))],
    );
    assert_eq!(s.stats(0).next_offset, 16);
    let (first, m) = s
        .shared
        .disk
        .lock()
        .read_chunk(15)
        .expect("read")
        .expect("held");
    assert_eq!(first, 15);
    assert_eq!(
        &decode(&m[0].body, 15, 16).expect("decodes").body[..],
        b"new"
    );
}
