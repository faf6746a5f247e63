//! The plain-HTTP/1 accept loop behind the coordinator's `--http` (status page, `/metrics`,
//! probes) and the agent's `--metrics`. Here because both need the same care: connections live in
//! a `JoinSet`, so they end with the listener instead of outliving the process on a scraper's (or
//! a browser's) keep-alive, and a failed accept waits instead of spinning.

use std::net::SocketAddr;
use tokio::net::TcpListener;

/// Accepts on `listener` until the future is dropped, serving each connection with the service
/// `service_for` makes for its peer's address.
pub async fn serve<F, S, B>(listener: TcpListener, service_for: F)
where
    F: Fn(SocketAddr) -> S,
    S: hyper::service::Service<http::Request<hyper::body::Incoming>, Response = http::Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                // Out of file descriptors, most likely: wait rather than spin on the error.
                tracing::warn!(error = %err, "HTTP accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let service = service_for(peer);
        connections.spawn(async move {
            let io = hyper_util::rt::TokioIo::new(stream);
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
        });
        while connections.try_join_next().is_some() {}
    }
}
