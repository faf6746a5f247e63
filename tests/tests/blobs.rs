//! Per-file uploads (issue 14) against a served coordinator and the real Docker daemon: a context
//! travels as the file blobs the coordinator lacks plus its entry list. The first converge sends
//! every blob once, a one-file edit sends one, a second client with the same tree sends none; a
//! blob whose bytes lie about their hash is refused and nothing is built; blobs are collected by
//! reachability (kept while a stored context names them or an upload in flight under a live
//! claim holds them).

use std::path::{Path, PathBuf};

use kiln::render::plain::Plain;
use kiln_core::digest::{digest_dir, EntryKind};
use kiln_e2e::fixture::{copy_dir, remove_built, unique, write};
use kiln_e2e::wire::{channel, gc, succeeded, up_request};
use kiln_e2e::Farm;
use kiln_proto::v1 as pb;
use pb::content_store_client::ContentStoreClient;

/// An instance folder with one built image whose context holds `files` small distinct files, a
/// 3 MiB file (sent in pieces) and a copy of the first small file (one blob for both).
fn instance(into: &Path, folder: &str, instance: &str, files: usize) -> PathBuf {
    let dir = into.join(folder);
    write(
        &dir,
        "kiln.toml",
        &format!("instance = \"{instance}\"\n[target]\nkind = \"local\"\n[built.app]\ncontext = \"app\"\n"),
    );
    write(&dir, "app/Dockerfile", "FROM scratch\nCOPY . /\n");
    for i in 0..files {
        write(&dir, &format!("app/src/f{i:02}.txt"), &format!("file {i} of {instance}\n"));
    }
    write(&dir, "app/copy.txt", &format!("file 0 of {instance}\n"));
    let big: String = (0..3 << 20).map(|i| char::from(b'a' + (i * 7 % 26) as u8)).collect();
    write(&dir, "app/big.txt", &big);
    dir
}

/// `kiln up DIR` as a user runs it against the served coordinator: the outcome and its plain output.
async fn kiln_up(farm: &Farm, dir: &Path) -> (kiln::UpOutcome, String) {
    let mut args = kiln::UpArgs::new(dir);
    args.connect = kiln::Connect::remote(&farm.url);
    args.output = kiln::OutputMode::Plain;
    let mut out = Plain::new(Vec::new());
    let outcome = kiln::up_with(&args, &mut out).await.unwrap();
    (outcome, String::from_utf8(out.into_inner()).unwrap())
}

/// The `(sent, of)` blob counts the converge's upload line printed, if it uploaded per file.
fn sent(text: &str) -> Option<(u64, u64)> {
    let line = text.lines().find(|l| l.contains("file blob(s)"))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words.iter().position(|w| *w == "sent")?;
    Some((words[at + 1].parse().ok()?, words[at + 3].parse().ok()?))
}

/// The blob files the coordinator holds.
fn blob_files(farm: &Farm) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(farm.home.join("state/contexts/blobs"))
        .map(|dir| dir.map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect())
        .unwrap_or_default();
    names.retain(|n| !n.starts_with('.'));
    names.sort();
    names
}

fn hash_of(text: &str) -> String {
    blake3::hash(text.as_bytes()).to_hex().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_file_uploads_send_each_blob_once_and_then_only_what_moved() {
    let tmp = tempfile::tempdir().unwrap();
    let name = unique("blobs");
    let dir = instance(tmp.path(), "alice", &name, 30);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    // The Dockerfile, 30 distinct small files, the big one; the copy shares the first's blob.
    let distinct = 32;

    let (outcome, text) = kiln_up(&farm, &dir).await;
    assert_eq!(outcome.exit(), kiln::Exit::Converged, "{text}");
    assert_eq!(sent(&text), Some((distinct, distinct)), "the first converge sends every blob once: {text}");
    assert_eq!(blob_files(&farm).len(), distinct as usize);
    assert_eq!(farm.builds(), 1);

    write(&dir, "app/src/f07.txt", "edited\n");
    let (outcome, text) = kiln_up(&farm, &dir).await;
    assert_eq!(outcome.exit(), kiln::Exit::Converged, "{text}");
    assert_eq!(sent(&text), Some((1, distinct)), "a one-file edit sends one blob: {text}");
    assert!(blob_files(&farm).contains(&hash_of("edited\n")));
    assert_eq!(farm.builds(), 2);

    // Another developer, the same sources in another folder and instance: the context is stored.
    let bob = tmp.path().join("bob");
    copy_dir(&dir, &bob);
    let manifest = std::fs::read_to_string(bob.join("kiln.toml")).unwrap().replace(&name, &format!("{name}-bob"));
    std::fs::write(bob.join("kiln.toml"), manifest).unwrap();
    let (outcome, text) = kiln_up(&farm, &bob).await;
    assert_eq!(outcome.exit(), kiln::Exit::Converged, "{text}");
    assert_eq!(sent(&text), None, "the same tree uploads nothing: {text}");

    // A tree that differs only by an empty directory: a new context, but every blob is held.
    std::fs::create_dir(bob.join("app/empty")).unwrap();
    let (outcome, text) = kiln_up(&farm, &bob).await;
    assert_eq!(outcome.exit(), kiln::Exit::Converged, "{text}");
    assert_eq!(sent(&text), Some((0, distinct)), "shared blobs are not sent again: {text}");

    farm.stop().await;
    remove_built(&dir);
    remove_built(&bob);
}

/// A file blob: its content hash and bytes.
type Blob = ([u8; 32], Vec<u8>);

/// The request of `dir`, its one context's digest, that context's files as blobs and its entry list.
fn context_of(dir: &Path) -> (pb::UpRequest, String, Vec<Blob>, Vec<u8>) {
    let (req, contexts) = up_request(dir, false);
    let (digest, (root, opts)) = contexts.into_iter().next().unwrap();
    let (tree, _) = digest_dir(&root, &opts).unwrap();
    let files = tree
        .entries
        .iter()
        .filter(|e| matches!(e.kind, EntryKind::File | EntryKind::ExecFile))
        .map(|e| (e.hash.unwrap().0, std::fs::read(root.join(String::from_utf8_lossy(&e.path).as_ref())).unwrap()))
        .collect();
    let list = kiln_core::digest::list::encode(&tree.entries).unwrap();
    (req, digest, files, list)
}

/// One `UploadBlobs` call carrying `blobs` for `context`, a message per MiB piece.
async fn upload_blobs(
    url: &str,
    context: &str,
    blobs: &[([u8; 32], Vec<u8>)],
) -> Result<pb::UploadBlobsReply, tonic::Status> {
    let mut batches = Vec::new();
    for (hash, data) in blobs {
        let mut offset = 0;
        loop {
            let end = (offset + (1 << 20)).min(data.len());
            let piece = pb::BlobPiece {
                hash: hash.to_vec(),
                size: data.len() as u64,
                offset: offset as u64,
                data: data[offset..end].to_vec().into(),
            };
            batches.push(pb::BlobBatch { context: context.to_string(), pieces: vec![piece] });
            offset = end;
            if offset == data.len() {
                break;
            }
        }
    }
    ContentStoreClient::new(channel(url)).upload_blobs(tokio_stream::iter(batches)).await.map(|r| r.into_inner())
}

async fn missing_blobs(url: &str, context: &str, hashes: &[[u8; 32]]) -> Vec<Vec<u8>> {
    let request = pb::FindMissingBlobsRequest {
        context: context.to_string(),
        hashes: hashes.iter().map(|h| h.to_vec()).collect(),
    };
    ContentStoreClient::new(channel(url)).find_missing_blobs(request).await.unwrap().into_inner().missing
}

async fn put_context(url: &str, digest: &str, list: Vec<u8>) -> Result<pb::UploadReply, tonic::Status> {
    let chunk = pb::ContextListChunk { digest: digest.to_string(), entries: list.into() };
    ContentStoreClient::new(channel(url)).put_context(tokio_stream::iter(vec![chunk])).await.map(|r| r.into_inner())
}

/// Starts `Up` for `req` and reads events until the coordinator asks for its context; the
/// converge then waits (holding its claims) while the stream is kept.
async fn up_until_asked(url: &str, req: pb::UpRequest) -> tonic::Streaming<pb::ConvergeEvent> {
    let mut stream = pb::kiln_client::KilnClient::new(channel(url)).up(req).await.unwrap().into_inner();
    while let Some(event) = stream.message().await.unwrap() {
        if event.kind() == pb::converge_event::Kind::NeedContexts {
            return stream;
        }
    }
    panic!("the converge ended without asking for its context");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_whose_bytes_lie_about_their_hash_is_refused_and_nothing_is_built() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = instance(tmp.path(), "liar", &unique("liar"), 3);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let (req, digest, files, list) = context_of(&dir);
    let stream = up_until_asked(&farm.url, req).await;

    // Every blob honest but one, whose bytes are another file's of the same length.
    let (honest, lying) = files.split_at(files.len() - 1);
    upload_blobs(&farm.url, &digest, honest).await.unwrap();
    let (hash, data) = &lying[0];
    let mut forged = data.clone();
    forged[0] ^= 1;
    let refused = upload_blobs(&farm.url, &digest, &[(*hash, forged)]).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("refused") && refused.message().contains(&hex::encode(hash)), "{refused:?}");
    assert_eq!(
        missing_blobs(&farm.url, &digest, &[*hash]).await,
        vec![hash.to_vec()],
        "nothing is stored under the lie"
    );

    let put = put_context(&farm.url, &digest, list).await.unwrap_err();
    assert_eq!(put.code(), tonic::Code::FailedPrecondition, "{put:?}");
    assert!(put.message().contains("1 file blob(s)"), "{put:?}");
    let mut store = ContentStoreClient::new(channel(&farm.url));
    let stored = store.find_missing(pb::FindMissingRequest { digests: vec![digest.clone()] }).await.unwrap();
    assert_eq!(stored.into_inner().missing, vec![digest.clone()], "the context is not stored");

    drop(stream); // the client leaves: its converge is cancelled
    assert_eq!(farm.builds(), 0, "nothing was built");
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blobs_stay_while_a_kept_context_or_an_upload_in_flight_names_them() {
    let tmp = tempfile::tempdir().unwrap();
    let kept = instance(tmp.path(), "kept", &unique("kept"), 3);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let (outcome, text) = kiln_up(&farm, &kept).await;
    assert_eq!(outcome.exit(), kiln::Exit::Converged, "{text}");
    let kept_blobs = blob_files(&farm);
    assert_eq!(kept_blobs.len(), 5, "{kept_blobs:?}");

    // A converge in flight: asked for its context, it holds the claim while the upload runs.
    let flying = instance(tmp.path(), "flying", &unique("flying"), 3);
    let (req, digest, files, list) = context_of(&flying);
    let stream = up_until_asked(&farm.url, req).await;
    let hashes: Vec<[u8; 32]> = files.iter().map(|(h, _)| *h).collect();
    let lacking = missing_blobs(&farm.url, &digest, &hashes).await;
    let first: Vec<_> = files.iter().filter(|(h, _)| lacking.contains(&h.to_vec())).take(1).cloned().collect();
    upload_blobs(&farm.url, &digest, &first).await.unwrap();
    let in_flight = hex::encode(first[0].0);

    // An orphan: uploaded for a context nobody converges, so no claim holds it.
    let orphan = "nobody converges this\n".as_bytes().to_vec();
    let orphan_hash: [u8; 32] = *blake3::hash(&orphan).as_bytes();
    upload_blobs(&farm.url, &"ab".repeat(32), &[(orphan_hash, orphan)]).await.unwrap();
    assert!(blob_files(&farm).contains(&hex::encode(orphan_hash)));

    let events = gc(&farm.url, false, None).await;
    assert!(succeeded(&events), "{events:#?}");
    let after = blob_files(&farm);
    assert!(!after.contains(&hex::encode(orphan_hash)), "the orphan went");
    assert!(after.contains(&in_flight), "the blob of the upload in flight stayed");
    assert!(kept_blobs.iter().all(|b| after.contains(b)), "every blob of the recorded context stayed");

    // The upload finishes and the converge builds from the blobs the collection spared.
    let rest: Vec<_> =
        files.iter().filter(|(h, _)| lacking.contains(&h.to_vec()) && hex::encode(h) != in_flight).cloned().collect();
    upload_blobs(&farm.url, &digest, &rest).await.unwrap();
    put_context(&farm.url, &digest, list).await.unwrap();
    let mut stream = stream;
    let mut last = None;
    while let Some(event) = stream.message().await.unwrap() {
        last = Some(event);
    }
    let last = last.unwrap();
    assert_eq!(last.outcome(), pb::Outcome::Succeeded, "{last:#?}");
    farm.stop().await;
    remove_built(&kept);
    remove_built(&flying);
}
