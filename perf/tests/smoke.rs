//! warren-perf against the real broker: the counts and the JSON summary it reports are right.
#![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

use std::process::Command;

use warren_compat_tests::Broker;

#[test]
fn counts_confirms_and_percentiles_of_a_fixed_run() {
    let b = Broker::start();
    let json = std::env::temp_dir().join(format!("warren-perf-smoke-{}.json", std::process::id()));
    let status = Command::new(env!("CARGO_BIN_EXE_warren-perf"))
        .args([
            "--uri",
            &b.uri(),
            "--duration",
            "0",
            "--durable",
            "--persistent",
        ])
        .args([
            "--confirm",
            "50",
            "--pmessages",
            "3000",
            "--cmessages",
            "3000",
        ])
        .args(["--size", "200", "--queue", "smoke"])
        .arg("--json")
        .arg(&json)
        .status()
        .unwrap();
    assert!(status.success());
    let text = std::fs::read_to_string(&json).unwrap();
    let _ = std::fs::remove_file(&json);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["published"], 3000);
    assert_eq!(v["confirmed"], 3000);
    assert_eq!(v["nacked"], 0);
    assert_eq!(v["consumed"], 3000);
    assert_eq!(v["confirm_latency_us"]["count"], 3000);
    assert_eq!(v["e2e_latency_us"]["count"], 3000);
    let p50 = v["e2e_latency_us"]["p50"].as_u64().unwrap();
    let p99 = v["e2e_latency_us"]["p99"].as_u64().unwrap();
    assert!(p50 > 0 && p50 <= p99);
}
