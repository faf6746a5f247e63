//! `kiln-bench noop-up` and `kiln-bench cold-build`: whole `kiln up` calls — the library function
//! the binary runs — against an in-process coordinator and host agent ([`farm`]) over the real
//! Docker daemon.
//!
//! `noop-up` checks DESIGN.md's claim that a steady-state converge costs a directory walk and one
//! RPC: repeated converges of an unchanged, recorded instance against hashing its contexts alone.
//! `cold-build` checks that a first build costs little more than Docker's own: a full converge of a
//! context Docker has never seen (upload, verify, build, label) against `docker build` of the same
//! context. The agent builds with the daemon's BuildKit (the context as the request body); the
//! `docker` CLI here has no buildx, so its `docker build` is the classic builder, and BuildKit's own
//! time is measured through the same Engine API call Kiln makes (`tar | curl … /build?version=2`).

mod farm;

pub(crate) use farm::{loopback_listener, Coordinator};

use crate::util::{self, Contestant};
use anyhow::{bail, Context, Result};
use farm::Farm;
use kiln::{Connect, EventKind, Outcome, OutputMode, UpArgs, UpOutcome};
use kiln_core::archive::{pack, verify};
use kiln_core::digest::{walk_tree, WalkOptions};
use kiln_core::manifest::Manifest;
use rayon::prelude::*;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fs;
use std::io::{BufReader, BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(Debug, clap::Args)]
pub struct NoopArgs {
    /// Measured runs per contestant (the median is reported).
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Built images in the instance, each with a context of its own.
    #[arg(long, default_value_t = 3)]
    images: usize,
    /// Files across all contexts together.
    #[arg(long, default_value_t = 20_000)]
    files: usize,
    /// Size of each file in bytes.
    #[arg(long, default_value_t = 4096)]
    size: usize,
    /// Set TCP_NODELAY on the coordinator's listener (inherited by accepted connections), which
    /// `kiln-coordinator` and the embedded coordinator do not do: shows what Nagle costs.
    #[arg(long)]
    nodelay: bool,
}

#[derive(Debug, clap::Args)]
pub struct ColdArgs {
    /// Measured runs per contestant (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Files in the context.
    #[arg(long, default_value_t = 2_000)]
    files: usize,
    /// Size of each file in bytes.
    #[arg(long, default_value_t = 4096)]
    size: usize,
    /// Set TCP_NODELAY on the coordinator's listener (inherited by accepted connections), which
    /// `kiln-coordinator` and the embedded coordinator do not do: shows what Nagle costs.
    #[arg(long)]
    nodelay: bool,
    /// Print every Kiln run's events (build log included) with their offsets, on stderr.
    #[arg(long)]
    timeline: bool,
}

const DOCKERFILE: &str = "FROM scratch\nCOPY . /data\n";

/// Files per directory in a generated context.
const PER_DIR: usize = 100;

/// The file whose first bytes `cold-build` rewrites before every run.
const TOUCHED: &str = "d000/file000000.bin";

pub fn noop_up(args: &NoopArgs) -> Result<()> {
    let scratch = util::scratch_dir("kiln-bench-noop-")?;
    let dir = scratch.path().join("instance");
    let names: Vec<String> = (0..args.images).map(|i| format!("img{i}")).collect();
    let per = args.files.div_ceil(args.images);
    for (i, name) in names.iter().enumerate() {
        eprintln!("generating {per} files of {} bytes under {}", args.size, dir.join(name).display());
        write_context(&dir.join(name), per, args.size, 0x6e6f6f70 + i as u64)?;
    }
    write_manifest(&dir, &format!("noop{:08x}", fastrand::u32(..)), &names)?;
    let manifest = Manifest::load(&dir).context("loading the generated kiln.toml")?;
    let mut cleanup = Cleanup::default();
    cleanup.refs.extend(built_refs(&manifest)?);

    let rt = runtime()?;
    let farm = rt.block_on(Farm::start(&scratch.path().join("home"), args.nodelay))?;
    let started = Instant::now();
    let cold = rt.block_on(kiln::up(up_args(&dir, &farm.coordinator.url)))?;
    check_succeeded(&cold)?;
    if images_with(&cold, EventKind::Built).len() != args.images {
        bail!(
            "the first converge built {:?}, expected all {} images",
            images_with(&cold, EventKind::Built),
            args.images
        );
    }
    eprintln!("cold converge (not measured): {}; {}", util::fmt(started.elapsed()), farm.calls());

    let before = farm.calls();
    let mut contestants = vec![
        Contestant::new("kiln up, no-op (whole call)", || {
            let started = Instant::now();
            let outcome = rt.block_on(kiln::up(up_args(&dir, &farm.coordinator.url)))?;
            let took = started.elapsed();
            check_succeeded(&outcome)?;
            if images_with(&outcome, EventKind::Recorded) != names {
                bail!("a no-op converge should find every image recorded: {:?}", outcome.events);
            }
            if outcome.events.iter().any(|e| e.kind == EventKind::NeedContexts) {
                bail!("a no-op converge asked for contexts: {:?}", outcome.events);
            }
            Ok(took)
        }),
        Contestant::new(format!("hash only (address ×{})", args.images), || {
            let started = Instant::now();
            let built: Vec<_> = manifest.built().collect();
            let walked = built
                .par_iter()
                .map(|(_, image)| image.walk())
                .collect::<Result<Vec<_>, _>>()
                .context("walking the contexts")?;
            let trees = built.iter().zip(&walked).map(|((name, _), (_, digest))| (*name, *digest)).collect();
            let addresses = manifest.address(&trees).context("addressing the contexts")?;
            let took = started.elapsed();
            std::hint::black_box(addresses.len());
            Ok(took)
        }),
        // "Recorded means present": for a `local` target every no-op converge lists the host
        // store once (labeled images) to confirm what the record names is there.
        Contestant::new("piece: presence confirmation (labeled listing)", || {
            use kiln_agent::host::HostStore;
            let started = Instant::now();
            let listed = rt.block_on(farm.store.list_labeled())?;
            let took = started.elapsed();
            std::hint::black_box(listed.len());
            Ok(took)
        }),
        Contestant::new("piece: load + plan_up", || {
            let started = Instant::now();
            let manifest = Manifest::load(&dir)?;
            let plan = kiln::request::plan_up(&manifest, false, "kiln-bench", None)?;
            let took = started.elapsed();
            std::hint::black_box(plan.request.images.len());
            Ok(took)
        }),
    ];
    util::rounds(&mut contestants, args.runs, 1, || Ok(()))?;
    let during = farm.calls().since(before);

    println!("## No-op converge\n");
    println!(
        "{} built images, {} files × {} bytes each ({} files in all), target `local`; {} runs each, medians, \
         warm page cache; coordinator listener {}.",
        args.images,
        per,
        args.size,
        per * args.images,
        args.runs,
        nagle(args.nodelay)
    );
    util::print_table("No-op `kiln up` vs hashing the contexts", &contestants);
    let (up, hash, confirm, plan) =
        (contestants[0].median(), contestants[1].median(), contestants[2].median(), contestants[3].median());
    println!();
    println!("- up / hash-only: {:.2} (goal ≤ 1.20)", up.as_secs_f64() / hash.as_secs_f64());
    util::goal("hash-only / up", util::speedup(hash, up), 1.0 / 1.2);
    println!(
        "- presence confirmation (one labeled listing of the host store): {:.1} ms (goal ≤ 15 ms for `local`)",
        confirm.as_secs_f64() * 1e3
    );
    // Medians of separate contestants: under noise the difference can come out negative.
    let beyond = (up.as_secs_f64() - plan.as_secs_f64()) * 1e3;
    println!("- up median minus load + plan_up median (dial, Up RPC, converge, events): {beyond:.1} ms");
    println!("- Docker calls during the {} measured and 1 warm-up converges: {during}", contestants[0].times.len());
    drop(contestants);
    rt.block_on(farm.stop())?;
    drop(cleanup);
    if during.builds != 0 || during.pushes != 0 {
        bail!("no-op converges sent Docker {during}; they must send no build and no push");
    }
    Ok(())
}

pub fn cold_build(args: &ColdArgs) -> Result<()> {
    let scratch = util::scratch_dir("kiln-bench-cold-")?;
    let dir = scratch.path().join("instance");
    let context = dir.join("app");
    eprintln!("generating {} files of {} bytes under {}", args.files, args.size, context.display());
    write_context(&context, args.files, args.size, 0x636f6c64)?;
    let names = vec!["app".to_string()];
    let prefix = format!("cold{:08x}", fastrand::u32(..));
    let cleanup = RefCell::new(Cleanup::default());
    let phases: RefCell<Vec<Phases>> = RefCell::new(Vec::new());
    let changes = Cell::new(0u64);
    let next_change = || -> Result<u64> {
        changes.set(changes.get() + 1);
        touch(&context.join(TOUCHED), changes.get())?;
        Ok(changes.get())
    };

    let rt = runtime()?;
    let farm = rt.block_on(Farm::start(&scratch.path().join("home"), args.nodelay))?;
    let mut contestants = vec![
        Contestant::new("kiln up (upload+verify+build)", || {
            let n = next_change()?;
            write_manifest(&dir, &format!("{prefix}-{n}"), &names)?;
            let before = farm.calls();
            let t0 = now_ms();
            let started = Instant::now();
            let outcome = rt.block_on(kiln::up(up_args(&dir, &farm.coordinator.url)))?;
            let took = started.elapsed();
            let calls = farm.calls().since(before);
            cleanup.borrow_mut().refs.extend(built_refs(&Manifest::load(&dir)?)?);
            check_succeeded(&outcome)?;
            if images_with(&outcome, EventKind::Built) != names || calls.builds != 1 {
                bail!("a changed context must be built once ({calls}): {:?}", outcome.events);
            }
            if !outcome.events.iter().any(|e| e.kind == EventKind::NeedContexts) {
                bail!("a changed context must be uploaded: {:?}", outcome.events);
            }
            phases.borrow_mut().push(Phases::of(&outcome, t0, took, calls.build_time));
            if args.timeline {
                for e in &outcome.events {
                    eprintln!("    +{:>5} ms {:<12} {}", e.at_ms.saturating_sub(t0), e.kind.word(), e.message);
                }
            }
            Ok(took)
        }),
        Contestant::new("docker build", || {
            let n = next_change()?;
            let tag = format!("kiln-bench-{prefix}:{n}");
            cleanup.borrow_mut().refs.push(tag.clone());
            docker_build(&context, &tag, &[])
        }),
        Contestant::new("docker build + Kiln's 4 labels", || {
            let n = next_change()?;
            let tag = format!("kiln-bench-{prefix}-labeled:{n}");
            cleanup.borrow_mut().refs.push(tag.clone());
            // The keys Kiln stamps, with values of the same shape: the classic builder turns each
            // `--label` into a LABEL step of its own, as it does with the API's `labels`.
            let labels = [
                format!("kiln.dev/context={:064x}", n),
                "kiln.dev/farm=home-0123456789ab".to_string(),
                format!("kiln.dev/instance={prefix}-{n}"),
                "kiln.dev/kind=image".to_string(),
            ];
            docker_build(&context, &tag, &labels)
        }),
        Contestant::new("BuildKit via the Engine API + 4 labels", || {
            let n = next_change()?;
            let tag = format!("kiln-bench-{prefix}-bk:{n}");
            cleanup.borrow_mut().refs.push(tag.clone());
            let labels = BTreeMap::from([
                ("kiln.dev/context".to_string(), format!("{:064x}", n)),
                ("kiln.dev/farm".to_string(), "home-0123456789ab".to_string()),
                ("kiln.dev/instance".to_string(), format!("{prefix}-{n}")),
                ("kiln.dev/kind".to_string(), "image".to_string()),
            ]);
            api_buildkit(&context, &tag, &labels)
        }),
    ];
    util::rounds(&mut contestants, args.runs, 1, || Ok(()))?;

    println!("## Cold build\n");
    println!(
        "One context of {} files × {} bytes plus a Dockerfile (`{}`); before every run one file's first 8 \
         bytes change, and every Kiln run converges a new instance, so neither Kiln's records nor Docker's \
         build cache can serve it. Kiln builds with BuildKit; `docker build` here is the classic builder. {} runs each, medians; coordinator \
         listener {}.",
        args.files,
        args.size,
        DOCKERFILE.trim_end().replace('\n', "`, `"),
        args.runs,
        nagle(args.nodelay)
    );
    util::print_table("Cold `kiln up` vs `docker build`", &contestants);
    let (kiln, docker, labeled) = (contestants[0].median(), contestants[1].median(), contestants[2].median());
    let buildkit = contestants[3].median();
    println!();
    println!("- kiln / docker build: {:.2} (goal ≤ 1.10)", kiln.as_secs_f64() / docker.as_secs_f64());
    util::goal("docker build / kiln up", util::speedup(docker, kiln), 1.0 / 1.1);
    println!(
        "- kiln / docker build with the same 4 labels: {:.2} (classic builder, one step per label)",
        kiln.as_secs_f64() / labeled.as_secs_f64()
    );
    println!(
        "- kiln / BuildKit through the Engine API with the same 4 labels: {:.2} (Docker's work equal: Kiln's own share)",
        kiln.as_secs_f64() / buildkit.as_secs_f64()
    );
    Phases::print_medians(&phases.borrow()[1..]);
    drop(contestants);
    rt.block_on(farm.stop())?;
    drop(cleanup);
    agent_verify(&context, scratch.path(), args.runs)
}

/// The agent's check before a build, alone: `verify_context` unpacks the archive into scratch
/// and deletes it again; `archive::verify` applies the same checks to the stream and writes nothing
/// (what the coordinator runs on upload). Both read the archive from the page cache.
fn agent_verify(context: &Path, scratch: &Path, runs: usize) -> Result<()> {
    let walk = WalkOptions { dockerfile: Some("Dockerfile".to_string()) };
    let archive = scratch.join("context.tar");
    let packed = pack(&walk_tree(context, &walk)?, BufWriter::new(fs::File::create(&archive)?))?;
    let verify_scratch = scratch.join("verify");
    fs::create_dir_all(&verify_scratch)?;
    let mut contestants = vec![
        Contestant::new("archive::verify (stream, no writes)", || {
            let started = Instant::now();
            verify(BufReader::new(fs::File::open(&archive)?), &packed.digest)?;
            Ok(started.elapsed())
        }),
        Contestant::new("verify_context (unpack + delete)", || {
            let started = Instant::now();
            kiln_agent::host::verify_context(&archive, &packed.digest, &verify_scratch)?;
            Ok(started.elapsed())
        }),
    ];
    util::rounds(&mut contestants, runs, 1, || Ok(()))?;
    util::print_table("Verifying this context's archive: streamed vs the agent's unpack", &contestants);
    Ok(())
}

/// Where one cold converge's time went, from the events' wall-clock stamps (millisecond
/// resolution) and the store's timing of Docker's build call.
#[derive(Clone, Copy, Debug)]
struct Phases {
    /// `up` called → `Started`: manifest, walk and address, dial, the `Up` RPC.
    address: Duration,
    /// `NeedContexts` → `Building`: pack, upload, verify and store on the coordinator.
    upload: Duration,
    /// `Building` → `Built` less Docker's build: the agent downloads and verifies the context.
    agent: Duration,
    /// Docker's build call as the agent's store saw it.
    docker: Duration,
    /// `Built` → `up` returned: inspect, record, `Finished`.
    tail: Duration,
    total: Duration,
}

impl Phases {
    fn of(outcome: &UpOutcome, t0: u64, total: Duration, docker: Duration) -> Phases {
        let at = |kind: EventKind| outcome.events.iter().find(|e| e.kind == kind).map_or(t0, |e| e.at_ms);
        let ms = |from: u64, to: u64| Duration::from_millis(to.saturating_sub(from));
        let (started, need, building) = (at(EventKind::Started), at(EventKind::NeedContexts), at(EventKind::Building));
        let built = outcome.events.iter().find(|e| matches!(e.kind, EventKind::Built)).map_or(building, |e| e.at_ms);
        Phases {
            address: ms(t0, started),
            upload: ms(need, building),
            agent: ms(building, built).saturating_sub(docker),
            docker,
            tail: ms(built, t0 + total.as_millis() as u64),
            total,
        }
    }

    fn print_medians(runs: &[Phases]) {
        if runs.is_empty() {
            return;
        }
        let med = |f: fn(&Phases) -> Duration| util::fmt(util::median(&runs.iter().map(f).collect::<Vec<_>>()));
        println!("\nWhere a cold `kiln up` spends its time (median of each phase over the measured runs):\n");
        println!("| phase | median |");
        println!("|---|---:|");
        println!("| walk + address + dial + `Up` (to `Started`) | {} |", med(|p| p.address));
        println!("| pack + upload + verify + store (`NeedContexts` → `Building`) | {} |", med(|p| p.upload));
        println!("| agent: download + verify (`Building` → `Built`, less Docker) | {} |", med(|p| p.agent));
        println!("| Docker's build call | {} |", med(|p| p.docker));
        println!("| inspect + record + `Finished` (`Built` → return) | {} |", med(|p| p.tail));
        println!("| whole `kiln up` | {} |", med(|p| p.total));
    }
}

/// `DOCKER_BUILDKIT=0 docker build -q -t <tag> [--label …] <context>`, timed as a whole process.
fn docker_build(context: &Path, tag: &str, labels: &[String]) -> Result<Duration> {
    let mut cmd = Command::new("docker");
    cmd.env("DOCKER_BUILDKIT", "0").args(["build", "-q", "-t", tag]);
    for label in labels {
        cmd.args(["--label", label]);
    }
    let started = Instant::now();
    let out = cmd.arg(context).output().context("running docker build")?;
    let took = started.elapsed();
    if !out.status.success() {
        bail!("docker build of {} failed: {}", context.display(), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(took)
}

/// `tar -c <context> | curl … POST /build?version=2&t=<tag>&labels=<json>` against the local
/// daemon: the BuildKit build Kiln's agent asks for, without Kiln, timed as a whole pipeline.
fn api_buildkit(context: &Path, tag: &str, labels: &BTreeMap<String, String>) -> Result<Duration> {
    // Keys and values here are plain words and hex: no JSON escaping is needed.
    let labels =
        format!("{{{}}}", labels.iter().map(|(k, v)| format!("\"{k}\":\"{v}\"")).collect::<Vec<_>>().join(","));
    let encode = |v: &str| v.bytes().map(|b| format!("%{b:02X}")).collect::<String>();
    let url = format!("http://localhost/build?version=2&t={}&labels={}", encode(tag), encode(&labels));
    let script = format!(
        "tar -C '{}' -cf - . | curl -sS --fail --unix-socket /var/run/docker.sock -X POST \
         -H 'Content-Type: application/x-tar' --data-binary @- '{url}'",
        context.display()
    );
    let started = Instant::now();
    let out = Command::new("sh").args(["-c", &script]).output().context("running tar | curl")?;
    let took = started.elapsed();
    let answer = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !answer.contains("moby.image.id") {
        bail!("BuildKit build of {} failed: {answer} {}", context.display(), String::from_utf8_lossy(&out.stderr));
    }
    Ok(took)
}

/// Removes the images a benchmark made, however it ends: benchmarks leave nothing on the daemon.
#[derive(Debug, Default)]
pub(crate) struct Cleanup {
    pub(crate) refs: Vec<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if self.refs.is_empty() {
            return;
        }
        let out = Command::new("docker").args(["rmi", "--force"]).args(&self.refs).output();
        match out {
            Ok(out) if out.status.success() => eprintln!("removed {} image(s)", self.refs.len()),
            Ok(out) => eprintln!("docker rmi: {}", String::from_utf8_lossy(&out.stderr).trim()),
            Err(err) => eprintln!("docker rmi could not run: {err}"),
        }
    }
}

fn nagle(nodelay: bool) -> &'static str {
    if nodelay {
        "with TCP_NODELAY (`--nodelay`)"
    } else {
        "as the coordinator binds it (Nagle on)"
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().context("starting tokio")
}

fn up_args(dir: &Path, url: &str) -> UpArgs {
    UpArgs {
        dir: dir.to_path_buf(),
        force: false,
        dry_run: false,
        connect: Connect::remote(url),
        output: OutputMode::Quiet,
    }
}

fn check_succeeded(outcome: &UpOutcome) -> Result<()> {
    if outcome.outcome != Outcome::Succeeded {
        bail!("the converge failed: {:?}", outcome.failure);
    }
    Ok(())
}

fn images_with(outcome: &UpOutcome, kind: EventKind) -> Vec<String> {
    outcome.events.iter().filter(|e| e.kind == kind).map(|e| e.image.clone()).collect()
}

/// The content refs `kiln up` builds for `manifest` (for clean-up).
pub(crate) fn built_refs(manifest: &Manifest) -> Result<Vec<String>> {
    let plan = kiln::request::plan_up(manifest, false, "kiln-bench", None)?;
    Ok(plan.request.images.into_iter().filter(|i| !i.context_digest.is_empty()).map(|i| i.reference).collect())
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// `files` random files of `size` bytes in directories of [`PER_DIR`], and the Dockerfile.
pub(crate) fn write_context(root: &Path, files: usize, size: usize, seed: u64) -> Result<()> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut buf = vec![0u8; size];
    for i in 0..files {
        let sub: PathBuf = root.join(format!("d{:03}", i / PER_DIR));
        if i % PER_DIR == 0 {
            fs::create_dir_all(&sub).with_context(|| format!("creating {}", sub.display()))?;
        }
        rng.fill(&mut buf);
        let path = sub.join(format!("file{i:06}.bin"));
        fs::write(&path, &buf).with_context(|| format!("writing {}", path.display()))?;
    }
    fs::write(root.join("Dockerfile"), DOCKERFILE).context("writing the Dockerfile")
}

pub(crate) fn write_manifest(dir: &Path, instance: &str, images: &[String]) -> Result<()> {
    let mut text = format!("instance = \"{instance}\"\n\n[target]\nkind = \"local\"\n");
    for name in images {
        text.push_str(&format!("\n[built.{name}]\ncontext = \"{name}\"\n"));
    }
    fs::write(dir.join("kiln.toml"), text).context("writing kiln.toml")
}

/// Writes `n` over the first bytes of `path`: new content, same size, so no cache can serve it.
fn touch(path: &Path, n: u64) -> Result<()> {
    let mut file =
        fs::OpenOptions::new().write(true).open(path).with_context(|| format!("opening {}", path.display()))?;
    file.seek(SeekFrom::Start(0))?;
    file.write_all(&n.to_le_bytes())?;
    Ok(())
}
