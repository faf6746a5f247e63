//! `kiln-core`: the pure functions two Kiln processes must agree on, and the planner that decides
//! what a sweep removes. Nothing here talks to a daemon, a socket or a database; the coordinator, the
//! agents and the CLI call these functions and do the I/O around them.
//!
//! Where to start:
//! - [`digest`] — the tree digest of a build context (DESIGN.md "Specs", v2: over each file's content
//!   hash), its stat cache, and its conformance vectors, with [`ignore`] applying `.dockerignore`
//!   exactly as Docker does. Everything else addresses images by this digest.
//! - [`refs`] — image references, their normalization, and the content tag `<repo>:<digest12>-<platforms>`.
//! - [`manifest`] — `kiln.toml`, the instance's images and target.
//! - [`dockerfile`] — a Dockerfile's `FROM` images as Docker reads them, and the rewrite that makes a
//!   built image build FROM its base's content ref.
//! - [`order`] — the order built images build in (bases first), and the cycle that forbids one.
//! - [`archive`] — the canonical context archive: packed byte-identically anywhere, unpacked without
//!   ever writing outside its target, digest re-checked.
//! - [`seal`] — strips where-and-when records from a staged tree before it is hashed.
//! - [`sweep`] — the reachability planner: listings + roots + policy → removals. Property-tested.
//! - [`farm`] — the farm id every image Kiln builds is labeled with.
//! - [`retry`] — the capped backoff ladder every cross-process call uses.
//! - [`duration`] — `90s`, `30m`, `12h`, `30d` as every binary's flags read them.

pub mod archive;
pub mod digest;
pub mod dockerfile;
pub mod duration;
pub mod farm;
pub mod ignore;
pub mod manifest;
pub mod order;
pub mod refs;
pub mod retry;
pub mod seal;
pub mod sweep;

/// An error and its sources on one line: how every Kiln process reports a failure, so a message
/// that crosses the wire keeps its cause (`… : connection refused (os error 111)`).
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// A place in English: 1st, 2nd, 3rd, 4th … 11th, 12th, 13th, 21st — how the coordinator's events
/// and `kiln ps` say a queued task's place.
pub fn ordinal(n: u32) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

#[cfg(test)]
mod ordinal_tests {
    #[test]
    fn teens_take_th() {
        let words: Vec<String> = [1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111].into_iter().map(super::ordinal).collect();
        assert_eq!(words, ["1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th"]);
    }
}
