//! `kiln-coordinator`: a served coordinator for a farm (the CLI embeds the same `serve` by default).
//!
//! Prints `listening on <addr>` once bound, so a supervisor or a test can bind port 0 and read
//! where it landed.

use anyhow::Context;
use clap::Parser;
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
    /// Directory of the coordinator's state (SQLite file and context store).
    #[arg(long, env = "KILN_STATE")]
    state: PathBuf,
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
    /// The most bytes one context upload may carry (default 8 GiB); a bigger one is refused as it
    /// passes the limit, and nothing of it is kept.
    #[arg(long, value_name = "BYTES", default_value_t = kiln_coordinator::DEFAULT_MAX_UPLOAD_BYTES, env = "KILN_MAX_UPLOAD_BYTES")]
    max_upload_bytes: u64,
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
    let mut config = kiln_coordinator::Config::new(args.state, args.farm);
    config.max_upload_bytes = args.max_upload_bytes;
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
