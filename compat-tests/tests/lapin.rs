//! lapin against the real binary over TCP: each test says what it proves.
#![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, ExchangeKind};
use warren_compat_tests::Broker;
use warren_compat_tests::client::{
    self, WAIT, bind, confirm_channel, connect, consume, message_count, next,
};

async fn declare(ch: &Channel, name: &str) {
    client::queue(ch, name, false).await;
}

async fn publish(ch: &Channel, exchange: &str, rk: &str, body: &[u8]) {
    client::publish(ch, exchange, rk, body, BasicProperties::default()).await;
}

#[tokio::test]
async fn publish_confirm_consume_ack_round_trip() {
    //! A confirmed publish reaches a consumer byte-exact and the ack empties the queue.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    declare(&ch, "rt").await;
    let confirm = ch
        .basic_publish(
            "".into(),
            "rt".into(),
            BasicPublishOptions::default(),
            b"hello",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack());
    let mut consumer = consume(&ch, "rt", "c1", false).await;
    let d = next(&mut consumer).await;
    assert_eq!(d.data, b"hello");
    assert!(!d.redelivered);
    d.ack(BasicAckOptions::default()).await.unwrap();
    ch.basic_cancel("c1".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    let q = ch
        .queue_declare(
            "rt".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!((q.message_count(), q.consumer_count()), (0, 0));
}

#[tokio::test]
async fn properties_headers_and_large_bodies_round_trip() {
    //! Every basic property, a header table of many types and a 5 MB multi-frame body survive.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    declare(&ch, "props").await;
    let mut headers = FieldTable::default();
    headers.insert("s".into(), AMQPValue::LongString(LongString::from("text")));
    headers.insert("i".into(), AMQPValue::LongInt(-7));
    headers.insert("l".into(), AMQPValue::LongLongInt(1 << 40));
    headers.insert("b".into(), AMQPValue::Boolean(true));
    headers.insert("d".into(), AMQPValue::Double(1.5));
    headers.insert("t".into(), AMQPValue::Timestamp(1_700_000_000));
    headers.insert("x".into(), AMQPValue::ByteArray(vec![0u8, 255, 1].into()));
    let mut nested = FieldTable::default();
    nested.insert(
        "k".into(),
        AMQPValue::FieldArray(vec![AMQPValue::ShortShortInt(1), AMQPValue::Void].into()),
    );
    headers.insert("n".into(), AMQPValue::FieldTable(nested));
    let props = BasicProperties::default()
        .with_content_type(ShortString::from("application/octet-stream"))
        .with_content_encoding(ShortString::from("identity"))
        .with_headers(headers)
        .with_delivery_mode(2)
        .with_priority(3)
        .with_correlation_id(ShortString::from("corr"))
        .with_reply_to(ShortString::from("replies"))
        .with_expiration(ShortString::from("60000"))
        .with_message_id(ShortString::from("m-1"))
        .with_timestamp(1_700_000_001)
        .with_type(ShortString::from("kind"))
        .with_user_id(ShortString::from("guest"))
        .with_app_id(ShortString::from("app"));
    let body: Vec<u8> = (0..5 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    ch.basic_publish(
        "".into(),
        "props".into(),
        BasicPublishOptions::default(),
        &body,
        props.clone(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let got = tokio::time::timeout(
        WAIT,
        ch.basic_get("props".into(), BasicGetOptions { no_ack: true }),
    )
    .await
    .unwrap()
    .unwrap()
    .expect("a message");
    assert_eq!(got.delivery.data.len(), body.len());
    assert!(got.delivery.data == body, "body differs");
    assert_eq!(got.delivery.properties, props);
}

#[tokio::test]
async fn round_robin_within_prefetch() {
    //! Two consumers with prefetch 1 share messages in turn and get nothing more until they ack.
    let b = Broker::start();
    let conn = connect(&b).await;
    let pch = confirm_channel(&conn).await;
    declare(&pch, "rr").await;
    let c1 = conn.create_channel().await.unwrap();
    let c2 = conn.create_channel().await.unwrap();
    c1.basic_qos(1, BasicQosOptions::default()).await.unwrap();
    c2.basic_qos(1, BasicQosOptions::default()).await.unwrap();
    let mut s1 = consume(&c1, "rr", "a", false).await;
    let mut s2 = consume(&c2, "rr", "b", false).await;
    for i in 0..4u8 {
        publish(&pch, "", "rr", &[i]).await;
    }
    let d1 = next(&mut s1).await;
    let d2 = next(&mut s2).await;
    let mut firsts = vec![d1.data[0], d2.data[0]];
    firsts.sort_unstable();
    assert_eq!(firsts, vec![0, 1]);
    // Within prefetch 1 nothing more arrives before the acks.
    assert_eq!(message_count(&pch, "rr").await, 2);
    d1.ack(BasicAckOptions::default()).await.unwrap();
    d2.ack(BasicAckOptions::default()).await.unwrap();
    let mut rest = vec![next(&mut s1).await.data[0], next(&mut s2).await.data[0]];
    rest.sort_unstable();
    assert_eq!(rest, vec![2, 3]);
}

#[tokio::test]
async fn unacked_messages_return_in_order_when_channel_closes() {
    //! Closing a channel requeues its unacked deliveries in original order, marked redelivered.
    let b = Broker::start();
    let conn = connect(&b).await;
    let pch = confirm_channel(&conn).await;
    declare(&pch, "requeue").await;
    for i in 0..5u8 {
        publish(&pch, "", "requeue", &[i]).await;
    }
    let cch = conn.create_channel().await.unwrap();
    let mut s = consume(&cch, "requeue", "c", false).await;
    for i in 0..5u8 {
        assert_eq!(next(&mut s).await.data, vec![i]);
    }
    cch.close(200, "bye".into()).await.unwrap();
    let cch2 = conn.create_channel().await.unwrap();
    let mut s2 = consume(&cch2, "requeue", "c", true).await;
    for i in 0..5u8 {
        let d = next(&mut s2).await;
        assert_eq!(d.data, vec![i]);
        assert!(d.redelivered);
    }
}

#[tokio::test]
async fn topic_and_fanout_routing_and_e2e_bindings() {
    //! Topic patterns, fanout and exchange-to-exchange bindings route to exactly the bound queues.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    for q in ["t-star", "t-hash", "f"] {
        declare(&ch, q).await;
    }
    bind(&ch, "t-star", "amq.topic", "a.*").await;
    bind(&ch, "t-hash", "amq.topic", "a.#").await;
    ch.exchange_declare(
        "fan".into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.exchange_bind(
        "fan".into(),
        "amq.topic".into(),
        "a.b".into(),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    bind(&ch, "f", "fan", "").await;
    publish(&ch, "amq.topic", "a.b", b"1").await;
    publish(&ch, "amq.topic", "a.b.c", b"2").await;
    publish(&ch, "amq.topic", "a", b"3").await;
    assert_eq!(message_count(&ch, "t-star").await, 1);
    assert_eq!(message_count(&ch, "t-hash").await, 3);
    assert_eq!(message_count(&ch, "f").await, 1);
}

#[tokio::test]
async fn mandatory_unroutable_is_returned_then_acked() {
    //! An unroutable mandatory publish comes back as basic.return (312) and is still confirmed.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    let confirm = ch
        .basic_publish(
            "".into(),
            "nowhere".into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"lost",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack());
    let returned = confirm.take_message().expect("returned message");
    assert_eq!(returned.reply_code, 312);
    assert_eq!(returned.reply_text.as_str(), "NO_ROUTE");
    assert_eq!(returned.delivery.data, b"lost");
}

#[tokio::test]
async fn channel_errors_close_only_the_channel() {
    //! A 404 on passive declare closes that channel; the connection and other channels go on.
    let b = Broker::start();
    let conn = connect(&b).await;
    let bad = conn.create_channel().await.unwrap();
    let err = bad
        .queue_declare(
            "missing".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert!(format!("{err:?}").contains("NOT_FOUND"), "{err:?}");
    let good = conn.create_channel().await.unwrap();
    declare(&good, "still-ok").await;
    assert!(conn.status().connected());
}

#[tokio::test]
async fn transactions_commit_and_rollback() {
    //! Publishes in a transaction are invisible until commit; rolled-back ones never arrive.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = conn.create_channel().await.unwrap();
    declare(&ch, "tx").await;
    ch.tx_select().await.unwrap();
    ch.basic_publish(
        "".into(),
        "tx".into(),
        BasicPublishOptions::default(),
        b"a",
        BasicProperties::default(),
    )
    .await
    .unwrap();
    assert!(
        ch.basic_get("tx".into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .is_none()
    );
    ch.tx_commit().await.unwrap();
    ch.basic_publish(
        "".into(),
        "tx".into(),
        BasicPublishOptions::default(),
        b"b",
        BasicProperties::default(),
    )
    .await
    .unwrap();
    ch.tx_rollback().await.unwrap();
    let got = ch
        .basic_get("tx".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("committed message");
    assert_eq!(got.delivery.data, b"a");
    assert!(
        ch.basic_get("tx".into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn many_messages_flow_through_a_no_ack_consumer() {
    //! 20,000 messages pass through a no-ack consumer in order (exercises the consumer window).
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = conn.create_channel().await.unwrap();
    declare(&ch, "bulk").await;
    let cch = conn.create_channel().await.unwrap();
    let mut s = consume(&cch, "bulk", "c", true).await;
    let total = 20_000u32;
    let publisher = tokio::spawn({
        let ch = ch.clone();
        async move {
            for i in 0..total {
                ch.basic_publish(
                    "".into(),
                    "bulk".into(),
                    BasicPublishOptions::default(),
                    &i.to_be_bytes(),
                    BasicProperties::default(),
                )
                .await
                .unwrap();
            }
        }
    });
    for i in 0..total {
        let d = next(&mut s).await;
        assert_eq!(d.data, i.to_be_bytes());
    }
    publisher.await.unwrap();
}

#[tokio::test]
async fn graceful_shutdown_sends_connection_forced_and_exits_zero() {
    //! SIGTERM closes client connections with 320 CONNECTION_FORCED and the process exits 0.
    let b = Broker::start();
    let conn = connect(&b).await;
    let mut events = conn.events_listener();
    let code = tokio::task::spawn_blocking(move || b.terminate())
        .await
        .unwrap();
    assert_eq!(code, Some(0));
    let err = tokio::time::timeout(WAIT, async {
        loop {
            match events.next().await {
                Some(lapin::Event::Error(e)) => break format!("{e:?}"),
                Some(_) => continue,
                None => break "events ended without an error".to_string(),
            }
        }
    })
    .await
    .expect("error reported");
    assert!(
        err.contains("CONNECTION_FORCED") || err.contains("320"),
        "{err}"
    );
}
