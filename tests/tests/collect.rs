//! What the sweep collects besides images, and how it counts (issue 13): uploaded contexts by
//! reachability; bytes as the layers really freed, shared ones once; and what a crash left behind —
//! a coordinator's half upload, an agent's context archive — removed at the next start.

use std::process::Command;

use kiln_e2e::fixture::{example, reference, remove_built, unique, write};
use kiln_e2e::wire::{down, gc, succeeded, up};
use kiln_e2e::{docker, Farm};
use kiln_proto::v1::converge_event::Kind;

fn contexts(farm: &Farm) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(farm.home.join("state/contexts"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|name| name.ends_with(".tar"))
        .collect();
    names.sort();
    names
}

fn tree(dir: &std::path::Path, image: &str) -> String {
    let (req, _) = kiln_e2e::wire::up_request(dir, false);
    format!("{}.tar", req.images.iter().find(|i| i.name == image).unwrap().context_digest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploaded_contexts_stay_while_a_record_names_them_and_go_after() {
    let tmp = tempfile::tempdir().unwrap();
    let instance = unique("ctxgc");
    let dir = example("hello", tmp.path(), "hello", &instance, None);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let mut built = Vec::new();

    assert!(succeeded(&up(&farm.url, &dir, false).await));
    let (web1, worker) = (tree(&dir, "web"), tree(&dir, "worker"));
    built.push(reference(&dir, "web"));
    write(&dir, "web/index.html", "<p>two</p>\n");
    assert!(succeeded(&up(&farm.url, &dir, false).await));
    let web2 = tree(&dir, "web");
    built.push(reference(&dir, "web"));
    assert!(contexts(&farm).contains(&web1), "the generation replaced still names web's first context");

    write(&dir, "web/index.html", "<p>three</p>\n");
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    built.push(reference(&dir, "web"));
    let web3 = tree(&dir, "web");
    let collected = events.iter().find(|e| e.kind() == Kind::ContextsCollected).expect("the sweep collected");
    assert_eq!(collected.count, 1, "{events:#?}");
    assert!(collected.bytes > 0);
    let mut kept = vec![web2.clone(), web3.clone(), worker.clone()];
    kept.sort();
    assert_eq!(contexts(&farm), kept, "web's first context went: no record names it any more");

    // Taken down: nothing names them; the down's sweep collects them all.
    let events = down(&farm.url, &instance).await;
    assert!(succeeded(&events), "{events:#?}");
    assert!(contexts(&farm).is_empty(), "{:?}", contexts(&farm));
    let events = gc(&farm.url, false, None).await;
    let collected = events.iter().find(|e| e.kind() == Kind::ContextsCollected).unwrap();
    assert_eq!(collected.count, 0, "a gc reports the content store too, even when it has nothing to take");
    farm.stop().await;
    built.iter().for_each(|r| docker::remove(r));
    remove_built(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_swept_images_sharing_a_layer_report_its_bytes_once() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let instance = unique("bytes");
    let (base, derived) = (format!("{instance}-base:1"), format!("{instance}-derived:1"));
    let labels = [
        ("kiln.dev/kind", "image"),
        ("kiln.dev/instance", instance.as_str()),
        ("kiln.dev/farm", farm.farm_id.as_str()),
    ];
    // 200 kB that do not compress to nothing, in one layer both images share.
    let content: String =
        (0..200_000u32).map(|i| char::from(b'a' + (i.wrapping_mul(2_654_435_761) >> 27) as u8 % 26)).collect();
    docker::plant_labeled(&[&base], &labels, &content);
    let ctx = tempfile::tempdir().unwrap();
    std::fs::write(ctx.path().join("Dockerfile"), format!("FROM {base}\nLABEL kiln.dev/derived=yes\n")).unwrap();
    let out = Command::new("docker")
        .env("DOCKER_BUILDKIT", "0")
        .args(["build", "-q", "--no-cache", "-t", &derived])
        .arg(ctx.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let events = gc(&farm.url, false, Some(&instance)).await;
    assert!(succeeded(&events), "{events:#?}");
    let swept = events.iter().find(|e| e.kind() == Kind::Swept).expect("a total");
    assert_eq!(swept.count, 2, "{events:#?}");
    // Docker lists each image at ~200 kB; the disk got the shared layer back once.
    assert!((200_000..260_000).contains(&swept.bytes), "swept {} bytes: {events:#?}", swept.bytes);
    assert!(docker::image_id(&base).is_none() && docker::image_id(&derived).is_none());
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_crash_left_behind_is_removed_at_the_next_start() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("home");
    let mut farm = Farm::start(&home).await;
    let half_upload = home.join("state/contexts").join(format!(".upload-{}-0badf00d", "ab".repeat(32)));
    std::fs::write(&half_upload, vec![7u8; 4096]).unwrap();
    let archive = home.join("scratch").join(format!("{}-0badf00d.tar", "cd".repeat(32)));
    std::fs::write(&archive, vec![7u8; 4096]).unwrap();
    let unrelated = home.join("scratch").join("notes.txt");
    std::fs::write(&unrelated, "mine").unwrap();

    farm.crash_coordinator();
    farm.restart_coordinator().await;
    assert!(!half_upload.exists(), "the coordinator removed the upload a crash cut short");
    farm.stop().await;
    let mut farm = Farm::start(&home).await;
    assert!(!archive.exists(), "the agent removed the context archive a crash left");
    assert!(unrelated.exists(), "and nothing it did not write");
    farm.stop().await;
}
