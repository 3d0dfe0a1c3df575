//! Write throw-away TLS material for the TLS tests into a directory:
//! `ca.pem`; `server.pem`/`server.key` (localhost, 127.0.0.1); `client.pem`/`client.key`
//! (subject CN=<client-cn>, O=Warren tests, signed by the CA); `rogue.pem`/`rogue.key`
//! (same subject, signed by a CA the broker does not trust); `node.pem`/`node.key` (a cluster
//! node: server and client, localhost and 127.0.0.1) and `rogue-node.pem`/`rogue-node.key` (the
//! same, signed by the untrusted CA).
//!
//! Usage: `gen-test-certs <dir> [client-cn]`.

use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn ca(name: &str) -> Result<(CertificateParams, KeyPair)> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok((params, KeyPair::generate()?))
}

fn leaf(
    dir: &Path,
    name: &str,
    sans: Vec<String>,
    subject: &[(DnType, &str)],
    usages: &[ExtendedKeyUsagePurpose],
    issuer: &Issuer<'_, KeyPair>,
) -> Result<()> {
    let mut params = CertificateParams::new(sans)?;
    for (kind, value) in subject {
        params.distinguished_name.push(kind.clone(), *value);
    }
    params.extended_key_usages = usages.to_vec();
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, issuer)?;
    std::fs::write(dir.join(format!("{name}.pem")), cert.pem())?;
    std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem())?;
    Ok(())
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .ok_or("usage: gen-test-certs <dir> [client-cn]")?;
    let client_cn = args.next().unwrap_or_else(|| "warren-client".to_string());
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir)?;

    let (ca_params, ca_key) = ca("Warren test CA")?;
    let ca_cert = ca_params.self_signed(&ca_key)?;
    std::fs::write(dir.join("ca.pem"), ca_cert.pem())?;
    let issuer = Issuer::new(ca_params, ca_key);

    leaf(
        dir,
        "server",
        vec!["localhost".into(), "127.0.0.1".into()],
        &[(DnType::CommonName, "localhost")],
        &[ExtendedKeyUsagePurpose::ServerAuth],
        &issuer,
    )?;
    let client_subject = [
        (DnType::OrganizationName, "Warren tests"),
        (DnType::CommonName, client_cn.as_str()),
    ];
    leaf(
        dir,
        "client",
        Vec::new(),
        &client_subject,
        &[ExtendedKeyUsagePurpose::ClientAuth],
        &issuer,
    )?;
    let (rogue_params, rogue_key) = ca("Untrusted CA")?;
    let rogue = Issuer::new(rogue_params, rogue_key);
    leaf(
        dir,
        "rogue",
        Vec::new(),
        &client_subject,
        &[ExtendedKeyUsagePurpose::ClientAuth],
        &rogue,
    )?;
    // Cluster nodes are servers and clients of each other on the cluster port.
    let both = [
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let node_sans = vec!["localhost".to_string(), "127.0.0.1".to_string()];
    leaf(
        dir,
        "node",
        node_sans.clone(),
        &[(DnType::CommonName, "warren-node")],
        &both,
        &issuer,
    )?;
    leaf(
        dir,
        "rogue-node",
        node_sans,
        &[(DnType::CommonName, "warren-node")],
        &both,
        &rogue,
    )?;
    Ok(())
}
