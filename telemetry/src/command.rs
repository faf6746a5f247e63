//! A command's spans (`kiln`): held in memory while it runs and sent in one export as it exits, on
//! the command's own runtime. The servers' batch processor would cost a process that lives for a
//! few dozen milliseconds a thread at start, and a blocking hand-off to it at exit — more than its
//! handful of spans.

use opentelemetry::Context;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter as _, SpanProcessor};
use opentelemetry_sdk::Resource;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// The spans ended so far and what sends them.
#[derive(Debug)]
pub(crate) struct Held {
    spans: Arc<Mutex<Vec<SpanData>>>,
    exporter: opentelemetry_otlp::SpanExporter,
    resource: Resource,
}

/// The processor the provider calls as spans end: it only keeps them.
#[derive(Debug)]
pub(crate) struct Keep(Arc<Mutex<Vec<SpanData>>>);

impl SpanProcessor for Keep {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

impl Held {
    /// `resource` is the provider's: the export names the service by it.
    pub(crate) fn new(exporter: opentelemetry_otlp::SpanExporter, resource: Resource) -> (Held, Keep) {
        let spans = Arc::new(Mutex::new(Vec::new()));
        (Held { spans: spans.clone(), exporter, resource }, Keep(spans))
    }

    /// Sends every span ended so far, in one export that may take `within`.
    pub(crate) async fn send(mut self, within: Duration) -> OTelSdkResult {
        let spans = std::mem::take(&mut *self.spans.lock().unwrap_or_else(PoisonError::into_inner));
        if spans.is_empty() {
            return Ok(());
        }
        self.exporter.set_resource(&self.resource);
        let sent = tokio::time::timeout(within, self.exporter.export(spans)).await;
        let _ = self.exporter.shutdown();
        sent.unwrap_or(Err(OTelSdkError::Timeout(within)))
    }
}
