//! `kiln-coordinator`: a served coordinator for a farm (the CLI embeds the same `serve` by default).
//!
//! Prints `listening on <addr>` once bound, so a supervisor or a test can bind port 0 and read
//! where it landed.

use anyhow::Context;
use clap::Parser;
use kiln_coordinator::Config;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "kiln-coordinator",
    version,
    about = "Kiln's coordinator: converge state, records, and the agents' hub"
)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7070", env = "KILN_LISTEN")]
    listen: String,
    /// Where the coordinator's state lives: a directory (its SQLite file and context store), or a
    /// farm's PostgreSQL database, `postgres://user:password@host:port/database`, that several
    /// coordinators share (one is active; the others stand by).
    #[arg(long, env = "KILN_STATE", value_name = "DIR|postgres://…")]
    state: String,
    /// With a PostgreSQL --state: the directory of the context store and the image relay's spool.
    #[arg(long, env = "KILN_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// The farm's name: every image this coordinator builds is labeled with it.
    #[arg(long, env = "KILN_FARM")]
    farm: String,
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
}

/// `postgres://…` or `postgresql://…`, as libpq spells them; anything else is a directory.
fn is_database_url(state: &str) -> bool {
    state.starts_with("postgres://") || state.starts_with("postgresql://")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        // `info` unless RUST_LOG says otherwise: an agent that cannot reach its coordinator, or a
        // converge marked failed at start, must be heard without anyone setting a variable.
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", args.listen))?;
    println!("listening on {}", listener.local_addr()?);
    let mut config = match (is_database_url(&args.state), args.data_dir) {
        (true, Some(dir)) => Config { database: Some(args.state), ..Config::new(dir, args.farm) },
        (true, None) => anyhow::bail!(
            "--state is a PostgreSQL database: give --data-dir DIR too, for the context store and the relay's spool"
        ),
        (false, None) => Config::new(args.state, args.farm),
        (false, Some(_)) => anyhow::bail!(
            "--data-dir is only for a PostgreSQL --state; with a directory --state, everything lives in it"
        ),
    };
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
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    kiln_coordinator::serve(listener, config, shutdown).await?;
    Ok(())
}
