//! RabbitMQ's `rabbitmq.conf` (the "new style", sysctl-like format: `key = value` lines, `#`
//! comments) read into Warren's configuration, so an operator can start from an existing file.
//!
//! Only the keys Warren has a setting for are taken (listeners, protocol and node limits,
//! watermarks, the default user, loopback users, TLS paths, log level, advertised identity);
//! every other key is returned by name so the caller can say it was ignored. A value Warren
//! cannot read is an error naming the line, never a silent default.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;

use crate::config::types::FileConfig;

/// What a `rabbitmq.conf` gave: Warren's settings, and the keys it does not have.
#[derive(Debug, Default)]
pub struct Parsed {
    /// The settings, as if they came from Warren's TOML file.
    pub file: FileConfig,
    /// Keys Warren ignores, in file order.
    pub ignored: Vec<String>,
}

/// Whether `text`, which did not parse as Warren's TOML, is meant as a `rabbitmq.conf`: it
/// has a `.conf` name or a dotted key (`listeners.tcp.default`), which Warren's TOML never
/// has. The caller tries TOML first, so a Warren file named `warren.conf` stays TOML.
#[must_use]
pub fn looks_like(path: &std::path::Path, text: &str) -> bool {
    if path.extension().is_some_and(|e| e == "conf") {
        return true;
    }
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .any(|l| {
            l.split_once('=')
                .is_some_and(|(k, _)| k.trim().contains('.') && !k.trim().starts_with('['))
        })
}

/// Parse a `rabbitmq.conf`.
///
/// # Errors
/// A line without `=`, or a value of the wrong form for a key Warren takes.
pub fn parse(text: &str) -> anyhow::Result<Parsed> {
    let mut p = Parsed::default();
    let f = &mut p.file;
    let mut http = [(None::<String>, None::<u16>), (None, None)]; // management, prometheus
    let mut mechanisms: Vec<(String, String)> = Vec::new(); // (key, name), sorted at the end
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .with_context(|| format!("rabbitmq.conf line {}: expected key = value", n + 1))?;
        let (key, value) = (key.trim(), unquote(value.trim()));
        let at = || format!("rabbitmq.conf line {} ({key})", n + 1);
        match key {
            // Refused rather than ignored: the operator asked for no plain listener, or for
            // TLS on the management port, and ignoring it would open what they closed.
            "listeners.tcp" => anyhow::bail!(
                "{}: Warren always listens for plain AMQP (it cannot be turned off)",
                at()
            ),
            k if k.starts_with("management.ssl.") => anyhow::bail!(
                "{}: Warren's management API has no TLS listener; use a TLS-terminating proxy",
                at()
            ),
            k if k.starts_with("listeners.tcp.") => {
                if f.amqp_listen.is_none() {
                    f.amqp_listen = Some(listener(value).with_context(at)?);
                } else {
                    // Warren has one plain listener: later ones are reported, not dropped.
                    p.ignored.push(key.to_string());
                }
            }
            k if k.starts_with("listeners.ssl.") => {
                if f.amqps_listen.is_none() {
                    f.amqps_listen = Some(listener(value).with_context(at)?);
                } else {
                    p.ignored.push(key.to_string());
                }
            }
            "management.tcp.port" | "management.listener.port" => {
                http[0].1 = Some(value.parse().with_context(at)?);
            }
            "management.tcp.ip" | "management.listener.ip" => http[0].0 = Some(value.into()),
            "prometheus.tcp.port" => http[1].1 = Some(value.parse().with_context(at)?),
            "prometheus.tcp.ip" => http[1].0 = Some(value.into()),
            "heartbeat" => f.heartbeat_s = Some(value.parse().with_context(at)?),
            "frame_max" => f.frame_max = Some(value.parse().with_context(at)?),
            "channel_max" => f.channel_max = Some(value.parse().with_context(at)?),
            "max_message_size" => {
                f.message_size_max = Some(crate::config::types::size(key, value).with_context(at)?);
            }
            "connection_max" => f.connection_max = infinity_or(value).with_context(at)?,
            "consumer_max_per_channel" => {
                f.consumer_max_per_channel = infinity_or(value).with_context(at)?;
            }
            "consumer_timeout" => f.consumer_timeout = Some(value.parse().with_context(at)?),
            "consumer_timeout_response" => f.consumer_timeout_response = Some(value.into()),
            "vm_memory_high_watermark.relative" => {
                f.vm_memory_high_watermark = Some(value.parse().with_context(at)?);
            }
            "vm_memory_high_watermark.absolute" => {
                f.vm_memory_high_watermark_absolute = Some(value.into());
            }
            "disk_free_limit.absolute" => f.disk_free_limit = Some(value.into()),
            "disk_free_limit.relative" => {
                f.disk_free_limit_mem_relative = Some(value.parse().with_context(at)?);
            }
            "default_user" => f.default_user = Some(value.into()),
            "default_pass" => f.default_pass = Some(value.into()),
            k if k.starts_with("loopback_users.") => {
                let user = &k["loopback_users.".len()..];
                let on = boolean(value).with_context(at)?;
                // The entries set to true are the whole list, as RabbitMQ's translation makes
                // it (no entry at all keeps the default, guest).
                let list = f.loopback_users.get_or_insert_with(Vec::new);
                list.retain(|u| u != user);
                if on {
                    list.push(user.to_string());
                }
            }
            "loopback_users" if value == "none" => f.loopback_users = Some(Vec::new()),
            "ssl_options.certfile" => f.tls_cert = Some(PathBuf::from(value)),
            "ssl_options.keyfile" => f.tls_key = Some(PathBuf::from(value)),
            "ssl_options.cacertfile" => f.tls_ca = Some(PathBuf::from(value)),
            "ssl_options.fail_if_no_peer_cert" => {
                f.tls_fail_if_no_peer_cert = Some(boolean(value).with_context(at)?);
            }
            "ssl_cert_login_from" => {
                f.ssl_cert_login_from = Some(match value {
                    "distinguished_name" => crate::tls::CertLogin::DistinguishedName,
                    "common_name" => crate::tls::CertLogin::CommonName,
                    other => anyhow::bail!("{}: unknown value {other:?}", at()),
                });
            }
            "log.console.level" | "log.file.level" | "log.default.level" => {
                if f.log_level.is_none() {
                    f.log_level = Some(log_level(value).with_context(at)?);
                }
            }
            k if k.starts_with("auth_mechanisms.") => {
                if warren_amqp::connection::Mechanism::from_name(value).is_some() {
                    mechanisms.push((k.to_string(), value.to_string()));
                } else {
                    // ANONYMOUS (in RabbitMQ 4's default list) and plugins' mechanisms.
                    p.ignored.push(format!("{key} = {value}"));
                }
            }
            "product.name" => f.product_name = Some(value.into()),
            "product.version" => f.product_version = Some(value.into()),
            _ => p.ignored.push(key.to_string()),
        }
    }
    if !mechanisms.is_empty() {
        // RabbitMQ orders them by key.
        mechanisms.sort();
        f.auth_mechanisms = Some(mechanisms.into_iter().map(|(_, m)| m).collect());
    }
    for (i, (ip, port)) in http.into_iter().enumerate() {
        if ip.is_none() && port.is_none() {
            continue;
        }
        let default_port = if i == 0 { 15672 } else { 15692 };
        let addr = format!(
            "{}:{}",
            bracket(ip.as_deref().unwrap_or("0.0.0.0")),
            port.unwrap_or(default_port)
        );
        if i == 0 {
            f.management_listen = Some(addr);
        } else {
            f.prometheus_listen = Some(addr);
        }
    }
    Ok(p)
}

/// `5672`, `127.0.0.1:5672` or `::1:5672` (RabbitMQ's listener forms).
fn listener(value: &str) -> anyhow::Result<SocketAddr> {
    if let Ok(port) = value.parse::<u16>() {
        return Ok(SocketAddr::from(([0, 0, 0, 0], port)));
    }
    if let Ok(addr) = value.parse::<SocketAddr>() {
        return Ok(addr);
    }
    // An IPv6 address without brackets: the port is after the last colon.
    let (ip, port) = value
        .rsplit_once(':')
        .with_context(|| format!("{value:?} is neither a port nor an address"))?;
    format!("[{ip}]:{port}")
        .parse()
        .with_context(|| format!("{value:?} is neither a port nor an address"))
}

fn bracket(ip: &str) -> String {
    if ip.contains(':') && !ip.starts_with('[') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    }
}

fn unquote(v: &str) -> &str {
    v.strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(v)
}

fn infinity_or(value: &str) -> anyhow::Result<Option<u64>> {
    if value == "infinity" {
        return Ok(None);
    }
    Ok(Some(value.parse().with_context(|| {
        format!("{value:?} is neither a number nor infinity")
    })?))
}

fn boolean(value: &str) -> anyhow::Result<bool> {
    match value {
        "true" => Ok(true),
        "false" => Ok(false),
        other => anyhow::bail!("{other:?} is neither true nor false"),
    }
}

/// RabbitMQ's log levels as a tracing filter.
fn log_level(value: &str) -> anyhow::Result<String> {
    Ok(match value {
        "debug" => "debug",
        "info" | "notice" => "info",
        "warning" | "warn" => "warn",
        "error" | "critical" | "alert" | "emergency" => "error",
        "none" => "off",
        other => anyhow::bail!("{other:?} is not a log level"),
    }
    .to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

    use super::*;

    #[test]
    fn a_typical_rabbitmq_conf_maps_to_warrens_settings() {
        let p = parse(
            "# a comment\n\
             listeners.tcp.default = 5673\n\
             listeners.ssl.default = 127.0.0.1:5674\n\
             management.tcp.port = 15673\n\
             management.tcp.ip = 127.0.0.1\n\
             prometheus.tcp.port = 15693\n\
             heartbeat = 30\n\
             frame_max = 65536\n\
             channel_max = 128\n\
             max_message_size = 134217728\n\
             connection_max = infinity\n\
             consumer_max_per_channel = 10\n\
             consumer_timeout = 900000\n\
             consumer_timeout_response = close_channel\n\
             vm_memory_high_watermark.relative = 0.4\n\
             disk_free_limit.absolute = 2GB\n\
             default_user = admin\n\
             default_pass = \"s3cret\"\n\
             loopback_users.guest = false\n\
             ssl_options.certfile = /etc/rabbitmq/server.pem\n\
             ssl_options.keyfile = /etc/rabbitmq/server.key\n\
             ssl_options.cacertfile = /etc/rabbitmq/ca.pem\n\
             ssl_options.verify = verify_peer\n\
             ssl_options.fail_if_no_peer_cert = true\n\
             log.console.level = warning\n\
             auth_mechanisms.2 = EXTERNAL\n\
             auth_mechanisms.1 = PLAIN\n\
             auth_mechanisms.3 = ANONYMOUS\n\
             listeners.tcp.other = 5999\n\
             cluster_formation.peer_discovery_backend = classic_config\n\
             collect_statistics_interval = 10000\n",
        )
        .unwrap();
        let f = &p.file;
        assert_eq!(f.amqp_listen, Some("0.0.0.0:5673".parse().unwrap()));
        assert_eq!(f.amqps_listen, Some("127.0.0.1:5674".parse().unwrap()));
        assert_eq!(f.management_listen.as_deref(), Some("127.0.0.1:15673"));
        assert_eq!(f.prometheus_listen.as_deref(), Some("0.0.0.0:15693"));
        assert_eq!(
            (f.heartbeat_s, f.frame_max, f.channel_max),
            (Some(30), Some(65536), Some(128))
        );
        assert_eq!(f.message_size_max, Some(134_217_728));
        assert_eq!(
            (f.connection_max, f.consumer_max_per_channel),
            (None, Some(10))
        );
        assert_eq!(f.consumer_timeout, Some(900_000));
        assert_eq!(
            f.consumer_timeout_response.as_deref(),
            Some("close_channel")
        );
        assert_eq!(f.vm_memory_high_watermark, Some(0.4));
        assert_eq!(f.disk_free_limit.as_deref(), Some("2GB"));
        assert_eq!(
            (f.default_user.as_deref(), f.default_pass.as_deref()),
            (Some("admin"), Some("s3cret"))
        );
        assert_eq!(f.loopback_users, Some(vec![]));
        assert_eq!(
            f.tls_cert.as_deref(),
            Some(std::path::Path::new("/etc/rabbitmq/server.pem"))
        );
        assert_eq!(f.tls_fail_if_no_peer_cert, Some(true));
        assert_eq!(f.log_level.as_deref(), Some("warn"));
        assert_eq!(
            f.auth_mechanisms.as_deref(),
            Some(&["PLAIN".to_string(), "EXTERNAL".to_string()][..])
        );
        assert_eq!(
            p.ignored,
            [
                "ssl_options.verify",
                "auth_mechanisms.3 = ANONYMOUS",
                "listeners.tcp.other",
                "cluster_formation.peer_discovery_backend",
                "collect_statistics_interval"
            ]
        );
    }

    #[test]
    fn bad_values_name_their_line() {
        let e = parse("heartbeat = often\n").unwrap_err();
        assert!(format!("{e:#}").contains("line 1 (heartbeat)"), "{e:#}");
        assert!(parse("just words\n").is_err());
        assert!(parse("loopback_users.guest = maybe\n").is_err());
        // Settings that would open what the operator closed are refused, not ignored.
        assert!(parse("listeners.tcp = none\n").is_err());
        assert!(parse("management.ssl.port = 15671\n").is_err());
        // loopback_users entries are the whole list.
        let p = parse("loopback_users.ops = true\n").unwrap();
        assert_eq!(p.file.loopback_users, Some(vec!["ops".to_string()]));
        assert_eq!(
            listener("::1:5672").unwrap(),
            "[::1]:5672".parse::<SocketAddr>().unwrap()
        );
    }

    #[test]
    fn the_format_is_recognised_by_name_or_by_dotted_keys() {
        let p = std::path::Path::new;
        assert!(looks_like(p("/etc/rabbitmq/rabbitmq.conf"), ""));
        assert!(looks_like(p("x.cfg"), "listeners.tcp.default = 5672\n"));
        assert!(!looks_like(
            p("warren.toml"),
            "amqp_listen = \"0.0.0.0:5672\"\n[section]\n"
        ));
    }
}
