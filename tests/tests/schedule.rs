//! The farm's scheduler, with simulated build hosts over real gRPC to a real served coordinator
//! (`kiln_e2e::sim`): builds in parallel across agents, never more than an agent's slots, a fair
//! queue across owners, builds lost with their agent queued again, stalled agents given up on,
//! cancelled converges stopped. Nothing here asserts on wall-clock speed: each test asserts what
//! the simulation recorded (which builds overlapped, who got a slot before whom).

use kiln_e2e::sim::{write_instance, SimFarm};
use kiln_e2e::wire;
use kiln_proto::v1 as pb;
use kiln_proto::v1::converge_event::Kind;
use std::time::{Duration, Instant};

fn succeeded(events: &[pb::ConvergeEvent]) -> bool {
    wire::succeeded(events)
}

/// The most builds running at one instant, over the records given.
fn most_at_once(builds: &[(String, kiln_e2e::sim::BuildRecord)]) -> usize {
    builds
        .iter()
        .map(|(_, b)| {
            builds.iter().filter(|(_, o)| o.started <= b.started && o.finished.is_none_or(|f| f > b.started)).count()
        })
        .max()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn independent_images_build_in_parallel_and_no_agent_runs_more_than_its_slots() {
    let farm = SimFarm::start(3, 2, Duration::from_secs(2), |_| {}).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("six");
    let images: Vec<(String, String)> = (0..6).map(|i| (format!("img{i}"), format!("content {i}"))).collect();
    let refs: Vec<(&str, &str)> = images.iter().map(|(n, c)| (n.as_str(), c.as_str())).collect();
    write_instance(&dir, "six", None, &refs);

    let events = wire::up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let builds = farm.builds();
    assert_eq!(builds.len(), 6, "each image built once: {builds:#?}");
    assert_eq!(most_at_once(&builds), 6, "all six ran at once on 3 agents × 2 slots: {builds:#?}");
    for agent in &farm.agents {
        let most = agent.store.max_running.load(std::sync::atomic::Ordering::SeqCst);
        assert!(most <= 2, "agent {} ran {most} builds at once, above its 2 slots", agent.id);
        assert_eq!(agent.store.builds().len(), 2, "the least loaded agent takes each: {builds:#?}");
    }
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slots_short_means_a_queue_that_says_its_place_and_never_oversubscribes() {
    let farm = SimFarm::start(1, 2, Duration::from_millis(400), |_| {}).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("five");
    let images: Vec<(String, String)> = (0..5).map(|i| (format!("img{i}"), format!("c {i}"))).collect();
    let refs: Vec<(&str, &str)> = images.iter().map(|(n, c)| (n.as_str(), c.as_str())).collect();
    write_instance(&dir, "five", None, &refs);

    let events = wire::up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let queued: Vec<_> = events.iter().filter(|e| e.kind() == Kind::Queued).collect();
    assert_eq!(queued.len(), 3, "two builds start at once, three wait: {events:#?}");
    assert!(queued.iter().all(|e| e.count >= 1 && e.message.starts_with("queued (")), "{queued:#?}");
    assert_eq!(farm.agents[0].store.max_running.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(most_at_once(&farm.builds()), 2);
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_owners_backlog_does_not_delay_anothers_single_build() {
    let farm = SimFarm::start(2, 1, Duration::from_millis(300), |_| {}).await;
    let tmp = tempfile::tempdir().unwrap();
    let big = tmp.path().join("big");
    let images: Vec<(String, String)> = (0..200).map(|i| (format!("b{i:03}"), format!("backlog {i}"))).collect();
    let refs: Vec<(&str, &str)> = images.iter().map(|(n, c)| (n.as_str(), c.as_str())).collect();
    write_instance(&big, "backlog", Some("alpha"), &refs);
    let small = tmp.path().join("small");
    write_instance(&small, "single", Some("beta"), &[("one", "just one")]);

    let url = farm.url.clone();
    let backlog = tokio::spawn(async move { wire::up(&url, &big, false).await });
    // Owner alpha's builds are running and the rest of its 200 queued.
    let deadline = Instant::now() + Duration::from_secs(60);
    while farm.builds().len() < 4 {
        assert!(Instant::now() < deadline, "the backlog never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let events = wire::up(&farm.url, &small, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let reference = events.iter().find(|e| e.kind() == Kind::Building).unwrap().reference.clone();

    // Every build that got a slot between beta's build joining the queue and it getting one.
    let dispatches = kiln_coordinator::metrics::dispatches();
    let mine = dispatches.iter().find(|d| d.reference == reference).expect("beta's build was dispatched");
    let overtaking = dispatches
        .iter()
        .filter(|d| {
            d.reference.contains("backlog") && d.granted_us > mine.enqueued_us && d.granted_us < mine.granted_us
        })
        .count();
    assert!(overtaking <= 1, "{overtaking} of alpha's queued builds got a slot before beta's one build");
    let alpha_done = farm.builds().iter().filter(|(_, b)| b.tag.contains("backlog")).count();
    assert!(alpha_done < 200, "beta's build did not wait for alpha's backlog ({alpha_done} of 200 built)");

    backlog.abort();
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_build_lost_with_its_agent_is_queued_again_elsewhere_and_the_converge_succeeds() {
    let mut farm = SimFarm::start(2, 1, Duration::from_secs(3), |_| {}).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("lost");
    write_instance(&dir, "lost", None, &[("app", "v1")]);

    let url = farm.url.clone();
    let converge = tokio::spawn(async move { wire::up(&url, &dir, false).await });
    let deadline = Instant::now() + Duration::from_secs(30);
    let first = loop {
        if let Some(i) = farm.agents.iter().position(|a| a.store.running() > 0) {
            break i;
        }
        assert!(Instant::now() < deadline, "no build started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let lost_id = farm.agents[first].id.clone();
    farm.kill(first);
    let events = converge.await.unwrap();
    assert!(succeeded(&events), "{events:#?}");
    let requeued: Vec<_> = events.iter().filter(|e| e.kind() == Kind::Requeued).collect();
    assert_eq!(requeued.len(), 1, "{events:#?}");
    assert_eq!(requeued[0].store, lost_id, "the event names the lost agent");
    let other = 1 - first;
    let built = farm.agents[other].store.builds();
    assert_eq!(built.len(), 1, "the other agent built it");
    assert!(built[0].finished.is_some());
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn losing_every_agent_fails_the_converge_naming_them_and_leaves_the_record() {
    let mut farm = SimFarm::start(2, 1, Duration::from_millis(100), |_| {}).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("all");
    write_instance(&dir, "all-lost", None, &[("app", "v1")]);
    assert!(succeeded(&wire::up(&farm.url, &dir, false).await));
    let before = status(&farm, "all-lost").await;

    write_instance(&dir, "all-lost", None, &[("app", "v2")]);
    for agent in &farm.agents {
        agent.store.set_build_time(Duration::from_secs(30));
    }
    let url = farm.url.clone();
    let converge = tokio::spawn(async move { wire::up(&url, &dir, false).await });
    let deadline = Instant::now() + Duration::from_secs(30);
    while farm.agents.iter().all(|a| a.store.running() == 0) {
        assert!(Instant::now() < deadline, "no build started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let running = farm.agents.iter().position(|a| a.store.running() > 0).unwrap();
    let lost = farm.agents[running].id.clone();
    farm.kill(0);
    farm.kill(1);
    let events = converge.await.unwrap();
    assert!(!succeeded(&events), "{events:#?}");
    let failed = events.iter().find(|e| e.kind() == Kind::Failed).expect("a failure");
    assert!(failed.message.contains(&lost), "the failure names the lost agent {lost}: {}", failed.message);
    assert_eq!(status(&farm, "all-lost").await, before, "the record is untouched");
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_that_heartbeats_but_never_answers_is_given_up_and_nothing_wedges() {
    let farm = SimFarm::start(1, 1, Duration::from_millis(100), |c| {
        c.task_deadline = Duration::from_secs(2);
        c.affinity_wait = Duration::ZERO;
    })
    .await;
    // The stranger's probe: an agent that says hello with a host store and many slots, keeps
    // heartbeating, and never answers a task — nor names one in its heartbeats.
    let silent = kiln_e2e::sim::silent_agent(&farm.url, "zz-silent", 8).await;
    farm.wait_connected(2).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("wedge");
    let images: Vec<(String, String)> = (0..4).map(|i| (format!("w{i}"), format!("w {i}"))).collect();
    let refs: Vec<(&str, &str)> = images.iter().map(|(n, c)| (n.as_str(), c.as_str())).collect();
    write_instance(&dir, "wedge", None, &refs);

    let events = tokio::time::timeout(Duration::from_secs(120), wire::up(&farm.url, &dir, false))
        .await
        .expect("the converge never ended: a silent agent wedged it");
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(farm.agents[0].store.builds().len(), 4, "the real agent built everything");
    let gc = tokio::time::timeout(Duration::from_secs(60), wire::gc(&farm.url, true, None))
        .await
        .expect("gc never ended: a silent agent wedged its listing");
    assert!(wire::succeeded(&gc), "{gc:#?}");
    silent.abort();
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancelled_converge_stops_its_builds_drops_its_queue_and_leaves_the_record() {
    let farm = SimFarm::start(1, 1, Duration::from_secs(30), |_| {}).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cancel");
    write_instance(&dir, "cancel-me", None, &[("a", "1"), ("b", "2"), ("c", "3")]);
    let url = farm.url.clone();
    let converge = tokio::spawn(async move { wire::up(&url, &dir, false).await });
    let deadline = Instant::now() + Duration::from_secs(30);
    while farm.agents[0].store.running() == 0 {
        assert!(Instant::now() < deadline, "no build started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut client = farm.client().await.unwrap();
    let ps = client.ps(pb::PsRequest {}).await.unwrap().into_inner();
    assert_eq!(ps.converges.len(), 1, "{ps:#?}");
    let states: Vec<&str> = ps.converges[0].tasks.iter().map(|t| t.state.as_str()).collect();
    assert_eq!(states, ["building", "queued", "queued"], "{ps:#?}");
    let id = ps.converges[0].converge_id.clone();

    let reply = client.cancel(pb::CancelRequest { converge_id: id.clone() }).await.unwrap().into_inner();
    assert_eq!(reply.instance, "cancel-me");
    let events = tokio::time::timeout(Duration::from_secs(20), converge).await.expect("cancel ended it").unwrap();
    assert!(!succeeded(&events));
    let failed = events.iter().find(|e| e.kind() == Kind::Failed).expect("failed event");
    assert!(failed.message.contains("cancelled"), "{failed:#?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while farm.agents[0].store.running() > 0 {
        assert!(Instant::now() < deadline, "the agent's build was never stopped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(farm.agents[0].store.builds().len(), 1, "the queued builds never started");
    assert!(farm.agents[0].store.builds()[0].finished.is_none(), "the running build was stopped, not finished");
    assert!(status(&farm, "cancel-me").await.instances.is_empty(), "nothing was recorded");
    let ps = client.ps(pb::PsRequest {}).await.unwrap().into_inner();
    assert!(ps.converges.is_empty() && ps.busy == 0, "the slot came back: {ps:#?}");
    let again = client.cancel(pb::CancelRequest { converge_id: id }).await.expect_err("not running any more");
    assert_eq!(again.code(), tonic::Code::NotFound);
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_gone_before_uploading_does_not_hold_its_instance() {
    let farm = SimFarm::start(1, 1, Duration::from_millis(100), |_| {}).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("gone");
    write_instance(&dir, "gone", None, &[("app", "v1")]);
    let (req, _) = wire::up_request(&dir, false);
    let mut client = farm.client().await.unwrap();
    let mut stream = client.up(req).await.unwrap().into_inner();
    loop {
        let event = stream.message().await.unwrap().expect("the converge asks for its context");
        if event.kind() == Kind::NeedContexts {
            break;
        }
    }
    drop(stream);
    drop(client);
    // The next converge of the instance is refused while one runs; it runs once the abandoned
    // one was cancelled.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (req, _) = wire::up_request(&dir, false);
        let mut client = farm.client().await.unwrap();
        match client.up(req).await {
            Ok(_) => break,
            Err(status) => assert!(Instant::now() < deadline, "the instance stayed held: {status:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    farm.stop().await;
}

async fn status(farm: &SimFarm, instance: &str) -> pb::StatusReply {
    let mut client = farm.client().await.unwrap();
    let mut reply = client.status(pb::StatusRequest { instance: instance.to_string() }).await.unwrap().into_inner();
    // Converges come and go; the record is what must stay.
    reply.converges.clear();
    reply
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_base_builds_first_then_the_images_built_from_it_in_parallel_where_it_is() {
    let farm = SimFarm::start(3, 2, Duration::from_secs(1), |c| c.affinity_wait = Duration::ZERO).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("graph");
    // The children come first in the manifest: the order is the FROM graph's, not the file's.
    let toml = "instance = \"graph\"\n[target]\nkind = \"local\"\n\
                [built.api]\ncontext = \"api\"\n[built.web]\ncontext = \"web\"\n\
                [built.base]\ncontext = \"base\"\nshared = true\n";
    kiln_e2e::fixture::write(&dir, "kiln.toml", toml);
    for (name, from) in [("api", "base"), ("web", "base"), ("base", "scratch")] {
        kiln_e2e::fixture::write(&dir, &format!("{name}/Dockerfile"), &format!("FROM {from}\nCOPY f /{name}\n"));
        kiln_e2e::fixture::write(&dir, &format!("{name}/f"), name);
    }

    let events = wire::up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let builds = farm.builds();
    assert_eq!(builds.len(), 3, "{builds:#?}");
    let (base_agent, base) = builds.iter().find(|(_, b)| b.tag.contains("graph-base")).unwrap();
    let children: Vec<_> = builds.iter().filter(|(_, b)| !b.tag.contains("graph-base")).collect();
    for (agent, child) in &children {
        assert!(child.started >= base.finished.unwrap(), "{} started before its base was built", child.tag);
        assert_eq!(agent, base_agent, "{} built where its base is", child.tag);
    }
    let (a, b) = (&children[0].1, &children[1].1);
    assert!(a.started < b.finished.unwrap() && b.started < a.finished.unwrap(), "the two children overlapped");
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ps_says_a_built_image_is_delivering_while_its_delivery_holds_the_slot() {
    let farm = SimFarm::start(1, 1, Duration::from_millis(10), |_| {}).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("deliver");
    write_instance(&dir, "deliver-me", None, &[("a", "1")]);
    // The delivery's read-back (an inspect of the built tag, in the build's slot) waits.
    farm.agents[0].store.hold_inspects_of("deliver-me");
    let url = farm.url.clone();
    let converge = tokio::spawn(async move { wire::up(&url, &dir, false).await });
    let mut client = farm.client().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let task = loop {
        let ps = client.ps(pb::PsRequest {}).await.unwrap().into_inner();
        if let Some(task) = ps.converges.first().and_then(|c| c.tasks.first()).filter(|t| t.state == "delivering") {
            assert_eq!(ps.busy, 1, "the delivery holds the build's slot: {ps:#?}");
            break task.clone();
        }
        assert!(Instant::now() < deadline, "ps never said delivering: {ps:#?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(task.agent, farm.agents[0].id);
    assert_eq!(farm.agents[0].store.builds().len(), 1, "it was built before it was delivering");
    farm.agents[0].store.clear_hangs();
    let events = tokio::time::timeout(Duration::from_secs(30), converge).await.expect("it ended").unwrap();
    assert!(succeeded(&events), "{events:#?}");
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_going_away_is_listed_as_draining_not_as_gone() {
    let mut farm = SimFarm::start(1, 1, Duration::from_millis(10), |_| {}).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("drain");
    write_instance(&dir, "draining", None, &[("app", "v1")]);
    // A build that never ends keeps the agent draining: with nothing to finish, it would be told
    // `Drained` and leave at once.
    farm.agents[0].store.hang_builds_of("draining");
    let url = farm.url.clone();
    let converge = tokio::spawn(async move { wire::up(&url, &dir, false).await });
    let deadline = Instant::now() + Duration::from_secs(30);
    while farm.agents[0].store.running() == 0 {
        assert!(Instant::now() < deadline, "the build never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    farm.stop_agent(0);
    let id = farm.agents[0].id.clone();
    let mut client = farm.client().await.unwrap();
    let listed = loop {
        let agents = client.agents(pb::AgentsRequest {}).await.unwrap().into_inner().agents;
        let listed = agents.into_iter().find(|a| a.id == id).expect("the agent is listed");
        if listed.draining {
            break listed;
        }
        assert!(listed.connected, "the agent was listed as gone while it still ran its build: {listed:?}");
        assert!(Instant::now() < deadline, "the agent was never listed as draining: {listed:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(listed.connected, "a draining agent is still connected: {listed:?}");
    converge.abort();
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rebuild_goes_to_the_agent_that_built_it_before_not_the_next_in_turn() {
    // Three idle agents, equally loaded: without warmth placement hands each new task to the
    // next agent in turn, so a rebuild landing on the first builder again is the inventory's doing
    // (the coordinator's index of who built which context and holds which ref).
    let farm = SimFarm::start(3, 1, Duration::from_millis(10), |_| {}).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("warm");
    write_instance(&dir, "warm", None, &[("app", "app v1")]);

    for round in 0..3 {
        let events = wire::up(&farm.url, &dir, round > 0).await;
        assert!(succeeded(&events), "round {round}: {events:#?}");
    }
    let builds = farm.builds();
    assert_eq!(builds.len(), 3, "built once, then rebuilt twice (--force): {builds:#?}");
    assert!(builds.iter().all(|(agent, _)| *agent == builds[0].0), "every build where the first ran: {builds:#?}");

    // A new context is warm nowhere: it goes to the next agent in turn, not to the warm one.
    write_instance(&dir, "warm", None, &[("app", "app v2")]);
    let events = wire::up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let builds = farm.builds();
    assert_eq!(builds.len(), 4, "{builds:#?}");
    assert_ne!(builds[3].0, builds[0].0, "a cold task is not pinned to one agent: {builds:#?}");
    farm.stop().await;
}

/// Listings each simulated agent answered since `before` (this, taken earlier).
fn listed_since(farm: &SimFarm, before: &[u32]) -> Vec<u32> {
    let now = farm.agents.iter().map(|a| a.store.listings.load(std::sync::atomic::Ordering::SeqCst));
    now.zip(before.iter().chain(std::iter::repeat(&0))).map(|(n, b)| n - b).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_no_op_lists_every_host_holding_its_images_and_a_forced_rebuild_only_its_own() {
    let farm = SimFarm::start(3, 1, Duration::from_millis(200), |_| {}).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("three");
    write_instance(&dir, "three", None, &[("a", "content a"), ("b", "content b"), ("c", "content c")]);
    let events = wire::up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let hosts: std::collections::HashSet<_> = farm.builds().into_iter().map(|(agent, _)| agent).collect();
    assert_eq!(hosts.len(), 3, "one image on each agent: {:#?}", farm.builds());

    // Recorded images may sit on any host: the no-op confirms each where it is.
    let before = listed_since(&farm, &[]);
    let events = wire::up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert!(events.iter().all(|e| e.kind() != Kind::Building), "{events:#?}");
    assert_eq!(listed_since(&farm, &before), vec![1, 1, 1], "the no-op lists each host holding one");

    // A forced rebuild looks at nothing recorded: only the converge's own host is listed.
    let before = listed_since(&farm, &[]);
    let events = wire::up(&farm.url, &dir, true).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(farm.builds().len(), 6, "each image built again: {:#?}", farm.builds());
    let listed = listed_since(&farm, &before);
    assert_eq!(listed.iter().sum::<u32>(), 1, "one host listed for the forced rebuild: {listed:?}");
    farm.stop().await;
}
