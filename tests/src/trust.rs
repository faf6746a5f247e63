//! A served coordinator that verifies its callers, for the trust tests: started in-process on a
//! free loopback port with the TLS material `kiln-coordinator init` makes (real rustls, real
//! certificates), its state under a temp dir. Users get tokens minted straight into the state, the
//! way `kiln-coordinator token create` does; agents enroll through the real `Enrollment` service.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_coordinator::model::{AgentRole, JoinRow, TokenRow};
use kiln_coordinator::state::{SqliteStore, StateStore};
use kiln_coordinator::trust::{pki, tokens, Role};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// A TLS coordinator (and nothing else: tests add the agents they need).
pub struct TrustedFarm {
    pub url: String,
    pub state: PathBuf,
    pub farm: String,
    pub ca_pem: String,
    pub fingerprint: String,
    pub store: SqliteStore,
    /// [`TrustedFarm::start_observed`]: where `--http` serves the status page and `/metrics`.
    pub http: Option<std::net::SocketAddr>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for TrustedFarm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrustedFarm").field("url", &self.url).finish_non_exhaustive()
    }
}

impl TrustedFarm {
    pub async fn start(state: &Path) -> TrustedFarm {
        TrustedFarm::start_with(state, None).await
    }

    /// A TLS coordinator that also serves `--http` (the status page, behind its login) on a free
    /// loopback port.
    pub async fn start_observed(state: &Path) -> TrustedFarm {
        TrustedFarm::start_with(state, Some(crate::free_addr())).await
    }

    async fn start_with(state: &Path, http: Option<std::net::SocketAddr>) -> TrustedFarm {
        let farm = format!("trust-{:08x}", fastrand::u32(..));
        let files = pki::TlsFiles::in_state(state);
        let fingerprint = pki::init(&files, &farm, &["localhost".into(), "127.0.0.1".into()]).unwrap();
        let read = |p: PathBuf| std::fs::read_to_string(p).unwrap();
        let tls = kiln_coordinator::ServerTls {
            cert_pem: read(files.server_cert()),
            key_pem: read(files.server_key()),
            client_ca_pem: read(files.ca_cert()),
            authority: Some(Arc::new(pki::Authority::load(&files).unwrap())),
        };
        let mut config = kiln_coordinator::Config::new(state, farm.clone());
        config.tls = Some(tls);
        config.http = http;
        let listener = kiln_coordinator::listen("127.0.0.1:0").await.unwrap();
        let url = format!("https://127.0.0.1:{}", listener.local_addr().unwrap().port());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            kiln_coordinator::serve(listener, config, async {
                let _ = stopped.await;
            })
            .await
            .expect("coordinator serves");
        });
        // The same state file, as `kiln-coordinator token create` opens it beside a running one.
        let store = SqliteStore::open(state.join("kiln.db")).unwrap();
        TrustedFarm {
            url,
            state: state.to_path_buf(),
            farm,
            ca_pem: read(files.ca_cert()),
            fingerprint,
            store,
            http,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// A user token, as `kiln-coordinator token create` makes it.
    pub async fn token(&self, user: &str, role: Role, team: Option<&str>, expires_ms: Option<u64>) -> String {
        let minted = tokens::mint();
        let row = TokenRow {
            id: minted.id.clone(),
            hash: minted.hash,
            user: user.to_string(),
            role,
            team: team.map(str::to_string),
            created_ms: pki::now_ms(),
            expires_ms,
            revoked_ms: None,
        };
        self.store.put_token(row).await.unwrap();
        minted.token
    }

    /// A one-time join token, as `kiln-coordinator enroll` makes it.
    pub async fn join_token(&self, role: AgentRole, cluster: &str, expires_ms: u64) -> String {
        let minted = tokens::mint_join(&self.fingerprint);
        let row = JoinRow {
            id: minted.id.clone(),
            hash: minted.hash,
            role,
            cluster: cluster.to_string(),
            created_ms: pki::now_ms(),
            expires_ms,
            used_ms: None,
        };
        self.store.put_join(row).await.unwrap();
        minted.token
    }

    /// A channel trusting the farm's CA, with no client certificate (a user's, or a stranger's).
    pub fn channel(&self) -> Channel {
        let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca_pem));
        Endpoint::from_shared(self.url.clone()).unwrap().tls_config(tls).unwrap().connect_lazy()
    }

    /// A channel presenting an agent's certificate and key (PEM).
    pub fn agent_channel(&self, cert_pem: &str, key_pem: &str) -> Channel {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(Identity::from_pem(cert_pem, key_pem));
        Endpoint::from_shared(self.url.clone()).unwrap().tls_config(tls).unwrap().connect_lazy()
    }

    /// Enrolls an agent through the real join flow into `dir`; returns (certificate, key) PEM.
    pub async fn enroll(&self, id: &str, role: AgentRole, cluster: &str, dir: &Path) -> (String, String) {
        let token = self.join_token(role, cluster, pki::now_ms() + 600_000).await;
        let identity = kiln_agent::enroll::Identity::in_dir(dir);
        kiln_agent::enroll::join(&self.url, &token, id, &identity).await.expect("enrollment");
        (std::fs::read_to_string(identity.cert()).unwrap(), std::fs::read_to_string(identity.key()).unwrap())
    }

    pub async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(10), task).await;
        }
    }
}

/// Adds a bearer token to every request of a raw client.
pub fn with_token(token: &str) -> impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone {
    let value: tonic::metadata::MetadataValue<tonic::metadata::Ascii> = format!("Bearer {token}").parse().unwrap();
    move |mut request: tonic::Request<()>| {
        request.metadata_mut().insert("authorization", value.clone());
        Ok(request)
    }
}
