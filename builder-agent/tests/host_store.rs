//! The host store against the machine's real Docker daemon and a real registry. Images are built
//! `FROM scratch` (nothing can be pulled here) under unique `kiln-test/…` names, so the tests run
//! in parallel and remove only what they created.

mod support;

use kiln_agent::host::{verify_context, BuildSpec, DockerStore, HostError, HostStore, Removal};
use kiln_core::archive::ArchiveError;
use kiln_core::sweep::{LABEL_FARM, LABEL_KIND};
use std::collections::BTreeMap;
use support::{build, context, image_files, kiln_labels, spec, store, unique, Cleanup, Registry};

#[tokio::test]
async fn a_build_streams_its_log_and_stamps_all_four_labels() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let ctx = context(&[("Dockerfile", "FROM scratch\nCOPY hello.txt /\n"), ("hello.txt", "hello\n")]);
    let tag = cleanup.tag(format!("{}:1", unique("labels")));
    let labels = kiln_labels("farm-a", &ctx.digest);
    let (built, log) = build(&store, &ctx.archive, &BuildSpec { labels: labels.clone(), ..spec(&tag) }).await;
    let built = built.unwrap();

    // BuildKit's log: steps numbered as `docker build` prints them (`#3 [1/1] COPY …`).
    assert!(log.iter().any(|l| l.starts_with('#') && l.contains("COPY hello.txt /")), "{log:#?}");
    let info = store.inspect(&tag).await.unwrap().expect("the tag exists after the build");
    assert_eq!(info.id, built.id);
    assert!(info.repo_tags.contains(&tag), "{:?}", info.repo_tags);
    for (key, value) in &labels {
        assert_eq!(info.labels.get(key), Some(value), "label {key}");
    }
    assert_eq!(image_files(&tag).await, ["hello.txt".to_string()].into());
}

#[tokio::test]
async fn a_build_arg_takes_effect() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let ctx = context(&[("Dockerfile", "FROM scratch\nARG PICK\nCOPY ${PICK} /\n"), ("a", "a"), ("b", "b")]);
    let repo = unique("args");
    for pick in ["a", "b"] {
        let tag = cleanup.tag(format!("{repo}:{pick}"));
        let args = BTreeMap::from([("PICK".to_string(), pick.to_string())]);
        build(&store, &ctx.archive, &BuildSpec { args, ..spec(&tag) }).await.0.unwrap();
        assert_eq!(image_files(&tag).await, [pick.to_string()].into());
    }
}

#[tokio::test]
async fn the_target_stage_is_the_one_built_and_labeled() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let dockerfile = "FROM scratch AS one\nCOPY a /\nFROM scratch AS two\nCOPY b /\n";
    let ctx = context(&[("Dockerfile", dockerfile), ("a", "a"), ("b", "b")]);
    let repo = unique("target");
    let labels = kiln_labels("farm-a", &ctx.digest);
    for (stage, file) in [("one", "a"), ("two", "b")] {
        let tag = cleanup.tag(format!("{repo}:{stage}"));
        let spec = BuildSpec { target: Some(stage.to_string()), labels: labels.clone(), ..spec(&tag) };
        build(&store, &ctx.archive, &spec).await.0.unwrap();
        assert_eq!(image_files(&tag).await, [file.to_string()].into(), "stage {stage}");
        assert_eq!(
            store.inspect(&tag).await.unwrap().unwrap().labels.get(LABEL_KIND).map(String::as_str),
            Some("image")
        );
    }
}

#[tokio::test]
async fn the_platform_reaches_the_build() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let ctx = context(&[("Dockerfile", "FROM scratch\nCOPY f /\n"), ("f", "platform")]);
    let tag = cleanup.tag(format!("{}:arm64", unique("platform")));
    build(&store, &ctx.archive, &BuildSpec { platform: Some("linux/arm64".into()), ..spec(&tag) }).await.0.unwrap();
    let image = support::docker().await.inspect_image(&tag).await.unwrap();
    assert_eq!((image.os.as_deref(), image.architecture.as_deref()), (Some("linux"), Some("arm64")));
}

#[tokio::test]
async fn an_outside_dockerfile_is_used_and_the_build_sees_only_the_context() {
    let (store, cleanup) = (store().await, Cleanup::default());
    // The context's own Dockerfile would fail: the build must use the outside one. Contents unique
    // to the run: the classic builder must not take a cached step another build may remove.
    let a = unique("a");
    let ctx = context(&[("Dockerfile", "FROM scratch\nCOPY missing /\n"), ("a.txt", a.as_str())]);
    let tag = cleanup.tag(format!("{}:1", unique("outside")));
    let spec = BuildSpec { dockerfile_outside: Some(b"FROM scratch\nCOPY . /ctx/\n".to_vec()), ..spec(&tag) };
    build(&store, &ctx.archive, &spec).await.0.unwrap();
    let files = image_files(&tag).await;
    assert_eq!(files, ["ctx", "ctx/Dockerfile", "ctx/a.txt"].map(String::from).into());
}

#[tokio::test]
async fn an_outside_dockerfile_copying_named_paths_builds_with_buildkit_and_copies_just_those() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let ctx = context(&[
        (".dockerignore", "Dockerfile\n"),
        ("Dockerfile", "FROM scratch\n"),
        ("a.txt", "a, for the outside BuildKit test"),
    ]);
    let tag = cleanup.tag(format!("{}:1", unique("outside-bk")));
    let spec = BuildSpec { dockerfile_outside: Some(b"FROM scratch\nCOPY a.txt /ctx/\n".to_vec()), ..spec(&tag) };
    let (built, log) = build(&store, &ctx.archive, &spec).await;
    built.unwrap();
    assert!(log.iter().any(|l| l.starts_with('#') && l.contains("COPY a.txt /ctx/")), "BuildKit's log: {log:#?}");
    assert_eq!(image_files(&tag).await, ["ctx", "ctx/a.txt"].map(String::from).into());
}

#[tokio::test]
async fn an_outside_dockerfile_leaves_a_self_ignoring_dockerignore_as_it_was() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let a = unique("a");
    let ctx = context(&[(".dockerignore", "*.log\n.dockerignore"), ("a.txt", a.as_str()), ("debug.log", "x")]);
    let tag = cleanup.tag(format!("{}:1", unique("outside-ignore")));
    let spec = BuildSpec { dockerfile_outside: Some(b"FROM scratch\nCOPY . /ctx/\n".to_vec()), ..spec(&tag) };
    build(&store, &ctx.archive, &spec).await.0.unwrap();
    assert_eq!(image_files(&tag).await, ["ctx", "ctx/a.txt"].map(String::from).into());
}

#[tokio::test]
async fn a_failing_build_names_its_step_and_leaves_no_tag() {
    let (store, cleanup) = (store().await, Cleanup::default());
    // The failing step comes first so that no intermediate image of the build outlives the test.
    let ctx = context(&[("Dockerfile", "FROM scratch\nCOPY missing /\nCOPY present /\n"), ("present", "p")]);
    let tag = cleanup.tag(format!("{}:1", unique("fails")));
    let (built, _) = build(&store, &ctx.archive, &spec(&tag)).await;
    match built {
        Err(HostError::BuildFailed { tag: failed, step }) => {
            assert_eq!(failed, tag);
            assert!(step.starts_with("[1/2] COPY missing /"), "{step}");
            assert!(step.contains("not found"), "{step}");
        }
        other => panic!("expected BuildFailed, got {other:?}"),
    }
    assert_eq!(store.inspect(&tag).await.unwrap(), None);
}

#[tokio::test]
async fn a_dockerignore_naming_the_dockerfile_keeps_it_out_of_the_image_through_the_classic_builder() {
    let (store, cleanup) = (store().await, Cleanup::default());
    // Contents no other test builds: the classic builder's cache must not share a step with a test
    // that removes its images. BuildKit ignores `.dockerignore` for a context sent as the request body, and the Dockerfile
    // and `.dockerignore` always travel: such a build must go to the classic builder.
    let ctx = context(&[
        ("Dockerfile", "FROM scratch\nCOPY . /ctx\n"),
        (".dockerignore", "Dockerfile\n.dockerignore\n"),
        ("a.txt", "a, for the ignoring test alone"),
    ]);
    let tag = cleanup.tag(format!("{}:1", unique("ignoresdf")));
    let (built, log) = build(&store, &ctx.archive, &spec(&tag)).await;
    built.unwrap();
    assert!(log.iter().any(|l| l.starts_with("Step ")), "the classic builder's log: {log:#?}");
    assert_eq!(image_files(&tag).await, ["ctx".to_string(), "ctx/a.txt".to_string()].into());

    // The same `.dockerignore`, but a Dockerfile that names what it copies: BuildKit, same result.
    let ctx = context(&[
        ("Dockerfile", "FROM scratch\nCOPY a.txt /ctx/\n"),
        (".dockerignore", "Dockerfile\n.dockerignore\n"),
        ("a.txt", "a, for the ignoring test alone"),
    ]);
    let tag = cleanup.tag(format!("{}:1", unique("ignoresdf-bk")));
    let (built, log) = build(&store, &ctx.archive, &spec(&tag)).await;
    built.unwrap();
    assert!(log.iter().any(|l| l.starts_with('#')), "BuildKit's log: {log:#?}");
    assert_eq!(image_files(&tag).await, ["ctx".to_string(), "ctx/a.txt".to_string()].into());
}

#[tokio::test]
async fn a_dockerfile_that_does_not_parse_fails_before_any_step() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let ctx = context(&[("Dockerfile", "FROM scratch\nNOSUCHINSTRUCTION x\n")]);
    let tag = cleanup.tag(format!("{}:1", unique("unparsable")));
    match build(&store, &ctx.archive, &spec(&tag)).await.0 {
        Err(HostError::BuildFailed { step, .. }) => {
            assert!(step.to_lowercase().contains("nosuchinstruction"), "{step}")
        }
        other => panic!("expected BuildFailed, got {other:?}"),
    }
}

/// What the agent's build task does: verify, and build only what verified.
async fn verified_build(
    store: &DockerStore,
    ctx: &support::Context,
    scratch: &std::path::Path,
    spec: &BuildSpec,
) -> Result<(), HostError> {
    verify_context(&ctx.archive, &ctx.digest, scratch)?;
    build(store, &ctx.archive, spec).await.0.map(|_| ())
}

#[tokio::test]
async fn a_tampered_archive_is_refused_and_nothing_is_built() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let scratch = tempfile::tempdir().unwrap();
    let ctx = context(&[("Dockerfile", "FROM scratch\nCOPY file /\n"), ("file", "the original content")]);
    let tag = cleanup.tag(format!("{}:1", unique("tampered")));
    verify_context(&ctx.archive, &ctx.digest, scratch.path()).expect("the untouched archive verifies");

    let mut bytes = std::fs::read(&ctx.archive).unwrap();
    let at = bytes.windows(8).position(|w| w == b"original").unwrap();
    bytes[at] ^= 0x20;
    std::fs::write(&ctx.archive, bytes).unwrap();

    match verified_build(&store, &ctx, scratch.path(), &spec(&tag)).await {
        Err(HostError::ContextRefused { source: ArchiveError::DigestMismatch { expected, .. }, .. }) => {
            assert_eq!(expected, ctx.digest)
        }
        other => panic!("expected a refused context, got {other:?}"),
    }
    assert_eq!(store.inspect(&tag).await.unwrap(), None, "nothing was built");
    assert_eq!(std::fs::read_dir(scratch.path()).unwrap().count(), 0, "the scratch copy is gone");
}

#[tokio::test]
async fn list_labeled_has_labeled_images_and_not_unlabeled_ones() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let labeled = context(&[("Dockerfile", "FROM scratch\nCOPY f /\n"), ("f", "labeled")]);
    let plain = context(&[("Dockerfile", "FROM scratch\nCOPY f /\n"), ("f", "plain")]);
    let repo = unique("listing");
    let (ours, theirs) = (cleanup.tag(format!("{repo}:labeled")), cleanup.tag(format!("{repo}:plain")));
    let labels = kiln_labels("farm-a", &labeled.digest);
    let our_id =
        build(&store, &labeled.archive, &BuildSpec { labels: labels.clone(), ..spec(&ours) }).await.0.unwrap().id;
    build(&store, &plain.archive, &spec(&theirs)).await.0.unwrap();

    let listed = store.list_labeled().await.unwrap();
    let mine = listed.iter().find(|image| image.refs.contains(&ours)).expect("the labeled image is listed");
    assert_eq!(mine.id, our_id);
    assert_eq!(mine.labels, labels);
    assert!(mine.bytes > 0);
    assert!(listed.iter().all(|image| !image.refs.contains(&theirs)), "the unlabeled image is not listed");
}

#[tokio::test]
async fn held_counts_only_this_farms_labeled_image_wearing_the_tag() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let ctx = context(&[("Dockerfile", "FROM scratch\nCOPY f /\n"), ("f", "held")]);
    let repo = unique("held");
    let (farmed, unlabeled) = (cleanup.tag(format!("{repo}:farmed")), cleanup.tag(format!("{repo}:unlabeled")));
    let labels = kiln_labels("farm-a", &ctx.digest);
    build(&store, &ctx.archive, &BuildSpec { labels, ..spec(&farmed) }).await.0.unwrap();
    build(&store, &ctx.archive, &spec(&unlabeled)).await.0.unwrap();

    assert!(store.held("farm-a", &farmed).await.is_some());
    assert!(store.held("farm-b", &farmed).await.is_none(), "another farm's image does not answer");
    assert!(store.held("farm-a", &unlabeled).await.is_none(), "an unlabeled image does not answer");
    assert!(store.held("farm-a", &format!("{repo}:absent")).await.is_none());
    let info = store.inspect(&unlabeled).await.unwrap().unwrap();
    assert!(!info.labels.contains_key(LABEL_KIND) && !info.labels.contains_key(LABEL_FARM));
}

#[tokio::test]
async fn inspect_of_a_missing_ref_is_none() {
    let store = store().await;
    assert_eq!(store.inspect(&format!("{}:nope", unique("missing"))).await.unwrap(), None);
}

#[tokio::test]
async fn user_is_the_declared_user_or_none() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let repo = unique("user");
    for (dockerfile, want) in
        [("FROM scratch\nCOPY f /\n", None), ("FROM scratch\nCOPY f /\nUSER 1000\n", Some("1000"))]
    {
        let ctx = context(&[("Dockerfile", dockerfile), ("f", "f")]);
        let tag = cleanup.tag(format!("{repo}:{}", want.unwrap_or("root")));
        build(&store, &ctx.archive, &spec(&tag)).await.0.unwrap();
        assert_eq!(store.inspect(&tag).await.unwrap().unwrap().user.as_deref(), want);
    }
}

#[tokio::test]
async fn a_push_reaches_the_registry_with_its_labels() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let registry = Registry::start();
    let ctx = context(&[("Dockerfile", "FROM scratch\nCOPY payload /\n"), ("payload", &"x".repeat(64 * 1024))]);
    let path = unique("pushed");
    let tag = cleanup.tag(format!("{}/{path}:v1", registry.addr));
    let labels = kiln_labels("farm-a", &ctx.digest);
    build(&store, &ctx.archive, &BuildSpec { labels: labels.clone(), ..spec(&tag) }).await.0.unwrap();

    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    let collector = tokio::spawn(async move {
        let mut progress = Vec::new();
        while let Some(update) = rx.recv().await {
            progress.push(update);
        }
        progress
    });
    let pushed = store.push(&tag, tx).await.unwrap();
    let progress = collector.await.unwrap();
    assert!(progress.iter().any(|p| !p.layer.is_empty() && p.total > 0), "{progress:?}");
    assert!(pushed.bytes > 0);

    let (_, tags) = registry.get_json(&format!("/v2/{path}/tags/list"), &[]);
    assert_eq!(tags["tags"], serde_json::json!(["v1"]));
    let accept = ("Accept", "application/vnd.docker.distribution.manifest.v2+json");
    let (response, manifest) = registry.get_json(&format!("/v2/{path}/manifests/v1"), &[accept]);
    assert_eq!(pushed.digest.as_deref(), response.headers.get("docker-content-digest").map(String::as_str));
    let config = manifest["config"]["digest"].as_str().unwrap();
    let (_, config) = registry.get_json(&format!("/v2/{path}/blobs/{config}"), &[]);
    for (key, value) in &labels {
        assert_eq!(config["config"]["Labels"][key], serde_json::json!(value), "label {key}");
    }
}

#[tokio::test]
async fn a_push_of_a_missing_image_or_to_a_dead_registry_fails_naming_the_ref() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let missing = format!("127.0.0.1:1/{}:v1", unique("nopush"));
    let (tx, _rx) = tokio::sync::mpsc::channel(16);
    match store.push(&missing, tx.clone()).await {
        Err(HostError::PushFailed { reference, .. }) => assert_eq!(reference, missing),
        other => panic!("expected PushFailed, got {other:?}"),
    }
    // Port 1 on loopback: nothing listens there, so the daemon cannot reach the registry.
    let ctx = context(&[("Dockerfile", "FROM scratch\nCOPY f /\n"), ("f", "dead")]);
    let tag = cleanup.tag(format!("127.0.0.1:1/{}:v1", unique("deadregistry")));
    build(&store, &ctx.archive, &spec(&tag)).await.0.unwrap();
    // A registry the daemon could not even connect to is its own kind: nothing was delivered, so
    // the task retries it on the ladder.
    match store.push(&tag, tx).await {
        Err(HostError::RegistryRefused { reference, why }) => {
            assert!(reference == tag && why.contains("connection refused"))
        }
        other => panic!("expected RegistryRefused, got {other:?}"),
    }
}

#[tokio::test]
async fn remove_tag_is_delete_if_present_and_spares_other_tags() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let ctx = context(&[("Dockerfile", "FROM scratch\nCOPY f /\n"), ("f", "removal")]);
    let repo = unique("remove");
    let (first, second) = (cleanup.tag(format!("{repo}:first")), cleanup.tag(format!("{repo}:second")));
    let id = build(&store, &ctx.archive, &spec(&first)).await.0.unwrap().id;
    let options = bollard::query_parameters::TagImageOptionsBuilder::default().repo(&repo).tag("second").build();
    support::docker().await.tag_image(&first, Some(options)).await.unwrap();

    assert_eq!(store.remove_tag(&first).await.unwrap(), Removal::Removed);
    assert_eq!(store.remove_tag(&first).await.unwrap(), Removal::Absent);
    assert_eq!(store.inspect(&first).await.unwrap(), None);
    assert_eq!(store.inspect(&second).await.unwrap().expect("the second tag survives").id, id);
}

#[tokio::test]
async fn remove_tag_refuses_a_ref_without_a_tag() {
    let store = store().await;
    assert!(matches!(store.remove_tag("kiln-test/untagged").await, Err(HostError::NotPushable { .. })));
}

#[tokio::test]
async fn images_in_use_names_a_stopped_containers_image_by_ref_and_by_id() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let ctx = context(&[("Dockerfile", "FROM scratch\nCOPY f /\n"), ("f", "in use")]);
    let tag = cleanup.tag(format!("{}:1", unique("inuse")));
    let id = build(&store, &ctx.archive, &spec(&tag)).await.0.unwrap().id;
    let created = std::process::Command::new("docker").args(["create", &tag, "/never-started"]).output().unwrap();
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let container = String::from_utf8(created.stdout).unwrap().trim().to_string();

    let used = store.images_in_use().await;
    let _ = std::process::Command::new("docker").args(["rm", "--force", &container]).output();
    let used = used.unwrap();
    assert!(used.contains(&tag), "{used:?}");
    assert!(used.contains(&id), "{used:?}");
}

#[tokio::test]
async fn an_untagged_labeled_image_is_listed_without_names_and_removed_by_id() {
    let (store, cleanup) = (store().await, Cleanup::default());
    let ctx = context(&[("Dockerfile", "FROM scratch\nCOPY f /\n"), ("f", "rebuilt")]);
    let tag = cleanup.tag(format!("{}:1", unique("untagged")));
    let labels = kiln_labels("farm-a", &ctx.digest);
    let first = build(&store, &ctx.archive, &BuildSpec { labels: labels.clone(), ..spec(&tag) }).await.0.unwrap().id;
    // Rebuilt without the cache, the tag moves to a new image and the first one keeps no name.
    let rebuilt = BuildSpec { labels, no_cache: true, ..spec(&tag) };
    let second = build(&store, &ctx.archive, &rebuilt).await.0.unwrap().id;
    assert_ne!(first, second);

    let listed = store.list_labeled().await.unwrap();
    let orphan = listed.iter().find(|image| image.id == first).expect("the untagged image is still listed");
    assert!(orphan.refs.is_empty(), "Docker's <none>:<none> is not a name: {:?}", orphan.refs);
    assert_eq!(store.remove_image(&first).await.unwrap(), Removal::Removed);
    assert_eq!(store.remove_image(&first).await.unwrap(), Removal::Absent);
    assert_eq!(store.inspect(&tag).await.unwrap().expect("the tag is untouched").id, second);
    assert!(matches!(store.remove_image(&tag).await, Err(HostError::NotAnImageId { .. })));
}

#[tokio::test]
async fn an_absent_daemon_is_named_in_the_error() {
    let err = DockerStore::connect("unix:///nonexistent/kiln-test.sock").await.unwrap_err();
    assert!(matches!(err, HostError::Unreachable { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "cannot reach the Docker daemon at unix:///nonexistent/kiln-test.sock — is it running?"
    );
}

#[tokio::test]
async fn ping_answers() {
    store().await.ping().await.unwrap();
}
