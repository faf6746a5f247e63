//! `kiln-bench state-writes`: the coordinator's SQLite state under a farm's burst of converges —
//! N at once, each opening its converge, claiming its refs, appending its events one by one,
//! writing its record and finishing — with group commit (calls that queue during a commit share
//! the next transaction) against a transaction per call, the store as it was before. Both keep
//! `synchronous = FULL`: nobody hears "done" before the disk has it.

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
    Ok(())
}
