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
