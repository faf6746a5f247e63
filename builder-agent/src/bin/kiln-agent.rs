//! `kiln-agent`: a builder agent on a build host, connected to a served coordinator.

use clap::Parser;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "kiln-agent",
    version,
    about = "Kiln's builder agent: builds, pushes, lists and removes on this host's Docker"
)]
struct Args {
    /// The coordinator's URL.
    #[arg(long, env = "KILN_COORDINATOR")]
    coordinator: String,
    /// This agent's stable id (default: the host name).
    #[arg(long, env = "KILN_AGENT_ID")]
    id: Option<String>,
    /// Where contexts are fetched and verified before a build.
    #[arg(long, env = "KILN_SCRATCH", default_value = "/var/tmp/kiln-agent")]
    scratch: PathBuf,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let agent_id = match args.id {
        Some(id) => id,
        None => {
            std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "agent".into())
        }
    };
    let config = kiln_agent::AgentConfig { coordinator: args.coordinator, agent_id, scratch_dir: args.scratch };
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    kiln_agent::run(config, shutdown).await?;
    Ok(())
}
