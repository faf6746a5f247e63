//! `kiln-bench stat-cache`: the no-op path with a warm stat cache, as whole processes the way a
//! user runs them, against `git status --porcelain` (index fresh) and a bare `find -printf` walk of
//! the same tree; and the cold-cache first digest against the previous release's (tree digest v1,
//! no stat cache) `kiln digest`.
//!
//! The tree is `digest`'s (20,000 × 4 KiB in 100 directories) as `app/` of an instance folder that
//! is also a git work tree, so `git status` sees exactly the context plus `kiln.toml` and the
//! stat caches and `KILN_HOME` live outside it.
//!
//! With `--watch`, a `kiln watch` process is started for the run (on a socket in the scratch
//! folder, stopped by its PID at the end) and the same no-op commands are timed again with it
//! answering; every other contestant runs with `KILN_WATCH=off`, so a watcher the user runs
//! cannot speed it up unseen.

use crate::util::{self, Contestant};
use anyhow::{bail, Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[arg(long, default_value_t = 20_000)]
    files: usize,
    #[arg(long, default_value_t = 4096)]
    size: usize,
    /// Measured runs per contestant (the median is reported).
    #[arg(long, default_value_t = 11)]
    runs: usize,
    /// The `kiln` binary under test (default: beside this one, from `cargo build --release -p kiln`).
    #[arg(long)]
    kiln: Option<PathBuf>,
    /// A `kiln` built from before tree digest v2, for "the old behaviour" (BENCHMARKS.md says how).
    #[arg(long)]
    baseline_kiln: Option<PathBuf>,
    /// Also time a no-op `kiln up` of the instance (embedded coordinator, local target; needs Docker).
    #[arg(long)]
    up: bool,
    /// Also time `kiln digest` (and, with --up, the no-op `kiln up`) with `kiln watch` running.
    #[arg(long)]
    watch: bool,
}

/// Longer than the stat cache's racy margin for nanosecond timestamps (100 ms) and than git's
/// (whole seconds on its index): after it, both trust what they recorded.
const SETTLE: Duration = Duration::from_millis(1100);

struct Setup {
    instance: PathBuf,
    context: PathBuf,
    /// `XDG_CACHE_HOME` of the warm runs.
    warm_cache: PathBuf,
    /// `XDG_CACHE_HOME` of the cold runs, emptied before each.
    cold_cache: PathBuf,
    kiln_home: PathBuf,
    /// The `kiln watch` socket of the `--watch` contestants.
    watch_socket: PathBuf,
}

pub fn run(args: &Args) -> Result<()> {
    let kiln = match &args.kiln {
        Some(path) => path.clone(),
        None => std::env::current_exe()?.with_file_name("kiln"),
    };
    if !kiln.is_file() {
        bail!("{} is not built: run `cargo build --release -p kiln` first", kiln.display());
    }
    let git = util::which("git").context("git is not on PATH")?;
    let scratch = util::scratch_dir("kiln-bench-statcache-")?;
    let s = Setup {
        instance: scratch.path().join("instance"),
        context: scratch.path().join("instance/app"),
        warm_cache: scratch.path().join("cache-warm"),
        cold_cache: scratch.path().join("cache-cold"),
        kiln_home: scratch.path().join("home"),
        watch_socket: scratch.path().join("run/watch.sock"),
    };
    eprintln!("generating {} files of {} bytes under {}", args.files, args.size, s.context.display());
    crate::digest::generate_small(&s.context, args.files, args.size)?;
    fs::write(s.context.join("Dockerfile"), "FROM scratch\nCOPY . /app/\n")?;
    fs::write(
        s.instance.join("kiln.toml"),
        format!(
            "instance = \"statcache{:08x}\"\n\n[target]\nkind = \"local\"\n\n[built.app]\ncontext = \"app\"\n",
            fastrand::u32(..)
        ),
    )?;
    git_init(&git, &s.instance)?;

    let digest = |cache: &Path| kiln_digest(&kiln, &s.context, cache, None);
    let expected = digest(&s.warm_cache)?;
    std::thread::sleep(SETTLE);
    // The first run after the racy window rewrites the cache with a stamp that vouches for every
    // file; git's index is refreshed the same way.
    digest(&s.warm_cache)?;
    util::time_command(Command::new(&git).arg("-C").arg(&s.instance).args(["status", "--porcelain"]))?;
    let old = match &args.baseline_kiln {
        Some(path) => Some(kiln_digest(path, &s.context, &s.cold_cache, None)?),
        None => None,
    };
    if args.up {
        first_up(&kiln, &s)?;
    }
    let watcher = match args.watch {
        true => Some(Watcher::start(&kiln, &s)?),
        false => None,
    };
    if watcher.is_some() {
        // The first question watches the tree and walks it; the second finds it vouched for.
        for _ in 0..2 {
            check_watched(kiln_digest(&kiln, &s.context, &s.warm_cache, Some(&s.watch_socket))?, &expected)?;
            if args.up {
                noop_up(&kiln, &s, Some(&s.watch_socket))?;
            }
        }
    }

    let check = |got: String| -> Result<()> {
        match got == expected {
            true => Ok(()),
            false => bail!("kiln digest printed {got}, expected {expected}"),
        }
    };
    let find = format!("find '{}' -printf '%s %T@\\n' > /dev/null", s.context.display());
    let mut contestants = vec![
        Contestant::new("kiln digest, warm stat cache", || timed(|| check(digest(&s.warm_cache)?))),
        Contestant::new("git status --porcelain (index fresh)", || {
            util::time_command(Command::new(&git).arg("-C").arg(&s.instance).args(["status", "--porcelain"]))
        }),
        Contestant::new("find -printf '%s %T@'", || util::time_command(Command::new("sh").arg("-c").arg(&find))),
        Contestant::new("kiln digest, cold stat cache", || {
            let _ = fs::remove_dir_all(&s.cold_cache);
            timed(|| check(digest(&s.cold_cache)?))
        }),
    ];
    if let (Some(path), Some(old)) = (&args.baseline_kiln, &old) {
        let (context, cold) = (&s.context, &s.cold_cache);
        contestants.push(Contestant::new("kiln digest v1 (before: no cache, contents streamed)", move || {
            timed(|| match kiln_digest(path, context, cold, None)? == *old {
                true => Ok(()),
                false => bail!("the v1 kiln's digest changed between runs"),
            })
        }));
    }
    if args.up {
        contestants.push(Contestant::new("kiln up, no-op (embedded, whole process)", || noop_up(&kiln, &s, None)));
    }
    if watcher.is_some() {
        let socket = Some(s.watch_socket.as_path());
        let (kiln, s, expected) = (&kiln, &s, &expected);
        contestants.push(Contestant::new("kiln digest, kiln watch running", move || {
            timed(|| check_watched(kiln_digest(kiln, &s.context, &s.warm_cache, socket)?, expected))
        }));
        if args.up {
            contestants
                .push(Contestant::new("kiln up, no-op, kiln watch running (embedded, whole process)", move || {
                    noop_up(kiln, s, socket)
                }));
        }
    }
    util::rounds(&mut contestants, args.runs, 1, || Ok(()))?;

    println!("## Stat cache: the no-op path\n");
    println!(
        "{} files × {} bytes in 100 directories (plus a Dockerfile), page cache warm; whole processes, \
         {} interleaved runs each, medians. Digest `{expected}`.",
        args.files, args.size, args.runs
    );
    util::print_table("No-op path, warm stat cache", &contestants);
    let median = |i: usize| contestants[i].median().as_secs_f64();
    println!();
    ratio("kiln digest (warm) / git status", median(0) / median(1), 1.0);
    ratio("kiln digest (warm) / find", median(0) / median(2), 1.5);
    let mut next = 4;
    if args.baseline_kiln.is_some() {
        ratio("cold-cache kiln digest / v1 kiln digest", median(3) / median(4), 1.05);
        next += 1;
    } else {
        println!("- (no --baseline-kiln: the cold-cache digest is not compared with v1)");
    }
    if args.up {
        ratio("kiln up no-op / git status", median(next) / median(1), 1.0);
        ratio("kiln up no-op / find", median(next) / median(2), 1.5);
        next += 1;
    }
    if watcher.is_some() {
        ratio("kiln digest with kiln watch / git status", median(next) / median(1), 1.0);
        ratio("kiln digest with kiln watch / find", median(next) / median(2), 1.5);
        if args.up {
            ratio("kiln up no-op with kiln watch / git status", median(next + 1) / median(1), 1.0);
            ratio("kiln up no-op with kiln watch / find", median(next + 1) / median(2), 1.5);
        }
    }
    drop(watcher);
    if args.up {
        drop(contestants);
        // `kiln down` removes the record and sweeps the image the first converge built, so
        // runs leave nothing on the daemon.
        let mut down = Command::new(&kiln);
        down.arg("down").arg(&s.instance).env("KILN_HOME", &s.kiln_home).env_remove("KILN_COORDINATOR");
        if let Err(err) = util::time_command(&mut down) {
            eprintln!("cleanup: {err:#} — remove the statcache… image by hand");
        }
    }
    Ok(())
}

/// `ours / theirs` against a ceiling (lower is better).
fn ratio(what: &str, measured: f64, ceiling: f64) {
    let met = if measured <= ceiling { "met" } else { "MISSED" };
    println!("- {what}: {measured:.2} (goal ≤ {ceiling:.2}) — {met}");
}

fn timed(f: impl FnOnce() -> Result<()>) -> Result<Duration> {
    let started = Instant::now();
    f()?;
    Ok(started.elapsed())
}

/// The watcher a `--watch` run times against, stopped (by its PID) when dropped.
struct Watcher(std::process::Child);

impl Watcher {
    fn start(kiln: &Path, s: &Setup) -> Result<Watcher> {
        let child = Command::new(kiln)
            .arg("watch")
            .arg("--socket")
            .arg(&s.watch_socket)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting kiln watch")?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !s.watch_socket.exists() {
            if Instant::now() > deadline {
                bail!("kiln watch did not make {} within 10 s", s.watch_socket.display());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(Watcher(child))
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn check_watched(got: String, expected: &str) -> Result<()> {
    match got == expected {
        true => Ok(()),
        false => bail!("kiln digest with kiln watch printed {got}, expected {expected}"),
    }
}

/// Asks `kiln watch` on `socket`, or no watcher at all with `None`.
fn watch_env(cmd: &mut Command, socket: Option<&Path>) {
    match socket {
        Some(socket) => cmd.env("KILN_WATCH_SOCKET", socket).env_remove("KILN_WATCH"),
        None => cmd.env("KILN_WATCH", "off"),
    };
}

/// `kiln digest DIR` with its stat cache under `cache`; returns the digest it printed.
fn kiln_digest(kiln: &Path, dir: &Path, cache: &Path, watch: Option<&Path>) -> Result<String> {
    let mut cmd = Command::new(kiln);
    watch_env(&mut cmd, watch);
    let out = cmd
        .arg("digest")
        .arg(dir)
        .env("XDG_CACHE_HOME", cache)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", kiln.display()))?;
    if !out.status.success() {
        bail!("{} digest exited with {}", kiln.display(), out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn git_init(git: &Path, dir: &Path) -> Result<()> {
    for args in [
        &["init", "-q"][..],
        &["add", "-A"],
        &["-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", "tree"],
    ] {
        let status = Command::new(git).arg("-C").arg(dir).args(args).stdout(Stdio::null()).status()?;
        if !status.success() {
            bail!("git {args:?} exited with {status}");
        }
    }
    Ok(())
}

fn up_command(kiln: &Path, s: &Setup, watch: Option<&Path>) -> Command {
    let mut cmd = Command::new(kiln);
    cmd.arg("up").arg(&s.instance).env("KILN_HOME", &s.kiln_home).env_remove("KILN_COORDINATOR");
    watch_env(&mut cmd, watch);
    cmd
}

/// The converge that builds the image; the measured ones then find it recorded.
fn first_up(kiln: &Path, s: &Setup) -> Result<()> {
    let started = Instant::now();
    let out = up_command(kiln, s, None).output()?;
    if !out.status.success() {
        bail!("the first kiln up failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    eprintln!("first kiln up (builds; not measured): {}", util::fmt(started.elapsed()));
    std::thread::sleep(SETTLE);
    up_command(kiln, s, None).output()?;
    Ok(())
}

fn noop_up(kiln: &Path, s: &Setup, watch: Option<&Path>) -> Result<Duration> {
    let started = Instant::now();
    let out = up_command(kiln, s, watch).arg("--json").output()?;
    let took = started.elapsed();
    if !out.status.success() {
        bail!("kiln up failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    if text.contains("\"kind\":\"built\"") || !text.contains("\"kind\":\"recorded\"") {
        bail!("a no-op kiln up should find the image recorded: {text}");
    }
    Ok(took)
}
