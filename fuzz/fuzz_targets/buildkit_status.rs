//! Arbitrary bytes into the BuildKit status decoder: the agent's reader of a daemon's answer to
//! `POST /build?version=2` (HTTP status line and headers, Docker's JSON lines, base64 protobuf
//! `StatusResponse` trace records). No panic; memory bounded (run with `-rss_limit_mb`).
//!
//! The first byte picks how the rest is read. Even: the rest is the daemon's whole answer.
//! Odd: the rest is a run of `StatusResponse` records, each behind a two-byte length, which the
//! target wraps in a `200 OK` answer as trace records, so the protobuf and step bookkeeping get
//! the fuzzer's attention without it having to learn JSON and base64 first.
//!
//! Besides not panicking, the decoder must never invent output: every log line is at most the
//! input's length plus its `#<step> ` prefix.
#![no_main]

use base64::Engine as _;
use kiln_agent::host::buildkit_answer;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let answer = if mode % 2 == 0 { rest.to_vec() } else { trace_answer(rest) };
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    let (outcome, lines) = runtime.block_on(async {
        let read = async move {
            let outcome = buildkit_answer(&answer, &tx).await;
            drop(tx);
            outcome
        };
        let collect = async {
            let mut lines = Vec::new();
            while let Some(line) = rx.recv().await {
                lines.push(line);
            }
            lines
        };
        tokio::join!(read, collect)
    });
    let limit = data.len() * 4 / 3 + 64;
    for line in &lines {
        assert!(line.len() <= limit, "a {}-byte line from {} bytes of input", line.len(), data.len());
    }
    if let Ok(id) = outcome {
        assert!(id.len() <= limit);
    }
});

fn trace_answer(mut records: &[u8]) -> Vec<u8> {
    let mut answer = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n".to_vec();
    while records.len() >= 2 {
        let len = usize::from(u16::from_le_bytes([records[0], records[1]])).min(records.len() - 2);
        let record = &records[2..2 + len];
        records = &records[2 + len..];
        let encoded = base64::engine::general_purpose::STANDARD.encode(record);
        answer.extend_from_slice(format!("{{\"id\":\"moby.buildkit.trace\",\"aux\":\"{encoded}\"}}\n").as_bytes());
    }
    if records.first().is_some_and(|b| b % 2 == 0) {
        answer.extend_from_slice(b"{\"aux\":{\"ID\":\"sha256:feed\"},\"id\":\"moby.image.id\"}\n");
    }
    answer
}
