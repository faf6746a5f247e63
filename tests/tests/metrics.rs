//! `/metrics` on the coordinator (`--http`) and the agent (`--metrics`), scraped over real HTTP
//! around real converges (Docker, a real registry) and read with an exposition-format parser:
//! every counter moves by what the converge did, no more.

use kiln_e2e::fixture::{example, reference, remove_built, unique, write};
use kiln_e2e::wire::up;
use kiln_e2e::{Farm, Registry};
use kiln_proto::v1 as pb;
use prometheus_parse::{Scrape, Value};
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One GET over HTTP/1.0 (the server closes after answering): the content type and the body.
async fn get(addr: SocketAddr, accept: &str) -> (String, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\nAccept: {accept}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP response: {response}"));
    assert!(head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"), "{head}");
    let content_type = head
        .lines()
        .find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case("content-type")))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_default();
    (content_type, body.to_string())
}

/// The endpoint as Prometheus's classic text format, parsed.
async fn scrape(addr: SocketAddr) -> Scrape {
    let (content_type, body) = get(addr, "text/plain").await;
    assert!(content_type.starts_with("text/plain; version=0.0.4"), "{content_type}");
    Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).unwrap()
}

/// The sum of `metric`'s series whose labels include `labels` (0 when there is none yet: a
/// family shows a series only once it was touched).
fn value(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
            Value::Histogram(_) | Value::Summary(_) => panic!("{metric} is a histogram's buckets; read _count"),
        })
        .sum()
}

/// How far `metric` moved between two scrapes.
fn moved(before: &Scrape, after: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    value(after, metric, labels) - value(before, metric, labels)
}

fn succeeded(events: &[pb::ConvergeEvent]) -> bool {
    events.last().is_some_and(|e| e.outcome() == pb::Outcome::Succeeded)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_converge_and_its_no_op_move_each_counter_by_what_they_did() {
    let registry = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("registry", tmp.path(), "reg", &unique("metrics"), Some(&registry.addr));
    let mut farm = Farm::start_observed(&tmp.path().join("home")).await;
    let (coordinator, agent) = (farm.coordinator_metrics.unwrap(), farm.agent_metrics.unwrap());
    let target = format!("registry:{}", registry.addr);
    let up_ok = [("kind", "up"), ("outcome", "succeeded")];
    let (c0, a0) = (scrape(coordinator).await, scrape(agent).await);

    // Two images built, uploaded and pushed.
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let (c1, a1) = (scrape(coordinator).await, scrape(agent).await);
    assert_eq!(moved(&c0, &c1, "kiln_converges_total", &up_ok), 1.0);
    assert_eq!(moved(&c0, &c1, "kiln_converge_duration_seconds_count", &up_ok), 1.0);
    assert_eq!(moved(&c0, &c1, "kiln_builds_total", &[("reason", "built")]), 2.0);
    assert_eq!(moved(&c0, &c1, "kiln_builds_total", &[]), 2.0, "nothing rebuilt for another reason");
    assert_eq!(moved(&c0, &c1, "kiln_skips_total", &[]), 0.0);
    assert_eq!(moved(&c0, &c1, "kiln_dispatch_latency_seconds_count", &[]), 2.0, "one slot per build");
    assert!(moved(&c0, &c1, "kiln_uploaded_bytes_total", &[]) > 0.0, "both contexts were uploaded");
    assert!(moved(&c0, &c1, "kiln_delivered_bytes_total", &[("target", &target)]) > 0.0, "both were pushed");
    assert_eq!(moved(&c0, &c1, "kiln_state_call_duration_seconds_count", &[("method", "write_record")]), 1.0);
    assert_eq!(moved(&c0, &c1, "kiln_state_call_duration_seconds_count", &[("method", "claim")]), 1.0);
    assert_eq!(moved(&c0, &c1, "kiln_state_call_duration_seconds_count", &[("method", "release_claims")]), 1.0);
    // Nothing recorded yet: the host is listed once, for images of this farm already there.
    assert_eq!(moved(&c0, &c1, "kiln_host_listing_duration_seconds_count", &[]), 1.0);
    let owners: Vec<_> = c1.samples.iter().filter(|s| s.metric == "kiln_converges_total").collect();
    assert!(owners.iter().all(|s| s.labels.get("owner").is_some_and(|o| !o.is_empty())), "{owners:#?}");
    assert_eq!(moved(&a0, &a1, "kiln_agent_build_duration_seconds_count", &[("outcome", "built")]), 2.0);
    assert_eq!(moved(&a0, &a1, "kiln_agent_build_duration_seconds_count", &[("outcome", "failed")]), 0.0);

    // The same again: both recorded, confirmed in the registry, nothing built, sent or uploaded.
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let (c2, a2) = (scrape(coordinator).await, scrape(agent).await);
    assert_eq!(moved(&c0, &c2, "kiln_converges_total", &up_ok), 2.0);
    assert_eq!(moved(&c1, &c2, "kiln_skips_total", &[("reason", "recorded")]), 2.0);
    assert_eq!(moved(&c1, &c2, "kiln_skips_total", &[]), 2.0);
    assert_eq!(moved(&c1, &c2, "kiln_builds_total", &[]), 0.0);
    assert_eq!(moved(&c1, &c2, "kiln_dispatch_latency_seconds_count", &[]), 0.0);
    assert_eq!(moved(&c1, &c2, "kiln_uploaded_bytes_total", &[]), 0.0);
    assert_eq!(moved(&c1, &c2, "kiln_delivered_bytes_total", &[]), 0.0);
    assert_eq!(moved(&c1, &c2, "kiln_state_call_duration_seconds_count", &[("method", "write_record")]), 0.0);
    // Every ref is the record's, so a root already: nothing claimed, nothing to release.
    assert_eq!(moved(&c1, &c2, "kiln_state_call_duration_seconds_count", &[("method", "claim")]), 0.0);
    assert_eq!(moved(&c1, &c2, "kiln_state_call_duration_seconds_count", &[("method", "release_claims")]), 0.0);
    // Confirmed by the registry's manifests alone, and stored in one write.
    assert_eq!(moved(&c1, &c2, "kiln_host_listing_duration_seconds_count", &[]), 0.0);
    assert_eq!(moved(&c1, &c2, "kiln_state_call_duration_seconds_count", &[("method", "settle_converge")]), 1.0);
    assert_eq!(moved(&c1, &c2, "kiln_state_call_duration_seconds_count", &[("method", "open_converge_with")]), 0.0);
    assert_eq!(moved(&a1, &a2, "kiln_agent_build_duration_seconds_count", &[]), 0.0);

    // What is true now, read at the scrape: the farm is idle, its claims released.
    assert_eq!(value(&c2, "kiln_agents_connected", &[("role", "host")]), 1.0);
    assert_eq!(value(&c2, "kiln_build_slots", &[]), 1.0);
    assert_eq!(value(&c2, "kiln_build_slots_busy", &[]), 0.0);
    assert_eq!(value(&c2, "kiln_queue_depth", &[]), 0.0);
    assert_eq!(value(&c2, "kiln_claims_live", &[]), 0.0);
    assert_eq!(value(&a2, "kiln_agent_build_slots", &[]), 1.0);
    assert_eq!(value(&a2, "kiln_agent_build_slots_busy", &[]), 0.0);
    // The daemon is shared with other tests: at least this farm's two images are Kiln's there.
    let store = [("store", "docker@e2e-agent")];
    assert!(value(&a2, "kiln_agent_store_images", &store) >= 2.0, "{:#?}", a2.samples);
    assert!(value(&a2, "kiln_agent_store_bytes", &store) > 0.0);

    // One file of web changes: web alone is built, and its old tag swept from the host.
    let old_web = reference(&dir, "web");
    write(&dir, "web/index.html", "<p>edited</p>\n");
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let c3 = scrape(coordinator).await;
    assert_eq!(moved(&c2, &c3, "kiln_builds_total", &[("reason", "built")]), 1.0);
    assert_eq!(moved(&c2, &c3, "kiln_skips_total", &[("reason", "recorded")]), 1.0, "worker");
    assert_eq!(moved(&c2, &c3, "kiln_host_listing_duration_seconds_count", &[]), 1.0, "web is not recorded");
    assert_eq!(moved(&c2, &c3, "kiln_sweep_removals_total", &store), 1.0, "{old_web} untagged");
    assert_eq!(moved(&c2, &c3, "kiln_sweep_failures_total", &store), 0.0);
    // Bytes freed depend on the layers other tests' images share on this daemon: only present.
    assert!(c3.samples.iter().any(|s| s.metric == "kiln_sweep_freed_bytes_total" && s.labels.get("store").is_some()));
    assert_eq!(moved(&c2, &c3, "kiln_state_call_duration_seconds_count", &[("method", "claim")]), 1.0);

    // A recorded image deleted from the registry outside Kiln: its ref is still the record's,
    // but the converge has something to deliver, so it claims before it pushes again.
    let worker = reference(&dir, "worker");
    let (repo, tag) = worker.trim_start_matches(&format!("{}/", registry.addr)).rsplit_once(':').unwrap();
    registry.delete_tag(repo, tag);
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let c4 = scrape(coordinator).await;
    let pushed = events.iter().any(|e| e.kind() == pb::converge_event::Kind::Pushed && e.image == "worker");
    assert!(pushed, "pushed again: {events:#?}");
    assert_eq!(moved(&c3, &c4, "kiln_state_call_duration_seconds_count", &[("method", "claim")]), 1.0);
    assert_eq!(moved(&c3, &c4, "kiln_state_call_duration_seconds_count", &[("method", "release_claims")]), 1.0);

    // A scraper asking for OpenMetrics (Prometheus does) gets it.
    let (content_type, body) = get(coordinator, "application/openmetrics-text;version=1.0.0,text/plain;q=0.5").await;
    assert!(content_type.starts_with("application/openmetrics-text"), "{content_type}");
    assert!(body.ends_with("# EOF\n"), "{body}");
    farm.stop().await;
    remove_built(&dir);
}
