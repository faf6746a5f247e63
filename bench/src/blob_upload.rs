//! `kiln-bench blob-upload`: per-file uploads (issue 14), both goals in one run.
//!
//! (a) After a one-file edit of a 1 GiB context of 2,000 files, the bytes sent must be at most the
//! edited file plus 1% of the context, and the upload phase at most 10% of a full upload's time.
//! (b) A full first upload must reach 1.5 GB/s over loopback, memory bounded.
//!
//! Every Kiln run talks to an in-process coordinator (`kiln_coordinator::serve`, the code the
//! served one runs) with a fresh state directory, so nothing is held before the run but what it
//! seeds. The timed call is `kiln::upload::send`, what `kiln up` runs when asked for a context:
//! `FindMissingBlobs`, the `UploadBlobs` streams, `PutContext`. Hashing the context is the
//! addressing walk's job (step 1), so the tree is hashed before the clock, as `kiln up` has it.
//! Baselines in the same run: today's whole-archive upload (`kiln::upload::upload`) and a plain
//! TCP copy of the archive's bytes over loopback.

use crate::converge::Coordinator;
use crate::upload::{gb_per_s, generate, mib, tcp_copy, vm_hwm_kib};
use crate::util::{self, Contestant};
use anyhow::{bail, Context, Result};
use kiln::request::ContextSource;
use kiln::upload::Uploaded;
use kiln_core::archive::pack;
use kiln_core::digest::{digest_dir, Tree, TreeDigest, WalkOptions};
use kiln_proto::v1::content_store_client::ContentStoreClient;
use std::cell::{Cell, RefCell};
use std::fs::{self, File};
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Size of the context in MiB, split evenly over `--files` files.
    #[arg(long, default_value_t = 1024)]
    mib: u64,
    /// Files in the context.
    #[arg(long, default_value_t = 2000)]
    files: u64,
    /// Measured runs per contestant (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Time only the first per-file upload, no baselines or pieces (to profile it alone, e.g.
    /// under perf).
    #[arg(long)]
    first_only: bool,
}

const GOAL_GB_S: f64 = 1.5;
const GOAL_EDIT_RATIO: f64 = 0.10;

pub fn run(args: &Args) -> Result<()> {
    let hwm_start = vm_hwm_kib()?;
    let scratch = util::scratch_dir("kiln-bench-blob-upload-")?;
    let context = scratch.path().join("context");
    let file_size = (args.mib << 20) / args.files;
    eprintln!("generating {} files of {} KiB under {}", args.files, file_size >> 10, context.display());
    generate(&context, args.files, file_size)?;
    let walk = WalkOptions::default();
    let (tree, digest) = digest_dir(&context, &walk)?;
    let archive = scratch.path().join("context.tar");
    let bytes = pack(&tree, BufWriter::new(File::create(&archive)?))?.bytes;
    let blob_bytes: u64 = tree.entries.iter().map(|e| e.size).sum();
    let edited = tree.entries.iter().find(|e| e.size > 0).context("a file to edit")?.path.clone();
    let edited = context.join(String::from_utf8(edited)?);
    let original = fs::read(&edited)?;
    let hwm_ready = vm_hwm_kib()?;

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let states = scratch.path().join("states");
    let run_no = Cell::new(0u32);
    let next_state = || {
        run_no.set(run_no.get() + 1);
        states.join(format!("run{}", run_no.get()))
    };
    let source = |tree: Tree| ContextSource {
        dir: context.clone(),
        walk: walk.clone(),
        images: vec!["bench".into()],
        archive_bytes: 0,
        tree: Some(Arc::new(tree)),
        stat_cache: None,
    };
    let full_source = source(tree.clone());
    let edit_sent = RefCell::new(Vec::new());

    let mut contestants = vec![
        Contestant::new("kiln per-file upload, first (every blob)", || {
            let state = next_state();
            let (took, sent, _) = rt.block_on(timed_send(&state, None, || Ok((full_source.clone(), digest))))?;
            expect_blobs(&sent, args.files, blob_bytes)?;
            fs::remove_dir_all(&state)?;
            Ok(took)
        }),
        Contestant::new("kiln per-file upload after a one-file edit", || {
            let state = next_state();
            // The edit, after the coordinator holds the context: the same length, new bytes, so
            // only its blob and the list move. Hashed before the clock, as `kiln up` addresses it.
            let edit = || {
                let mut changed = original.clone();
                changed[..4].copy_from_slice(&run_no.get().to_le_bytes());
                fs::write(&edited, &changed)?;
                let (tree_after, digest_after) = digest_dir(&context, &walk)?;
                Ok((source(tree_after), digest_after))
            };
            let result = rt.block_on(timed_send(&state, Some((&full_source, digest)), edit));
            fs::write(&edited, &original)?;
            let (took, sent, _) = result?;
            match sent {
                Uploaded::Blobs(s) if s.blobs == 1 => edit_sent.borrow_mut().push(s.bytes + s.list_bytes),
                other => bail!("a one-file edit sent {other:?}, not one blob"),
            }
            fs::remove_dir_all(&state)?;
            Ok(took)
        }),
        Contestant::new("kiln archive upload (whole, as before)", || {
            let state = next_state();
            let took = rt.block_on(timed_archive(&state, &full_source, digest, bytes))?;
            fs::remove_dir_all(&state)?;
            Ok(took)
        }),
        Contestant::new("plain TCP copy of the archive (loopback)", || tcp_copy(&archive, bytes)),
        Contestant::new("piece: store the files as blobs (read, write, rename; no network)", || {
            let dir = next_state();
            let took = store_as_files(&tree, &dir)?;
            fs::remove_dir_all(&dir)?;
            Ok(took)
        }),
    ];
    if args.first_only {
        contestants.truncate(1);
    }
    util::rounds(&mut contestants, args.runs, 1, || Ok(()))?;
    let hwm_end = vm_hwm_kib()?;
    if args.first_only {
        let rate = gb_per_s(blob_bytes, contestants[0].median());
        println!(
            "first per-file upload: {} median = {rate:.2} GB/s of blobs (goal ≥ {GOAL_GB_S:.2})",
            util::fmt(contestants[0].median())
        );
        return Ok(());
    }

    println!("## Per-file uploads\n");
    println!(
        "{} files × {} KiB of random bytes ({:.2} GiB of blobs, the archive {} bytes). {} runs each, medians; \
         warm page cache; coordinator in-process on 127.0.0.1, a fresh state per run.",
        args.files,
        file_size >> 10,
        blob_bytes as f64 / (1u64 << 30) as f64,
        bytes,
        args.runs
    );
    util::print_table("Per-file upload vs the archive upload and a plain TCP copy", &contestants);
    let (full, edit, archive_took, tcp, store) = (
        contestants[0].median(),
        contestants[1].median(),
        contestants[2].median(),
        contestants[3].median(),
        contestants[4].median(),
    );
    println!();
    let rate = gb_per_s(blob_bytes, full);
    let met = |ok: bool| if ok { "met" } else { "MISSED" };
    println!("- (b) first upload: {rate:.2} GB/s of blobs (goal ≥ {GOAL_GB_S:.2}) — {}", met(rate >= GOAL_GB_S));
    println!(
        "  - the archive upload as before: {:.2} GB/s; plain TCP copy: {:.2} GB/s; per-file / TCP = {:.2}×",
        gb_per_s(bytes, archive_took),
        gb_per_s(bytes, tcp),
        rate / gb_per_s(bytes, tcp)
    );
    println!(
        "  - storing the blobs alone (one thread, no network): {:.2} GB/s — the ceiling of any per-file path on this disk",
        gb_per_s(blob_bytes, store)
    );
    let ratio = edit.as_secs_f64() / full.as_secs_f64();
    println!(
        "- (a) one-file edit: upload phase {:.1} ms = {:.1}% of the first upload's (goal ≤ {:.0}%) — {}",
        edit.as_secs_f64() * 1e3,
        ratio * 100.0,
        GOAL_EDIT_RATIO * 100.0,
        met(ratio <= GOAL_EDIT_RATIO)
    );
    let sent = edit_sent.borrow().iter().copied().max().unwrap_or_default();
    let allowed = file_size + blob_bytes / 100;
    println!(
        "  - bytes sent (blob + entry list, most of any run): {sent} ≤ edited file {file_size} + 1% of the context {} = {allowed} — {}",
        blob_bytes / 100,
        met(sent <= allowed)
    );
    println!(
        "- peak RSS (VmHWM) of this process (CLI and coordinator): {} at start, {} after generating, {} at the end (payload {})",
        mib(hwm_start),
        mib(hwm_ready),
        mib(hwm_end),
        mib(blob_bytes >> 10)
    );
    Ok(())
}

async fn client(url: &str) -> Result<ContentStoreClient<kiln::connect::Channel>> {
    let channel = kiln::connect::endpoint(url)?.connect().await.context("dialing the coordinator")?;
    Ok(ContentStoreClient::new(tonic::service::interceptor::InterceptedService::new(
        channel,
        kiln::connect::Bearer::new(None)?,
    )))
}

/// One per-file upload of what `prepare` gives into a fresh coordinator at `state`; with `seed`,
/// that context is uploaded first, untimed, and `prepare` runs after it (the coordinator then
/// holds every blob but the edited one).
async fn timed_send(
    state: &Path,
    seed: Option<(&ContextSource, TreeDigest)>,
    prepare: impl FnOnce() -> Result<(ContextSource, TreeDigest)>,
) -> Result<(Duration, Uploaded, TreeDigest)> {
    let coordinator = Coordinator::start(state, "kiln-bench-blobs", false).await?;
    if let Some((seed, seed_digest)) = seed {
        kiln::upload::send(client(&coordinator.url).await?, seed_digest.to_string(), seed.clone(), None).await?;
    }
    let (source, digest) = prepare()?;
    let client = client(&coordinator.url).await?;
    let started = Instant::now();
    let sent = kiln::upload::send(client, digest.to_string(), source.clone(), None).await?;
    let took = started.elapsed();
    coordinator.stop().await?;
    let list: PathBuf = state.join("contexts").join(format!("{digest}.list"));
    if !list.is_file() {
        bail!("the coordinator stored no {}", list.display());
    }
    Ok((took, sent, digest))
}

/// Today's whole-archive upload into a fresh coordinator.
async fn timed_archive(state: &Path, source: &ContextSource, digest: TreeDigest, bytes: u64) -> Result<Duration> {
    let coordinator = Coordinator::start(state, "kiln-bench-blobs", false).await?;
    let client = client(&coordinator.url).await?;
    let started = Instant::now();
    let sent = kiln::upload::upload(client, digest.to_string(), source.clone(), None).await?;
    let took = started.elapsed();
    coordinator.stop().await?;
    if sent != bytes {
        bail!("sent {sent} archive bytes; the archive is {bytes}");
    }
    Ok(took)
}

/// What the content store does with a first upload's bytes, without the network, the hashing or
/// the CLI: each file read and written to a temp name, then renamed to its hash, in `dir`.
fn store_as_files(tree: &Tree, dir: &Path) -> Result<Duration> {
    fs::create_dir_all(dir)?;
    let started = Instant::now();
    for (i, entry) in tree.entries.iter().enumerate() {
        let Some(hash) = entry.hash else { continue };
        let data = fs::read(tree.root.join(String::from_utf8_lossy(&entry.path).as_ref()))?;
        let tmp = dir.join(format!(".upload-{i}"));
        fs::write(&tmp, &data)?;
        fs::rename(&tmp, dir.join(hash.to_string()))?;
    }
    Ok(started.elapsed())
}

fn expect_blobs(sent: &Uploaded, files: u64, bytes: u64) -> Result<()> {
    match sent {
        Uploaded::Blobs(s) if s.blobs == files && s.bytes == bytes => Ok(()),
        other => bail!("a first upload sent {other:?}; expected {files} blobs of {bytes} bytes"),
    }
}
