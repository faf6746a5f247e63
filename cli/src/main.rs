//! `kiln`: the command line over the `kiln` library. Parsing and exit codes live here; everything
//! else is in `lib.rs` and its modules, so the tests run what a user runs.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use kiln::error::report;
use kiln::{CliError, Connect, Exit, OutputMode};

const EXIT_CODES: &str = "\
Exit codes:
  0  converged (or the command did what it was asked)
  1  the converge failed (the message names the image and why), or the command failed
  2  usage or manifest error (kiln.toml:<line>: …); nothing was asked of the coordinator
  3  the coordinator cannot be reached, or the embedded one did not come up

Without --coordinator (or KILN_COORDINATOR), every command but the plumbing starts an embedded
coordinator and host agent in this process, with their state in $KILN_HOME
(default ~/.local/share/kiln), shared by every instance you converge.";

#[derive(Parser, Debug)]
#[command(
    name = "kiln",
    version,
    about = "Content-addressed container images: built once, delivered, swept by reachability",
    after_help = EXIT_CODES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Which coordinator to talk to, and how to print.
#[derive(Args, Debug)]
struct Remote {
    /// The coordinator's URL, e.g. http://127.0.0.1:7070. Without it, an embedded coordinator and
    /// host agent run in this process with their state in $KILN_HOME.
    #[arg(long, env = "KILN_COORDINATOR", value_name = "URL")]
    coordinator: Option<String>,
    /// Print JSON: one object per event (up, logs), one document otherwise.
    #[arg(long)]
    json: bool,
    /// How long to keep retrying a coordinator that cannot be reached, in seconds.
    #[arg(long, env = "KILN_RETRY_WINDOW", value_name = "SECS", default_value_t = 90)]
    retry_window: u64,
}

impl Remote {
    fn connect(&self) -> Connect {
        Connect {
            coordinator: self.coordinator.clone().filter(|url| !url.is_empty()),
            kiln_home: None,
            retry_window: Duration::from_secs(self.retry_window),
        }
    }

    fn output(&self) -> OutputMode {
        if self.json {
            OutputMode::Json
        } else {
            OutputMode::Auto
        }
    }
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Converge an instance: build what changed, deliver it, record it, sweep what nothing needs.
    Up {
        /// The instance folder holding `kiln.toml`.
        #[arg(default_value = ".")]
        dir: PathBuf,
        /// Rebuild and redeliver every built image, whatever is recorded or held.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Take an instance down: delete its record, then sweep what nothing else needs. No prompt.
    Down {
        /// The instance folder whose `kiln.toml` names the instance.
        #[arg(default_value = ".")]
        dir: PathBuf,
        #[command(flatten)]
        remote: Remote,
    },
    /// Sweep now: remove every image this farm built that no record, claim, pin or container
    /// needs. No prompt: it removes only what Kiln built and nothing a root names.
    Gc {
        /// Print the plan per store, with bytes per instance; remove nothing.
        #[arg(long)]
        dry_run: bool,
        /// Remove only this instance's images.
        #[arg(long, value_name = "NAME")]
        instance: Option<String>,
        #[command(flatten)]
        remote: Remote,
    },
    /// Keep a ref (or an image id) through every sweep until it is unpinned.
    Pin {
        reference: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Let a pinned ref go: the next sweep takes it if nothing else needs it.
    Unpin {
        reference: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// List the pinned refs.
    Pins {
        #[command(flatten)]
        remote: Remote,
    },
    /// Show the recorded images of every instance (or one) and the recent converges.
    Status {
        instance: Option<String>,
        #[command(flatten)]
        remote: Remote,
    },
    /// Replay a converge's events; with --follow, keep going until it finishes.
    Logs {
        /// The converge id (`kiln status` lists them).
        id: String,
        #[arg(long)]
        follow: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// List the images in every store the agents manage.
    Images {
        #[command(flatten)]
        remote: Remote,
    },
    /// List the agents the coordinator knows.
    Agents {
        #[command(flatten)]
        remote: Remote,
    },
    /// Print the tree digest of a build context (what its content tag addresses).
    Digest {
        /// The context directory.
        dir: PathBuf,
        /// Also print every entry the digest covered: type, size, path.
        #[arg(long)]
        list: bool,
        /// The Dockerfile's path inside the context (always part of it, even if .dockerignore names it).
        #[arg(long, default_value = "Dockerfile")]
        dockerfile: String,
    },
    /// Pack a context into the canonical archive (what `kiln up` uploads).
    Pack {
        dir: PathBuf,
        /// Where to write the archive (`-` for stdout).
        #[arg(short, long)]
        output: PathBuf,
        #[arg(long, default_value = "Dockerfile")]
        dockerfile: String,
    },
    /// Unpack a canonical archive into a new or empty directory, refusing anything unsafe.
    Unpack {
        /// The archive (`-` for stdin).
        file: PathBuf,
        dir: PathBuf,
        /// The tree digest the archive must hold; a mismatch is refused and the directory removed.
        #[arg(long)]
        expect: Option<String>,
    },
    /// Print the content ref of every image of an instance, as `kiln up` computes them.
    Refs {
        /// The instance folder holding `kiln.toml`.
        #[arg(default_value = ".")]
        dir: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let plumbing = match cli.command {
        Command::Digest { dir, list, dockerfile } => Some(kiln::plumbing::digest(&dir, list, dockerfile)),
        Command::Pack { dir, output, dockerfile } => Some(kiln::plumbing::pack(&dir, &output, dockerfile)),
        Command::Unpack { file, dir, expect } => Some(kiln::plumbing::unpack(&file, &dir, expect.as_deref())),
        Command::Refs { dir } => Some(kiln::plumbing::refs(&dir)),
        command => return run(command),
    };
    match plumbing {
        Some(Err(err)) => {
            eprintln!("kiln: {err:#}");
            ExitCode::FAILURE
        }
        _ => ExitCode::SUCCESS,
    }
}

/// The commands that talk to a coordinator.
fn run(command: Command) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("kiln: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(command)) {
        Ok(exit) => ExitCode::from(exit.code()),
        Err(err) => {
            eprintln!("kiln: {}", report(&err));
            ExitCode::from(err.exit().code())
        }
    }
}

/// A gc's or down's exit: its converge's, with the failure on stderr.
fn job_exit(job: &str, run: &kiln::UpOutcome) -> Result<Exit, CliError> {
    if let Some(failure) = &run.failure {
        eprintln!("kiln: {job} ({}) failed: {failure}", run.converge_id);
    }
    Ok(run.exit())
}

async fn dispatch(command: Command) -> Result<Exit, CliError> {
    match command {
        Command::Up { dir, force, remote } => {
            let args = kiln::UpArgs { dir, force, connect: remote.connect(), output: remote.output() };
            let outcome = kiln::up(args).await?;
            if let Some(failure) = &outcome.failure {
                eprintln!("kiln: converge {} failed: {failure}", outcome.converge_id);
            }
            Ok(outcome.exit())
        }
        Command::Down { dir, remote } => {
            let args = kiln::DownArgs { dir, connect: remote.connect(), output: remote.output() };
            let outcome = kiln::down(args).await?;
            job_exit("down", &outcome.run)
        }
        Command::Gc { dry_run, instance, remote } => {
            let args = kiln::GcArgs { dry_run, instance, connect: remote.connect(), output: remote.output() };
            let outcome = kiln::gc(args).await?;
            job_exit("gc", &outcome.run)
        }
        Command::Pin { reference, remote } => {
            let args = kiln::PinArgs { reference, connect: remote.connect(), output: remote.output() };
            kiln::pin(args).await.map(|_| Exit::Converged)
        }
        Command::Unpin { reference, remote } => {
            let args = kiln::PinArgs { reference, connect: remote.connect(), output: remote.output() };
            kiln::unpin(args).await.map(|_| Exit::Converged)
        }
        Command::Pins { remote } => {
            let args = kiln::ListArgs { connect: remote.connect(), output: remote.output() };
            kiln::pins(args).await.map(|_| Exit::Converged)
        }
        Command::Status { instance, remote } => {
            let args = kiln::StatusArgs { instance, connect: remote.connect(), output: remote.output() };
            kiln::status(args).await.map(|_| Exit::Converged)
        }
        Command::Logs { id, follow, remote } => {
            let args = kiln::LogsArgs { converge_id: id, follow, connect: remote.connect(), output: remote.output() };
            kiln::logs(args).await.map(|_| Exit::Converged)
        }
        Command::Images { remote } => {
            let args = kiln::ListArgs { connect: remote.connect(), output: remote.output() };
            kiln::images(args).await.map(|_| Exit::Converged)
        }
        Command::Agents { remote } => {
            let args = kiln::ListArgs { connect: remote.connect(), output: remote.output() };
            kiln::agents(args).await.map(|_| Exit::Converged)
        }
        Command::Digest { .. } | Command::Pack { .. } | Command::Unpack { .. } | Command::Refs { .. } => {
            unreachable!("the plumbing commands run without a runtime")
        }
    }
}
