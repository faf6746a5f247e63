//! Timing helpers every benchmark shares: run contestants in interleaved rounds (so a noisy
//! neighbour slows all of them alike rather than whichever ran during the noise), take medians,
//! print ratios and a markdown table ready to paste into BENCHMARKS.md.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One thing being timed: a name and a closure that performs one run and returns its duration
/// (closures time themselves, so a baseline can exclude its own start-up when that is fairer).
pub struct Contestant<'a> {
    pub name: String,
    pub run: Box<dyn FnMut() -> Result<Duration> + 'a>,
    pub times: Vec<Duration>,
}

impl<'a> Contestant<'a> {
    pub fn new(name: impl Into<String>, run: impl FnMut() -> Result<Duration> + 'a) -> Self {
        Contestant { name: name.into(), run: Box::new(run), times: Vec::new() }
    }

    pub fn median(&self) -> Duration {
        median(&self.times)
    }
}

/// Runs every contestant `runs` times, round-robin, calling `before_each` before every single run
/// (e.g. to drop the page cache). `warmup` extra rounds run first and are not recorded.
pub fn rounds(
    contestants: &mut [Contestant<'_>],
    runs: usize,
    warmup: usize,
    mut before_each: impl FnMut() -> Result<()>,
) -> Result<()> {
    for round in 0..warmup + runs {
        for c in contestants.iter_mut() {
            before_each()?;
            let took = (c.run)().with_context(|| format!("{} failed", c.name))?;
            if round >= warmup {
                eprintln!("  {:<28} run {:>2}: {}", c.name, round - warmup + 1, fmt(took));
                c.times.push(took);
            }
        }
    }
    Ok(())
}

/// The value at fraction `p` (0.5, 0.99) of `sorted`, rounded to the nearest sample; `None` when
/// there are no samples.
pub fn percentile<T: Copy>(sorted: &[T], p: f64) -> Option<T> {
    let last = sorted.len().checked_sub(1)?;
    sorted.get((last as f64 * p).round() as usize).copied()
}

pub fn median(times: &[Duration]) -> Duration {
    let mut sorted = times.to_vec();
    sorted.sort();
    match sorted.len() {
        0 => Duration::ZERO,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2,
    }
}

/// Milliseconds with a precision that suits the magnitude.
pub fn fmt(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms >= 100.0 {
        format!("{ms:.0} ms")
    } else {
        format!("{ms:.1} ms")
    }
}

/// How many times faster `ours` is than `theirs` (> 1 means ours is faster).
pub fn speedup(theirs: Duration, ours: Duration) -> f64 {
    theirs.as_secs_f64() / ours.as_secs_f64()
}

/// Times a whole process from spawn to exit; fails if it exits non-zero.
pub fn time_command(cmd: &mut Command) -> Result<Duration> {
    let started = Instant::now();
    let status = cmd.stdout(Stdio::null()).status().with_context(|| format!("spawning {cmd:?}"))?;
    let took = started.elapsed();
    if !status.success() {
        bail!("{cmd:?} exited with {status}");
    }
    Ok(took)
}

/// Empties the page cache so the next run reads from the disk. Needs root.
pub fn drop_caches() -> Result<()> {
    let status = Command::new("sync").status().context("running sync")?;
    if !status.success() {
        bail!("sync exited with {status}");
    }
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .context("writing /proc/sys/vm/drop_caches (cold-cache runs need root)")
}

/// The first `name` on `PATH`.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|p| p.is_file())
}

/// Prints a markdown table of contestants: median, fastest, slowest, and the ratio of each
/// contestant's median to the first one's (the first is the subject, the rest are baselines).
pub fn print_table(title: &str, contestants: &[Contestant<'_>]) {
    println!("\n### {title}\n");
    println!("| contestant | median | min | max | subject's speed-up |");
    println!("|---|---:|---:|---:|---:|");
    let subject = contestants[0].median();
    for c in contestants {
        let min = c.times.iter().min().copied().unwrap_or_default();
        let max = c.times.iter().max().copied().unwrap_or_default();
        let ratio = if std::ptr::eq(c, &contestants[0]) {
            "—".to_string()
        } else {
            format!("{:.2}×", speedup(c.median(), subject))
        };
        println!("| {} | {} | {} | {} | {} |", c.name.replace('|', "\\|"), fmt(c.median()), fmt(min), fmt(max), ratio);
    }
}

/// A goal line: `ok`/`MISSED`, and the measured against the required ratio.
pub fn goal(what: &str, measured: f64, required: f64) -> bool {
    let met = measured >= required;
    println!("- {what}: {measured:.2}× (goal ≥ {required:.2}×) — {}", if met { "met" } else { "MISSED" });
    met
}

/// A scratch directory on a real disk (not tmpfs), so cold-cache runs really read the disk.
pub fn scratch_dir(prefix: &str) -> Result<tempfile::TempDir> {
    let base = Path::new("/var/tmp");
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(base)
        .with_context(|| format!("creating a scratch dir in {}", base.display()))
}
