//! The retry ladder driven through `retry` on tokio's paused clock: sleeps climb the rungs inside
//! equal jitter, the window ends the retrying and says what it cost, time spent inside an attempt
//! counts against the window, a fatal failure is never re-sent, and a seed fixes the sleeps.

use std::cell::Cell;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kiln_core::retry::{retry, retry_measured, Attempt, Clock, GaveUp, Ladder, LadderConfig, StopReason};

/// tokio's clock, recording every sleep the retry loop asks for.
#[derive(Default)]
struct PausedClock {
    sleeps: Mutex<Vec<Duration>>,
}

impl Clock for PausedClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    fn sleep(&self, duration: Duration) -> impl Future<Output = ()> + Send {
        self.sleeps.lock().unwrap().push(duration);
        tokio::time::sleep(duration)
    }
}

impl PausedClock {
    fn sleeps(&self) -> Vec<Duration> {
        self.sleeps.lock().unwrap().clone()
    }
}

/// A transport failure the way an attempt would report it.
fn refused(n: u32) -> String {
    format!("connect ECONNREFUSED 10.0.0.7:7070 (attempt {n})")
}

const RUNGS_MS: [u64; 8] = [250, 500, 1000, 2000, 4000, 5000, 5000, 5000];

#[tokio::test(start_paused = true)]
async fn sleeps_climb_the_rungs_within_equal_jitter_until_success() {
    let clock = PausedClock::default();
    let mut ladder = Ladder::new(LadderConfig::default(), 11);
    let calls = Cell::new(0u32);
    let retried = retry_measured(&mut ladder, &clock, || {
        calls.set(calls.get() + 1);
        let n = calls.get();
        async move {
            if n <= 8 {
                Err(Attempt::Retry(refused(n)))
            } else {
                Ok("listing")
            }
        }
    })
    .await
    .unwrap();

    let sleeps = clock.sleeps();
    assert_eq!(sleeps.len(), RUNGS_MS.len());
    for (sleep, rung) in sleeps.iter().zip(RUNGS_MS) {
        let range = Duration::from_millis(rung / 2)..=Duration::from_millis(rung);
        assert!(range.contains(sleep), "{sleep:?} outside {range:?}");
    }
    assert_eq!(retried.value, "listing");
    assert_eq!(retried.attempts, 9);
    assert_eq!(retried.elapsed, sleeps.iter().sum::<Duration>());
    assert_eq!(retried.last.as_deref(), Some(refused(8).as_str()));
    let line = retried.routability_line("agent.list", "10.0.0.7:7070").unwrap();
    assert!(line.starts_with("kiln.routability seat=agent.list attempts=9 ms="), "{line}");
    assert!(line.ends_with(" url=10.0.0.7:7070"), "{line}");
}

#[tokio::test(start_paused = true)]
async fn the_window_ends_retrying_and_reports_what_it_cost() {
    let clock = PausedClock::default();
    let window = Duration::from_secs(90);
    let mut ladder = Ladder::new(LadderConfig::with_window(window), 5);
    let calls = Cell::new(0u32);
    let gave_up: GaveUp<String> = retry(&mut ladder, &clock, || {
        calls.set(calls.get() + 1);
        let n = calls.get();
        async move { Err::<(), _>(Attempt::Retry(refused(n))) }
    })
    .await
    .unwrap_err();

    let sleeps = clock.sleeps();
    assert_eq!(gave_up.reason, StopReason::WindowExhausted);
    assert_eq!(gave_up.attempts, calls.get());
    assert_eq!(gave_up.attempts as usize, sleeps.len() + 1);
    assert_eq!(gave_up.elapsed, sleeps.iter().sum::<Duration>());
    assert!(gave_up.elapsed <= window);
    // It stopped only because a next sleep (at most one 5 s rung) no longer fit.
    assert!(gave_up.elapsed > window - Duration::from_secs(5), "{:?}", gave_up.elapsed);
    assert_eq!(gave_up.last, refused(gave_up.attempts));
    assert_eq!(
        gave_up.to_string(),
        format!(
            "gave up after {} attempt(s) in {} ms (retry window exhausted)",
            gave_up.attempts,
            gave_up.elapsed.as_millis()
        )
    );
    assert_eq!(
        gave_up.routability_line("agent.remove", "10.0.0.7:7070"),
        format!(
            "kiln.routability seat=agent.remove attempts={} ms={} last=\"{}\" url=10.0.0.7:7070",
            gave_up.attempts,
            gave_up.elapsed.as_millis(),
            refused(gave_up.attempts)
        )
    );
}

#[tokio::test(start_paused = true)]
async fn time_spent_inside_attempts_counts_against_the_window() {
    // A dropped SYN: each attempt waits out a 10 s connect timeout before it fails.
    let clock = PausedClock::default();
    let mut ladder = Ladder::new(LadderConfig::default(), 9);
    let gave_up = retry(&mut ladder, &clock, || async {
        tokio::time::sleep(Duration::from_secs(10)).await;
        Err::<(), _>(Attempt::Retry("connect ETIMEDOUT 10.0.0.7:7070"))
    })
    .await
    .unwrap_err();

    let sleeps = clock.sleeps();
    let attempt_time = Duration::from_secs(10) * gave_up.attempts;
    assert_eq!(gave_up.elapsed, attempt_time + sleeps.iter().sum::<Duration>());
    // Nine attempts would be 90 s of timeouts alone, so the window must stop it sooner.
    assert!(gave_up.attempts < 9, "{} attempts", gave_up.attempts);
    assert_eq!(gave_up.reason, StopReason::WindowExhausted);
}

#[tokio::test(start_paused = true)]
async fn a_fatal_failure_is_never_sent_again() {
    let clock = PausedClock::default();
    let mut ladder = Ladder::new(LadderConfig::default(), 1);
    let calls = Cell::new(0u32);
    let gave_up = retry(&mut ladder, &clock, || {
        calls.set(calls.get() + 1);
        let n = calls.get();
        async move {
            if n == 1 {
                Err::<(), _>(Attempt::Retry("connect ECONNREFUSED 10.0.0.7:7070"))
            } else {
                Err(Attempt::Fatal("read ECONNRESET 10.0.0.7:7070"))
            }
        }
    })
    .await
    .unwrap_err();

    assert_eq!(calls.get(), 2);
    assert_eq!(clock.sleeps().len(), 1);
    assert_eq!(gave_up.attempts, 2);
    assert_eq!(gave_up.reason, StopReason::Fatal);
    assert_eq!(gave_up.last, "read ECONNRESET 10.0.0.7:7070");
    assert!(gave_up.to_string().ends_with("(not safe to retry)"));
}

async fn sleeps_with_seed(seed: u64) -> Vec<Duration> {
    let clock = PausedClock::default();
    let mut ladder = Ladder::new(LadderConfig::with_window(Duration::from_secs(60)), seed);
    retry(&mut ladder, &clock, || async { Err::<(), _>(Attempt::Retry("down")) }).await.unwrap_err();
    clock.sleeps()
}

#[tokio::test(start_paused = true)]
async fn the_same_seed_gives_the_same_sleeps() {
    let first = sleeps_with_seed(42).await;
    assert!(first.len() > 10);
    assert_eq!(first, sleeps_with_seed(42).await);
    assert_ne!(first, sleeps_with_seed(43).await);
}
