//! Durability against the real binary: what must survive a restart or a kill -9 does, and what
//! must not does not (issue 3). Each test says what it proves.
#![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};
use warren_compat_tests::Broker;
use warren_compat_tests::client::{
    WAIT, bind, confirm_channel, connect, consume, message_count, publish, queue,
};

fn persistent() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

/// Everything in a queue, taken with no-ack basic.get: (body, redelivered).
async fn drain(ch: &Channel, queue: &str) -> Vec<(Vec<u8>, bool)> {
    let mut out = Vec::new();
    loop {
        let got = tokio::time::timeout(
            WAIT,
            ch.basic_get(queue.into(), BasicGetOptions { no_ack: true }),
        )
        .await
        .unwrap()
        .unwrap();
        match got {
            Some(m) => out.push((m.delivery.data, m.delivery.redelivered)),
            None => return out,
        }
    }
}

fn bodies(got: &[(Vec<u8>, bool)]) -> Vec<String> {
    got.iter()
        .map(|(b, _)| String::from_utf8_lossy(b).into_owned())
        .collect()
}

async fn exists(conn: &Connection, queue: &str) -> bool {
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .is_ok()
}

async fn exchange_exists(conn: &Connection, exchange: &str) -> bool {
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .is_ok()
}

/// Kill -9 or stop gracefully, then start again on the same data directory.
fn restart(b: Broker, kill: bool) -> Broker {
    let dir: PathBuf = if kill { b.kill9() } else { b.stop() };
    Broker::start_in(dir, &[])
}

#[tokio::test]
async fn confirmed_persistent_messages_survive_kill_9_in_order_and_nothing_else_does() {
    //! Confirmed persistent messages in a durable queue come back after kill -9, in order and
    //! marked redelivered; transient messages, non-durable queues and acked messages do not.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    queue(&ch, "dq", true).await;
    queue(&ch, "tq", false).await;
    for i in 0..20 {
        publish(&ch, "", "dq", format!("p{i}").as_bytes(), persistent()).await;
    }
    publish(&ch, "", "dq", b"transient", BasicProperties::default()).await;
    publish(&ch, "", "tq", b"in a transient queue", persistent()).await;
    // Ack the first two; a durable declare afterwards on the same connection returns only once
    // everything submitted before it is committed, so these acks are on disk.
    for _ in 0..2 {
        let m = ch
            .basic_get("dq".into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .unwrap();
        m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    queue(&ch, "barrier", true).await;
    drop(conn);

    let b = restart(b, true);
    let conn = connect(&b).await;
    let ch = conn.create_channel().await.unwrap();
    let got = drain(&ch, "dq").await;
    let expected: Vec<String> = (2..20).map(|i| format!("p{i}")).collect();
    assert_eq!(bodies(&got), expected);
    assert!(got.iter().all(|(_, redelivered)| *redelivered));
    assert!(
        !exists(&conn, "tq").await,
        "non-durable queues do not survive"
    );
    assert!(exists(&conn, "barrier").await);
}

#[tokio::test]
async fn unacked_messages_come_back_redelivered_after_a_graceful_restart() {
    //! Messages delivered but not acked when the broker stops are back in the queue, in their
    //! original order, with redelivered set; an ack made before the stop sticks.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    queue(&ch, "work", true).await;
    for i in 0..5 {
        publish(&ch, "", "work", format!("m{i}").as_bytes(), persistent()).await;
    }
    let mut consumer = consume(&ch, "work", "c", false).await;
    let mut tags = Vec::new();
    for _ in 0..5 {
        let d = tokio::time::timeout(WAIT, consumer.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        tags.push((d.delivery_tag, d.data));
    }
    ch.basic_ack(tags[1].0, BasicAckOptions::default())
        .await
        .unwrap();
    queue(&ch, "barrier", true).await;

    let b = restart(b, false);
    let conn = connect(&b).await;
    let ch = conn.create_channel().await.unwrap();
    let got = drain(&ch, "work").await;
    assert_eq!(bodies(&got), ["m0", "m2", "m3", "m4"]);
    assert!(got.iter().all(|(_, r)| *r));
}

#[tokio::test]
async fn durable_topology_survives_and_routes_after_kill_9() {
    //! Durable exchanges, queues and bindings (queue and exchange-to-exchange) come back and
    //! route; non-durable exchanges and exclusive queues do not; deleted and unbound objects
    //! stay deleted.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    for (name, kind) in [("dx", ExchangeKind::Direct), ("tx", ExchangeKind::Topic)] {
        ch.exchange_declare(name.into(), kind, durable, FieldTable::default())
            .await
            .unwrap();
    }
    ch.exchange_declare(
        "gone-x".into(),
        ExchangeKind::Fanout,
        durable,
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.exchange_declare(
        "transient-x".into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    for q in ["q1", "q2", "gone-q"] {
        queue(&ch, q, true).await;
    }
    bind(&ch, "q1", "dx", "k1").await;
    bind(&ch, "q1", "dx", "unbound").await;
    bind(&ch, "q2", "tx", "a.*").await;
    ch.exchange_bind(
        "tx".into(),
        "dx".into(),
        "a.x".into(),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_unbind(
        "q1".into(),
        "dx".into(),
        "unbound".into(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_delete("gone-q".into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    ch.exchange_delete("gone-x".into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    ch.queue_declare(
        "excl".into(),
        QueueDeclareOptions {
            durable: true,
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();

    let b = restart(b, true);
    let conn = connect(&b).await;
    assert!(
        exchange_exists(&conn, "dx").await
            && exists(&conn, "q1").await
            && exists(&conn, "q2").await
    );
    assert!(!exchange_exists(&conn, "gone-x").await && !exists(&conn, "gone-q").await);
    assert!(!exchange_exists(&conn, "transient-x").await);
    assert!(
        !exists(&conn, "excl").await,
        "exclusive queues do not survive"
    );
    let ch = confirm_channel(&conn).await;
    publish(&ch, "dx", "k1", b"direct", persistent()).await;
    publish(&ch, "dx", "unbound", b"nowhere", persistent()).await;
    publish(&ch, "tx", "a.b", b"topic", persistent()).await;
    // dx -> tx (exchange-to-exchange, key a.x) -> q2 (a.*): both hops came back.
    publish(&ch, "dx", "a.x", b"two hops", persistent()).await;
    assert_eq!(bodies(&drain(&ch, "q1").await), ["direct"]);
    assert_eq!(bodies(&drain(&ch, "q2").await), ["topic", "two hops"]);
}

#[tokio::test]
async fn fanout_to_durable_queues_is_stored_once_and_settled_per_queue() {
    //! One persistent publish to three durable queues survives in each; acking it in one queue
    //! leaves it in the others; a purge and a delete are durable too.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    ch.exchange_declare(
        "fan".into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    for q in ["f1", "f2", "f3", "purged"] {
        queue(&ch, q, true).await;
        bind(&ch, q, "fan", "").await;
    }
    publish(&ch, "fan", "", b"everyone", persistent()).await;
    let m = ch
        .basic_get("f1".into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .unwrap();
    m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    ch.queue_purge("purged".into(), QueuePurgeOptions::default())
        .await
        .unwrap();

    let b = restart(b, true);
    let conn = connect(&b).await;
    let ch = conn.create_channel().await.unwrap();
    assert!(drain(&ch, "f1").await.is_empty());
    assert_eq!(bodies(&drain(&ch, "f2").await), ["everyone"]);
    assert_eq!(bodies(&drain(&ch, "f3").await), ["everyone"]);
    assert!(drain(&ch, "purged").await.is_empty());
}

#[tokio::test]
async fn committed_transactions_survive_and_rolled_back_ones_do_not() {
    //! tx.commit-ok means the transaction's persistent messages and acks are on disk.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = conn.create_channel().await.unwrap();
    queue(&ch, "txq", true).await;
    ch.tx_select().await.unwrap();
    let send = |body: &'static [u8]| {
        ch.basic_publish(
            "".into(),
            "txq".into(),
            BasicPublishOptions::default(),
            body,
            persistent(),
        )
    };
    send(b"committed").await.unwrap();
    send(b"acked in a transaction").await.unwrap();
    ch.tx_commit().await.unwrap();
    send(b"rolled back").await.unwrap();
    ch.tx_rollback().await.unwrap();
    // An ack-only transaction: commit-ok means the ack is on disk.
    let m = ch
        .basic_get("txq".into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .unwrap();
    let m2 = ch
        .basic_get("txq".into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(m2.delivery.data, b"acked in a transaction");
    ch.basic_ack(m2.delivery.delivery_tag, BasicAckOptions::default())
        .await
        .unwrap();
    ch.tx_commit().await.unwrap();
    drop(m);

    let b = restart(b, true);
    let conn = connect(&b).await;
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(bodies(&drain(&ch, "txq").await), ["committed"]);
}

#[tokio::test]
async fn a_long_durable_queue_delivers_bodies_read_back_from_the_store() {
    //! 24 MiB of persistent messages (beyond the 8 MiB a queue keeps in memory at its head)
    //! are delivered intact and in order, before and after a restart, and requeued ones too.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    queue(&ch, "long", true).await;
    let body = |i: u32| -> Vec<u8> {
        let mut v = vec![(i % 251) as u8; 8 * 1024];
        v[..4].copy_from_slice(&i.to_be_bytes());
        v
    };
    for i in 0..3000u32 {
        publish(&ch, "", "long", &body(i), persistent()).await;
    }
    // Take the first 1000 with acks, return 10 of them.
    let get = conn.create_channel().await.unwrap();
    for i in 0..1000u32 {
        let m = get
            .basic_get("long".into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .unwrap();
        assert!(m.delivery.data == body(i), "message {i} intact");
        if i < 990 {
            m.delivery.ack(BasicAckOptions::default()).await.unwrap();
        }
    }
    get.basic_nack(
        0,
        BasicNackOptions {
            multiple: true,
            requeue: true,
        },
    )
    .await
    .unwrap();
    queue(&get, "barrier", true).await;
    let b = restart(b, true);
    let conn = connect(&b).await;
    let ch = conn.create_channel().await.unwrap();
    let got = drain(&ch, "long").await;
    assert_eq!(got.len(), 2010);
    for (n, (data, _)) in got.iter().enumerate() {
        let i = u32::try_from(n).unwrap() + 990;
        let first = u32::from_be_bytes(data[..4].try_into().unwrap());
        assert!(
            *data == body(i),
            "message {i} intact after restart (got {first}, len {})",
            data.len()
        );
    }
}

#[tokio::test]
async fn a_no_ack_consumer_drains_recovered_messages_across_deleted_segments() {
    //! After a restart every message exists only in the store. A no-ack consumer settles each
    //! one as it is handed over, so segments are deleted while the consumer drains: every body
    //! must still arrive intact and in order. (Deliveries hold their segment open from the
    //! moment they are chosen, so the race with the deletion cannot lose one.)
    let dir = std::env::temp_dir().join(format!("warren-noack-{}", std::process::id()));
    let small = ["--store-segment-bytes", "65536"];
    let b = Broker::start_in(dir.clone(), &small);
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    queue(&ch, "noack", true).await;
    let body = |i: u32| -> Vec<u8> {
        let mut v = vec![(i % 13) as u8; 1024];
        v[..4].copy_from_slice(&i.to_be_bytes());
        v
    };
    for i in 0..2000u32 {
        publish(&ch, "", "noack", &body(i), persistent()).await;
    }
    let dir = b.kill9();
    let b = Broker::start_in(dir, &small);
    let conn = connect(&b).await;
    let ch = conn.create_channel().await.unwrap();
    let mut consumer = consume(&ch, "noack", "c", true).await;
    for i in 0..2000u32 {
        let d = tokio::time::timeout(WAIT, consumer.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(d.data == body(i), "message {i} intact");
    }
}

#[tokio::test]
async fn priorities_and_length_limits_survive_a_restart() {
    //! A durable priority queue comes back with its priority order (kept in the store's index)
    //! and its declared limits still apply.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    let mut args = FieldTable::default();
    args.insert("x-max-priority".into(), lapin::types::AMQPValue::LongInt(5));
    args.insert("x-max-length".into(), lapin::types::AMQPValue::LongInt(4));
    ch.queue_declare(
        "prio".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    for (body, priority) in [("low", 1u8), ("high", 5), ("mid", 3), ("high2", 5)] {
        publish(
            &ch,
            "",
            "prio",
            body.as_bytes(),
            persistent().with_priority(priority),
        )
        .await;
    }
    let b = restart(b, true);
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    // The limit still holds after the restart: one more drops the head (highest first).
    publish(&ch, "", "prio", b"zero", persistent()).await;
    assert_eq!(
        bodies(&drain(&ch, "prio").await),
        ["high2", "mid", "low", "zero"]
    );
}

#[tokio::test]
async fn message_ttls_keep_running_across_a_restart() {
    //! A persistent message's expiry is stored with it: after a kill -9 it still expires at its
    //! original time (its own `expiration` included), while the message without one stays.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    queue(&ch, "ttl", true).await;
    publish(
        &ch,
        "",
        "ttl",
        b"short",
        persistent().with_expiration("1500".into()),
    )
    .await;
    publish(&ch, "", "ttl", b"stays", persistent()).await;
    let b = restart(b, true);
    let conn = connect(&b).await;
    let ch = conn.create_channel().await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if message_count(&ch, "ttl").await == 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the stored expiry was lost"
        );
        // Bounded poll of the queue depth: the event is the broker's own timer.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(bodies(&drain(&ch, "ttl").await), ["stays"]);
}

/// A durable x-delayed-message exchange "later" routing to durable queue "due" with key "k".
async fn delayed_topology(ch: &lapin::Channel) {
    let mut args = FieldTable::default();
    args.insert(
        "x-delayed-type".into(),
        lapin::types::AMQPValue::LongString("direct".into()),
    );
    ch.exchange_declare(
        "later".into(),
        ExchangeKind::Custom("x-delayed-message".into()),
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    queue(ch, "due", true).await;
    bind(ch, "due", "later", "k").await;
}

/// Publish `body` persistently to "later" with a delay of 1.5 s (confirmed).
async fn publish_delayed(ch: &lapin::Channel, body: &[u8]) {
    let mut headers = FieldTable::default();
    headers.insert("x-delay".into(), lapin::types::AMQPValue::LongInt(1500));
    publish(ch, "later", "k", body, persistent().with_headers(headers)).await;
}

#[tokio::test]
async fn delayed_messages_survive_a_restart_and_are_released_on_time() {
    //! A persistent message held by a durable x-delayed-message exchange is confirmed once
    //! stored, survives a kill -9, and is routed when its delay runs out.
    let b = Broker::start();
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    delayed_topology(&ch).await;
    publish_delayed(&ch, b"scheduled").await;
    let b = restart(b, true);
    let conn = connect(&b).await;
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(next_due(&ch).await, b"scheduled");
}

/// The next message released into "due" (a consumer "c" is left on `ch`).
async fn next_due(ch: &lapin::Channel) -> Vec<u8> {
    let mut consumer = consume(ch, "due", "c", true).await;
    tokio::time::timeout(WAIT, consumer.next())
        .await
        .expect("released within the wait")
        .unwrap()
        .unwrap()
        .data
}

#[tokio::test]
async fn delayed_messages_stay_in_their_vhost_across_a_restart() {
    //! The same delayed exchange in "/", "tenant" and "gone": after "gone" is deleted (and
    //! created again) and the broker is killed, each message is released into its own vhost's
    //! queue, and "gone"'s never comes back.
    let b = Broker::start();
    for vhost in ["tenant", "gone"] {
        b.add_vhost_for_guest(vhost, &[]);
    }
    let uri = |b: &Broker, vhost: &str| b.uri().replace("/%2f", &format!("/{vhost}"));
    // "tenant" last, so that once its message is released every other delay has run out.
    for (vhost, body) in [("gone", "gone"), ("%2f", "root"), ("tenant", "tenant")] {
        let conn = lapin::Connection::connect(&uri(&b, vhost), Default::default())
            .await
            .unwrap();
        let ch = confirm_channel(&conn).await;
        delayed_topology(&ch).await;
        publish_delayed(&ch, body.as_bytes()).await;
    }
    // Deleted, then created again with the same topology before the restart: had the
    // delayed record stayed in the store, recovery would hand it to the new "gone".
    let (ok, out) = b.ctl(&["delete_vhost", "gone"]);
    assert!(ok, "{out}");
    b.add_vhost_for_guest("gone", &[]);
    {
        let conn = lapin::Connection::connect(&uri(&b, "gone"), Default::default())
            .await
            .unwrap();
        delayed_topology(&confirm_channel(&conn).await).await;
    }
    let b = restart(b, true);
    let conn = lapin::Connection::connect(&uri(&b, "tenant"), Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(next_due(&ch).await, b"tenant");
    ch.basic_cancel("c".into(), Default::default())
        .await
        .unwrap();
    assert!(
        drain(&ch, "due").await.is_empty(),
        "only tenant's message in tenant"
    );
    let root = connect(&b).await.create_channel().await.unwrap();
    assert_eq!(
        bodies(&drain(&root, "due").await),
        ["root"],
        "only root's in /"
    );
    let conn = lapin::Connection::connect(&uri(&b, "gone"), Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    assert!(
        drain(&ch, "due").await.is_empty(),
        "gone's message went with it"
    );
}

#[tokio::test]
async fn policies_survive_a_restart() {
    //! A policy set with `warren ctl` is stored: after a kill -9 it is listed again and still
    //! limits the queues it matches.
    let b = Broker::start();
    let (ok, out) = b.ctl(&[
        "set_policy",
        "cap",
        "^pol\\.",
        r#"{"max-length": 2}"#,
        "--apply-to",
        "queues",
    ]);
    assert!(ok, "{out}");
    let b = restart(b, true);
    let (ok, out) = b.ctl(&["list_policies"]);
    assert!(
        ok && out.contains("\"cap\"") && out.contains("max-length"),
        "{out}"
    );
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    queue(&ch, "pol.q", true).await;
    for body in ["1", "2", "3"] {
        publish(&ch, "", "pol.q", body.as_bytes(), persistent()).await;
    }
    assert_eq!(bodies(&drain(&ch, "pol.q").await), ["2", "3"]);
}

#[tokio::test]
async fn users_permissions_and_limits_survive_a_restart_and_deleted_guest_stays_deleted() {
    //! Users and permissions set with `warren ctl` are stored: after a kill -9 the new user
    //! logs in with its password, and guest, deleted before, is not recreated.
    let b = Broker::start();
    b.ctl_all(&[
        &["add_user", "alice", "s3cret"],
        &["set_permissions", "alice", ".*", ".*", ".*"],
        &["set_user_tags", "alice", "administrator"],
        &["set_user_limits", "alice", r#"{"max-channels": 7}"#],
        &["set_vhost_limits", "-p", "/", r#"{"max-queues": 50}"#],
        &["delete_user", "guest"],
    ]);
    let b = restart(b, true);
    let (ok, out) = b.ctl(&["list_users"]);
    assert!(ok && out.contains("alice\t[administrator]"), "{out}");
    assert!(!out.contains("guest"), "{out}");
    let (ok, out) = b.ctl(&["list_user_limits", "--user", "alice"]);
    assert!(ok && out.contains(r#"{"max-channels":7}"#), "{out}");
    let (ok, out) = b.ctl(&["list_vhost_limits", "-p", "/"]);
    assert!(ok && out.contains(r#"{"max-queues":50}"#), "{out}");
    let alice = b.uri().replace("guest:guest@", "alice:s3cret@");
    let conn = lapin::Connection::connect(&alice, lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let ch = confirm_channel(&conn).await;
    queue(&ch, "users.q", true).await;
    let refused =
        lapin::Connection::connect(&b.uri(), lapin::ConnectionProperties::default()).await;
    assert!(refused.is_err(), "guest was deleted before the restart");
}

#[tokio::test]
async fn vhosts_survive_a_restart_and_a_deleted_one_takes_its_messages() {
    //! A vhost and its durable queue survive a kill -9 with their persistent messages; after
    //! delete_vhost, a vhost of that name created again is empty, also after a restart. Its
    //! limits and default queue type survive too.
    let b = Broker::start();
    b.add_vhost_for_guest("tenant", &["--default-queue-type", "quorum"]);
    b.ctl_all(&[&["set_vhost_limits", "-p", "tenant", r#"{"max-queues": 5}"#]]);
    let tenant = b.uri().replace("/%2f", "/tenant");
    {
        let conn = lapin::Connection::connect(&tenant, lapin::ConnectionProperties::default())
            .await
            .unwrap();
        let ch = confirm_channel(&conn).await;
        queue(&ch, "t.q", true).await;
        publish(&ch, "", "t.q", b"kept", persistent()).await;
    }
    let b = restart(b, true);
    let (ok, out) = b.ctl(&["list_vhosts", "name", "default_queue_type"]);
    assert!(ok && out.lines().any(|l| l == "tenant\tquorum"), "{out}");
    let (ok, out) = b.ctl(&["list_vhost_limits", "-p", "tenant"]);
    assert!(ok && out.contains(r#""max-queues":5"#), "{out}");
    let tenant = b.uri().replace("/%2f", "/tenant");
    let conn = lapin::Connection::connect(&tenant, lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let ch = confirm_channel(&conn).await;
    assert_eq!(bodies(&drain(&ch, "t.q").await), ["kept"]);
    publish(&ch, "", "t.q", b"dropped with the vhost", persistent()).await;
    let (ok, out) = b.ctl(&["delete_vhost", "tenant"]);
    assert!(ok, "{out}");
    // Created again before the restart: had the queue's record or messages stayed in the
    // store, recovery would put them back into it.
    b.add_vhost_for_guest("tenant", &[]);
    let b = restart(b, true);
    let (ok, out) = b.ctl(&["list_vhosts"]);
    assert!(ok && out.contains("tenant"), "{out}");
    let tenant = b.uri().replace("/%2f", "/tenant");
    let conn = lapin::Connection::connect(&tenant, lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let gone = ch
        .queue_declare(
            "t.q".into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    assert!(gone.is_err(), "the queue went with its vhost");
}

fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

#[tokio::test]
async fn disk_space_of_settled_messages_is_reclaimed_while_running() {
    //! A steady publish/consume loop of 40 MiB through 1 MiB segments leaves only a few
    //! segments on disk: settled data is deleted as the broker runs.
    let dir = std::env::temp_dir().join(format!("warren-reclaim-{}", std::process::id()));
    let b = Broker::start_in(dir.clone(), &["--store-segment-bytes", "1048576"]);
    let conn = connect(&b).await;
    let ch = confirm_channel(&conn).await;
    queue(&ch, "loop", true).await;
    let body = vec![7u8; 256 * 1024];
    for _ in 0..160 {
        publish(&ch, "", "loop", &body, persistent()).await;
        let m = ch
            .basic_get("loop".into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .unwrap();
        m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    queue(&ch, "barrier", true).await;
    let on_disk = dir_bytes(&b.data_dir().join("segments"));
    assert!(
        on_disk < 4 * 1024 * 1024,
        "{on_disk} bytes of segments after 40 MiB settled"
    );
}

#[derive(Default)]
struct Ledger {
    /// Per queue: next sequence number to publish.
    next: Vec<u64>,
    /// Per queue: sequence numbers the broker confirmed.
    confirmed: Vec<BTreeSet<u64>>,
}

/// Publish persistent messages with confirms, round-robin over the queues, recording each
/// confirm, until the connection dies (the broker is killed under it).
async fn publish_until_killed(ch: Channel, ledger: Arc<Mutex<Ledger>>, queues: usize) {
    for i in 0.. {
        let q = i % queues;
        let seq = {
            let mut l = ledger.lock().unwrap();
            let s = l.next[q];
            l.next[q] += 1;
            s
        };
        let sent = ch
            .basic_publish(
                "".into(),
                format!("crash{q}").as_str().into(),
                BasicPublishOptions::default(),
                seq.to_string().as_bytes(),
                persistent(),
            )
            .await;
        let Ok(confirm) = sent else { return };
        match confirm.await {
            Ok(c) if c.is_ack() => {
                ledger.lock().unwrap().confirmed[q].insert(seq);
            }
            _ => return,
        }
    }
}

#[tokio::test]
async fn crash_cycles_lose_no_confirmed_message_and_resurrect_no_acked_one() {
    //! Two publishers (confirms) into three durable queues and a consumer acking, killed with
    //! SIGKILL at a random moment while all of them run, many times. After each restart every
    //! confirmed message not acked is present exactly once, in order; no message whose ack was
    //! made durable (a durable declare after it returned) comes back; acks still in flight at
    //! the crash may come back (at-least-once); nothing unknown appears.
    const QUEUES: usize = 3;
    // 15 in CI; more with WARREN_CRASH_CYCLES=N (e.g. for a long local soak).
    let cycles: usize = std::env::var("WARREN_CRASH_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15);
    let ledger = Arc::new(Mutex::new(Ledger {
        next: vec![0; QUEUES],
        confirmed: vec![BTreeSet::new(); QUEUES],
    }));
    let mut acked: Vec<BTreeSet<u64>> = vec![BTreeSet::new(); QUEUES];
    let mut maybe_acked: Vec<BTreeSet<u64>> = vec![BTreeSet::new(); QUEUES];
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut rand = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n.max(1)
    };
    let mut b = Broker::start();
    let mut checked = 0usize;
    for cycle in 0..cycles {
        let conn = connect(&b).await;
        let check = conn.create_channel().await.unwrap();
        for q in 0..QUEUES {
            queue(&check, &format!("crash{q}"), true).await;
        }
        let mut in_flight_acks = Vec::new();
        for q in 0..QUEUES {
            let name = format!("crash{q}");
            let mut seen = Vec::new();
            loop {
                let got = check
                    .basic_get(name.as_str().into(), BasicGetOptions { no_ack: false })
                    .await
                    .unwrap();
                let Some(m) = got else { break };
                let seq: u64 = String::from_utf8_lossy(&m.delivery.data).parse().unwrap();
                seen.push((seq, m.delivery.delivery_tag));
            }
            let seqs: Vec<u64> = seen.iter().map(|(s, _)| *s).collect();
            let mut sorted = seqs.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(
                sorted, seqs,
                "cycle {cycle} queue {q}: in order, no duplicates"
            );
            {
                let l = ledger.lock().unwrap();
                for s in &seqs {
                    assert!(
                        *s < l.next[q],
                        "cycle {cycle} queue {q}: unknown message {s}"
                    );
                    assert!(
                        !acked[q].contains(s),
                        "cycle {cycle} queue {q}: acked message {s} came back"
                    );
                }
                for s in l.confirmed[q].difference(&acked[q]) {
                    assert!(
                        seqs.contains(s) || maybe_acked[q].contains(s),
                        "cycle {cycle} queue {q}: confirmed message {s} lost"
                    );
                }
            }
            checked += seqs.len();
            // Whatever an in-flight ack did not remove is simply unacked: forget the doubt.
            maybe_acked[q].retain(|s| !seqs.contains(s));
            // Ack the oldest third for sure, the next third in flight at the crash; the rest
            // go back to the queue.
            let third = seen.len() / 3;
            for (s, tag) in &seen[..third] {
                check
                    .basic_ack(*tag, BasicAckOptions::default())
                    .await
                    .unwrap();
                acked[q].insert(*s);
            }
            in_flight_acks.extend(seen[third..2 * third].iter().map(|(s, tag)| (q, *s, *tag)));
            for (_, tag) in &seen[2 * third..] {
                check
                    .basic_nack(
                        *tag,
                        BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        },
                    )
                    .await
                    .unwrap();
            }
        }
        // Everything acked above is durable once this durable declare returns.
        queue(&check, "crash-barrier", true).await;
        let mut publishers = Vec::new();
        for _ in 0..2 {
            let ch = confirm_channel(&conn).await;
            publishers.push(tokio::spawn(publish_until_killed(
                ch,
                Arc::clone(&ledger),
                QUEUES,
            )));
        }
        // Fault injection: the kill lands after a random delay, while publishes, confirms and
        // acks are in progress.
        // Every in-flight ack may or may not reach the disk before the kill.
        for (q, s, _) in &in_flight_acks {
            maybe_acked[*q].insert(*s);
        }
        let acker = tokio::spawn(async move {
            for (_, _, tag) in in_flight_acks {
                if check
                    .basic_ack(tag, BasicAckOptions::default())
                    .await
                    .is_err()
                {
                    break;
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(20 + rand(120))).await;
        b = restart(b, true);
        for p in publishers {
            let _ = p.await;
        }
        let _ = acker.await;
        let _ = conn;
    }
    let total: usize = ledger
        .lock()
        .unwrap()
        .confirmed
        .iter()
        .map(BTreeSet::len)
        .sum();
    eprintln!(
        "crash cycles: {cycles}, confirmed messages: {total}, messages checked after restarts: {checked}"
    );
    // Only that the checks above were not vacuous: how many confirms fit in a cycle is a
    // speed (a debug build on a loaded 2-core machine confirms about 10 a cycle, a release
    // build 80), and speed belongs in the benchmarks.
    assert!(
        total > cycles * 5,
        "the publishers made progress ({total} confirmed)"
    );
    assert!(checked > cycles * 10, "the checks saw messages ({checked})");
}
