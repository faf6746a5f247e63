//! `kiln`, the thin client: it computes refs, uploads contexts and streams events; every decision
//! (skip, build, deliver, record, sweep) is the coordinator's. The binary (`main.rs`) is a clap
//! front over these functions, so the end-to-end tests call exactly what a user runs.
//!
//! Where to start:
//! - [`up`] / [`up_with`] — `kiln up`: [`request::plan_up`] stages the contexts a manifest says
//!   are staged ([`stage`]: run the command, seal the tree), walks and addresses the instance,
//!   `Kiln.Up` streams the converge's [`Event`]s, [`upload`] sends each context the coordinator
//!   asks for, [`render`] shows the events. It returns an [`UpOutcome`] (events, outcome, exit).
//! - [`status`], [`logs`], [`images`], [`agents`] — the read commands ([`query`]).
//! - [`why`] — `kiln why IMAGE`: every input and file that moved since a recorded generation.
//! - [`gc`], [`down`], [`pin`], [`unpin`], [`pins`] — the sweep's commands ([`sweep`]): gc and
//!   down stream their events through the same renderers as `up`.
//! - [`mirror`] — `kiln mirror`: the pinned images copied into `mirror_registry`, alone.
//! - [`embedded`] — with no coordinator URL, every command starts the real coordinator and a host
//!   agent in-process, state in `$KILN_HOME` ([`home`]), and shuts them down after.
//! - [`connect`] — dialing on the retry ladder; transport failures become messages naming the
//!   address and the OS error.
//! - [`plumbing`] — `digest`, `pack`, `unpack`, `refs`: `kiln-core` directly, no coordinator.
//!
//! # Exit codes
//!
//! | code | meaning |
//! |---|---|
//! | 0 | converged (or the command did what it was asked) |
//! | 1 | the converge failed — the message names the image and why — or the command failed |
//! | 2 | usage or manifest error (`kiln.toml:<line>: …`); nothing was asked of the coordinator |
//! | 3 | the coordinator cannot be reached (`cannot reach the coordinator at <url>: connection refused`), or the embedded one did not come up |
//!
//! [`CliError::exit`] and [`UpOutcome::exit`] give the code of each outcome.

pub mod blobs;
pub mod connect;
pub mod embedded;
pub mod error;
pub mod event;
pub mod home;
pub mod mirror;
pub mod platforms;
pub mod plumbing;
pub mod ps;
pub mod query;
pub mod render;
pub mod request;
pub mod stage;
pub mod sweep;
pub mod up;
pub mod upload;
pub mod view;
pub mod watch;
pub mod why;

use std::path::PathBuf;
use std::time::Duration;

pub use error::{CliError, Exit};
pub use event::{Event, EventKind, Outcome};
pub use mirror::{mirror, mirror_with, MirrorArgs};
pub use ps::{cancel, ps, PsView};
pub use query::{agents, audit, images, logs, logs_with, status, whoami, AuditView, ListArgs, LogsArgs, StatusArgs};
pub use render::OutputMode;
pub use sweep::{down, gc, pin, pins, unpin, DownArgs, GcArgs, PinArgs, PinsView, SweepOutcome};
pub use up::{up, up_with, Failure, UpArgs, UpOutcome};
pub use why::{why, WhyArgs, WhyView};

/// Which coordinator a command talks to.
#[derive(Clone, Debug)]
pub struct Connect {
    /// `--coordinator` / `$KILN_COORDINATOR`; `None` starts the embedded coordinator and agent.
    pub coordinator: Option<String>,
    /// Embedded only: the home to use instead of `$KILN_HOME` (or `~/.local/share/kiln`).
    pub kiln_home: Option<PathBuf>,
    /// How long transport failures are retried before the command fails with exit code 3.
    pub retry_window: Duration,
    /// `--ca FILE` / `KILN_CA`: the CA a served coordinator's certificate must chain to.
    pub ca: Option<PathBuf>,
    /// `--token-file FILE`: where the user's token is, when not in `KILN_TOKEN` or
    /// `~/.config/kiln/token`.
    pub token_file: Option<PathBuf>,
}

impl Default for Connect {
    /// The embedded coordinator in `$KILN_HOME`, retrying for DESIGN.md's 90 s window.
    fn default() -> Connect {
        Connect {
            coordinator: None,
            kiln_home: None,
            retry_window: kiln_core::retry::LadderConfig::DEFAULT_WINDOW,
            ca: None,
            token_file: None,
        }
    }
}

impl Connect {
    /// The coordinator at `url`.
    pub fn remote(url: impl Into<String>) -> Connect {
        Connect { coordinator: Some(url.into()), ..Connect::default() }
    }

    /// The CA to trust and the token to carry, for a served coordinator.
    pub fn credentials(&self) -> Result<connect::Credentials, CliError> {
        connect::Credentials::load(self.ca.as_deref(), self.token_file.as_deref())
    }

    /// The embedded coordinator with its state in `home`.
    pub fn embedded_in(home: impl Into<PathBuf>) -> Connect {
        Connect { kiln_home: Some(home.into()), ..Connect::default() }
    }
}
