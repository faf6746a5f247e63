//! The coordinator's Kubernetes side against a fake API server: no API server can run on these
//! machines, so every test here hands `kube` a client over `tower-test`'s mock service and answers
//! its requests from a named scenario of recorded responses (`tests/fixtures/kube/*.json`),
//! asserting each request's method, path, query and body on the way.
//!
//! The fake server also notes each request as the API server's authorizer would see it (verb,
//! group, resource), and the last test checks the ClusterRole in `deploy/kubernetes` against what
//! every scenario here asked for: nothing missing, nothing extra.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use kiln_coordinator::kube::{
    delete_images, gather_roots, pod_images, stale_notes, stale_workloads, write_images, CustomResource, KubeConfig,
    KubeError,
};
use serde_json::{json, Value};
use tokio::task::JoinHandle;
use tower_test::mock::{self, Handle};

use ::kube::client::Body;
use ::kube::Client;

/// What the fake API server does with one request: what it must be, and what it answers.
struct Exchange {
    method: Method,
    path: String,
    /// Query parameters the request must carry (decoded), besides any others.
    query: Vec<(&'static str, String)>,
    status: StatusCode,
    /// The answer; `None` echoes the request's body (what a server-side apply returns).
    reply: Option<Value>,
}

impl Exchange {
    fn get(path: &str, reply: &str) -> Exchange {
        Exchange::answer(Method::GET, path, StatusCode::OK, reply)
    }
    fn answer(method: Method, path: &str, status: StatusCode, reply: &str) -> Exchange {
        let reply = serde_json::from_str(reply).expect("fixture is JSON");
        Exchange { method, path: path.to_string(), query: Vec::new(), status, reply: Some(reply) }
    }
    fn with(mut self, key: &'static str, value: &str) -> Exchange {
        self.query.push((key, value.to_string()));
        self
    }
}

/// The fake API server's named scenarios.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Scenario {
    /// `kiln up` of `shop` into namespace `shop`: label the namespace, apply `kiln-images`.
    ConfigMapApplied,
    /// Two labeled namespaces: `shop` (ConfigMap, one sandbox with an image, pods) and `tools`
    /// (no ConfigMap yet, nothing running), then the system namespace's pods.
    RootsOfTwoNamespaces,
    /// The coordinator may not list namespaces.
    NamespacesForbidden,
    /// Namespaces list fine, but `shop`'s pods are forbidden.
    PodsForbidden,
    /// The pods of `shop`, some on older refs of its images.
    ShopPods,
    /// `kiln down shop`: find its ConfigMap by label, delete it.
    DownDeletesConfigMap,
    /// A cluster's platform set: its Node objects, an amd64 and an arm64 node and one whose
    /// kubelet has not reported yet.
    ClusterNodes,
    /// A whole served coordinator: `kiln up` of `shop` publishes, reports and sweeps with the
    /// cluster's roots; `kiln down shop` deletes the ConfigMap and sweeps again; a `kiln gc` that
    /// cannot list namespaces fails.
    UpDownGc,
}

fn fixture(name: &str) -> String {
    let path = format!("{}/tests/fixtures/kube/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("fixture {path}: {err}"))
}

impl Scenario {
    fn exchanges(self) -> Vec<Exchange> {
        let pods = |ns: &str, file: &str| Exchange::get(&format!("/api/v1/namespaces/{ns}/pods"), &fixture(file));
        let sandboxes = |ns: &str, file: &str| {
            Exchange::get(&format!("/apis/sandbox.kiln.dev/v1/namespaces/{ns}/sandboxes"), &fixture(file))
        };
        let namespaces = || {
            Exchange::get("/api/v1/namespaces", &fixture("namespaces.json")).with("labelSelector", "kiln.dev/instance")
        };
        match self {
            Scenario::ConfigMapApplied => {
                let apply = |path: &str| Exchange {
                    method: Method::PATCH,
                    path: path.to_string(),
                    query: vec![("fieldManager", "kiln".to_string()), ("force", "true".to_string())],
                    status: StatusCode::OK,
                    reply: None,
                };
                vec![apply("/api/v1/namespaces/shop"), apply("/api/v1/namespaces/shop/configmaps/kiln-images")]
            }
            Scenario::RootsOfTwoNamespaces => vec![
                namespaces(),
                Exchange::get("/api/v1/namespaces/shop/configmaps/kiln-images", &fixture("configmap-shop.json")),
                sandboxes("shop", "sandboxes-shop.json"),
                pods("shop", "pods-shop.json"),
                Exchange::answer(
                    Method::GET,
                    "/api/v1/namespaces/tools/configmaps/kiln-images",
                    StatusCode::NOT_FOUND,
                    &fixture("not-found.json"),
                ),
                sandboxes("tools", "sandboxes-empty.json"),
                pods("tools", "pods-empty.json"),
                pods("kube-system", "pods-kube-system.json"),
            ],
            Scenario::NamespacesForbidden => vec![Exchange::answer(
                Method::GET,
                "/api/v1/namespaces",
                StatusCode::FORBIDDEN,
                &fixture("forbidden.json"),
            )],
            Scenario::PodsForbidden => vec![
                namespaces(),
                Exchange::get("/api/v1/namespaces/shop/configmaps/kiln-images", &fixture("configmap-shop.json")),
                Exchange::answer(
                    Method::GET,
                    "/api/v1/namespaces/shop/pods",
                    StatusCode::FORBIDDEN,
                    &fixture("forbidden.json"),
                ),
            ],
            Scenario::ShopPods => vec![pods("shop", "pods-shop.json")],
            Scenario::UpDownGc => {
                let mut all = Scenario::ConfigMapApplied.exchanges();
                all.push(pods("shop", "pods-shop.json"));
                let roots = || {
                    let mut roots = Scenario::RootsOfTwoNamespaces.exchanges();
                    // This coordinator configures no custom resources.
                    roots.retain(|e| !e.path.contains("/sandboxes"));
                    roots
                };
                all.extend(roots());
                all.extend(Scenario::DownDeletesConfigMap.exchanges());
                all.extend(roots());
                all.extend(Scenario::NamespacesForbidden.exchanges());
                all
            }
            Scenario::ClusterNodes => vec![Exchange::get("/api/v1/nodes", &fixture("nodes.json"))],
            Scenario::DownDeletesConfigMap => vec![
                Exchange::get("/api/v1/configmaps", &fixture("configmaps-of-shop.json"))
                    .with("labelSelector", "kiln.dev/instance=shop")
                    .with("fieldSelector", "metadata.name=kiln-images"),
                Exchange::answer(
                    Method::DELETE,
                    "/api/v1/namespaces/shop/configmaps/kiln-images",
                    StatusCode::OK,
                    &fixture("configmap-shop.json"),
                ),
            ],
        }
    }
}

/// The API server's side of the mock pair: answers a scenario's requests in order.
struct ApiServer(Handle<Request<Body>, Response<Body>>);

/// A client whose every request reaches the returned fake API server.
fn fake_cluster() -> (Client, ApiServer) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    (Client::new(service, "default"), ApiServer(handle))
}

fn decode(raw: &str) -> String {
    let bytes = raw.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
                out.push(u8::from_str_radix(hex, 16).unwrap());
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap()
}

/// One request as the API server's authorizer sees it: a verb on a resource of an API group.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Access {
    /// `""` for the core group (`/api/v1`).
    group: String,
    /// The resource's plural, with `/subresource` when the path names one (`pods/log`).
    resource: String,
    verb: String,
}

impl Access {
    /// The verbs RBAC checks `request` against (Kubernetes' "request attributes"): the HTTP method
    /// on a collection or an object path, a `watch` query, and one rule of the API server's own —
    /// a server-side apply (a PATCH of type `apply-patch`) that finds no object creates it, and is
    /// authorized as `create` too. The fake server cannot know whether the object would exist, and
    /// the code applies in order to create, so an apply counts as both.
    fn of(request: &Request<Body>) -> Vec<Access> {
        let path = request.uri().path();
        let (group, rest) = if let Some(rest) = path.strip_prefix("/api/v1") {
            (String::new(), rest)
        } else if let Some(rest) = path.strip_prefix("/apis/") {
            let mut parts = rest.splitn(3, '/');
            let group = parts.next().unwrap_or_default().to_string();
            let _version = parts.next();
            (group, parts.next().map_or("", |r| r))
        } else {
            panic!("{path}: not a Kubernetes API path");
        };
        let segments: Vec<&str> = rest.split('/').filter(|s| !s.is_empty()).collect();
        // `namespaces/NS/RESOURCE[/NAME[/SUB]]` is namespaced; anything else is `RESOURCE[/NAME[/SUB]]`
        // (a cluster-scoped resource, a namespace itself, or a list across namespaces).
        let scoped = match segments.as_slice() {
            ["namespaces", _namespace, scoped @ ..] if !scoped.is_empty() => scoped,
            all => all,
        };
        let (resource, is_object) = match scoped {
            [resource] => (resource.to_string(), false),
            [resource, _name] => (resource.to_string(), true),
            [resource, _name, sub] => (format!("{resource}/{sub}"), true),
            _ => panic!("{path}: no resource in the path"),
        };
        let watching =
            request.uri().query().unwrap_or("").split('&').any(|pair| matches!(pair, "watch=true" | "watch=1"));
        let is_apply = request
            .headers()
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/apply-patch"));
        let verbs: &[&str] = match (request.method().as_str(), is_object) {
            ("GET", _) if watching => &["watch"],
            ("GET", true) => &["get"],
            ("GET", false) => &["list"],
            ("POST", _) => &["create"],
            ("PUT", _) => &["update"],
            ("PATCH", _) if is_apply => &["patch", "create"],
            ("PATCH", _) => &["patch"],
            ("DELETE", true) => &["delete"],
            ("DELETE", false) => &["deletecollection"],
            (method, _) => panic!("{method} {path}: a method the Kubernetes API does not serve"),
        };
        verbs
            .iter()
            .map(|verb| Access { group: group.clone(), resource: resource.clone(), verb: verb.to_string() })
            .collect()
    }
}

/// What the fake API servers of one thread served, and in which scenarios.
#[derive(Default)]
struct Served {
    scenarios: BTreeSet<Scenario>,
    accesses: BTreeSet<Access>,
}

impl Served {
    fn note(&mut self, scenario: Scenario, accesses: Vec<Access>) {
        self.scenarios.insert(scenario);
        self.accesses.extend(accesses);
    }
}

thread_local! {
    /// Per thread, because every test here runs its fake server on its own thread (`#[tokio::test]`
    /// is a current-thread runtime): the RBAC check, rerunning the tests one after another on its
    /// thread, reads what they asked for and nothing from the tests running beside it.
    static SERVED: RefCell<Served> = RefCell::default();
}

impl ApiServer {
    /// Serves `scenario`; the handle yields the bodies of the requests that carried one, in order.
    fn run(mut self, scenario: Scenario) -> JoinHandle<Vec<(String, Value)>> {
        tokio::spawn(async move {
            let mut bodies = Vec::new();
            for (step, expected) in scenario.exchanges().into_iter().enumerate() {
                let next = tokio::time::timeout(Duration::from_secs(30), self.0.next_request()).await;
                let (request, send) = next
                    .unwrap_or_else(|_| panic!("{scenario:?} step {step}: no request came"))
                    .unwrap_or_else(|| panic!("{scenario:?} step {step}: the client went away"));
                let what = format!("{scenario:?} step {step}: {} {}", request.method(), request.uri());
                let access = Access::of(&request);
                SERVED.with(|served| served.borrow_mut().note(scenario, access));
                assert_eq!(request.method(), expected.method, "{what}");
                assert_eq!(request.uri().path(), expected.path, "{what}");
                let query: Vec<(String, String)> = request
                    .uri()
                    .query()
                    .unwrap_or("")
                    .split('&')
                    .filter_map(|pair| pair.split_once('='))
                    .map(|(k, v)| (decode(k), decode(v)))
                    .collect();
                for (key, value) in &expected.query {
                    assert!(query.iter().any(|(k, v)| k == key && v == value), "{what}: wants {key}={value}");
                }
                let content_type = request
                    .headers()
                    .get(http::header::CONTENT_TYPE)
                    .map(|v| v.to_str().unwrap().to_string())
                    .unwrap_or_default();
                let bytes = request.into_body().collect_bytes().await.unwrap();
                let body: Option<Value> =
                    if bytes.is_empty() { None } else { Some(serde_json::from_slice(&bytes).unwrap()) };
                let reply = match (expected.reply, &body) {
                    (Some(reply), _) => reply,
                    (None, Some(body)) => body.clone(),
                    (None, None) => panic!("{what}: an apply without a body"),
                };
                if let Some(body) = body {
                    bodies.push((content_type, body));
                }
                let response = Response::builder()
                    .status(expected.status)
                    .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                    .unwrap();
                send.send_response(response);
            }
            bodies
        })
    }
}

fn sandboxes() -> CustomResource {
    CustomResource {
        group: "sandbox.kiln.dev".into(),
        version: "v1".into(),
        kind: "Sandbox".into(),
        plural: "sandboxes".into(),
    }
}

fn kube_config(client: Client) -> KubeConfig {
    KubeConfig { custom_resources: vec![sandboxes()], ..KubeConfig::new(client) }
}

/// Fake API server (none can run here): a converge's publish labels the namespace and applies
/// `kiln-images` with every image's name → ref, labeled with the instance.
#[tokio::test]
async fn the_configmap_write_applies_the_instance_images_and_labels() {
    let (client, server) = fake_cluster();
    let served = server.run(Scenario::ConfigMapApplied);
    let images = vec![
        ("api".to_string(), "shop-api:4a77b1".to_string()),
        ("web".to_string(), "registry.example:5000/shop-web:77aa01".to_string()),
    ];
    write_images(&client, "shop", "shop", &images).await.unwrap();
    let bodies = served.await.unwrap();
    assert_eq!(bodies.len(), 2);
    for (content_type, _) in &bodies {
        assert_eq!(content_type, "application/apply-patch+yaml", "a server-side apply");
    }
    assert_eq!(
        bodies[0].1,
        json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": { "name": "shop", "labels": { "kiln.dev/instance": "shop" } },
        })
    );
    assert_eq!(
        bodies[1].1,
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": { "name": "kiln-images", "namespace": "shop", "labels": { "kiln.dev/instance": "shop" } },
            "data": { "api": "shop-api:4a77b1", "web": "registry.example:5000/shop-web:77aa01" },
        })
    );
}

/// Fake API server (none can run here): roots are the ConfigMap's refs, the sandboxes'
/// `spec.image`, every pod image and resolved image id in the labeled namespaces, and the system
/// namespace's pods — and nothing else (the sandbox without an image names nothing).
#[tokio::test]
async fn roots_come_from_configmaps_custom_resources_and_pods() {
    let (client, server) = fake_cluster();
    let served = server.run(Scenario::RootsOfTwoNamespaces);
    let roots = gather_roots(&kube_config(client)).await.unwrap();
    served.await.unwrap();
    let expected = [
        // shop's kiln-images
        "shop-api:4a77b1",
        "registry.example:5000/shop-web:77aa01",
        // shop's sandbox
        "shop-sandbox:5e5e5e",
        // shop's pods: containers, init containers, then each status's image and imageID
        "shop-api:9c1e02",
        "shop-migrate:3",
        "docker.io/library/shop-api:9c1e02",
        "shop-api@sha256:1111111111111111111111111111111111111111111111111111111111111111",
        "shop-api:9c1e02",
        "shop-api:4a77b1",
        "registry.example:5000/shop-web:0000aa",
        "registry.example:5000/shop-web:3b3b3b",
        // kube-system
        "kiln-agent:0.1",
        "sha256:2222222222222222222222222222222222222222222222222222222222222222",
    ];
    assert_eq!(roots, expected.map(String::from).to_vec());
}

/// Fake API server (none can run here): without the namespaces the sweep would guess, so
/// gathering fails naming what could not be listed.
#[tokio::test]
async fn a_forbidden_namespace_list_fails_the_roots() {
    let (client, server) = fake_cluster();
    let served = server.run(Scenario::NamespacesForbidden);
    let err = gather_roots(&kube_config(client)).await.unwrap_err();
    served.await.unwrap();
    assert!(matches!(err, KubeError::Namespaces(_)), "{err:?}");
    assert!(err.to_string().contains("namespaces labeled kiln.dev/instance"), "{err}");
}

/// Fake API server (none can run here): one unreadable namespace's pods fail the whole gathering,
/// naming the namespace — partial roots are never returned.
#[tokio::test]
async fn unreadable_pods_fail_the_roots_naming_the_namespace() {
    let (client, server) = fake_cluster();
    let served = server.run(Scenario::PodsForbidden);
    // Without custom resources the scenario's next read after the ConfigMap is the pods.
    let err = gather_roots(&KubeConfig::new(client)).await.unwrap_err();
    served.await.unwrap();
    match &err {
        KubeError::Read { what, namespace, .. } => assert_eq!((what.as_str(), namespace.as_str()), ("pods", "shop")),
        other => panic!("expected a read error, got {other:?}"),
    }
}

/// Fake API server (none can run here): running pods on older tags of the recorded images are
/// counted per old ref; a finished pod and a pod on the new ref are not.
#[tokio::test]
async fn workloads_on_older_refs_are_reported_not_touched() {
    let (client, server) = fake_cluster();
    let served = server.run(Scenario::ShopPods);
    let images = vec![
        ("api".to_string(), "shop-api:4a77b1".to_string()),
        ("web".to_string(), "registry.example:5000/shop-web:77aa01".to_string()),
        ("worker".to_string(), "shop-worker:1".to_string()),
    ];
    let notes = stale_workloads(&client, "shop", &images).await.unwrap();
    served.await.unwrap();
    assert_eq!(
        notes,
        vec![
            "2 running workloads keep shop-api:9c1e02; new ones use :4a77b1".to_string(),
            "1 running workload keeps registry.example:5000/shop-web:3b3b3b; new ones use :77aa01".to_string(),
        ]
    );
}

/// Fake API server (none can run here): `kiln down` finds the instance's ConfigMap by label and
/// deletes it where it is.
#[tokio::test]
async fn down_deletes_the_instance_configmap() {
    let (client, server) = fake_cluster();
    let served = server.run(Scenario::DownDeletesConfigMap);
    let deleted = delete_images(&client, "shop").await.unwrap();
    served.await.unwrap();
    assert_eq!(deleted, vec!["shop".to_string()]);
}

/// Pure: a pod's images include init containers and the kubelet's resolved ids without scheme.
#[test]
fn pod_images_read_spec_and_status() {
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": { "name": "p" },
        "spec": {
            "initContainers": [ { "name": "i", "image": "init:1" } ],
            "containers": [ { "name": "c", "image": "app:2" } ]
        },
        "status": { "containerStatuses": [ {
            "name": "c", "image": "app:2", "imageID": "docker://sha256:3333333333333333333333333333333333333333333333333333333333333333",
            "ready": true, "restartCount": 0
        } ] }
    }))
    .unwrap();
    assert_eq!(
        pod_images(&pod),
        vec!["app:2", "init:1", "app:2", "sha256:3333333333333333333333333333333333333333333333333333333333333333"]
    );
}

/// Pure: a digest-only container image is not called older, and an image nobody runs is silent.
#[test]
fn digest_only_containers_are_not_reported() {
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": { "name": "p" },
        "spec": { "containers": [ { "name": "c", "image": "shop-api@sha256:4444444444444444444444444444444444444444444444444444444444444444" } ] },
        "status": { "phase": "Running" }
    }))
    .unwrap();
    let images = vec![("api".to_string(), "shop-api:4a77b1".to_string())];
    assert!(stale_notes(&[pod], &images).is_empty());
}

/// Reads a converge's events to its end.
async fn converge_events(
    stream: tonic::Streaming<kiln_proto::v1::ConvergeEvent>,
) -> Vec<kiln_proto::v1::ConvergeEvent> {
    use tokio_stream::StreamExt;
    stream.map(|event| event.expect("the event stream holds")).collect().await
}

/// A coordinator served on a free loopback port with the fake cluster's client as its
/// `--kubernetes`, its state in a temp dir; stopped by [`ServedCoordinator::stop`].
struct ServedCoordinator {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), kiln_coordinator::ServeError>>,
    _state: tempfile::TempDir,
}

impl ServedCoordinator {
    async fn start(
        client: Client,
    ) -> (kiln_proto::v1::kiln_client::KilnClient<tonic::transport::Channel>, ServedCoordinator) {
        let state = tempfile::tempdir().unwrap();
        let mut config = kiln_coordinator::Config::new(state.path(), "farm-k8s");
        config.kubernetes = Some(KubeConfig::new(client));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(kiln_coordinator::serve(listener, config, async {
            let _ = stopped.await;
        }));
        let channel = tonic::transport::Endpoint::from_shared(url).unwrap().connect_lazy();
        (kiln_proto::v1::kiln_client::KilnClient::new(channel), ServedCoordinator { stop, task, _state: state })
    }

    async fn stop(self) {
        self.stop.send(()).unwrap();
        self.task.await.unwrap().unwrap();
    }
}

/// Fake API server (none can run here), real coordinator: a served coordinator configured with
/// the fake cluster publishes `kiln-images` after recording `shop`, reports the pods on its older
/// ref, sweeps with the cluster's roots; `kiln down` deletes the ConfigMap; and a gc whose
/// namespace list is forbidden fails rather than sweeping on guessed roots.
#[tokio::test]
async fn a_served_converge_publishes_reports_and_down_unpublishes() {
    use kiln_proto::v1 as pb;

    let (client, server) = fake_cluster();
    let served = server.run(Scenario::UpDownGc);
    let (mut kiln, coordinator) = ServedCoordinator::start(client).await;

    let up = pb::UpRequest {
        instance: "shop".into(),
        target: Some(pb::Target {
            kind: pb::target::Kind::Local as i32,
            namespace: "shop".into(),
            ..Default::default()
        }),
        platforms: vec!["linux/amd64".into()],
        images: vec![pb::ImageSpec {
            name: "api".into(),
            kind: pb::image_spec::Kind::Brought as i32,
            reference: "shop-api:4a77b1".into(),
            ..Default::default()
        }],
        requested_by: "test".into(),
        ..Default::default()
    };
    let events = converge_events(kiln.up(up).await.unwrap().into_inner()).await;
    let notes: Vec<&str> =
        events.iter().filter(|e| e.kind() == pb::converge_event::Kind::Note).map(|e| e.message.as_str()).collect();
    assert!(notes.contains(&"ConfigMap kiln-images in namespace shop names 1 image(s)"), "{notes:?}");
    assert!(notes.contains(&"2 running workloads keep shop-api:9c1e02; new ones use :4a77b1"), "{notes:?}");
    assert_eq!(events.last().unwrap().outcome(), pb::Outcome::Succeeded, "{events:?}");

    let down = pb::DownRequest { instance: "shop".into(), requested_by: "test".into() };
    let events = converge_events(kiln.down(down).await.unwrap().into_inner()).await;
    assert!(events.iter().any(|e| e.message == "deleted ConfigMap kiln-images in namespace shop"), "{events:?}");
    assert_eq!(events.last().unwrap().outcome(), pb::Outcome::Succeeded, "{events:?}");

    let gc = pb::GcRequest { requested_by: "test".into(), ..Default::default() };
    let events = converge_events(kiln.gc(gc).await.unwrap().into_inner()).await;
    let last = events.last().unwrap();
    assert_eq!(last.outcome(), pb::Outcome::Failed, "{events:?}");
    assert!(last.message.contains("Kubernetes roots"), "{}", last.message);

    let bodies = served.await.unwrap();
    assert_eq!(bodies[1].1["data"], json!({ "api": "shop-api:4a77b1" }));
    coordinator.stop().await;
}

/// Fake API server (none can run here), real coordinator: with `--kubernetes`, a cluster's
/// platform set (`platforms = "cluster"`) includes every Node's reported architecture; a node
/// whose kubelet has not reported one adds none.
#[tokio::test]
async fn a_clusters_platforms_include_what_its_kubelets_report() {
    use kiln_proto::v1 as pb;

    let (client, server) = fake_cluster();
    let served = server.run(Scenario::ClusterNodes);
    let (mut kiln, coordinator) = ServedCoordinator::start(client).await;

    let ask = pb::ClusterPlatformsRequest { kind: "nodes".into(), cluster: "edge".into() };
    let reply = kiln.cluster_platforms(ask).await.unwrap().into_inner();
    assert_eq!(reply.platforms, vec!["linux/amd64", "linux/arm64"]);
    assert!(reply.sources.contains(&"Kubernetes node edge-b: linux/arm64".to_string()), "{:?}", reply.sources);
    served.await.unwrap();
    coordinator.stop().await;
}

/// Against a real cluster (the ambient kubeconfig; none runs on these machines): publish an
/// instance into a scratch namespace, find its refs among the roots, and unpublish it.
#[tokio::test]
#[ignore = "needs cluster"]
async fn a_real_cluster_round_trip() {
    let client = Client::try_default().await.expect("a kubeconfig or service account");
    let images = vec![("api".to_string(), "kiln-roundtrip-api:0001".to_string())];
    write_images(&client, "kiln-roundtrip", "kiln-roundtrip", &images).await.unwrap();
    let roots = gather_roots(&KubeConfig::new(client.clone())).await.unwrap();
    assert!(roots.contains(&"kiln-roundtrip-api:0001".to_string()), "{roots:?}");
    assert_eq!(delete_images(&client, "kiln-roundtrip").await.unwrap(), vec!["kiln-roundtrip".to_string()]);
}

impl Scenario {
    const ALL: [Scenario; 8] = [
        Scenario::ClusterNodes,
        Scenario::ConfigMapApplied,
        Scenario::RootsOfTwoNamespaces,
        Scenario::NamespacesForbidden,
        Scenario::PodsForbidden,
        Scenario::ShopPods,
        Scenario::DownDeletesConfigMap,
        Scenario::UpDownGc,
    ];

    /// The test that serves this scenario. A new scenario does not compile until it is named
    /// here (and in `ALL`, above), so the RBAC check below reruns it too.
    fn test(self) -> fn() {
        match self {
            Scenario::ClusterNodes => a_clusters_platforms_include_what_its_kubelets_report,
            Scenario::ConfigMapApplied => the_configmap_write_applies_the_instance_images_and_labels,
            Scenario::RootsOfTwoNamespaces => roots_come_from_configmaps_custom_resources_and_pods,
            Scenario::NamespacesForbidden => a_forbidden_namespace_list_fails_the_roots,
            Scenario::PodsForbidden => unreadable_pods_fail_the_roots_naming_the_namespace,
            Scenario::ShopPods => workloads_on_older_refs_are_reported_not_touched,
            Scenario::DownDeletesConfigMap => down_deletes_the_instance_configmap,
            Scenario::UpDownGc => a_served_converge_publishes_reports_and_down_unpublishes,
        }
    }
}

/// The role the deploy files bind to the coordinator's service account.
const CLUSTER_ROLE: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/kubernetes/base/coordinator-clusterrole.yaml");

/// Every (group, resource, verb) `path`'s ClusterRole grants, refusing what this check cannot
/// compare: wildcards, rules narrowed to object names, non-resource URLs.
fn granted_by(path: &str) -> BTreeSet<Access> {
    use k8s_openapi::api::rbac::v1::ClusterRole;
    let text = std::fs::read_to_string(path).unwrap_or_else(|err| panic!("{path}: {err}"));
    let role: ClusterRole = serde_saphyr::from_str(&text).unwrap_or_else(|err| panic!("{path}: {err}"));
    let mut granted = BTreeSet::new();
    for rule in role.rules.unwrap_or_default() {
        assert!(
            rule.resource_names.is_none() && rule.non_resource_urls.is_none(),
            "{path}: a rule with resourceNames or nonResourceURLs — the check compares whole resources"
        );
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    assert!(
                        [group, resource, verb].iter().all(|part| part.as_str() != "*"),
                        "{path}: a wildcard grants what no test can list"
                    );
                    granted.insert(Access { group: group.clone(), resource: resource.clone(), verb: verb.clone() });
                }
            }
        }
    }
    granted
}

fn listed(accesses: &BTreeSet<Access>) -> String {
    let lines: Vec<String> = accesses
        .iter()
        .map(|a| {
            format!(
                "  {} on {}{}",
                a.verb,
                a.resource,
                if a.group.is_empty() { String::new() } else { format!(".{}", a.group) }
            )
        })
        .collect();
    lines.join("\n")
}

/// Fake API server (none can run here): every scenario above is served again, noting each
/// request as the authorizer sees it, and the ClusterRole in deploy/kubernetes must grant exactly
/// that. A missing grant would fail the first converge or sweep in a real cluster; an extra one
/// is a permission no code of Kiln's uses. Custom resources are the operator's to grant for each
/// `--custom-resource` they pass (deploy/README.md says `list`): only that verb is checked.
#[test]
fn the_deployed_cluster_role_grants_exactly_what_the_coordinator_asks_for() {
    for scenario in Scenario::ALL {
        scenario.test()();
    }
    let served = SERVED.with(|served| std::mem::take(&mut *served.borrow_mut()));
    assert_eq!(served.scenarios, BTreeSet::from(Scenario::ALL), "each test serves the scenario it is named for");

    let custom = sandboxes();
    let (custom_uses, uses): (BTreeSet<Access>, BTreeSet<Access>) =
        served.accesses.into_iter().partition(|a| a.group == custom.group && a.resource == custom.plural);
    let custom_verbs: Vec<&str> = custom_uses.iter().map(|a| a.verb.as_str()).collect();
    assert_eq!(custom_verbs, ["list"], "deploy/README.md tells operators to grant `list` on each --custom-resource");

    let granted = granted_by(CLUSTER_ROLE);
    let missing: BTreeSet<Access> = uses.difference(&granted).cloned().collect();
    let unused: BTreeSet<Access> = granted.difference(&uses).cloned().collect();
    assert!(
        missing.is_empty() && unused.is_empty(),
        "{CLUSTER_ROLE} must grant exactly what the coordinator asks for.\nused, not granted:\n{}\ngranted, never used:\n{}",
        listed(&missing),
        listed(&unused)
    );
}
