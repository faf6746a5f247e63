//! An OTLP collector stand-in: opentelemetry-proto's `TraceService` served over real gRPC on a free
//! loopback port, keeping every span it is sent with the `service.name` of the process that sent
//! it. Point a process at it with `OTEL_EXPORTER_OTLP_ENDPOINT=<endpoint>`; the wire protocol is
//! the one a real collector speaks.

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// One span as received; ids in hex, `parent` empty for a root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    pub service: String,
    pub name: String,
    pub trace: String,
    pub id: String,
    pub parent: String,
}

#[derive(Default)]
struct Received {
    exports: usize,
    spans: Vec<Span>,
}

/// The collector; stopped when dropped.
pub struct Collector {
    /// `http://127.0.0.1:PORT`, as `OTEL_EXPORTER_OTLP_ENDPOINT` takes it.
    pub endpoint: String,
    received: Arc<Mutex<Received>>,
    stop: Option<oneshot::Sender<()>>,
    served: JoinHandle<()>,
}

impl std::fmt::Debug for Collector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Collector").field("endpoint", &self.endpoint).finish_non_exhaustive()
    }
}

struct Service(Arc<Mutex<Received>>);

#[tonic::async_trait]
impl TraceService for Service {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut received = self.0.lock().unwrap();
        received.exports += 1;
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                    Value::StringValue(name) => Some(name.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
                received.spans.push(Span {
                    service: service.clone(),
                    name: span.name,
                    trace: hex::encode(span.trace_id),
                    id: hex::encode(span.span_id),
                    parent: hex::encode(span.parent_span_id),
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

impl Collector {
    /// Serves on a free loopback port of the current runtime.
    pub async fn start() -> Collector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a loopback port");
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let received = Arc::new(Mutex::new(Received::default()));
        let (stop, stopped) = oneshot::channel::<()>();
        let service = TraceServiceServer::new(Service(received.clone()));
        // Nagle off, as a collector should be: an answer held for the client's delayed ACK would
        // add ~40 ms to a CLI's flush on exit, which is the collector's cost, not Kiln's.
        let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let served = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
        });
        Collector { endpoint, received, stop: Some(stop), served }
    }

    /// Every span received so far, in the order received.
    pub fn spans(&self) -> Vec<Span> {
        self.received.lock().unwrap().spans.clone()
    }

    /// How many export calls arrived, spans or not.
    pub fn exports(&self) -> usize {
        self.received.lock().unwrap().exports
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.served.abort();
    }
}
