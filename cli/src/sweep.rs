//! The sweep's commands: `kiln gc [--dry-run] [--instance NAME]`, `kiln down [DIR]`, and
//! `kiln pin` / `kiln unpin` / `kiln pins`. Like `up`, gc and down stream a converge's events
//! through the same renderers; the sweep itself — what is garbage, what goes — is the
//! coordinator's. Neither asks for confirmation: by construction they remove only what this farm
//! built and nothing a root names (DESIGN.md "Reachability").

use std::collections::BTreeMap;
use std::path::PathBuf;

use kiln_core::manifest::Manifest;
use kiln_proto::v1::kiln_client::KilnClient;
use kiln_proto::v1::{ConvergeEvent, DownRequest, GcRequest, PinRequest, PinsReply, PinsRequest};
use serde::Serialize;
use tonic::Streaming;

use crate::connect::{self, Kind, Link};
use crate::embedded::with_coordinator;
use crate::error::CliError;
use crate::event::{Event, EventKind};
use crate::query::ListArgs;
use crate::render::{human_bytes, renderer, OutputMode, Render};
use crate::up::UpOutcome;
use crate::view::table;
use crate::Connect;

/// `kiln gc`.
#[derive(Clone, Debug, Default)]
pub struct GcArgs {
    /// Print the plan, remove nothing.
    pub dry_run: bool,
    /// Remove only images labeled with this instance.
    pub instance: Option<String>,
    pub connect: Connect,
    pub output: OutputMode,
}

/// `kiln down [DIR]`.
#[derive(Clone, Debug)]
pub struct DownArgs {
    /// The instance folder whose `kiln.toml` names the instance to take down.
    pub dir: PathBuf,
    pub connect: Connect,
    pub output: OutputMode,
}

/// `kiln pin <ref>` and `kiln unpin <ref>`.
#[derive(Clone, Debug, Default)]
pub struct PinArgs {
    pub reference: String,
    pub connect: Connect,
    pub output: OutputMode,
}

/// How a gc or down ended, and what it removed (or, for a dry run, would remove) per store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SweepOutcome {
    /// The converge the job ran as: its events, outcome and exit code.
    pub run: UpOutcome,
    /// From its `Planned` events (a dry run) or `Removed` events, in store order.
    pub stores: Vec<StoreSweep>,
}

/// One store's part of a sweep.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StoreSweep {
    pub store: String,
    /// By owner: an instance, `shared` or `unowned`.
    pub owners: BTreeMap<String, OwnerSweep>,
    /// Refs the sweep meant to remove and did not, with why.
    pub not_removed: Vec<(String, String)>,
}

/// One owner's images in one store's sweep.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OwnerSweep {
    pub refs: Vec<String>,
    /// Freed (or, for a dry run, to be freed).
    pub bytes: u64,
}

/// One pin as `kiln pins` lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PinView {
    pub reference: String,
    pub pinned_at_ms: u64,
    pub pinned_by: String,
}

/// What pin or unpin changed, and every pin after it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PinsView {
    pub changed: bool,
    pub pins: Vec<PinView>,
}

impl SweepOutcome {
    /// Groups the sweep's `Planned` or `Removed` (and `NotRemoved`) events by store and owner.
    pub fn from_run(run: UpOutcome) -> SweepOutcome {
        let mut stores: BTreeMap<String, StoreSweep> = BTreeMap::new();
        for event in &run.events {
            let store = || StoreSweep { store: event.store.clone(), ..StoreSweep::default() };
            match event.kind {
                EventKind::Planned | EventKind::Removed => {
                    let owner =
                        stores.entry(event.store.clone()).or_insert_with(store).owners.entry(event.instance.clone());
                    let owner = owner.or_default();
                    owner.refs.push(event.reference.clone());
                    owner.bytes += event.bytes;
                }
                EventKind::NotRemoved => stores
                    .entry(event.store.clone())
                    .or_insert_with(store)
                    .not_removed
                    .push((event.reference.clone(), event.message.clone())),
                _ => {}
            }
        }
        SweepOutcome { run, stores: stores.into_values().collect() }
    }

    /// Every ref removed (or planned), sorted: what a dry run and the gc after it must agree on.
    pub fn refs(&self) -> Vec<String> {
        let mut refs: Vec<String> =
            self.stores.iter().flat_map(|s| s.owners.values()).flat_map(|o| o.refs.iter().cloned()).collect();
        refs.sort();
        refs
    }
}

/// A sweep's plan (or result) as text: per store, a row per owner with its images and bytes.
pub fn sweep_text(stores: &[StoreSweep], dry_run: bool) -> String {
    let verb = if dry_run { "would free" } else { "freed" };
    if stores.iter().all(|s| s.owners.is_empty()) {
        return if dry_run { "nothing to sweep\n".to_string() } else { String::new() };
    }
    let mut out = String::new();
    for store in stores.iter().filter(|s| !s.owners.is_empty()) {
        let total: u64 = store.owners.values().map(|o| o.bytes).sum();
        out.push_str(&format!("store {}: {verb} {}\n", store.store, human_bytes(total)));
        let rows = store.owners.iter().map(|(owner, o)| {
            vec![owner.clone(), format!("{} ref(s)", o.refs.len()), human_bytes(o.bytes), o.refs.join(" ")]
        });
        out.push_str(&table(rows, "  "));
    }
    out
}

/// `kiln gc`, showing events as `args.output` says; a dry run then prints its plan per store.
pub async fn gc(args: GcArgs) -> Result<SweepOutcome, CliError> {
    let mut render = renderer(args.output);
    let outcome = gc_with(&args, render.as_mut()).await;
    render.finish().map_err(CliError::Output)?;
    let outcome = outcome?;
    if args.dry_run && matches!(args.output, OutputMode::Auto | OutputMode::Plain) {
        print!("{}", sweep_text(&outcome.stores, true));
    }
    Ok(outcome)
}

/// [`gc`] through `render`.
pub async fn gc_with(args: &GcArgs, render: &mut dyn Render) -> Result<SweepOutcome, CliError> {
    let request = GcRequest {
        dry_run: args.dry_run,
        instance: args.instance.clone().unwrap_or_default(),
        requested_by: crate::home::requested_by(),
    };
    with_coordinator(&args.connect, true, |link| async move {
        let client = KilnClient::new(link.channel.clone());
        // A gc is an action: re-sent only when it never reached the coordinator.
        let response = connect::call(&link, "Gc", Kind::Action, || {
            let (mut client, request) = (client.clone(), request.clone());
            async move { client.gc(request).await }
        })
        .await?;
        follow(&link, "Gc", response.into_inner(), render).await
    })
    .await
}

/// `kiln down [DIR]`: the instance its `kiln.toml` names loses its record, then the farm sweeps.
pub async fn down(args: DownArgs) -> Result<SweepOutcome, CliError> {
    let mut render = renderer(args.output);
    let outcome = down_with(&args, render.as_mut()).await;
    render.finish().map_err(CliError::Output)?;
    outcome
}

/// [`down`] through `render`.
pub async fn down_with(args: &DownArgs, render: &mut dyn Render) -> Result<SweepOutcome, CliError> {
    let dir = args.dir.clone();
    let manifest = tokio::task::spawn_blocking(move || Manifest::load(&dir))
        .await
        .map_err(|_| CliError::Panicked { what: "manifest" })??;
    let request = DownRequest { instance: manifest.instance, requested_by: crate::home::requested_by() };
    with_coordinator(&args.connect, true, |link| async move {
        let client = KilnClient::new(link.channel.clone());
        let response = connect::call(&link, "Down", Kind::Action, || {
            let (mut client, request) = (client.clone(), request.clone());
            async move { client.down(request).await }
        })
        .await?;
        follow(&link, "Down", response.into_inner(), render).await
    })
    .await
}

/// Shows a job's events until its `Finished`.
async fn follow(
    link: &Link,
    call: &'static str,
    mut stream: Streaming<ConvergeEvent>,
    render: &mut dyn Render,
) -> Result<SweepOutcome, CliError> {
    let mut events: Vec<Event> = Vec::new();
    loop {
        let event = match stream.message().await {
            Ok(Some(wire)) => Event::from(wire),
            Ok(None) => {
                let converge_id = events.first().map_or("(not started)".to_string(), |e| e.converge_id.clone());
                return Err(CliError::StreamEnded { at: link.at.clone(), converge_id });
            }
            Err(status) => {
                let converge_id = events.first().map_or("(not started)".to_string(), |e| e.converge_id.clone());
                return Err(connect::broke(link, call, &converge_id, status));
            }
        };
        render.event(&event).map_err(CliError::Output)?;
        let finished = event.kind == EventKind::Finished;
        events.push(event);
        if finished {
            return Ok(SweepOutcome::from_run(UpOutcome::from_events(events)));
        }
    }
}

/// `kiln pin <ref>`: keep the ref through every sweep until unpinned.
pub async fn pin(args: PinArgs) -> Result<PinsView, CliError> {
    pin_call(args, true).await
}

/// `kiln unpin <ref>`: let the next sweep take the ref if nothing else keeps it.
pub async fn unpin(args: PinArgs) -> Result<PinsView, CliError> {
    pin_call(args, false).await
}

async fn pin_call(args: PinArgs, pin: bool) -> Result<PinsView, CliError> {
    let request = PinRequest { reference: args.reference.clone(), requested_by: crate::home::requested_by() };
    let call = if pin { "Pin" } else { "Unpin" };
    let view = with_coordinator(&args.connect, false, |link| async move {
        let client = KilnClient::new(link.channel.clone());
        // Pinning twice is pinning once, so a re-sent pin or unpin is harmless: a read's rule.
        let reply = connect::call(&link, call, Kind::Read, || {
            let (mut client, request) = (client.clone(), request.clone());
            async move {
                match pin {
                    true => client.pin(request).await,
                    false => client.unpin(request).await,
                }
            }
        })
        .await?;
        Ok(PinsView::from(reply.into_inner()))
    })
    .await?;
    let word = match (pin, view.changed) {
        (true, true) => "pinned",
        (true, false) => "already pinned",
        (false, true) => "unpinned",
        (false, false) => "was not pinned",
    };
    show_pins(args.output, &view, Some(&format!("{word}: {}", args.reference)))?;
    Ok(view)
}

/// `kiln pins`: every pin.
pub async fn pins(args: ListArgs) -> Result<PinsView, CliError> {
    let view = crate::embedded::with_reader(&args.connect, |link| async move {
        let client = KilnClient::new(link.channel.clone());
        let reply = connect::call(&link, "Pins", Kind::Read, || {
            let mut client = client.clone();
            async move { client.pins(PinsRequest {}).await }
        })
        .await?;
        Ok(PinsView::from(reply.into_inner()))
    })
    .await?;
    show_pins(args.output, &view, None)?;
    Ok(view)
}

impl From<PinsReply> for PinsView {
    fn from(reply: PinsReply) -> PinsView {
        let pins = reply
            .pins
            .into_iter()
            .map(|p| PinView { reference: p.reference, pinned_at_ms: p.pinned_at_ms, pinned_by: p.pinned_by })
            .collect();
        PinsView { changed: reply.changed, pins }
    }
}

/// The pins as text: a headline (what the call changed), then one row per pin.
pub fn pins_text(view: &PinsView, headline: Option<&str>, now_ms: u64) -> String {
    let mut out = headline.map(|h| format!("{h}\n")).unwrap_or_default();
    if view.pins.is_empty() {
        out.push_str("no pins\n");
        return out;
    }
    let rows = view
        .pins
        .iter()
        .map(|p| vec![p.reference.clone(), p.pinned_by.clone(), crate::view::age(now_ms, p.pinned_at_ms)]);
    out.push_str(&table(rows, ""));
    out
}

fn show_pins(mode: OutputMode, view: &PinsView, headline: Option<&str>) -> Result<(), CliError> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let written = match mode {
        OutputMode::Quiet => return Ok(()),
        OutputMode::Json => {
            serde_json::to_writer_pretty(&mut out, view).map_err(std::io::Error::from).and_then(|()| writeln!(out))
        }
        OutputMode::Auto | OutputMode::Plain => out.write_all(pins_text(view, headline, now_ms()).as_bytes()),
    };
    written.and_then(|()| out.flush()).map_err(CliError::Output)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Outcome;

    fn sweep_event(kind: EventKind, store: &str, owner: &str, reference: &str, bytes: u64) -> Event {
        Event {
            store: store.into(),
            instance: owner.into(),
            reference: reference.into(),
            bytes,
            ..Event::new(kind, "", "")
        }
    }

    #[test]
    fn a_plan_is_grouped_by_store_and_owner_with_bytes() {
        let events = vec![
            Event::new(EventKind::Started, "", "gc --dry-run"),
            sweep_event(EventKind::Planned, "docker@b", "shop", "shop-api:1", 1_000_000),
            sweep_event(EventKind::Planned, "docker@a", "shop", "shop-api:2", 2_000_000),
            sweep_event(EventKind::Planned, "docker@a", "shop", "shop-api:3", 0),
            sweep_event(EventKind::Planned, "docker@a", "shared", "base:1", 500_000),
            Event { outcome: Outcome::Succeeded, ..Event::new(EventKind::Finished, "", "") },
        ];
        let outcome = SweepOutcome::from_run(UpOutcome::from_events(events));
        assert_eq!(outcome.refs(), vec!["base:1", "shop-api:1", "shop-api:2", "shop-api:3"]);
        assert_eq!(
            sweep_text(&outcome.stores, true),
            "\
store docker@a: would free 2.5 MB
  shared  1 ref(s)  500.0 kB  base:1
  shop    2 ref(s)  2.0 MB    shop-api:2 shop-api:3
store docker@b: would free 1.0 MB
  shop  1 ref(s)  1.0 MB  shop-api:1
"
        );
    }

    #[test]
    fn an_empty_plan_says_so() {
        assert_eq!(sweep_text(&[], true), "nothing to sweep\n");
        assert_eq!(sweep_text(&[], false), "");
    }

    #[test]
    fn pins_are_listed_one_per_row() {
        let view = PinsView {
            changed: true,
            pins: vec![PinView { reference: "tool:1".into(), pinned_at_ms: 1_000, pinned_by: "ana@box".into() }],
        };
        let text = pins_text(&view, Some("pinned: tool:1"), 90_001_000);
        assert_eq!(text, "pinned: tool:1\ntool:1  ana@box  1 d ago\n");
        let none = PinsView { changed: false, pins: vec![] };
        assert_eq!(pins_text(&none, None, 0), "no pins\n");
    }
}
