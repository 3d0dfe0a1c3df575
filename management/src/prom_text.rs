//! The Prometheus text format (0.0.4), written with RabbitMQ's label order.
//!
//! The prometheus crate sorts a metric's labels by name, so a queue's series would read
//! `{queue="q",vhost="/"}`; RabbitMQ writes `{vhost="/",queue="q"}`
//! (`prometheus_rabbitmq_core_metrics_collector:label/1`), and tools that match series as
//! text follow it. This encoder puts the object labels first in that order and keeps every
//! other label in the crate's (sorted) order after them.

use std::fmt::Write as _;

use prometheus::proto::{MetricFamily, MetricType};

/// Labels written first, in this order, when a series has them.
const LEADING_LABELS: [&str; 3] = ["vhost", "queue", "exchange"];

/// Append `families` to `out` in the text format.
pub(crate) fn encode(families: &[MetricFamily], out: &mut String) {
    for mf in families {
        let name = mf.name();
        if !mf.help().is_empty() {
            let _ = writeln!(out, "# HELP {name} {}", escape(mf.help(), false));
        }
        let kind = match mf.get_field_type() {
            MetricType::COUNTER => "counter",
            MetricType::GAUGE => "gauge",
            MetricType::HISTOGRAM => "histogram",
            MetricType::SUMMARY => "summary",
            MetricType::UNTYPED => "untyped",
        };
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for m in mf.get_metric() {
            let value = match mf.get_field_type() {
                MetricType::COUNTER => m.get_counter().get_value(),
                MetricType::GAUGE => m.get_gauge().get_value(),
                // Scrapes register gauges and counters only (histograms are written apart).
                _ => continue,
            };
            out.push_str(name);
            let mut labels: Vec<(&str, &str)> = m
                .get_label()
                .iter()
                .map(|l| (l.name(), l.value()))
                .collect();
            // Stable: labels outside LEADING_LABELS keep their order.
            labels.sort_by_key(|(n, _)| {
                LEADING_LABELS
                    .iter()
                    .position(|l| l == n)
                    .unwrap_or(LEADING_LABELS.len())
            });
            for (i, (n, v)) in labels.iter().enumerate() {
                let sep = if i == 0 { '{' } else { ',' };
                let _ = write!(out, "{sep}{n}=\"{}\"", escape(v, true));
            }
            if !labels.is_empty() {
                out.push('}');
            }
            let _ = writeln!(out, " {}", number(value));
        }
    }
}

/// A sample value as Prometheus reads it.
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else {
        v.to_string()
    }
}

/// Backslash and newline escaped (and the double quote in label values).
pub(crate) fn escape(v: &str, quote: bool) -> std::borrow::Cow<'_, str> {
    if !(v.contains(['\\', '\n']) || quote && v.contains('"')) {
        return v.into();
    }
    let mut s = String::with_capacity(v.len() + 8);
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '\n' => s.push_str("\\n"),
            '"' if quote => s.push_str("\\\""),
            c => s.push(c),
        }
    }
    s.into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::{GaugeVec, Opts, Registry};

    #[test]
    fn object_labels_lead_in_rabbitmq_order_and_values_are_escaped() {
        let r = Registry::new();
        let g = GaugeVec::new(
            Opts::new("rabbitmq_queue_messages", "Sum of ready and unacked"),
            &["queue", "vhost", "channel"],
        )
        .expect("valid");
        r.register(Box::new(g.clone())).expect("registers");
        g.with_label_values(&["q\"1", "/", "c\\2"]).set(3.0);
        let mut out = String::new();
        encode(&r.gather(), &mut out);
        assert_eq!(
            out,
            "# HELP rabbitmq_queue_messages Sum of ready and unacked\n\
             # TYPE rabbitmq_queue_messages gauge\n\
             rabbitmq_queue_messages{vhost=\"/\",queue=\"q\\\"1\",channel=\"c\\\\2\"} 3\n"
        );
    }

    #[test]
    fn special_values_are_prometheus_spelled() {
        assert_eq!(number(f64::INFINITY), "+Inf");
        assert_eq!(number(f64::NEG_INFINITY), "-Inf");
        assert_eq!(number(f64::NAN), "NaN");
        assert_eq!(number(0.25), "0.25");
    }
}
