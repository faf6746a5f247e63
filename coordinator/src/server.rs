//! `serve`: the coordinator as a library. The CLI's embedded mode, `kiln-coordinator` the binary
//! and every test start this same function on a listener they bound themselves.

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

/// What a coordinator needs to run.
#[derive(Clone, Debug)]
pub struct Config {
    /// Where the SQLite state and the content-addressed context store live.
    pub state_dir: PathBuf,
    /// The farm id every image this coordinator builds is labeled with (`kiln.dev/farm`).
    pub farm: String,
    /// How long a converge's claim on its refs lives without renewal.
    pub claim_lease: Duration,
    /// How long an agent may stay silent before its tasks are failed.
    pub agent_lease: Duration,
}

impl Config {
    pub fn new(state_dir: impl Into<PathBuf>, farm: impl Into<String>) -> Config {
        Config {
            state_dir: state_dir.into(),
            farm: farm.into(),
            claim_lease: Duration::from_secs(600),
            agent_lease: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("coordinator is not implemented yet")]
    NotYet,
}

/// Serves the coordinator's gRPC services on `listener` until `shutdown` resolves.
pub async fn serve(
    _listener: tokio::net::TcpListener,
    _config: Config,
    _shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    Err(ServeError::NotYet)
}
