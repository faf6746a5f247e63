//! `run`: the agent as a library — connects to the coordinator, says hello, executes tasks, and
//! reconnects forever on the retry ladder. The CLI's embedded mode and the tests start this same
//! function.

use std::future::Future;
use std::path::PathBuf;

/// What an agent needs to run.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// The coordinator's URL, e.g. `http://127.0.0.1:7070`.
    pub coordinator: String,
    /// Stable id of this agent (defaults to the host name).
    pub agent_id: String,
    /// Where contexts are downloaded and verified before a build.
    pub scratch_dir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("agent is not implemented yet")]
    NotYet,
}

/// Runs the agent against the local Docker daemon until `shutdown` resolves.
pub async fn run(_config: AgentConfig, _shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), RunError> {
    Err(RunError::NotYet)
}
