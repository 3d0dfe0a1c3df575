//! Streams with lapin against the real binary: replay with offsets and filtering, ack as
//! credit, and what survives a kill -9 (every confirmed message, at its offset; a named
//! consumer's saved position).
#![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

use lapin::options::*;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString};
use lapin::{BasicProperties, Channel};
use warren_compat_tests::Broker;
use warren_compat_tests::client::{self, WAIT, confirm_channel, connect, next};

fn stream_args() -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("stream")),
    );
    t
}

async fn declare_stream(ch: &Channel, name: &str) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        stream_args(),
    )
    .await
    .expect("declare stream");
}

/// Publish `bodies` (each confirmed), with `x-stream-filter-value` when given.
async fn publish_all(ch: &Channel, stream: &str, bodies: &[(String, Option<&str>)]) {
    for (body, value) in bodies {
        let mut props = BasicProperties::default();
        if let Some(v) = value {
            let mut h = FieldTable::default();
            h.insert(
                "x-stream-filter-value".into(),
                AMQPValue::LongString(LongString::from(*v)),
            );
            props = props.with_headers(h);
        }
        client::publish(ch, "", stream, body.as_bytes(), props).await;
    }
}

/// Consume `n` deliveries with `arguments` and prefetch `prefetch`, acking each; returns
/// (offset, body).
async fn read(
    ch: &Channel,
    stream: &str,
    n: usize,
    arguments: FieldTable,
    prefetch: u16,
) -> Vec<(i64, String)> {
    ch.basic_qos(prefetch, BasicQosOptions::default())
        .await
        .unwrap();
    let tag = format!("reader-{}", rand_tag());
    let mut c = ch
        .basic_consume(
            stream.into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            arguments,
        )
        .await
        .expect("consume");
    let mut got = Vec::new();
    while got.len() < n {
        let d = next(&mut c).await;
        let offset = match d
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get("x-stream-offset").cloned())
        {
            Some(AMQPValue::LongLongInt(o)) => o,
            other => panic!("x-stream-offset header missing or mistyped: {other:?}"),
        };
        got.push((offset, String::from_utf8(d.data.clone()).unwrap()));
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    ch.basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
        .await
        .unwrap();
    got
}

fn rand_tag() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn offset_arg(v: AMQPValue) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert("x-stream-offset".into(), v);
    t
}

#[tokio::test]
async fn replay_offsets_and_filters() {
    //! Three readers replay the same stream independently; numeric and negative offsets
    //! start where they say; a filter delivers only its values.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    declare_stream(&ch, "events").await;
    let bodies: Vec<(String, Option<&str>)> = (0..30)
        .map(|i| (format!("e{i}"), Some(if i % 3 == 0 { "eu" } else { "us" })))
        .collect();
    publish_all(&ch, "events", &bodies).await;
    let want: Vec<(i64, String)> = (0..30).map(|i| (i, format!("e{i}"))).collect();
    for _ in 0..3 {
        let first = offset_arg(AMQPValue::LongString(LongString::from("first")));
        assert_eq!(read(&ch, "events", 30, first, 7).await, want);
    }
    let at = read(&ch, "events", 5, offset_arg(AMQPValue::LongLongInt(12)), 5).await;
    assert_eq!(at, want[12..17].to_vec());
    let tail = read(&ch, "events", 4, offset_arg(AMQPValue::LongLongInt(-4)), 5).await;
    assert_eq!(tail, want[26..].to_vec());
    let mut args = offset_arg(AMQPValue::LongString(LongString::from("first")));
    args.insert(
        "x-stream-filter".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString(
            LongString::from("eu"),
        )])),
    );
    let eu = read(&ch, "events", 10, args, 3).await;
    assert_eq!(
        eu,
        want.iter()
            .filter(|(o, _)| o % 3 == 0)
            .cloned()
            .collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn prefetch_bounds_unacked_deliveries() {
    //! Ack is credit: with prefetch 4 and no acks, exactly four deliveries arrive.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    declare_stream(&ch, "credit").await;
    let bodies: Vec<(String, Option<&str>)> = (0..20).map(|i| (format!("c{i}"), None)).collect();
    publish_all(&ch, "credit", &bodies).await;
    ch.basic_qos(4, BasicQosOptions::default()).await.unwrap();
    let mut c = ch
        .basic_consume(
            "credit".into(),
            "held".into(),
            BasicConsumeOptions::default(),
            offset_arg(AMQPValue::LongString(LongString::from("first"))),
        )
        .await
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(next(&mut c).await);
    }
    // A fifth would arrive at once if credit were not bounded: none within 300 ms.
    use futures_lite::StreamExt;
    let more = tokio::time::timeout(std::time::Duration::from_millis(300), c.next()).await;
    assert!(more.is_err(), "a delivery beyond the prefetch");
    held[3]
        .ack(BasicAckOptions { multiple: true })
        .await
        .unwrap();
    for i in 4..8 {
        assert_eq!(next(&mut c).await.data, format!("c{i}").as_bytes());
    }
}

#[tokio::test]
async fn confirmed_messages_and_saved_offsets_survive_kill9() {
    //! Every confirmed message is there after kill -9, at the offset it had; a named
    //! consumer whose position was saved resumes there.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    declare_stream(&ch, "ledger").await;
    let bodies: Vec<(String, Option<&str>)> = (0..200).map(|i| (format!("l{i}"), None)).collect();
    publish_all(&ch, "ledger", &bodies).await;
    let mut named = offset_arg(AMQPValue::LongString(LongString::from("first")));
    named.insert(
        "x-stream-consumer-name".into(),
        AMQPValue::LongString(LongString::from("posting")),
    );
    let got = read(&ch, "ledger", 50, named, 1).await;
    assert_eq!(got.last().unwrap().0, 49);
    // The position is saved within a second (the writer's tick): wait until the file holds
    // 50 (its one entry's offset is the 8 bytes before the checksum).
    let streams = b.data_dir().join("streams");
    let deadline = std::time::Instant::now() + WAIT;
    let saved_at = |p: std::path::PathBuf| -> Option<u64> {
        let bytes = std::fs::read(p).ok()?;
        let at = bytes.len().checked_sub(12)?;
        Some(u64::from_be_bytes(bytes[at..at + 8].try_into().ok()?))
    };
    loop {
        let saved = std::fs::read_dir(&streams)
            .into_iter()
            .flatten()
            .flatten()
            .find_map(|e| saved_at(e.path().join("offsets")));
        if saved == Some(50) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "offset never saved: {saved:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    drop(conn);
    let dir = b.kill9();
    let b = Broker::start_in(dir, &[]);
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    declare_stream(&ch, "ledger").await;
    let all = read(
        &ch,
        "ledger",
        200,
        offset_arg(AMQPValue::LongString(LongString::from("first"))),
        100,
    )
    .await;
    let want: Vec<(i64, String)> = (0..200).map(|i| (i, format!("l{i}"))).collect();
    assert_eq!(all, want);
    let mut resume = FieldTable::default();
    resume.insert(
        "x-stream-consumer-name".into(),
        AMQPValue::LongString(LongString::from("posting")),
    );
    let next_one = read(&ch, "ledger", 1, resume, 1).await;
    assert_eq!(next_one, vec![(50, "l50".to_string())]);
}

#[tokio::test]
async fn declare_rules_and_refused_methods() {
    //! RabbitMQ's rules: a stream must be durable (406 closes the channel); basic.get is
    //! refused with 540, which closes the connection.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = conn.create_channel().await.unwrap();
    let e = ch
        .queue_declare(
            "transient".into(),
            QueueDeclareOptions::default(),
            stream_args(),
        )
        .await
        .expect_err("a non-durable stream is refused");
    assert!(
        e.to_string().contains("invalid property 'non-durable'"),
        "{e}"
    );
    let ch = conn.create_channel().await.unwrap();
    declare_stream(&ch, "rules").await;
    let e = ch
        .basic_get("rules".into(), BasicGetOptions::default())
        .await
        .expect_err("basic.get is refused");
    assert!(
        e.to_string()
            .contains("basic.get not supported by stream queues"),
        "{e}"
    );
}

#[tokio::test]
async fn size_retention_drops_whole_old_segments() {
    //! With 2000-byte segments and 6000 bytes kept, the oldest segments go as the stream
    //! grows: a reader from `first` starts well past offset 0, and what it reads is the
    //! newest messages, contiguous to the end.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    let mut args = stream_args();
    args.insert(
        "x-stream-max-segment-size-bytes".into(),
        AMQPValue::LongLongInt(2000),
    );
    args.insert("x-max-length-bytes".into(), AMQPValue::LongLongInt(6000));
    ch.queue_declare(
        "bounded".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    let bodies: Vec<(String, Option<&str>)> =
        (0..100).map(|i| (format!("{i:0>200}"), None)).collect();
    publish_all(&ch, "bounded", &bodies).await;
    let first = read(
        &ch,
        "bounded",
        1,
        offset_arg(AMQPValue::LongString(LongString::from("first"))),
        1,
    )
    .await;
    let start = first[0].0;
    assert!(
        start > 50,
        "the oldest segments were kept: first offset {start}"
    );
    let rest = read(
        &ch,
        "bounded",
        usize::try_from(100 - start).unwrap(),
        offset_arg(AMQPValue::LongString(LongString::from("first"))),
        100,
    )
    .await;
    let want: Vec<(i64, String)> = (start..100).map(|i| (i, format!("{i:0>200}"))).collect();
    assert_eq!(rest, want);
}
