//! How an agent becomes one of the farm's (DESIGN.md "Trust"): `kiln-agent --join TOKEN` makes a
//! key that never leaves this machine, trusts on its first connection only the CA whose fingerprint
//! the join token carries, and exchanges the token and a certificate request for a certificate the
//! farm's CA signed. Key, certificate and CA are kept in the agent's state directory and used for
//! mutual TLS on every connection; the certificate is renewed when a third of its life is left.
//!
//! The first connection cannot verify the coordinator the usual way — the agent has no CA yet — so
//! it reads the certificate chain the coordinator presents, finds in it the CA the token pins,
//! checks the coordinator's certificate against that CA, and only then trusts it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_proto::v1 as pb;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use sha2::{Digest, Sha256};

/// The files of an enrolled agent, in its state directory.
#[derive(Clone, Debug)]
pub struct Identity {
    pub dir: PathBuf,
}

impl Identity {
    pub fn in_dir(dir: &Path) -> Identity {
        Identity { dir: dir.to_path_buf() }
    }
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }
    pub fn cert(&self) -> PathBuf {
        self.dir.join("agent.pem")
    }
    pub fn key(&self) -> PathBuf {
        self.dir.join("agent.key")
    }
    pub fn exists(&self) -> bool {
        self.ca().is_file() && self.cert().is_file() && self.key().is_file()
    }

    /// The TLS settings to reach the coordinator with: its CA, and this agent's certificate.
    pub fn tls(&self) -> Result<tonic::transport::ClientTlsConfig, EnrollError> {
        let read = |p: PathBuf| std::fs::read_to_string(&p).map_err(|err| EnrollError::Io { path: p, err });
        Ok(tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(read(self.ca())?))
            .identity(tonic::transport::Identity::from_pem(read(self.cert())?, read(self.key())?)))
    }

    fn save(&self, reply: &pb::EnrollReply, key_pem: &str) -> Result<(), EnrollError> {
        std::fs::create_dir_all(&self.dir).map_err(|err| EnrollError::Io { path: self.dir.clone(), err })?;
        write_atomic(&self.key(), key_pem, 0o600)?;
        write_atomic(&self.cert(), &reply.certificate_pem, 0o644)?;
        write_atomic(&self.ca(), &reply.ca_pem, 0o644)
    }

    /// When the certificate stops being valid (ms since the epoch), if it can be read.
    pub fn not_after_ms(&self) -> Option<(u64, u64)> {
        let pem = std::fs::read_to_string(self.cert()).ok()?;
        let der: CertificateDer<'static> = rustls::pki_types::pem::PemObject::from_pem_slice(pem.as_bytes()).ok()?;
        let (_, cert) = x509_parser::parse_x509_certificate(&der).ok()?;
        let v = cert.validity();
        let ms = |t: x509_parser::time::ASN1Time| u64::try_from(t.timestamp()).ok().map(|s| s * 1000);
        Some((ms(v.not_before)?, ms(v.not_after)?))
    }
}

fn write_atomic(path: &Path, contents: &str, mode: u32) -> Result<(), EnrollError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let io = |err| EnrollError::Io { path: path.to_owned(), err };
    let mut file =
        std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp).map_err(io)?;
    file.write_all(contents.as_bytes()).map_err(io)?;
    file.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    #[error("{token} is not a join token — `kiln-coordinator enroll` prints one (kjoin_…)")]
    NotAJoinToken { token: String },
    #[error("cannot reach the coordinator at {url}: {why}")]
    Unreachable { url: String, why: String },
    #[error(
        "the coordinator at {url} does not present the farm CA the join token names ({pin}) — \
         wrong address, or someone in between; nothing was sent"
    )]
    WrongFarm { url: String, pin: String },
    #[error("the coordinator at {url} refused the enrollment: {why}")]
    Refused { url: String, why: String },
    #[error("cannot make the agent's key or certificate request")]
    Key(#[source] rcgen::Error),
    #[error("cannot write {path}")]
    Io {
        path: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error("{url} is not a coordinator URL an agent can enroll with — use https://host:port")]
    BadUrl { url: String },
}

/// A fresh key and a certificate request for it (the coordinator decides the names).
fn request() -> Result<(String, Vec<u8>), EnrollError> {
    let key = rcgen::KeyPair::generate().map_err(EnrollError::Key)?;
    let csr = rcgen::CertificateParams::default().serialize_request(&key).map_err(EnrollError::Key)?;
    Ok((key.serialize_pem(), csr.der().to_vec()))
}

/// Enrolls: trusts the CA `token` pins, exchanges the token for a certificate, saves them.
pub async fn join(url: &str, token: &str, agent_id: &str, identity: &Identity) -> Result<(), EnrollError> {
    let pin =
        kiln_core::farm::join_token_pin(token).ok_or_else(|| EnrollError::NotAJoinToken { token: redact(token) })?;
    let ca_pem = pinned_ca(url, &pin).await?;
    let endpoint = tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|_| EnrollError::BadUrl { url: url.to_string() })?
        .tls_config(
            tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(&ca_pem)),
        )
        .map_err(|err| EnrollError::Unreachable { url: url.to_string(), why: kiln_core::error_chain(&err) })?;
    let channel = endpoint
        .connect()
        .await
        .map_err(|err| EnrollError::Unreachable { url: url.to_string(), why: kiln_core::error_chain(&err) })?;
    let (key_pem, csr_der) = request()?;
    let mut client = pb::enrollment_client::EnrollmentClient::new(channel);
    let request = pb::EnrollRequest { join_token: token.trim().to_string(), agent_id: agent_id.to_string(), csr_der };
    let reply = client
        .enroll(request)
        .await
        .map_err(|status| EnrollError::Refused { url: url.to_string(), why: status.message().to_string() })?
        .into_inner();
    identity.save(&reply, &key_pem)?;
    tracing::info!(agent = %reply.agent_id, cluster = %reply.cluster, dir = %identity.dir.display(), "enrolled in the farm");
    Ok(())
}

/// Renews the certificate over the agent's own mutual-TLS `channel` when a third of its life is
/// left; true when it did.
pub async fn renew_if_due(
    url: &str,
    channel: tonic::transport::Channel,
    identity: &Identity,
    now_ms: u64,
) -> Result<bool, EnrollError> {
    let Some((not_before, not_after)) = identity.not_after_ms() else { return Ok(false) };
    let left = not_after.saturating_sub(now_ms);
    if left * 3 > not_after.saturating_sub(not_before) {
        return Ok(false);
    }
    let (key_pem, csr_der) = request()?;
    let reply = pb::enrollment_client::EnrollmentClient::new(channel)
        .renew(pb::RenewRequest { csr_der })
        .await
        .map_err(|status| EnrollError::Refused { url: url.to_string(), why: status.message().to_string() })?
        .into_inner();
    identity.save(&reply, &key_pem)?;
    tracing::info!(dir = %identity.dir.display(), "agent certificate renewed");
    Ok(true)
}

fn redact(token: &str) -> String {
    token.chars().take(10).chain("…".chars()).collect()
}

/// Reads the chain the coordinator at `url` presents and returns, as PEM, the CA in it whose
/// fingerprint is `pin` — after checking the coordinator's own certificate against that CA.
async fn pinned_ca(url: &str, pin: &str) -> Result<String, EnrollError> {
    let bad = || EnrollError::BadUrl { url: url.to_string() };
    let uri: http::Uri = url.parse().map_err(|_| bad())?;
    if uri.scheme_str() != Some("https") {
        return Err(bad());
    }
    let host = uri.host().ok_or_else(bad)?.trim_matches(['[', ']']).to_string();
    let port = uri.port_u16().unwrap_or(443);
    let unreachable = |why: String| EnrollError::Unreachable { url: url.to_string(), why };
    let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await.map_err(|e| unreachable(e.to_string()))?;
    let seen = Arc::new(std::sync::Mutex::new(Vec::<CertificateDer<'static>>::new()));
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| unreachable(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Capture { seen: seen.clone(), provider }))
        .with_no_client_auth();
    let name = ServerName::try_from(host.clone()).map_err(|_| bad())?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    // Only the handshake: nothing is sent before the CA is checked.
    connector.connect(name.clone(), tcp).await.map_err(|e| unreachable(e.to_string()))?;
    let chain = seen.lock().unwrap().clone();
    let Some(ca) = chain.iter().find(|c| format!("sha256:{}", hex::encode(Sha256::digest(c.as_ref()))) == pin) else {
        return Err(EnrollError::WrongFarm { url: url.to_string(), pin: pin.to_string() });
    };
    // The coordinator's certificate must chain to that CA and name the host dialed.
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).map_err(|_| EnrollError::WrongFarm { url: url.to_string(), pin: pin.to_string() })?;
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::new(rustls::crypto::ring::default_provider()),
    )
    .build()
    .map_err(|e| unreachable(e.to_string()))?;
    let (leaf, rest) =
        chain.split_first().ok_or_else(|| EnrollError::WrongFarm { url: url.to_string(), pin: pin.to_string() })?;
    verifier
        .verify_server_cert(leaf, rest, &name, &[], UnixTime::now())
        .map_err(|_| EnrollError::WrongFarm { url: url.to_string(), pin: pin.to_string() })?;
    Ok(pem_of(ca.as_ref()))
}

fn pem_of(der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let lines: Vec<&str> = b64.as_bytes().chunks(64).map(|c| std::str::from_utf8(c).unwrap_or_default()).collect();
    format!("-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n", lines.join("\n"))
}

/// Accepts any chain but keeps it: the caller decides, against the pinned CA, whether to trust it.
#[derive(Debug)]
struct Capture {
    seen: Arc<std::sync::Mutex<Vec<CertificateDer<'static>>>>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for Capture {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let mut seen = self.seen.lock().unwrap();
        seen.push(end_entity.clone().into_owned());
        seen.extend(intermediates.iter().map(|c| c.clone().into_owned()));
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}
