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
