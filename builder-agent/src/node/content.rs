//! One connection to containerd and the calls every adapter needs on it: requests scoped to a
//! namespace (and, while importing, to a lease), a bounded wait for each answer, blob reads, streamed
//! blob writes, and leases.

use super::NodeError;
use hyper_util::rt::TokioIo;
use kiln_proto::containerd::services::content::v1::content_client::ContentClient;
use kiln_proto::containerd::services::content::v1::{
    AbortRequest, ReadContentRequest, WriteAction, WriteContentRequest,
};
use kiln_proto::containerd::services::leases::v1::leases_client::LeasesClient;
use kiln_proto::containerd::services::leases::v1::{CreateRequest, DeleteRequest};
use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Code, Request, Status};

/// How long a quick call (a listing, a removal, a blob read) may wait for its answer. A streamed
/// blob write has no such bound: a large layer over a slow link takes as long as it takes.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

/// How long containerd keeps an import's lease if the agent dies before ending it; after that the
/// half-imported blobs are collected.
pub(super) const LEASE_TTL: Duration = Duration::from_secs(60 * 60);

/// A channel to one containerd, and the namespace every request is scoped to.
#[derive(Clone, Debug)]
pub(super) struct Conn {
    pub channel: Channel,
    pub socket: PathBuf,
    pub namespace: String,
}

impl Conn {
    /// Connects to the unix socket at `socket`; fails naming it when nothing listens there.
    pub async fn connect(socket: &Path, namespace: &str) -> Result<Conn, NodeError> {
        let unreachable = |source| NodeError::Unreachable { socket: socket.to_path_buf(), source };
        let channel = unix_channel(socket).await.map_err(unreachable)?;
        Ok(Conn { channel, socket: socket.to_path_buf(), namespace: namespace.to_string() })
    }

    /// `message` scoped to this namespace and, when given, held by `lease` so containerd's collector
    /// leaves what it writes alone until the lease ends.
    pub fn request<T>(&self, message: T, lease: Option<&str>) -> Request<T> {
        let mut request = Request::new(message);
        let metadata = request.metadata_mut();
        if let Some(Ok(namespace)) = (!self.namespace.is_empty()).then(|| self.namespace.parse()) {
            metadata.insert("containerd-namespace", namespace);
        }
        if let Some(Ok(lease)) = lease.map(str::parse) {
            metadata.insert("containerd-lease", lease);
        }
        request
    }

    pub fn refused(&self, op: &'static str, object: &str, source: Status) -> NodeError {
        NodeError::Refused { socket: self.socket.clone(), op, object: object.to_string(), source }
    }

    /// Awaits one call, bounded by [`ANSWER_TIMEOUT`], naming `op object` when it fails.
    pub async fn call<T>(
        &self,
        op: &'static str,
        object: &str,
        call: impl Future<Output = Result<T, Status>>,
    ) -> Result<T, NodeError> {
        match tokio::time::timeout(ANSWER_TIMEOUT, call).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(status)) => Err(self.refused(op, object, status)),
            Err(_) => Err(NodeError::TimedOut { socket: self.socket.clone(), op, object: object.to_string() }),
        }
    }

    /// The whole blob `digest`, or `None` when the content store does not hold it. `what` names the
    /// blob's role for errors; a blob over `limit` bytes is refused rather than read into memory.
    pub async fn read_blob(&self, digest: &str, what: &'static str, limit: u64) -> Result<Option<Vec<u8>>, NodeError> {
        let mut client = ContentClient::new(self.channel.clone());
        let request = self.request(ReadContentRequest { digest: digest.to_string(), offset: 0, size: 0 }, None);
        let read = async {
            let mut chunks = client.read(request).await?.into_inner();
            let mut blob = Vec::new();
            while let Some(chunk) = chunks.message().await? {
                blob.extend_from_slice(&chunk.data);
                if blob.len() as u64 > limit {
                    return Ok(Err(()));
                }
            }
            Ok::<_, Status>(Ok(blob))
        };
        match tokio::time::timeout(ANSWER_TIMEOUT, read).await {
            Ok(Ok(Ok(blob))) => Ok(Some(blob)),
            Ok(Ok(Err(()))) => {
                Err(NodeError::BlobTooLarge { socket: self.socket.clone(), digest: digest.to_string(), what, limit })
            }
            Ok(Err(status)) if status.code() == Code::NotFound => Ok(None),
            Ok(Err(status)) => Err(self.refused("read blob", digest, status)),
            Err(_) => Err(NodeError::TimedOut { socket: self.socket.clone(), op: "read blob", object: digest.into() }),
        }
    }

    /// Opens a lease that expires by itself after [`LEASE_TTL`], so an agent that dies mid-import
    /// leaks nothing for longer than that.
    pub async fn lease(&self) -> Result<String, NodeError> {
        let id = format!("kiln-import-{:016x}", fastrand::u64(..));
        let expires = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default() + LEASE_TTL;
        let labels = HashMap::from([("containerd.io/gc.expire".to_string(), rfc3339(expires.as_secs()))]);
        let mut client = LeasesClient::new(self.channel.clone());
        let request = self.request(CreateRequest { id: id.clone(), labels }, None);
        self.call("create lease", &id, client.create(request)).await?;
        Ok(id)
    }

    /// Ends a lease; what it held and nothing else names becomes collectable. Best effort: a lease
    /// left behind expires by itself.
    pub async fn end_lease(&self, id: &str) {
        let mut client = LeasesClient::new(self.channel.clone());
        let request = self.request(DeleteRequest { id: id.to_string(), sync: false }, None);
        if let Err(err) = self.call("delete lease", id, client.delete(request)).await {
            tracing::warn!(socket = %self.socket.display(), lease = id, error = %err, "could not end an import lease; it expires by itself");
        }
    }
}

/// A gRPC channel to the unix socket at `socket` (containerd's, which also serves the CRI),
/// connected before it is returned, so a socket nobody listens on fails here. The channel
/// reconnects to the same path when the connection drops.
pub async fn unix_channel(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let socket = socket.to_path_buf();
    // The URI only fills the HTTP/2 `:authority`; `localhost` is what gRPC's own clients send on a
    // unix socket. Every connection goes to the socket.
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { UnixStream::connect(socket).await.map(TokioIo::new) }
        }))
        .await
}

/// One blob streamed into the content store under a lease, in chunks, without knowing its digest
/// until the end.
#[derive(Debug)]
pub(super) struct BlobWriter {
    conn: Conn,
    /// What the blob is, for errors (`layer 0abc…/layer.tar`).
    object: String,
    /// containerd's name for the unfinished write; random, so two imports never share one.
    ingest: String,
    tx: Option<mpsc::Sender<WriteContentRequest>>,
    call: JoinHandle<Result<(), Status>>,
    offset: i64,
}

/// Whether a committed blob was new to the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Committed {
    Written,
    AlreadyPresent,
}

impl BlobWriter {
    pub fn open(conn: &Conn, lease: &str, object: String) -> BlobWriter {
        let ingest = format!("kiln-{:016x}", fastrand::u64(..));
        // A few chunks in flight at most: the bound on an import's memory.
        let (tx, rx) = mpsc::channel(2);
        let mut client = ContentClient::new(conn.channel.clone());
        let request = conn.request(ReceiverStream::new(rx), Some(lease));
        // containerd answers every request on the stream; the answers are drained as they come, or
        // HTTP/2 flow control would stall the upload once enough of them piled up unread.
        let call = tokio::spawn(async move {
            let mut answers = client.write(request).await?.into_inner();
            while answers.message().await?.is_some() {}
            Ok(())
        });
        BlobWriter { conn: conn.clone(), object, ingest, tx: Some(tx), call, offset: 0 }
    }

    pub async fn write(&mut self, data: Vec<u8>) -> Result<(), NodeError> {
        let len = data.len() as i64;
        let request = WriteContentRequest {
            action: WriteAction::Write as i32,
            r#ref: self.ingest.clone(),
            offset: self.offset,
            data,
            ..Default::default()
        };
        self.send(request).await?;
        self.offset += len;
        Ok(())
    }

    /// Commits what was written as `digest` of `size` bytes; containerd recomputes the digest and
    /// refuses a mismatch. `labels` land on the blob only when it is new.
    pub async fn commit(
        mut self,
        digest: &str,
        size: u64,
        labels: HashMap<String, String>,
    ) -> Result<Committed, NodeError> {
        let request = WriteContentRequest {
            action: WriteAction::Commit as i32,
            r#ref: self.ingest.clone(),
            total: size as i64,
            expected: digest.to_string(),
            offset: self.offset,
            labels,
            ..Default::default()
        };
        self.send(request).await?;
        drop(self.tx.take());
        match self.finish().await {
            Ok(()) => Ok(Committed::Written),
            Err(status) if status.code() == Code::AlreadyExists => Ok(Committed::AlreadyPresent),
            Err(status) => Err(self.fail(status).await),
        }
    }

    /// Gives the unfinished write up, so its partial bytes do not linger in the ingest area.
    pub async fn abort(mut self) {
        drop(self.tx.take());
        self.call.abort();
        let mut client = ContentClient::new(self.conn.channel.clone());
        let request = self.conn.request(AbortRequest { r#ref: self.ingest.clone() }, None);
        let _ = self.conn.call("abort write", &self.ingest, client.abort(request)).await;
    }

    async fn send(&mut self, request: WriteContentRequest) -> Result<(), NodeError> {
        let sent = match &self.tx {
            Some(tx) => tx.send(request).await.is_ok(),
            None => false,
        };
        if sent {
            return Ok(());
        }
        // The stream ended early: the call's own answer says why.
        drop(self.tx.take());
        let status = self.finish().await.err().unwrap_or_else(|| Status::aborted("the write stream closed early"));
        Err(self.fail(status).await)
    }

    async fn finish(&mut self) -> Result<(), Status> {
        match (&mut self.call).await {
            Ok(result) => result,
            Err(join) => Err(Status::aborted(join.to_string())),
        }
    }

    async fn fail(&self, status: Status) -> NodeError {
        let mut client = ContentClient::new(self.conn.channel.clone());
        let request = self.conn.request(AbortRequest { r#ref: self.ingest.clone() }, None);
        let _ = self.conn.call("abort write", &self.ingest, client.abort(request)).await;
        self.conn.refused("write blob", &self.object, status)
    }
}

/// `unix_secs` as an RFC 3339 UTC timestamp (`2026-11-29T22:29:30Z`), the form containerd's lease
/// expiry label takes.
pub(super) fn rfc3339(unix_secs: u64) -> String {
    let (days, secs) = (unix_secs / 86_400, unix_secs % 86_400);
    let (year, month, day) = civil_from_days(days as i64);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", secs / 3600, secs % 3600 / 60, secs % 60)
}

/// The proleptic Gregorian date `days` after 1970-01-01 (Howard Hinnant's days-to-civil algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_spells_utc_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_795_991_370), "2026-11-29T22:29:30Z");
        assert_eq!(rfc3339(4_107_542_399), "2100-02-28T23:59:59Z");
    }
}
