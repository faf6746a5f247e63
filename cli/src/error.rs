//! What a command can fail with, and the exit code each failure is.
//!
//! The codes are a contract with scripts and CI (`kiln up || …`): 0 converged, 1 the converge (or
//! the command) failed, 2 the command line or the manifest is wrong, 3 the coordinator cannot be
//! reached. A script can retry on 3 and must not on 2, so a failure is put in the class of its
//! cause, not of the place it surfaced.

use std::path::PathBuf;

use kiln_core::manifest::{AddressError, ImageAddressError, ManifestError};

use crate::stage::StageError;
use crate::upload::UploadError;

/// The process exit code of a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Exit {
    /// 0: the converge succeeded (or the command did what it was asked).
    Converged = 0,
    /// 1: the converge failed; the message names the image and why.
    Failed = 1,
    /// 2: the command line or the manifest is wrong; nothing was asked of the coordinator.
    Usage = 2,
    /// 3: the coordinator (or the embedded one) cannot be reached.
    Unreachable = 3,
    /// 130: the user interrupted it (Ctrl-C), as shells report SIGINT; a converge was cancelled.
    Interrupted = 130,
}

impl Exit {
    pub fn code(self) -> u8 {
        self as u8
    }
}

/// Why a command stopped. `Display` is the message for the user; the cause, when there is one,
/// is the `source`, printed after it.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Displays as `Manifest` gives it: `<file>:<line>: <problem>`.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    #[error("built image {image:?} cannot be addressed")]
    Address {
        image: String,
        #[source]
        err: AddressError,
    },
    /// A staged context: its command failed or could not start, or the seal refused its tree.
    /// Boxed: it carries the command's output, and every command's `Result` would carry its size.
    #[error(transparent)]
    Stage(Box<StageError>),
    #[error("coordinator address {url:?} is not usable: {why}")]
    BadUrl { url: String, why: String },
    #[error("the token is not usable: {why}")]
    BadToken { why: String },
    #[error("cannot read {path}")]
    Credentials {
        path: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error("token file {path} is readable by others (mode {mode:o}) — a token is a password: chmod 600 {path}")]
    TokenFileOpen { path: PathBuf, mode: u32 },
    #[error("cannot speak TLS with {at}: {reason} — an https:// URL needs a coordinator serving TLS and --ca (or KILN_CA) naming its farm's CA; a --dev coordinator is http://")]
    TlsMismatch { at: String, reason: String },
    /// `at` names the coordinator (`the coordinator at http://…`, or the embedded one by its
    /// home); `reason` is the OS's word for it (`connection refused`), never the transport's wrapper.
    #[error("cannot reach {at}: {reason}")]
    Unreachable { at: String, reason: String },
    /// The stream of a running converge broke: the coordinator died or was cut off. The converge
    /// is reported failed when it is back (its claims expire on their lease).
    #[error("{at} went away during the converge ({reason}) — once it is back, `kiln logs {converge_id}` shows how it ended; run `kiln up` again")]
    WentAway { at: String, converge_id: String, reason: String },
    /// The same, when the user gave a farm's several coordinators: a standby takes over.
    #[error("coordinator failed over during the converge; run `kiln up` again ({at} went away: {reason}; `kiln logs {converge_id}` shows how it ended)")]
    FailedOver { at: String, converge_id: String, reason: String },
    /// A farm's standby answered: nothing was done; the active coordinator is elsewhere.
    #[error("{at} stands by; the farm's active coordinator is at {active} — pass --coordinator {active} (or list the farm's coordinators, comma-separated)")]
    Standby { at: String, active: String },
    #[error("no home for the embedded coordinator — set KILN_HOME (or HOME), or pass --coordinator URL")]
    NoHome,
    #[error("cannot prepare KILN_HOME {path}")]
    Home {
        path: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error("the embedded coordinator (state in {state}) did not start")]
    CoordinatorDown {
        state: PathBuf,
        #[source]
        err: Box<kiln_coordinator::ServeError>,
    },
    #[error("the embedded coordinator (state in {state}) stopped before it was asked to")]
    CoordinatorStopped { state: PathBuf },
    #[error("the embedded agent {agent} did not start")]
    AgentDown {
        agent: String,
        #[source]
        err: Box<kiln_agent::RunError>,
    },
    #[error("the embedded agent {agent} stopped before it connected")]
    AgentStopped { agent: String },
    #[error(
        "the embedded agent {agent} did not connect to {at} within {secs} s — is the Docker \
         daemon running and readable by this user?"
    )]
    AgentTimeout { agent: String, at: String, secs: u64 },
    #[error("the embedded {what} panicked")]
    EmbeddedPanicked { what: &'static str },
    /// The coordinator answered the call with an error; `message` is its word for why.
    #[error("{at} refused {call}: {message}")]
    Refused { at: String, call: &'static str, code: tonic::Code, message: String },
    #[error(
        "{at} ended the events of converge {converge_id} before it finished — \
         `kiln logs {converge_id}` shows how it ended"
    )]
    StreamEnded { at: String, converge_id: String },
    #[error("cannot upload context {dir} (tree {short})")]
    Upload {
        dir: PathBuf,
        short: String,
        /// Boxed: an archive error is large, and every command's `Result` would carry its size.
        #[source]
        err: Box<UploadError>,
    },
    #[error("the coordinator asked for context {digest}, which no built image of this manifest has")]
    UnknownContext { digest: String },
    #[error("{file} names no built image {image:?} — its built images: {built}")]
    NoSuchImage { image: String, file: PathBuf, built: String },
    #[error(
        "{manifest} names no mirror_registry — add mirror_registry = \"host:port/prefix\" under [target] for \
         `kiln mirror` to copy its pinned images into"
    )]
    NoMirror { manifest: PathBuf },
    #[error(
        "platforms = \"cluster\": no node of {target} cluster {cluster} is known to the coordinator — start its node \
         agents (`kiln-agent --role node --cluster {cluster}`) or its kind cluster, or list the platforms in kiln.toml"
    )]
    NoClusterPlatforms { target: &'static str, cluster: String },
    #[error("the coordinator named platforms of cluster {cluster} this kiln cannot read: {why}")]
    BadClusterPlatforms { cluster: String, why: String },
    #[error("cannot write the output")]
    Output(#[source] std::io::Error),
    #[error("the {what} task panicked")]
    Panicked { what: &'static str },
}

impl From<StageError> for CliError {
    fn from(err: StageError) -> CliError {
        CliError::Stage(Box::new(err))
    }
}

impl From<ImageAddressError> for CliError {
    fn from(ImageAddressError { image, err }: ImageAddressError) -> CliError {
        CliError::Address { image, err }
    }
}

impl CliError {
    /// The exit code this failure is.
    pub fn exit(&self) -> Exit {
        match self {
            CliError::Stage(err) => err.exit(),
            CliError::Manifest(_)
            | CliError::Address { .. }
            | CliError::BadUrl { .. }
            | CliError::BadToken { .. }
            | CliError::Credentials { .. }
            | CliError::TokenFileOpen { .. }
            | CliError::NoSuchImage { .. }
            | CliError::NoMirror { .. }
            | CliError::NoHome => Exit::Usage,
            // The coordinator judged the request itself malformed: the user's input, not the converge.
            CliError::Refused { code: tonic::Code::InvalidArgument, .. } => Exit::Usage,
            CliError::Unreachable { .. }
            | CliError::TlsMismatch { .. }
            | CliError::WentAway { .. }
            | CliError::FailedOver { .. }
            | CliError::Standby { .. }
            | CliError::CoordinatorDown { .. }
            | CliError::CoordinatorStopped { .. }
            | CliError::AgentDown { .. }
            | CliError::AgentStopped { .. }
            | CliError::AgentTimeout { .. }
            | CliError::EmbeddedPanicked { .. } => Exit::Unreachable,
            CliError::Home { .. }
            | CliError::Refused { .. }
            | CliError::StreamEnded { .. }
            | CliError::Upload { .. }
            | CliError::UnknownContext { .. }
            | CliError::Output(_)
            | CliError::NoClusterPlatforms { .. }
            | CliError::BadClusterPlatforms { .. }
            | CliError::Panicked { .. } => Exit::Failed,
        }
    }
}

/// The full message of an error: its own text, then each source's, joined by `: `.
pub fn report(err: &(dyn std::error::Error + 'static)) -> String {
    kiln_core::error_chain(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn each_class_of_failure_has_its_code() {
        let manifest = kiln_core::manifest::Manifest::parse("instance = \"x\"\n", Path::new("/tmp/kiln.toml"))
            .expect_err("a manifest without images or target is refused");
        assert_eq!(CliError::Manifest(manifest).exit(), Exit::Usage);
        assert_eq!(CliError::BadUrl { url: "x".into(), why: "no scheme".into() }.exit(), Exit::Usage);
        let unreachable = CliError::Unreachable {
            at: "the coordinator at http://127.0.0.1:1".into(),
            reason: "connection refused".into(),
        };
        assert_eq!(unreachable.exit(), Exit::Unreachable);
        assert_eq!(unreachable.exit().code(), 3);
        assert_eq!(
            CliError::AgentTimeout { agent: "embedded-h".into(), at: "the embedded coordinator".into(), secs: 10 }
                .exit(),
            Exit::Unreachable
        );
        let refused = |code| CliError::Refused { at: "u".into(), call: "Up", code, message: "m".into() };
        assert_eq!(refused(tonic::Code::InvalidArgument).exit(), Exit::Usage);
        assert_eq!(refused(tonic::Code::FailedPrecondition).exit(), Exit::Failed);
        assert_eq!(CliError::StreamEnded { at: "u".into(), converge_id: "c".into() }.exit().code(), 1);
        let went = CliError::WentAway {
            at: "the coordinator at http://10.0.0.7:7070".into(),
            converge_id: "c".into(),
            reason: "connection reset".into(),
        };
        assert_eq!(went.exit().code(), 3, "a coordinator that went away is unreachable, not a failed converge");
        assert!(went
            .to_string()
            .starts_with("the coordinator at http://10.0.0.7:7070 went away during the converge (connection reset)"));
        assert_eq!(Exit::Converged.code(), 0);
    }

    #[test]
    fn the_report_chains_sources_once_each() {
        let err = CliError::Home {
            path: "/nowhere/kiln".into(),
            err: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        };
        assert_eq!(report(&err), "cannot prepare KILN_HOME /nowhere/kiln: permission denied");
    }
}
