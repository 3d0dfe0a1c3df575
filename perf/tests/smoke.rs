//! warren-perf against the real broker: the counts and the JSON summary it reports are right.
#![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

use std::process::Command;

use warren_compat_tests::Broker;

/// Run warren-perf with `args` plus `--json`, return the summary.
fn run(args: &[&str]) -> serde_json::Value {
    let json = std::env::temp_dir().join(format!(
        "warren-perf-{}-{}.json",
        std::process::id(),
        args.join("_").replace(['/', ':'], "")
    ));
    let status = Command::new(env!("CARGO_BIN_EXE_warren-perf"))
        .args(args)
        .arg("--json")
        .arg(&json)
        .status()
        .unwrap();
    assert!(status.success(), "warren-perf {args:?} failed");
    let text = std::fs::read_to_string(&json).unwrap();
    let _ = std::fs::remove_file(&json);
    serde_json::from_str(&text).unwrap()
}

#[test]
fn counts_confirms_and_percentiles_of_a_fixed_run() {
    let b = Broker::start();
    for client in ["raw", "lapin"] {
        let v = run(&[
            "--client",
            client,
            "--uri",
            &b.uri(),
            "--duration",
            "0",
            "--durable",
            "--persistent",
            "--confirm",
            "50",
            "--pmessages",
            "3000",
            "--cmessages",
            "3000",
            "--size",
            "200",
            "--queue",
            client,
        ]);
        assert_eq!(v["published"], 3000, "{client}");
        assert_eq!(v["confirmed"], 3000, "{client}");
        assert_eq!(v["nacked"], 0, "{client}");
        assert_eq!(v["consumed"], 3000, "{client}");
        assert_eq!(v["confirm_latency_us"]["count"], 3000, "{client}");
        assert_eq!(v["e2e_latency_us"]["count"], 3000, "{client}");
        let p50 = v["e2e_latency_us"]["p50"].as_u64().unwrap();
        let p99 = v["e2e_latency_us"]["p99"].as_u64().unwrap();
        assert!(p50 > 0 && p50 <= p99, "{client}");
    }
}

/// Every named scenario runs briefly against a fresh broker and reports what it measures.
/// Proves the tool works; no timing is asserted.
#[test]
fn every_scenario_runs() {
    let b = Broker::start();
    let uri = b.uri();
    let common = ["--uri", uri.as_str(), "--delete-after"];
    for scenario in [
        "transient",
        "durable",
        "quorum",
        "parallel4",
        "fanout8",
        "paced5k",
        "small16",
    ] {
        let mut args = vec!["--scenario", scenario, "--duration", "1"];
        args.extend(common);
        let v = run(&args);
        assert!(v["published"].as_u64().unwrap() > 0, "{scenario}: {v}");
        assert!(v["consumed"].as_u64().unwrap() > 0, "{scenario}: {v}");
        assert_eq!(v["nacked"], 0, "{scenario}");
        if ["durable", "quorum", "paced5k"].contains(&scenario) {
            assert!(v["confirmed"].as_u64().unwrap() > 0, "{scenario}: {v}");
            assert!(v["confirm_latency_us"]["count"].as_u64().unwrap() > 0);
        }
    }
    // fanout8 delivers each message to 8 queues: checked exactly with a fixed count.
    let mut args = vec![
        "--scenario",
        "fanout8",
        "--duration",
        "0",
        "--pmessages",
        "500",
        "--cmessages",
        "500",
    ];
    args.extend(common);
    let v = run(&args);
    assert_eq!(v["published"], 500);
    assert_eq!(v["consumed"], 4000);
    // backlog: publish a fixed number with no consumer, then drain exactly those.
    let mut args = vec!["--scenario", "backlog", "--pmessages", "2000"];
    args.extend(common);
    let v = run(&args);
    assert_eq!(v["published"], 2000);
    assert_eq!(v["confirmed"], 2000);
    assert_eq!(v["consumed"], 0);
    assert_eq!(v["drained"], 2000);
    // idle: connections held open at once.
    let v = run(&[
        "--scenario",
        "idle",
        "--connections",
        "200",
        "--uri",
        uri.as_str(),
    ]);
    assert_eq!(v["idle_connections"], 200);
}

/// A TCP relay to `to` that closes the first `drop_first` connections as soon as the client
/// has spoken (as RabbitMQ does to a handshake it has no time for) and relays the rest.
fn shedding_relay(to: std::net::SocketAddr, drop_first: usize) -> std::net::SocketAddr {
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for (i, client) in listener.incoming().enumerate() {
            let Ok(mut client) = client else { return };
            if i < drop_first {
                let mut header = [0u8; 8];
                let _ = client.read_exact(&mut header);
                continue; // dropped: the client reads EOF
            }
            let Ok(broker) = TcpStream::connect(to) else {
                return;
            };
            for (mut from, mut into) in [
                (client.try_clone().unwrap(), broker.try_clone().unwrap()),
                (broker, client),
            ] {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut into);
                    let _ = into.shutdown(std::net::Shutdown::Write);
                });
            }
        }
    });
    addr
}

/// A connection the broker closes during its handshake is opened again (up to OPEN_ATTEMPTS
/// times); past that its task fails, and the run still writes its figures, counts the failed
/// task and exits 1 (with a message, not a backtrace).
#[test]
fn a_handshake_the_broker_sheds_is_tried_again_and_a_failed_task_is_counted() {
    let b = Broker::start();
    let broker: std::net::SocketAddr = b.addr.parse().unwrap();
    let run_through = |drop_first: usize| {
        let relay = shedding_relay(broker, drop_first);
        let json = std::env::temp_dir().join(format!(
            "warren-perf-shed-{}-{drop_first}.json",
            std::process::id()
        ));
        let uri = format!("amqp://guest:guest@{relay}/%2f");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_warren-perf"));
        cmd.args(["--uri", &uri, "--queue", "shed", "--consumers", "0"])
            .args(["--duration", "0", "--pmessages", "100", "--confirm", "10"])
            .env("RUST_BACKTRACE", "1")
            .args(["--no-declare", "--json"])
            .arg(&json);
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let text = std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("{e}: {stderr}"));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let _ = std::fs::remove_file(&json);
        (out.status.code(), v, stderr)
    };
    // Through the relay, nothing shed: 100 confirmed (unroutable: no queue is declared).
    let (code, v, stderr) = run_through(0);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        (v["confirmed"].as_u64(), v["failed"].as_u64()),
        (Some(100), Some(0))
    );
    // The producer's first handshake shed: it opens again and publishes everything.
    let (code, v, stderr) = run_through(1);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(v["confirmed"], 100, "{stderr}");
    assert!(stderr.contains("(attempt 1)"), "{stderr}");
    // Every handshake shed: the task fails after OPEN_ATTEMPTS; the figures are written.
    let (code, v, stderr) = run_through(usize::MAX);
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(
        (v["failed"].as_u64(), v["published"].as_u64()),
        (Some(1), Some(0))
    );
    assert!(stderr.contains("(attempt 2)"), "{stderr}");
    assert!(!stderr.contains("(attempt 3)"), "{stderr}");
    assert!(
        stderr.contains("1 publisher or consumer tasks failed"),
        "{stderr}"
    );
    assert!(!stderr.contains("Stack backtrace"), "{stderr}");
}
