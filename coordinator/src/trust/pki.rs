//! The farm's certificates (rcgen, rustls — no OpenSSL): the CA `kiln-coordinator init` makes,
//! the coordinator's server certificate, and the client certificates enrolled agents get.
//!
//! An agent certificate names the agent in its subject alternative name as a URI,
//! `kiln://agent/<id>?role=<host|node>&cluster=<name>`: the one place the coordinator reads who an
//! agent is. It is signed by the farm CA only for a request carrying a valid join token (or the
//! agent's own current certificate, to renew), so the id, role and cluster in it are the farm's
//! word, not the agent's.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use sha2::{Digest, Sha256};

use crate::model::AgentRole;

/// How long an agent's certificate is valid; it renews when a third is left.
pub const AGENT_CERT_VALIDITY: Duration = Duration::from_secs(30 * 24 * 3600);
/// How long the CA and the server certificate `init` makes are valid.
const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
const SERVER_VALIDITY: Duration = Duration::from_secs(2 * 365 * 24 * 3600);

/// The files of a farm's TLS material under `<state>/tls/`.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub dir: PathBuf,
}

impl TlsFiles {
    pub fn in_state(state: &Path) -> TlsFiles {
        TlsFiles { dir: state.join("tls") }
    }
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }
    pub fn ca_key(&self) -> PathBuf {
        self.dir.join("ca.key")
    }
    /// The server's certificate chain: its own certificate, then the CA's (so an agent joining
    /// by fingerprint sees the CA it pins).
    pub fn server_cert(&self) -> PathBuf {
        self.dir.join("server.pem")
    }
    pub fn server_key(&self) -> PathBuf {
        self.dir.join("server.key")
    }
    pub fn exists(&self) -> bool {
        self.ca_cert().is_file()
            && self.ca_key().is_file()
            && self.server_cert().is_file()
            && self.server_key().is_file()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error("cannot read {path} — run `kiln-coordinator init` to create the farm's TLS material, or pass --tls-cert/--tls-key/--client-ca")]
    Read {
        path: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error("{path} already exists — the farm's CA is made once; remove the tls directory to start a new farm")]
    Exists { path: PathBuf },
    #[error("certificate work failed: {what}")]
    Rcgen {
        what: String,
        #[source]
        err: rcgen::Error,
    },
    #[error("the certificate request is not usable: {why}")]
    BadRequest { why: String },
}

fn rc(what: &str) -> impl FnOnce(rcgen::Error) -> PkiError + '_ {
    move |err| PkiError::Rcgen { what: what.to_string(), err }
}

fn write_private(path: &Path, contents: &str) -> Result<(), PkiError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|err| PkiError::Write { path: path.to_owned(), err })?;
    file.write_all(contents.as_bytes()).map_err(|err| PkiError::Write { path: path.to_owned(), err })
}

fn window(validity: Duration) -> (time::OffsetDateTime, time::OffsetDateTime) {
    let now = time::OffsetDateTime::now_utc();
    // A little slack before now: a peer whose clock is a minute behind still accepts it.
    (now - time::Duration::minutes(5), now + time::Duration::seconds(validity.as_secs() as i64))
}

/// `kiln-coordinator init`: the farm CA and a server certificate for `sans` (names and IPs), in
/// `files.dir`. Refuses to overwrite: a new CA would orphan every enrolled agent.
pub fn init(files: &TlsFiles, farm: &str, sans: &[String]) -> Result<String, PkiError> {
    if files.ca_cert().exists() {
        return Err(PkiError::Exists { path: files.ca_cert() });
    }
    std::fs::create_dir_all(&files.dir).map_err(|err| PkiError::Write { path: files.dir.clone(), err })?;
    let ca_key = KeyPair::generate().map_err(rc("generating the CA key"))?;
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("kiln farm {farm} CA"));
    ca.distinguished_name = dn;
    (ca.not_before, ca.not_after) = window(CA_VALIDITY);
    let ca_cert = ca.self_signed(&ca_key).map_err(rc("self-signing the CA"))?;
    let issuer = Issuer::new(ca, ca_key);

    let server_key = KeyPair::generate().map_err(rc("generating the server key"))?;
    let mut server = CertificateParams::new(sans.to_vec()).map_err(rc("naming the server certificate"))?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("kiln coordinator of farm {farm}"));
    server.distinguished_name = dn;
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    (server.not_before, server.not_after) = window(SERVER_VALIDITY);
    let server_cert = server.signed_by(&server_key, &issuer).map_err(rc("signing the server certificate"))?;

    write_private(&files.ca_key(), &issuer_key_pem(&issuer))?;
    write_private(&files.server_key(), &server_key.serialize_pem())?;
    std::fs::write(files.ca_cert(), ca_cert.pem()).map_err(|err| PkiError::Write { path: files.ca_cert(), err })?;
    std::fs::write(files.server_cert(), format!("{}{}", server_cert.pem(), ca_cert.pem()))
        .map_err(|err| PkiError::Write { path: files.server_cert(), err })?;
    Ok(fingerprint_pem(&ca_cert.pem()).unwrap_or_default())
}

fn issuer_key_pem(issuer: &Issuer<'_, KeyPair>) -> String {
    issuer.key().serialize_pem()
}

/// The farm CA, able to sign agents' certificates.
pub struct Authority {
    issuer: Issuer<'static, KeyPair>,
    pub ca_pem: String,
    pub fingerprint: String,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority").field("fingerprint", &self.fingerprint).finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<String, PkiError> {
    std::fs::read_to_string(path).map_err(|err| PkiError::Read { path: path.to_owned(), err })
}

impl Authority {
    pub fn load(files: &TlsFiles) -> Result<Authority, PkiError> {
        let ca_pem = read(&files.ca_cert())?;
        let key = KeyPair::from_pem(&read(&files.ca_key())?).map_err(rc("reading the CA key"))?;
        let issuer = Issuer::from_ca_cert_pem(&ca_pem, key).map_err(rc("reading the CA certificate"))?;
        let fingerprint =
            fingerprint_pem(&ca_pem).ok_or(PkiError::BadRequest { why: "the CA file holds no certificate".into() })?;
        Ok(Authority { issuer, ca_pem, fingerprint })
    }

    /// Signs `csr_der` as agent `id` of `role` (and `cluster`), whatever names the request asked
    /// for: the identity is the farm's to give.
    pub fn sign_agent(
        &self,
        csr_der: &[u8],
        id: &str,
        role: AgentRole,
        cluster: &str,
    ) -> Result<(String, u64), PkiError> {
        let der = rustls_pki_types::CertificateSigningRequestDer::from(csr_der.to_vec());
        let mut csr = CertificateSigningRequestParams::from_der(&der)
            .map_err(|err| PkiError::BadRequest { why: kiln_core::error_chain(&err) })?;
        let uri = agent_uri(id, role, cluster);
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, format!("kiln agent {id}"));
        params.distinguished_name = dn;
        params.subject_alt_names = vec![SanType::URI(uri.try_into().map_err(rc("naming the agent"))?)];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let (not_before, not_after) = window(AGENT_CERT_VALIDITY);
        (params.not_before, params.not_after) = (not_before, not_after);
        csr.params = params;
        let cert = csr.signed_by(&self.issuer).map_err(rc("signing the agent certificate"))?;
        let not_after_ms = (not_after.unix_timestamp() as u64) * 1000;
        Ok((cert.pem(), not_after_ms))
    }
}

/// `kiln://agent/<id>?role=host&cluster=<c>`.
pub fn agent_uri(id: &str, role: AgentRole, cluster: &str) -> String {
    let role = match role {
        AgentRole::Node => "node",
        AgentRole::Host | AgentRole::Both => "host",
    };
    format!("kiln://agent/{id}?role={role}&cluster={cluster}")
}

/// Who an agent certificate (DER) names: `(id, role, cluster)`, from its `kiln://agent/` URI.
pub fn agent_of(cert_der: &[u8]) -> Option<(String, AgentRole, String)> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|name| match name {
        x509_parser::extensions::GeneralName::URI(uri) => parse_agent_uri(uri),
        _ => None,
    })
}

fn parse_agent_uri(uri: &str) -> Option<(String, AgentRole, String)> {
    let rest = uri.strip_prefix("kiln://agent/")?;
    let (id, query) = rest.split_once('?')?;
    let mut role = None;
    let mut cluster = String::new();
    for pair in query.split('&') {
        match pair.split_once('=')? {
            ("role", "host") => role = Some(AgentRole::Host),
            ("role", "node") => role = Some(AgentRole::Node),
            ("cluster", c) => cluster = c.to_string(),
            _ => {}
        }
    }
    (!id.is_empty()).then_some(())?;
    Some((id.to_string(), role?, cluster))
}

/// `sha256:<hex>` of the first certificate in `pem`.
pub fn fingerprint_pem(pem: &str) -> Option<String> {
    let der = rustls_pki_types::pem::PemObject::from_pem_slice(pem.as_bytes())
        .ok()
        .map(|c: rustls_pki_types::CertificateDer<'static>| c.to_vec())?;
    Some(fingerprint_der(&der))
}

pub fn fingerprint_der(der: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(der)))
}

/// When a certificate (DER) was issued, as ms since the epoch (its validity starts five minutes
/// before, for clock skew).
pub fn issued_ms(cert_der: &[u8]) -> Option<u64> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der).ok()?;
    let secs = cert.validity().not_before.timestamp() + 5 * 60;
    u64::try_from(secs).ok().map(|s| s * 1000)
}

/// When a certificate (DER) stops being valid, as ms since the epoch.
pub fn not_after_ms(cert_der: &[u8]) -> Option<u64> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der).ok()?;
    let secs = cert.validity().not_after.timestamp();
    u64::try_from(secs).ok().map(|s| s * 1000)
}

/// Milliseconds since the epoch, for certificate and token expiries.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_uri_names_id_role_and_cluster_and_nothing_else_parses() {
        assert_eq!(
            parse_agent_uri(&agent_uri("n1", AgentRole::Node, "prod")),
            Some(("n1".into(), AgentRole::Node, "prod".into()))
        );
        assert_eq!(
            parse_agent_uri(&agent_uri("h1", AgentRole::Host, "")),
            Some(("h1".into(), AgentRole::Host, String::new()))
        );
        assert_eq!(parse_agent_uri("kiln://agent/?role=host"), None);
        assert_eq!(parse_agent_uri("kiln://agent/x?role=admin"), None);
        assert_eq!(parse_agent_uri("https://agent/x?role=host"), None);
    }

    #[test]
    fn init_makes_a_ca_that_signs_agents_and_refuses_to_run_twice() {
        let tmp = tempfile::tempdir().unwrap();
        let files = TlsFiles::in_state(tmp.path());
        let fingerprint = init(&files, "f", &["localhost".into(), "127.0.0.1".into()]).unwrap();
        assert!(fingerprint.starts_with("sha256:") && fingerprint.len() == 7 + 64);
        assert!(matches!(init(&files, "f", &[]), Err(PkiError::Exists { .. })));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(files.ca_key()).unwrap().permissions().mode() & 0o777, 0o600);

        let authority = Authority::load(&files).unwrap();
        assert_eq!(authority.fingerprint, fingerprint);
        let key = KeyPair::generate().unwrap();
        // The request asks to be someone else; the certificate names whom the farm enrolled.
        let csr = CertificateParams::new(vec!["kiln://agent/admin?role=host".into()])
            .unwrap()
            .serialize_request(&key)
            .unwrap();
        let (pem, not_after) = authority.sign_agent(csr.der(), "build-1", AgentRole::Node, "prod").unwrap();
        let der: rustls_pki_types::CertificateDer<'static> =
            rustls_pki_types::pem::PemObject::from_pem_slice(pem.as_bytes()).unwrap();
        assert_eq!(agent_of(&der), Some(("build-1".into(), AgentRole::Node, "prod".into())));
        assert!(not_after > now_ms());
    }
}
