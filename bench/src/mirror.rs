//! The mirror: a pinned two-platform image (a layer of `--mb` MB of random bytes per platform)
//! copied from one local registry into another by `kiln mirror` — the real CLI library against
//! the real coordinator (`kiln-e2e`'s farm), which streams every blob registry to registry —
//! vs the daemon's way, for ONE platform: `docker pull` + `docker tag` + `docker push` of an image
//! of the same size (made with `docker import`, so no build cache can answer the pull).
//!
//! Each run gets a fresh, empty target registry (started before its clock), so neither side finds
//! a blob already there. The daemon side starts each run with its image removed, so the pull
//! downloads and unpacks every byte. Goal: Kiln ≥ 1.5× faster while copying both platforms.

use crate::util::{self, Contestant};
use anyhow::{bail, Context, Result};
use kiln_e2e::oci::push_two_platform;
use kiln_e2e::{Farm, Registry};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Size of each platform's layer, in MB.
    #[arg(long, default_value_t = 200)]
    mb: usize,
    #[arg(long, default_value_t = 5)]
    runs: usize,
}

fn docker(args: &[&str]) -> Result<()> {
    let out = Command::new("docker").args(args).output().context("running docker")?;
    if !out.status.success() {
        bail!("docker {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// An instance whose only image is `pinned`, re-homed into `mirror`.
fn instance(root: &Path, mirror: &str, pinned: &str) -> Result<PathBuf> {
    let dir = root.join(format!("m{:08x}", fastrand::u32(..)));
    std::fs::create_dir_all(&dir)?;
    let name = dir.file_name().unwrap_or_default().to_string_lossy().to_string();
    let toml = format!(
        "instance = \"{name}\"\n\n[target]\nkind = \"local\"\nmirror_registry = \"{mirror}/mirror\"\n\n\
         [pinned.envoy]\nref = \"{pinned}\"\n"
    );
    std::fs::write(dir.join("kiln.toml"), toml)?;
    Ok(dir)
}

/// `kiln mirror DIR` into a fresh registry; its time, and that it copied `expect` bytes.
async fn kiln_mirror(farm: &Farm, root: &Path, pinned: &str, expect: u64) -> Result<Duration> {
    let target = Registry::start();
    let dir = instance(root, &target.addr, pinned)?;
    let args = kiln::MirrorArgs {
        dir,
        dry_run: false,
        connect: kiln::Connect::remote(&farm.url),
        output: kiln::OutputMode::Quiet,
    };
    let started = Instant::now();
    let outcome = kiln::mirror_with(&args, &mut kiln::render::Quiet).await?;
    let took = started.elapsed();
    let copied: u64 = outcome.events.iter().filter(|e| e.kind == kiln::EventKind::Mirrored).map(|e| e.bytes).sum();
    if outcome.exit() != kiln::Exit::Converged || copied < expect {
        bail!("kiln mirror copied {copied} of {expect} bytes: {:?}", outcome.failure);
    }
    Ok(took)
}

/// `docker pull` + `tag` + `push` of `image` into a fresh registry, the image removed first.
fn daemon_copy(image: &str) -> Result<Duration> {
    let target = Registry::start();
    let copy = format!("{}/bench/base:1", target.addr);
    let _ = docker(&["rmi", image]);
    let started = Instant::now();
    docker(&["pull", "-q", image])?;
    docker(&["tag", image, &copy])?;
    docker(&["push", "-q", &copy])?;
    let took = started.elapsed();
    docker(&["rmi", &copy])?;
    Ok(took)
}

pub fn run(args: &Args) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let scratch = util::scratch_dir("kiln-bench-mirror")?;
    let upstream = Registry::start();
    let bytes = args.mb << 20;
    eprintln!("pushing a two-platform image of {} MB per platform to {}", args.mb, upstream.addr);
    let pushed = rt.block_on(push_two_platform(&upstream.addr, "upstream/envoy", "v1", bytes));

    // The daemon's image: one layer of the same size, imported (no build cache holds it), pushed
    // to the same upstream.
    let blob = scratch.path().join("payload");
    let mut content = vec![0u8; bytes];
    fastrand::fill(&mut content);
    std::fs::write(&blob, &content)?;
    drop(content);
    let tarball = scratch.path().join("layer.tar");
    let status = Command::new("tar").arg("-C").arg(scratch.path()).arg("-cf").arg(&tarball).arg("payload").status()?;
    if !status.success() {
        bail!("tar failed");
    }
    let image = format!("{}/bench/base:1", upstream.addr);
    docker(&["import", &tarball.to_string_lossy(), &image])?;
    docker(&["push", "-q", &image])?;
    std::fs::remove_file(&tarball)?;

    let farm = rt.block_on(Farm::start(&scratch.path().join("home")));
    let both = 2 * bytes as u64;
    let mut contestants = [
        Contestant::new(format!("kiln mirror, 2 platforms × {} MB", args.mb), || {
            rt.block_on(kiln_mirror(&farm, scratch.path(), &pushed.pinned, both))
        }),
        Contestant::new(format!("docker pull+tag+push, 1 platform × {} MB", args.mb), || daemon_copy(&image)),
    ];
    util::rounds(&mut contestants, args.runs, 1, || Ok(()))?;
    util::print_table("mirror copy of a pinned image between two local registries", &contestants);
    let ratio = util::speedup(contestants[1].median(), contestants[0].median());
    util::goal("kiln mirror (both platforms) vs docker pull+tag+push (one platform)", ratio, 1.5);
    let _ = docker(&["rmi", &image]);
    drop(contestants);
    let mut farm = farm;
    rt.block_on(farm.stop());
    Ok(())
}
