//! `kiln-telemetry`: how `kiln`, `kiln-coordinator` and `kiln-agent` log and trace. Start at
//! [`init`], which each binary calls first in `main`, and [`Telemetry::shutdown`], which it calls
//! last; [`propagate`] carries a trace across processes (gRPC metadata, a task's `traceparent`);
//! [`http`] is the plain-HTTP listener loop of `/metrics` and the status page.
//!
//! Traces are exported by OTLP over gRPC only when `OTEL_EXPORTER_OTLP_ENDPOINT` is set; otherwise
//! no exporter is built and Kiln's spans cost a disabled callsite each. The exporter reads the
//! other standard variables itself (`OTEL_BSP_SCHEDULE_DELAY`, `OTEL_EXPORTER_OTLP_TIMEOUT`, …).
//!
//! A crate of its own because the three binaries share no crate that may do I/O: `kiln-core` is
//! pure and `kiln-proto` holds generated code only, and the coordinator and the agent do not depend
//! on each other.

mod command;
pub mod http;
pub mod propagate;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use std::time::Duration;
use tracing_subscriber::filter::{filter_fn, EnvFilter, FilterExt, LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

pub use propagate::{follow, follow_headers, inject, traceparent};

/// The variable that turns tracing on: where the OTLP/gRPC collector listens.
pub const ENDPOINT_VAR: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// How long the last spans may take to reach the collector on exit: a collector that is down must
/// not hold a `kiln` command or a stopping server for the exporter's own 10 s timeout.
const FLUSH_WAIT: Duration = Duration::from_secs(3);

/// What kind of process is traced, which decides how it logs and how its spans are sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Process {
    /// A server (`kiln-coordinator`, `kiln-agent`): logs on stderr; a batch the collector did not
    /// take is sent again (the exporter's recommended retries), on the exporter's own thread.
    Server,
    /// A command (`kiln`): no logs, its output is its own; its spans are held and sent in one
    /// export as it exits, never retried — a collector that is down must not hold the command for
    /// the retries' second.
    Command,
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("cannot export traces to {ENDPOINT_VAR}={endpoint} — fix the URL (http://host:4317) or unset it")]
    Exporter {
        endpoint: String,
        #[source]
        err: opentelemetry_otlp::ExporterBuildError,
    },
}

/// The installed telemetry; [`Telemetry::shutdown`] sends the spans still buffered.
#[derive(Debug)]
#[must_use = "call `shutdown` on exit, or the last spans are lost"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    /// A command's spans, sent by [`Telemetry::shutdown`].
    held: Option<command::Held>,
}

/// Whether `OTEL_EXPORTER_OTLP_ENDPOINT` asks for traces.
pub fn exporting() -> bool {
    std::env::var_os(ENDPOINT_VAR).is_some_and(|v| !v.is_empty())
}

/// Installs the global subscriber for the binary `service` (`service.name` on every span): logs as
/// `process` says, and — when [`exporting`] — Kiln's spans exported by OTLP/gRPC through a batch
/// processor. Must run inside a Tokio runtime (the exporter's channel is a Tokio task).
pub fn init(service: &'static str, process: Process) -> Result<Telemetry, TelemetryError> {
    let (provider, held) = match exporting() {
        true => {
            let (provider, held) = provider(service, process)?;
            (Some(provider), held)
        }
        false => (None, None),
    };
    if process == Process::Command && provider.is_none() {
        // Nothing would consume a span or an event: no subscriber at all, so none is even built.
        return Ok(Telemetry { provider, held });
    }
    // The log lines stay what they were before spans existed: events only, as RUST_LOG says
    // (`info` by default — an agent that cannot reach its coordinator must be heard unasked).
    // The events-only filter claims no level, so RUST_LOG alone sets the level `log` records pass.
    let stderr = (process == Process::Server).then(|| {
        let env = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
        let events_only = filter_fn(|meta| meta.is_event()).with_max_level_hint(LevelFilter::TRACE);
        tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_filter(env.and(events_only))
    });
    // Kiln's own spans and events only: the libraries' (tonic, h2, hyper) would bury a converge.
    let traces = provider.as_ref().map(|provider| {
        let kiln = Targets::new().with_target("kiln", LevelFilter::INFO);
        tracing_opentelemetry::layer().with_tracer(provider.tracer(service)).with_filter(kiln)
    });
    tracing_subscriber::registry().with(stderr).with(traces).init();
    Ok(Telemetry { provider, held })
}

/// The provider, and for a command the spans it holds until exit.
fn provider(
    service: &'static str,
    process: Process,
) -> Result<(SdkTracerProvider, Option<command::Held>), TelemetryError> {
    use opentelemetry_otlp::WithTonicConfig;
    let mut exporter = opentelemetry_otlp::SpanExporter::builder().with_tonic();
    if process == Process::Command {
        exporter = exporter.with_retry_policy(opentelemetry_otlp::RetryPolicy::disabled());
    }
    let exporter = exporter
        .build()
        .map_err(|err| TelemetryError::Exporter { endpoint: std::env::var(ENDPOINT_VAR).unwrap_or_default(), err })?;
    let resource = Resource::builder().with_service_name(service).build();
    let builder = SdkTracerProvider::builder().with_resource(resource.clone());
    Ok(match process {
        Process::Server => (builder.with_batch_exporter(exporter).build(), None),
        Process::Command => {
            let (held, keep) = command::Held::new(exporter, resource);
            (builder.with_span_processor(keep).build(), Some(held))
        }
    })
}

impl Telemetry {
    /// Sends the spans not sent yet and stops the exporter. Call it once the work is done and its
    /// spans closed: the CLI at the end of its command, the servers after their serve loop returns.
    pub async fn shutdown(self) {
        let Some(provider) = self.provider else { return };
        let flushed = match self.held {
            // A command's spans go in one export on this runtime; the provider holds nothing more.
            Some(held) => {
                let sent = held.send(FLUSH_WAIT).await;
                let _ = provider.shutdown();
                sent
            }
            // The batch processor's flush blocks until the batch is sent, while the exporter's
            // channel needs the runtime's threads: off them.
            None => {
                tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(FLUSH_WAIT)).await.unwrap_or(Ok(()))
            }
        };
        if let Err(err) = flushed {
            tracing::warn!(error = %err, "the last spans may not have reached the collector");
        }
    }
}
