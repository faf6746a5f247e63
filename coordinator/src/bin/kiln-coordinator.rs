//! `kiln-coordinator`: a served coordinator for a farm (the CLI embeds the same `serve` by
//! default), and the admin's commands on its state: `init` (the farm's CA and server certificate),
//! `token` (users' bearer tokens), `enroll` (agents' join tokens), `agent revoke`, `audit`.
//!
//! Serving prints `listening on <addr>` once bound, so a supervisor or a test can bind port 0 and
//! read where it landed.

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use kiln_coordinator::model::{AgentRole, AuditRow, JoinRow, TokenRow};
use kiln_coordinator::state::leadership::LeasePolicy;
use kiln_coordinator::state::{SqliteStore, StateStore};
use kiln_coordinator::trust::{pki, tokens, Role};
use kiln_coordinator::Config;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    name = "kiln-coordinator",
    version,
    about = "Kiln's coordinator: converge state, records, and the agents' hub",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the farm (the default when no command is given).
    // Boxed: the serve flags outweigh every other command's, and the enum is as big as its largest.
    Serve(Box<ServeArgs>),
    /// Create the farm: its CA and the coordinator's server certificate under DIR/tls.
    Init {
        #[arg(long, env = "KILN_FARM")]
        farm: String,
        #[arg(long, env = "KILN_STATE")]
        state: PathBuf,
        /// A name or address the server certificate is valid for (repeatable; default: localhost,
        /// 127.0.0.1 and this host's name).
        #[arg(long = "san")]
        sans: Vec<String>,
    },
    /// Users' bearer tokens.
    Token {
        #[command(subcommand)]
        command: TokenCommand,
    },
    /// Print a one-time join token an agent exchanges for its certificate (`kiln-agent --join`).
    Enroll {
        #[arg(long, env = "KILN_STATE")]
        state: PathBuf,
        #[arg(long, value_parser = ["host", "node"])]
        role: String,
        /// Node agents: the cluster whose `nodes` target delivers to it.
        #[arg(long)]
        cluster: Option<String>,
        /// How long the join token stays usable: 90s, 30m, 1h, 1d.
        #[arg(long, default_value = "1h", value_parser = kiln_core::duration::parse)]
        expires: Duration,
    },
    /// Enrolled agents.
    Agent {
        #[command(subcommand)]
        command: AgentCommand,
    },
    /// Print the audit log: every mutating call, who made it, from where, and how it ended.
    Audit {
        #[arg(long, env = "KILN_STATE")]
        state: PathBuf,
        /// Only entries this recent: 90s, 30m, 1h, 1d.
        #[arg(long, value_parser = kiln_core::duration::parse)]
        since: Option<Duration>,
    },
}

#[derive(Subcommand, Debug)]
enum TokenCommand {
    /// Make a token; it is printed once, alone on the last line, and only its hash is kept.
    Create {
        #[arg(long, env = "KILN_STATE")]
        state: PathBuf,
        #[arg(long)]
        user: String,
        #[arg(long, value_parser = ["admin", "member", "viewer"])]
        role: String,
        #[arg(long)]
        team: Option<String>,
        /// How long it stays valid: 90s, 30m, 12h, 30d. Default: until revoked.
        #[arg(long, value_parser = kiln_core::duration::parse)]
        expires: Option<Duration>,
    },
    /// List every token (never their secrets).
    List {
        #[arg(long, env = "KILN_STATE")]
        state: PathBuf,
    },
    /// Revoke a token by its id (the 12 hex after `kiln_`).
    Revoke {
        #[arg(long, env = "KILN_STATE")]
        state: PathBuf,
        id: String,
    },
}

#[derive(Subcommand, Debug)]
enum AgentCommand {
    /// Revoke agent ID: its stream is dropped and every certificate it holds is refused from now.
    Revoke {
        #[arg(long, env = "KILN_STATE")]
        state: PathBuf,
        id: String,
    },
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7070", env = "KILN_LISTEN")]
    listen: String,
    /// Where the coordinator's state lives: a directory (its SQLite file, context store and
    /// tls/), or a farm's PostgreSQL database, `postgres://user:password@host:port/database`, that
    /// several coordinators share (one is active; the others stand by).
    #[arg(long, env = "KILN_STATE", value_name = "DIR|postgres://…")]
    state: Option<String>,
    /// With a PostgreSQL --state: the directory of the context store, the image relay's spool, the
    /// TLS material and the farm's name.
    #[arg(long, env = "KILN_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// The farm's name (default: the one `init` recorded): every image this coordinator builds is
    /// labeled with it.
    #[arg(long, env = "KILN_FARM")]
    farm: Option<String>,
    /// Plaintext, no authentication: for experiments on one machine. Refuses any address but
    /// loopback.
    #[arg(long)]
    dev: bool,
    /// The server's certificate chain (PEM), instead of the one `init` made: a company PKI's.
    #[arg(long, requires_all = ["tls_key", "client_ca"])]
    tls_cert: Option<PathBuf>,
    #[arg(long)]
    tls_key: Option<PathBuf>,
    /// The CA agents' client certificates must chain to (PEM).
    #[arg(long)]
    client_ca: Option<PathBuf>,
    /// Reach the Kubernetes cluster of the ambient kubeconfig (or the in-cluster service account):
    /// write each instance's `kiln-images` ConfigMap and keep what the cluster names in sweeps.
    #[arg(long, env = "KILN_KUBERNETES")]
    kubernetes: bool,
    /// The namespace whose pods are roots besides the instances' own.
    #[arg(long, default_value = "kube-system", env = "KILN_SYSTEM_NAMESPACE")]
    system_namespace: String,
    /// A custom resource whose objects' `spec.image` is a root: `group/version/Kind/plural`
    /// (repeatable).
    #[arg(long = "custom-resource", value_name = "GROUP/VERSION/KIND/PLURAL")]
    custom_resources: Vec<kiln_coordinator::kube::CustomResource>,
    /// The most bytes one context upload may carry (default 8 GiB); a bigger one is refused as it
    /// passes the limit, and nothing of it is kept.
    #[arg(long, value_name = "BYTES", default_value_t = kiln_coordinator::DEFAULT_MAX_UPLOAD_BYTES, env = "KILN_MAX_UPLOAD_BYTES")]
    max_upload_bytes: u64,
    /// A task whose agent shows no sign of it this long (no progress, and its heartbeats do not
    /// name it) is given up, and a build queued again elsewhere: `30s`, `2m`.
    #[arg(long, default_value = "30s", value_parser = kiln_core::duration::parse, env = "KILN_TASK_DEADLINE")]
    task_deadline: Duration,
    /// How long a build waits for a warm agent (one holding its image or having built its
    /// context) before it takes any free one: `2s`; `0` never waits.
    #[arg(long, default_value = "2s", value_parser = kiln_core::duration::parse, env = "KILN_AFFINITY_WAIT")]
    affinity_wait: Duration,
    /// The URL agents and clients reach this coordinator by, e.g. `https://coord-a.farm:7070`: a
    /// standby names it to callers that reached the standby instead. Default: the scheme and the
    /// listening address (the host's name for a wildcard one).
    #[arg(long, env = "KILN_ADVERTISE", value_name = "URL")]
    advertise: Option<String>,
    /// How long the farm's lease lives without renewal (PostgreSQL state): how long a dead active
    /// coordinator keeps the farm waiting before a standby takes over. Renewed every third of it.
    #[arg(long, default_value = "6s", value_parser = kiln_core::duration::parse, env = "KILN_LEASE_TTL")]
    lease_ttl: Duration,
    /// Serve the status page (`/`) and `/metrics` (Prometheus) over plain HTTP on this address,
    /// e.g. `127.0.0.1:7071`. Off unless given. With TLS the page asks for a user token at
    /// `/login`; `/metrics` is unauthenticated. Plain HTTP: bind loopback or put a TLS proxy in front.
    #[arg(long, value_name = "ADDR", env = "KILN_HTTP")]
    http: Option<std::net::SocketAddr>,
}

/// `postgres://…` or `postgresql://…`, as libpq spells them; anything else is a directory.
fn is_database_url(state: &str) -> bool {
    state.starts_with("postgres://") || state.starts_with("postgresql://")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Logs on stderr as RUST_LOG says (`info` by default); traces when OTEL_EXPORTER_OTLP_ENDPOINT is set.
    let telemetry = kiln_telemetry::init("kiln-coordinator", kiln_telemetry::Process::Server)?;
    let cli = Cli::parse();
    let result = run(cli).await;
    // After the serve loop returned (SIGTERM, SIGINT): its last spans are still buffered.
    telemetry.shutdown().await;
    result
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        None => serve(cli.serve).await,
        Some(Command::Serve(args)) => serve(*args).await,
        Some(Command::Init { farm, state, sans }) => init(&farm, &state, sans),
        Some(Command::Token { command }) => token(command).await,
        Some(Command::Enroll { state, role, cluster, expires }) => enroll(&state, &role, cluster, expires).await,
        Some(Command::Agent { command: AgentCommand::Revoke { state, id } }) => {
            let store = open(&state)?;
            let now = pki::now_ms();
            let changed = store.revoke_agent(&id, now).await?;
            audit_local(&store, "agent revoke", &id).await;
            println!("agent {id} revoked{}", if changed { "" } else { " (it already was)" });
            Ok(())
        }
        Some(Command::Audit { state, since }) => {
            let store = open(&state)?;
            let since_ms = since.map_or(0, |d| pki::now_ms().saturating_sub(d.as_millis() as u64));
            for entry in store.audit(since_ms, None).await? {
                println!(
                    "{}  {:<20} {:<14} {:<24} {:<22} {}",
                    entry.at_ms, entry.actor, entry.action, entry.target, entry.address, entry.outcome
                );
            }
            Ok(())
        }
    }
}

fn open(state: &Path) -> anyhow::Result<SqliteStore> {
    SqliteStore::open(state.join("kiln.db"))
        .with_context(|| format!("cannot open the farm's state in {}", state.display()))
}

/// The admin running a command on the state directly: the local account.
fn local_actor() -> String {
    format!("local:{}", std::env::var("USER").unwrap_or_else(|_| "root".to_string()))
}

async fn audit_local(store: &SqliteStore, action: &str, target: &str) {
    let entry = AuditRow {
        at_ms: pki::now_ms(),
        actor: local_actor(),
        action: action.to_string(),
        target: target.to_string(),
        address: "local".to_string(),
        outcome: "ok".to_string(),
    };
    if let Err(err) = store.append_audit(entry).await {
        eprintln!("kiln-coordinator: warning: the audit entry was not written: {err}");
    }
}

fn host_name() -> String {
    std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_default()
}

fn init(farm: &str, state: &Path, mut sans: Vec<String>) -> anyhow::Result<()> {
    if sans.is_empty() {
        sans = vec!["localhost".to_string(), "127.0.0.1".to_string()];
        let host = host_name();
        if !host.is_empty() {
            sans.push(host);
        }
    }
    let files = pki::TlsFiles::in_state(state);
    let fingerprint = pki::init(&files, farm, &sans)?;
    std::fs::write(state.join("farm"), format!("{farm}\n")).context("recording the farm's name")?;
    println!("farm {farm}: CA {} (fingerprint {fingerprint})", files.ca_cert().display());
    println!("server certificate for {} in {}", sans.join(", "), files.server_cert().display());
    println!("next: kiln-coordinator --state {} --listen 0.0.0.0:7070", state.display());
    Ok(())
}

async fn token(command: TokenCommand) -> anyhow::Result<()> {
    match command {
        TokenCommand::Create { state, user, role, team, expires } => {
            let store = open(&state)?;
            let minted = tokens::mint();
            let now = pki::now_ms();
            let row = TokenRow {
                id: minted.id.clone(),
                hash: minted.hash,
                user: user.clone(),
                role: Role::parse(&role).context("role")?,
                team: team.clone(),
                created_ms: now,
                expires_ms: expires.map(|d| now + d.as_millis() as u64),
                revoked_ms: None,
            };
            store.put_token(row).await?;
            audit_local(&store, "token create", &format!("{} ({user}, {role})", minted.id)).await;
            eprintln!(
                "token {} for {user} ({role}{}) — shown once; the coordinator keeps only its hash:",
                minted.id,
                team.map(|t| format!(", team {t}")).unwrap_or_default()
            );
            println!("{}", minted.token);
            Ok(())
        }
        TokenCommand::List { state } => {
            let store = open(&state)?;
            let now = pki::now_ms();
            for t in store.tokens().await? {
                let status = match (t.revoked_ms, t.expires_ms) {
                    (Some(_), _) => "revoked".to_string(),
                    (None, Some(e)) if e <= now => "expired".to_string(),
                    (None, Some(e)) => format!("expires in {} s", (e - now) / 1000),
                    (None, None) => "valid".to_string(),
                };
                println!(
                    "{}  {:<16} {:<7} {:<12} {status}",
                    t.id,
                    t.user,
                    t.role.name(),
                    t.team.unwrap_or_else(|| "-".into())
                );
            }
            Ok(())
        }
        TokenCommand::Revoke { state, id } => {
            let store = open(&state)?;
            let changed = store.revoke_token(&id, pki::now_ms()).await?;
            audit_local(&store, "token revoke", &id).await;
            if !changed {
                bail!("no valid token {id} — `kiln-coordinator token list` shows them");
            }
            println!("token {id} revoked");
            Ok(())
        }
    }
}

async fn enroll(state: &Path, role: &str, cluster: Option<String>, expires: Duration) -> anyhow::Result<()> {
    let role = AgentRole::from_name(role).context("role")?;
    if role == AgentRole::Node && cluster.is_none() {
        bail!("a node agent needs --cluster NAME: the cluster a `nodes` target of that name delivers to");
    }
    let authority = pki::Authority::load(&pki::TlsFiles::in_state(state))?;
    let store = open(state)?;
    let minted = tokens::mint_join(&authority.fingerprint);
    let now = pki::now_ms();
    let row = JoinRow {
        id: minted.id.clone(),
        hash: minted.hash,
        role,
        cluster: cluster.clone().unwrap_or_default(),
        created_ms: now,
        expires_ms: now + expires.as_millis() as u64,
        used_ms: None,
    };
    store.put_join(row).await?;
    audit_local(&store, "enroll", &format!("join token {} ({})", minted.id, role.name())).await;
    eprintln!(
        "join token {} for a {} agent{}, usable once within {} s; the farm CA's fingerprint is {} — the agent trusts \
         only that CA for its first connection:",
        minted.id,
        role.name(),
        cluster.map(|c| format!(" of cluster {c}")).unwrap_or_default(),
        expires.as_secs(),
        authority.fingerprint
    );
    println!("{}", minted.token);
    Ok(())
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let Some(state) = args.state.clone() else {
        bail!("--state is required: the coordinator's state directory, or a postgres:// database")
    };
    // The directory of everything that is not in the database: contexts, the relay's spool,
    // tls/ and the farm's name.
    let (dir, database) = match (is_database_url(&state), args.data_dir.clone()) {
        (true, Some(dir)) => (dir, Some(state.clone())),
        (true, None) => bail!(
            "--state is a PostgreSQL database: give --data-dir DIR too, for the context store and the relay's spool"
        ),
        (false, None) => (PathBuf::from(&state), None),
        (false, Some(_)) => {
            bail!("--data-dir is only for a PostgreSQL --state; with a directory --state, everything lives in it")
        }
    };
    let farm = match args.farm.clone() {
        Some(farm) => farm,
        None => std::fs::read_to_string(dir.join("farm")).map(|f| f.trim().to_string()).map_err(|_| {
            anyhow::anyhow!("no farm name: pass --farm NAME, or create the farm with `kiln-coordinator init --farm NAME --state {}`", dir.display())
        })?,
    };
    let listener = kiln_coordinator::listen(&args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", args.listen))?;
    let local = listener.local_addr()?;
    let mut config = match database {
        Some(url) => Config { database: Some(url), ..Config::new(dir.clone(), farm) },
        None => Config::new(dir.clone(), farm),
    };
    if args.dev {
        if !local.ip().is_loopback() {
            bail!("--dev serves plaintext without authentication, so it binds loopback only — not {local}");
        }
        eprintln!(
            "kiln-coordinator: WARNING: --dev: plaintext and NO authentication on {local}; every caller may do \
             everything. For experiments on this machine only."
        );
    } else {
        config.tls = Some(tls_material(&args, &dir)?);
    }
    println!("listening on {local}");
    config.max_upload_bytes = args.max_upload_bytes;
    config.task_deadline = args.task_deadline;
    config.affinity_wait = args.affinity_wait;
    config.advertise = args.advertise.clone();
    if args.lease_ttl < Duration::from_secs(3) {
        bail!(
            "--lease-ttl {}s is too short to renew across a database hiccup: give 3s or more",
            args.lease_ttl.as_secs()
        );
    }
    config.lease = LeasePolicy {
        ttl: args.lease_ttl,
        renew_every: args.lease_ttl / 3,
        poll_every: (args.lease_ttl / 10).max(Duration::from_millis(200)),
    };
    config.http = args.http;
    if args.kubernetes {
        let client = kube::Client::try_default()
            .await
            .context("cannot reach Kubernetes from the kubeconfig or the service account — or drop --kubernetes")?;
        config.kubernetes = Some(kiln_coordinator::kube::KubeConfig {
            client,
            system_namespace: args.system_namespace,
            custom_resources: args.custom_resources,
        });
    }
    // SIGTERM is what systemd and the kubelet send; SIGINT what a terminal does. Either stops
    // serving and, on a farm, hands the lease on at once.
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let shutdown = async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate.recv() => {}
        }
    };
    kiln_coordinator::serve(listener, config, shutdown).await?;
    Ok(())
}

/// The TLS material to serve with: the operator's files, else what `init` made. With neither,
/// the coordinator does not start: it would otherwise serve everyone in plaintext.
fn tls_material(args: &ServeArgs, state: &Path) -> anyhow::Result<kiln_coordinator::ServerTls> {
    let read = |p: &Path| std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()));
    if let (Some(cert), Some(key), Some(ca)) = (&args.tls_cert, &args.tls_key, &args.client_ca) {
        // The operator's PKI signs agents' certificates itself; enrollment here needs the farm CA.
        let files = pki::TlsFiles::in_state(state);
        let authority = files.ca_key().is_file().then(|| pki::Authority::load(&files)).transpose()?.map(Arc::new);
        return Ok(kiln_coordinator::ServerTls {
            cert_pem: read(cert)?,
            key_pem: read(key)?,
            client_ca_pem: read(ca)?,
            authority,
        });
    }
    let files = pki::TlsFiles::in_state(state);
    if !files.exists() {
        bail!(
            "no TLS material in {} — a served coordinator speaks TLS only: run `kiln-coordinator init --farm NAME --state {}` \
             (or pass --tls-cert/--tls-key/--client-ca); for a plaintext experiment on loopback, --dev",
            files.dir.display(),
            state.display()
        );
    }
    Ok(kiln_coordinator::ServerTls {
        cert_pem: read(&files.server_cert())?,
        key_pem: read(&files.server_key())?,
        client_ca_pem: read(&files.ca_cert())?,
        authority: Some(Arc::new(pki::Authority::load(&files)?)),
    })
}
