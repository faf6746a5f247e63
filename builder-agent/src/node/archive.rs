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
