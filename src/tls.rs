//! TLS for the AMQPS listener: the rustls server configuration built from PEM files, and the
//! user name a verified client certificate gives for SASL EXTERNAL.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};

/// Which part of a client certificate names the user (RabbitMQ's `ssl_cert_login_from`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum CertLogin {
    /// The subject's distinguished name in RFC 4514 form, as RabbitMQ's default.
    DistinguishedName,
    /// The subject's (last) common name.
    CommonName,
}

/// TLS settings; present only when a certificate is configured.
#[derive(Debug, Clone)]
pub struct TlsOptions {
    /// Server certificate chain (PEM).
    pub cert: PathBuf,
    /// Server private key (PEM).
    pub key: PathBuf,
    /// CA bundle that client certificates are verified against (PEM). Without it, clients are
    /// not asked for a certificate.
    pub ca: Option<PathBuf>,
    /// Refuse clients without a certificate (RabbitMQ's `fail_if_no_peer_cert`); needs `ca`.
    pub fail_if_no_peer_cert: bool,
    /// How the user name for SASL EXTERNAL is read from the client certificate.
    pub login_from: CertLogin,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .with_context(|| format!("reading {}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing certificates in {}", path.display()))?;
    anyhow::ensure!(!certs.is_empty(), "no certificate in {}", path.display());
    Ok(certs)
}

/// Build the acceptor: TLS 1.2 and 1.3 only; client certificates verified against `ca` when one
/// is given (optional unless `fail_if_no_peer_cert`).
pub fn acceptor(opts: &TlsOptions) -> anyhow::Result<TlsAcceptor> {
    let certs = read_certs(&opts.cert)?;
    let key = PrivateKeyDer::from_pem_file(&opts.key)
        .with_context(|| format!("reading the private key in {}", opts.key.display()))?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS12, &rustls::version::TLS13])
        .context("choosing TLS versions")?;
    let builder = match &opts.ca {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in read_certs(ca)? {
                roots
                    .add(cert)
                    .with_context(|| format!("adding a CA certificate from {}", ca.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
            let verifier = if opts.fail_if_no_peer_cert {
                verifier
            } else {
                verifier.allow_unauthenticated()
            };
            builder.with_client_cert_verifier(verifier.build().context("client verifier")?)
        }
        None => {
            anyhow::ensure!(
                !opts.fail_if_no_peer_cert,
                "tls_fail_if_no_peer_cert needs tls_ca to verify client certificates against"
            );
            builder.with_no_client_auth()
        }
    };
    let config = builder
        .with_single_cert(certs, key)
        .context("the certificate and key do not form a usable pair")?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The user name a verified client certificate gives, or `None` when the certificate has no
/// usable subject (then SASL EXTERNAL is not offered).
#[must_use]
pub fn cert_identity(der: &[u8], from: CertLogin) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let subject = cert.subject();
    match from {
        CertLogin::CommonName => subject
            .iter_common_name()
            .last()
            .and_then(|cn| cn.as_str().ok())
            .map(str::to_string),
        CertLogin::DistinguishedName => {
            let registry = x509_parser::objects::oid_registry();
            // RFC 4514: the last RDN of the sequence first, as OpenSSL's -nameopt RFC2253.
            let mut rdns: Vec<String> = subject
                .iter()
                .map(|rdn| {
                    rdn.iter()
                        .map(|atv| {
                            let oid = atv.attr_type();
                            let name = x509_parser::objects::oid2abbrev(oid, registry)
                                .map_or_else(|_| oid.to_id_string(), str::to_string);
                            let value = match atv.as_str() {
                                Ok(s) => escape_rfc4514(s),
                                Err(_) => format!("#{}", hex(atv.as_slice())),
                            };
                            format!("{name}={value}")
                        })
                        .collect::<Vec<_>>()
                        .join("+")
                })
                .collect();
            rdns.reverse();
            (!rdns.is_empty()).then(|| rdns.join(","))
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// RFC 4514 section 2.4 escaping of an attribute value.
fn escape_rfc4514(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let last = value.chars().count().saturating_sub(1);
    for (i, c) in value.chars().enumerate() {
        let special = matches!(c, '"' | '+' | ',' | ';' | '<' | '>' | '\\')
            || (i == 0 && (c == '#' || c == ' '))
            || (i == last && c == ' ');
        if c == '\0' {
            out.push_str("\\00");
            continue;
        }
        if special {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc4514_escapes_specials_and_edge_spaces() {
        assert_eq!(escape_rfc4514("plain"), "plain");
        assert_eq!(escape_rfc4514("a,b+c"), "a\\,b\\+c");
        assert_eq!(escape_rfc4514("#lead"), "\\#lead");
        assert_eq!(escape_rfc4514(" both "), "\\ both\\ ");
        assert_eq!(escape_rfc4514("q\"<>;\\"), "q\\\"\\<\\>\\;\\\\");
    }

    #[test]
    fn garbage_is_no_identity() {
        assert_eq!(
            cert_identity(b"not a certificate", CertLogin::CommonName),
            None
        );
        assert_eq!(
            cert_identity(
                &[0x30, 0x03, 0x02, 0x01, 0x00],
                CertLogin::DistinguishedName
            ),
            None
        );
    }
}
