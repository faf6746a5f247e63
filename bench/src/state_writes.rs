//! `kiln-bench state-writes`: the coordinator's SQLite state under a farm's burst of converges —
//! N at once, each opening its converge, claiming its refs, appending its events one by one,
//! writing its record and finishing — with group commit (calls that queue during a commit share
//! the next transaction) against a transaction per call, the store as it was before. Both keep
//! `synchronous = FULL`: nobody hears "done" before the disk has it.
//!
//! Beside it, what a no-op converge waits for during such a burst: one instance's record read
//! over and over while the burst runs, with reads on connections of their own against reads sent
//! through the writer (queued behind its group commits, as before).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use kiln_coordinator::model::{ConvergeState, EventKind};
use kiln_coordinator::state::{SqliteStore, StateStore, SystemClock};

use crate::util::{self, Contestant};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Converges running at once.
    #[arg(long, default_value_t = 200)]
    converges: usize,
    /// Events each converge appends, one call each.
    #[arg(long, default_value_t = 10)]
    events: usize,
    /// Measured runs per contestant (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
}

const GROUPED: usize = 256;

/// One burst on a fresh database; how long until every converge finished.
fn burst(rt: &tokio::runtime::Runtime, args: &Args, group: usize) -> Result<Duration> {
    let dir = util::scratch_dir("kiln-bench-state-")?;
    let store = SqliteStore::open_grouped(dir.path().join("kiln.db"), Arc::new(SystemClock), group)?;
    let store: Arc<dyn StateStore> = Arc::new(store);
    let events = args.events;
    rt.block_on(async {
        let started = Instant::now();
        let mut running = tokio::task::JoinSet::new();
        for i in 0..args.converges {
            let store = store.clone();
            running.spawn(async move { one_converge(&*store, i, events).await });
        }
        while let Some(done) = running.join_next().await {
            done??;
        }
        Ok(started.elapsed())
    })
}

async fn one_converge(store: &dyn StateStore, i: usize, events: usize) -> Result<()> {
    let instance = format!("inst{i:04}");
    let converge = store.open_converge(&instance, "bench").await?;
    let refs: Vec<String> = (0..5).map(|n| format!("{instance}-img{n}:0123456789ab-amd64")).collect();
    store.claim(&converge.id, &refs, u64::MAX / 2).await?;
    for n in 0..events {
        store.append_event(&converge.id, EventKind::Note, Some("img0"), &format!("event {n}")).await?;
    }
    store.finish_converge(&converge.id, ConvergeState::Succeeded).await?;
    store.release_claims(&converge.id).await?;
    Ok(())
}

/// One burst (group commit) with a reader asking for one record again and again until the burst
/// ends; the reads' latencies, sorted.
fn reads_during_burst(rt: &tokio::runtime::Runtime, args: &Args, through_writer: bool) -> Result<Vec<Duration>> {
    let dir = util::scratch_dir("kiln-bench-state-")?;
    let path = dir.path().join("kiln.db");
    let store = match through_writer {
        true => SqliteStore::open_reading_through_writer(&path, Arc::new(SystemClock))?,
        false => SqliteStore::open_grouped(&path, Arc::new(SystemClock), GROUPED)?,
    };
    let store: Arc<dyn StateStore> = Arc::new(store);
    let events = args.events;
    rt.block_on(async {
        store.write_record("probe", None, Vec::new()).await?;
        let mut running = tokio::task::JoinSet::new();
        for i in 0..args.converges {
            let store = store.clone();
            running.spawn(async move { one_converge(&*store, i, events).await });
        }
        let mut latencies = Vec::new();
        while !running.is_empty() {
            let asked = Instant::now();
            store.record("probe").await?.ok_or_else(|| anyhow::anyhow!("the probe's record is gone"))?;
            latencies.push(asked.elapsed());
            while let Some(done) = running.try_join_next() {
                done??;
            }
        }
        latencies.sort();
        Ok(latencies)
    })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    util::percentile(sorted, p).unwrap_or_default()
}

pub fn run(args: &Args) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut contestants = vec![
        Contestant::new("group commit", || burst(&rt, args, GROUPED)),
        Contestant::new("a transaction per call (before)", || burst(&rt, args, 1)),
    ];
    util::rounds(&mut contestants, args.runs, 1, || Ok(()))?;
    let calls = args.converges * (args.events + 4);
    println!("## The SQLite state under a burst of converges\n");
    println!(
        "{} converges at once, each: open, claim 5 refs, {} events one call each, finish, release — {calls} calls; {} runs each, medians.",
        args.converges, args.events, args.runs
    );
    util::print_table("state writes", &contestants);
    let ratio = contestants[1].median().as_secs_f64() / contestants[0].median().as_secs_f64();
    println!("\n- group commit is {ratio:.1}× faster than a transaction per call");

    // p50 and p99 of each run's reads; each contestant's runs report their p99.
    let p50s = std::cell::RefCell::new([Vec::new(), Vec::new()]);
    let read = |through_writer: bool| -> Result<Duration> {
        let latencies = reads_during_burst(&rt, args, through_writer)?;
        p50s.borrow_mut()[usize::from(through_writer)].push(percentile(&latencies, 0.50));
        Ok(percentile(&latencies, 0.99))
    };
    let mut readers = vec![
        Contestant::new("a record read during the burst, p99: reads beside the writer", || read(false)),
        Contestant::new("a record read during the burst, p99: reads through the writer (before)", || read(true)),
    ];
    util::rounds(&mut readers, args.runs, 1, || Ok(()))?;
    println!();
    util::print_table("reads during a burst", &readers);
    let p50s = p50s.borrow();
    let (beside, through) = (util::median(&p50s[0]), util::median(&p50s[1]));
    let ratio = readers[1].median().as_secs_f64() / readers[0].median().as_secs_f64();
    println!("\n- p50 of a read during the burst: {beside:.2?} beside the writer, {through:.2?} through it");
    println!("- p99: reads beside the writer are {ratio:.1}× faster");
    Ok(())
}
