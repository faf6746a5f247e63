//! The agent's standard gRPC health service (`--health ADDR`), in plaintext: it tells only whether
//! the agent runs and whether it is connected, and the kubelet's `grpc:` probe cannot speak TLS.
//!
//! - `""` (the whole server) is SERVING while the process runs: the liveness probe. An unreachable
//!   coordinator is no reason to restart the agent — it reconnects by itself.
//! - `kiln.v1.AgentHub` is SERVING only while the agent holds a session with the active coordinator
//!   and is not draining: the readiness probe, and what an operator's dashboard asks.

use std::net::SocketAddr;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// The service name readiness is reported under: the coordinator's service the agent is a client of.
pub const READY_SERVICE: &str = "kiln.v1.AgentHub";

/// The health service while it is served; dropping it stops the listener.
#[derive(Debug, Default)]
pub(crate) struct Health {
    reporter: Option<HealthReporter>,
    server: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Health {
    fn drop(&mut self) {
        if let Some(server) = &self.server {
            server.abort();
        }
    }
}

impl Health {
    /// Binds `addr` and serves `grpc.health.v1.Health` there, not ready until the agent connects.
    pub(crate) async fn start(addr: SocketAddr) -> std::io::Result<Health> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        tracing::info!(addr = %listener.local_addr()?, "serving grpc.health.v1");
        let (reporter, service) = tonic_health::server::health_reporter();
        reporter.set_service_status(READY_SERVICE, ServingStatus::NotServing).await;
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let server = tokio::spawn(async move {
            let served = tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming).await;
            if let Err(err) = served {
                tracing::warn!(error = %err, "the health service stopped");
            }
        });
        Ok(Health { reporter: Some(reporter), server: Some(server) })
    }

    /// The agent holds a session with the active coordinator.
    pub(crate) async fn connected(&self) {
        self.set(ServingStatus::Serving).await;
    }

    /// The session ended, or the agent drains: it takes no work.
    pub(crate) async fn not_ready(&self) {
        self.set(ServingStatus::NotServing).await;
    }

    async fn set(&self, status: ServingStatus) {
        if let Some(reporter) = &self.reporter {
            reporter.set_service_status(READY_SERVICE, status).await;
        }
    }
}
