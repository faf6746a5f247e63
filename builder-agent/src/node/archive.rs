//! Reading a `docker save` archive as it streams in, on a blocking thread, into [`Piece`]s the
//! importer writes straight to containerd.
//!
//! Layers are never held whole: each is cut into [`CHUNK`]-sized pieces, hashed on this thread as
//! they pass, and sent down a channel only a couple of pieces deep, so a multi-gigabyte image costs
//! a few megabytes of memory. Only the small JSON files (`manifest.json`, the image config) are
//! kept whole, and those are capped.
//!
//! Both archive layouts Docker writes are read: the legacy one (`<id>/layer.tar`, `<config>.json`,
//! Docker ≤ 24) and the OCI one (`blobs/sha256/<hex>`, Docker ≥ 25). Which file is a layer and
//! which the config is known only from `manifest.json`, and that comes last; so everything shaped
//! like a layer or blob is streamed out by path, and the importer matches paths afterwards.

use super::ImportBody;
use bytes::Bytes;
use futures_util::StreamExt;
use sha2::{Digest as _, Sha256};
use std::io::{self, Read};
use tokio::sync::mpsc;

/// The size of one piece of a layer on its way to containerd.
pub(super) const CHUNK: usize = 1 << 20;

/// The largest `manifest.json` or image config the importer keeps in memory.
pub(super) const SMALL_LIMIT: u64 = 16 << 20;

#[derive(Debug)]
pub(super) enum Piece {
    /// A layer or blob begins; its bytes follow as `Data`, then `End`.
    Start {
        path: String,
        size: u64,
    },
    Data(Vec<u8>),
    /// The layer or blob that began last is complete, and hashes to `digest`.
    End {
        digest: String,
    },
    /// A small JSON file, whole.
    Small {
        path: String,
        bytes: Vec<u8>,
    },
    /// `path` is a symlink to `target` (both archive paths): `docker save` writes a layer that
    /// occurs twice in an image once, and links the second occurrence to it.
    Link {
        path: String,
        target: String,
    },
}

#[derive(Debug)]
pub(super) enum Failure {
    Read(io::Error),
    Malformed(String),
}

/// Starts reading `body`; pieces arrive on the returned channel in archive order, and the channel
/// closes after the last one or after the first failure.
pub(super) fn read(body: ImportBody) -> mpsc::Receiver<Result<Piece, Failure>> {
    let (bytes_tx, bytes_rx) = mpsc::channel::<io::Result<Bytes>>(2);
    let (pieces_tx, pieces_rx) = mpsc::channel(2);
    tokio::spawn(async move {
        let mut body = body;
        while let Some(chunk) = body.next().await {
            // The reader stopped (finished or failed): the rest of the body is not needed.
            if bytes_tx.send(chunk).await.is_err() {
                break;
            }
        }
    });
    tokio::task::spawn_blocking(move || {
        let reader = ChannelRead { rx: bytes_rx, current: Bytes::new() };
        if let Err(failure) = pieces(reader, &pieces_tx) {
            let _ = pieces_tx.blocking_send(Err(failure));
        }
    });
    pieces_rx
}

/// Why sending stopped: the importer went away, so reading on is pointless.
struct Gone;

fn pieces(reader: impl Read, out: &mpsc::Sender<Result<Piece, Failure>>) -> Result<(), Failure> {
    let send = |piece: Piece| out.blocking_send(Ok(piece)).map_err(|_| Gone);
    let mut archive = tar::Archive::new(reader);
    for entry in archive.entries().map_err(Failure::Read)? {
        let mut entry = entry.map_err(Failure::Read)?;
        let path = clean(&String::from_utf8_lossy(&entry.path_bytes()));
        let kind = entry.header().entry_type();
        let sent = if kind.is_symlink() && is_blob(&path) {
            let Some(link) = entry.link_name_bytes() else { continue };
            let target = resolve(&path, &String::from_utf8_lossy(&link))
                .ok_or_else(|| Failure::Malformed(format!("{path} links outside the archive")))?;
            send(Piece::Link { path, target })
        } else if !kind.is_file() {
            continue;
        } else if is_small(&path) {
            let size = entry.size();
            if size > SMALL_LIMIT {
                return Err(Failure::Malformed(format!(
                    "{path} is {size} bytes, more than a {SMALL_LIMIT}-byte limit"
                )));
            }
            let mut bytes = Vec::with_capacity(size as usize);
            entry.read_to_end(&mut bytes).map_err(Failure::Read)?;
            send(Piece::Small { path, bytes })
        } else if is_blob(&path) {
            stream(&mut entry, path, &send)?
        } else {
            continue;
        };
        if sent.is_err() {
            return Ok(());
        }
    }
    Ok(())
}

fn stream(
    entry: &mut tar::Entry<'_, impl Read>,
    path: String,
    send: &impl Fn(Piece) -> Result<(), Gone>,
) -> Result<Result<(), Gone>, Failure> {
    let size = entry.size();
    if send(Piece::Start { path, size }).is_err() {
        return Ok(Err(Gone));
    }
    let mut hasher = Sha256::new();
    let mut remaining = size;
    while remaining > 0 {
        let mut chunk = vec![0u8; remaining.min(CHUNK as u64) as usize];
        entry.read_exact(&mut chunk).map_err(Failure::Read)?;
        hasher.update(&chunk);
        remaining -= chunk.len() as u64;
        if send(Piece::Data(chunk)).is_err() {
            return Ok(Err(Gone));
        }
    }
    Ok(send(Piece::End { digest: format!("sha256:{:x}", hasher.finalize()) }))
}

/// A `./`-less archive path.
fn clean(path: &str) -> String {
    path.trim_start_matches("./").trim_end_matches('/').to_string()
}

/// `manifest.json`, and a top-level `<hex>.json`: the legacy layout's image config.
fn is_small(path: &str) -> bool {
    !path.contains('/') && path.ends_with(".json") && path != "index.json"
}

/// A legacy layer tar, or any OCI blob (layers and, in that layout, the config too).
fn is_blob(path: &str) -> bool {
    path.ends_with("/layer.tar") || path.starts_with("blobs/")
}

/// The archive path a symlink at `path` pointing to `link` names, or `None` when it leaves the
/// archive's root.
fn resolve(path: &str, link: &str) -> Option<String> {
    let mut parts: Vec<&str> = if link.starts_with('/') {
        Vec::new()
    } else {
        path.split('/').collect::<Vec<_>>().split_last().map(|(_, dir)| dir.to_vec()).unwrap_or_default()
    };
    for part in link.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            part => parts.push(part),
        }
    }
    Some(parts.join("/"))
}

/// A blocking `Read` over the chunks of an async body.
struct ChannelRead {
    rx: mpsc::Receiver<io::Result<Bytes>>,
    current: Bytes,
}

impl Read for ChannelRead {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(chunk)) => self.current = chunk,
                Some(Err(err)) => return Err(err),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    enum E<'a> {
        Dir(&'a str),
        File(&'a str, &'a [u8]),
        Link(&'a str, &'a str),
    }

    fn tar_of(entries: &[E<'_>]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for entry in entries {
            let mut header = tar::Header::new_gnu();
            match entry {
                E::File(path, data) => {
                    header.set_size(data.len() as u64);
                    builder.append_data(&mut header, path, *data).unwrap();
                }
                E::Link(path, target) => {
                    header.set_entry_type(tar::EntryType::Symlink);
                    header.set_size(0);
                    builder.append_link(&mut header, path, target).unwrap();
                }
                E::Dir(path) => {
                    header.set_entry_type(tar::EntryType::Directory);
                    header.set_size(0);
                    builder.append_data(&mut header, path, std::io::empty()).unwrap();
                }
            }
        }
        builder.into_inner().unwrap()
    }

    async fn collect(archive: Vec<u8>, split: usize) -> Vec<Result<Piece, Failure>> {
        let chunks: Vec<io::Result<Bytes>> = archive.chunks(split).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
        let mut rx = read(Box::pin(futures_util::stream::iter(chunks)));
        let mut pieces = Vec::new();
        while let Some(piece) = rx.recv().await {
            pieces.push(piece);
        }
        pieces
    }

    #[tokio::test]
    async fn layers_stream_in_chunks_with_their_digest_and_json_arrives_whole() {
        let layer: Vec<u8> = (0..(2 * CHUNK + 100)).map(|i| (i % 251) as u8).collect();
        let archive = tar_of(&[
            E::Dir("abc"),
            E::File("abc/VERSION", b"1.0"),
            E::File("abc/json", b"{}"),
            E::File("abc/layer.tar", &layer),
            E::Link("def/layer.tar", "../abc/layer.tar"),
            E::File("cfg.json", b"{\"rootfs\":{}}"),
            E::File("manifest.json", b"[]"),
            E::File("repositories", b"{}"),
        ]);
        let pieces: Vec<Piece> = collect(archive, 7000).await.into_iter().map(Result::unwrap).collect();
        let sizes: Vec<usize> =
            pieces.iter().filter_map(|p| if let Piece::Data(d) = p { Some(d.len()) } else { None }).collect();
        assert_eq!(sizes, vec![CHUNK, CHUNK, 100], "no piece is larger than a chunk");
        assert!(
            matches!(&pieces[0], Piece::Start { path, size } if path == "abc/layer.tar" && *size == layer.len() as u64)
        );
        assert!(matches!(&pieces[4], Piece::End { digest } if *digest == super::super::oci::sha256(&layer)));
        assert!(
            matches!(&pieces[5], Piece::Link { path, target } if path == "def/layer.tar" && target == "abc/layer.tar")
        );
        assert!(matches!(&pieces[6], Piece::Small { path, .. } if path == "cfg.json"));
        assert!(matches!(&pieces[7], Piece::Small { path, bytes } if path == "manifest.json" && bytes == b"[]"));
        assert_eq!(pieces.len(), 8, "VERSION, json, directories and repositories are skipped");
    }

    #[tokio::test]
    async fn a_link_out_of_the_archive_and_an_oversized_json_are_refused() {
        let out = tar_of(&[E::Link("abc/layer.tar", "../../etc/passwd")]);
        let last = collect(out, 512).await.pop().unwrap();
        assert!(matches!(last, Err(Failure::Malformed(why)) if why.contains("outside")));

        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(SMALL_LIMIT + 1);
        builder.append_data(&mut header, "manifest.json", io::repeat(b' ').take(SMALL_LIMIT + 1)).unwrap();
        let last = collect(builder.into_inner().unwrap(), 1 << 20).await.pop().unwrap();
        assert!(matches!(last, Err(Failure::Malformed(why)) if why.contains("manifest.json")));
    }

    #[tokio::test]
    async fn a_stream_that_fails_or_stops_midway_is_a_read_failure() {
        let layer = vec![1u8; 10_000];
        let archive = tar_of(&[E::File("abc/layer.tar", &layer)]);
        let last = collect(archive[..3000].to_vec(), 512).await.pop().unwrap();
        assert!(matches!(last, Err(Failure::Read(_))));

        let chunks = vec![Ok(Bytes::from(archive[..1024].to_vec())), Err(io::Error::other("peer went away"))];
        let mut rx = read(Box::pin(futures_util::stream::iter(chunks)));
        let mut last = None;
        while let Some(piece) = rx.recv().await {
            last = Some(piece);
        }
        assert!(matches!(last, Some(Err(Failure::Read(err))) if err.to_string() == "peer went away"));
    }

    #[test]
    fn links_resolve_inside_the_archive_only() {
        assert_eq!(resolve("b/layer.tar", "../a/layer.tar").as_deref(), Some("a/layer.tar"));
        assert_eq!(resolve("b/layer.tar", "./x/../layer.tar").as_deref(), Some("b/layer.tar"));
        assert_eq!(resolve("b/layer.tar", "/a/layer.tar").as_deref(), Some("a/layer.tar"));
        assert_eq!(resolve("b/layer.tar", "../../a"), None);
    }
}
