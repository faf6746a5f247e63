//! An image built FROM a `shared` base of the same manifest, against the real Docker daemon: the
//! child is built on the base's content ref, carries the base's layers and files, and its tag moves
//! when only the base's context does.
//!
//! The base is first in the manifest, and the request lists bases first anyway (build order, as
//! the CLI sends it): the engine builds in request order today. Once it waits on
//! `BuildInputs.from` (issue 9, the scheduler), this test must pass unchanged.

use kiln_e2e::fixture::{reference, remove_built, unique, write};
use kiln_e2e::wire::{images_with, up, up_request};
use kiln_e2e::{docker, Farm};
use kiln_proto::v1::converge_event::Kind;
use kiln_proto::v1::input_change::Input;

fn succeeded(events: &[kiln_proto::v1::ConvergeEvent]) -> bool {
    events.last().is_some_and(|e| e.kind() == Kind::Finished && e.outcome() == kiln_proto::v1::Outcome::Succeeded)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_builds_on_its_shared_base_and_its_tag_moves_with_the_base() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("shop");
    let manifest = format!(
        "instance = \"{}\"\n[target]\nkind = \"local\"\n\n\
         [built.base]\ncontext = \"base\"\nshared = true\n\n\
         [built.app]\ncontext = \"app\"\n",
        unique("bases")
    );
    write(&dir, "kiln.toml", &manifest);
    write(&dir, "base/Dockerfile", &format!("FROM {}\nCOPY motd /etc/motd\n", docker::busybox_base()));
    write(&dir, "base/motd", "from the base, first\n");
    write(
        &dir,
        "app/Dockerfile",
        "# on the shared base, by its manifest name\nFROM base AS app\nCOPY app.txt /app.txt\n",
    );
    write(&dir, "app/app.txt", "the app\n");
    let (request, _) = up_request(&dir, false);
    assert_eq!(request.images.iter().map(|i| i.from.clone()).collect::<Vec<_>>(), [vec![], vec!["base".to_string()]]);
    let mut farm = Farm::start(&tmp.path().join("home")).await;

    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Built), vec!["base", "app"]);
    let (base, app) = (reference(&dir, "base"), reference(&dir, "app"));
    assert_eq!(docker::label(&base, "kiln.dev/kind").as_deref(), Some("shared"));
    assert_eq!(docker::label(&app, "kiln.dev/kind").as_deref(), Some("image"));
    // Built on the base itself: its layers first, then the child's own; its files, and the child's.
    let (base_layers, app_layers) = (docker::layers(&base), docker::layers(&app));
    assert_eq!(app_layers.len(), base_layers.len() + 1, "{app_layers:?}");
    assert!(app_layers.starts_with(&base_layers), "{base_layers:?} under {app_layers:?}");
    assert_eq!(docker::run(&app, &["cat", "/etc/motd", "/app.txt"]), "from the base, first\nthe app");

    // Nothing changed: nothing is built.
    let events = up(&farm.url, &dir, false).await;
    assert_eq!(images_with(&events, Kind::Recorded), vec!["base", "app"], "{events:#?}");
    assert_eq!(farm.builds(), 2);

    // Only the base's context changes: the base's tag moves, and with it the child's, whose new
    // image is built on the new base.
    write(&dir, "base/motd", "from the base, second\n");
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Built), vec!["base", "app"], "{events:#?}");
    // The child's own files did not move; the Dockerfile it is built from did (its FROM).
    let moved = |name: &str| -> Vec<Input> {
        let building = events.iter().find(|e| e.kind() == Kind::Building && e.image == name).unwrap();
        building.reason.as_ref().unwrap().changes.iter().map(|c| c.input()).collect()
    };
    assert_eq!(moved("base"), [Input::Context]);
    assert_eq!(moved("app"), [Input::Dockerfile]);
    let (new_base, new_app) = (reference(&dir, "base"), reference(&dir, "app"));
    assert_ne!(new_base, base);
    assert_ne!(new_app, app, "the child's tag follows its base's");
    assert!(docker::layers(&new_app).starts_with(&docker::layers(&new_base)));
    assert_eq!(docker::run(&new_app, &["cat", "/etc/motd"]), "from the base, second");
    assert_eq!(farm.builds(), 4);

    farm.stop().await;
    [base, app].iter().for_each(|r| docker::remove(r));
    remove_built(&dir);
}
