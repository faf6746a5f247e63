//! `kiln-bench upload`: step 4 of the converge on its own — a context of large files walked,
//! packed and streamed by the CLI's uploader (`kiln::upload::upload`, the code `kiln up` runs) to
//! an in-process coordinator, which verifies the archive as it arrives and stores it. Baseline: a
//! plain TCP copy of the same archive bytes over loopback, so the ratio is what gRPC, packing,
//! verifying and storing add to moving the bytes at all. Each Kiln run starts a coordinator with an
//! empty state directory before its timer, so every run really uploads (`FindMissing` is asked
//! first and must name the context missing).
//!
//! The pieces of the path are timed alone too, so a missed goal points at the stage that costs:
//! the same upload into a gRPC server that discards the chunks (once with tonic's default HTTP/2
//! windows, as the coordinator serves, once with larger ones), pack into a sink, verify from the
//! archive file, write + fsync of the archive. Peak RSS (`VmHWM`) is read around every run: the
//! claim is that uploading never holds the archive whole.

use crate::converge::{loopback_listener, Coordinator};
use crate::util::{self, Contestant};
use anyhow::{bail, Context, Result};
use kiln::request::ContextSource;
use kiln_core::archive::{pack, verify};
use kiln_core::digest::{walk_tree, TreeDigest, WalkOptions};
use kiln_proto::v1::content_store_client::ContentStoreClient;
use kiln_proto::v1::content_store_server::{ContentStore, ContentStoreServer};
use kiln_proto::v1::{DownloadChunk, DownloadRequest, FindMissingReply, FindMissingRequest, UploadChunk, UploadReply};
use std::cell::{Cell, RefCell};
use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tonic::{Request, Response, Status, Streaming};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Size of the context in MiB, split evenly over `--files` files.
    #[arg(long, default_value_t = 1024)]
    mib: u64,
    /// Files in the context.
    #[arg(long, default_value_t = 16)]
    files: u64,
    /// Measured runs per contestant (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Set TCP_NODELAY on the coordinator's listener (see `noop-up --help`).
    #[arg(long)]
    nodelay: bool,
    /// Time only Kiln's upload, no baselines or pieces (for profiling it alone, e.g. under perf).
    #[arg(long)]
    kiln_only: bool,
}

/// The copy buffer of the TCP baseline and the pieces: the uploader's chunk size.
const BUF: usize = 1 << 20;

const GOAL_GB_S: f64 = 1.5;

/// The HTTP/2 stream window of the second discarding server: eight chunks in flight.
const BIG_WINDOW: u32 = 8 << 20;

/// A rise of the process's peak RSS during one run of one contestant.
#[derive(Debug)]
struct Rise {
    contestant: &'static str,
    from_kib: u64,
    to_kib: u64,
}

pub fn run(args: &Args) -> Result<()> {
    let hwm_start = vm_hwm_kib()?;
    let scratch = util::scratch_dir("kiln-bench-upload-")?;
    let context = scratch.path().join("context");
    let file_size = (args.mib << 20) / args.files;
    eprintln!("generating {} files of {} MiB under {}", args.files, file_size >> 20, context.display());
    generate(&context, args.files, file_size)?;
    let walk = WalkOptions::default();
    let archive = scratch.path().join("context.tar");
    // The digest comes from packing (which hashes what it packs) rather than `digest_dir`, whose
    // mmap of big files would count in RSS and blur the baseline the upload's peak is read against;
    // the coordinator recomputes it from the bytes on every run anyway.
    let packed = pack(&walk_tree(&context, &walk)?, BufWriter::with_capacity(BUF, File::create(&archive)?))?;
    let digest = packed.digest;
    let bytes = packed.bytes;
    let hwm_ready = vm_hwm_kib()?;

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let states = scratch.path().join("states");
    let run_no = Cell::new(0u32);
    let rises = RefCell::new(Vec::new());
    let source = ContextSource {
        dir: context.clone(),
        walk: walk.clone(),
        images: vec!["bench".to_string()],
        archive_bytes: 0,
        tree: None,
        stat_cache: None,
    };
    let mut contestants = vec![
        tracked("kiln upload (pack→gRPC→verify→store)", &rises, || {
            run_no.set(run_no.get() + 1);
            let state = states.join(format!("run{}", run_no.get()));
            let took = rt.block_on(kiln_upload(&state, &source, digest, bytes, args.nodelay))?;
            fs::remove_dir_all(&state).with_context(|| format!("removing {}", state.display()))?;
            Ok(took)
        }),
        tracked("plain TCP copy (loopback)", &rises, || tcp_copy(&archive, bytes)),
        tracked("piece: pack→gRPC→discard", &rises, || {
            rt.block_on(sink_upload(&source, digest, bytes, args.nodelay, None))
        }),
        tracked("piece: pack→gRPC→discard, 8 MiB windows", &rises, || {
            rt.block_on(sink_upload(&source, digest, bytes, args.nodelay, Some(BIG_WINDOW)))
        }),
        tracked("piece: walk + pack → sink", &rises, || {
            let started = Instant::now();
            let packed = pack(&walk_tree(&context, &walk)?, std::io::sink())?;
            let took = started.elapsed();
            check_digest(packed.digest, digest)?;
            Ok(took)
        }),
        tracked("piece: verify (archive file)", &rises, || {
            let started = Instant::now();
            verify(BufReader::with_capacity(BUF, File::open(&archive)?), &digest).context("verifying the archive")?;
            Ok(started.elapsed())
        }),
        tracked("piece: write + fsync (archive)", &rises, || {
            let copy = scratch.path().join("copy.tar");
            let took = write_fsync(&archive, &copy)?;
            fs::remove_file(&copy)?;
            Ok(took)
        }),
    ];
    if args.kiln_only {
        contestants.truncate(1);
    }
    util::rounds(&mut contestants, args.runs, 1, || Ok(()))?;
    let hwm_end = vm_hwm_kib()?;

    println!("## Context upload\n");
    println!(
        "{} files × {} MiB of random bytes; the archive is {} bytes ({:.2} GiB). {} runs each, medians; \
         warm page cache; coordinator in-process on 127.0.0.1, its state on the same disk.",
        args.files,
        file_size >> 20,
        bytes,
        bytes as f64 / (1u64 << 30) as f64,
        args.runs
    );
    util::print_table("Upload vs a plain TCP copy, and the pieces", &contestants);
    println!("\n| contestant | throughput (archive bytes / median) |\n|---|---:|");
    for c in &contestants {
        println!("| {} | {:.2} GB/s |", c.name, gb_per_s(bytes, c.median()));
    }
    let kiln = gb_per_s(bytes, contestants[0].median());
    println!();
    let met = if kiln >= GOAL_GB_S { "met" } else { "MISSED" };
    println!("- kiln upload: {kiln:.2} GB/s (goal ≥ {GOAL_GB_S:.2} GB/s) — {met}");
    if let Some(tcp) = contestants.get(1).map(|c| gb_per_s(bytes, c.median())) {
        println!("- kiln upload / plain TCP copy: {:.2}× of loopback's {tcp:.2} GB/s", kiln / tcp);
    }
    println!(
        "- peak RSS (VmHWM) of this process: {} at start, {} after generating the data, {} at the end \
         (payload {})",
        mib(hwm_start),
        mib(hwm_ready),
        mib(hwm_end),
        mib(bytes >> 10)
    );
    // HWM only grows, so each contestant's rises say which runs set new peaks, and by how much.
    let rises = rises.borrow();
    for c in &contestants {
        let mine: Vec<&Rise> = rises.iter().filter(|r| r.contestant == c.name).collect();
        if let Some(last) = mine.last() {
            let total: u64 = mine.iter().map(|r| r.to_kib - r.from_kib).sum();
            println!(
                "  - `{}` raised it {} time(s), by {} in all, last to {}",
                c.name,
                mine.len(),
                mib(total),
                mib(last.to_kib)
            );
        }
    }
    Ok(())
}

/// One Kiln upload into a fresh coordinator whose state is `state`; only the upload is timed.
async fn kiln_upload(
    state: &Path,
    source: &ContextSource,
    digest: TreeDigest,
    bytes: u64,
    nodelay: bool,
) -> Result<Duration> {
    let coordinator = Coordinator::start(state, "kiln-bench-upload", nodelay).await?;
    let channel = kiln::connect::endpoint(&coordinator.url)?.connect().await.context("dialing the coordinator")?;
    let channel = tonic::service::interceptor::InterceptedService::new(channel, kiln::connect::Bearer::new(None)?);
    let mut client = ContentStoreClient::new(channel);
    let missing = client.find_missing(FindMissingRequest { digests: vec![digest.to_string()] }).await?;
    if missing.into_inner().missing != [digest.to_string()] {
        bail!("a fresh coordinator must report the context missing, or the run uploads nothing");
    }
    let started = Instant::now();
    let sent = kiln::upload::upload(client, digest.to_string(), source.clone(), None).await?;
    let took = started.elapsed();
    coordinator.stop().await?;
    let stored = state.join("contexts").join(format!("{digest}.tar"));
    let len = fs::metadata(&stored).with_context(|| format!("the coordinator stored no {}", stored.display()))?.len();
    if sent != bytes || len != bytes {
        bail!("sent {sent} bytes and the coordinator stored {len}; the archive is {bytes}");
    }
    Ok(took)
}

/// The same upload into a server that discards every chunk: the CLI's side and the gRPC transport,
/// without verifying or storing. With `window` `None` the server keeps tonic's defaults, as the
/// coordinator does (hyper then advertises 1 MiB HTTP/2 windows, less than one 1 MiB chunk plus
/// its frame); `Some(bytes)` sets the stream window to it and the connection window to twice it.
async fn sink_upload(
    source: &ContextSource,
    digest: TreeDigest,
    bytes: u64,
    nodelay: bool,
    window: Option<u32>,
) -> Result<Duration> {
    let listener = loopback_listener(nodelay)?;
    let url = format!("http://{}", listener.local_addr()?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .initial_stream_window_size(window)
            .initial_connection_window_size(window.map(|w| 2 * w))
            .add_service(ContentStoreServer::new(Sink))
            .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), async {
                let _ = stopped.await;
            }),
    );
    let channel = kiln::connect::endpoint(&url)?.connect().await.context("dialing the sink")?;
    let started = Instant::now();
    let sent = kiln::upload::upload(
        ContentStoreClient::new(tonic::service::interceptor::InterceptedService::new(
            channel,
            kiln::connect::Bearer::new(None)?,
        )),
        digest.to_string(),
        source.clone(),
        None,
    )
    .await?;
    let took = started.elapsed();
    let _ = stop.send(());
    server.await?.context("the sink server failed")?;
    if sent != bytes {
        bail!("sent {sent} bytes to the sink; the archive is {bytes}");
    }
    Ok(took)
}

/// A `ContentStore` that drains uploads and keeps nothing.
#[derive(Debug)]
struct Sink;

#[tonic::async_trait]
impl ContentStore for Sink {
    async fn find_missing(&self, request: Request<FindMissingRequest>) -> Result<Response<FindMissingReply>, Status> {
        Ok(Response::new(FindMissingReply { missing: request.into_inner().digests }))
    }

    async fn upload(&self, request: Request<Streaming<UploadChunk>>) -> Result<Response<UploadReply>, Status> {
        let mut chunks = request.into_inner();
        let (mut digest, mut bytes) = (String::new(), 0u64);
        while let Some(chunk) = chunks.message().await? {
            if digest.is_empty() {
                digest = chunk.digest;
            }
            bytes += chunk.data.len() as u64;
        }
        Ok(Response::new(UploadReply { digest, bytes }))
    }

    async fn find_missing_blobs(
        &self,
        _: Request<kiln_proto::v1::FindMissingBlobsRequest>,
    ) -> Result<Response<kiln_proto::v1::FindMissingBlobsReply>, Status> {
        Err(Status::unimplemented("the sink takes archives only"))
    }

    async fn upload_blobs(
        &self,
        _: Request<Streaming<kiln_proto::v1::BlobBatch>>,
    ) -> Result<Response<kiln_proto::v1::UploadBlobsReply>, Status> {
        Err(Status::unimplemented("the sink takes archives only"))
    }

    async fn put_context(
        &self,
        _: Request<Streaming<kiln_proto::v1::ContextListChunk>>,
    ) -> Result<Response<UploadReply>, Status> {
        Err(Status::unimplemented("the sink takes archives only"))
    }

    type DownloadStream = tokio_stream::Empty<Result<DownloadChunk, Status>>;

    async fn download(&self, _: Request<DownloadRequest>) -> Result<Response<Self::DownloadStream>, Status> {
        Err(Status::unimplemented("the sink keeps nothing to download"))
    }
}

/// Sends the archive file over a loopback TCP connection to a thread that reads it into a
/// buffer and drops it; timed from connect to the reader's last byte.
pub(crate) fn tcp_copy(archive: &Path, bytes: u64) -> Result<Duration> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<u64> {
        let (mut conn, _) = listener.accept()?;
        let mut buf = vec![0u8; BUF];
        let mut total = 0u64;
        loop {
            match conn.read(&mut buf)? {
                0 => return Ok(total),
                n => total += n as u64,
            }
        }
    });
    let mut file = File::open(archive)?;
    let mut buf = vec![0u8; BUF];
    let started = Instant::now();
    let mut conn = TcpStream::connect(addr)?;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        conn.write_all(&buf[..n])?;
    }
    drop(conn);
    let received = reader.join().map_err(|_| anyhow::anyhow!("the TCP reader panicked"))??;
    let took = started.elapsed();
    if received != bytes {
        bail!("the TCP reader got {received} bytes of {bytes}");
    }
    Ok(took)
}

/// Copies `from` to a new file `to` in chunks and fsyncs it: what the coordinator's store does
/// with an upload's bytes, without the network or the verify.
fn write_fsync(from: &Path, to: &Path) -> Result<Duration> {
    let mut src = File::open(from)?;
    let mut buf = vec![0u8; BUF];
    let started = Instant::now();
    let mut out = File::create(to)?;
    loop {
        let n = src.read(&mut buf)?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n])?;
    }
    out.sync_all()?;
    Ok(started.elapsed())
}

fn tracked<'a>(
    contestant: &'static str,
    rises: &'a RefCell<Vec<Rise>>,
    mut run: impl FnMut() -> Result<Duration> + 'a,
) -> Contestant<'a> {
    Contestant::new(contestant, move || {
        let from_kib = vm_hwm_kib()?;
        let took = run()?;
        let to_kib = vm_hwm_kib()?;
        if to_kib > from_kib {
            rises.borrow_mut().push(Rise { contestant, from_kib, to_kib });
        }
        Ok(took)
    })
}

fn check_digest(got: TreeDigest, want: TreeDigest) -> Result<()> {
    if got != want {
        bail!("packed digest {got} differs from {want}");
    }
    Ok(())
}

/// The process's peak resident set so far, in KiB (`VmHWM` in /proc/self/status).
pub(crate) fn vm_hwm_kib() -> Result<u64> {
    let status = fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("/proc/self/status has no VmHWM line")
}

pub(crate) fn mib(kib: u64) -> String {
    format!("{:.0} MiB", kib as f64 / 1024.0)
}

pub(crate) fn gb_per_s(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / took.as_secs_f64() / 1e9
}

/// `files` files of `size` random bytes each (a fixed seed, so the digest is reproducible).
pub(crate) fn generate(root: &Path, files: u64, size: u64) -> Result<()> {
    fs::create_dir_all(root)?;
    let mut rng = fastrand::Rng::with_seed(0x75706c64);
    let mut chunk = vec![0u8; 8 << 20];
    for i in 0..files {
        let path: PathBuf = root.join(format!("blob{i:03}.bin"));
        let mut out = BufWriter::with_capacity(8 << 20, File::create(&path)?);
        let mut left = size;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            rng.fill(&mut chunk[..n]);
            out.write_all(&chunk[..n])?;
            left -= n as u64;
        }
        out.flush().with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
