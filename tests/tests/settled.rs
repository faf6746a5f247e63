//! The settled converge, against the real Docker daemon and a served coordinator on SQLite: a
//! no-op `kiln up` is decided before anything is stored and stored in one write, says what the
//! usual converge says (and `kiln logs` replays it), and anything left to do sends it the usual
//! way, with nothing of the abandoned attempt left in the state.
//!
//! The writes are counted by the coordinator's own `kiln_state_call_duration_seconds` series,
//! scraped over HTTP (one series per state call), and the host listings by
//! `kiln_host_listing_duration_seconds`.

use kiln_e2e::fixture::{example, reference, remove_built, unique};
use kiln_e2e::wire::{self, images_with, succeeded, up};
use kiln_e2e::{docker, Farm};
use kiln_proto::v1 as pb;
use pb::converge_event::Kind;
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How many times the coordinator has made each of the state calls that write a converge —
/// (settle_converge, open_converge_with, append_events, finish_with_events) — and how many host
/// listings it asked for.
async fn converge_writes(addr: SocketAddr) -> [u64; 5] {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\nAccept: text/plain\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let count = |series: String| {
        let series = format!("{series} ");
        response.lines().find_map(|l| l.strip_prefix(series.as_str())).map_or(0, |v| v.trim().parse().unwrap())
    };
    let call = |method: &str| count(format!("kiln_state_call_duration_seconds_count{{method=\"{method}\"}}"));
    let listings = count("kiln_host_listing_duration_seconds_count".to_string());
    [call("settle_converge"), call("open_converge_with"), call("append_events"), call("finish_with_events"), listings]
}

async fn logs(url: &str, converge_id: &str) -> Vec<pb::ConvergeEvent> {
    let mut client = pb::kiln_client::KilnClient::new(wire::channel(url));
    let request = pb::LogsRequest { converge_id: converge_id.to_string(), follow: false };
    let mut stream = client.logs(request).await.unwrap().into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        events.push(event);
    }
    events
}

async fn converges(url: &str, instance: &str) -> Vec<pb::ConvergeSummary> {
    let mut client = pb::kiln_client::KilnClient::new(wire::channel(url));
    client.status(pb::StatusRequest { instance: instance.to_string() }).await.unwrap().into_inner().converges
}

/// What a client and a replay must agree on, event by event.
fn said(events: &[pb::ConvergeEvent]) -> Vec<(u64, i32, String, String, String, i32)> {
    events.iter().map(|e| (e.seq, e.kind, e.image.clone(), e.reference.clone(), e.message.clone(), e.outcome)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_no_op_up_is_one_write_and_replays_as_it_was_told() {
    let tmp = tempfile::tempdir().unwrap();
    let instance = unique("settled");
    let dir = example("hello", tmp.path(), "hello", &instance, None);
    let mut farm = Farm::start_observed(&tmp.path().join("home")).await;
    let metrics = farm.coordinator_metrics.unwrap();

    // The first converge builds: it is opened, logged and finished the usual way.
    let w0 = converge_writes(metrics).await;
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let w1 = converge_writes(metrics).await;
    assert_eq!(w1[0] - w0[0], 0, "a converge that builds is not settled");
    assert_eq!(w1[1] - w0[1], 1, "it is opened");
    assert_eq!(w1[3] - w0[3], 1, "and finished");

    // The no-op: both images recorded and on the daemon, stored in one write and no other.
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Recorded), vec!["web", "worker"], "{events:#?}");
    assert_eq!(events.first().map(|e| e.kind()), Some(Kind::Started));
    let finished = events.last().unwrap();
    assert_eq!(finished.kind(), Kind::Finished);
    assert!(finished.message.contains("unchanged at generation 1"), "{finished:?}");
    assert_eq!(farm.builds(), 2, "nothing was built");
    let w2 = converge_writes(metrics).await;
    assert_eq!(w2[0] - w1[0], 1, "stored by settle_converge");
    assert_eq!([w2[1] - w1[1], w2[2] - w1[2], w2[3] - w1[3]], [0, 0, 0], "and by no other converge write");
    assert_eq!(w2[4] - w1[4], 1, "presence on the daemon confirmed by one listing");
    // What the client was told is what was stored: `kiln logs` replays it event for event.
    let settled_id = finished.converge_id.clone();
    assert!(events.iter().all(|e| e.converge_id == settled_id));
    assert_eq!(said(&logs(&farm.url, &settled_id).await), said(&events));
    let listed = converges(&farm.url, &instance).await;
    let summary = listed.iter().find(|c| c.id == settled_id).expect("the settled converge is listed");
    assert_eq!(summary.outcome(), pb::Outcome::Succeeded);
    assert!(summary.finished_ms >= summary.started_ms && summary.finished_ms > 0, "{summary:?}");

    // An image gone from the daemon: the settled converge gives up before writing, and the usual
    // one rebuilds it and records a new generation.
    docker::remove(&reference(&dir, "web"));
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Built), vec!["web"], "{events:#?}");
    assert_eq!(images_with(&events, Kind::Recorded), vec!["worker"], "{events:#?}");
    let w3 = converge_writes(metrics).await;
    assert_eq!(w3[0] - w2[0], 0, "no settled converge was stored");
    assert_eq!(w3[1] - w2[1], 1, "the converge was opened the usual way");
    assert_eq!(converges(&farm.url, &instance).await.len(), 3, "nothing of the abandoned attempt is listed");

    // `--force` goes the usual way at once: one listing, as before there was a settled converge.
    let events = up(&farm.url, &dir, true).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Built), vec!["web", "worker"], "{events:#?}");
    let w4 = converge_writes(metrics).await;
    assert_eq!([w4[0] - w3[0], w4[1] - w3[1], w4[4] - w3[4]], [0, 1, 1], "settled, opened, listings");
    farm.stop().await;
    remove_built(&dir);
}
