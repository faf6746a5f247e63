//! `kiln`, the thin client. Today it carries the plumbing commands over `kiln-core` — the same
//! functions the coordinator and the agents will call — so a user can see exactly what a tag
//! addresses: `digest`, `pack`, `unpack`, and `refs` (the walk-and-address step of `kiln up`).
//!
//! Exit codes: 0 success; 1 the command failed (the message names the object and the fix);
//! 2 the command line was wrong.

mod plumbing;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "kiln",
    version,
    about = "Content-addressed container images: built once, delivered, swept by reachability"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
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
    let result = match cli.command {
        Command::Digest { dir, list, dockerfile } => plumbing::digest(&dir, list, dockerfile),
        Command::Pack { dir, output, dockerfile } => plumbing::pack(&dir, &output, dockerfile),
        Command::Unpack { file, dir, expect } => plumbing::unpack(&file, &dir, expect.as_deref()),
        Command::Refs { dir } => plumbing::refs(&dir),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kiln: {err:#}");
            ExitCode::FAILURE
        }
    }
}
