//! The capped backoff ladder every cross-process call backs off on (DESIGN.md "Talking across the
//! network", ADR-0042): rungs of 250 ms, 500 ms, 1 s, 2 s, 4 s, then 5 s for as long as the window
//! lasts, each sleep drawn from the top half of its rung. The jitter is there because callers
//! arrive together — agents reconnecting after a coordinator restart would otherwise retry and
//! miss in lockstep — and the floor of half a rung is what still holds them off a service that is
//! genuinely down. The window is bounded so that an address that never answers becomes a failure
//! naming that address instead of a hang.
//!
//! [`Ladder`] is pure: the caller says how much time has passed, so tests need no real clock.
//! [`retry`] drives an operation on it through a [`Clock`]; it retries [`Attempt::Retry`] and
//! never [`Attempt::Fatal`], because an action that may have reached the other side must not be
//! sent twice.

use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

/// The shape of a ladder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LadderConfig {
    /// The first rung; each next rung doubles it.
    pub first: Duration,
    /// The highest rung, repeated for as long as the window lasts.
    pub cap: Duration,
    /// How long retrying may go on in total, counted from the first attempt.
    /// [`Duration::MAX`] never gives up (an agent's stream to its coordinator).
    pub window: Duration,
}

impl LadderConfig {
    /// 90 s: kubernetes#88986 measured 63 s and kind#2280 up to 77 s before a new Service answered
    /// (ADR-0042), so a shorter window fails calls that would have succeeded.
    pub const DEFAULT_WINDOW: Duration = Duration::from_secs(90);

    /// The standard ladder with another window.
    pub fn with_window(window: Duration) -> Self {
        LadderConfig { window, ..LadderConfig::default() }
    }

    /// The standard ladder that never gives up.
    pub fn forever() -> Self {
        LadderConfig::with_window(Duration::MAX)
    }
}

impl Default for LadderConfig {
    fn default() -> Self {
        LadderConfig {
            first: Duration::from_millis(250),
            cap: Duration::from_secs(5),
            window: LadderConfig::DEFAULT_WINDOW,
        }
    }
}

/// One caller's position on the ladder.
#[derive(Debug, Clone)]
pub struct Ladder {
    config: LadderConfig,
    rng: fastrand::Rng,
    rung: u32,
}

impl Ladder {
    /// Sleeps are drawn from a generator seeded with `seed`, so the same seed gives the same
    /// sleeps. `first` below 1 ms is raised to 1 ms (a zero rung would spin) and `cap` below
    /// `first` is raised to `first`.
    pub fn new(config: LadderConfig, seed: u64) -> Self {
        let first = config.first.max(Duration::from_millis(1));
        let config = LadderConfig { first, cap: config.cap.max(first), window: config.window };
        Ladder { config, rng: fastrand::Rng::with_seed(seed), rung: 0 }
    }

    pub fn config(&self) -> LadderConfig {
        self.config
    }

    /// The rung the next sleep is drawn from.
    pub fn next_rung(&self) -> Duration {
        // Past 2^31 × first the rung has long been capped; saturate instead of overflowing.
        let factor = 1u32.checked_shl(self.rung).unwrap_or(u32::MAX);
        self.config.first.saturating_mul(factor).min(self.config.cap)
    }

    /// How long to sleep before the next attempt, given the time since the first one began; `None`
    /// when that sleep would end past the window, which means give up. Sleeps are whole
    /// milliseconds (timers have no finer resolution) drawn uniformly from `[rung/2, rung]`.
    pub fn next_sleep(&mut self, elapsed: Duration) -> Option<Duration> {
        let rung = millis(self.next_rung());
        let sleep = Duration::from_millis(self.rng.u64(rung.div_ceil(2)..=rung));
        let ends = elapsed.checked_add(sleep)?;
        if ends > self.config.window {
            return None;
        }
        self.rung = self.rung.saturating_add(1);
        Some(sleep)
    }

    /// How many sleeps the ladder has granted since it was made or reset — the retries so far.
    pub fn attempts(&self) -> u32 {
        self.rung
    }

    /// Back to the first rung, e.g. once a reconnected stream has proved itself. The caller
    /// restarts its own elapsed count; the jitter sequence carries on.
    pub fn reset(&mut self) {
        self.rung = 0;
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Where time comes from, so tests can run the ladder on tokio's paused clock.
pub trait Clock {
    fn now(&self) -> Instant;
    fn sleep(&self, duration: Duration) -> impl Future<Output = ()> + Send;
}

/// What one attempt of an operation came to, when it failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt<E> {
    /// Safe to ask again: an idempotent read that failed, or an action that was never delivered
    /// (the connection was never made).
    Retry(E),
    /// Must not be sent again: an action that may have reached the other side (a reset after the
    /// request left), or an answer that is the other side's word.
    Fatal(E),
}

/// Why [`retry`] stopped without a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The next sleep would have ended past the window.
    WindowExhausted,
    /// The last attempt failed in a way that must not be retried.
    Fatal,
}

/// A call that did not succeed within its window, or failed fatally, with what it cost.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("gave up after {attempts} attempt(s) in {} ms ({})", elapsed.as_millis(), match reason {
    StopReason::WindowExhausted => "retry window exhausted",
    StopReason::Fatal => "not safe to retry",
})]
pub struct GaveUp<E> {
    /// Attempts made, the first included.
    pub attempts: u32,
    /// From the start of the first attempt to the end of the last.
    pub elapsed: Duration,
    pub reason: StopReason,
    /// The last attempt's error.
    #[source]
    pub last: E,
}

impl<E: fmt::Display> GaveUp<E> {
    /// The one-line note ADR-0042 asks for when a retry cost something:
    /// `kiln.routability seat=<call> attempts=<n> ms=<t> last=<errno> url=<addr>`.
    pub fn routability_line(&self, seat: &str, url: &str) -> String {
        routability_line(seat, self.attempts, self.elapsed, &self.last, url)
    }
}

/// A successful call and what it cost to get there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retried<T, E> {
    pub value: T,
    /// Attempts made, the successful one included.
    pub attempts: u32,
    pub elapsed: Duration,
    /// The error of the last failed attempt; `None` when the first attempt succeeded.
    pub last: Option<E>,
}

impl<T, E: fmt::Display> Retried<T, E> {
    /// The routability line, or `None` when the first attempt succeeded and nothing was spent.
    pub fn routability_line(&self, seat: &str, url: &str) -> Option<String> {
        let last = self.last.as_ref()?;
        Some(routability_line(seat, self.attempts, self.elapsed, last, url))
    }
}

fn routability_line(seat: &str, attempts: u32, elapsed: Duration, last: &dyn fmt::Display, url: &str) -> String {
    format!(
        "kiln.routability seat={} attempts={attempts} ms={} last={} url={}",
        field(seat),
        elapsed.as_millis(),
        field(&last.to_string()),
        field(url),
    )
}

/// Quotes a value that would otherwise split the line's `key=value` fields when read back.
fn field(value: &str) -> String {
    if value.is_empty() || value.contains(|c: char| c.is_whitespace() || c == '"' || c == '=') {
        format!("{value:?}")
    } else {
        value.to_owned()
    }
}

/// Runs `op` until it succeeds, fails fatally, or the ladder's window runs out.
pub async fn retry<T, E, F, Fut, C>(ladder: &mut Ladder, clock: &C, op: F) -> Result<T, GaveUp<E>>
where
    C: Clock,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Attempt<E>>>,
{
    retry_measured(ladder, clock, op).await.map(|retried| retried.value)
}

/// [`retry`], also returning what a success cost, for the routability line.
pub async fn retry_measured<T, E, F, Fut, C>(
    ladder: &mut Ladder,
    clock: &C,
    mut op: F,
) -> Result<Retried<T, E>, GaveUp<E>>
where
    C: Clock,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Attempt<E>>>,
{
    let start = clock.now();
    let mut attempts = 0u32;
    let mut last = None;
    loop {
        attempts = attempts.saturating_add(1);
        let outcome = op().await;
        let elapsed = clock.now().saturating_duration_since(start);
        let (error, reason) = match outcome {
            Ok(value) => return Ok(Retried { value, attempts, elapsed, last }),
            Err(Attempt::Fatal(error)) => (error, StopReason::Fatal),
            Err(Attempt::Retry(error)) => match ladder.next_sleep(elapsed) {
                Some(sleep) => {
                    last = Some(error);
                    clock.sleep(sleep).await;
                    continue;
                }
                None => (error, StopReason::WindowExhausted),
            },
        };
        return Err(GaveUp { attempts, elapsed, reason, last: error });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RUNGS_MS: [u64; 7] = [250, 500, 1000, 2000, 4000, 5000, 5000];

    #[test]
    fn each_sleep_is_in_the_top_half_of_its_rung_and_the_rungs_cap_at_5s() {
        for seed in 0..200 {
            let mut ladder = Ladder::new(LadderConfig::forever(), seed);
            for rung in RUNGS_MS {
                let sleep = ladder.next_sleep(Duration::ZERO).unwrap();
                let range = Duration::from_millis(rung / 2)..=Duration::from_millis(rung);
                assert!(range.contains(&sleep), "seed {seed}: {sleep:?} outside {range:?}");
            }
            for _ in 0..100 {
                assert_eq!(ladder.next_rung(), Duration::from_secs(5));
                assert!(ladder.next_sleep(Duration::ZERO).unwrap() <= Duration::from_secs(5));
            }
            assert_eq!(ladder.attempts(), 107);
        }
    }

    #[test]
    fn the_ladder_gives_up_when_the_sleep_would_end_past_the_window() {
        let mut ladder = Ladder::new(LadderConfig::with_window(Duration::from_secs(10)), 7);
        // The first rung sleeps at least 125 ms, which no longer fits.
        assert_eq!(ladder.next_sleep(Duration::from_millis(9_876)), None);
        assert_eq!(ladder.attempts(), 0);
        assert!(ladder.next_sleep(Duration::from_millis(9_750)).is_some());
        assert_eq!(ladder.attempts(), 1);
    }

    #[test]
    fn reset_returns_to_the_first_rung() {
        let mut ladder = Ladder::new(LadderConfig::default(), 3);
        for _ in 0..6 {
            ladder.next_sleep(Duration::ZERO).unwrap();
        }
        assert_eq!(ladder.next_rung(), Duration::from_secs(5));
        ladder.reset();
        assert_eq!(ladder.attempts(), 0);
        assert_eq!(ladder.next_rung(), Duration::from_millis(250));
        assert!(ladder.next_sleep(Duration::ZERO).unwrap() <= Duration::from_millis(250));
    }

    #[test]
    fn degenerate_configs_are_raised_rather_than_spinning() {
        let config = LadderConfig { first: Duration::ZERO, cap: Duration::ZERO, window: Duration::from_secs(1) };
        let mut ladder = Ladder::new(config, 0);
        assert_eq!(ladder.next_sleep(Duration::ZERO), Some(Duration::from_millis(1)));
    }

    #[test]
    fn the_routability_line_quotes_an_errno_with_spaces() {
        let gave_up = GaveUp {
            attempts: 3,
            elapsed: Duration::from_millis(502),
            reason: StopReason::WindowExhausted,
            last: "connect ECONNREFUSED 10.0.0.7:7070",
        };
        assert_eq!(
            gave_up.routability_line("agent.list", "10.0.0.7:7070"),
            "kiln.routability seat=agent.list attempts=3 ms=502 \
             last=\"connect ECONNREFUSED 10.0.0.7:7070\" url=10.0.0.7:7070"
        );
        let retried = Retried { value: (), attempts: 1, elapsed: Duration::ZERO, last: None::<&str> };
        assert_eq!(retried.routability_line("agent.list", "10.0.0.7:7070"), None);
    }
}
