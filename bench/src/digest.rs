//! `kiln-bench digest`: Kiln's tree digest against what a build context costs to read otherwise.
//!
//! Small files (warm and, with `--cold`, cold page cache): Kiln's `digest_dir` in-process, against
//! (a) `find | sort | xargs cat` — the floor of reading every file once, single-threaded — and
//! (b) `baselines/content_hash.mjs`, the seed's sequential Node tree hash. One big file: Kiln
//! against `b3sum`, which is the same blake3 with the same mmap + threads.

use crate::util::{self, Contestant};
use anyhow::{bail, Context, Result};
use kiln_core::digest::{digest_dir, TreeDigest, WalkOptions};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Number of small files in the tree.
    #[arg(long, default_value_t = 20_000)]
    files: usize,
    /// Size of each small file in bytes.
    #[arg(long, default_value_t = 4096)]
    size: usize,
    /// Measured runs per contestant (the median is reported).
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Also measure with the page cache dropped before every run (needs root).
    #[arg(long)]
    cold: bool,
    /// Size of the single-file comparison with b3sum in GiB; 0 skips it.
    #[arg(long, default_value_t = 1)]
    big_gib: u64,
}

/// Leaf directories the small files are spread over (10 × 10, two levels deep).
const FANOUT: usize = 10;

pub fn run(args: &Args) -> Result<()> {
    let node = util::which("node").context("node is not on PATH; baseline (b) needs it")?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("baselines/content_hash.mjs");
    let scratch = util::scratch_dir("kiln-bench-digest-")?;
    let tree = scratch.path().join("tree");
    eprintln!("generating {} files of {} bytes under {}", args.files, args.size, tree.display());
    generate_small(&tree, args.files, args.size)?;
    println!("## Tree digest\n");
    println!(
        "{} files × {} bytes in {} directories; {} runs each, medians.",
        args.files,
        args.size,
        FANOUT * FANOUT,
        args.runs
    );

    small_files(&tree, &node, &script, args.runs, false)?;
    if args.cold {
        small_files(&tree, &node, &script, args.runs, true)?;
    }
    if args.big_gib > 0 {
        big_file(scratch.path(), args.big_gib, args.runs)?;
    }
    Ok(())
}

pub(crate) fn generate_small(root: &Path, files: usize, size: usize) -> Result<()> {
    let mut rng = fastrand::Rng::with_seed(0x6b696c6e);
    let mut buf = vec![0u8; size];
    for i in 0..files {
        let dir = root.join(format!("d{:02}/s{:02}", i % FANOUT, (i / FANOUT) % FANOUT));
        if i < FANOUT * FANOUT {
            fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        rng.fill(&mut buf);
        let path = dir.join(format!("file{i:06}.bin"));
        fs::write(&path, &buf).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Times one in-process digest and checks it against the first one: a digest that varied from
/// run to run would make the timing meaningless.
fn time_kiln(root: &Path, expected: TreeDigest) -> Result<Duration> {
    let started = Instant::now();
    let (tree, digest) =
        digest_dir(root, &WalkOptions::default()).with_context(|| format!("digesting {}", root.display()))?;
    let took = started.elapsed();
    std::hint::black_box(tree.entries.len());
    if digest != expected {
        bail!("digest of {} changed between runs: {expected} then {digest}", root.display());
    }
    Ok(took)
}

/// Runs the Node baseline and returns the time it reports for the hash itself.
fn time_node(node: &Path, script: &Path, root: &Path) -> Result<Duration> {
    let out = Command::new(node).arg(script).arg(root).output().context("running node")?;
    if !out.status.success() {
        bail!("content_hash.mjs failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let ms: f64 = text
        .split_whitespace()
        .nth(1)
        .and_then(|ms| ms.parse().ok())
        .with_context(|| format!("content_hash.mjs printed {text:?}, expected `<hash> <ms>`"))?;
    Ok(Duration::from_secs_f64(ms / 1e3))
}

fn small_files(root: &Path, node: &Path, script: &Path, runs: usize, cold: bool) -> Result<()> {
    let (_, digest) = digest_dir(root, &WalkOptions::default())?;
    let label = if cold { "cold page cache" } else { "warm page cache" };
    eprintln!("small files, {label}: kiln digest {digest}");
    let pipeline = format!("cd '{}' && find . -type f -print0 | sort -z | xargs -0 cat > /dev/null", root.display());
    let mut contestants = vec![
        Contestant::new("kiln digest_dir", || time_kiln(root, digest)),
        Contestant::new("(a) find | sort | xargs cat", || {
            util::time_command(Command::new("sh").arg("-c").arg(&pipeline))
        }),
        Contestant::new("(b) node contentHash", || time_node(node, script, root)),
    ];
    let warmup = if cold { 0 } else { 1 };
    util::rounds(&mut contestants, runs, warmup, || if cold { util::drop_caches() } else { Ok(()) })?;
    util::print_table(&format!("Small files, {label}"), &contestants);
    println!("\nKiln's digest of the tree: `{digest}` ({label}, same every run).");
    let kiln = contestants[0].median();
    let vs_a = util::speedup(contestants[1].median(), kiln);
    let vs_b = util::speedup(contestants[2].median(), kiln);
    println!();
    if cold {
        util::goal("cold: Kiln vs (b)", vs_b, 4.0);
        println!("- cold: Kiln vs (a): {vs_a:.2}× (no goal)");
    } else {
        util::goal("warm: Kiln vs (b)", vs_b, 3.0);
        util::goal("warm: Kiln vs (a)", vs_a, 0.8);
    }
    Ok(())
}

fn big_file(scratch: &Path, gib: u64, runs: usize) -> Result<()> {
    let Some(b3sum) = util::which("b3sum") else {
        println!("\n(b3sum is not on PATH: install it with `cargo install b3sum` to run the big-file comparison)");
        return Ok(());
    };
    let dir = scratch.join("big");
    let file = dir.join("big.bin");
    eprintln!("generating a {gib} GiB file at {}", file.display());
    write_random(&file, gib << 30)?;
    let (_, digest) = digest_dir(&dir, &WalkOptions::default())?;
    eprintln!("one big file: kiln digest {digest}");
    let mut contestants = vec![
        Contestant::new("kiln digest_dir", || time_kiln(&dir, digest)),
        Contestant::new("b3sum FILE", || util::time_command(Command::new(&b3sum).arg(&file))),
    ];
    util::rounds(&mut contestants, runs, 1, || Ok(()))?;
    util::print_table(&format!("One {gib} GiB file, warm page cache"), &contestants);
    let vs = util::speedup(contestants[1].median(), contestants[0].median());
    println!("\nKiln's digest of the directory: `{digest}`.");
    util::goal("big file: Kiln vs b3sum", vs, 0.8);
    Ok(())
}

fn write_random(path: &PathBuf, len: u64) -> Result<()> {
    fs::create_dir_all(path.parent().unwrap())?;
    let mut out = std::io::BufWriter::with_capacity(8 << 20, fs::File::create(path)?);
    let mut rng = fastrand::Rng::with_seed(0x62696766);
    let mut chunk = vec![0u8; 8 << 20];
    let mut left = len;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        rng.fill(&mut chunk[..n]);
        out.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    out.flush()?;
    Ok(())
}
