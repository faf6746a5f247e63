//! Hostile uploads against the real `kiln-coordinator` binary, which anyone who reaches its port
//! can send before any identity is checked: a pax record of hundreds of megabytes, an upload that
//! never ends. Each must be refused with an error naming the limit, leave no file behind, and cost
//! the coordinator bounded memory however many arrive at once.
//!
//! The memory bound is read from the child's own peak resident set (`VmHWM`), so what is measured
//! is exactly the process production runs; it is a bound on memory, not a timing.

use kiln_proto::v1 as pb;
use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// One `kiln-coordinator` child serving a temp state on a free loopback port; killed on drop.
struct Served {
    child: Child,
    url: String,
    state: tempfile::TempDir,
}

impl Served {
    fn start(extra: &[&str]) -> Served {
        let state = tempfile::tempdir().unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln-coordinator"))
            .arg("--state")
            .arg(state.path())
            .args(["--farm", "hostile", "--listen", "127.0.0.1:0", "--dev"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("kiln-coordinator starts");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("first line: {line:?}"));
        Served { url: format!("http://{addr}"), child, state }
    }

    /// The peak resident set of the child so far, in bytes (`VmHWM` of /proc/PID/status).
    fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM in /proc/PID/status");
        let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        kib * 1024
    }

    /// Every file in the content store's directory and its blob directory: what an upload left behind.
    fn stored_files(&self) -> Vec<PathBuf> {
        let contexts = self.state.path().join("contexts");
        [contexts.clone(), contexts.join("blobs")]
            .iter()
            .filter_map(|dir| std::fs::read_dir(dir).ok())
            .flat_map(|dir| dir.map(|e| e.unwrap().path()))
            .filter(|path| !path.is_dir())
            .collect()
    }

    async fn missing(&self, digest: &str) -> Vec<String> {
        let mut client = pb::content_store_client::ContentStoreClient::new(self.channel());
        let request = pb::FindMissingRequest { digests: vec![digest.to_string()] };
        client.find_missing(request).await.unwrap().into_inner().missing
    }

    /// A connection of its own per caller, as separate hostile clients would have.
    fn channel(&self) -> tonic::transport::Channel {
        tonic::transport::Endpoint::from_shared(self.url.clone()).unwrap().connect_lazy()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A ustar header of `kind` claiming `size` bytes of content.
fn header(name: &str, kind: u8, size: u64) -> [u8; 512] {
    let mut h = [0u8; 512];
    h[..name.len()].copy_from_slice(name.as_bytes());
    let octal = |field: &mut [u8], value: u64| {
        let width = field.len() - 1;
        field[..width].copy_from_slice(format!("{value:0width$o}").as_bytes());
    };
    octal(&mut h[100..108], 0o644);
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    octal(&mut h[124..136], size);
    octal(&mut h[136..148], 0);
    h[156] = kind;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].fill(b' ');
    let sum: u32 = h.iter().map(|&b| b as u32).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    h
}

/// Uploads `head` and then `fill` more bytes in 1 MiB chunks, generated as they are sent, as long
/// as the coordinator keeps reading: the client holds one chunk, never the whole claim.
async fn upload(channel: tonic::transport::Channel, digest: &str, head: Vec<u8>, fill: u64) -> tonic::Status {
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::UploadChunk>(2);
    let digest = digest.to_string();
    tokio::spawn(async move {
        if tx.send(pb::UploadChunk { digest, data: head.into() }).await.is_err() {
            return;
        }
        let chunk = bytes::Bytes::from(vec![b'a'; 1 << 20]);
        let mut left = fill;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            if tx.send(pb::UploadChunk { digest: String::new(), data: chunk.slice(..n) }).await.is_err() {
                return; // the coordinator answered and stopped reading
            }
            left -= n as u64;
        }
    });
    let mut client = pb::content_store_client::ContentStoreClient::new(channel);
    let reply = client.upload(tokio_stream::wrappers::ReceiverStream::new(rx)).await;
    reply.expect_err("a hostile upload is refused")
}

const DIGEST: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_uploads_each_carrying_a_300_mb_pax_record_cost_bounded_memory() {
    let served = Served::start(&[]);
    let baseline = served.peak_rss();
    // An innocent first entry, then a pax header claiming 300 MB of records, streamed in full.
    let record = 300u64 << 20;
    let mut head = header("a", b'0', 1).to_vec();
    head.extend_from_slice(&[b'x'; 512]);
    head.extend_from_slice(&header("././@PaxHeader", b'x', record));
    let uploads = (0..3).map(|_| tokio::spawn(upload(served.channel(), DIGEST, head.clone(), record)));
    let refusals = futures_join(uploads).await;
    let peak = served.peak_rss();
    eprintln!("kiln-coordinator peak RSS: {} MiB (at start {} MiB)", peak >> 20, baseline >> 20);
    assert!(peak < 200 << 20, "three 300 MB pax records took the coordinator to {} MiB", peak >> 20);
    for refused in refusals {
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().contains(&format!("upload of context {DIGEST} refused"))
                && refused.message().contains("exceed 1 MiB"),
            "names the context and the limit: {}",
            refused.message()
        );
    }
    assert_eq!(served.stored_files(), Vec::<PathBuf>::new(), "nothing of a refused upload is kept");
    assert_eq!(served.missing(DIGEST).await, [DIGEST], "the context is still missing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_passing_the_configured_limit_are_refused_and_leave_no_file() {
    let served = Served::start(&["--max-upload-bytes", "10485760"]);
    // A file entry whose header claims 4 GB, then data for as long as the coordinator reads.
    let claim = 4u64 << 30;
    let head = header("big.bin", b'0', claim).to_vec();
    let uploads = (0..3).map(|_| tokio::spawn(upload(served.channel(), DIGEST, head.clone(), claim)));
    for refused in futures_join(uploads).await {
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
        let msg = refused.message();
        assert!(
            msg.contains(&format!("upload of context {DIGEST} refused"))
                && msg.contains("limit of 10 MiB")
                && msg.contains("--max-upload-bytes"),
            "names the context, the limit and the flag that sets it: {msg}"
        );
    }
    assert_eq!(served.stored_files(), Vec::<PathBuf>::new(), "the partial files are deleted");
    assert_eq!(served.missing(DIGEST).await, [DIGEST]);
    let peak = served.peak_rss();
    eprintln!("kiln-coordinator peak RSS: {} MiB", peak >> 20);
    assert!(peak < 200 << 20, "three capped uploads took the coordinator to {} MiB", peak >> 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_decoding_limit_is_refused_without_being_kept() {
    let served = Served::start(&[]);
    // One 8 MiB message: four times the content store's limit, where the CLI sends 1 MiB.
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::UploadChunk>(1);
    tx.send(pb::UploadChunk { digest: DIGEST.to_string(), data: vec![0u8; 8 << 20].into() }).await.unwrap();
    drop(tx);
    let mut client = pb::content_store_client::ContentStoreClient::new(served.channel());
    let refused = client.upload(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::OutOfRange, "{refused:?}");
    assert!(refused.message().contains("message length too large"), "{}", refused.message());
    assert_eq!(served.stored_files(), Vec::<PathBuf>::new());
}

/// Awaits every spawned upload, in order.
async fn futures_join(uploads: impl Iterator<Item = tokio::task::JoinHandle<tonic::Status>>) -> Vec<tonic::Status> {
    let mut done = Vec::new();
    for upload in uploads.collect::<Vec<_>>() {
        done.push(upload.await.unwrap());
    }
    done
}
