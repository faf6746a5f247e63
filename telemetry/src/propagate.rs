//! W3C trace context across Kiln's processes. A caller puts its current span's `traceparent` in
//! the gRPC metadata of every call ([`inject`]); a server makes its request span a child of it
//! ([`follow_headers`]). Tasks travel on an agent's long-lived `Connect` stream, whose metadata was
//! sent once, so each `Task` carries its span's [`traceparent`] as a field, which the agent
//! [`follow`]s.
//!
//! Without the OpenTelemetry layer (tracing off) nothing is injected and nothing is parsed.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use std::collections::HashMap;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C header: `00-<trace id>-<parent span id>-<flags>`.
pub const TRACEPARENT: &str = "traceparent";

/// Adds the current span's trace context to outgoing gRPC metadata.
pub fn inject(metadata: &mut tonic::metadata::MetadataMap) {
    let cx = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&cx, &mut MetadataInjector(metadata));
}

/// `span`'s `traceparent`, for a message that carries it (`Task.traceparent`); empty when the span
/// is not traced.
pub fn traceparent(span: &tracing::Span) -> String {
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    carrier.remove(TRACEPARENT).unwrap_or_default()
}

/// Makes `span` — not yet entered — a child of the remote span whose `traceparent` the request
/// headers carry. A request without one (or a malformed one) leaves `span` where it was.
pub fn follow_headers(span: &tracing::Span, headers: &http::HeaderMap) {
    if span.is_disabled() || !headers.contains_key(TRACEPARENT) {
        return;
    }
    adopt(span, &HeaderExtractor(headers));
}

/// Makes `span` — not yet entered — a child of the remote span `traceparent` names; an empty or
/// malformed one (a coordinator that does not trace) leaves `span` where it was.
pub fn follow(span: &tracing::Span, traceparent: &str) {
    if span.is_disabled() || traceparent.is_empty() {
        return;
    }
    adopt(span, &HashMap::from([(TRACEPARENT.to_string(), traceparent.to_string())]));
}

fn adopt(span: &tracing::Span, carrier: &dyn Extractor) {
    use opentelemetry::trace::TraceContextExt;
    let cx = TraceContextPropagator::new().extract(carrier);
    if cx.span().span_context().is_valid() {
        // Fails only when the span is already started or not traced: then it keeps its own parent.
        let _ = span.set_parent(cx);
    }
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        // An empty `tracestate` says nothing; a value no header may carry is dropped, never sent.
        if value.is_empty() {
            return;
        }
        if let (Ok(key), Ok(value)) = (tonic::metadata::MetadataKey::from_bytes(key.as_bytes()), value.parse()) {
            self.0.insert(key, value);
        }
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
    use tracing_subscriber::layer::SubscriberExt;

    /// Spans traced by an SDK provider that exports nowhere: ids are made, nothing leaves.
    fn traced() -> impl tracing::Subscriber + Send + Sync {
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")))
    }

    fn ids(span: &tracing::Span) -> (String, String) {
        let cx = span.context();
        let context = cx.span().span_context().clone();
        (context.trace_id().to_string(), context.span_id().to_string())
    }

    #[test]
    fn a_task_span_that_follows_a_traceparent_joins_its_trace() {
        tracing::subscriber::with_default(traced(), || {
            let task = tracing::info_span!("task");
            let carried = traceparent(&task);
            let (trace, parent) = ids(&task);
            assert_eq!(carried, format!("00-{trace}-{parent}-01"));
            let build = tracing::info_span!(parent: None, "build");
            follow(&build, &carried);
            assert_eq!(ids(&build).0, trace, "the agent's span is in the coordinator's trace");
            assert_ne!(ids(&build).1, parent, "and a span of its own");
        });
    }

    #[test]
    fn a_call_carries_the_current_span_and_the_server_span_follows_its_headers() {
        tracing::subscriber::with_default(traced(), || {
            let command = tracing::info_span!("kiln up");
            let mut metadata = tonic::metadata::MetadataMap::new();
            command.in_scope(|| inject(&mut metadata));
            let headers = metadata.into_headers();
            assert!(!headers.contains_key("tracestate"), "an empty tracestate is not sent");
            let rpc = tracing::info_span!(parent: None, "rpc");
            follow_headers(&rpc, &headers);
            assert_eq!(ids(&rpc).0, ids(&command).0);
        });
    }

    #[test]
    fn a_missing_or_malformed_traceparent_leaves_the_span_its_own_root() {
        tracing::subscriber::with_default(traced(), || {
            for carried in ["", "00-zz-zz-01", "garbage"] {
                let span = tracing::info_span!(parent: None, "build");
                follow(&span, carried);
                assert_eq!(ids(&span).0.len(), 32, "{carried:?}: a trace of its own");
            }
            let mut metadata = tonic::metadata::MetadataMap::new();
            inject(&mut metadata);
            assert!(metadata.is_empty(), "outside any span nothing is injected");
        });
    }

    #[test]
    fn without_the_opentelemetry_layer_nothing_is_carried() {
        let span = tracing::info_span!("task");
        assert_eq!(traceparent(&span), "");
        let mut metadata = tonic::metadata::MetadataMap::new();
        span.in_scope(|| inject(&mut metadata));
        assert!(metadata.is_empty());
    }
}
