//! `kiln`: the command line over the `kiln` library. Parsing and exit codes live here; everything
//! else is in `lib.rs` and its modules, so the tests run what a user runs.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use kiln::error::report;
use kiln::{CliError, Connect, Exit, OutputMode};
use tracing::Instrument;

const EXIT_CODES: &str = "\
Exit codes:
  0  converged (or the command did what it was asked)
  1  the converge failed (the message names the image and why), or the command failed
  2  usage or manifest error (kiln.toml:<line>: …); nothing was asked of the coordinator
  3  the coordinator cannot be reached, or the embedded one did not come up
  130  interrupted (Ctrl-C): the converge was cancelled, its builds stopped, nothing recorded

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
    #[command(flatten)]
    remote: Remote,
    #[command(subcommand)]
    command: Command,
}

/// Which coordinator to talk to, and how to print. Global: before or after the subcommand.
#[derive(Args, Debug)]
struct Remote {
    /// The coordinator's URL, e.g. https://kiln.example:7070; a farm's several coordinators
    /// comma-separated, of which the active one is found. Without it, an embedded coordinator and
    /// host agent run in this process with their state in $KILN_HOME.
    #[arg(long, global = true, env = "KILN_COORDINATOR", value_name = "URL[,URL…]")]
    coordinator: Option<String>,
    /// Print JSON: one object per event (up, logs, gc, down), one document otherwise.
    #[arg(long, global = true)]
    json: bool,
    /// How long to keep trying to reach the coordinator, in seconds; each failed attempt is said
    /// on stderr as it happens.
    #[arg(
        long,
        global = true,
        env = "KILN_CONNECT_TIMEOUT",
        value_name = "SECS",
        default_value_t = 90,
        alias = "retry-window"
    )]
    connect_timeout: u64,
    /// The CA (PEM) a served coordinator's certificate must chain to (its `tls/ca.pem`); without
    /// it, the system's roots.
    #[arg(long, global = true, env = "KILN_CA", value_name = "FILE")]
    ca: Option<PathBuf>,
    /// The file holding your token (mode 0600), when it is not in KILN_TOKEN or
    /// ~/.config/kiln/token.
    #[arg(long, global = true, value_name = "FILE")]
    token_file: Option<PathBuf>,
}

impl Remote {
    fn connect(&self) -> Connect {
        Connect {
            coordinator: self.coordinator.clone().filter(|url| !url.is_empty()),
            kiln_home: None,
            retry_window: Duration::from_secs(self.connect_timeout),
            ca: self.ca.clone(),
            token_file: self.token_file.clone(),
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
    /// Every image says why it was skipped, delivered or built.
    Up {
        /// The instance folder holding `kiln.toml`.
        #[arg(default_value = ".")]
        dir: PathBuf,
        /// Rebuild and redeliver every built image, whatever is recorded or held.
        #[arg(long)]
        force: bool,
        /// Print the plan — every image with what would happen and why — and change nothing:
        /// no claim, upload, build, delivery or record.
        #[arg(long)]
        dry_run: bool,
    },
    /// Copy the instance's pinned images into its mirror_registry — every platform, at the
    /// pinned digest — and nothing else: no build, record or sweep. Shows bytes as they move.
    Mirror {
        /// The instance folder holding `kiln.toml`.
        #[arg(default_value = ".")]
        dir: PathBuf,
        /// List what would be copied; copy nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Take an instance down: delete its record, then sweep what nothing else needs. No prompt.
    Down {
        /// The instance folder whose `kiln.toml` names the instance.
        #[arg(default_value = ".")]
        dir: PathBuf,
    },
    /// Sweep now: remove every image this farm built that no record, claim, pin or container
    /// needs, and the uploaded contexts no record or claim names. No prompt: it removes only what
    /// Kiln built and nothing a root names.
    Gc {
        /// Print the plan per store, with bytes per instance; remove nothing.
        #[arg(long)]
        dry_run: bool,
        /// Remove only this instance's images.
        #[arg(long, value_name = "NAME")]
        instance: Option<String>,
    },
    /// Keep a ref (or an image id) through every sweep until it is unpinned.
    Pin { reference: String },
    /// Let a pinned ref go: the next sweep takes it if nothing else needs it.
    Unpin { reference: String },
    /// List the pinned refs.
    Pins,
    /// Show the recorded images of every instance (or one) and the recent converges.
    Status { instance: Option<String> },
    /// Replay a converge's events; with --follow, keep going until it finishes.
    Logs {
        /// The converge id (`kiln status` lists them).
        id: String,
        #[arg(long)]
        follow: bool,
    },
    /// List this farm's images in every store the agents manage.
    Images {
        /// Every farm's Kiln images, with a farm column.
        #[arg(long)]
        all_farms: bool,
    },
    /// List the agents the coordinator knows.
    Agents,
    /// The audit log: every mutating call, who made it, from where, how it ended (an admin sees
    /// every entry; anyone else their own).
    Audit {
        /// Only entries this many seconds old or newer.
        #[arg(long, value_name = "SECS")]
        since: Option<u64>,
    },
    /// Who the coordinator takes you for: your user, role and team.
    Whoami,
    /// What the farm runs now: every running converge and its build tasks — owner, image,
    /// agent, state, and a queued task's place and estimated wait.
    Ps,
    /// Cancel a running converge: its queued builds are dropped, its running builds stopped on
    /// their agents, its claims released; the record stays as it was.
    Cancel {
        /// The converge id (`kiln ps` lists them).
        id: String,
    },
    /// Say what moved since the recorded generation of a built image: every file (added, removed,
    /// changed, mode or type changed, symlink retargeted), the Dockerfile, build args, target
    /// stage, platforms. "nothing moved" when nothing did.
    Why {
        /// The built image's name in kiln.toml.
        image: String,
        /// The instance folder holding `kiln.toml`.
        #[arg(default_value = ".")]
        dir: PathBuf,
        /// Compare with generation N (the current one or the one it replaced) instead of the current.
        #[arg(long, value_name = "N")]
        since: Option<u64>,
    },
    /// Print the tree digest of a build context (what its content tag addresses).
    Digest {
        /// The context directory.
        dir: PathBuf,
        /// Also print every entry the digest covered: type, size, content hash (files), path.
        #[arg(long)]
        list: bool,
        /// The Dockerfile's path inside the context (always part of it, even if .dockerignore names it).
        #[arg(long, default_value = "Dockerfile")]
        dockerfile: String,
    },
    /// Watch the contexts kiln walks (inotify), so that kiln up and kiln digest skip the walk
    /// of a context that has not changed: runs until Ctrl-C or SIGTERM, one per user.
    Watch {
        /// The socket to answer on (default: $KILN_WATCH_SOCKET, else kiln/watch.sock under
        /// $XDG_RUNTIME_DIR or ~/.cache).
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
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
    /// Print the content ref of every image of an instance, as `kiln up` computes them (running
    /// each built image's stage command, as `kiln up` does).
    Refs {
        /// The instance folder holding `kiln.toml`.
        #[arg(default_value = ".")]
        dir: PathBuf,
    },
}

impl Command {
    /// How the command's trace is named: `kiln up`, `kiln status`.
    fn name(&self) -> &'static str {
        match self {
            Command::Up { .. } => "up",
            Command::Mirror { .. } => "mirror",
            Command::Down { .. } => "down",
            Command::Gc { .. } => "gc",
            Command::Pin { .. } => "pin",
            Command::Unpin { .. } => "unpin",
            Command::Pins => "pins",
            Command::Status { .. } => "status",
            Command::Logs { .. } => "logs",
            Command::Images { .. } => "images",
            Command::Agents => "agents",
            Command::Audit { .. } => "audit",
            Command::Whoami => "whoami",
            Command::Ps => "ps",
            Command::Cancel { .. } => "cancel",
            Command::Why { .. } => "why",
            Command::Digest { .. } => "digest",
            Command::Watch { .. } => "watch",
            Command::Pack { .. } => "pack",
            Command::Unpack { .. } => "unpack",
            Command::Refs { .. } => "refs",
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let plumbing = match cli.command {
        Command::Digest { dir, list, dockerfile } => {
            let stat_cache = kiln::home::stat_cache_dir(false, None);
            kiln::plumbing::digest(&dir, list, dockerfile, stat_cache.as_deref())
        }
        Command::Watch { socket } => kiln::watch::run(socket),
        Command::Pack { dir, output, dockerfile } => kiln::plumbing::pack(&dir, &output, dockerfile),
        Command::Unpack { file, dir, expect } => kiln::plumbing::unpack(&file, &dir, expect.as_deref()),
        Command::Refs { dir } => kiln::plumbing::refs(&dir, &cli.remote.connect()),
        command => return run(command, &cli.remote),
    };
    match plumbing {
        Ok(()) => ExitCode::SUCCESS,
        // `kiln digest … | head`: the reader has what it wanted.
        Err(err) if kiln::plumbing::is_broken_pipe(&err) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kiln: {err:#}");
            ExitCode::from(kiln::plumbing::exit_of(&err).code())
        }
    }
}

/// The commands that talk to a coordinator.
fn run(command: Command, remote: &Remote) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("kiln: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let done = runtime.block_on(async {
        // Traces when OTEL_EXPORTER_OTLP_ENDPOINT is set, one per command: every call carries the
        // command's span to the coordinator (`traceparent`). A bad endpoint must not stop a converge.
        let telemetry = kiln_telemetry::init("kiln", kiln_telemetry::Process::Command)
            .map_err(|err| eprintln!("kiln: warning: traces are off: {}", kiln_core::error_chain(&err)))
            .ok();
        let name = command.name();
        let root = tracing::info_span!("kiln", otel.name = %format!("kiln {name}"), command = name);
        let done = dispatch(command, remote).instrument(root).await;
        // The command's span closed with the future above; send it before the process exits.
        if let Some(telemetry) = telemetry {
            telemetry.shutdown().await;
        }
        done
    });
    match done {
        Ok(exit) => ExitCode::from(exit.code()),
        // `kiln logs … | head`: the reader closed the pipe because it has what it wanted.
        Err(CliError::Output(err)) if err.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kiln: {}", report(&err));
            ExitCode::from(err.exit().code())
        }
    }
}

/// A gc's or down's exit: its converge's. The failure was shown with the job's events; JSON
/// output (events on stdout) also says it once on stderr for a script's log.
fn job_exit(job: &str, run: &kiln::UpOutcome, remote: &Remote) -> Result<Exit, CliError> {
    if let (Some(failure), true) = (&run.failure, remote.json) {
        eprintln!("kiln: {job} ({}) failed: {failure}", run.converge_id);
    }
    Ok(run.exit())
}

async fn dispatch(command: Command, remote: &Remote) -> Result<Exit, CliError> {
    let (connect, output) = (remote.connect(), remote.output());
    match command {
        Command::Up { dir, force, dry_run } => {
            let args = kiln::UpArgs { dir, force, dry_run, connect, output };
            let outcome = kiln::up(args).await?;
            job_exit("converge", &outcome, remote)
        }
        Command::Mirror { dir, dry_run } => {
            let outcome = kiln::mirror(kiln::MirrorArgs { dir, dry_run, connect, output }).await?;
            job_exit("mirror", &outcome, remote)
        }
        Command::Down { dir } => {
            let outcome = kiln::down(kiln::DownArgs { dir, connect, output }).await?;
            job_exit("down", &outcome.run, remote)
        }
        Command::Gc { dry_run, instance } => {
            let outcome = kiln::gc(kiln::GcArgs { dry_run, instance, connect, output }).await?;
            job_exit("gc", &outcome.run, remote)
        }
        Command::Pin { reference } => {
            kiln::pin(kiln::PinArgs { reference, connect, output }).await.map(|_| Exit::Converged)
        }
        Command::Unpin { reference } => {
            kiln::unpin(kiln::PinArgs { reference, connect, output }).await.map(|_| Exit::Converged)
        }
        Command::Pins => {
            kiln::pins(kiln::ListArgs { connect, output, ..Default::default() }).await.map(|_| Exit::Converged)
        }
        Command::Status { instance } => {
            kiln::status(kiln::StatusArgs { instance, connect, output }).await.map(|_| Exit::Converged)
        }
        Command::Logs { id, follow } => {
            let args = kiln::LogsArgs { converge_id: id, follow, connect, output };
            kiln::logs(args).await.map(|_| Exit::Converged)
        }
        Command::Images { all_farms } => {
            kiln::images(kiln::ListArgs { connect, output, all_farms }).await.map(|_| Exit::Converged)
        }
        Command::Agents => {
            kiln::agents(kiln::ListArgs { connect, output, ..Default::default() }).await.map(|_| Exit::Converged)
        }
        Command::Audit { since } => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0);
            let since_ms = since.map_or(0, |s| now.saturating_sub(s * 1000));
            let args = kiln::ListArgs { connect, output, ..Default::default() };
            kiln::audit(args, since_ms).await.map(|_| Exit::Converged)
        }
        Command::Ps => {
            kiln::ps(kiln::ListArgs { connect, output, ..Default::default() }).await.map(|_| Exit::Converged)
        }
        Command::Cancel { id } => {
            kiln::cancel(kiln::ListArgs { connect, output, ..Default::default() }, id).await.map(|_| Exit::Converged)
        }
        Command::Why { image, dir, since } => {
            kiln::why(kiln::WhyArgs { image, dir, since, connect, output }).await.map(|_| Exit::Converged)
        }
        Command::Whoami => {
            kiln::whoami(kiln::ListArgs { connect, output, ..Default::default() }).await.map(|_| Exit::Converged)
        }
        Command::Digest { .. }
        | Command::Watch { .. }
        | Command::Pack { .. }
        | Command::Unpack { .. }
        | Command::Refs { .. } => {
            unreachable!("the plumbing commands run without a runtime")
        }
    }
}
