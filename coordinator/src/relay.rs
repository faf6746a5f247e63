//! The image relay: a `docker save` archive on its way from the host agent that exported it to the
//! node agents that import it. Agents only dial out, so neither side can reach the other; the
//! coordinator spools the archive to a file under its state dir (`relay/<key>.tar`) as it arrives
//! and streams that file to each node agent that asks. Memory stays bounded by one chunk per
//! stream whatever the image's size. The converge that chose the key deletes the file after its
//! delivery, whatever the outcome.

use kiln_proto::v1 as pb;
use std::path::PathBuf;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

const CHUNK: usize = 1 << 20;

/// Where relayed archives are spooled.
#[derive(Debug, Clone)]
pub struct Relay {
    dir: PathBuf,
}

impl Relay {
    /// Opens the spool, emptying it: whatever a previous run left belonged to converges that
    /// died with it (they are marked failed at start), and nothing else would ever delete it.
    pub fn open(dir: PathBuf) -> std::io::Result<Relay> {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(Relay { dir })
    }

    /// The spool file of `key`; `None` for a key that could name a path outside the spool dir.
    fn path(&self, key: &str) -> Option<PathBuf> {
        let safe = !key.is_empty()
            && key.len() <= 200
            && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        safe.then(|| self.dir.join(format!("{key}.tar")))
    }

    /// Deletes `key`'s archive; a missing one is fine (the export may never have started).
    pub async fn discard(&self, key: &str) {
        if let Some(path) = self.path(key) {
            let _ = tokio::fs::remove_file(path).await;
        }
    }
}

/// The `ImageRelay` gRPC service.
#[derive(Debug, Clone)]
pub struct RelayService {
    pub relay: Relay,
}

#[tonic::async_trait]
impl pb::image_relay_server::ImageRelay for RelayService {
    async fn put(&self, request: Request<Streaming<pb::RelayChunk>>) -> Result<Response<pb::RelayPutReply>, Status> {
        let mut inbound = request.into_inner();
        let first = inbound.message().await?.ok_or_else(|| Status::invalid_argument("relay put without a chunk"))?;
        let path = self.relay.path(&first.key).ok_or_else(|| {
            Status::invalid_argument(format!("relay key {:?} must be 1–200 of [A-Za-z0-9_-]", first.key))
        })?;
        // Written under a temporary name and renamed at the end, so a reader never sees half an archive.
        let partial = path.with_extension("partial");
        let mut file = tokio::fs::File::create(&partial)
            .await
            .map_err(|e| Status::internal(format!("cannot create {}: {e}", partial.display())))?;
        let mut bytes = first.data.len() as u64;
        let write_err = |e: std::io::Error| Status::internal(format!("cannot write the relay spool: {e}"));
        file.write_all(&first.data).await.map_err(write_err)?;
        loop {
            match inbound.message().await {
                Ok(Some(chunk)) => {
                    bytes += chunk.data.len() as u64;
                    file.write_all(&chunk.data).await.map_err(write_err)?;
                }
                Ok(None) => break,
                Err(status) => {
                    let _ = tokio::fs::remove_file(&partial).await;
                    return Err(status);
                }
            }
        }
        file.flush().await.map_err(write_err)?;
        drop(file);
        tokio::fs::rename(&partial, &path).await.map_err(write_err)?;
        Ok(Response::new(pb::RelayPutReply { bytes }))
    }

    type GetStream = ReceiverStream<Result<pb::RelayChunk, Status>>;

    async fn get(&self, request: Request<pb::RelayGetRequest>) -> Result<Response<Self::GetStream>, Status> {
        let key = request.into_inner().key;
        let path = self
            .relay
            .path(&key)
            .ok_or_else(|| Status::invalid_argument(format!("relay key {key:?} must be 1–200 of [A-Za-z0-9_-]")))?;
        let mut file = tokio::fs::File::open(&path)
            .await
            .map_err(|_| Status::not_found(format!("no relayed archive under {key} — the export did not finish")))?;
        let (tx, rx) = mpsc::channel(2);
        tokio::spawn(async move {
            let mut buf = vec![0u8; CHUNK];
            loop {
                match file.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => {
                        let chunk =
                            pb::RelayChunk { key: String::new(), data: bytes::Bytes::copy_from_slice(&buf[..n]) };
                        if tx.send(Ok(chunk)).await.is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(Status::internal(format!("cannot read the relay spool: {e}")))).await;
                        break;
                    }
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_that_could_leave_the_spool_dir_names_no_file() {
        let relay = Relay { dir: PathBuf::from("/spool") };
        assert_eq!(relay.path("abc123-conv_1"), Some(PathBuf::from("/spool/abc123-conv_1.tar")));
        for bad in ["", "../x", "a/b", "a.b", &"k".repeat(201)] {
            assert_eq!(relay.path(bad), None, "{bad:?}");
        }
    }
}
