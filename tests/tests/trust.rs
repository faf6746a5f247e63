//! Trust, tried as an attacker would (issue 8): every RPC of every service without credentials,
//! with the wrong role, with an expired or revoked token, with an agent certificate where a user is
//! expected and the other way round — against a real TLS coordinator on loopback. The methods are
//! read from the generated code, so an RPC added without a rule in the authorization table (and an
//! expectation here) fails this test.

use kiln_coordinator::model::AgentRole;
use kiln_coordinator::trust::{pki, Role};
use kiln_e2e::trust::TrustedFarm;
use kiln_proto::v1 as pb;
use tonic::Code;

/// Every gRPC path the generated server code serves.
fn every_rpc() -> Vec<String> {
    let code = include_str!("../../proto/src/gen/kiln.v1.rs");
    let mut paths: Vec<String> = code
        .match_indices("\"/kiln.v1.")
        .map(|(i, _)| {
            let rest = &code[i + 1..];
            rest[..rest.find('"').unwrap()].to_string()
        })
        .filter(|p| p.matches('/').count() == 2)
        .collect();
    paths.sort();
    paths.dedup();
    paths
}

/// Who calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Caller {
    Nobody,
    Viewer,
    Member,
    Admin,
    Expired,
    Revoked,
    HostAgent,
    NodeAgent,
}

/// What the caller gets: refused for who it is, or let through to the handler (which may still
/// refuse the empty request for its content — that is not the guard's business).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Unauthenticated,
    Denied,
    Through,
}

/// What a security reviewer expects of each RPC, written apart from the coordinator's table.
fn expected(path: &str, caller: Caller) -> Verdict {
    use Caller::*;
    use Verdict::*;
    let method = path.rsplit('/').next().unwrap();
    if matches!(caller, Expired | Revoked) {
        // A credential that is no longer good is refused wherever it is shown.
        return Unauthenticated;
    }
    if caller == Nobody {
        // Enrollment is the one door without credentials; the join token is checked inside.
        return if method == "Enroll" { Through } else { Unauthenticated };
    }
    let user = matches!(caller, Viewer | Member | Admin);
    let member = matches!(caller, Member | Admin);
    let agent = matches!(caller, HostAgent | NodeAgent);
    let allowed = match path {
        "/kiln.v1.Kiln/Status"
        | "/kiln.v1.Kiln/Logs"
        | "/kiln.v1.Kiln/Images"
        | "/kiln.v1.Kiln/Agents"
        | "/kiln.v1.Kiln/Pins"
        | "/kiln.v1.Kiln/Audit"
        | "/kiln.v1.Kiln/WhoAmI"
        | "/kiln.v1.Kiln/Ps"
        | "/kiln.v1.Kiln/ClusterPlatforms" => user,
        // Why: any user reaches the handler, which answers only the instance's owners.
        "/kiln.v1.Kiln/Why" => user,
        // Cancel: a member, of converges of instances it owns (the handler checks the owner).
        "/kiln.v1.Kiln/Up" | "/kiln.v1.Kiln/Down" | "/kiln.v1.Kiln/Cancel" => member,
        "/kiln.v1.Kiln/Gc" | "/kiln.v1.Kiln/Pin" | "/kiln.v1.Kiln/Unpin" => caller == Admin,
        "/kiln.v1.ContentStore/FindMissing" | "/kiln.v1.ContentStore/Upload" => member,
        // Per-file uploads: the same door as `Upload`.
        "/kiln.v1.ContentStore/FindMissingBlobs"
        | "/kiln.v1.ContentStore/UploadBlobs"
        | "/kiln.v1.ContentStore/PutContext" => member,
        "/kiln.v1.ContentStore/Download" => member || caller == HostAgent,
        "/kiln.v1.ImageRelay/Put" => caller == HostAgent,
        "/kiln.v1.ImageRelay/Get" => caller == NodeAgent,
        "/kiln.v1.AgentHub/Connect" | "/kiln.v1.Enrollment/Renew" => agent,
        "/kiln.v1.Enrollment/Enroll" => true,
        other => panic!("{other} is an RPC this test has no expectation for — decide who may call it"),
    };
    if allowed {
        Through
    } else {
        Denied
    }
}

/// Calls `path` with one empty message, as a raw gRPC client (streams and unaries alike).
async fn call(channel: tonic::transport::Channel, path: &str, token: Option<&str>) -> Code {
    let mut grpc = tonic::client::Grpc::new(channel);
    if let Err(err) = grpc.ready().await {
        panic!("{path}: the channel is not ready: {err}");
    }
    let codec = tonic_prost::ProstCodec::<pb::PinsRequest, pb::PinsRequest>::default();
    let mut request = tonic::Request::new(tokio_stream::once(pb::PinsRequest {}));
    if let Some(token) = token {
        request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    let path = http::uri::PathAndQuery::try_from(path.to_string()).unwrap();
    let answer = tokio::time::timeout(std::time::Duration::from_secs(10), grpc.streaming(request, path, codec)).await;
    match answer {
        Ok(Ok(_)) => Code::Ok,
        Ok(Err(status)) => status.code(),
        // A stream the handler accepted and keeps open (an agent's Connect): it was let through.
        Err(_) => Code::Ok,
    }
}

fn verdict_of(code: Code) -> Verdict {
    match code {
        Code::Unauthenticated => Verdict::Unauthenticated,
        Code::PermissionDenied => Verdict::Denied,
        _ => Verdict::Through,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_refuses_every_caller_its_rule_does_not_let_through() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = TrustedFarm::start(&tmp.path().join("state")).await;
    let viewer = farm.token("vera", Role::Viewer, None, None).await;
    let member = farm.token("mo", Role::Member, Some("payments"), None).await;
    let admin = farm.token("ada", Role::Admin, None, None).await;
    let expired = farm.token("old", Role::Admin, None, Some(pki::now_ms() - 1)).await;
    let revoked = farm.token("gone", Role::Admin, None, None).await;
    let revoked_id = revoked.split('_').nth(1).unwrap().to_string();
    use kiln_coordinator::state::StateStore;
    assert!(farm.store.revoke_token(&revoked_id, pki::now_ms()).await.unwrap());
    let (host_cert, host_key) = farm.enroll("host-1", AgentRole::Host, "", &tmp.path().join("host")).await;
    let (node_cert, node_key) = farm.enroll("node-1", AgentRole::Node, "prod", &tmp.path().join("node")).await;

    let rpcs = every_rpc();
    assert!(rpcs.len() >= 20, "the generated code lists the services' methods: {rpcs:?}");
    let mut checked = 0;
    for path in &rpcs {
        // The coordinator must have a rule for every method, whoever calls.
        assert!(kiln_coordinator::trust::rule_for(path).is_some(), "{path} has no rule in the authorization table");
        for caller in [
            Caller::Nobody,
            Caller::Viewer,
            Caller::Member,
            Caller::Admin,
            Caller::Expired,
            Caller::Revoked,
            Caller::HostAgent,
            Caller::NodeAgent,
        ] {
            let (channel, token) = match caller {
                Caller::Nobody => (farm.channel(), None),
                Caller::Viewer => (farm.channel(), Some(viewer.as_str())),
                Caller::Member => (farm.channel(), Some(member.as_str())),
                Caller::Admin => (farm.channel(), Some(admin.as_str())),
                Caller::Expired => (farm.channel(), Some(expired.as_str())),
                Caller::Revoked => (farm.channel(), Some(revoked.as_str())),
                Caller::HostAgent => (farm.agent_channel(&host_cert, &host_key), None),
                Caller::NodeAgent => (farm.agent_channel(&node_cert, &node_key), None),
            };
            let code = call(channel, path, token).await;
            let want = expected(path, caller);
            // Enrollment lets everyone through the guard and refuses a missing join token itself.
            let got = if path.ends_with("/Enroll") && code == Code::PermissionDenied {
                Verdict::Through
            } else {
                verdict_of(code)
            };
            assert_eq!(got, want, "{caller:?} calling {path} got {code:?}");
            checked += 1;
        }
    }
    assert_eq!(checked, rpcs.len() * 8);
    farm.stop().await;
}

/// A real host agent (the machine's Docker daemon) connected to `farm` over mutual TLS.
async fn start_agent(farm: &TrustedFarm, id: &str, dir: &std::path::Path) -> tokio::sync::oneshot::Sender<()> {
    farm.enroll(id, AgentRole::Host, "", dir).await;
    let config = kiln_agent::AgentConfig {
        identity: Some(kiln_agent::enroll::Identity::in_dir(dir)),
        ..kiln_agent::AgentConfig::new(farm.url.clone(), id.to_string(), dir.join("scratch"))
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = kiln_agent::run(config, async {
            let _ = stopped.await;
        })
        .await;
    });
    // Until the coordinator lists it as connected.
    let admin = farm.token("wait", Role::Admin, None, None).await;
    let mut client = pb::kiln_client::KilnClient::with_interceptor(farm.channel(), kiln_e2e::trust::with_token(&admin));
    for _ in 0..200 {
        let agents = client.agents(pb::AgentsRequest {}).await.unwrap().into_inner().agents;
        if agents.iter().any(|a| a.id == id && a.connected) {
            return stop;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("agent {id} did not connect");
}

/// The state a refusal must leave as it was.
#[derive(Debug, PartialEq)]
struct Snapshot {
    records: Vec<(String, u64)>,
    pins: Vec<String>,
    claims: usize,
    converges: usize,
    images: Vec<String>,
}

async fn snapshot(farm: &TrustedFarm, repo: &str) -> Snapshot {
    use kiln_coordinator::state::StateStore;
    let records = farm.store.records().await.unwrap().into_iter().map(|(r, _)| (r.instance, r.generation.0)).collect();
    Snapshot {
        records,
        pins: farm.store.pins().await.unwrap().into_iter().map(|p| p.reference).collect(),
        claims: farm.store.live_claims(pki::now_ms()).await.unwrap().len(),
        converges: farm.store.converges(None, 1000).await.unwrap().len(),
        images: kiln_e2e::docker::images_named(repo),
    }
}

/// Runs `Up` for the instance folder `dir` as the holder of `token`, uploading what is asked.
async fn up_as(
    farm: &TrustedFarm,
    token: &str,
    dir: &std::path::Path,
) -> Result<Vec<pb::ConvergeEvent>, tonic::Status> {
    up_with(farm.channel(), token, dir).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_call_changes_nothing_and_owners_are_the_verified_callers() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = TrustedFarm::start(&tmp.path().join("state")).await;
    let stop = start_agent(&farm, "host-1", &tmp.path().join("host-1")).await;
    let instance = kiln_e2e::fixture::unique("trusted");
    let dir = kiln_e2e::fixture::example("hello", tmp.path(), "hello", &instance, None);
    let repo = format!("{instance}-web");
    let (viewer, payments, ops, admin) = (
        farm.token("vera", Role::Viewer, None, None).await,
        farm.token("mo", Role::Member, Some("payments"), None).await,
        farm.token("otto", Role::Member, Some("ops"), None).await,
        farm.token("ada", Role::Admin, None, None).await,
    );

    // A viewer cannot converge: refused before anything is claimed, uploaded or built.
    let before = snapshot(&farm, &repo).await;
    let refused = up_as(&farm, &viewer, &dir).await.expect_err("a viewer may not converge");
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert_eq!(snapshot(&farm, &repo).await, before, "a refused Up changes nothing");

    // A member converges: the instance is theirs (their user, no team named), and the record says who.
    let events = up_as(&farm, &payments, &dir).await.unwrap();
    assert!(kiln_e2e::wire::succeeded(&events), "{events:#?}");
    let mut client = pb::kiln_client::KilnClient::with_interceptor(farm.channel(), kiln_e2e::trust::with_token(&admin));
    let converges =
        client.status(pb::StatusRequest { instance: instance.clone() }).await.unwrap().into_inner().converges;
    assert_eq!(converges[0].requested_by, "user:mo", "requested_by is the verified identity, never the request body's");

    // Another team's member can neither converge it nor take it down; the refusal names the owner.
    let before = snapshot(&farm, &repo).await;
    let refused = up_as(&farm, &ops, &dir).await.expect_err("another member may not converge it");
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert!(refused.message().contains(&format!("instance {instance} is owned by mo")), "{}", refused.message());
    let mut theirs = pb::kiln_client::KilnClient::with_interceptor(farm.channel(), kiln_e2e::trust::with_token(&ops));
    let down = theirs.down(pb::DownRequest { instance: instance.clone(), requested_by: "mo".into() }).await;
    assert_eq!(down.expect_err("another member may not take it down").code(), Code::PermissionDenied);
    // Nor sweep, nor pin: those are an admin's.
    assert_eq!(theirs.gc(pb::GcRequest::default()).await.expect_err("gc is an admin's").code(), Code::PermissionDenied);
    let pin = theirs.pin(pb::PinRequest { reference: "victim:1".into(), requested_by: "ada".into() }).await;
    assert_eq!(pin.expect_err("pins are an admin's").code(), Code::PermissionDenied);
    assert_eq!(snapshot(&farm, &repo).await, before, "refusals change nothing");

    // Every mutating call is in the audit log with its verified actor; a member sees their own.
    let audit = client.audit(pb::AuditRequest::default()).await.unwrap().into_inner().entries;
    assert!(
        audit.iter().any(|e| e.actor == "user:mo" && e.action == "up" && e.outcome.starts_with("ok")),
        "{audit:#?}"
    );
    assert!(
        audit.iter().any(|e| e.actor == "user:otto" && e.action == "down" && e.outcome.starts_with("refused")),
        "{audit:#?}"
    );
    let own = theirs.audit(pb::AuditRequest::default()).await.unwrap().into_inner().entries;
    assert!(!own.is_empty() && own.iter().all(|e| e.actor == "user:otto"), "{own:#?}");

    let _ = stop.send(());
    farm.stop().await;
    kiln_e2e::fixture::remove_built(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_are_who_their_certificates_say_and_nobody_else() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = TrustedFarm::start(&tmp.path().join("state")).await;
    let (cert, key) = farm.enroll("host-1", AgentRole::Host, "", &tmp.path().join("host-1")).await;

    // A hello with no certificate is refused before it says anything.
    let hello = |id: &str| pb::AgentMessage {
        body: Some(pb::agent_message::Body::Hello(pb::Hello {
            agent_id: id.into(),
            version: "0.1.0".into(),
            role: pb::Role::Host as i32,
            ..Default::default()
        })),
    };
    let mut stranger = pb::agent_hub_client::AgentHubClient::new(farm.channel());
    let refused = stranger.connect(tokio_stream::once(hello("host-1"))).await.expect_err("no certificate");
    assert_eq!(refused.code(), Code::Unauthenticated);

    // A real certificate for host-1 cannot say hello as someone else.
    let mut agent = pb::agent_hub_client::AgentHubClient::new(farm.agent_channel(&cert, &key));
    let refused =
        agent.connect(tokio_stream::once(hello("host-2"))).await.expect_err("an id is bound to its certificate");
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert!(refused.message().contains("certificate names host-1"), "{}", refused.message());

    // A certificate from another farm's CA does not get past the handshake.
    let other = tempfile::tempdir().unwrap();
    let mut foreign = TrustedFarm::start(other.path()).await;
    let (foreign_cert, foreign_key) = foreign.enroll("host-1", AgentRole::Host, "", &other.path().join("a")).await;
    let mut impostor = pb::agent_hub_client::AgentHubClient::new(farm.agent_channel(&foreign_cert, &foreign_key));
    assert!(
        impostor.connect(tokio_stream::once(hello("host-1"))).await.is_err(),
        "another CA's certificate is refused"
    );
    foreign.stop().await;

    // Revoked: refused from then on.
    use kiln_coordinator::state::StateStore;
    farm.store.revoke_agent("host-1", pki::now_ms() + 1).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let mut revoked = pb::agent_hub_client::AgentHubClient::new(farm.agent_channel(&cert, &key));
    let refused = revoked.connect(tokio_stream::once(hello("host-1"))).await.expect_err("revoked");
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert!(refused.message().contains("revoked"), "{}", refused.message());
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_token_works_once_before_it_expires_and_only_for_its_farm() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = TrustedFarm::start(&tmp.path().join("state")).await;
    let token = farm.join_token(AgentRole::Host, "", pki::now_ms() + 600_000).await;
    let identity = |n: &str| kiln_agent::enroll::Identity::in_dir(&tmp.path().join(n));
    kiln_agent::enroll::join(&farm.url, &token, "a-1", &identity("a1")).await.expect("first use");
    let again = kiln_agent::enroll::join(&farm.url, &token, "a-2", &identity("a2")).await.expect_err("single use");
    assert!(again.to_string().contains("already used"), "{again}");
    assert!(!identity("a2").exists(), "nothing was issued");

    let stale = farm.join_token(AgentRole::Host, "", pki::now_ms() - 1).await;
    let expired = kiln_agent::enroll::join(&farm.url, &stale, "a-3", &identity("a3")).await.expect_err("expired");
    assert!(expired.to_string().contains("expired"), "{expired}");

    // A token naming another CA: the agent refuses this coordinator before sending anything.
    let wrong_pin = token.rsplit_once('_').unwrap().0.to_string() + "_" + &"ab".repeat(32);
    let wrong = kiln_agent::enroll::join(&farm.url, &wrong_pin, "a-4", &identity("a4")).await.expect_err("wrong farm");
    assert!(matches!(wrong, kiln_agent::enroll::EnrollError::WrongFarm { .. }), "{wrong}");
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_context_goes_only_to_the_agent_building_it() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = TrustedFarm::start(&tmp.path().join("state")).await;
    let member = farm.token("mo", Role::Member, None, None).await;
    let (cert, key) = farm.enroll("host-9", AgentRole::Host, "", &tmp.path().join("h")).await;
    // Upload a context as a member, then ask for it as an agent that builds nothing.
    let ctx = tmp.path().join("ctx");
    std::fs::create_dir(&ctx).unwrap();
    std::fs::write(ctx.join("secret.txt"), "source code").unwrap();
    let tree = kiln_core::digest::walk_tree(&ctx, &Default::default()).unwrap();
    let mut bytes = Vec::new();
    let packed = kiln_core::archive::pack(&tree, &mut bytes).unwrap();
    let mut store = pb::content_store_client::ContentStoreClient::with_interceptor(
        farm.channel(),
        kiln_e2e::trust::with_token(&member),
    );
    store
        .upload(tokio_stream::once(pb::UploadChunk { digest: packed.digest.to_string(), data: bytes.into() }))
        .await
        .unwrap();
    let mut idle = pb::content_store_client::ContentStoreClient::new(farm.agent_channel(&cert, &key));
    let refused =
        idle.download(pb::DownloadRequest { digest: packed.digest.to_string() }).await.expect_err("no task for it");
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    // Nor a member whose instances do not name it.
    let refused =
        store.download(pb::DownloadRequest { digest: packed.digest.to_string() }).await.expect_err("not theirs");
    assert_eq!(refused.code(), Code::PermissionDenied);
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_certificate_asking_to_be_a_host_stays_a_node_with_only_its_own_store() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = TrustedFarm::start(&tmp.path().join("state")).await;
    let (cert, key) = farm.enroll("node-7", AgentRole::Node, "prod", &tmp.path().join("n")).await;
    let store = |id: &str, kind: pb::store_info::Kind| pb::StoreInfo {
        id: id.into(),
        kind: kind as i32,
        cluster: "prod".into(),
    };
    let hello = pb::Hello {
        agent_id: "node-7".into(),
        role: pb::Role::Host as i32,
        cluster: "other".into(),
        version: "0.1.0".into(),
        stores: vec![
            store("docker@node-7", pb::store_info::Kind::Host),
            store("containerd@node-7", pb::store_info::Kind::Node),
            store("containerd@node-8", pb::store_info::Kind::Node),
        ],
        ..Default::default()
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(pb::AgentMessage { body: Some(pb::agent_message::Body::Hello(hello)) }).await.unwrap();
    let mut client = pb::agent_hub_client::AgentHubClient::new(farm.agent_channel(&cert, &key));
    let _stream = client.connect(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap();
    let admin = farm.token("ada", Role::Admin, None, None).await;
    let mut kiln = pb::kiln_client::KilnClient::with_interceptor(farm.channel(), kiln_e2e::trust::with_token(&admin));
    let mut seen = None;
    for _ in 0..100 {
        let agents = kiln.agents(pb::AgentsRequest {}).await.unwrap().into_inner().agents;
        if let Some(a) = agents.into_iter().find(|a| a.id == "node-7" && a.connected) {
            seen = Some(a);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let agent = seen.expect("node-7 connected");
    assert_eq!(agent.role(), pb::Role::Node, "the certificate's role, not the hello's");
    assert_eq!(
        agent.stores,
        vec!["containerd@node-7".to_string()],
        "only its own node store: no host store, no other node's"
    );
    drop(tx);
    farm.stop().await;
}

/// One member cancelling another team's running converge, as an attacker would try it: refused
/// with the owner named, and the converge and its build go on untouched; its owner may cancel it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_cannot_cancel_another_teams_running_converge() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = TrustedFarm::start(&tmp.path().join("state")).await;
    // A simulated build host on mutual TLS whose builds hang: the converge stays running.
    let dir = tmp.path().join("sim-1");
    farm.enroll("sim-1", AgentRole::Host, "", &dir).await;
    let host = kiln_e2e::sim::SimHost::new("sim-1", std::time::Duration::from_millis(10));
    host.hang.store(true, std::sync::atomic::Ordering::SeqCst);
    let config = kiln_agent::AgentConfig {
        slots: 1,
        identity: Some(kiln_agent::enroll::Identity::in_dir(&dir)),
        ..kiln_agent::AgentConfig::new(farm.url.clone(), "sim-1", dir.join("scratch"))
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let store: std::sync::Arc<dyn kiln_agent::host::HostStore> = host.clone();
    tokio::spawn(kiln_agent::run_with(config, store, async {
        let _ = stopped.await;
    }));
    let (payments, ops, viewer, admin) = (
        farm.token("mo", Role::Member, Some("payments"), None).await,
        farm.token("otto", Role::Member, Some("ops"), None).await,
        farm.token("vera", Role::Viewer, None, None).await,
        farm.token("ada", Role::Admin, None, None).await,
    );
    let instance = kiln_e2e::fixture::unique("cancel");
    let work = tmp.path().join("instance");
    kiln_e2e::sim::write_instance(&work, &instance, Some("payments"), &[("web", "v1")]);
    let converge = {
        let (channel, token, work) = (farm.channel(), payments.clone(), work.clone());
        tokio::spawn(async move { up_with(channel, &token, &work).await })
    };
    let mut admin_client =
        pb::kiln_client::KilnClient::with_interceptor(farm.channel(), kiln_e2e::trust::with_token(&admin));
    let mut id = String::new();
    for _ in 0..400 {
        let ps = admin_client.ps(pb::PsRequest {}).await.unwrap().into_inner();
        if let Some(running) = ps.converges.iter().find(|c| c.instance == instance) {
            if host.running() > 0 {
                id = running.converge_id.clone();
                break;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(!id.is_empty(), "the converge never got to its build");

    let running = || async {
        let ps = admin_client.clone().ps(pb::PsRequest {}).await.unwrap().into_inner();
        ps.converges.iter().any(|c| c.converge_id == id)
    };
    let cancel = |token: Option<String>| {
        let (channel, id) = (farm.channel(), id.clone());
        async move {
            let request = pb::CancelRequest { converge_id: id };
            match token {
                Some(token) => {
                    pb::kiln_client::KilnClient::with_interceptor(channel, kiln_e2e::trust::with_token(&token))
                        .cancel(request)
                        .await
                }
                None => pb::kiln_client::KilnClient::new(channel).cancel(request).await,
            }
        }
    };
    let refused = cancel(Some(ops)).await.expect_err("another team's member may not cancel it");
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("owned by"), "the refusal names the owner: {}", refused.message());
    assert_eq!(cancel(Some(viewer)).await.expect_err("a viewer may not").code(), Code::PermissionDenied);
    assert_eq!(cancel(None).await.expect_err("nobody may not").code(), Code::Unauthenticated);
    assert!(running().await, "a refused cancel left the converge running");
    assert_eq!(host.running(), 1, "a refused cancel left its build running");

    // Its owner may.
    cancel(Some(payments)).await.expect("the owner cancels");
    let ended = tokio::time::timeout(std::time::Duration::from_secs(30), converge).await.expect("it ended").unwrap();
    let events = ended.expect("the stream ends with the converge");
    assert!(!kiln_e2e::wire::succeeded(&events));
    assert!(!running().await);
    let _ = stop.send(());
    farm.stop().await;
}

/// `Up` over `channel` as the holder of `token`, uploading what is asked; the events.
async fn up_with(
    channel: tonic::transport::Channel,
    token: &str,
    dir: &std::path::Path,
) -> Result<Vec<pb::ConvergeEvent>, tonic::Status> {
    let (req, contexts) = kiln_e2e::wire::up_request(dir, false);
    let mut client = pb::kiln_client::KilnClient::with_interceptor(channel.clone(), kiln_e2e::trust::with_token(token));
    let mut stream = client.up(req).await?.into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await? {
        if event.kind() == pb::converge_event::Kind::NeedContexts {
            let mut store = pb::content_store_client::ContentStoreClient::with_interceptor(
                channel.clone(),
                kiln_e2e::trust::with_token(token),
            );
            for digest in &event.contexts {
                let (dir, opts) = &contexts[digest];
                let tree = kiln_core::digest::walk_tree(dir, opts).unwrap();
                let mut bytes = Vec::new();
                kiln_core::archive::pack(&tree, &mut bytes).unwrap();
                let chunk = pb::UploadChunk { digest: digest.clone(), data: bytes.into() };
                store.upload(tokio_stream::once(chunk)).await?;
            }
        }
        events.push(event);
    }
    Ok(events)
}
