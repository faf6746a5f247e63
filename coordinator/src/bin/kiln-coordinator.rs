//! `kiln-coordinator`: a served coordinator for a farm (the CLI embeds the same `serve` by default).
//!
//! Prints `listening on <addr>` once bound, so a supervisor or a test can bind port 0 and read
//! where it landed.

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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", args.listen))?;
    println!("listening on {}", listener.local_addr()?);
    let config = kiln_coordinator::Config::new(args.state, args.farm);
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    kiln_coordinator::serve(listener, config, shutdown).await?;
    Ok(())
}
