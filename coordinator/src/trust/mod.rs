//! Trust (DESIGN.md "Trust"): who is calling, and what they may do.
//!
//! Every call passes [`Guard`], a tower layer in front of every service. It finds the caller's
//! [`Principal`] — an agent by the client certificate the farm's CA signed at enrollment, a user by
//! the bearer token an admin issued, or the embedded principal when the coordinator runs in-process
//! (`kiln up` with no `--coordinator`) or with `--dev` — checks it against the rule the
//! authorization table ([`RULES`]) gives that RPC, and puts it in the request's extensions for the
//! handlers, which check what depends on the object: an instance's owner, a context's task.
//!
//! An RPC without a rule is refused: a method added to the proto without a decision here cannot
//! be called, and the table test (`coordinator/tests/trust.rs`) fails until it has one.
//!
//! - [`pki`] — the farm CA, server and agent certificates.
//! - [`tokens`] — user tokens and join tokens (minted, parsed, hashed).
//! - [`enroll`] — the `Enrollment` service: join tokens for agent certificates.

pub mod enroll;
pub mod pki;
pub mod tokens;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tonic::Status;

use crate::model::AgentRole;
use crate::state::leadership::Activity;
use crate::state::StateStore;

/// A user's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Viewer,
    Member,
    Admin,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Member => "member",
            Role::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "viewer" => Some(Role::Viewer),
            "member" => Some(Role::Member),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }
}

/// Who a call comes from, as the coordinator verified it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Principal {
    /// In-process (`kiln up` with no `--coordinator`) or `--dev`: one user, loopback, all rights.
    Embedded,
    User {
        name: String,
        role: Role,
        team: Option<String>,
    },
    /// `issued_ms`: when its certificate was issued, so a revocation can tell it from a newer one.
    Agent {
        id: String,
        role: AgentRole,
        cluster: String,
        issued_ms: u64,
    },
    /// No credentials: only what needs none (enrollment by join token, health).
    Anonymous,
}

impl Principal {
    /// How records, events and the audit log name the caller.
    pub fn actor(&self) -> String {
        match self {
            Principal::Embedded => "embedded".to_string(),
            Principal::User { name, .. } => format!("user:{name}"),
            Principal::Agent { id, .. } => format!("agent:{id}"),
            Principal::Anonymous => "anonymous".to_string(),
        }
    }

    /// Whether the caller may do everything an admin may.
    pub fn is_admin(&self) -> bool {
        matches!(self, Principal::Embedded | Principal::User { role: Role::Admin, .. })
    }

    /// The principal a handler's request carries; a request that never passed the guard (a unit
    /// test calling a service directly) is the embedded principal's.
    pub fn of<T>(request: &tonic::Request<T>) -> Principal {
        request.extensions().get::<Principal>().cloned().unwrap_or(Principal::Embedded)
    }
}

/// What a caller must be for one RPC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Anyone, credentials or not (the RPC checks what it needs itself: a join token).
    Anyone,
    /// Any user (viewer and up).
    Read,
    /// A member or admin; the handler checks the instance's owner.
    Member,
    Admin,
    /// An enrolled agent, host or node.
    Agent,
    HostAgent,
    NodeAgent,
    /// A host agent (the handler checks it runs a task for the context) or a member (the handler
    /// checks the member's team owns an instance naming it).
    HostAgentOrMember,
}

/// The authorization table: every RPC of every service, by its gRPC path.
pub const RULES: &[(&str, Rule)] = &[
    ("/kiln.v1.Kiln/Up", Rule::Member),
    ("/kiln.v1.Kiln/Down", Rule::Member),
    ("/kiln.v1.Kiln/Gc", Rule::Admin),
    ("/kiln.v1.Kiln/Status", Rule::Read),
    ("/kiln.v1.Kiln/Logs", Rule::Read),
    ("/kiln.v1.Kiln/Images", Rule::Read),
    ("/kiln.v1.Kiln/Agents", Rule::Read),
    ("/kiln.v1.Kiln/Pin", Rule::Admin),
    ("/kiln.v1.Kiln/Unpin", Rule::Admin),
    ("/kiln.v1.Kiln/Pins", Rule::Read),
    ("/kiln.v1.Kiln/Audit", Rule::Read),
    ("/kiln.v1.Kiln/WhoAmI", Rule::Read),
    // A member cancels converges of instances it owns (checked by the handler); an admin any.
    ("/kiln.v1.Kiln/Cancel", Rule::Member),
    ("/kiln.v1.Kiln/Ps", Rule::Read),
    // Any role reads; the handler answers only the instance's owners (its files' names).
    ("/kiln.v1.Kiln/Why", Rule::Read),
    ("/kiln.v1.Kiln/ClusterPlatforms", Rule::Read),
    ("/kiln.v1.ContentStore/FindMissing", Rule::Member),
    ("/kiln.v1.ContentStore/Upload", Rule::Member),
    ("/kiln.v1.ContentStore/FindMissingBlobs", Rule::Member),
    ("/kiln.v1.ContentStore/UploadBlobs", Rule::Member),
    ("/kiln.v1.ContentStore/PutContext", Rule::Member),
    ("/kiln.v1.ContentStore/Download", Rule::HostAgentOrMember),
    ("/kiln.v1.ImageRelay/Put", Rule::HostAgent),
    ("/kiln.v1.ImageRelay/Get", Rule::NodeAgent),
    ("/kiln.v1.AgentHub/Connect", Rule::Agent),
    ("/kiln.v1.Enrollment/Enroll", Rule::Anyone),
    ("/kiln.v1.Enrollment/Renew", Rule::Agent),
];

/// The rule for `path`; `None` refuses the call.
pub fn rule_for(path: &str) -> Option<Rule> {
    RULES.iter().find(|(p, _)| *p == path).map(|(_, rule)| *rule)
}

/// Whether `principal` passes `rule`: `Ok`, or the status a refusal answers with.
pub fn check(rule: Rule, principal: &Principal, path: &str) -> Result<(), Status> {
    let user_role = match principal {
        Principal::Embedded => return Ok(()),
        Principal::User { role, .. } => Some(*role),
        _ => None,
    };
    let agent_role = match principal {
        Principal::Agent { role, .. } => Some(*role),
        _ => None,
    };
    let allowed = match rule {
        Rule::Anyone => true,
        Rule::Read => user_role.is_some(),
        Rule::Member => user_role >= Some(Role::Member),
        Rule::Admin => user_role == Some(Role::Admin),
        Rule::Agent => agent_role.is_some(),
        Rule::HostAgent => matches!(agent_role, Some(AgentRole::Host | AgentRole::Both)),
        Rule::NodeAgent => matches!(agent_role, Some(AgentRole::Node | AgentRole::Both)),
        Rule::HostAgentOrMember => {
            matches!(agent_role, Some(AgentRole::Host | AgentRole::Both)) || user_role >= Some(Role::Member)
        }
    };
    if allowed {
        return Ok(());
    }
    if *principal == Principal::Anonymous {
        return Err(Status::unauthenticated(format!(
            "{path} needs credentials — a token (KILN_TOKEN, --token-file or ~/.config/kiln/token) for a user, \
             an enrolled certificate for an agent"
        )));
    }
    let needs = match rule {
        Rule::Read => "a user token",
        Rule::Member => "a member or admin",
        Rule::Admin => "an admin",
        Rule::Agent => "an enrolled agent",
        Rule::HostAgent => "an enrolled host agent",
        Rule::NodeAgent => "an enrolled node agent",
        Rule::HostAgentOrMember => "an enrolled host agent or a member",
        Rule::Anyone => "anyone",
    };
    Err(Status::permission_denied(format!("{} may not call {path}: it needs {needs}", principal.actor())))
}

/// How a coordinator decides who calls it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Everyone is the embedded principal: in-process, or `--dev` on loopback.
    Open,
    /// Certificates and tokens, verified.
    Verified,
}

/// How long a verified token or a revocation list is believed before it is read again: revoking
/// takes effect within this, and a busy CLI does not cost a database read per call.
const CACHE_FOR: Duration = Duration::from_secs(2);

/// The revocations last read, and when: `(agent id, revoked at)`.
type Revocations = (Option<Instant>, Vec<(String, u64)>);

/// Resolves callers to principals against the state store.
pub struct Verifier {
    store: Arc<dyn StateStore>,
    tokens: Mutex<HashMap<String, (Instant, Option<Principal>)>>,
    revoked: Mutex<Revocations>,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier").finish_non_exhaustive()
    }
}

impl Verifier {
    pub fn new(store: Arc<dyn StateStore>) -> Verifier {
        Verifier { store, tokens: Mutex::new(HashMap::new()), revoked: Mutex::new((None, Vec::new())) }
    }

    /// The user a bearer token names, if it is valid now.
    pub async fn user(&self, token: &str) -> Result<Option<Principal>, Status> {
        if let Some((at, principal)) = self.tokens.lock().unwrap().get(token) {
            if at.elapsed() < CACHE_FOR {
                return Ok(principal.clone());
            }
        }
        let Some((id, secret)) = tokens::parse(token) else { return Ok(None) };
        let row = self.store.token(id).await.map_err(|e| Status::unavailable(kiln_core::error_chain(&e)))?;
        let now = pki::now_ms();
        let principal = row
            .filter(|row| tokens::matches(secret, &row.hash))
            .filter(|row| row.revoked_ms.is_none() && row.expires_ms.is_none_or(|e| e > now))
            .map(|row| Principal::User { name: row.user, role: row.role, team: row.team });
        let mut cache = self.tokens.lock().unwrap();
        if cache.len() > 10_000 {
            cache.clear();
        }
        cache.insert(token.to_string(), (Instant::now(), principal.clone()));
        Ok(principal)
    }

    /// Whether the certificate of agent `id` issued at `issued_ms` was revoked.
    pub async fn agent_revoked(&self, id: &str, issued_ms: u64) -> Result<bool, Status> {
        let hit = |list: &[(String, u64)]| list.iter().any(|(r, at)| r == id && issued_ms <= *at);
        {
            let cached = self.revoked.lock().unwrap();
            if cached.0.is_some_and(|at| at.elapsed() < CACHE_FOR) {
                return Ok(hit(&cached.1));
            }
        }
        let list = self.store.revoked_agents().await.map_err(|e| Status::unavailable(kiln_core::error_chain(&e)))?;
        let revoked = hit(&list);
        *self.revoked.lock().unwrap() = (Some(Instant::now()), list);
        Ok(revoked)
    }

    /// Forgets what it believed, so a revocation made in this process counts at once.
    pub fn forget(&self) {
        self.tokens.lock().unwrap().clear();
        *self.revoked.lock().unwrap() = (None, Vec::new());
    }
}

/// The peer certificates and address of a request, as tonic's TLS acceptor recorded them.
fn peer<B>(req: &http::Request<B>) -> (Option<Vec<Vec<u8>>>, Option<std::net::SocketAddr>) {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    if let Some(tls) = req.extensions().get::<TlsConnectInfo<TcpConnectInfo>>() {
        let certs = tls.peer_certs().map(|certs| certs.iter().map(|c| c.to_vec()).collect());
        return (certs, tls.get_ref().remote_addr());
    }
    let addr = req.extensions().get::<TcpConnectInfo>().and_then(|c| c.remote_addr());
    (None, addr)
}

/// Where a call came from, for the audit log.
#[derive(Clone, Debug, Default)]
pub struct Peer(pub Option<std::net::SocketAddr>);

impl Peer {
    pub fn of<T>(request: &tonic::Request<T>) -> String {
        request.extensions().get::<Peer>().and_then(|p| p.0).map(|a| a.to_string()).unwrap_or_default()
    }
}

/// The tower layer that puts every call through [`check`].
#[derive(Clone, Debug)]
pub struct Guard {
    pub mode: Mode,
    pub verifier: Arc<Verifier>,
    /// Whether this coordinator leads its farm: a standby answers every call but health with
    /// where the active one is, before looking at who calls.
    pub activity: tokio::sync::watch::Receiver<Activity>,
}

impl<S> tower::Layer<S> for Guard {
    type Service = Guarded<S>;
    fn layer(&self, inner: S) -> Guarded<S> {
        Guarded { inner, guard: self.clone() }
    }
}

#[derive(Clone, Debug)]
pub struct Guarded<S> {
    inner: S,
    guard: Guard,
}

type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for Guarded<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        // The clone that was made ready serves this call; the fresh one waits for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let guard = self.guard.clone();
        Box::pin(async move {
            let path = req.uri().path().to_string();
            let (certs, addr) = peer(&req);
            req.extensions_mut().insert(Peer(addr));
            // Health answers anyone: probes carry no credentials.
            if path.starts_with("/grpc.health.v1.Health/") {
                return inner.call(req).await;
            }
            let standby = match &*guard.activity.borrow() {
                Activity::Standby { active } => Some(standby_status(active.as_deref())),
                Activity::Active => None,
            };
            if let Some(status) = standby {
                return Ok(status.into_http());
            }
            let principal = match guard.mode {
                Mode::Open => Principal::Embedded,
                Mode::Verified => match resolve(&guard.verifier, bearer(&req), certs).await {
                    Ok(principal) => principal,
                    Err(status) => return Ok(status.into_http()),
                },
            };
            let verdict = match rule_for(&path) {
                Some(rule) => check(rule, &principal, &path),
                None => Err(Status::permission_denied(format!("{path} has no rule in the authorization table"))),
            };
            if let Err(status) = verdict {
                tracing::warn!(%path, actor = %principal.actor(), peer = ?addr, "refused: {}", status.message());
                return Ok(status.into_http());
            }
            req.extensions_mut().insert(principal);
            inner.call(req).await
        })
    }
}

/// What a standby answers: `Unavailable`, naming the active coordinator in the message and, for
/// clients to follow, in the `kiln-active` metadata. Nothing was done, so any call may be sent
/// again there — an `Up` included.
pub fn standby_status(active: Option<&str>) -> Status {
    let mut status = match active {
        Some(addr) => Status::unavailable(format!(
            "this coordinator stands by; the farm's active coordinator is at {addr} — use --coordinator {addr}, or give both"
        )),
        None => Status::unavailable(
            "this coordinator stands by and no coordinator holds the farm's lease yet; one takes over within seconds — try again",
        ),
    };
    status.metadata_mut().insert(STANDBY_HEADER, tonic::metadata::MetadataValue::from_static("1"));
    if let Some(value) = active.and_then(|addr| addr.parse().ok()) {
        status.metadata_mut().insert(ACTIVE_HEADER, value);
    }
    status
}

/// The metadata key under which a standby names the active coordinator.
pub const ACTIVE_HEADER: &str = "kiln-active";
/// The metadata key that marks an answer as a standby's: nothing was done.
pub const STANDBY_HEADER: &str = "kiln-standby";

/// The bearer token a request carries, if any (an empty string for a malformed header).
fn bearer<B>(req: &http::Request<B>) -> Option<String> {
    let value = req.headers().get("authorization")?;
    Some(value.to_str().ok().and_then(|v| v.strip_prefix("Bearer ")).unwrap_or_default().to_string())
}

/// The principal of a verified request: its agent certificate, else its bearer token, else nobody.
async fn resolve(verifier: &Verifier, token: Option<String>, certs: Option<Vec<Vec<u8>>>) -> Result<Principal, Status> {
    if let Some(leaf) = certs.as_ref().and_then(|c| c.first()) {
        // rustls already verified the chain against the farm CA; what it names is the agent.
        let Some((id, role, cluster)) = pki::agent_of(leaf) else {
            return Err(Status::unauthenticated(
                "the client certificate names no Kiln agent — enroll with `kiln-agent --join`",
            ));
        };
        let issued_ms = pki::issued_ms(leaf).unwrap_or(0);
        if verifier.agent_revoked(&id, issued_ms).await? {
            return Err(Status::permission_denied(format!(
                "agent {id} was revoked — enroll it again with a new join token"
            )));
        }
        return Ok(Principal::Agent { id, role, cluster, issued_ms });
    }
    let Some(token) = token else { return Ok(Principal::Anonymous) };
    match verifier.user(&token).await? {
        Some(user) => Ok(user),
        None => Err(Status::unauthenticated(
            "the token is not valid: unknown, expired or revoked — ask an admin for a new one (`kiln-coordinator token create`)",
        )),
    }
}
