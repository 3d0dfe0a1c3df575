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

/// The PEM files of TLS on the cluster port.
#[derive(Debug, Clone)]
pub struct ClusterTlsFiles {
    /// This node's certificate chain.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The CA every node's certificate is signed by.
    pub ca: PathBuf,
}

/// TLS for the cluster port, both ways: peers must present a certificate signed by the CA
/// (as clients and as servers), and this node presents its own in both roles. Servers are
/// verified for the IP address they are dialled at, so certificates name their nodes' IPs.
pub fn cluster(
    files: &ClusterTlsFiles,
) -> anyhow::Result<warren_cluster::transport::tcp::ClusterTls> {
    let certs = read_certs(&files.cert)?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .with_context(|| format!("reading the private key in {}", files.key.display()))?;
    let mut roots = RootCertStore::empty();
    for cert in read_certs(&files.ca)? {
        roots
            .add(cert)
            .with_context(|| format!("adding a CA certificate from {}", files.ca.display()))?;
    }
    let roots = Arc::new(roots);
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), provider())
        .build()
        .context("cluster peer verifier")?;
    let server = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("choosing TLS versions")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs.clone(), key.clone_key())
        .context("the cluster certificate and key do not form a usable pair")?;
    let client = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("choosing TLS versions")?
        .with_root_certificates(roots)
        .with_client_auth_cert(certs, key)
        .context("the cluster certificate and key do not form a usable client pair")?;
    Ok(warren_cluster::transport::tcp::ClusterTls {
        acceptor: TlsAcceptor::from(Arc::new(server)),
        connector: tokio_rustls::TlsConnector::from(Arc::new(client)),
    })
}

/// The user name a verified client certificate gives, or `None` when the certificate has no
/// usable subject (then SASL EXTERNAL is not offered). The forms are RabbitMQ's
/// (`rabbit_ssl:peer_cert_auth_name` and `rabbit_cert_info`), byte for byte, because the
/// result must equal a user name created for RabbitMQ.
#[must_use]
pub fn cert_identity(der: &[u8], from: CertLogin) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let subject = cert.subject();
    match from {
        // Several CNs are joined with ",", as RabbitMQ does.
        CertLogin::CommonName => {
            let cns: Vec<String> = subject.iter_common_name().map(attribute_value).collect();
            (!cns.is_empty()).then(|| cns.join(","))
        }
        CertLogin::DistinguishedName => {
            // RFC 4514: the last RDN of the sequence first.
            let mut rdns: Vec<String> = subject
                .iter()
                .map(|rdn| {
                    rdn.iter()
                        .map(|atv| {
                            let oid = atv.attr_type().to_id_string();
                            let name = attribute_name(&oid).map_or(oid, str::to_string);
                            format!("{name}={}", escape_rdn_value(&attribute_value(atv)))
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

/// rabbit_cert_info's attribute names; others are printed as their dotted OID.
fn attribute_name(oid: &str) -> Option<&'static str> {
    Some(match oid {
        "2.5.4.4" => "SN",
        "2.5.4.42" => "GIVENNAME",
        "2.5.4.43" => "INITIALS",
        "2.5.4.44" => "GENERATIONQUALIFIER",
        "2.5.4.3" => "CN",
        "2.5.4.7" => "L",
        "2.5.4.8" => "ST",
        "2.5.4.10" => "O",
        "2.5.4.11" => "OU",
        "2.5.4.12" => "TITLE",
        "2.5.4.6" => "C",
        "2.5.4.5" => "SERIALNUMBER",
        "2.5.4.65" => "PSEUDONYM",
        "0.9.2342.19200300.100.1.25" => "DC",
        "1.2.840.113549.1.9.1" => "EMAILADDRESS",
        "2.5.4.9" => "STREET",
        "0.9.2342.19200300.100.1.1" => "UID",
        _ => return None,
    })
}

/// An attribute value as text, decoding the ASN.1 string types as RabbitMQ does (T61 as
/// Latin-1, BMP as UTF-16, Universal as UTF-32); anything else as `#` and hex.
fn attribute_value(atv: &x509_parser::x509::AttributeTypeAndValue<'_>) -> String {
    use x509_parser::asn1_rs::Tag;
    let data = atv.as_slice();
    match atv.attr_value().tag() {
        Tag::Utf8String
        | Tag::PrintableString
        | Tag::Ia5String
        | Tag::NumericString
        | Tag::VisibleString => String::from_utf8_lossy(data).into_owned(),
        Tag::T61String => data.iter().map(|&b| char::from(b)).collect(),
        Tag::BmpString => char::decode_utf16(
            data.chunks_exact(2)
                .map(|c| u16::from_be_bytes([c[0], c[1]])),
        )
        .map(|c| c.unwrap_or(char::REPLACEMENT_CHARACTER))
        .collect(),
        Tag::UniversalString => data
            .chunks_exact(4)
            .map(|c| {
                char::from_u32(u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
                    .unwrap_or(char::REPLACEMENT_CHARACTER)
            })
            .collect(),
        _ => format!(
            "#{}",
            data.iter().map(|b| format!("{b:02x}")).collect::<String>()
        ),
    }
}

/// rabbit_cert_info's escaping of an attribute value, per UTF-8 byte: a leading space or `#`,
/// a trailing space and `"+,;<>\` get a backslash; bytes below 32 or from 126 up are written
/// as `\XX` (uppercase hex).
fn escape_rdn_value(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = String::with_capacity(bytes.len());
    for (i, &b) in bytes.iter().enumerate() {
        let first = i == 0;
        let last = i + 1 == bytes.len();
        let special = matches!(b, b'"' | b'+' | b',' | b';' | b'<' | b'>' | b'\\');
        let edge = (first && b == b'#') || ((first || last) && b == b' ');
        if special || edge {
            out.push('\\');
            out.push(char::from(b));
        } else if !(32..126).contains(&b) {
            out.push_str(&format!("\\{b:02X}"));
        } else {
            out.push(char::from(b));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_escaped_as_rabbitmq_does() {
        assert_eq!(escape_rdn_value("plain"), "plain");
        assert_eq!(escape_rdn_value("a,b+c"), "a\\,b\\+c");
        assert_eq!(escape_rdn_value("#lead"), "\\#lead");
        assert_eq!(escape_rdn_value(" both "), "\\ both\\ ");
        assert_eq!(escape_rdn_value(" "), "\\ ");
        assert_eq!(escape_rdn_value("q\"<>;\\"), "q\\\"\\<\\>\\;\\\\");
        // Non-printable and non-ASCII bytes, one escape per UTF-8 byte; '=' is left alone.
        assert_eq!(escape_rdn_value("M\u{fc}ller~"), "M\\C3\\BCller\\7E");
        assert_eq!(escape_rdn_value("a\tb=c"), "a\\09b=c");
    }

    #[test]
    fn names_are_rabbitmqs() {
        assert_eq!(attribute_name("2.5.4.3"), Some("CN"));
        assert_eq!(attribute_name("1.2.840.113549.1.9.1"), Some("EMAILADDRESS"));
        assert_eq!(attribute_name("0.9.2342.19200300.100.1.1"), Some("UID"));
        assert_eq!(attribute_name("1.2.3.4"), None);
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
