//! The agent's cache of verified contexts, over real gRPC to a real served coordinator with a
//! simulated build host (`kiln_e2e::sim`): a rebuild on the agent that built a context before uses
//! the archive it verified then, and fetches nothing. Counted by the agent's own `/metrics`
//! (`kiln_agent_build_contexts_total` by source), as an operator would see it.

use kiln_e2e::sim::{write_instance, SimFarm};
use kiln_e2e::{http, wire};
use std::time::Duration;

/// The agent's count of build contexts from `source` (`cache` or `coordinator`); 0 before any.
async fn contexts_from(metrics: std::net::SocketAddr, source: &str) -> u64 {
    let page = http::get(metrics, "/metrics", None).await;
    assert_eq!(page.status, 200, "{}", page.body);
    let series = format!("kiln_agent_build_contexts_total{{source=\"{source}\"}} ");
    page.body.lines().find_map(|l| l.strip_prefix(&series)).map_or(0, |n| n.trim().parse().expect("a count"))
}

/// A farm of one simulated agent serving `/metrics`, its context cache as `budget` says.
async fn one_agent(budget: u64) -> (SimFarm, std::net::SocketAddr) {
    let mut farm = SimFarm::start(0, 1, Duration::from_millis(10), |_| {}).await;
    let metrics = kiln_e2e::free_addr();
    farm.add_agent_with("sim-cache", 2, Duration::from_millis(10), |config| {
        config.metrics = Some(metrics);
        config.context_cache = budget;
    });
    farm.wait_connected(1).await;
    (farm, metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_on_the_agent_that_built_a_context_uses_its_verified_copy_and_fetches_nothing() {
    let (farm, metrics) = one_agent(kiln_agent::DEFAULT_CONTEXT_CACHE).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cached");
    write_instance(&dir, "cached", None, &[("api", "api v1"), ("web", "web v1")]);

    let events = wire::up(&farm.url, &dir, false).await;
    assert!(wire::succeeded(&events), "{events:#?}");
    assert_eq!((contexts_from(metrics, "coordinator").await, contexts_from(metrics, "cache").await), (2, 0));

    // `--force`: both images are built again, from the archives the first builds verified.
    let events = wire::up(&farm.url, &dir, true).await;
    assert!(wire::succeeded(&events), "{events:#?}");
    assert_eq!(farm.builds().len(), 4, "both images were rebuilt: {:#?}", farm.builds());
    assert_eq!((contexts_from(metrics, "coordinator").await, contexts_from(metrics, "cache").await), (2, 2));

    // One context moved: that one is fetched, the other is not built at all.
    write_instance(&dir, "cached", None, &[("api", "api v2"), ("web", "web v1")]);
    let events = wire::up(&farm.url, &dir, false).await;
    assert!(wire::succeeded(&events), "{events:#?}");
    assert_eq!((contexts_from(metrics, "coordinator").await, contexts_from(metrics, "cache").await), (3, 2));
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_cache_off_every_build_fetches_its_context() {
    let (farm, metrics) = one_agent(0).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("uncached");
    write_instance(&dir, "uncached", None, &[("api", "api v1")]);
    for force in [false, true, true] {
        let events = wire::up(&farm.url, &dir, force).await;
        assert!(wire::succeeded(&events), "{events:#?}");
    }
    assert_eq!((contexts_from(metrics, "coordinator").await, contexts_from(metrics, "cache").await), (3, 0));
    farm.stop().await;
}
