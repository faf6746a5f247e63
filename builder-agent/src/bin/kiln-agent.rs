//! `kiln-agent`: a builder agent on a build host (role `host`, the default) or a node agent on a
//! cluster node (role `node`), connected to a served coordinator.

use clap::Parser;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "kiln-agent",
    version,
    about = "Kiln's agent: builds, pushes, lists and removes on this host's Docker (role host), or lists and removes in this node's containerd (role node)"
)]
struct Args {
    /// The coordinator's URL; a farm's several coordinators comma-separated (`https://a:7070,https://b:7070`),
    /// of which the agent finds the active one.
    #[arg(long, env = "KILN_COORDINATOR")]
    coordinator: String,
    /// This agent's stable id (default: the host name).
    #[arg(long, env = "KILN_AGENT_ID")]
    id: Option<String>,
    /// Where contexts are fetched and verified before a build.
    #[arg(long, env = "KILN_SCRATCH", default_value = "/var/tmp/kiln-agent")]
    scratch: PathBuf,
    /// Which store this agent serves: the host's Docker daemon, or the node's containerd.
    #[arg(long, env = "KILN_ROLE", value_enum, default_value = "host")]
    role: Role,
    /// Role node: containerd's gRPC socket (the CRI is served on it too).
    #[arg(long, env = "KILN_CONTAINERD", default_value = "/run/containerd/containerd.sock")]
    containerd: PathBuf,
    /// Role node: the containerd namespace the kubelet's CRI uses.
    #[arg(long, env = "KILN_NAMESPACE", default_value = kiln_agent::node::K8S_NAMESPACE)]
    namespace: String,
    /// Role node: reach the node through the CRI alone (no untagging: whole ids only).
    #[arg(long, env = "KILN_CRI_ONLY")]
    cri_only: bool,
    /// Role node: the cluster this node belongs to; `kind = "nodes"`, `cluster = NAME` delivers here.
    /// (An enrolled agent's cluster is the one its certificate names.)
    #[arg(long, env = "KILN_CLUSTER")]
    cluster: Option<String>,
    /// Where the agent keeps its enrolled key, certificate and the farm's CA.
    #[arg(long, env = "KILN_AGENT_STATE", default_value = "/var/lib/kiln-agent")]
    state: PathBuf,
    /// A one-time join token from `kiln-coordinator enroll`: exchanged at start for this agent's
    /// certificate (kept in --state; later starts need no token).
    #[arg(long, env = "KILN_JOIN")]
    join: Option<String>,
    /// Builds this agent runs at once; the coordinator never gives it more. Default: one per core.
    #[arg(long, env = "KILN_SLOTS", default_value_t = 0, hide_default_value = true)]
    slots: u32,
    /// Bytes of verified build contexts kept for the next build of the same context, least
    /// recently used out first (e.g. `2g`, `512m`; `0` keeps none). Emptied at every start.
    #[arg(long, env = "KILN_CONTEXT_CACHE", default_value = "2g", value_parser = parse_bytes)]
    context_cache: u64,
    /// Serve this agent's `/metrics` (Prometheus) over plain HTTP on this address, e.g.
    /// `127.0.0.1:7072`. Off unless given; unauthenticated, so bind it where only the scraper reaches.
    #[arg(long, value_name = "ADDR", env = "KILN_METRICS")]
    metrics: Option<std::net::SocketAddr>,
    /// Serve the standard gRPC health service in plaintext on this address, e.g. `0.0.0.0:7073`:
    /// `""` answers while the agent runs (liveness), `kiln.v1.AgentHub` while it is connected to
    /// the active coordinator and not draining (readiness). Off unless given.
    #[arg(long, value_name = "ADDR", env = "KILN_HEALTH")]
    health: Option<std::net::SocketAddr>,
    /// After SIGTERM or SIGINT, how long running tasks may finish before the agent hands them back
    /// to the coordinator (which runs them elsewhere) and exits: 90s, 2m. Keep it under the
    /// process manager's own grace (the kubelet's default is 30 s).
    #[arg(long, default_value = "25s", value_parser = kiln_core::duration::parse, env = "KILN_DRAIN_GRACE")]
    drain_grace: std::time::Duration,
    /// The platform this agent runs natively, announced to the coordinator (repeat for several),
    /// e.g. `linux/arm64` for a node agent on an arm64 node. Default: this machine's.
    #[arg(long = "platform", value_name = "OS/ARCH", env = "KILN_PLATFORMS", value_delimiter = ',')]
    platforms: Vec<String>,
    /// Where binfmt_misc is read for the platforms this host emulates (qemu-user-static handlers).
    #[arg(long, value_name = "DIR", env = "KILN_BINFMT_ROOT", default_value = kiln_agent::emulation::BINFMT_ROOT)]
    binfmt_root: PathBuf,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Host,
    Node,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Logs on stderr as RUST_LOG says (`info` by default); traces when OTEL_EXPORTER_OTLP_ENDPOINT is set.
    let telemetry = kiln_telemetry::init("kiln-agent", kiln_telemetry::Process::Server)?;
    let result = run(Args::parse()).await;
    // After the agent's loop returned (SIGTERM, SIGINT): its last spans are still buffered.
    telemetry.shutdown().await;
    result
}

async fn run(args: Args) -> anyhow::Result<()> {
    let agent_id = match args.id {
        Some(id) => id,
        None => {
            std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "agent".into())
        }
    };
    let identity = kiln_agent::enroll::Identity::in_dir(&args.state);
    let tls = args.coordinator.starts_with("https://");
    if tls && !identity.exists() {
        let Some(token) = &args.join else {
            anyhow::bail!(
                "no enrolled identity in {} — enroll this agent once with --join TOKEN (an admin's `kiln-coordinator enroll` prints one)",
                args.state.display()
            );
        };
        // Enrollment writes, so only the farm's active coordinator takes it: ask each in turn.
        let mut failures = Vec::new();
        for url in kiln_agent::coordinator_urls(&args.coordinator) {
            match kiln_agent::enroll::join(&url, token, &agent_id, &identity).await {
                Ok(()) => {
                    failures.clear();
                    break;
                }
                Err(err) => failures.push(format!("{url}: {}", kiln_core::error_chain(&err))),
            }
        }
        if !failures.is_empty() {
            anyhow::bail!("agent {agent_id} could not enroll: {}", failures.join("; "));
        }
    }
    let config = kiln_agent::AgentConfig {
        coordinator: args.coordinator,
        agent_id,
        scratch_dir: args.scratch,
        cluster: args.cluster.unwrap_or_default(),
        identity: tls.then_some(identity),
        slots: args.slots,
        context_cache: args.context_cache,
        metrics: args.metrics,
        health: args.health,
        drain_grace: args.drain_grace,
        platforms: kiln_agent::Platforms {
            native: native_platforms(&args.platforms)?,
            binfmt_root: Some(args.binfmt_root),
        },
    };
    if args.role == Role::Node && config.cluster.is_empty() {
        anyhow::bail!("a node agent needs --cluster NAME: the cluster a `nodes` target of that name delivers to");
    }
    // SIGTERM is what systemd and the kubelet send; SIGINT what a terminal does.
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let shutdown = async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate.recv() => {}
        }
    };
    match args.role {
        Role::Host => kiln_agent::run(config, shutdown).await?,
        Role::Node => {
            let node = kiln_agent::node::NodeConfig {
                socket: args.containerd,
                namespace: args.namespace,
                cri_only: args.cri_only,
            };
            kiln_agent::run_node(config, node, shutdown).await?
        }
    }
    Ok(())
}

/// `--platform` values in the OCI form the coordinator compares (`arm64` → `linux/arm64`).
fn native_platforms(given: &[String]) -> anyhow::Result<Vec<String>> {
    given
        .iter()
        .map(|p| {
            kiln_core::refs::Platform::parse(p)
                .map(|p| p.oci())
                .map_err(|err| anyhow::anyhow!("--platform {p}: {}", kiln_core::error_chain(&err)))
        })
        .collect()
}

/// `--context-cache`: a byte count with an optional binary unit (`k`, `m`, `g`, `t`).
fn parse_bytes(given: &str) -> Result<u64, String> {
    let lower = given.trim().to_ascii_lowercase();
    let lower = lower.strip_suffix("ib").or_else(|| lower.strip_suffix('b')).unwrap_or(&lower);
    let (number, shift) = match lower.char_indices().last() {
        Some((i, 'k')) => (&lower[..i], 10),
        Some((i, 'm')) => (&lower[..i], 20),
        Some((i, 'g')) => (&lower[..i], 30),
        Some((i, 't')) => (&lower[..i], 40),
        _ => (lower, 0),
    };
    let bad = || format!("`{given}` is not a size — write bytes or a number with k, m, g or t (e.g. 2g, 512m, 0)");
    let n: u64 = number.trim().parse().map_err(|_| bad())?;
    n.checked_mul(1 << shift).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_read_with_binary_units_and_nonsense_is_named() {
        assert_eq!(super::parse_bytes("0"), Ok(0));
        assert_eq!(super::parse_bytes("2g"), Ok(2 << 30));
        assert_eq!(super::parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(super::parse_bytes("100"), Ok(100));
        let refused = super::parse_bytes("lots").unwrap_err();
        assert!(refused.contains("`lots` is not a size"), "{refused}");
        assert!(super::parse_bytes("99999999999t").is_err());
    }
}
