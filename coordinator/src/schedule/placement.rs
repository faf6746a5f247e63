//! Where a build task goes, among the agents with a free slot: pure, so the rules are tested
//! without agents.
//!
//! 1. Only an agent that may run it: a host that builds the task's platform (natively; through
//!    emulation or on any host when the engine found no native one — [`Via`]), not excluded (an agent
//!    the task was already lost on), and the one agent it requires when it builds `FROM` an image of
//!    its converge (the base exists on that daemon only).
//! 2. A warm agent first — it holds the image, or built the context before (Docker's layer cache) —
//!    the least loaded of them.
//! 3. Otherwise the least loaded of all, but only once the task has waited `affinity_wait` for a
//!    warm one, or when no warm agent is connected at all: warmth is worth a short wait, never a
//!    starving one. And a busy warm agent is waited for by at most as many tasks as it has slots
//!    (the first in the queue's order): each of them gets the next slot it frees, about one task's
//!    length away, while a task behind them would wait a whole line of builds for warmth — with
//!    free cold agents beside it, going cold now is the shorter way.

use std::time::Duration;

/// What placement needs to know of one connected host agent.
#[derive(Clone, Debug)]
pub struct Candidate<'a> {
    pub id: &'a str,
    pub platforms: &'a [String],
    /// Platforms it runs through emulation only.
    pub emulates: &'a [String],
    pub slots: u32,
    pub busy: u32,
    /// The agent holds the task's image or built its context before.
    pub warm: bool,
    /// Tasks ahead of this one in the queue's order already waiting for this agent's next slot.
    pub waiting: u32,
}

/// What placement needs to know of one waiting task.
#[derive(Clone, Debug, Default)]
pub struct Needs {
    pub platform: String,
    /// How an agent may build `platform`.
    pub via: Via,
    pub required: Option<String>,
    pub exclude: Vec<String>,
}

/// How a task's platform may be built: the engine decides once per converge, from the agents
/// connected and the Dockerfile, and placement only follows it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Via {
    /// On an agent that runs it natively.
    #[default]
    Native,
    /// No agent runs it natively; one whose binfmt_misc handlers run it will do.
    Emulation,
    /// The Dockerfile runs nothing (`FROM scratch` + `COPY`): BuildKit builds it for any platform
    /// on any host.
    AnyHost,
}

/// Whether an agent announcing `platforms` (natively) and `emulates` may build for `needs`.
pub fn runs(platforms: &[String], emulates: &[String], needs: &Needs) -> bool {
    let native = needs.platform.is_empty() || platforms.is_empty() || platforms.contains(&needs.platform);
    match needs.via {
        Via::Native => native,
        Via::Emulation => native || emulates.contains(&needs.platform),
        Via::AnyHost => true,
    }
}

/// The outcome for one task and the agents now connected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Run it on the candidate at this index.
    On(usize),
    /// A warm agent (at this index) is connected but busy, and this task is among the first in
    /// line for it: ask again when it frees up or the affinity wait ends.
    WaitWarm(usize),
    /// No agent with a free slot may run it now.
    Wait,
}

impl Candidate<'_> {
    fn free(&self) -> bool {
        self.busy < self.slots
    }

    fn may_run(&self, needs: &Needs) -> bool {
        let platform_ok = runs(self.platforms, self.emulates, needs);
        let required_ok = needs.required.as_deref().is_none_or(|id| id == self.id);
        platform_ok && required_ok && !needs.exclude.iter().any(|id| id == self.id)
    }

    /// Busy share of the slots: the least loaded has the most room left, relative to its size.
    fn load(&self) -> (u64, u32) {
        ((self.busy as u64 * 1_000_000) / self.slots.max(1) as u64, u32::MAX - self.slots)
    }
}

/// Chooses for one task that has waited `waited` of `affinity_wait`. Among equally loaded agents
/// the first from `start` on wins: the caller turns `start` so equals take turns.
pub fn choose(
    candidates: &[Candidate<'_>],
    needs: &Needs,
    waited: Duration,
    affinity_wait: Duration,
    start: usize,
) -> Choice {
    let n = candidates.len().max(1);
    let least = |warm_only: bool| {
        let free = candidates.iter().enumerate().filter(|(_, c)| c.may_run(needs) && c.free());
        let turn = |i: usize| (i + n - start % n) % n;
        free.filter(|(_, c)| c.warm || !warm_only).min_by_key(|(i, c)| (c.load(), turn(*i))).map(|(i, _)| i)
    };
    if let Some(i) = least(true) {
        return Choice::On(i);
    }
    if waited < affinity_wait {
        // The warm agent with the shortest line, if any line is still shorter than its slots.
        let line = candidates.iter().enumerate().filter(|(_, c)| c.warm && c.may_run(needs) && c.waiting < c.slots);
        if let Some((i, _)) = line.min_by_key(|(_, c)| (u64::from(c.waiting) << 32) / u64::from(c.slots.max(1))) {
            return Choice::WaitWarm(i);
        }
    }
    match least(false) {
        Some(i) => Choice::On(i),
        None => Choice::Wait,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent<'a>(id: &'a str, slots: u32, busy: u32, warm: bool) -> Candidate<'a> {
        Candidate { id, platforms: &[], emulates: &[], slots, busy, warm, waiting: 0 }
    }

    const WAIT: Duration = Duration::from_secs(2);

    #[test]
    fn a_free_warm_agent_wins_over_a_less_loaded_cold_one() {
        let agents = [agent("cold", 4, 0, false), agent("warm", 4, 3, true)];
        assert_eq!(choose(&agents, &Needs::default(), Duration::ZERO, WAIT, 0), Choice::On(1));
    }

    #[test]
    fn a_busy_warm_agent_is_waited_for_only_until_the_affinity_wait_ends() {
        let agents = [agent("cold", 1, 0, false), agent("warm", 1, 1, true)];
        assert_eq!(choose(&agents, &Needs::default(), Duration::from_millis(500), WAIT, 0), Choice::WaitWarm(1));
        assert_eq!(choose(&agents, &Needs::default(), WAIT, WAIT, 0), Choice::On(0));
    }

    #[test]
    fn a_busy_warm_agent_is_waited_for_by_no_more_tasks_than_it_has_slots() {
        let warm = |slots, waiting| Candidate { waiting, ..agent("warm", slots, slots, true) };
        let fresh = Duration::from_millis(10);
        let cold_or_warm = |slots, waiting| [agent("cold", 1, 0, false), warm(slots, waiting)];
        assert_eq!(choose(&cold_or_warm(2, 1), &Needs::default(), fresh, WAIT, 0), Choice::WaitWarm(1));
        assert_eq!(choose(&cold_or_warm(2, 2), &Needs::default(), fresh, WAIT, 0), Choice::On(0), "its line is full");
        assert_eq!(choose(&cold_or_warm(1, 1), &Needs::default(), fresh, WAIT, 0), Choice::On(0), "its line is full");
        // Two warm agents: the shorter line relative to its slots; none free and none cold: wait.
        let two = [warm(1, 1), warm(4, 1), agent("busy", 1, 1, false)];
        assert_eq!(choose(&two, &Needs::default(), fresh, WAIT, 0), Choice::WaitWarm(1));
        let full = [warm(1, 1), agent("busy", 1, 1, false)];
        assert_eq!(choose(&full, &Needs::default(), fresh, WAIT, 0), Choice::Wait);
    }

    #[test]
    fn among_equals_the_least_loaded_share_wins() {
        let agents = [agent("a", 2, 1, false), agent("b", 8, 2, false), agent("c", 2, 2, false)];
        assert_eq!(choose(&agents, &Needs::default(), Duration::ZERO, WAIT, 0), Choice::On(1));
    }

    #[test]
    fn equals_take_turns() {
        let agents = [agent("a", 1, 0, false), agent("b", 1, 0, false), agent("c", 1, 0, false)];
        let picks: Vec<Choice> = (0..3).map(|turn| choose(&agents, &Needs::default(), WAIT, WAIT, turn)).collect();
        assert_eq!(picks, [Choice::On(0), Choice::On(1), Choice::On(2)]);
    }

    #[test]
    fn no_agent_ever_gets_more_than_its_slots() {
        let agents = [agent("a", 2, 2, true), agent("b", 1, 1, false)];
        assert_eq!(choose(&agents, &Needs::default(), WAIT, WAIT, 0), Choice::Wait);
    }

    #[test]
    fn platform_requirement_and_exclusion_are_never_bent() {
        let arm = ["linux/arm64".to_string()];
        let amd = ["linux/amd64".to_string()];
        let agents = [
            Candidate { id: "arm", platforms: &arm, emulates: &[], slots: 1, busy: 0, warm: true, waiting: 0 },
            Candidate { id: "amd", platforms: &amd, emulates: &[], slots: 1, busy: 0, warm: false, waiting: 0 },
            Candidate { id: "lost", platforms: &amd, emulates: &[], slots: 1, busy: 0, warm: false, waiting: 0 },
        ];
        let needs =
            Needs { platform: "linux/amd64".into(), required: None, exclude: vec!["amd".into()], ..Needs::default() };
        assert_eq!(choose(&agents, &needs, Duration::ZERO, WAIT, 0), Choice::On(2));
        let pinned = Needs { required: Some("amd".into()), ..Needs::default() };
        assert_eq!(choose(&agents, &pinned, WAIT, WAIT, 0), Choice::On(1));
        let gone = Needs { required: Some("elsewhere".into()), ..Needs::default() };
        assert_eq!(choose(&agents, &gone, WAIT, WAIT, 0), Choice::Wait);
    }

    #[test]
    fn a_foreign_platform_goes_where_its_via_allows() {
        let amd = ["linux/amd64".to_string()];
        let arm = ["linux/arm64".to_string()];
        let agents = [
            Candidate { id: "plain", platforms: &amd, emulates: &[], slots: 1, busy: 0, warm: false, waiting: 0 },
            Candidate { id: "qemu", platforms: &amd, emulates: &arm, slots: 1, busy: 1, warm: false, waiting: 0 },
        ];
        let arm64 = |via| Needs { platform: "linux/arm64".into(), via, ..Needs::default() };
        assert_eq!(choose(&agents, &arm64(Via::Native), WAIT, WAIT, 0), Choice::Wait, "no agent runs it natively");
        let emulated = [agents[0].clone(), Candidate { busy: 0, ..agents[1].clone() }];
        assert_eq!(choose(&emulated, &arm64(Via::Emulation), WAIT, WAIT, 0), Choice::On(1), "only the emulating one");
        assert_eq!(choose(&agents, &arm64(Via::AnyHost), WAIT, WAIT, 0), Choice::On(0), "no RUN: any free host");
    }
}
